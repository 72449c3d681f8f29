//! The fleet figures (`sandcell-bench --fleet N`, run by `deploy/local/bench.sh` with 1, 2 and 3
//! workers in turn, against 2 schedulers): what a fleet of `N` workers on this box gives an agent.
//! - a burst of new sessions at once: publish → first result of each, and how they spread;
//! - in-session throughput: sessions fed concurrently, jobs/s;
//! - in-session `1+1` round trip, sequential;
//! - with 2 workers or more, a drain: sessions are opened until one worker holds
//!   [`DRAIN_SESSIONS`], each with a DataFrame and a file; that worker gets SIGTERM (its launcher's
//!   pid in `$SANDCELL_RUN_DIR`); measured: SIGTERM → the process gone (the drain, the sessions'
//!   snapshots included), and each moved session's next job, published at once right after, from
//!   publish to result (it waits for a worker to take the session over and put its workspace and
//!   variables back). The worker is started again after.
//!
//! Each run adds its entry to `docs/benchmarks/fleet.json` (keyed by the number of workers) and
//! rewrites `fleet.md` from every entry there, so the three runs of one bench.sh make one table.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use sandcell_protocol::{JobStatus, SessionRequest};
use serde::{Deserialize, Serialize};

use crate::{summarize, Bench, Summary};

/// What one fleet size measured.
#[derive(Debug, Serialize, Deserialize, Clone)]
pub struct FleetRun {
    measured_at: String,
    git_commit: String,
    machine: String,
    workers: usize,
    schedulers: usize,
    new_session_burst: usize,
    new_session_burst_first_result: SummaryDoc,
    new_sessions_by_worker: BTreeMap<String, usize>,
    throughput_sessions: usize,
    throughput_jobs: usize,
    throughput_jobs_per_s: f64,
    in_session_round_trip: SummaryDoc,
    /// Sessions on the drained worker, SIGTERM → exit (s), and the moved sessions' first jobs.
    #[serde(default)]
    drain: Option<DrainDoc>,
}

/// What one drain measured.
#[derive(Debug, Serialize, Deserialize, Clone)]
struct DrainDoc {
    sessions: usize,
    drain_s: f64,
    moved_first_job: SummaryDoc,
}

/// Sessions the drained worker holds.
pub const DRAIN_SESSIONS: usize = 10;

/// A [`Summary`] as stored (read back when the next run merges its entry).
#[derive(Debug, Serialize, Deserialize, Clone)]
struct SummaryDoc {
    n: usize,
    p50_ms: f64,
    p99_ms: f64,
}

impl From<Summary> for SummaryDoc {
    fn from(s: Summary) -> Self {
        SummaryDoc { n: s.n, p50_ms: s.p50_ms, p99_ms: s.p99_ms }
    }
}

/// Sizes of the fleet run.
pub struct FleetArgs {
    /// Workers running now.
    pub workers: usize,
    /// Schedulers running now.
    pub schedulers: usize,
    /// New sessions published at once.
    pub burst: usize,
    /// Sessions fed concurrently for throughput, and jobs each.
    pub sessions: usize,
    /// Jobs per session in the throughput run.
    pub jobs_per_session: usize,
    /// Sequential in-session jobs.
    pub sequential: usize,
}

