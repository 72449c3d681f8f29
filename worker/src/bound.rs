//! One-off sandboxes bound to a tenant: after a one-off job whose driver left nothing of it
//! behind, its sandbox waits here for the same tenant's next one-off job of the same container
//! shape. That job then starts in a process forked from the sandbox's pre-imported kernel
//! (milliseconds) instead of a container start (most of a second with the libraries imported).
//!
//! Invariants:
//! - **a sandbox serves one tenant for life**: it is bound to the tenant of its first job, and
//!   only [`BoundPool::take`] for that tenant and shape returns it;
//! - **its kernel never runs user code**: a bound sandbox runs only fresh requests (each job in
//!   a process forked for it, see `sandbox/driver/driver.py`), never a session's cells;
//! - **nothing of one job reaches the next**: a sandbox goes back only when the driver vouched
//!   for it (`settled` with `reusable`: the job's process exited, the workspace, `/tmp` and
//!   `/dev/shm` emptied, the job's processes and IPC objects gone, the kernel alive and as it
//!   was); a job that timed out, ran out of memory or broke the protocol destroys it;
//! - **a job's result does not wait for the cleanup**: the driver sends `done` first, and the
//!   sandbox *settles* (its process exits, the driver cleans up and says `settled`) while the
//!   result is committed. The tenant's next job waits for a settling sandbox rather than start
//!   or take another ([`BoundPool::is_settling`]);
//! - **bounded**: a sandbox is destroyed after `SANDCELL_ONEOFF_REUSE_JOBS` jobs,
//!   `SANDCELL_ONEOFF_REUSE_S` of life or `SANDCELL_ONEOFF_IDLE_S` idle; at most
//!   `SANDCELL_ONEOFF_IDLE_MAX` wait at once (the longest idle is destroyed first).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::kernel::Kernel;
use crate::metrics::Metrics;
use crate::sandbox::container::ContainerShape;

/// When bound sandboxes are recycled.
#[derive(Debug, Clone)]
pub struct ReuseSettings {
    /// `SANDCELL_ONEOFF_REUSE_JOBS`, default 1000 (1 under gVisor): jobs one sandbox runs before
    /// it is destroyed. 1: no reuse — every one-off job gets a sandbox of its own and runs in its
    /// kernel directly, not in a forked process.
    pub max_jobs: u32,
    /// `SANDCELL_ONEOFF_REUSE_S`, default 600: longest life of a bound sandbox.
    pub max_age: Duration,
    /// `SANDCELL_ONEOFF_IDLE_S`, default 60: longest wait for the tenant's next job.
    pub max_idle: Duration,
    /// `SANDCELL_ONEOFF_IDLE_MAX`, default 8: most bound sandboxes waiting at once.
    pub max_waiting: usize,
}

/// A one-off sandbox and its binding.
pub struct Bound {
    /// The sandbox's kernel.
    pub kernel: Kernel,
    tenant: String,
    shape: ContainerShape,
    jobs: u32,
    born: Instant,
}

impl Bound {
    /// Bind a kernel that never ran a job to `tenant`.
    pub fn new(kernel: Kernel, tenant: &str, shape: ContainerShape) -> Self {
        Bound { kernel, tenant: tenant.to_string(), shape, jobs: 0, born: Instant::now() }
    }
}

struct Waiting {
    bound: Bound,
    since: Instant,
}

/// Longest a stopping worker waits for sandboxes settling after their jobs (each settle has
/// its own bound of 10 s, `SETTLE_WITHIN` in `run.rs`).
const SETTLE_DRAIN: Duration = Duration::from_secs(12);

/// What a sandbox of a tenant on its way is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coming {
    /// Being started (at most one per tenant and shape: [`BoundPool::start_ticket`]).
    Start,
    /// Settling after a job ([`BoundPool::settling`]).
    Settle,
}

/// A sandbox of a tenant on its way: being started, or settling after its job. Its end, when
/// dropped, wakes the jobs waiting for a sandbox of the tenant (one of them may then start the
/// next).
pub struct InFlight {
    pool: BoundPool,
    tenant: String,
    shape: ContainerShape,
    coming: Coming,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut in_flight) = self.pool.in_flight.lock() {
            if let Some(i) = in_flight.iter().position(|(t, s, c)| *t == self.tenant && *s == self.shape && *c == self.coming) {
                in_flight.swap_remove(i);
            }
        }
        self.pool.returned.notify_waiters();
    }
}

