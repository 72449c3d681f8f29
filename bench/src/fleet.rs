//! The fleet figures (`sandcell-bench --fleet N`, run by `deploy/local/bench.sh` with 1, 2 and 3
//! workers in turn, against 2 schedulers): what a fleet of `N` workers on this box gives an agent.
//! - a burst of new sessions at once: publish → first result of each, and how they spread;
//! - in-session throughput: sessions fed concurrently, jobs/s;
//! - in-session `1+1` round trip, sequential.
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
}

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
            let status = tokio::time::timeout(Duration::from_secs(300), w).await.context("throughput job timed out")??;
            anyhow::ensure!(status == "succeeded", "a throughput job ended {status}");
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

fn markdown(runs: &BTreeMap<usize, FleetRun>) -> String {
    let mut md = String::from(
        "# Fleet benchmark\n\nWritten by `deploy/local/bench.sh` (`sandcell-bench --fleet N`): the same box runs 2 schedulers \
         and N workers (release builds, runc); each row is one run, measured back to back with the others. All share the box's \
         cores, so more workers add sessions' room and availability, not CPU.\n\n\
         | workers | schedulers | burst of new sessions: first result p50 / p99 (ms) | sessions by worker | in-session throughput (jobs/s) | in-session `1+1` p50 / p99 (ms) | commit | measured |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs.values() {
        let spread: Vec<String> = r.new_sessions_by_worker.values().map(|n| n.to_string()).collect();
        md += &format!(
            "| {} | {} | {} sessions: {} / {} | {} | {} ({} sessions × {} jobs) | {} / {} | {} | {} |\n",
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
            r.git_commit,
            r.measured_at.get(..16).unwrap_or(&r.measured_at),
        );
    }
    if let Some(r) = runs.values().next() {
        md += &format!("\nMachine: {}.\n", r.machine);
    }
    md
}
