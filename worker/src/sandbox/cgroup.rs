//! A container's cgroup counters, read from the host: what a cell cost, and whether it hit
//! the process limit.
//!
//! - **Process limit.** The code inside a sandbox only sees a failed `fork`; the kernel counts
//!   those refusals in the container's `pids.events` (`max N`). Reading it before and after a
//!   cell is how a result reports `limits_hit: ["pids"]`.
//! - **Cost.** CPU time is the difference of the container's cumulative CPU counter
//!   (`cpuacct.usage` in cgroup v1, `cpu.stat`'s `usage_usec` in v2) across the cell. Peak
//!   memory is the container's high-water mark, reset when the cell starts: v1's
//!   `memory.max_usage_in_bytes` resets when 0 is written to it; v2's `memory.peak` resets for
//!   the file descriptor that wrote to it (Linux 6.12+), so the [`Cgroup`] keeps that one open
//!   for the container's life. A peak that could not be reset is not reported: a lifetime
//!   high-water mark is not this cell's.
//!
//! - **CPU weight.** A warm-pool kernel starts in the background, and so does a one-off
//!   sandbox whose job took another meanwhile: [`CpuWeight::lower`] puts its container in the
//!   idle scheduling class (`cpu.idle`, Linux 5.15+), whose tasks run only on CPU no other task
//!   wants, and gives it a small share of contended CPU (cgroup v2 `cpu.weight`, v1
//!   `cpu.shares`; all that is left where there is no idle class) while it imports its
//!   libraries, so the starts after a burst's takes do not slow the burst's jobs;
//!   [`CpuWeight::restore`] gives back the class and weight it had when it is handed out. On
//!   an idle machine the start runs at full speed.
//!
//! All of it needs the host's cgroup filesystem at `SANDCELL_CGROUP_ROOT` (default
//! `/sys/fs/cgroup`), writable for the peak's reset — true for a worker running on the host
//! as root, or in a pod with `/sys/fs/cgroup` mounted. Where a file cannot be found, that
//! figure goes unreported (`null`); nothing else depends on it. The files are tiny kernel
//! counters, read synchronously, each through a descriptor opened once for the container's
//! life and read from its start (a path lookup, an open and a close cost ~9 us a file here,
//! a read from an open descriptor ~1 us; a cell reads five).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A container's CPU weight, lowered while it starts in the background.
#[derive(Debug)]
pub struct CpuWeight {
    file: PathBuf,
    /// What the file said before it was lowered, written back by [`CpuWeight::restore`].
    before: String,
    /// The cgroup's `cpu.idle`, set to 1, where the kernel has it (Linux 5.15+, cgroup v1 and
    /// v2): its tasks then run only on CPU no other task wants.
    idle: Option<PathBuf>,
}

/// The weight of a background start, out of the default 100 (cgroup v2; v1's shares are scaled
/// from it, 1024 for 100).
pub const BACKGROUND_CPU_WEIGHT: u32 = 10;

impl CpuWeight {
    /// Lower the CPU weight of `container_id`'s cgroup to [`BACKGROUND_CPU_WEIGHT`]. `None` when
    /// its cgroup was not found or is not writable: the container then keeps its weight.
    pub fn lower(root: &Path, container_id: &str) -> Option<CpuWeight> {
        let candidates = [
            (root.join("docker").join(container_id).join("cpu.weight"), BACKGROUND_CPU_WEIGHT),
            (root.join("system.slice").join(format!("docker-{container_id}.scope")).join("cpu.weight"), BACKGROUND_CPU_WEIGHT),
            (root.join("cpu").join("docker").join(container_id).join("cpu.shares"), BACKGROUND_CPU_WEIGHT * 1024 / 100),
        ];
        let (file, value) = candidates.into_iter().find(|(f, _)| f.is_file())?;
        let before = std::fs::read_to_string(&file).ok()?.trim().to_string();
        if let Err(e) = std::fs::write(&file, value.to_string()) {
            tracing::debug!(container_id, file = %file.display(), error = %e, "cannot lower a background start's CPU weight");
            return None;
        }
        // After the weight: a cgroup in the idle class refuses a new one.
        let idle = file.with_file_name("cpu.idle");
        let idle = match std::fs::write(&idle, "1") {
            Ok(()) => Some(idle),
            Err(e) => {
                tracing::debug!(container_id, file = %idle.display(), error = %e, "no idle class for a background start; its weight alone is lowered");
                None
            }
        };
        Some(CpuWeight { file, before, idle })
    }

