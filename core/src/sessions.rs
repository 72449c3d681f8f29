//! The session store: session ownership, keep-alive bookkeeping and worker liveness in Postgres.
//!
//! Every session state change happens here, through a guarded `UPDATE` whose source states come
//! from [`SessionState::sources_of`]. Who may call what:
//! - the scheduler records a session as `starting` together with the job that opens it
//!   ([`crate::jobs::JobStore::record_queued`] calls [`create`] in its transaction) and reads [`SessionStore::route`] to place later jobs;
//! - only the worker running the opening job may [`bind`](SessionStore::bind) it (→ `active`);
//! - only the worker holding it may [`end`](SessionStore::end) it (→ `expired`, `closed`, `lost`);
//! - a starting worker, or the sweeper for a worker whose heartbeat stopped, declares that worker's
//!   sessions `lost` ([`SessionStore::lose_worker`]).

use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_protocol::{ErrorCode, Reason, Session, SessionState};
use sqlx::postgres::PgPool;
use sqlx::Row;

/// Where the scheduler should send a job naming a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The session is active on this worker.
    Worker(String),
    /// The job cannot run; record this reason.
    Refuse(Reason),
}

/// Handle on the session tables (shares the job store's pool).
#[derive(Clone)]
pub struct SessionStore {
    pool: PgPool,
}

fn states(next: SessionState) -> Vec<String> {
    SessionState::sources_of(next).into_iter().map(|s| s.as_str().to_string()).collect()
}

/// Record a session as `starting`, in the transaction that records the job opening it (so
/// a duplicate submission never creates a second session).
pub(crate) async fn create(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, session_id: &str, tenant: &str, keep_alive_s: u64, job_id: &str) -> Result<()> {
    sqlx::query("INSERT INTO sessions (session_id, tenant, state, keep_alive_s, created_by_job) VALUES ($1, $2, $3, $4, $5)")
        .bind(session_id)
        .bind(tenant)
        .bind(SessionState::Starting.as_str())
        .bind(i32::try_from(keep_alive_s).unwrap_or(i32::MAX))
        .bind(job_id)
        .execute(&mut **tx)
        .await
        .context("inserting session")?;
    Ok(())
}

/// What a session job's commit does to its session, in the commit's own transaction: close it
/// (a transition, guarded like every other) or extend its keep-alive while it is active.
pub(crate) async fn touch(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, touch: &crate::jobs::SessionTouch) -> Result<()> {
    if touch.close {
        sqlx::query("UPDATE sessions SET state = 'closed', ended_at = now(), last_activity_at = now() WHERE session_id = $1 AND state = ANY($2)")
            .bind(&touch.id)
            .bind(states(SessionState::Closed))
            .execute(&mut **tx)
            .await
            .context("closing the session")?;
    } else {
        sqlx::query(
            "UPDATE sessions SET keep_alive_s = COALESCE($2, keep_alive_s), last_activity_at = now(),
                                 expires_at = now() + COALESCE($2, keep_alive_s) * interval '1 second'
             WHERE session_id = $1 AND state = 'active'",
        )
        .bind(&touch.id)
        .bind(touch.keep_alive_s.map(|k| i32::try_from(k).unwrap_or(i32::MAX)))
        .execute(&mut **tx)
        .await
        .context("extending the session's keep-alive")?;
    }
    Ok(())
}

impl SessionStore {
    /// Wrap a pool.
    pub fn new(pool: PgPool) -> Self {
        SessionStore { pool }
    }

    /// Decide where a job of `tenant` naming `session_id` goes. Another tenant's session is
    /// reported exactly like an unknown one, so ids cannot be probed.
    pub async fn route(&self, tenant: &str, session_id: &str) -> Result<Route> {
        let row = sqlx::query("SELECT state, worker_id FROM sessions WHERE session_id = $1 AND tenant = $2")
            .bind(session_id)
            .bind(tenant)
            .fetch_optional(&self.pool)
            .await
            .context("looking up session")?;
        let Some(row) = row else {
            return Ok(Route::Refuse(Reason::new(ErrorCode::SessionNotFound, format!("tenant {tenant} has no session {session_id}"))));
        };
        let state = parse_state(row.try_get("state")?)?;
        if let Some(reason) = state.refusal(session_id) {
            return Ok(Route::Refuse(reason));
        }
        let worker: Option<String> = row.try_get("worker_id")?;
        Ok(match worker {
            Some(w) => Route::Worker(w),
            None => Route::Refuse(Reason::new(ErrorCode::SessionLost, format!("session {session_id} is active but has no worker"))),
        })
    }

