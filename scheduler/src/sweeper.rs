//! The artifact TTL sweeper: the real enforcement of `expires_at`.
//!
//! Each tick also looks for workers whose heartbeat stopped and sets their sessions moving,
//! expires moving sessions nobody used within their keep-alive,
//! ends jobs stuck in `queued` (and sessions in `starting`) past `SANDCELL_STUCK_AFTER_S`, and
//! refuses with `capacity` new sessions no worker took within `SANDCELL_SESSION_START_WAIT_S`,
//! and deletes finished jobs and upload answers past `SANDCELL_RESULT_RETENTION_S`.
//!
//! Each tick deletes the objects of artifacts whose expiry has passed and then marks them
//! `expired` (so a client sees `artifact_expired` and no URL). Deleting first and marking second
//! means a crash in between only repeats an idempotent delete.

use std::time::{Duration, Instant};

use sandcell_core::jobs::{Gone, JobStore};
use sandcell_core::sessions::SessionStore;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::MoveCause;

use crate::metrics::Metrics;

const BATCH: i64 = 500;
/// When an upload whose objects could not all be deleted is tried again.
const UPLOAD_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How long things may wait before the sweeper ends them.
pub struct SweepLimits {
    /// A worker silent this long has lost its sessions.
    pub worker_dead_after: Duration,
    /// A job `queued` (a session `starting`) this long is stuck.
    pub stuck_after: Duration,
    /// A new session no worker took within this is refused with `capacity`.
    pub session_start_wait: Duration,
    /// Finished jobs and upload answers older than this are deleted.
    pub result_retention: Duration,
}

/// How long past its time limit a `running` job may stay so before the sweeper ends it: room for
/// its sandbox's start (tries × start timeout), the interrupt grace and the commit's retries
/// (about two minutes). A job still running after that has lost its worker's attention.
const OVERDUE_MARGIN: Duration = Duration::from_secs(600);

/// How long the sweeper's ping may take before the database counts as unreachable.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a worker's silence can be trusted to mean it is dead. Heartbeats are rows in the
/// database: while it is out (or before this sweeper first reached it) every heartbeat grows
/// old though no worker died, so silence is judged only once the database has been reachable
/// for `dead_after` without a break: by then every live worker has beaten again.
///
/// This is what the sweeper sees of the database; the statements that act on silence also ask
/// the database itself (`sandcell_worker_silent`, migration 0016): a statement held up by an
/// outage runs the moment it ends, after this sweeper last looked.
#[derive(Debug)]
struct SilenceTrust {
    dead_after: Duration,
    reachable_since: Option<Instant>,
}

impl SilenceTrust {
    fn new(dead_after: Duration) -> Self {
        SilenceTrust { dead_after, reachable_since: None }
    }

    /// Record whether the database answered at `now`.
    fn observe(&mut self, reached: bool, now: Instant) {
        if reached {
            self.reachable_since.get_or_insert(now);
        } else {
            self.reachable_since = None;
        }
    }

    /// The silence after which a worker is dead, or `None` while silence proves nothing.
    fn dead_after(&self, now: Instant) -> Option<Duration> {
        self.reachable_since.is_some_and(|t| now.saturating_duration_since(t) >= self.dead_after).then_some(self.dead_after)
    }
}

/// Remove what expired from the object store forever, every `interval`: artifacts past their
/// TTL ([`sweep_once`]) and uploads past theirs ([`sweep_uploads`]). A task of its own, apart
/// from [`run`]: a store that hangs (each attempt waits up to `SANDCELL_S3_ATTEMPT_TIMEOUT_S`)
/// must not hold up the sweeps that find dead workers and end stuck jobs.
pub async fn run_store(jobs: JobStore, store: ArtifactStore, metrics: Metrics, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = sweep_once(&jobs, &store, &metrics).await {
            tracing::warn!(error = format!("{e:#}"), "artifact sweep failed; retrying next tick");
        }
        if let Err(e) = sweep_uploads(jobs.pool(), &store, &metrics).await {
            tracing::warn!(error = format!("{e:#}"), "upload sweep failed; retrying next tick");
        }
        if let Err(e) = sweep_snapshots(&SessionStore::new(jobs.pool().clone()), &store).await {
            tracing::warn!(error = format!("{e:#}"), "snapshot sweep failed; retrying next tick");
        }
    }
}

