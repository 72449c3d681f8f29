//! The warm pool: kernels started ahead of demand, with the common libraries already imported,
//! assigned to no tenant. A new session or a one-off job takes one if its container shape
//! matches the pool's (the operator's default limits, no network); a background task refills
//! the pool. A pool kernel is used by exactly one tenant and never returns to the pool.
//!
//! Where one-off sandboxes are reused, a warm kernel also makes its one-off preparation for
//! forked jobs (immortal objects, huge pages: ~0.3 s of CPU) in its start, in the background,
//! instead of after the first one-off job that takes it, in that tenant's burst.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::Docker;
use tokio::sync::Notify;

use crate::context::Activity;
use crate::kernel::{Kernel, KernelSettings, Priority, StartPriority};
use crate::metrics::Metrics;
use crate::sandbox::container::{ContainerShape, SandboxSpec, LABEL_POOL, LABEL_WORKER};

/// A pool of started kernels, cheap to clone.
#[derive(Clone)]
pub struct WarmPool {
    inner: Arc<Inner>,
}

struct Inner {
    kernels: Mutex<Vec<Kernel>>,
    target: usize,
    spec: SandboxSpec,
    shape: ContainerShape,
    refill: Notify,
    metrics: Metrics,
}

impl Inner {
    /// Destroy, in the background, every warm kernel whose driver died while it waited (killed
    /// outside the worker), and have the pool refilled.
    fn drop_dead(&self) {
        let dead: Vec<Kernel> = match self.kernels.lock() {
            Ok(mut kernels) => kernels.extract_if(.., |k| k.is_gone()).collect(),
            Err(_) => return,
        };
        for kernel in dead {
            tracing::warn!(container = %kernel.id(), "a warm kernel died while it waited");
            self.metrics.idle_sandboxes_lost.with_label_values(&["warm"]).inc();
            self.metrics.pool_size.dec();
            self.refill.notify_one();
            tokio::spawn(kernel.destroy());
        }
    }
}

/// How often the refill looks for warm kernels that died while they waited (without waiting on
/// any: a look costs a non-blocking read per kernel).
const LIVENESS_EVERY: Duration = Duration::from_secs(1);

impl WarmPool {
    /// A pool of `target` kernels built from the operator's default limits; `prepared`: each
    /// makes its preparation for forked jobs in its start ([`SandboxSpec::prepare_at_start`]).
    pub fn new(
        target: usize,
        prepared: bool,
        settings: &KernelSettings,
        limits: sandcell_protocol::ExecutionLimits,
        worker_id: &str,
        metrics: Metrics,
    ) -> Self {
        let spec = SandboxSpec {
            image: settings.image.clone(),
            runtime: settings.runtime.clone(),
            limits,
            labels: HashMap::from([(LABEL_WORKER.to_string(), worker_id.to_string()), (LABEL_POOL.to_string(), "1".to_string())]),
            egress: None,
            preload: settings.preload.clone(),
            prepare_at_start: prepared,
        };
        let shape = spec.shape();
        WarmPool { inner: Arc::new(Inner { kernels: Mutex::new(Vec::new()), target, spec, shape, refill: Notify::new(), metrics }) }
    }

    /// A warm kernel for a job needing `shape`, if one is ready, with its full CPU weight back
    /// (it was started in the background). Counts a hit or a miss.
    pub fn take(&self, shape: &ContainerShape) -> Option<Kernel> {
        let inner = &self.inner;
        let mut kernel = if *shape == inner.shape {
            inner.drop_dead();
            inner.kernels.lock().ok().and_then(|mut k| k.pop())
        } else {
            None
        };
        let outcome = match (&kernel, *shape == inner.shape) {
            (Some(_), _) => "hit",
            (None, true) => "empty",
            (None, false) => "shape",
        };
        inner.metrics.pool_takes.with_label_values(&[outcome]).inc();
        if let Some(kernel) = kernel.as_mut() {
            kernel.bring_to_foreground();
            inner.metrics.pool_size.dec();
            inner.refill.notify_one();
        }
        kernel
    }

    /// Whether a job needing `shape` would find no warm kernel now (a look, not a take; one
    /// that died in the last second is found out by the take).
    pub fn is_empty_for(&self, shape: &ContainerShape) -> bool {
        *shape != self.inner.shape || self.len() == 0
    }

    /// Number of warm kernels now.
    pub fn len(&self) -> usize {
        self.inner.kernels.lock().map(|k| k.len()).unwrap_or(0)
    }

    /// Keep the pool full, forever, replacing kernels found dead. Start failures are logged and
    /// retried with a backoff. Each start waits for a lull in the worker's jobs
    /// ([`Activity::lull`]): the jobs that emptied the pool are not slowed by its refill.
    pub async fn refill_forever(self, docker: Docker, settings: KernelSettings, activity: Activity) {
        let inner = &self.inner;
        let mut backoff = Duration::from_millis(500);
        loop {
            while self.len() < inner.target {
                activity.lull().await;
                match Kernel::start(&docker, &settings, &inner.spec, &StartPriority::new(Priority::Background, &settings.cgroup_root)).await {
                    Ok(kernel) => {
                        kernel.count_start(&inner.metrics);
                        match inner.kernels.lock() {
                            Ok(mut k) => {
                                k.push(kernel);
                                inner.metrics.pool_size.inc();
                            }
                            Err(_) => return,
                        }
                        backoff = Duration::from_millis(500);
                    }
                    Err(e) => {
                        tracing::warn!(error = format!("{e:#}"), ?backoff, "could not start a warm kernel; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
            // A take wakes the refill; so does a kernel found dead meanwhile.
            tokio::select! {
                () = inner.refill.notified() => {}
                () = tokio::time::sleep(LIVENESS_EVERY) => inner.drop_dead(),
            }
        }
    }

    /// Remove every warm kernel (shutdown).
    pub async fn drain(&self) {
        let kernels = self.inner.kernels.lock().map(|mut k| std::mem::take(&mut *k)).unwrap_or_default();
        for k in kernels {
            k.destroy().await;
        }
    }
}