    /// Give the container back the class and weight it had before [`CpuWeight::lower`].
    pub fn restore(self) {
        if let Some(idle) = &self.idle {
            if let Err(e) = std::fs::write(idle, "0") {
                tracing::warn!(file = %idle.display(), error = %e, "cannot take a warm kernel out of the idle class");
            }
        }
        if let Err(e) = std::fs::write(&self.file, &self.before) {
            tracing::warn!(file = %self.file.display(), error = %e, "cannot restore a warm kernel's CPU weight");
        }
    }
}

/// Where a container's counters live.
#[derive(Debug, Default)]
pub struct Cgroup {
    pids_events: Option<File>,
    cpu: Option<CpuCounter>,
    peak: Option<PeakMemory>,
}

/// The container's cumulative CPU time.
#[derive(Debug)]
enum CpuCounter {
    /// cgroup v1 `cpuacct.usage`: nanoseconds.
    V1(File),
    /// cgroup v2 `cpu.stat`: `usage_usec`.
    V2(File),
}

/// The container's memory high-water mark.
#[derive(Debug)]
enum PeakMemory {
    /// cgroup v1 `memory.max_usage_in_bytes`: reset by writing 0 to its path, read through
    /// its descriptor.
    V1(PathBuf, File),
    /// cgroup v2 `memory.peak`, open: its reset holds for this descriptor only.
    V2(File),
}

/// The counters when a cell started.
#[derive(Debug)]
pub struct Meter {
    started: Instant,
    cpu_ns: Option<u64>,
    peak_reset: bool,
    pids_refusals: Option<u64>,
}

/// The counters when a cell ended, against its [`Meter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// Wall time since the meter started.
    pub wall_ms: f64,
    /// CPU time the container used since.
    pub cpu_ms: Option<f64>,
    /// The container's highest memory use since.
    pub peak_memory_bytes: Option<u64>,
    /// Process-limit refusals since (only known when counted at both ends).
    pub pids_refused: Option<u64>,
}

impl Cgroup {
    /// Find the cgroup of `container_id` under `root`: cgroup v1 with the cgroupfs driver
    /// (`<controller>/docker/<id>`), cgroup v2 with cgroupfs (`docker/<id>`) or systemd
    /// (`system.slice/docker-<id>.scope`).
    pub fn locate(root: &Path, container_id: &str) -> Cgroup {
        let v2_dirs = [root.join("docker").join(container_id), root.join("system.slice").join(format!("docker-{container_id}.scope"))];
        let v1 = |controller: &str, file: &str| Some(root.join(controller).join("docker").join(container_id).join(file)).filter(|p| p.is_file());
        let v2 = |file: &str| v2_dirs.iter().map(|d| d.join(file)).find(|p| p.is_file());
        let open = |p: PathBuf| File::open(p).ok();

        let pids_events = v1("pids", "pids.events").or_else(|| v2("pids.events")).and_then(open);
        let cpu = v1("cpuacct", "cpuacct.usage").and_then(open).map(CpuCounter::V1).or_else(|| v2("cpu.stat").and_then(open).map(CpuCounter::V2));
        let peak = v1("memory", "memory.max_usage_in_bytes")
            .and_then(|p| File::open(&p).ok().map(|f| PeakMemory::V1(p, f)))
            .or_else(|| v2("memory.peak").and_then(|p| File::options().read(true).write(true).open(p).ok()).map(PeakMemory::V2));
        if pids_events.is_none() || cpu.is_none() || peak.is_none() {
            tracing::debug!(
                container_id,
                root = %root.display(),
                pids = pids_events.is_some(),
                cpu = cpu.is_some(),
                memory = peak.is_some(),
                "some cgroup counters of the container were not found; those figures will not be reported"
            );
        }
        Cgroup { pids_events, cpu, peak }
    }