    /// The state of a session, checked against its tenant.
    pub async fn state(&self, tenant: &str, session_id: &str) -> Result<Option<SessionState>> {
        let row = sqlx::query("SELECT state FROM sessions WHERE session_id = $1 AND tenant = $2")
            .bind(session_id)
            .bind(tenant)
            .fetch_optional(&self.pool)
            .await
            .context("reading session state")?;
        row.map(|r| parse_state(r.try_get("state")?)).transpose()
    }

    /// Make `worker_id` the owner of a session, as the worker starting its opening job `job_id`.
    /// Also allowed when the session is already active: the opening job was redelivered because
    /// its first worker died. Returns false when the session is no longer bindable.
    pub async fn bind(&self, session_id: &str, job_id: &str, worker_id: &str, container_id: &str) -> Result<bool> {
        let n = sqlx::query(
            "UPDATE sessions SET state = 'active', worker_id = $3, container_id = $4, last_activity_at = now(),
                    expires_at = now() + keep_alive_s * interval '1 second'
             WHERE session_id = $1 AND created_by_job = $2 AND state = ANY($5)",
        )
        .bind(session_id)
        .bind(job_id)
        .bind(worker_id)
        .bind(container_id)
        .bind(states(SessionState::Active))
        .execute(&self.pool)
        .await
        .context("binding session to worker")?
        .rows_affected();
        Ok(n == 1)
    }

    /// Record that a session's kernel was replaced by a new container.
    pub async fn set_container(&self, session_id: &str, worker_id: &str, container_id: &str) -> Result<()> {
        sqlx::query("UPDATE sessions SET container_id = $3 WHERE session_id = $1 AND worker_id = $2 AND state = 'active'")
            .bind(session_id)
            .bind(worker_id)
            .bind(container_id)
            .execute(&self.pool)
            .await
            .context("recording session container")?;
        Ok(())
    }

    /// End a session held by `worker_id` (expired, closed, lost) or one that never started
    /// (failed). Returns false if it had already ended or belongs to another worker.
    pub async fn end(&self, session_id: &str, worker_id: Option<&str>, state: SessionState, reason: Option<&Reason>) -> Result<bool> {
        let n = sqlx::query(
            "UPDATE sessions SET state = $2, ended_at = now(), end_reason = $3
             WHERE session_id = $1 AND ($4::text IS NULL OR worker_id = $4) AND state = ANY($5)",
        )
        .bind(session_id)
        .bind(state.as_str())
        .bind(reason.map(sandcell_protocol::storable::json).transpose()?)
        .bind(worker_id)
        .bind(states(state))
        .execute(&self.pool)
        .await
        .context("ending session")?
        .rows_affected();
        Ok(n == 1)
    }

    /// Declare every live session of `worker_id` lost, and end their unfinished jobs with
    /// `session_lost`. Called by a worker at start-up (its containers are gone) and by the
    /// sweeper for a worker whose heartbeat stopped. Returns the number of sessions lost.
    pub async fn lose_worker(&self, worker_id: &str, why: &str) -> Result<u64> {
        let reason = Reason::new(ErrorCode::SessionLost, why.to_string());
        let reason_json = sandcell_protocol::storable::json(&reason)?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let lost: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'lost', ended_at = now(), end_reason = $2
             WHERE worker_id = $1 AND state = ANY($3) RETURNING session_id",
        )
        .bind(worker_id)
        .bind(&reason_json)
        .bind(states(SessionState::Lost))
        .fetch_all(&mut *tx)
        .await
        .context("marking sessions lost")?;
        if !lost.is_empty() {
            crate::jobs::refuse_jobs_of_sessions(&mut tx, &lost, &reason_json).await?;
        }
        tx.commit().await.context("committing lost sessions")?;
        Ok(lost.len() as u64)
    }

    /// Note that a worker is alive, with its capacity.
    pub async fn heartbeat(&self, worker_id: &str, slots: i32, max_sessions: i32) -> Result<()> {
        sqlx::query(
            "INSERT INTO workers (worker_id, slots, max_sessions) VALUES ($1, $2, $3)
             ON CONFLICT (worker_id) DO UPDATE SET last_seen_at = now(), slots = $2, max_sessions = $3",
        )
        .bind(worker_id)
        .bind(slots)
        .bind(max_sessions)
        .execute(&self.pool)
        .await
        .context("worker heartbeat")?;
        Ok(())
    }

    /// Workers that hold live sessions but have not been seen for `silence`.
    pub async fn silent_workers(&self, silence: Duration) -> Result<Vec<String>> {
        let rows = sqlx::query_scalar(
            "SELECT w.worker_id FROM workers w
             WHERE w.last_seen_at < now() - $1 * interval '1 millisecond'
               AND EXISTS (SELECT 1 FROM sessions s WHERE s.worker_id = w.worker_id AND s.state IN ('starting', 'active'))",
        )
        .bind(i64::try_from(silence.as_millis()).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .context("finding silent workers")?;
        Ok(rows)
    }

    /// One session as its tenant sees it ([`crate::reads::session`]).
    pub async fn get(&self, tenant: &str, session_id: &str) -> Result<Option<Session>> {
        crate::reads::session(&self.pool, tenant, session_id).await
    }
}