/// The bound sandboxes waiting for their tenant's next job, cheap to clone.
#[derive(Clone)]
pub struct BoundPool {
    waiting: Arc<Mutex<Vec<Waiting>>>,
    /// Woken whenever a sandbox goes back to wait, or a start or a settle ends (see
    /// [`BoundPool::returned`]).
    returned: Arc<tokio::sync::Notify>,
    /// Sandboxes on their way, by tenant and shape (see [`InFlight`]).
    in_flight: Arc<Mutex<Vec<(String, ContainerShape, Coming)>>>,
    /// Set by [`BoundPool::drain`]: a sandbox that settles afterwards is destroyed, not kept.
    closed: Arc<std::sync::atomic::AtomicBool>,
    settings: ReuseSettings,
    metrics: Metrics,
}

impl BoundPool {
    /// Whether one-off sandboxes are reused at all (`SANDCELL_ONEOFF_REUSE_JOBS` > 1).
    pub fn reuses(&self) -> bool {
        self.settings.max_jobs > 1
    }

    /// An empty pool.
    pub fn new(settings: ReuseSettings, metrics: Metrics) -> Self {
        BoundPool {
            waiting: Arc::new(Mutex::new(Vec::new())),
            returned: Arc::new(tokio::sync::Notify::new()),
            in_flight: Arc::new(Mutex::new(Vec::new())),
            closed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            settings,
            metrics,
        }
    }

    /// A sandbox bound to `tenant` of `shape`, if one waits (the one idle the shortest: its
    /// caches are warmest). Counts a reuse. Those found dead first (killed outside the worker
    /// since the reaper last looked) are destroyed in the background, never handed out.
    pub fn take(&self, tenant: &str, shape: &ContainerShape) -> Option<Bound> {
        let mut waiting = self.waiting.lock().ok()?;
        for w in self.take_lost(&mut waiting) {
            let pool = self.clone();
            tokio::spawn(async move { pool.recycle(w.bound, "lost").await });
        }
        self.metrics.oneoff_idle.set(waiting.len() as i64);
        // One past its bounds is left for the reaper, never handed out.
        let fresh_enough = |w: &Waiting| w.since.elapsed() < self.settings.max_idle && w.bound.born.elapsed() < self.settings.max_age;
        let i = waiting.iter().rposition(|w| w.bound.tenant == tenant && w.bound.shape == *shape && fresh_enough(w))?;
        let w = waiting.remove(i);
        self.metrics.oneoff_idle.set(waiting.len() as i64);
        self.metrics.oneoff_sandboxes.with_label_values(&["reused"]).inc();
        Some(w.bound)
    }

    /// Take out of `waiting` the sandboxes whose driver died while they waited (killed outside
    /// the worker: an operator, the engine, the host's OOM killer), asked without waiting.
    fn take_lost(&self, waiting: &mut Vec<Waiting>) -> Vec<Waiting> {
        let lost: Vec<Waiting> = waiting.extract_if(.., |w| w.bound.kernel.is_gone()).collect();
        for w in &lost {
            tracing::warn!(tenant = %w.bound.tenant, container = %w.bound.kernel.id(), "a one-off sandbox died while it waited for its tenant's next job");
            self.metrics.idle_sandboxes_lost.with_label_values(&["oneoff"]).inc();
        }
        lost
    }

