//! The scheduler's answers to tenants' upload requests (`uploads`): written here, read by
//! clients through [`crate::reads::upload_grant`].

use anyhow::{Context, Result};
use sandcell_protocol::upload::UploadGrant;
use sqlx::postgres::PgPool;

/// The answer that stands for a `(tenant, upload_id)` after [`record`].
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The grant recorded first: this call's, or one recorded before it.
    pub grant: UploadGrant,
    /// Whether this call's grant was the one recorded (`false`: an earlier answer stands).
    pub inserted: bool,
}

/// Record an upload grant unless the `(tenant, upload_id)` has one: the same request asked
/// again keeps its first answer, which is returned, with whether this call recorded it.
pub async fn record(pool: &PgPool, grant: &UploadGrant) -> Result<Recorded> {
    let doc = serde_json::to_value(grant).context("encoding an upload grant")?;
    // The no-op update makes a conflict return the standing row; `xmax = 0` holds only for a
    // row this statement inserted (an updated row carries this transaction's id in `xmax`).
    let (kept, inserted): (serde_json::Value, bool) = sqlx::query_as(
        "INSERT INTO uploads (tenant, upload_id, grant_doc) VALUES ($1, $2, $3)
         ON CONFLICT (tenant, upload_id) DO UPDATE SET tenant = uploads.tenant
         RETURNING grant_doc, (xmax = 0)",
    )
    .bind(&grant.tenant)
    .bind(&grant.upload_id)
    .bind(doc)
    .fetch_one(pool)
    .await
    .context("recording an upload grant")?;
    let grant = serde_json::from_value(kept).context("decoding a recorded upload grant")?;
    Ok(Recorded { grant, inserted })
}
