//! Fair share: a tenant's jobs beyond its `max_jobs_in_flight` wait here, in Postgres, and the
//! scheduler's dispatcher takes them round-robin across tenants.

use anyhow::{Context, Result};
use sqlx::Row;

use super::JobStore;

/// A held job taken for dispatch: publish [`HeldJob::payload`] to the shared queue, then call
/// [`HeldJob::dispatched`]. Dropped instead (the publish failed), the job stays held.
pub struct HeldJob {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    /// Its tenant.
    pub tenant: String,
    /// Its id.
    pub job_id: String,
    /// The execution job, as recorded at intake.
    pub payload: Vec<u8>,
}

impl HeldJob {
    /// The broker confirmed the publish: the job is in flight, and its tenant goes to the back
    /// of the round-robin.
    pub async fn dispatched(mut self) -> Result<()> {
        sqlx::query("UPDATE jobs SET held_job = NULL, dispatched_at = now() WHERE tenant = $1 AND job_id = $2")
            .bind(&self.tenant)
            .bind(&self.job_id)
            .execute(&mut *self.tx)
            .await
            .context("marking a held job dispatched")?;
        sqlx::query("UPDATE tenants SET last_dispatch_at = clock_timestamp() WHERE tenant = $1")
            .bind(&self.tenant)
            .execute(&mut *self.tx)
            .await
            .context("moving the tenant to the back of the round-robin")?;
        self.tx.commit().await.context("committing a dispatch")
    }
}

impl JobStore {
    /// Tenants with held jobs, the one dispatched to longest ago first: the dispatcher's
    /// round-robin order.
    pub async fn tenants_with_held_jobs(&self, limit: i64) -> Result<Vec<String>> {
        sqlx::query_scalar(
            "SELECT t.tenant FROM tenants t
             WHERE EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = t.tenant AND j.held_job IS NOT NULL AND j.status = 'queued')
             ORDER BY t.last_dispatch_at NULLS FIRST, t.tenant LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .context("listing tenants with held jobs")
    }

    /// The oldest held job of `tenant` when the tenant has room for one more job in flight.
    /// The tenant's row stays locked (no intake of its jobs, no other dispatcher) until the
    /// [`HeldJob`] is marked dispatched or dropped; `None` also when another scheduler holds
    /// that lock.
    pub async fn take_held(&self, tenant: &str) -> Result<Option<HeldJob>> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let locked = sqlx::query("SELECT 1 FROM tenants WHERE tenant = $1 FOR UPDATE SKIP LOCKED")
            .bind(tenant)
            .fetch_optional(&mut *tx)
            .await
            .context("locking tenant")?;
        if locked.is_none() {
            return Ok(None);
        }
        // The tenant's shared jobs in flight as `tenant_job_counts` keeps them (exact under the
        // tenant's lock, as in `sandcell_record_job`), not counted from its backlog.
        let room: bool = sqlx::query_scalar(
            "SELECT (SELECT COALESCE(sum(c.shared_out), 0) FROM tenant_job_counts c WHERE c.tenant = t.tenant) < t.max_jobs_in_flight
             FROM tenants t WHERE t.tenant = $1",
        )
        .bind(tenant)
        .fetch_one(&mut *tx)
        .await
        .context("counting the tenant's jobs in flight")?;
        if !room {
            return Ok(None);
        }
        let row = sqlx::query(
            "SELECT job_id, held_job FROM jobs WHERE tenant = $1 AND held_job IS NOT NULL AND status = 'queued'
             ORDER BY queued_at, job_id LIMIT 1",
        )
        .bind(tenant)
        .fetch_optional(&mut *tx)
        .await
        .context("reading the oldest held job")?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(HeldJob { tx, tenant: tenant.to_string(), job_id: row.try_get("job_id")?, payload: row.try_get("held_job")? }))
    }
}