    /// Resolves when a sandbox next goes back to wait, or a start or a settle ends (enable it
    /// before looking with [`BoundPool::take`], so a return in between is not missed).
    pub fn returned(&self) -> tokio::sync::futures::Notified<'_> {
        self.returned.notified()
    }

    /// A ticket for a start of a sandbox for `tenant` of `shape`, unless one is in flight
    /// already: then a job waits for a return or for that start's end instead of starting
    /// another, so a burst starts at most one sandbox per tenant and shape at a time.
    pub fn start_ticket(&self, tenant: &str, shape: &ContainerShape) -> Option<InFlight> {
        let mut in_flight = self.in_flight.lock().ok()?;
        if in_flight.iter().any(|(t, s, c)| t == tenant && s == shape && *c == Coming::Start) {
            return None;
        }
        in_flight.push((tenant.to_string(), shape.clone(), Coming::Start));
        Some(InFlight { pool: self.clone(), tenant: tenant.to_string(), shape: shape.clone(), coming: Coming::Start })
    }

    /// Mark `bound` as settling after its job until the ticket is given to
    /// [`BoundPool::put_back`] (or dropped).
    pub fn settling(&self, bound: &Bound) -> InFlight {
        if let Ok(mut in_flight) = self.in_flight.lock() {
            in_flight.push((bound.tenant.clone(), bound.shape.clone(), Coming::Settle));
        }
        InFlight { pool: self.clone(), tenant: bound.tenant.clone(), shape: bound.shape.clone(), coming: Coming::Settle }
    }

    /// Whether a sandbox of `tenant` and `shape` is settling after a job: it is back in
    /// milliseconds, sooner than any other could be had.
    pub fn is_settling(&self, tenant: &str, shape: &ContainerShape) -> bool {
        self.in_flight.lock().is_ok_and(|f| f.iter().any(|(t, s, c)| t == tenant && s == shape && *c == Coming::Settle))
    }

    /// Count a one-off job that got a sandbox of its own (warm pool or fresh).
    pub fn count_new(&self) {
        self.metrics.oneoff_sandboxes.with_label_values(&["new"]).inc();
    }

    /// After a job: keep the sandbox for its tenant's next job when the driver vouched for it
    /// (`clean`) and it is within its bounds; else destroy it. `settled`: its ticket from
    /// [`BoundPool::settling`], ended once the sandbox waits (or is known to go).
    pub async fn put_back(&self, mut bound: Bound, clean: bool, settled: Option<InFlight>) {
        bound.jobs += 1;
        let why = if !clean {
            Some("dirty")
        } else if bound.jobs >= self.settings.max_jobs {
            Some("jobs")
        } else if bound.born.elapsed() >= self.settings.max_age {
            Some("age")
        } else {
            None
        };
        if let Some(why) = why {
            self.recycle(bound, why).await;
        } else {
            self.keep(bound).await;
        }
        // Only now: a stopping worker waits for settles, so a sandbox going away is gone first.
        drop(settled);
    }

    /// Keep `bound` waiting for its tenant's next job (the longest idle beyond
    /// `SANDCELL_ONEOFF_IDLE_MAX` is destroyed), and wake those waiting for a return.
    pub async fn keep(&self, bound: Bound) {
        let (evicted, refused) = match self.waiting.lock() {
            // Checked under the lock drain takes: the worker is stopping, nothing waits any more.
            Ok(_) if self.closed.load(std::sync::atomic::Ordering::SeqCst) => (Vec::new(), Some(bound)),
            Ok(mut waiting) => {
                waiting.push(Waiting { bound, since: Instant::now() });
                // The longest idle first: it is the least likely to be asked for.
                let excess = waiting.len().saturating_sub(self.settings.max_waiting);
                let evicted: Vec<Waiting> = waiting.drain(..excess).collect();
                self.metrics.oneoff_idle.set(waiting.len() as i64);
                (evicted, None)
            }
            Err(_) => return,
        };
        if let Some(bound) = refused {
            return self.recycle(bound, "shutdown").await;
        }
        self.returned.notify_waiters();
        for w in evicted {
            self.recycle(w.bound, "evicted").await;
        }
    }

    /// Destroy sandboxes idle or alive too long, and those found dead, forever (every second).
    pub async fn reap_forever(self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let expired: Vec<(Waiting, &'static str)> = match self.waiting.lock() {
                Ok(mut waiting) => {
                    let lost = self.take_lost(&mut waiting);
                    let (keep, expired): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut *waiting)
                        .into_iter()
                        .partition(|w| w.since.elapsed() < self.settings.max_idle && w.bound.born.elapsed() < self.settings.max_age);
                    *waiting = keep;
                    self.metrics.oneoff_idle.set(waiting.len() as i64);
                    let expired = expired.into_iter().map(|w| if w.since.elapsed() >= self.settings.max_idle { (w, "idle") } else { (w, "age") });
                    lost.into_iter().map(|w| (w, "lost")).chain(expired).collect()
                }
                Err(_) => return,
            };
            for (w, why) in expired {
                self.recycle(w.bound, why).await;
            }
        }
    }

    /// Destroy every waiting sandbox (shutdown).
    pub async fn drain(&self) {
        if let Ok(_waiting) = self.waiting.lock() {
            self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // Sandboxes settling now are destroyed by their settle (see keep); wait for those.
        let deadline = tokio::time::Instant::now() + SETTLE_DRAIN;
        loop {
            let returned = self.returned();
            tokio::pin!(returned);
            returned.as_mut().enable();
            let settling = self.in_flight.lock().is_ok_and(|f| f.iter().any(|(_, _, c)| *c == Coming::Settle));
            if !settling || tokio::time::timeout_at(deadline, returned).await.is_err() {
                break;
            }
        }
        let waiting = self.waiting.lock().map(|mut w| std::mem::take(&mut *w)).unwrap_or_default();
        self.metrics.oneoff_idle.set(0);
        for w in waiting {
            self.recycle(w.bound, "shutdown").await;
        }
    }

    async fn recycle(&self, bound: Bound, why: &'static str) {
        tracing::debug!(tenant = %bound.tenant, jobs = bound.jobs, why, container = %bound.kernel.id(), "one-off sandbox recycled");
        self.metrics.oneoff_recycled.with_label_values(&[why]).inc();
        bound.kernel.destroy().await;
    }
}
