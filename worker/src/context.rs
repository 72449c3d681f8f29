//! The worker's context: everything a job handler needs, cheap to clone, and the accounting of
//! the worker's slots.

use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// When every slot was last busy: what no job waits for waits for a lull.
    pub saturation: Saturation,
    /// Sessions held at once (`SANDCELL_WORKER_MAX_SESSIONS`).
    pub session_capacity: Arc<Semaphore>,
    /// Set once the worker was told to stop: it takes no more jobs.
    pub draining: tokio::sync::watch::Receiver<bool>,
}

/// A slot held by a running cell. The busy-slots gauge and the saturation count live guards,
/// so they are right on every path (a finished cell, an error, a cancelled task).
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
    saturation: Saturation,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
        self.saturation.ended();
    }
}

impl WorkerContext {
    /// Wait for a free slot.
    pub async fn slot(&self) -> Result<Slot> {
        let permit = self.slots.clone().acquire_owned().await.context("the worker's slots are closed")?;
        self.metrics.busy_slots.inc();
        self.saturation.began();
        Ok(Slot { _permit: permit, gauge: self.metrics.busy_slots.clone(), saturation: self.saturation.clone() })
    }
}

/// How long no moment with every slot busy must last before work no job waits for begins.
const LULL: Duration = Duration::from_millis(250);
/// The longest such work waits for a lull: a worker kept saturated still refills its warm pool.
const AT_MOST: Duration = Duration::from_secs(10);
/// How often a wait for a lull looks again.
const LOOK_EVERY: Duration = Duration::from_millis(25);

/// When the worker last had every slot busy, for the work no job waits for: a warm-pool refill
/// and the preparation of a one-off sandbox its job did not wait for. Begun in a burst, even in
/// the idle CPU class, such work took 0.3-0.5 s of the CPU of a 2.5 s burst of 200 one-off
/// jobs on two cores (idle gaps are short and many, and a start also works in Docker and the
/// host's kernel): it waits until no slot has been full for [`LULL`], at most [`AT_MOST`].
/// A worker that never fills its slots (sequential jobs, a few sessions) starts it at once.
/// Cheap to clone.
#[derive(Clone)]
pub struct Saturation {
    inner: Arc<SaturationState>,
}

struct SaturationState {
    slots: usize,
    busy: AtomicUsize,
    /// The last moment every slot was busy; `None`: never.
    last_full: Mutex<Option<tokio::time::Instant>>,
}

impl Saturation {
    /// For a worker of `slots` slots.
    pub fn new(slots: usize) -> Self {
        Saturation { inner: Arc::new(SaturationState { slots: slots.max(1), busy: AtomicUsize::new(0), last_full: Mutex::new(None) }) }
    }

    /// A slot was taken.
    fn began(&self) {
        if self.inner.busy.fetch_add(1, Ordering::SeqCst) + 1 >= self.inner.slots {
            self.mark_full();
        }
    }

    /// A slot was given back (a full worker was full until now).
    fn ended(&self) {
        if self.inner.busy.fetch_sub(1, Ordering::SeqCst) >= self.inner.slots {
            self.mark_full();
        }
    }

    fn mark_full(&self) {
        if let Ok(mut last) = self.inner.last_full.lock() {
            *last = Some(tokio::time::Instant::now());
        }
    }

    /// Whether no slot has been full for [`LULL`].
    fn in_lull(&self) -> bool {
        if self.inner.busy.load(Ordering::SeqCst) >= self.inner.slots {
            return false;
        }
        self.inner.last_full.lock().map(|last| last.is_none_or(|t| t.elapsed() >= LULL)).unwrap_or(true)
    }

    /// Wait for a lull (no slot full for [`LULL`]), at most [`AT_MOST`]. Returns whether it came.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard as a slot holds it.
    struct Held(Saturation);
    impl Held {
        fn take(s: &Saturation) -> Self {
            s.began();
            Held(s.clone())
        }
    }
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.ended();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_waits_for_a_lull_begins_at_once_on_a_worker_that_never_filled_its_slots() {
        let s = Saturation::new(2);
        let _one = Held::take(&s);
        let t = tokio::time::Instant::now();
        assert!(s.lull().await);
        assert_eq!(t.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn it_begins_a_lull_after_the_slots_were_last_full() {
        let s = Saturation::new(2);
        let one = Held::take(&s);
        let two = Held::take(&s);
        let waiter = tokio::spawn({
            let s = s.clone();
            async move {
                let t = tokio::time::Instant::now();
                (s.lull().await, t.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(two); // full until now
        drop(one);
        let (came, waited) = waiter.await.expect("the waiter");
        assert!(came);
        assert!(waited >= Duration::from_secs(2) + LULL && waited < Duration::from_secs(2) + LULL + LOOK_EVERY * 2, "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_kept_full_delays_it_at_most_the_bound() {
        let s = Saturation::new(1);
        let _held = Held::take(&s);
        let t = tokio::time::Instant::now();
        assert!(!s.lull().await);
        assert!(t.elapsed() >= AT_MOST && t.elapsed() < AT_MOST + LOOK_EVERY * 2, "{:?}", t.elapsed());
    }
}
