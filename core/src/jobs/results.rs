//! A job's end: the worker's commit of its result and artifacts (one transaction), and the
//! result as a client reads it.

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sandcell_protocol::storable;
use sandcell_protocol::{ArtifactKind, ExecError, FileListing, JobResult, JobStatus, LimitHit, Output, Reason, SkippedFile};
use sqlx::Row;

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
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
    /// stdout was cut at the cap.
    pub stdout_truncated: bool,
    /// stderr was cut at the cap.
    pub stderr_truncated: bool,
    /// Exit code.
    pub exit_code: Option<i32>,
    /// Exception raised by the code.
    pub error: Option<ExecError>,
    /// Infrastructure reason, if any.
    pub reason: Option<Reason>,
    /// Rich outputs.
    pub outputs: Vec<Output>,
    /// Stored artifacts.
    pub artifacts: Vec<NewArtifact>,
    /// The session's kernel was replaced during the job.
    pub kernel_restarted: bool,
    /// Workspace listing, when asked for.
    pub files: Option<FileListing>,
    /// The container that ran the job.
    pub container_id: Option<String>,
    /// Sandbox limits the job ran into.
    pub limits_hit: Vec<LimitHit>,
    /// Files not stored, and why.
    pub skipped_files: Vec<SkippedFile>,
    /// Processes left running by the cell and killed at its end.
    pub processes_killed: u32,
    /// The session to extend or close in the same transaction.
    pub session: Option<SessionTouch>,
}

impl Finished {
    /// A result with a status and a reason and nothing else (the fallback when the full result
    /// cannot be stored).
    pub fn bare(status: JobStatus, reason: Reason, container_id: Option<String>, session: Option<SessionTouch>) -> Self {
        Finished {
            status,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            exit_code: None,
            error: None,
            reason: Some(reason),
            outputs: Vec::new(),
            artifacts: Vec::new(),
            kernel_restarted: false,
            files: None,
            container_id,
            limits_hit: Vec::new(),
            skipped_files: Vec::new(),
            processes_killed: 0,
            session,
        }
    }
}

impl JobStore {
    /// Commit a job's outcome and its artifacts in one transaction. Returns false when the job
    /// was no longer in a state that may become `fin.status` (someone else finished it).
    pub async fn finish(&self, tenant: &str, job_id: &str, fin: &Finished) -> Result<bool> {
        let mut tx = self.pool.begin().await.context("beginning result transaction")?;
        let n = sqlx::query(
            "UPDATE jobs SET status = $3, stdout = $4, stderr = $5, stdout_truncated = $6, stderr_truncated = $7,
                    exit_code = $8, error = $9, reason = $10, outputs = $11, finished_at = now(),
                    kernel_restarted = $13, files = $14, container_id = $15,
                    limits_hit = $16, skipped_files = $17, processes_killed = $18
             WHERE tenant = $1 AND job_id = $2 AND status = ANY($12)",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(fin.status.as_str())
        .bind(storable::text(&fin.stdout))
        .bind(storable::text(&fin.stderr))
        .bind(fin.stdout_truncated)
        .bind(fin.stderr_truncated)
        .bind(fin.exit_code)
        .bind(fin.error.as_ref().map(storable::json).transpose()?)
        .bind(fin.reason.as_ref().map(storable::json).transpose()?)
        .bind(storable::json(&fin.outputs)?)
        .bind(status_list(fin.status))
        .bind(fin.kernel_restarted)
        .bind(fin.files.as_ref().map(storable::json).transpose()?)
        .bind(&fin.container_id)
        .bind(storable::json(&fin.limits_hit)?)
        .bind(storable::json(&fin.skipped_files)?)
        .bind(i32::try_from(fin.processes_killed).unwrap_or(i32::MAX))
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

    /// The result record of one job, as a client sees it.
    pub async fn result(&self, tenant: &str, job_id: &str) -> Result<Option<JobResult>> {
        let row = sqlx::query("SELECT result FROM job_results WHERE tenant = $1 AND job_id = $2")
            .bind(tenant)
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await
            .context("reading job result")?;
        match row {
            None => Ok(None),
            Some(r) => {
                let v: serde_json::Value = r.try_get("result")?;
                Ok(Some(serde_json::from_value(v).context("decoding job result")?))
            }
        }
    }
}
