//! The artifact TTL sweeper: the real enforcement of `expires_at`.
//!
//! Each tick also looks for workers whose heartbeat stopped and sets their sessions moving,
//! expires moving sessions nobody used within their keep-alive,
//! ends jobs stuck in `queued` (and sessions in `starting`) past `SANDCELL_STUCK_AFTER_S`, and
//! refuses with `capacity` new sessions no worker took within `SANDCELL_SESSION_START_WAIT_S`.
//!
//! Each tick deletes the objects of artifacts whose expiry has passed and then marks them
//! `expired` (so a client sees `artifact_expired` and no URL). Deleting first and marking second
//! means a crash in between only repeats an idempotent delete.

use std::time::Duration;

use sandcell_core::jobs::{Gone, JobStore};
use sandcell_core::sessions::SessionStore;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::MoveCause;

use crate::metrics::Metrics;

const BATCH: i64 = 500;

/// How long things may wait before the sweeper ends them.
pub struct SweepLimits {
    /// A worker silent this long has lost its sessions.
    pub worker_dead_after: Duration,
    /// A job `queued` (a session `starting`) this long is stuck.
    pub stuck_after: Duration,
    /// A new session no worker took within this is refused with `capacity`.
    pub session_start_wait: Duration,
}

/// Sweep forever, every `interval`.
pub async fn run(jobs: JobStore, store: ArtifactStore, metrics: Metrics, interval: Duration, limits: SweepLimits) {
    let SweepLimits { worker_dead_after, stuck_after, session_start_wait } = limits;
    let sessions = SessionStore::new(jobs.pool().clone());
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = sweep_once(&jobs, &store, &metrics).await {
            tracing::warn!(error = format!("{e:#}"), "artifact sweep failed; retrying next tick");
        }
        if let Err(e) = sweep_silent_workers(&sessions, worker_dead_after).await {
            tracing::warn!(error = format!("{e:#}"), "worker liveness sweep failed; retrying next tick");
        }
        match jobs.end_jobs_of_gone_worker(Gone::Silent(worker_dead_after)).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.stuck_ended.with_label_values(&["job_of_dead_worker"]).inc_by(n);
                tracing::warn!(jobs = n, "jobs running on silent workers ended worker_lost");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "dead-worker job sweep failed; retrying next tick"),
        }
        match sessions.end_stuck(stuck_after).await {
            Ok((0, 0)) => {}
            Ok((jobs, sessions)) => {
                metrics.stuck_ended.with_label_values(&["job"]).inc_by(jobs);
                metrics.stuck_ended.with_label_values(&["session"]).inc_by(sessions);
                tracing::warn!(jobs, sessions, after_s = stuck_after.as_secs(), "ended jobs and sessions stuck in queued/starting");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "stuck sweep failed; retrying next tick"),
        }
        match sessions.refuse_unplaced(session_start_wait).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.stuck_ended.with_label_values(&["session_capacity"]).inc_by(n);
                tracing::warn!(sessions = n, wait_s = session_start_wait.as_secs(), "refused new sessions no worker had room for");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "new-session sweep failed; retrying next tick"),
        }
        match sessions.end_unadopted(session_start_wait, worker_dead_after).await {
            Ok((0, 0)) => {}
            Ok((expired, lost)) => {
                metrics.stuck_ended.with_label_values(&["moving_session"]).inc_by(lost);
                tracing::warn!(expired, lost, "ended moving sessions nobody used or no worker took over");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "moving-session sweep failed; retrying next tick"),
        }
        match sessions.park_strays().await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(jobs = n, "parked jobs recorded for a moved session's old worker"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "stray-job sweep failed; retrying next tick"),
        }
        match jobs.count_by_status().await {
            Ok(counts) => {
                metrics.jobs.reset();
                for (status, n) in counts {
                    metrics.jobs.with_label_values(&[status.as_str()]).set(n);
                }
            }
            Err(e) => tracing::debug!(error = format!("{e:#}"), "could not refresh job gauges"),
        }
    }
}

/// Delete and mark one batch of expired artifacts. Returns how many were marked.
pub async fn sweep_once(jobs: &JobStore, store: &ArtifactStore, metrics: &Metrics) -> anyhow::Result<u64> {
    let expired = jobs.expired_artifacts(BATCH).await?;
    if expired.is_empty() {
        return Ok(0);
    }
    let mut deleted = Vec::with_capacity(expired.len());
    for a in &expired {
        match store.delete(&a.s3_key).await {
            Ok(()) => deleted.push(a.id),
            Err(e) => tracing::warn!(key = %a.s3_key, error = format!("{e:#}"), "could not delete expired artifact; will retry"),
        }
    }
    let n = jobs.mark_artifacts_expired(&deleted).await?;
    metrics.artifacts_expired.inc_by(n);
    tracing::info!(expired = n, "swept expired artifacts");
    Ok(n)
}

/// Set the sessions of workers that stopped beating `moving`: each continues on another worker
/// with its next job (the job that was running there ends `worker_lost`). A worker that comes
/// back with the same id does not get them back.
pub async fn sweep_silent_workers(sessions: &SessionStore, dead_after: Duration) -> anyhow::Result<u64> {
    let mut total = 0;
    for worker in sessions.silent_workers(dead_after).await? {
        let why = format!("worker {worker} stopped responding for more than {}s", dead_after.as_secs());
        let n = sessions.orphan_worker(&worker, MoveCause::WorkerLost, &why).await?;
        tracing::warn!(worker_id = %worker, sessions = n, "worker silent; its sessions move to other workers");
        total += n;
    }
    Ok(total)
}
