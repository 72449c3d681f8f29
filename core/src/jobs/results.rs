//! A job's end: the worker's commit of its result and artifacts (one transaction), and the
//! result as a client reads it.

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sandcell_protocol::storable;
use sandcell_protocol::{ArtifactKind, Execution, JobResult, JobStatus, Reason};

use super::{status_list, JobStore, SessionTouch};

/// A file or figure a job produced, ready to be recorded.
#[derive(Debug, Clone)]
pub struct NewArtifact {
    /// Workspace-relative path (or `_display/N.png`).
    pub path: String,
    /// File or rich output.
    pub kind: ArtifactKind,
    /// Size in bytes.
    pub size_bytes: i64,
    /// MIME type.
    pub content_type: String,
    /// Hex SHA-256.
    pub sha256: String,
    /// Object key.
    pub s3_key: String,
    /// Expiry.
    pub expires_at: DateTime<Utc>,
    /// Presigned GET URL valid until `expires_at`.
    pub download_url: String,
}

/// The outcome of running a job, as the worker commits it.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Terminal status.
    pub status: JobStatus,
    /// Infrastructure reason, if any.
    pub reason: Option<Reason>,
    /// What the code did, stored as one document (`jobs.execution`).
    pub execution: Execution,
    /// Stored artifacts.
    pub artifacts: Vec<NewArtifact>,
    /// The container that ran the job.
    pub container_id: Option<String>,
    /// The session to extend or close in the same transaction.
    pub session: Option<SessionTouch>,
}

impl Finished {
    /// A result with a status and a reason and nothing else (the fallback when the full result
    /// cannot be stored).
    pub fn bare(status: JobStatus, reason: Reason, container_id: Option<String>, session: Option<SessionTouch>) -> Self {
        Finished { status, reason: Some(reason), execution: Execution::default(), artifacts: Vec::new(), container_id, session }
    }
}

impl JobStore {
    /// Commit a job's outcome and its artifacts in one transaction. Returns false when the job
    /// was no longer in a state that may become `fin.status` (someone else finished it).
    pub async fn finish(&self, tenant: &str, job_id: &str, fin: &Finished) -> Result<bool> {
        if fin.artifacts.is_empty() && !fin.session.as_ref().is_some_and(|s| s.close) {
            return self.finish_in_one_statement(tenant, job_id, fin).await;
        }
        let mut tx = self.pool.begin().await.context("beginning result transaction")?;
        let n = sqlx::query(
            "UPDATE jobs SET status = $3, reason = $4, execution = $5, container_id = $6, finished_at = now()
             WHERE tenant = $1 AND job_id = $2 AND status = ANY($7)",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(fin.status.as_str())
        .bind(fin.reason.as_ref().map(storable::json).transpose()?)
        .bind(storable::json(&fin.execution)?)
        .bind(&fin.container_id)
        .bind(status_list(fin.status))
        .execute(&mut *tx)
        .await
        .context("updating job result")?
        .rows_affected();
        if n == 0 {
            tx.rollback().await.ok();
            return Ok(false);
        }
        for a in &fin.artifacts {
            sqlx::query(
                "INSERT INTO artifacts (tenant, job_id, path, kind, size_bytes, content_type, sha256, s3_key, expires_at, download_url)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                 ON CONFLICT (tenant, job_id, path) DO NOTHING",
            )
            .bind(tenant)
            .bind(job_id)
            .bind(&a.path)
            .bind(match a.kind {
                ArtifactKind::File => "file",
                ArtifactKind::Display => "display",
                ArtifactKind::Fetched => "fetched",
            })
            .bind(a.size_bytes)
            .bind(&a.content_type)
            .bind(&a.sha256)
            .bind(&a.s3_key)
            .bind(a.expires_at)
            .bind(&a.download_url)
            .execute(&mut *tx)
            .await
            .context("inserting artifact")?;
        }
        sqlx::query("DELETE FROM artifact_reservations WHERE tenant = $1 AND job_id = $2")
            .bind(tenant)
            .bind(job_id)
            .execute(&mut *tx)
            .await
            .context("releasing the artifact reservation")?;
        if let Some(touch) = &fin.session {
            crate::sessions::touch(&mut tx, touch).await?;
        }
        tx.commit().await.context("committing job result")?;
        Ok(true)
    }

    /// [`JobStore::finish`] of a job with no artifacts whose session (if any) goes on: the same
    /// writes as the transaction (the result, the reservation released, the keep-alive
    /// extended, each only if the result was taken), in one statement, so one round trip
    /// instead of five. Most jobs end this way.
    async fn finish_in_one_statement(&self, tenant: &str, job_id: &str, fin: &Finished) -> Result<bool> {
        let taken: i64 = sqlx::query_scalar(
            "WITH done AS (
                 UPDATE jobs SET status = $3, reason = $4, execution = $5, container_id = $6, finished_at = now()
                 WHERE tenant = $1 AND job_id = $2 AND status = ANY($7)
                 RETURNING 1),
             released AS (
                 DELETE FROM artifact_reservations WHERE tenant = $1 AND job_id = $2 AND EXISTS (SELECT 1 FROM done)),
             extended AS (
                 UPDATE sessions SET keep_alive_s = COALESCE($9, keep_alive_s), last_activity_at = now(),
                                     expires_at = now() + COALESCE($9, keep_alive_s) * interval '1 second'
                 WHERE session_id = $8 AND state = 'active' AND EXISTS (SELECT 1 FROM done))
             SELECT count(*) FROM done",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(fin.status.as_str())
        .bind(fin.reason.as_ref().map(storable::json).transpose()?)
        .bind(storable::json(&fin.execution)?)
        .bind(&fin.container_id)
        .bind(status_list(fin.status))
        .bind(fin.session.as_ref().map(|s| s.id.as_str()))
        .bind(fin.session.as_ref().and_then(|s| s.keep_alive_s).map(|k| i32::try_from(k).unwrap_or(i32::MAX)))
        .fetch_one(&self.pool)
        .await
        .context("committing job result")?;
        Ok(taken > 0)
    }

    /// The result record of one job, as a client sees it ([`crate::reads::result`]).
    pub async fn result(&self, tenant: &str, job_id: &str) -> Result<Option<JobResult>> {
        crate::reads::result(&self.pool, tenant, job_id).await
    }
}