/// Measure the running fleet and merge the entry into `out/fleet.json` and `out/fleet.md`.
pub async fn run(b: &Bench, a: &FleetArgs, out: &Path) -> Result<()> {
    // A burst of new sessions at once.
    let openings: Vec<_> = (0..a.burst).map(|_| b.job("x = 1", Some(SessionRequest { new: true, ..Default::default() }))).collect();
    let (_, first_results) = b.burst(&openings).await?;
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    let mut opened = Vec::new();
    for sub in &openings {
        let r = b.client.result(&sub.tenant, &sub.job_id).await?.context("opening result missing")?;
        let session = r.session.context("no session in an opening result")?;
        *by_worker.entry(session.worker_id.unwrap_or_default()).or_default() += 1;
        opened.push(session.id);
    }
    let burst = summarize(&first_results);
    println!("fleet of {} workers: burst of {} new sessions, first result {burst:?}, by worker {by_worker:?}", a.workers, a.burst);
    for id in &opened {
        b.close(id).await?;
    }

    // Throughput: sessions fed back to back, concurrently.
    let mut sessions = Vec::new();
    for _ in 0..a.sessions {
        sessions.push(b.open("n = 0", None).await?.1);
    }
    let t0 = Instant::now();
    let feeds = sessions.iter().map(|id| async move {
        let mut waits = Vec::new();
        for _ in 0..a.jobs_per_session {
            let sub = b.in_session(id, "n += 1");
            waits.push(b.watcher.watch(&sub.tenant, &sub.job_id));
            b.client.submit(&sub).await?;
        }
        for w in waits {
            let status = tokio::time::timeout(Duration::from_secs(300), w).await.context("throughput job timed out")??.status;
            anyhow::ensure!(status == JobStatus::Succeeded, "a throughput job ended {status}");
        }
        anyhow::Ok(())
    });
    futures::stream::iter(feeds).buffer_unordered(a.sessions).collect::<Vec<_>>().await.into_iter().collect::<Result<Vec<_>>>()?;
    let per_s = crate::round((a.sessions * a.jobs_per_session) as f64 / t0.elapsed().as_secs_f64());
    println!("fleet of {} workers: {} sessions x {} jobs: {per_s} jobs/s", a.workers, a.sessions, a.jobs_per_session);

    // Sequential in-session round trips (one session: one worker's path, with the fleet around).
    let sid = sessions.first().context("no session")?.clone();
    let mut trips = Vec::with_capacity(a.sequential);
    for _ in 0..a.sequential {
        let (d, r) = b.run(&b.in_session(&sid, "1+1")).await?;
        anyhow::ensure!(r.status == JobStatus::Succeeded, "in-session job failed: {r:?}");
        trips.push(d);
    }
    let trip = summarize(&trips);
    println!("fleet of {} workers: in-session 1+1 {trip:?}", a.workers);
    for id in &sessions {
        b.close(id).await?;
    }

    let drain = if a.workers >= 2 { Some(drain(b, a.workers).await?) } else { None };

    let entry = FleetRun {
        measured_at: chrono::Utc::now().to_rfc3339(),
        git_commit: std::env::var("SANDCELL_GIT_COMMIT").unwrap_or_else(|_| "unknown".into()),
        machine: std::env::var("SANDCELL_MACHINE").unwrap_or_else(|_| "unknown".into()),
        workers: a.workers,
        schedulers: a.schedulers,
        new_session_burst: a.burst,
        new_session_burst_first_result: burst.into(),
        new_sessions_by_worker: by_worker,
        throughput_sessions: a.sessions,
        throughput_jobs: a.sessions * a.jobs_per_session,
        throughput_jobs_per_s: per_s,
        in_session_round_trip: trip.into(),
        drain,
    };
    std::fs::create_dir_all(out)?;
    let path = out.join("fleet.json");
    let mut runs: BTreeMap<usize, FleetRun> = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    runs.insert(a.workers, entry);
    std::fs::write(&path, serde_json::to_string_pretty(&runs)? + "\n")?;
    std::fs::write(out.join("fleet.md"), markdown(&runs))?;
    println!("wrote {}/fleet.json, fleet.md", out.display());
    Ok(())
}

/// Open sessions until one worker holds [`DRAIN_SESSIONS`], drain it, and time the drain and the
/// moved sessions' first jobs.
async fn drain(b: &Bench, workers: usize) -> Result<DrainDoc> {
    let code = "import pandas as pd\ndf = pd.DataFrame({'v': range(1000)})\nopen('data.txt', 'w').write('x' * 100000)";
    let mut by_worker: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut all = Vec::new();
    let victim = loop {
        anyhow::ensure!(all.len() < DRAIN_SESSIONS * workers * 2, "no worker reached {DRAIN_SESSIONS} sessions: {by_worker:?}");
        let sub = b.job(code, Some(SessionRequest { new: true, ..Default::default() }));
        let (_, r) = b.run(&sub).await?;
        anyhow::ensure!(r.status == JobStatus::Succeeded, "opening a session failed: {r:?}");
        let session = r.session.context("no session in an opening result")?;
        let worker = session.worker_id.unwrap_or_default();
        all.push(session.id.clone());
        let held = by_worker.entry(worker.clone()).or_default();
        held.push(session.id);
        if held.len() == DRAIN_SESSIONS {
            break worker;
        }
    };
    let sessions = by_worker.remove(&victim).unwrap_or_default();
    let (name, pid) = instance_of(&victim)?;
    let t0 = Instant::now();
    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().context("kill -TERM")?;
    anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(120), "{victim} did not stop within 120 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_s = crate::round(t0.elapsed().as_secs_f64());
    let next: Vec<_> = sessions.iter().map(|id| b.in_session(id, "int(df.v.sum()) + len(open('data.txt').read())")).collect();
    let (_, latencies) = b.burst(&next).await?;
    for sub in &next {
        let r = b.client.result(&sub.tenant, &sub.job_id).await?.context("moved session's result missing")?;
        anyhow::ensure!(r.execution.moved.as_ref().is_some_and(|m| m.variables_restored), "a moved session's first job did not get its variables back: {r:?}");
    }
    let moved = summarize(&latencies);
    println!("fleet of {workers} workers: drained {victim} holding {} sessions in {drain_s} s; moved sessions' first job {moved:?}", sessions.len());
    restart(&name)?;
    for id in &all {
        b.close(id).await?;
    }
    Ok(DrainDoc { sessions: sessions.len(), drain_s, moved_first_job: moved.into() })
}

