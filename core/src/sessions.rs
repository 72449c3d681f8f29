//! The session store: session ownership, keep-alive bookkeeping and worker liveness in Postgres.
//!
//! Every session state change happens here, through a guarded `UPDATE` whose source states come
//! from [`SessionState::sources_of`]. Who may call what:
//! - the scheduler records a session as `starting` together with the job that opens it (the
//!   one statement of [`crate::jobs::JobStore::record_queued`], the SQL function
//!   `sandcell_record_job` of migrations/0014_record_job_routes.sql: the one session write
//!   outside this module), which also routes later jobs to the session's worker ([`refusal`]
//!   words why it would not);
//! - only the worker running the opening job may [`bind`](SessionStore::bind) it (→ `active`);
//! - only the worker holding it may [`end`](SessionStore::end) it (→ `expired`, `closed`, `lost`);
//! - a starting worker (its containers are gone), a draining worker, or the sweeper for a worker
//!   whose heartbeat stopped, sets that worker's sessions `moving` ([`SessionStore::orphan_worker`]);
//! - only the worker running the job the dispatcher sent to take a moving session over may
//!   [`adopt`](SessionStore::adopt) it (→ `active` there).

use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_protocol::submission::decoded_len;
use sandcell_protocol::{storable, ErrorCode, MoveCause, Reason, Session, SessionState};
use sqlx::postgres::PgPool;
use sqlx::Row;

/// Why a job of `tenant` naming `session_id` cannot run there, from the session's state as the
/// record read it (`None`: the tenant has no such session). Which states take a job is decided
/// by the record (`sandcell_record_job`, migration 0014); this says why not, in the words of
/// [`SessionState::refusal`]. Another tenant's session is reported exactly like an unknown
/// one, so ids cannot be probed.
pub fn refusal(tenant: &str, session_id: &str, state: Option<&str>) -> Result<Reason> {
    let Some(state) = state else {
        return Ok(Reason::new(ErrorCode::SessionNotFound, format!("tenant {tenant} has no session {session_id}")));
    };
    let state = parse_state(state.to_string())?;
    // Active (or moving) yet refused: it has no worker.
    Ok(state.refusal(session_id).unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, format!("session {session_id} is active but has no worker"))))
}

/// A moving session, taken over ([`SessionStore::adopt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adopted {
    /// The worker it left.
    pub from_worker: String,
    /// Why it left.
    pub cause: MoveCause,
    /// Its keep-alive, in seconds.
    pub keep_alive_s: u64,
    /// The variables its draining worker saved, if it did.
    pub snapshot: Option<Snapshot>,
}

/// A session's variables as a draining worker saved them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The object in the store (a dill pickle of a dict of the variables).
    pub key: String,
    /// The names that could not be saved.
    pub variables_lost: Vec<String>,
}

/// A file of a moved session's workspace, as the store has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceFile {
    /// An input file a job brought inline.
    Inline {
        /// Path in the workspace.
        path: String,
        /// Its bytes, base64.
        content_b64: String,
    },
    /// An object in the store: a file a job wrote, or a tenant's upload.
    Stored {
        /// Path in the workspace.
        path: String,
        /// The object's key.
        s3_key: String,
        /// False once the artifact expired (its object is gone).
        available: bool,
    },
    /// An input file a job brought inline whose contents would take the workspace past its
    /// size with the newer files: not read.
    Over {
        /// Path in the workspace.
        path: String,
    },
}

impl WorkspaceFile {
    /// Its path in the workspace.
    pub fn path(&self) -> &str {
        match self {
            WorkspaceFile::Inline { path, .. } | WorkspaceFile::Stored { path, .. } | WorkspaceFile::Over { path } => path,
        }
    }
}

/// Most paths of a moved session's history [`SessionStore::workspace_of`] reads.
pub const MAX_WORKSPACE_ENTRIES: usize = 10_000;

/// The paths of a workspace being rebuilt newest first, and their directories: an older file
/// is left out when a newer one has its path, or one of them is a directory of the other (a
/// file where a directory now is, or the reverse). Sets, so that a history of many paths costs
/// in proportion to them.
#[derive(Default)]
struct KeptPaths {
    paths: std::collections::HashSet<String>,
    dirs: std::collections::HashSet<String>,
}

