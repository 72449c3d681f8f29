//! The worker's context: everything a job handler needs, cheap to clone, and the accounting of
//! the worker's slots.

use std::sync::Arc;

use anyhow::{Context as _, Result};
use bollard::Docker;
use sandcell_core::jobs::JobStore;
use sandcell_core::sessions::SessionStore;
use sandcell_core::store::ArtifactStore;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Config;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::pool::WarmPool;
use crate::registry::Registry;

/// Everything a job handler needs, cheap to clone.
#[derive(Clone)]
pub struct WorkerContext {
    /// Settings.
    pub cfg: Arc<Config>,
    /// Docker client.
    pub docker: Docker,
    /// Job store.
    pub jobs: JobStore,
    /// Session store.
    pub sessions: SessionStore,
    /// Tenants (the artifact quota).
    pub tenants: sandcell_core::tenants::TenantStore,
    /// Artifact store.
    pub store: ArtifactStore,
    /// Metrics.
    pub metrics: Metrics,
    /// Live output of running jobs.
    pub events: crate::events::Events,
    /// Warm kernels.
    pub pool: WarmPool,
    /// One-off sandboxes waiting for their tenant's next job.
    pub bound: crate::bound::BoundPool,
    /// Sessions held here.
    pub registry: Registry,
    /// The job messages held here, and the one place they are settled.
    pub ledger: Ledger,
    /// Cells running at once (`SANDCELL_WORKER_SLOTS`).
    pub slots: Arc<Semaphore>,
    /// Sessions held at once (`SANDCELL_WORKER_MAX_SESSIONS`).
    pub session_capacity: Arc<Semaphore>,
    /// Set once the worker was told to stop: it takes no more jobs.
    pub draining: tokio::sync::watch::Receiver<bool>,
}

/// A slot held by a running cell. The busy-slots gauge counts live guards, so it is right on
/// every path (a finished cell, an error, a cancelled task).
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

impl WorkerContext {
    /// Wait for a free slot.
    pub async fn slot(&self) -> Result<Slot> {
        let permit = self.slots.clone().acquire_owned().await.context("the worker's slots are closed")?;
        self.metrics.busy_slots.inc();
        Ok(Slot { _permit: permit, gauge: self.metrics.busy_slots.clone() })
    }
}