/// The launcher name (`worker`, `worker-2`, …) and pid of the local instance with `worker_id`:
/// instance 1 takes its id from the environment, the others export theirs in their launcher.
fn instance_of(worker_id: &str) -> Result<(String, String)> {
    let dir = std::env::var("SANDCELL_RUN_DIR").unwrap_or_else(|_| "/var/lib/sandcell/run".into());
    let mut first = None;
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".cmd")).filter(|n| n.starts_with("worker")) else {
            continue;
        };
        let text = std::fs::read_to_string(&path)?;
        let pid = || std::fs::read_to_string(format!("{dir}/{name}.pid")).map(|p| p.trim().to_string());
        if text.contains(&format!("SANDCELL_WORKER_ID={worker_id}\n")) {
            return Ok((name.to_string(), pid()?));
        }
        if !text.contains("SANDCELL_WORKER_ID=") {
            first = Some((name.to_string(), pid()?));
        }
    }
    first.with_context(|| format!("no launcher in {dir} for worker {worker_id}"))
}

/// Start instance `name` again with its launcher (its pid file follows, for `stop_sandcell`).
fn restart(name: &str) -> Result<()> {
    let dir = std::env::var("SANDCELL_RUN_DIR").unwrap_or_else(|_| "/var/lib/sandcell/run".into());
    let cmd = format!("nohup bash {dir}/{name}.cmd >/dev/null 2>&1 & echo $! > {dir}/{name}.pid");
    let status = std::process::Command::new("bash").arg("-c").arg(cmd).status().context("restarting a worker")?;
    anyhow::ensure!(status.success(), "restarting {name} failed");
    Ok(())
}

fn markdown(runs: &BTreeMap<usize, FleetRun>) -> String {
    let mut md = String::from(
        "# Fleet benchmark\n\nWritten by `deploy/local/bench.sh` (`sandcell-bench --fleet N`): the same box runs 2 schedulers \
         and N workers (release builds, runc); each row is one run, measured back to back with the others. All share the box's \
         cores, so more workers add sessions' room and availability, not CPU.\n\n\
         | workers | schedulers | burst of new sessions: first result p50 / p99 (ms) | sessions by worker | in-session throughput (jobs/s) | in-session `1+1` p50 / p99 (ms) | drain: sessions, SIGTERM → exit (s) | moved session's first job p50 / p99 (ms) | commit | measured |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs.values() {
        let spread: Vec<String> = r.new_sessions_by_worker.values().map(|n| n.to_string()).collect();
        let (drained, moved) = match &r.drain {
            Some(d) => (format!("{}, {}", d.sessions, d.drain_s), format!("{} / {}", d.moved_first_job.p50_ms, d.moved_first_job.p99_ms)),
            None => ("—".to_string(), "—".to_string()),
        };
        md += &format!(
            "| {} | {} | {} sessions: {} / {} | {} | {} ({} sessions × {} jobs) | {} / {} | {} | {} | {} | {} |\n",
            r.workers,
            r.schedulers,
            r.new_session_burst,
            r.new_session_burst_first_result.p50_ms,
            r.new_session_burst_first_result.p99_ms,
            spread.join(" / "),
            r.throughput_jobs_per_s,
            r.throughput_sessions,
            r.throughput_jobs / r.throughput_sessions.max(1),
            r.in_session_round_trip.p50_ms,
            r.in_session_round_trip.p99_ms,
            drained,
            moved,
            r.git_commit,
            r.measured_at.get(..16).unwrap_or(&r.measured_at),
        );
    }
    if let Some(r) = runs.values().next() {
        md += &format!("\nMachine: {}.\n", r.machine);
    }
    md
}