impl KeptPaths {
    /// Keep `path` unless a kept one clashes with it; whether it was kept.
    fn admit(&mut self, path: &str) -> bool {
        let ancestors: Vec<&str> = path.match_indices('/').map(|(i, _)| &path[..i]).collect();
        if self.paths.contains(path) || self.dirs.contains(path) || ancestors.iter().any(|a| self.paths.contains(*a)) {
            return false;
        }
        self.dirs.extend(ancestors.iter().map(|a| a.to_string()));
        self.paths.insert(path.to_string());
        true
    }

    fn len(&self) -> usize {
        self.paths.len()
    }
}

#[cfg(test)]
mod kept_paths_tests {
    use super::KeptPaths;

    #[test]
    fn a_newer_path_hides_the_same_path_and_its_directories_and_files_below_it() {
        let mut kept = KeptPaths::default();
        // Newest first: `out/y` (so `out` is a directory), `a`, `x`.
        assert!(kept.admit("out/y") && kept.admit("a") && kept.admit("x"));
        assert!(!kept.admit("x"), "the same path, older");
        assert!(!kept.admit("a/b.csv"), "below a path that is now a file");
        assert!(!kept.admit("out"), "a file where a directory now is");
        assert!(kept.admit("output.csv") && kept.admit("ab") && kept.admit("out/z"), "no clash: a longer name, a sibling");
        assert_eq!(kept.len(), 6);
    }
}

/// Handle on the session tables (shares the job store's pool).
#[derive(Clone)]
pub struct SessionStore {
    pool: PgPool,
}

