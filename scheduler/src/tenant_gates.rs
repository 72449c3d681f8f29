//! How many of one tenant's intake handlers this scheduler runs at once.
//!
//! Every handler of a tenant's message takes that tenant's row lock in Postgres (a job's record,
//! `sandcell_record_job`; an upload's grant recorded on its own, `sandcell_core::uploads::grant`),
//! so a tenant's handlers run one after another whatever their number. (What needs no judgment
//! under the lock takes no place: refusals from the quota memory and of invalid submissions, and
//! upload grants, which one writer task records in batches on one connection,
//! `crate::uploads::Grants`.) Before, the intake started every
//! delivery it had prefetched at once (32 a partition, 8 partitions): a tenant flooding upload
//! requests had up to 256 handlers asking for the scheduler's 8 database connections, each
//! holding its connection while it waited for the tenant's lock. Every connection was then
//! one tenant's, for as long as its flood lasted (30 s in a CI run): other tenants' submissions,
//! the dispatcher and the sweepers timed out waiting for one (the sweeper's ping failed and it
//! skipped its ticks). Now a handler first takes one of its tenant's `SANDCELL_INTAKE_TENANT_CONCURRENCY`
//! places here, then a connection: one tenant holds at most that many of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The default of `SANDCELL_INTAKE_TENANT_CONCURRENCY`: half the scheduler's database
/// connections by default (`SANDCELL_SCHEDULER_DB_CONNECTIONS`, 8), so a tenant's flood always leaves the other half to everyone else. A tenant's
/// handlers overlap outside its lock (parsing, the broker's confirm and ack): measured, one
/// tenant's 1,500 refusals took 4.4 s through 4 places, 6.0 s through 2, 4.0 s ungated.
pub const DEFAULT_TENANT_CONCURRENCY: usize = 4;

/// The tenant a message's body names (`tenant`, as in submissions, upload and cancel requests),
/// read only for a trusted publisher's message.
pub fn named_tenant(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        tenant: String,
    }
    serde_json::from_slice::<Named>(body).ok().map(|n| n.tenant)
}

/// Each tenant's places, made on first use and forgotten once nobody holds or waits for one.
#[derive(Debug, Clone)]
pub struct TenantGates {
    per_tenant: usize,
    gates: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl TenantGates {
    /// Gates letting `per_tenant` (at least 1) of each tenant's handlers run at once.
    pub fn new(per_tenant: usize) -> TenantGates {
        TenantGates { per_tenant: per_tenant.max(1), gates: Arc::default() }
    }

    /// The gate of tenant `key` ([`crate::intake::Publisher::attributed`]), to wait at with [`Gate::enter`].
    pub fn gate(&self, key: &str) -> Gate {
        let mut gates = match self.gates.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if gates.len() >= 1024 {
            // A gate only this map holds has nobody in it or waiting at it.
            gates.retain(|_, g| Arc::strong_count(g) > 1);
        }
        let gate = gates.entry(key.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(self.per_tenant)));
        Gate(gate.clone())
    }
}

/// One tenant's gate.
#[derive(Debug)]
pub struct Gate(Arc<Semaphore>);

impl Gate {
    /// Wait for a place (in arrival order); it is given back when the permit is dropped.
    pub async fn enter(self) -> Option<OwnedSemaphorePermit> {
        // The semaphore is never closed: `None` cannot happen, and would only let the handler in.
        self.0.acquire_owned().await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intake::Publisher;
    use std::time::Duration;

    #[test]
    fn a_tenants_own_user_is_gated_under_its_name_whatever_the_body_names() {
        assert_eq!(Publisher::Tenant("acme".into()).attributed(Some("globex")), "acme");
        assert_eq!(Publisher::Tenant("acme".into()).attributed(None), "acme");
    }

    #[test]
    fn a_trusted_publisher_is_gated_under_the_tenant_it_names_and_unknown_publishers_share_one_gate() {
        assert_eq!(Publisher::Trusted("sandcell".into()).attributed(Some("globex")), "globex");
        assert_eq!(Publisher::Trusted("sandcell".into()).attributed(None), "sandcell");
        assert_eq!(Publisher::Unknown.attributed(Some("globex")), "");
        assert_eq!(named_tenant(br#"{"tenant": "globex", "upload_id": "u1", "files": []}"#).as_deref(), Some("globex"));
        assert_eq!(named_tenant(b"not json"), None);
    }

    #[tokio::test]
    async fn a_tenant_past_its_places_waits_and_another_tenant_does_not() {
        let gates = TenantGates::new(2);
        let first = gates.gate("acme").enter().await;
        let second = gates.gate("acme").enter().await;
        assert!(first.is_some() && second.is_some());
        let third = tokio::time::timeout(Duration::from_millis(50), gates.gate("acme").enter()).await;
        assert!(third.is_err(), "a third handler of the tenant got in");
        let other = tokio::time::timeout(Duration::from_millis(50), gates.gate("globex").enter()).await;
        assert!(other.is_ok_and(|p| p.is_some()), "another tenant waited for the first one's places");
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), gates.gate("acme").enter()).await;
        assert!(third.is_ok_and(|p| p.is_some()), "a place given back was not taken");
    }

    #[tokio::test]
    async fn gates_nobody_holds_are_forgotten_and_held_ones_kept() {
        let gates = TenantGates::new(1);
        let held = gates.gate("held").enter().await;
        for i in 0..1100 {
            drop(gates.gate(&format!("t{i}")).enter().await);
        }
        let kept = gates.gates.lock().map(|g| (g.len(), g.contains_key("held"))).unwrap_or_default();
        assert!(kept.0 < 1024 && kept.1, "{kept:?}");
        // The held gate is the same one: its one place is still taken.
        assert!(tokio::time::timeout(Duration::from_millis(50), gates.gate("held").enter()).await.is_err());
        drop(held);
    }
}