impl SessionStore {
    /// End what stayed `queued` (jobs) or `starting` (sessions) longer than `after` since it was
    /// dispatched: such a job's message was lost (dead-lettered, or its queue deleted), and it
    /// must not hold its tenant's quota forever. Jobs held for fair share are waiting, not lost,
    /// and are left alone. Sessions become `failed`, their unfinished jobs end by the rule of
    /// [`crate::jobs::refuse_jobs_of_sessions`]; queued jobs become `rejected`. All with reason `stuck`.
    /// Returns (jobs, sessions) ended.
    pub async fn end_stuck(&self, after: Duration) -> Result<(u64, u64)> {
        let millis = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        let why = format!("it stayed queued for more than {} s without reaching a worker", after.as_secs());
        let reason = sandcell_protocol::storable::json(&Reason::new(ErrorCode::Stuck, why))?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let sessions: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'failed', ended_at = now(), end_reason = $2
             WHERE state = 'starting' AND state = ANY($3) AND created_at < now() - $1 * interval '1 millisecond'
               AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.session_id = sessions.session_id AND j.held_job IS NOT NULL)
             RETURNING session_id",
        )
        .bind(millis)
        .bind(&reason)
        .bind(states(SessionState::Failed))
        .fetch_all(&mut *tx)
        .await
        .context("failing stuck sessions")?;
        if !sessions.is_empty() {
            crate::jobs::refuse_jobs_of_sessions(&mut tx, &sessions, &reason).await?;
        }
        let jobs = crate::jobs::reject_stuck(&mut tx, millis, &reason).await?;
        tx.commit().await.context("committing stuck jobs and sessions")?;
        Ok((jobs, sessions.len() as u64))
    }

    /// Refuse new sessions no worker took: sessions still `starting` whose opening job was
    /// dispatched more than `wait` ago and is still `queued` (a worker without room for another
    /// session does not consume `sandcell.sessions.new`, so at a full fleet such jobs wait in the
    /// queue). The session becomes `failed` and its jobs `rejected` with `capacity`; should a
    /// worker take the message later, its claim finds the job ended and skips it. Returns how
    /// many sessions.
    pub async fn refuse_unplaced(&self, wait: Duration) -> Result<u64> {
        let millis = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let why = format!("no worker had room for another session within {} s", wait.as_secs());
        let reason = sandcell_protocol::storable::json(&Reason::new(ErrorCode::Capacity, why))?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let sessions: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'failed', ended_at = now(), end_reason = $2
             WHERE state = 'starting' AND state = ANY($3)
               AND EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = sessions.tenant AND j.job_id = sessions.created_by_job
                             AND j.status = 'queued' AND j.held_job IS NULL AND j.dispatched_at < now() - $1 * interval '1 millisecond')
             RETURNING session_id",
        )
        .bind(millis)
        .bind(&reason)
        .bind(states(SessionState::Failed))
        .fetch_all(&mut *tx)
        .await
        .context("failing sessions no worker took")?;
        if !sessions.is_empty() {
            crate::jobs::refuse_jobs_of_sessions(&mut tx, &sessions, &reason).await?;
        }
        tx.commit().await.context("committing refused sessions")?;
        Ok(sessions.len() as u64)
    }
}

fn parse_state(s: String) -> Result<SessionState> {
    SessionState::parse(&s).with_context(|| format!("unknown session state {s:?} in database"))
}
