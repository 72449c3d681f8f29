//! Parked jobs: the jobs of a session that is moving to another worker wait here, in
//! Postgres, and the scheduler's dispatcher publishes them in the order they were recorded.
//!
//! Two steps, each under the session row's lock (`FOR NO KEY UPDATE`, so recording a job of the
//! session is never blocked by it):
//! 1. **Take over.** The session is `moving` and no job was sent to take it over: its oldest
//!    parked job becomes its `adopting_job` and is unparked, committed *before* it is published
//!    (the worker that receives it claims it only as the session's adopting job). Until that job
//!    is published ([`TakeOver::dispatched`]) a later round publishes it again.
//! 2. **Follow.** The session is `active` again (its new owner bound it): its parked jobs are
//!    addressed to the owner (`routed_to`, committed first: the owner may claim a parked job
//!    addressed to it), published to its queue in order, and unparked once the broker confirmed
//!    them all ([`Follow::dispatched`]). Until then they read as parked, so the intake parks the
//!    session's newer jobs behind them; a crash in between publishes them again next round (the
//!    claim refuses a second copy).

use anyhow::{Context, Result};
use sandcell_protocol::MoveCause;
use sqlx::Row;

use super::JobStore;

/// What to publish for one session with parked jobs.
pub enum Release {
    /// Send this job to the new-sessions queue to take the session over.
    TakeOver(TakeOver),
    /// Publish these jobs, in order, to the session's new owner.
    Follow(Follow),
}

/// The job that takes a moving session over (step 1).
pub struct TakeOver {
    /// Its tenant.
    pub tenant: String,
    /// Its id.
    pub job_id: String,
    /// The execution job as recorded.
    pub routed: Vec<u8>,
    /// The worker the session left.
    pub from_worker: String,
    /// Why it left.
    pub cause: MoveCause,
    pool: sqlx::PgPool,
}

impl TakeOver {
    /// The broker confirmed the publish.
    pub async fn dispatched(self) -> Result<()> {
        sqlx::query("UPDATE jobs SET dispatched_at = now() WHERE tenant = $1 AND job_id = $2")
            .bind(&self.tenant)
            .bind(&self.job_id)
            .execute(&self.pool)
            .await
            .context("marking a taking-over job dispatched")?;
        Ok(())
    }
}

/// The parked jobs of a session that has its new owner (step 2).
pub struct Follow {
    pool: sqlx::PgPool,
    /// The session's new owner.
    pub owner: String,
    /// (tenant, job id, execution job), oldest first.
    pub jobs: Vec<(String, String, Vec<u8>)>,
}

impl Follow {
    /// The broker confirmed every publish: the jobs are no longer parked.
    pub async fn dispatched(self) -> Result<()> {
        let (tenants, ids): (Vec<String>, Vec<String>) = self.jobs.into_iter().map(|(t, j, _)| (t, j)).unzip();
        sqlx::query(
            // Only while still addressed to this owner: should it have died meanwhile, the jobs
            // were parked again for the next one and stay so.
            "UPDATE jobs SET parked = false, dispatched_at = now()
             FROM unnest($1::text[], $2::text[]) AS r(tenant, job_id)
             WHERE jobs.tenant = r.tenant AND jobs.job_id = r.job_id AND jobs.parked AND jobs.routed_to = $3",
        )
        .bind(&tenants)
        .bind(&ids)
        .bind(&self.owner)
        .execute(&self.pool)
        .await
        .context("marking released parked jobs dispatched")?;
        Ok(())
    }
}

impl JobStore {
    /// Park a job recorded for `worker_id` that this worker cannot run because its session
    /// moved (a stray: recorded in the instant of the move, so the move did not park it): the
    /// dispatcher then sends it to the session's owner in recorded order. Only while it is
    /// still queued, unparked and addressed here. Returns whether it was parked.
    pub async fn park_stray(&self, tenant: &str, job_id: &str, worker_id: &str) -> Result<bool> {
        let n = sqlx::query(
            "UPDATE jobs SET parked = true, routed_to = NULL
             WHERE tenant = $1 AND job_id = $2 AND status = 'queued' AND NOT parked AND routed_to = $3 AND routed IS NOT NULL",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(worker_id)
        .execute(&self.pool)
        .await
        .context("parking a stray job")?
        .rows_affected();
        Ok(n == 1)
    }

    /// Sessions with parked jobs the dispatcher can release now: moving ones with nothing sent
    /// to take them over yet (or sent but not confirmed), and active ones (taken over).
    pub async fn sessions_with_parked_jobs(&self, limit: i64) -> Result<Vec<String>> {
        sqlx::query_scalar(
            "SELECT session_id FROM (
                SELECT DISTINCT j.session_id FROM jobs j JOIN sessions s ON s.session_id = j.session_id
                WHERE j.parked AND j.status = 'queued' AND s.state IN ('moving', 'active')
                UNION
                SELECT s.session_id FROM sessions s
                WHERE s.state = 'moving' AND s.adopting_job IS NOT NULL
                  AND EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = s.tenant AND j.job_id = s.adopting_job
                                AND j.status = 'queued' AND j.dispatched_at IS NULL)
             ) waiting
             LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .context("listing sessions with parked jobs")
    }

