//! The scheduler's answers to tenants' upload requests (`uploads`): written here, read by
//! clients through [`crate::reads::upload_grant`].

use anyhow::{Context, Result};
use sandcell_protocol::upload::UploadGrant;
use sqlx::postgres::PgPool;

/// Record an upload grant; the same `(tenant, upload_id)` asked again keeps its first answer,
/// which is returned.
pub async fn record(pool: &PgPool, grant: &UploadGrant) -> Result<UploadGrant> {
    let doc = serde_json::to_value(grant).context("encoding an upload grant")?;
    let kept: serde_json::Value = sqlx::query_scalar(
        "INSERT INTO uploads (tenant, upload_id, grant_doc) VALUES ($1, $2, $3)
         ON CONFLICT (tenant, upload_id) DO UPDATE SET tenant = uploads.tenant
         RETURNING grant_doc",
    )
    .bind(&grant.tenant)
    .bind(&grant.upload_id)
    .bind(doc)
    .fetch_one(pool)
    .await
    .context("recording an upload grant")?;
    serde_json::from_value(kept).context("decoding a recorded upload grant")
}

/// Record an upload grant unless the `(tenant, upload_id)` has one; whether this one was
/// recorded (`false`: the first answer stands).
pub async fn record_if_none(pool: &PgPool, grant: &UploadGrant) -> Result<bool> {
    let doc = serde_json::to_value(grant).context("encoding an upload grant")?;
    let inserted = sqlx::query("INSERT INTO uploads (tenant, upload_id, grant_doc) VALUES ($1, $2, $3) ON CONFLICT (tenant, upload_id) DO NOTHING")
        .bind(&grant.tenant)
        .bind(&grant.upload_id)
        .bind(doc)
        .execute(pool)
        .await
        .context("recording an upload grant")?;
    Ok(inserted.rows_affected() == 1)
}
