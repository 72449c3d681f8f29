//! A job's latency broken down by stage: the client's clock at publish, notification and read,
//! against the timestamps of its result (`timings`) and the time its code ran
//! (`usage.wall_ms`). Client and database share the machine's clock.
//!
//! The stages follow each other, so they add up to the round trip:
//! 1. publish → recorded (`queued_at`): the broker, and the scheduler receiving the submission;
//! 2. recorded → claimed (`started_at`): the record's commit, the publish to the workers'
//!    queue, the delivery and the worker's claim;
//! 3. claimed → committed (`finished_at`) outside the code: getting a kernel, handing it the
//!    job, reading its events, storing files;
//! 4. the code in the sandbox (`usage.wall_ms`);
//! 5. committed → notified: the commit transaction and Postgres' `NOTIFY`;
//! 6. notified → read: the client reading the result row (nothing to read when the
//!    notification carried the result, as it does when the record fits one).
//!
//! `timings.dispatched_at` (the broker confirmed the dispatch) is reported beside them, not
//! among them: the worker may claim the job before the scheduler has noted the confirm.
//! Postgres' `now()` is its transaction's start, so each database timestamp is when that step
//! began.

use chrono::{DateTime, Utc};
use sandcell_protocol::JobResult;
use serde::Serialize;

/// The client's clock around one job.
pub struct Trip {
    pub published: DateTime<Utc>,
    pub notified: DateTime<Utc>,
    pub read: DateTime<Utc>,
}

/// Names of the stages, in order, as the report prints them.
pub const NAMES: [&str; 6] = [
    "publish → recorded (broker, scheduler receipt)",
    "recorded → claimed (record commit, dispatch, worker delivery, claim)",
    "worker, outside the code (kernel, hand-over, events, files)",
    "code in the sandbox",
    "committed → notified (commit, NOTIFY)",
    "notified → result read",
];

/// One job's stages in ms (see [`NAMES`]), and when its dispatch was confirmed after it was
/// recorded.
#[derive(Debug, Clone, Copy)]
pub struct Stages {
    pub ms: [f64; 6],
    pub dispatch_confirmed_ms: Option<f64>,
}

fn ms(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    (to - from).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

impl Stages {
    /// The stages of `r`, or `None` when it lacks a timestamp or its usage (it did not run).
    pub fn of(trip: &Trip, r: &JobResult) -> Option<Stages> {
        let t = &r.timings;
        let (started, finished) = (t.started_at?, t.finished_at?);
        let code = r.execution.usage.as_ref()?.wall_ms;
        let worker = ms(started, finished);
        Some(Stages {
            ms: [
                ms(trip.published, t.queued_at),
                ms(t.queued_at, started),
                (worker - code).max(0.0),
                code.min(worker),
                ms(finished, trip.notified),
                ms(trip.notified, trip.read),
            ],
            dispatch_confirmed_ms: t.dispatched_at.map(|d| ms(t.queued_at, d)),
        })
    }
}

/// Median and mean of each stage over many jobs.
#[derive(Debug, Serialize, Clone)]
pub struct Breakdown {
    pub n: usize,
    pub stages: Vec<StageSummary>,
    /// Recorded → the broker confirmed the dispatch (median, ms).
    pub dispatch_confirmed_p50_ms: Option<f64>,
}

/// One stage over many jobs.
#[derive(Debug, Serialize, Clone)]
pub struct StageSummary {
    pub stage: &'static str,
    pub p50_ms: f64,
    pub mean_ms: f64,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied()
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Summarise the stages of many jobs.
pub fn breakdown(all: &[Stages]) -> Breakdown {
    let stages = NAMES
        .iter()
        .enumerate()
        .map(|(i, stage)| {
            let v: Vec<f64> = all.iter().map(|s| s.ms[i]).collect();
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            StageSummary { stage, p50_ms: round(median(v).unwrap_or(f64::NAN)), mean_ms: round(mean) }
        })
        .collect();
    Breakdown { n: all.len(), stages, dispatch_confirmed_p50_ms: median(all.iter().filter_map(|s| s.dispatch_confirmed_ms).collect()).map(round) }
}

/// What jobs' code used, from their results' `usage`.
#[derive(Debug, Serialize, Clone)]
pub struct Cost {
    pub n: usize,
    pub cpu_ms_p50: Option<f64>,
    pub cpu_ms_mean: Option<f64>,
    pub peak_memory_mib_p50: Option<f64>,
}

/// Summarise the usage of `results`.
pub fn cost(results: &[JobResult]) -> Cost {
    let usages: Vec<_> = results.iter().filter_map(|r| r.execution.usage.as_ref()).collect();
    let cpu: Vec<f64> = usages.iter().filter_map(|u| u.cpu_ms).collect();
    let mem: Vec<f64> = usages.iter().filter_map(|u| u.peak_memory_bytes).map(|b| b as f64 / 1048576.0).collect();
    let cpu_mean = (!cpu.is_empty()).then(|| round(cpu.iter().sum::<f64>() / cpu.len() as f64));
    Cost { n: usages.len(), cpu_ms_p50: median(cpu).map(round), cpu_ms_mean: cpu_mean, peak_memory_mib_p50: median(mem).map(round) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_add_up_to_the_round_trip() {
        let t0: DateTime<Utc> = "2026-11-22T12:00:00Z".parse().unwrap();
        let at = |ms: i64| t0 + chrono::Duration::milliseconds(ms);
        let mut r: JobResult = serde_json::from_value(serde_json::json!({
            "job_id": "j", "tenant": "t", "status": "succeeded", "language": "python", "reason": null,
            "artifacts": [], "limits": null, "worker_id": null, "attempts": 1, "session": null,
            "timings": {"queued_at": at(2), "dispatched_at": at(6), "started_at": at(5), "finished_at": at(15)},
            "stdout": "", "stderr": "", "stdout_truncated": false, "stderr_truncated": false, "exit_code": 0,
            "error": null, "outputs": [], "kernel_restarted": false, "files": null, "limits_hit": [],
            "skipped_files": [], "processes_killed": 0, "usage": {"wall_ms": 7.0, "cpu_ms": 1.0, "peak_memory_bytes": 1}
        }))
        .unwrap();
        let trip = Trip { published: t0, notified: at(17), read: at(18) };
        let s = Stages::of(&trip, &r).unwrap();
        assert_eq!(s.ms, [2.0, 3.0, 3.0, 7.0, 2.0, 1.0]);
        assert_eq!(s.ms.iter().sum::<f64>(), 18.0);
        assert_eq!(s.dispatch_confirmed_ms, Some(4.0));
        r.execution.usage = None;
        assert!(Stages::of(&trip, &r).is_none(), "a job that did not run has no stages");
    }
}