    /// Start measuring a cell: reset the memory high-water mark, read the counters.
    pub fn start(&mut self) -> Meter {
        let peak_reset = match &mut self.peak {
            Some(PeakMemory::V1(path, _)) => std::fs::write(path, "0").is_ok(),
            Some(PeakMemory::V2(file)) => file.write_all_at(b"reset\n", 0).is_ok(),
            None => false,
        };
        Meter { started: Instant::now(), cpu_ns: self.cpu_ns(), peak_reset, pids_refusals: self.pids_refusals() }
    }

    /// Read the counters against `meter`. Call it before the container is killed: a killed
    /// container's cgroup disappears.
    pub fn read(&mut self, meter: &Meter) -> Reading {
        let cpu_ms = match (meter.cpu_ns, self.cpu_ns()) {
            (Some(before), Some(after)) => Some(after.saturating_sub(before) as f64 / 1e6),
            _ => None,
        };
        let peak_memory_bytes = if meter.peak_reset { self.peak_bytes() } else { None };
        let pids_refused = match (meter.pids_refusals, self.pids_refusals()) {
            (Some(before), Some(after)) => Some(after.saturating_sub(before)),
            _ => None,
        };
        Reading { wall_ms: meter.started.elapsed().as_secs_f64() * 1e3, cpu_ms, peak_memory_bytes, pids_refused }
    }

    fn pids_refusals(&self) -> Option<u64> {
        parse_pids_events(read_from_start(self.pids_events.as_ref()?, &mut [0; COUNTER_BYTES])?)
    }

    fn cpu_ns(&self) -> Option<u64> {
        let buf = &mut [0; COUNTER_BYTES];
        match self.cpu.as_ref()? {
            CpuCounter::V1(file) => read_from_start(file, buf)?.trim().parse().ok(),
            CpuCounter::V2(file) => parse_cpu_stat_usec(read_from_start(file, buf)?).map(|us| us.saturating_mul(1000)),
        }
    }

    fn peak_bytes(&mut self) -> Option<u64> {
        let file = match self.peak.as_ref()? {
            PeakMemory::V1(_, file) | PeakMemory::V2(file) => file,
        };
        read_from_start(file, &mut [0; COUNTER_BYTES])?.trim().parse().ok()
    }
}

/// Room for a counter file's text: the longest, v2's `cpu.stat`, is a few hundred bytes.
const COUNTER_BYTES: usize = 4096;

/// A counter file's text as the kernel makes it now: read from its start through `file`, into
/// `buf`. `None` if it cannot be read (the cgroup is gone) or fills `buf` (it may go on: a
/// read that fills the buffer cannot tell that the file ended).
fn read_from_start<'b>(file: &File, buf: &'b mut [u8]) -> Option<&'b str> {
    let mut len = 0;
    loop {
        match file.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(_) => return None,
        }
        if len == buf.len() {
            return None;
        }
    }
    std::str::from_utf8(&buf[..len]).ok()
}

fn parse_pids_events(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("max ")).and_then(|n| n.trim().parse().ok())
}