fn states(next: SessionState) -> Vec<String> {
    SessionState::sources_of(next).into_iter().map(|s| s.as_str().to_string()).collect()
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
        forget_routed(tx, &touch.id).await?;
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

/// An ended session never moves again: drop the execution jobs kept to move it (they may carry
/// inline input files).
async fn forget_routed(tx: &mut sqlx::PgConnection, session_id: &str) -> Result<()> {
    sqlx::query("UPDATE jobs SET routed = NULL WHERE session_id = $1 AND routed IS NOT NULL AND status NOT IN ('queued', 'running')")
        .bind(session_id)
        .execute(tx)
        .await
        .context("dropping an ended session's kept execution jobs")?;
    Ok(())
}

/// What ending a session does to its jobs, in the transaction that ends it: the execution jobs
/// kept to move it are dropped, and jobs parked for a new owner it will never have are refused.
async fn after_end(tx: &mut sqlx::PgConnection, session_id: &str, refusal: &Reason) -> Result<()> {
    forget_routed(&mut *tx, session_id).await?;
    sqlx::query("UPDATE jobs SET status = 'rejected', reason = $2, finished_at = now() WHERE session_id = $1 AND parked AND status = 'queued'")
        .bind(session_id)
        .bind(storable::json(refusal)?)
        .execute(tx)
        .await
        .context("refusing the parked jobs of an ended session")?;
    Ok(())
}

impl SessionStore {
    /// Wrap a pool.
    pub fn new(pool: PgPool) -> Self {
        SessionStore { pool }
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

    /// Record the snapshot of a session's variables that `worker_id`, draining, took before it
    /// sets the session moving: it is for the coming move only. `None` when it was not recorded
    /// (the session is not active on that worker); otherwise the key of the snapshot it
    /// replaced, if any (its object is for no move any more).
    pub async fn record_snapshot(&self, session_id: &str, worker_id: &str, snapshot: &Snapshot) -> Result<Option<Option<String>>> {
        sqlx::query_scalar(
            "WITH old AS (SELECT session_id, snapshot_key FROM sessions
                           WHERE session_id = $1 AND worker_id = $2 AND state = 'active' FOR UPDATE)
             UPDATE sessions s SET snapshot_key = $3, variables_lost = $4, snapshot_move = s.moves + 1
               FROM old WHERE s.session_id = old.session_id
             RETURNING old.snapshot_key",
        )
        .bind(session_id)
        .bind(worker_id)
        .bind(&snapshot.key)
        .bind(serde_json::to_value(&snapshot.variables_lost).context("serializing lost variable names")?)
        .fetch_optional(&self.pool)
        .await
        .context("recording a session's snapshot")
    }

    /// Up to `limit` snapshots of sessions that ended: (session id, object key). No move will
    /// read them.
    pub async fn ended_snapshots(&self, limit: i64) -> Result<Vec<(String, String)>> {
        let rows = sqlx::query_as(
            "SELECT session_id, snapshot_key FROM sessions
              WHERE snapshot_key IS NOT NULL AND state IN ('expired', 'closed', 'lost', 'failed')
              LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .context("finding the snapshots of ended sessions")?;
        Ok(rows)
    }

    /// Forget a session's snapshot `key` once its object is deleted (unless another replaced it).
    pub async fn forget_snapshot(&self, session_id: &str, key: &str) -> Result<()> {
        sqlx::query("UPDATE sessions SET snapshot_key = NULL WHERE session_id = $1 AND snapshot_key = $2")
            .bind(session_id)
            .bind(key)
            .execute(&self.pool)
            .await
            .context("forgetting a session's snapshot")?;
        Ok(())
    }

    /// The state of a session and the worker holding it, checked against its tenant.
    pub async fn holder(&self, tenant: &str, session_id: &str) -> Result<Option<(SessionState, Option<String>)>> {
        let row = sqlx::query("SELECT state, worker_id FROM sessions WHERE session_id = $1 AND tenant = $2")
            .bind(session_id)
            .bind(tenant)
            .fetch_optional(&self.pool)
            .await
            .context("reading a session's holder")?;
        row.map(|r| Ok((parse_state(r.try_get("state")?)?, r.try_get("worker_id")?))).transpose()
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
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let n = sqlx::query(
            "UPDATE sessions SET state = $2, ended_at = now(), end_reason = $3
             WHERE session_id = $1 AND ($4::text IS NULL OR worker_id = $4) AND state = ANY($5)",
        )
        .bind(session_id)
        .bind(state.as_str())
        .bind(reason.map(sandcell_protocol::storable::json).transpose()?)
        .bind(worker_id)
        .bind(states(state))
        .execute(&mut *tx)
        .await
        .context("ending session")?
        .rows_affected();
        if n == 1 {
            let refusal = reason.cloned().or_else(|| state.refusal(session_id)).unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, "the session ended"));
            after_end(&mut tx, session_id, &refusal).await?;
        }
        tx.commit().await.context("committing the end of a session")?;
        Ok(n == 1)
    }

    /// End a moving session `lost` because the job sent to take it over (`job_id`) cannot: only
    /// while that job is still its taking-over job (a stale copy of it changes nothing).
    pub async fn end_adoption(&self, session_id: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let n = sqlx::query(
            "UPDATE sessions SET state = 'lost', ended_at = now(), end_reason = $3
             WHERE session_id = $1 AND adopting_job = $2 AND state = 'moving' AND state = ANY($4)",
        )
        .bind(session_id)
        .bind(job_id)
        .bind(storable::json(reason)?)
        .bind(states(SessionState::Lost))
        .execute(&mut *tx)
        .await
        .context("ending a session no worker could take over")?
        .rows_affected();
        if n == 1 {
            after_end(&mut tx, session_id, reason).await?;
        }
        tx.commit().await.context("committing the end of a session")?;
        Ok(n == 1)
    }

    /// Set every session `worker_id` holds `moving` (it died, restarted or drained): each
    /// continues on another worker with its next job, from its stored workspace. In the same
    /// transaction, the sessions' jobs that had not run are *parked* for the dispatcher (they
    /// are published again, in order, to the new owner; the copies in `worker_id`'s queue are
    /// never run), and a job that was running there ends `infrastructure_error/worker_lost` (it
    /// may have had effects, so it is not run again). Returns the number of sessions.
    pub async fn orphan_worker(&self, worker_id: &str, cause: MoveCause, why: &str) -> Result<u64> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let moved: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'moving', moved_from = worker_id, worker_id = NULL, container_id = NULL,
                                 move_cause = $2, adopting_job = NULL, moves = moves + 1
             WHERE worker_id = $1 AND state = ANY($3) RETURNING session_id",
        )
        .bind(worker_id)
        .bind(cause.as_str())
        .bind(states(SessionState::Moving))
        .fetch_all(&mut *tx)
        .await
        .context("setting a worker's sessions moving")?;
        if !moved.is_empty() {
            let died =
                storable::json(&Reason::new(ErrorCode::WorkerLost, format!("{why}; the job is not run again, and its session continues on another worker")))?;
            sqlx::query("UPDATE jobs SET status = 'infrastructure_error', reason = $2, finished_at = now() WHERE session_id = ANY($1) AND status = 'running'")
                .bind(&moved)
                .bind(&died)
                .execute(&mut *tx)
                .await
                .context("ending the jobs that were running on a lost worker")?;
            sqlx::query("UPDATE jobs SET parked = true, routed_to = NULL WHERE session_id = ANY($1) AND status = 'queued' AND routed IS NOT NULL")
                .bind(&moved)
                .execute(&mut *tx)
                .await
                .context("parking the jobs of moving sessions")?;
            // Recorded before sessions could move (no execution job kept): they cannot follow.
            let lost = storable::json(&Reason::new(ErrorCode::SessionLost, format!("{why}; this job was recorded without what it takes to move it")))?;
            sqlx::query("UPDATE jobs SET status = 'rejected', reason = $2, finished_at = now() WHERE session_id = ANY($1) AND status = 'queued' AND routed IS NULL AND NOT parked")
                .bind(&moved)
                .bind(&lost)
                .execute(&mut *tx)
                .await
                .context("refusing jobs that cannot move")?;
        }
        tx.commit().await.context("committing moving sessions")?;
        Ok(moved.len() as u64)
    }

    /// Make `worker_id` the new owner of a moving session, as the worker running the job sent
    /// to take it over (`adopting_job`). Returns where it came from, or `None` when the session
    /// can no longer be taken over (it ended, or another job was sent meanwhile).
    ///
    /// Repeatable, as [`SessionStore::bind`] is: a try whose answer was lost (committed, the
    /// reply not received) is answered the same by the next try of the same job, worker and
    /// container, which finds the session active there with this job as its last taking-over
    /// job (`adopting_job` is kept until the session moves again; while it is active nothing
    /// reads it). Any other worker or container gets `None`.
    pub async fn adopt(&self, session_id: &str, job_id: &str, worker_id: &str, container_id: &str) -> Result<Option<Adopted>> {
        let row = sqlx::query(
            "UPDATE sessions SET state = 'active', worker_id = $3, container_id = $4, last_activity_at = now(),
                    expires_at = now() + keep_alive_s * interval '1 second'
             WHERE session_id = $1 AND adopting_job = $2
               AND (state = 'moving' OR (state = 'active' AND worker_id = $3 AND container_id = $4))
             RETURNING moved_from, move_cause, keep_alive_s,
                       CASE WHEN snapshot_move = moves THEN snapshot_key END AS snapshot_key,
                       CASE WHEN snapshot_move = moves THEN variables_lost END AS variables_lost",
        )
        .bind(session_id)
        .bind(job_id)
        .bind(worker_id)
        .bind(container_id)
        .fetch_optional(&self.pool)
        .await
        .context("taking a session over")?;
        let Some(row) = row else { return Ok(None) };
        let from: Option<String> = row.try_get("moved_from")?;
        let cause: Option<String> = row.try_get("move_cause")?;
        let keep_alive_s: i32 = row.try_get("keep_alive_s")?;
        let snapshot_key: Option<String> = row.try_get("snapshot_key")?;
        let lost: Option<serde_json::Value> = row.try_get("variables_lost")?;
        let variables_lost = lost.and_then(|v| serde_json::from_value::<Vec<String>>(v).ok()).unwrap_or_default();
        Ok(Some(Adopted {
            snapshot: snapshot_key.map(|key| Snapshot { key, variables_lost }),
            from_worker: from.unwrap_or_default(),
            cause: cause.as_deref().and_then(MoveCause::parse).unwrap_or(MoveCause::WorkerLost),
            keep_alive_s: u64::try_from(keep_alive_s).unwrap_or(1),
        }))
    }

    /// The files to put back in a moved session's workspace, in the order to write them: of
    /// each path, the version of the session's latest job that has it (a job's own files after
    /// its input files), oldest first. A file a job deleted comes back; one that was never
    /// stored (too large, over quota) or whose artifact expired is missing.
    ///
    /// Bounded whatever the session's history: the jobs are read newest first, one at a time
    /// (not the history at once: a long-lived session keeps every job's execution job, inline
    /// files included, and a worker taking it over read them all into its memory), an older
    /// version of a path is dropped as it is read, inline contents beyond `inline_budget` bytes
    /// (the workspace's size: no more could be written back) are [`WorkspaceFile::Over`], and
    /// at most [`MAX_WORKSPACE_ENTRIES`] paths are read.
    pub async fn workspace_of(&self, tenant: &str, session_id: &str, inline_budget: u64) -> Result<Vec<WorkspaceFile>> {
        use futures::TryStreamExt;
        let mut rows = sqlx::query(
            "SELECT j.job_id, j.routed, COALESCE(
                    (SELECT jsonb_agg(jsonb_build_array(a.path, a.s3_key, a.state) ORDER BY a.id)
                     FROM artifacts a WHERE a.tenant = j.tenant AND a.job_id = j.job_id AND a.kind = 'file'), '[]'::jsonb) AS files
             FROM jobs j WHERE j.tenant = $1 AND j.session_id = $2 AND j.status NOT IN ('queued', 'rejected')
             ORDER BY j.queued_at DESC, j.job_id DESC",
        )
        .bind(tenant)
        .bind(session_id)
        .fetch(&self.pool);
        let mut newest_first = Vec::new();
        let mut kept = KeptPaths::default();
        let mut inline_bytes = 0u64;
        while let Some(row) = rows.try_next().await.context("reading a session's stored workspace")? {
            // This job's files in the order it had them: its inputs, then what it wrote.
            let mut files = Vec::new();
            let routed: Option<Vec<u8>> = row.try_get("routed")?;
            // Every job of the session keeps its execution job (rows recorded before migration 0009 do not).
            if let Some(job) = routed.and_then(|r| serde_json::from_slice::<sandcell_protocol::ExecutionJob>(&r).ok()) {
                for f in job.files {
                    files.push(match (f.content_b64, f.s3_key) {
                        (Some(b64), _) => WorkspaceFile::Inline { path: f.path, content_b64: b64 },
                        (None, Some(key)) => WorkspaceFile::Stored { path: f.path, s3_key: key, available: true },
                        (None, None) => continue,
                    });
                }
            }
            let stored: serde_json::Value = row.try_get("files")?;
            for f in stored.as_array().into_iter().flatten() {
                let (Some(path), Some(key), Some(state)) =
                    (f.get(0).and_then(|v| v.as_str()), f.get(1).and_then(|v| v.as_str()), f.get(2).and_then(|v| v.as_str()))
                else {
                    continue;
                };
                files.push(WorkspaceFile::Stored { path: path.to_string(), s3_key: key.to_string(), available: state == "available" });
            }
            for f in files.into_iter().rev() {
                if !kept.admit(f.path()) {
                    continue;
                }
                let f = match f {
                    WorkspaceFile::Inline { path, content_b64 } if inline_bytes.saturating_add(decoded_len(&content_b64)) > inline_budget => {
                        WorkspaceFile::Over { path }
                    }
                    WorkspaceFile::Inline { path, content_b64 } => {
                        inline_bytes += decoded_len(&content_b64);
                        WorkspaceFile::Inline { path, content_b64 }
                    }
                    other => other,
                };
                newest_first.push(f);
            }
            if kept.len() >= MAX_WORKSPACE_ENTRIES {
                tracing::warn!(session_id, paths = kept.len(), "a moved session's history names too many paths; its older files are not put back");
                break;
            }
        }
        newest_first.reverse();
        Ok(newest_first)
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
             WHERE sandcell_worker_silent(w.worker_id, $1)
               AND EXISTS (SELECT 1 FROM sessions s WHERE s.worker_id = w.worker_id AND s.state IN ('starting', 'active'))",
        )
        .bind(crate::jobs::millis(silence))
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
        let millis = crate::jobs::millis(after);
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

    /// End a job whose message the broker dead-lettered ([`crate::jobs::reject_undelivered`]):
    /// `rejected` with `reason` if it was still `queued`; and a session it was opening, still
    /// `starting`, becomes `failed` with it, its other jobs refused. Returns whether the job
    /// ended here (false: it had ended, was running, or its copy waits in Postgres).
    pub async fn end_undelivered(&self, tenant: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        let reason = storable::json(reason)?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let crate::jobs::Undelivered::Rejected { session_id } = crate::jobs::reject_undelivered(&mut tx, tenant, job_id, &reason).await? else {
            return Ok(false);
        };
        if let Some(session) = session_id {
            let failed: Vec<String> = sqlx::query_scalar(
                "UPDATE sessions SET state = 'failed', ended_at = now(), end_reason = $4
                 WHERE session_id = $1 AND tenant = $2 AND created_by_job = $3 AND state = 'starting' AND state = ANY($5)
                 RETURNING session_id",
            )
            .bind(&session)
            .bind(tenant)
            .bind(job_id)
            .bind(&reason)
            .bind(states(SessionState::Failed))
            .fetch_all(&mut *tx)
            .await
            .context("failing the session a dead-lettered job was opening")?;
            if !failed.is_empty() {
                crate::jobs::refuse_jobs_of_sessions(&mut tx, &failed, &reason).await?;
            }
        }
        tx.commit().await.context("committing a dead-lettered job")?;
        Ok(true)
    }

    /// Refuse new sessions no worker took: sessions still `starting` whose opening job was
    /// dispatched (recorded, for a job the dispatcher did not hold: its dispatch is noted only
    /// by the worker that claims it) more than `wait` ago and is still `queued` (a worker without room for another
    /// session does not consume `sandcell.sessions.new`, so at a full fleet such jobs wait in the
    /// queue). The session becomes `failed` and its jobs `rejected` with `capacity`; should a
    /// worker take the message later, its claim finds the job ended and skips it. Returns how
    /// many sessions.
    pub async fn refuse_unplaced(&self, wait: Duration) -> Result<u64> {
        let millis = crate::jobs::millis(wait);
        let why = format!("no worker had room for another session within {} s", wait.as_secs());
        let reason = sandcell_protocol::storable::json(&Reason::new(ErrorCode::Capacity, why))?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let sessions: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'failed', ended_at = now(), end_reason = $2
             WHERE state = 'starting' AND state = ANY($3)
               AND EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = sessions.tenant AND j.job_id = sessions.created_by_job
                             AND j.status = 'queued' AND j.held_job IS NULL
                             AND COALESCE(j.dispatched_at, j.queued_at) < now() - $1 * interval '1 millisecond')
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

    /// End moving sessions nobody took over: those no job asked for within their keep-alive
    /// (`expired`), and those whose taking-over job no worker took within `wait` (`lost`, with
    /// `capacity`; their parked jobs are `rejected` with it). A taking-over job that will never
    /// bind its session — it ended without binding it, or the worker running it has been silent
    /// for `dead_after` (killed between its claim and the binding; it ends `worker_lost`; `None`
    /// while silence proves nothing, the database having been out) — is
    /// forgotten, so that the dispatcher sends the next parked job. Jobs parked for a session
    /// that ended meanwhile (recorded in the instant it ended) are `rejected` with its reason.
    /// Returns (expired, lost).
    pub async fn end_unadopted(&self, wait: Duration, dead_after: Option<Duration>) -> Result<(u64, u64)> {
        let millis = crate::jobs::millis(wait);
        let why = format!("no worker had room to take the session over within {} s", wait.as_secs());
        let reason = sandcell_protocol::storable::json(&Reason::new(ErrorCode::Capacity, why))?;
        let died = storable::json(&Reason::new(ErrorCode::WorkerLost, "the worker taking its session over died before it had; the job is not run again"))?;
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        if let Some(dead_after) = dead_after {
            sqlx::query(
                "UPDATE jobs SET status = 'infrastructure_error', reason = $2, finished_at = now()
                 FROM sessions s
                 WHERE s.state = 'moving' AND jobs.tenant = s.tenant AND jobs.job_id = s.adopting_job AND jobs.status = 'running'
                   AND sandcell_worker_silent(jobs.worker_id, $1)",
            )
            .bind(crate::jobs::millis(dead_after))
            .bind(&died)
            .execute(&mut *tx)
            .await
            .context("ending taking-over jobs whose worker died")?;
        }
        sqlx::query(
            "UPDATE sessions SET adopting_job = NULL
             WHERE state = 'moving' AND adopting_job IS NOT NULL
               AND EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = sessions.tenant AND j.job_id = sessions.adopting_job
                             AND j.status NOT IN ('queued', 'running'))",
        )
        .execute(&mut *tx)
        .await
        .context("forgetting taking-over jobs that ended")?;
        let stray = storable::json(&Reason::new(ErrorCode::SessionLost, "the session ended while this job was being recorded"))?;
        sqlx::query(
            "UPDATE jobs SET status = 'rejected', reason = COALESCE(s.end_reason, $1), finished_at = now()
             FROM sessions s
             WHERE jobs.session_id = s.session_id AND jobs.parked AND jobs.status = 'queued' AND s.state NOT IN ('moving', 'active')",
        )
        .bind(&stray)
        .execute(&mut *tx)
        .await
        .context("refusing parked jobs of ended sessions")?;
        let expired = sqlx::query(
            "UPDATE sessions SET state = 'expired', ended_at = now()
             WHERE state = 'moving' AND state = ANY($1) AND adopting_job IS NULL AND expires_at < now()
               AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.session_id = sessions.session_id AND j.status = 'queued')",
        )
        .bind(states(SessionState::Expired))
        .execute(&mut *tx)
        .await
        .context("expiring moving sessions")?
        .rows_affected();
        let lost: Vec<String> = sqlx::query_scalar(
            "UPDATE sessions SET state = 'lost', ended_at = now(), end_reason = $2
             WHERE state = 'moving' AND state = ANY($3)
               AND EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = sessions.tenant AND j.job_id = sessions.adopting_job
                             AND j.status = 'queued' AND j.dispatched_at < now() - $1 * interval '1 millisecond')
             RETURNING session_id",
        )
        .bind(millis)
        .bind(&reason)
        .bind(states(SessionState::Lost))
        .fetch_all(&mut *tx)
        .await
        .context("ending moving sessions no worker took")?;
        if !lost.is_empty() {
            crate::jobs::refuse_jobs_of_sessions(&mut tx, &lost, &reason).await?;
        }
        tx.commit().await.context("committing unadopted sessions")?;
        Ok((expired, lost.len() as u64))
    }

    /// Park the strays of moved sessions: jobs recorded for a session's old owner in the instant
    /// it moved (the intake read the owner, then the move was committed, then the job). Left
    /// alone they would wait in a queue no worker of the session reads until the stuck-job sweep
    /// ended them; parked, the dispatcher sends them to the session's new owner like any other.
    /// The intake takes no lock on the session row to prevent them (the one CI run with a share
    /// lock there stalled in the fleet's chaos test). Returns how many were parked.
    pub async fn park_strays(&self) -> Result<u64> {
        let n = sqlx::query(
            "UPDATE jobs SET parked = true, routed_to = NULL
             FROM sessions s
             WHERE jobs.session_id = s.session_id AND s.moves > 0 AND s.state IN ('moving', 'active')
               AND jobs.status = 'queued' AND NOT jobs.parked AND jobs.routed_to IS NOT NULL
               AND jobs.routed_to IS DISTINCT FROM s.worker_id",
        )
        .execute(&self.pool)
        .await
        .context("parking jobs recorded for a moved session's old worker")?
        .rows_affected();
        Ok(n)
    }
}

fn parse_state(s: String) -> Result<SessionState> {
    SessionState::parse(&s).with_context(|| format!("unknown session state {s:?} in database"))
}