    /// What to publish for `session_id`, under its row lock; `None` when another dispatcher
    /// holds it or nothing is to be done.
    pub async fn release_parked(&self, session_id: &str) -> Result<Option<Release>> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let Some(s) = sqlx::query(
            "SELECT tenant, state, worker_id, moved_from, move_cause, adopting_job FROM sessions WHERE session_id = $1 FOR NO KEY UPDATE SKIP LOCKED",
        )
        .bind(session_id)
        .fetch_optional(&mut *tx)
        .await
        .context("locking a session with parked jobs")?
        else {
            return Ok(None);
        };
        let (tenant, state): (String, String) = (s.try_get("tenant")?, s.try_get("state")?);
        match state.as_str() {
            "moving" => {
                let adopting: Option<String> = s.try_get("adopting_job")?;
                let job = match adopting {
                    // Sent before but not confirmed: send it again.
                    Some(job_id) => {
                        sqlx::query("SELECT job_id, routed FROM jobs WHERE tenant = $1 AND job_id = $2 AND status = 'queued' AND dispatched_at IS NULL")
                            .bind(&tenant)
                            .bind(job_id)
                            .fetch_optional(&mut *tx)
                            .await
                            .context("reading the taking-over job")?
                    }
                    None => {
                        let first = sqlx::query(
                            "SELECT job_id, routed FROM jobs WHERE session_id = $1 AND parked AND status = 'queued' ORDER BY queued_at, job_id LIMIT 1",
                        )
                        .bind(session_id)
                        .fetch_optional(&mut *tx)
                        .await
                        .context("reading the oldest parked job")?;
                        if let Some(row) = &first {
                            let job_id: String = row.try_get("job_id")?;
                            sqlx::query("UPDATE sessions SET adopting_job = $2 WHERE session_id = $1").bind(session_id).bind(&job_id).execute(&mut *tx).await?;
                            sqlx::query("UPDATE jobs SET parked = false, routed_to = NULL, dispatched_at = NULL WHERE tenant = $1 AND job_id = $2")
                                .bind(&tenant)
                                .bind(&job_id)
                                .execute(&mut *tx)
                                .await
                                .context("unparking the taking-over job")?;
                        }
                        first
                    }
                };
                let Some(job) = job else { return Ok(None) };
                let from_worker: Option<String> = s.try_get("moved_from")?;
                let cause: Option<String> = s.try_get("move_cause")?;
                tx.commit().await.context("committing the taking-over job")?;
                Ok(Some(Release::TakeOver(TakeOver {
                    tenant,
                    job_id: job.try_get("job_id")?,
                    routed: job.try_get::<Option<Vec<u8>>, _>("routed")?.unwrap_or_default(),
                    from_worker: from_worker.unwrap_or_default(),
                    cause: cause.as_deref().and_then(MoveCause::parse).unwrap_or(MoveCause::WorkerLost),
                    pool: self.pool.clone(),
                })))
            }
            "active" => {
                let Some(owner) = s.try_get::<Option<String>, _>("worker_id")? else { return Ok(None) };
                // Addressed to the owner, still parked: the owner may claim them, the intake
                // parks the session's newer jobs behind them until they are marked dispatched.
                let rows = sqlx::query(
                    "UPDATE jobs SET routed_to = $2 WHERE session_id = $1 AND parked AND status = 'queued'
                     RETURNING tenant, job_id, routed, queued_at",
                )
                .bind(session_id)
                .bind(&owner)
                .fetch_all(&mut *tx)
                .await
                .context("addressing a session's parked jobs to its owner")?;
                tx.commit().await.context("committing released parked jobs")?;
                let mut jobs = Vec::with_capacity(rows.len());
                for r in rows {
                    let queued_at: chrono::DateTime<chrono::Utc> = r.try_get("queued_at")?;
                    let (tenant, job_id): (String, String) = (r.try_get("tenant")?, r.try_get("job_id")?);
                    jobs.push((queued_at, (tenant, job_id, r.try_get::<Option<Vec<u8>>, _>("routed")?.unwrap_or_default())));
                }
                jobs.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1 .1.cmp(&b.1 .1)));
                if jobs.is_empty() {
                    return Ok(None);
                }
                Ok(Some(Release::Follow(Follow { pool: self.pool.clone(), owner, jobs: jobs.into_iter().map(|(_, j)| j).collect() })))
            }
            _ => Ok(None),
        }
    }
}
