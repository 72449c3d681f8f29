//! The scheduler's answers to tenants' upload requests (`uploads`): written here, read by
//! clients through [`crate::reads::upload_grant`]; and how long what a grant let a tenant put
//! in the store is kept (migration 0019): its granted bytes count against the tenant's
//! stored-bytes quota until the sweeper removes its objects.

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sandcell_protocol::upload::UploadGrant;
use sandcell_protocol::{ErrorCode, Reason};
use sqlx::postgres::PgPool;
use sqlx::Row;

use crate::tenants::{Quotas, KEPT_REFUSALS_OVER_QUOTA};

/// The answer that stands for a `(tenant, upload_id)` after [`record`] or [`grant`].
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The grant recorded first: this call's, or one recorded before it.
    pub grant: UploadGrant,
    /// Whether this call's grant was the one recorded (`false`: an earlier answer stands).
    pub inserted: bool,
}

/// Record an answer that puts nothing in the store (a refusal) unless the `(tenant,
/// upload_id)` has one: the same request asked again keeps its first answer, which is
/// returned, with whether this call recorded it.
pub async fn record(pool: &PgPool, grant: &UploadGrant) -> Result<Recorded> {
    let mut tx = pool.begin().await.context("beginning an upload answer")?;
    let recorded = insert(&mut *tx, grant, 0, None).await?;
    forget_refusals_past_quota(&mut tx, &recorded).await?;
    tx.commit().await.context("committing an upload answer")?;
    Ok(recorded)
}

/// After recording a refusal for a tenant over its `max_result_bytes`, delete its refused
/// answers past the newest [`KEPT_REFUSALS_OVER_QUOTA`]: the newest are read without a lock
/// (`uploads_refused`, migration 0027) for the cutoff; only older answers are locked, and those
/// another recording is deleting are skipped, not waited for.
async fn forget_refusals_past_quota(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, recorded: &Recorded) -> Result<()> {
    if !recorded.inserted || recorded.grant.status != "rejected" {
        return Ok(());
    }
    let forgotten = sqlx::query(
        "DELETE FROM uploads u USING (
             SELECT r.tenant, r.upload_id FROM uploads r
              WHERE sandcell_over_result_bytes($1)
                AND r.tenant = $1 AND r.grant_doc->>'status' = 'rejected'
                AND r.created_at < (SELECT k.created_at FROM uploads k
                                     WHERE k.tenant = $1 AND k.grant_doc->>'status' = 'rejected'
                                     ORDER BY k.created_at DESC OFFSET $2 - 1 LIMIT 1)
              FOR UPDATE SKIP LOCKED) old
          WHERE u.tenant = old.tenant AND u.upload_id = old.upload_id",
    )
    .bind(&recorded.grant.tenant)
    .bind(KEPT_REFUSALS_OVER_QUOTA)
    .execute(&mut **tx)
    .await
    .context("deleting the old upload refusals of a tenant over its result bytes quota")?
    .rows_affected();
    if forgotten > 0 {
        tracing::debug!(tenant = recorded.grant.tenant, forgotten, "deleted old upload refusals of a tenant over its result bytes quota");
    }
    Ok(())
}

/// Record a `ready` grant that lets its tenant put `bytes` in the store, kept until
/// `objects_expire_at`, if the tenant's stored-bytes quota has room for them (under the
/// tenant's row lock, so grants and job commits at the same moment cannot together overshoot
/// it); otherwise a refusal, `quota_exceeded` with the figures. As [`record`], a first answer
/// stands. A tenant with no row (named by a trusted publisher) is registered with `defaults`,
/// as by its first job.
pub async fn grant(pool: &PgPool, grant: &UploadGrant, bytes: u64, objects_expire_at: DateTime<Utc>, defaults: &Quotas) -> Result<Recorded> {
    let mut tx = pool.begin().await.context("beginning an upload grant")?;
    crate::tenants::ensure(&mut tx, &grant.tenant, defaults).await?;
    let max = crate::tenants::lock_stored_bytes_quota(&mut tx, &grant.tenant).await?;
    let standing: Option<serde_json::Value> = sqlx::query_scalar("SELECT grant_doc FROM uploads WHERE tenant = $1 AND upload_id = $2")
        .bind(&grant.tenant)
        .bind(&grant.upload_id)
        .fetch_optional(&mut *tx)
        .await
        .context("looking for a standing upload grant")?;
    if let Some(doc) = standing {
        tx.commit().await.context("ending an upload grant")?;
        return Ok(Recorded { grant: serde_json::from_value(doc).context("decoding a recorded upload grant")?, inserted: false });
    }
    // `ensure` made the row: a tenant without one would have no quota.
    let max = max.unwrap_or(i64::MAX);
    let used = crate::tenants::stored_bytes(&mut tx, &grant.tenant, None).await?;
    let wanted = i64::try_from(bytes).unwrap_or(i64::MAX);
    let (kept, max_kept) = crate::tenants::kept_bytes(&mut tx, &grant.tenant).await?.unwrap_or((0, i64::MAX));
    let refusal = if used.saturating_add(wanted) > max {
        Some(format!(
            "tenant stores or may upload {used} bytes, the upload asks for {bytes} more; its quota is {max} (wait for artifacts and uploads to expire)"
        ))
    } else if kept >= max_kept {
        Some(format!(
            "tenant keeps {kept} bytes of job results and upload answers in the database; its quota is {max_kept} (they are deleted SANDCELL_RESULT_RETENTION_S after they end)"
        ))
    } else {
        None
    };
    let recorded = match refusal {
        Some(reason) => {
            insert(&mut *tx, &UploadGrant::rejected(&grant.tenant, &grant.upload_id, Reason::new(ErrorCode::QuotaExceeded, reason)), 0, None).await?
        }
        None => insert(&mut *tx, grant, bytes, Some(objects_expire_at)).await?,
    };
    forget_refusals_past_quota(&mut tx, &recorded).await?;
    tx.commit().await.context("committing an upload grant")?;
    Ok(recorded)
}

