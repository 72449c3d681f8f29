//! How long sandcell keeps what it finished with: a job's result (and its refusal, for a
//! submission it refused) and the answer to an upload request are deleted
//! `SANDCELL_RESULT_RETENTION_S` after they ended (migration 0021). The one place that forgets.
//!
//! Why: every result is a row of Postgres (up to a few MB: its output within the job's caps), and
//! every refusal and upload answer one more. Kept forever, the database shared by all tenants
//! grew with each tenant's history, without bound.
//!
//! What is kept past the retention, and why:
//! - a job of a session that is still live (`starting`, `active`, `moving`): a session that
//!   moves rebuilds its workspace from its jobs (`SessionStore::workspace_of`);
//! - a job with an artifact still `available`: its row holds the artifact's key, and its bytes
//!   count against the tenant's quota until the artifact sweeper removes the object (the
//!   retention is never shorter than a day past the longest artifact TTL, so this is only an
//!   object the store would not delete);
//! - an upload whose objects are still in the store (the upload sweeper has not removed them).
//!
//! A session's own row (and, for a sandbox the E2B gateway opened, its `gateway_sandboxes` and
//! `gateway_contexts` rows) goes once the session ended that long ago and its jobs are gone
//! (they reference it), unless a snapshot of it still waits for the sweeper (migration 0025).
//! A job naming a forgotten session is refused as naming no session.
//!
//! A job id is remembered as long as its result: a submission reusing it after the retention
//! is a new job.

use std::time::Duration;

use anyhow::{Context, Result};
use sqlx::postgres::PgPool;

/// Delete up to `batch` jobs that ended more than `retention` ago, oldest first, other than
/// those kept (see the module's docs); their artifacts' rows and reservations go with them.
/// Returns how many were deleted.
pub async fn forget_jobs(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64> {
    let done = sqlx::query(
        "WITH old AS (
             SELECT j.tenant, j.job_id FROM jobs j
              WHERE j.finished_at < now() - make_interval(secs => $1)
                AND j.status NOT IN ('queued', 'running')
                AND NOT EXISTS (SELECT 1 FROM sessions s
                                 WHERE s.session_id = j.session_id AND s.state IN ('starting', 'active', 'moving'))
                AND NOT EXISTS (SELECT 1 FROM artifacts a
                                 WHERE a.tenant = j.tenant AND a.job_id = j.job_id AND a.state = 'available')
              ORDER BY j.finished_at
              LIMIT $2
              FOR UPDATE OF j SKIP LOCKED)
         DELETE FROM jobs j USING old WHERE j.tenant = old.tenant AND j.job_id = old.job_id",
    )
    .bind(retention.as_secs_f64())
    .bind(batch)
    .execute(pool)
    .await
    .context("deleting results past their retention")?;
    Ok(done.rows_affected())
}

/// Delete up to `batch` upload answers recorded more than `retention` ago whose objects are
/// gone (removed by the upload sweeper, or never granted: a refusal). Returns how many.
pub async fn forget_uploads(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM uploads u USING (
             SELECT tenant, upload_id FROM uploads
              WHERE created_at < now() - make_interval(secs => $1)
                AND (objects_expire_at IS NULL OR objects_removed_at IS NOT NULL)
              ORDER BY created_at
              LIMIT $2
              FOR UPDATE SKIP LOCKED) old
          WHERE u.tenant = old.tenant AND u.upload_id = old.upload_id",
    )
    .bind(retention.as_secs_f64())
    .bind(batch)
    .execute(pool)
    .await
    .context("deleting upload answers past their retention")?;
    Ok(done.rows_affected())
}

/// Delete up to `batch` sessions that ended more than `retention` ago and have no job left,
/// oldest first, with the gateway's rows for them (its sandbox and code contexts), in one
/// transaction. A session whose snapshot the sweeper has not yet deleted is kept. Returns how
/// many sessions were deleted.
pub async fn forget_sessions(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64> {
    let mut tx = pool.begin().await.context("beginning the deletion of ended sessions")?;
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT s.session_id FROM sessions s
          WHERE s.ended_at < now() - make_interval(secs => $1)
            AND s.state NOT IN ('starting', 'active', 'moving')
            AND s.snapshot_key IS NULL
            AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.session_id = s.session_id)
          ORDER BY s.ended_at
          LIMIT $2
          FOR UPDATE OF s SKIP LOCKED",
    )
    .bind(retention.as_secs_f64())
    .bind(batch)
    .fetch_all(&mut *tx)
    .await
    .context("finding ended sessions past their retention")?;
    if ids.is_empty() {
        return Ok(0);
    }
    sqlx::query("DELETE FROM gateway_contexts WHERE session_id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .context("deleting the code contexts of ended sessions")?;
    sqlx::query("DELETE FROM gateway_sandboxes WHERE session_id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .context("deleting the gateway sandboxes of ended sessions")?;
    let done = sqlx::query("DELETE FROM sessions WHERE session_id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .context("deleting ended sessions past their retention")?;
    tx.commit().await.context("committing the deletion of ended sessions")?;
    Ok(done.rows_affected())
}
