//! The worker's context: everything a job handler needs, cheap to clone, and the accounting of
//! the worker's slots.

use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// What the uploads fetched for jobs may hold at once (`SANDCELL_WORKER_FETCH_BYTES`).
    pub fetch_budget: crate::inputs::FetchBudget,
    /// When a cell last ran: what no job waits for waits for a lull.
    pub activity: Activity,
    /// Sessions held at once (`SANDCELL_WORKER_MAX_SESSIONS`).
    pub session_capacity: Arc<Semaphore>,
    /// Set once the worker was told to stop: it takes no more jobs.
    pub draining: tokio::sync::watch::Receiver<bool>,
}

/// A slot held by a running cell. The busy-slots gauge and the activity count live guards,
/// so they are right on every path (a finished cell, an error, a cancelled task).
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
    activity: Activity,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
        self.activity.ended();
    }
}

impl WorkerContext {
    /// Wait for a free slot.
    pub async fn slot(&self) -> Result<Slot> {
        let permit = self.slots.clone().acquire_owned().await.context("the worker's slots are closed")?;
        self.metrics.busy_slots.inc();
        self.activity.began();
        Ok(Slot { _permit: permit, gauge: self.metrics.busy_slots.clone(), activity: self.activity.clone() })
    }
}

/// How long the worker must have run no cell before work no job waits for begins.
const LULL: Duration = Duration::from_millis(250);
/// The longest such work waits for a lull: a worker kept busy still refills its warm pool.
const AT_MOST: Duration = Duration::from_secs(10);
/// How often a wait for a lull looks again.
const LOOK_EVERY: Duration = Duration::from_millis(25);

/// When the worker last ran a cell, for the work no job waits for: a warm-pool refill. Begun
/// while jobs run, even in the idle CPU class, a refill took 0.3-0.5 s of the CPU of a 2.5 s
/// burst of 200 one-off jobs on two cores (idle gaps are short and many, and a start also works
/// in Docker and the host's kernel), and stretched the tail of sequential jobs (p99); it waits
/// until no cell has run for [`LULL`], at most [`AT_MOST`] (measured: docs/benchmarks/speed-check.md,
/// fifteenth round). Cheap to clone.
#[derive(Clone)]
pub struct Activity {
    inner: Arc<ActivityState>,
}

struct ActivityState {
    /// Slots busy now, and the last moment one was (`None`: never), changed together so that a
    /// look never sees a cell's end without its time.
    state: Mutex<(usize, Option<tokio::time::Instant>)>,
}

impl Activity {
    /// A worker that ran no cell yet.
    pub fn new() -> Self {
        Activity { inner: Arc::new(ActivityState { state: Mutex::new((0, None)) }) }
    }

    /// A slot was taken.
    fn began(&self) {
        self.change(|busy| busy + 1);
    }

    /// A slot was given back (its cell ran until now).
    fn ended(&self) {
        self.change(|busy| busy.saturating_sub(1));
    }

    fn change(&self, to: impl FnOnce(usize) -> usize) {
        if let Ok(mut state) = self.inner.state.lock() {
            state.0 = to(state.0);
            state.1 = Some(tokio::time::Instant::now());
        }
    }

    /// Whether no cell has run for [`LULL`].
    fn in_lull(&self) -> bool {
        self.inner.state.lock().map(|s| s.0 == 0 && s.1.is_none_or(|t| t.elapsed() >= LULL)).unwrap_or(true)
    }

    /// Wait for a lull (no cell run for [`LULL`]), at most [`AT_MOST`]. Returns whether it came.
    pub async fn lull(&self) -> bool {
        let give_up = tokio::time::Instant::now() + AT_MOST;
        loop {
            if self.in_lull() {
                return true;
            }
            if tokio::time::Instant::now() >= give_up {
                return false;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard as a slot holds it.
    struct Held(Activity);
    impl Held {
        fn take(a: &Activity) -> Self {
            a.began();
            Held(a.clone())
        }
    }
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.ended();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_waits_for_a_lull_begins_at_once_on_a_worker_that_ran_no_cell() {
        let a = Activity::new();
        let t = tokio::time::Instant::now();
        assert!(a.lull().await);
        assert_eq!(t.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn it_begins_a_lull_after_the_last_cell_ended() {
        let a = Activity::new();
        let one = Held::take(&a);
        let waiter = tokio::spawn({
            let a = a.clone();
            async move {
                let t = tokio::time::Instant::now();
                (a.lull().await, t.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(one);
        let (came, waited) = waiter.await.expect("the waiter");
        assert!(came);
        assert!(waited >= Duration::from_secs(2) + LULL && waited < Duration::from_secs(2) + LULL + LOOK_EVERY * 2, "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn cells_back_to_back_delay_it_at_most_the_bound() {
        let a = Activity::new();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move {
                let t = tokio::time::Instant::now();
                (a.lull().await, t.elapsed())
            }
        });
        // Sequential cells, a few milliseconds apart: never a lull.
        for _ in 0..1500 {
            let cell = Held::take(&a);
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(cell);
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        let (came, waited) = waiter.await.expect("the waiter");
        assert!(!came);
        assert!(waited >= AT_MOST && waited < AT_MOST + LOOK_EVERY * 2, "{waited:?}");
    }
}