/// The one insert into `uploads`. The no-op update makes a conflict return the standing row;
/// `xmax = 0` holds only for a row this statement inserted (an updated row carries this
/// transaction's id in `xmax`).
async fn insert<'e>(db: impl sqlx::PgExecutor<'e>, grant: &UploadGrant, bytes: u64, objects_expire_at: Option<DateTime<Utc>>) -> Result<Recorded> {
    let doc = serde_json::to_value(grant).context("encoding an upload grant")?;
    let (kept, inserted): (serde_json::Value, bool) = sqlx::query_as(
        "INSERT INTO uploads (tenant, upload_id, grant_doc, granted_bytes, objects_expire_at) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (tenant, upload_id) DO UPDATE SET tenant = uploads.tenant
         RETURNING grant_doc, (xmax = 0)",
    )
    .bind(&grant.tenant)
    .bind(&grant.upload_id)
    .bind(doc)
    .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
    .bind(objects_expire_at)
    .fetch_one(db)
    .await
    .context("recording an upload grant")?;
    let grant = serde_json::from_value(kept).context("decoding a recorded upload grant")?;
    Ok(Recorded { grant, inserted })
}

/// A grant whose objects are due for removal.
#[derive(Debug, Clone)]
pub struct ExpiredUpload {
    /// Its tenant.
    pub tenant: String,
    /// Its id.
    pub upload_id: String,
    /// The keys it let the tenant put.
    pub keys: Vec<String>,
}

/// Up to `limit` grants whose objects' time is over and which are not removed yet, oldest first.
/// The keys are read from the document in SQL: a document this version cannot decode (an older
/// or newer one) is still swept.
pub async fn expired(pool: &PgPool, limit: i64) -> Result<Vec<ExpiredUpload>> {
    let rows = sqlx::query(
        "SELECT tenant, upload_id,
                ARRAY(SELECT f->>'s3_key' FROM jsonb_array_elements(CASE WHEN jsonb_typeof(grant_doc->'files') = 'array'
                                                                         THEN grant_doc->'files' ELSE '[]' END) f
                      WHERE f->>'s3_key' IS NOT NULL) AS keys
         FROM uploads
         WHERE objects_expire_at IS NOT NULL AND objects_removed_at IS NULL AND objects_expire_at <= now()
         ORDER BY objects_expire_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("scanning expired uploads")?;
    rows.into_iter().map(|r| Ok(ExpiredUpload { tenant: r.try_get("tenant")?, upload_id: r.try_get("upload_id")?, keys: r.try_get("keys")? })).collect()
}

/// Try a grant whose objects could not all be deleted again in `after`, behind the others: one
/// the store keeps refusing must not hold up every later grant's removal. Its bytes still count.
pub async fn postpone(pool: &PgPool, tenant: &str, upload_id: &str, after: std::time::Duration) -> Result<()> {
    sqlx::query("UPDATE uploads SET objects_expire_at = now() + $3 WHERE tenant = $1 AND upload_id = $2 AND objects_removed_at IS NULL")
        .bind(tenant)
        .bind(upload_id)
        .bind(after)
        .execute(pool)
        .await
        .context("postponing an upload's removal")?;
    Ok(())
}

/// Mark a grant's objects removed: its bytes no longer count against its tenant's quota.
pub async fn mark_removed(pool: &PgPool, tenant: &str, upload_id: &str) -> Result<bool> {
    let n = sqlx::query("UPDATE uploads SET objects_removed_at = now() WHERE tenant = $1 AND upload_id = $2 AND objects_removed_at IS NULL")
        .bind(tenant)
        .bind(upload_id)
        .execute(pool)
        .await
        .context("marking an upload's objects removed")?
        .rows_affected();
    Ok(n == 1)
}
