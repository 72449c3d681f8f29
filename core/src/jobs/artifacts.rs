//! Artifact rows past their expiry: what the sweeper deletes from the store, then marks.

use anyhow::{Context, Result};
use sqlx::Row;

use super::JobStore;

/// An artifact whose TTL has passed.
#[derive(Debug, Clone)]
pub struct ExpiredArtifact {
    /// Row id.
    pub id: i64,
    /// Object key to delete.
    pub s3_key: String,
}

impl JobStore {
    /// Available artifacts whose expiry has passed.
    pub async fn expired_artifacts(&self, limit: i64) -> Result<Vec<ExpiredArtifact>> {
        let rows = sqlx::query("SELECT id, s3_key FROM artifacts WHERE state = 'available' AND expires_at <= now() ORDER BY expires_at LIMIT $1")
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .context("scanning expired artifacts")?;
        rows.into_iter().map(|r| Ok(ExpiredArtifact { id: r.try_get("id")?, s3_key: r.try_get("s3_key")? })).collect()
    }

    /// Mark artifacts expired after their objects were deleted.
    pub async fn mark_artifacts_expired(&self, ids: &[i64]) -> Result<u64> {
        let n = sqlx::query("UPDATE artifacts SET state = 'expired', download_url = NULL WHERE id = ANY($1) AND state = 'available'")
            .bind(ids)
            .execute(&self.pool)
            .await
            .context("marking artifacts expired")?
            .rows_affected();
        Ok(n)
    }
}