fn parse_cpu_stat_usec(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_max_counter_is_read_from_pids_events() {
        assert_eq!(parse_pids_events("max 7\n"), Some(7));
        assert_eq!(parse_pids_events("max 0\n"), Some(0));
        assert_eq!(parse_pids_events(""), None);
        assert_eq!(parse_pids_events("max x\n"), None);
    }

    #[test]
    fn cpu_time_is_read_from_cpu_stat() {
        assert_eq!(parse_cpu_stat_usec("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n"), Some(1500));
        assert_eq!(parse_cpu_stat_usec("user_usec 1000\n"), None);
    }

    #[test]
    fn a_container_without_a_cgroup_reports_nothing() {
        let mut cg = Cgroup::locate(Path::new("/nonexistent"), "abc");
        let meter = cg.start();
        let r = cg.read(&meter);
        assert_eq!((r.cpu_ms, r.peak_memory_bytes, r.pids_refused), (None, None, None));
        assert!(r.wall_ms >= 0.0);
    }

    #[test]
    fn a_cell_is_measured_against_its_start_in_cgroup_v1() {
        let root = std::env::temp_dir().join(format!("sandcell-cgroup-test-{}", std::process::id()));
        let dir = |c: &str| root.join(c).join("docker").join("c1");
        for c in ["pids", "cpuacct", "memory"] {
            std::fs::create_dir_all(dir(c)).unwrap();
        }
        std::fs::write(dir("pids").join("pids.events"), "max 2\n").unwrap();
        std::fs::write(dir("cpuacct").join("cpuacct.usage"), "1000000000\n").unwrap();
        std::fs::write(dir("memory").join("memory.max_usage_in_bytes"), "999999\n").unwrap();
        let mut cg = Cgroup::locate(&root, "c1");
        let meter = cg.start();
        assert_eq!(std::fs::read_to_string(dir("memory").join("memory.max_usage_in_bytes")).unwrap(), "0", "the peak is reset at the start");
        std::fs::write(dir("pids").join("pids.events"), "max 5\n").unwrap();
        std::fs::write(dir("cpuacct").join("cpuacct.usage"), "1250000000\n").unwrap();
        std::fs::write(dir("memory").join("memory.max_usage_in_bytes"), "4096\n").unwrap();
        let r = cg.read(&meter);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!((r.cpu_ms, r.peak_memory_bytes, r.pids_refused), (Some(250.0), Some(4096), Some(3)));
    }

    #[test]
    fn a_cell_is_measured_against_its_start_in_cgroup_v2_through_descriptors_opened_once() {
        let root = std::env::temp_dir().join(format!("sandcell-cgroup-v2-test-{}", std::process::id()));
        let dir = root.join("docker").join("c2");
        std::fs::create_dir_all(&dir).unwrap();
        let cpu_stat = |usec: u64| format!("usage_usec {usec}\nuser_usec 1\nsystem_usec 2\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n");
        std::fs::write(dir.join("pids.events"), "max 0\n").unwrap();
        std::fs::write(dir.join("cpu.stat"), cpu_stat(2_000_000)).unwrap();
        std::fs::write(dir.join("memory.peak"), "999999\n").unwrap();
        let mut cg = Cgroup::locate(&root, "c2");
        let meter = cg.start();
        assert!(std::fs::read_to_string(dir.join("memory.peak")).unwrap().starts_with("reset\n"), "the peak is reset at the start, through its descriptor");
        // The files change in place, as the kernel's counters do; the descriptors see it.
        for (name, text) in [("pids.events", "max 1\n".to_string()), ("cpu.stat", cpu_stat(2_012_500)), ("memory.peak", "8192\n".to_string())] {
            std::fs::OpenOptions::new().write(true).open(dir.join(name)).unwrap().write_all_at(text.as_bytes(), 0).unwrap();
            std::fs::OpenOptions::new().write(true).open(dir.join(name)).unwrap().set_len(text.len() as u64).unwrap();
        }
        let r = cg.read(&meter);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!((r.cpu_ms, r.peak_memory_bytes, r.pids_refused), (Some(12.5), Some(8192), Some(1)));
    }

    #[test]
    fn a_counter_longer_than_its_buffer_is_not_read() {
        let path = std::env::temp_dir().join(format!("sandcell-cgroup-long-{}", std::process::id()));
        std::fs::write(&path, "x".repeat(101)).unwrap();
        let file = File::open(&path).unwrap();
        assert_eq!(read_from_start(&file, &mut [0; 100]), None, "longer than the buffer");
        assert_eq!(read_from_start(&file, &mut [0; 101]), None, "as long as the buffer: no read shows it ended");
        assert_eq!(read_from_start(&file, &mut [0; 102]).map(str::len), Some(101));
        std::fs::remove_file(&path).unwrap();
    }
}
