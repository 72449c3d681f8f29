//! A container's cgroup counters, read from the host.
//!
//! The code inside a sandbox only sees a failed `fork` when it hits the process limit; the
//! kernel counts those refusals in the container's `pids.events` (`max N`). Reading that file
//! before and after a cell is how a result reports `limits_hit: ["pids"]`. It needs the host's
//! cgroup filesystem at `SANDCELL_CGROUP_ROOT` (default `/sys/fs/cgroup`) — true for a worker
//! running on the host or in a pod with `/sys/fs/cgroup` mounted. Where the file cannot be
//! found, pids-limit hits go unreported (the job's status and traceback still show the failed
//! fork); nothing else depends on it.

use std::path::{Path, PathBuf};

/// Where a container's pids counters live.
#[derive(Debug, Clone, Default)]
pub struct Cgroup {
    pids_events: Option<PathBuf>,
}

impl Cgroup {
    /// Find the cgroup of `container_id` under `root`: cgroup v1 with the cgroupfs driver
    /// (`pids/docker/<id>`), cgroup v2 with cgroupfs (`docker/<id>`) or systemd
    /// (`system.slice/docker-<id>.scope`).
    pub fn locate(root: &Path, container_id: &str) -> Cgroup {
        let candidates = [
            root.join("pids/docker").join(container_id),
            root.join("docker").join(container_id),
            root.join("system.slice").join(format!("docker-{container_id}.scope")),
        ];
        let pids_events = candidates.into_iter().map(|d| d.join("pids.events")).find(|p| p.is_file());
        if pids_events.is_none() {
            tracing::debug!(container_id, root = %root.display(), "no pids.events for the container; pids-limit hits will not be reported");
        }
        Cgroup { pids_events }
    }

    /// How many times the container's process limit refused a fork so far.
    pub fn pids_refusals(&self) -> Option<u64> {
        let text = std::fs::read_to_string(self.pids_events.as_ref()?).ok()?;
        parse_pids_events(&text)
    }
}

fn parse_pids_events(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("max ")).and_then(|n| n.trim().parse().ok())
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
    fn a_container_without_a_cgroup_reports_nothing() {
        let cg = Cgroup::locate(Path::new("/nonexistent"), "abc");
        assert_eq!(cg.pids_refusals(), None);
    }
}
