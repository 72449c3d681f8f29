//! A client's read: the result of a job, a session as its tenant sees it, and the tenant's
//! notification channel — what a client needs from Postgres, and nothing of the stores that
//! write (available without the `services` feature).
//!
//! Every read goes through the views and columns granted to tenants' roles, so the same calls
//! work for a tenant's own database login (row-level security shows it only its rows) and for
//! the service role.

use anyhow::{Context, Result};
use sandcell_protocol::{JobResult, Session};
use sqlx::postgres::PgPool;
use sqlx::Row;

/// The result record of one job (`job_results`), decoded strictly.
pub async fn result(pool: &PgPool, tenant: &str, job_id: &str) -> Result<Option<JobResult>> {
    let row = sqlx::query("SELECT result FROM job_results WHERE tenant = $1 AND job_id = $2")
        .bind(tenant)
        .bind(job_id)
        .fetch_optional(pool)
        .await
        .context("reading job result")?;
    row.map(|r| {
        let v: serde_json::Value = r.try_get("result")?;
        JobResult::from_document(v).map_err(anyhow::Error::msg)
    })
    .transpose()
}

/// One session as its tenant sees it (`session_documents`).
pub async fn session(pool: &PgPool, tenant: &str, session_id: &str) -> Result<Option<Session>> {
    let row = sqlx::query("SELECT document FROM session_documents WHERE session_id = $1 AND tenant = $2")
        .bind(session_id)
        .bind(tenant)
        .fetch_optional(pool)
        .await
        .context("reading session")?;
    row.map(|r| {
        let v: serde_json::Value = r.try_get("document")?;
        serde_json::from_value(v).context("decoding session")
    })
    .transpose()
}

/// The secret notification channel of `tenant` (readable by the service role, and by the
/// tenant's own role through row-level security).
pub async fn notify_channel(pool: &PgPool, tenant: &str) -> Result<Option<String>> {
    sqlx::query_scalar("SELECT notify_channel FROM tenants WHERE tenant = $1")
        .bind(tenant)
        .fetch_optional(pool)
        .await
        .context("reading the tenant's notification channel")
}

/// The scheduler's answer to an upload request (`uploads`), once there is one.
pub async fn upload_grant(pool: &PgPool, tenant: &str, upload_id: &str) -> Result<Option<sandcell_protocol::upload::UploadGrant>> {
    let doc: Option<serde_json::Value> = sqlx::query_scalar("SELECT grant_doc FROM uploads WHERE tenant = $1 AND upload_id = $2")
        .bind(tenant)
        .bind(upload_id)
        .fetch_optional(pool)
        .await
        .context("reading an upload grant")?;
    doc.map(|d| serde_json::from_value(d).context("decoding an upload grant")).transpose()
}