/// Sweep the database's state forever, every `interval`: dead workers, jobs and sessions that
/// waited too long, the job gauges.
pub async fn run(jobs: JobStore, metrics: Metrics, interval: Duration, limits: SweepLimits) {
    let SweepLimits { worker_dead_after, stuck_after, session_start_wait, result_retention } = limits;
    let sessions = SessionStore::new(jobs.pool().clone());
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut silence = SilenceTrust::new(worker_dead_after);
    loop {
        tick.tick().await;
        // A ping that waits for a database coming back (the pool retries its connection) is no
        // answer: the outage it waited through aged every heartbeat.
        let reached = match tokio::time::timeout(PING_TIMEOUT, jobs.ping()).await {
            Ok(reached) => reached,
            Err(_) => Err(anyhow::anyhow!("the database did not answer a ping within {} s", PING_TIMEOUT.as_secs())),
        };
        silence.observe(reached.is_ok(), Instant::now());
        if let Err(e) = reached {
            tracing::warn!(error = format!("{e:#}"), "database unreachable; sweeping next tick");
            continue;
        }
        // Silence is judged first, right after the ping, not after the artifact sweep's deletes.
        let dead_after = silence.dead_after(Instant::now());
        if let Some(dead_after) = dead_after {
            if let Err(e) = sweep_silent_workers(&sessions, dead_after).await {
                tracing::warn!(error = format!("{e:#}"), "worker liveness sweep failed; retrying next tick");
            }
            match jobs.end_jobs_of_gone_worker(Gone::Silent(dead_after)).await {
                Ok(0) => {}
                Ok(n) => {
                    metrics.stuck_ended.with_label_values(&["job_of_dead_worker"]).inc_by(n);
                    tracing::warn!(jobs = n, "jobs running on silent workers ended worker_lost");
                }
                Err(e) => tracing::warn!(error = format!("{e:#}"), "dead-worker job sweep failed; retrying next tick"),
            }
        }
        match jobs.end_overdue(OVERDUE_MARGIN).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.stuck_ended.with_label_values(&["job_overdue"]).inc_by(n);
                tracing::warn!(jobs = n, margin_s = OVERDUE_MARGIN.as_secs(), "ended jobs running far past their time limit");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "overdue-job sweep failed; retrying next tick"),
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
        match sessions.end_unadopted(session_start_wait, dead_after).await {
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
        if let Err(e) = sweep_retention(jobs.pool(), result_retention, &metrics).await {
            tracing::warn!(error = format!("{e:#}"), "retention sweep failed; retrying next tick");
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

/// Remove the objects of one batch of upload grants whose time is over, and mark them removed
/// (their bytes stop counting against their tenant's quota). A grant one of whose objects could
/// not be deleted is tried again an hour later, behind the others; a key nothing was put to
/// deletes as well as any. Returns how many were marked.
pub async fn sweep_uploads(pool: &sqlx::PgPool, store: &ArtifactStore, metrics: &Metrics) -> anyhow::Result<u64> {
    let mut removed = 0;
    for upload in sandcell_core::uploads::expired(pool, BATCH).await? {
        let mut all = true;
        for key in &upload.keys {
            if let Err(e) = store.delete(key).await {
                tracing::warn!(key = %key, error = format!("{e:#}"), "could not delete an expired upload; will retry");
                all = false;
            }
        }
        if !all {
            sandcell_core::uploads::postpone(pool, &upload.tenant, &upload.upload_id, UPLOAD_RETRY_AFTER).await?;
        } else if sandcell_core::uploads::mark_removed(pool, &upload.tenant, &upload.upload_id).await? {
            removed += 1;
        }
    }
    if removed > 0 {
        metrics.uploads_removed.inc_by(removed);
        tracing::info!(removed, "removed expired uploads");
    }
    Ok(removed)
}

/// How long the retention sweep deletes in one tick, at most (of each kind): a batch of 500
/// takes ~10 ms here, so a backlog of old results goes at thousands a second, while the tick's
/// other sweeps (dead workers, stuck jobs) wait at most this long.
const RETENTION_TIME: Duration = Duration::from_secs(2);

/// Delete finished jobs, upload answers and ended sessions past their retention
/// ([`sandcell_core::retention`]), oldest first, in batches, each kind until a batch comes back
/// short or [`RETENTION_TIME`] is spent. Sessions go after the jobs: a session's row is deleted
/// once its jobs are. Returns (jobs, uploads, sessions) deleted.
pub async fn sweep_retention(pool: &sqlx::PgPool, retention: Duration, metrics: &Metrics) -> anyhow::Result<(u64, u64, u64)> {
    use sandcell_core::retention::{forget_jobs, forget_sessions, forget_uploads};
    let jobs = in_batches(|| forget_jobs(pool, retention, BATCH)).await?;
    let uploads = in_batches(|| forget_uploads(pool, retention, BATCH)).await?;
    let sessions = in_batches(|| forget_sessions(pool, retention, BATCH)).await?;
    for (what, n) in [("job", jobs), ("upload", uploads), ("session", sessions)] {
        metrics.retention_deleted.with_label_values(&[what]).inc_by(n);
    }
    if (jobs, uploads, sessions) != (0, 0, 0) {
        tracing::info!(jobs, uploads, sessions, retention_s = retention.as_secs(), "deleted results, upload answers and sessions past their retention");
    }
    Ok((jobs, uploads, sessions))
}

/// Run `batch` until it deletes fewer than [`BATCH`] or [`RETENTION_TIME`] is spent; the total.
async fn in_batches<F, Fut>(mut batch: F) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let started = Instant::now();
    let mut deleted = 0;
    loop {
        let n = batch().await?;
        deleted += n;
        if n < BATCH as u64 || started.elapsed() >= RETENTION_TIME {
            return Ok(deleted);
        }
    }
}

/// Delete the snapshots (pickled variables saved by a draining worker) of sessions that ended
/// before a move used them: a session that expired or was lost while moving, or one whose
/// taking-over worker could not delete it. Before, they stayed in the store, counted nowhere.
/// Returns how many were deleted; one that could not be is tried again next tick.
pub async fn sweep_snapshots(sessions: &SessionStore, store: &ArtifactStore) -> anyhow::Result<u64> {
    let mut deleted = 0;
    for (session_id, key) in sessions.ended_snapshots(BATCH).await? {
        match store.delete(&key).await {
            Ok(()) => {
                sessions.forget_snapshot(&session_id, &key).await?;
                deleted += 1;
            }
            Err(e) => tracing::warn!(key = %key, error = format!("{e:#}"), "could not delete an ended session's snapshot; will retry"),
        }
    }
    if deleted > 0 {
        tracing::info!(deleted, "deleted the snapshots of ended sessions");
    }
    Ok(deleted)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_proves_nothing_before_the_database_was_reachable_for_the_dead_after() {
        let t0 = Instant::now();
        let mut s = SilenceTrust::new(Duration::from_secs(30));
        assert_eq!(s.dead_after(t0), None, "never reached yet");
        s.observe(true, t0);
        assert_eq!(s.dead_after(t0 + Duration::from_secs(29)), None);
        assert_eq!(s.dead_after(t0 + Duration::from_secs(30)), Some(Duration::from_secs(30)));
    }

    #[test]
    fn an_outage_restarts_the_wait_before_silence_is_trusted_again() {
        let t0 = Instant::now();
        let mut s = SilenceTrust::new(Duration::from_secs(30));
        s.observe(true, t0);
        s.observe(true, t0 + Duration::from_secs(40));
        assert!(s.dead_after(t0 + Duration::from_secs(40)).is_some());
        // Out for a minute: every heartbeat is now old, though no worker died.
        s.observe(false, t0 + Duration::from_secs(41));
        assert_eq!(s.dead_after(t0 + Duration::from_secs(41)), None);
        s.observe(true, t0 + Duration::from_secs(100));
        assert_eq!(s.dead_after(t0 + Duration::from_secs(101)), None, "just back: the workers have not beaten yet");
        assert!(s.dead_after(t0 + Duration::from_secs(130)).is_some());
    }
}
