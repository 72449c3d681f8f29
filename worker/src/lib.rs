//! The worker: takes execution jobs off `sandcell.jobs` and runs each in a fresh, capped
//! Docker sandbox, then commits the result and its artifacts.
//!
//! The data path through this crate: [`consumer`] (delivery, claim, ack) → [`execute`]
//! (sandbox conversation, wall clock) → [`sandbox`] (container limits, driver framing) →
//! [`artifacts`] (object store) → back to [`consumer`], which commits to Postgres and acks.

pub mod artifacts;
pub mod consumer;
pub mod execute;
pub mod metrics;
pub mod sandbox;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_core::config::{self, Services};
use sandcell_core::jobs::JobStore;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::LimitPolicy;

use crate::execute::ExecSettings;

/// Worker settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Broker, database, object store.
    pub services: Services,
    /// Operator's limit policy; limits carried by jobs are capped by its maximums.
    pub policy: LimitPolicy,
    /// `SANDCELL_WORKER_ID`, default the host name: labels this worker's containers.
    pub worker_id: String,
    /// `SANDCELL_WORKER_SLOTS`, default 4: jobs run concurrently (= the consumer prefetch).
    pub slots: u16,
    /// `SANDCELL_SANDBOX_IMAGE` (required) and `SANDCELL_DOCKER_RUNTIME` (default `runc`).
    pub exec: ExecSettings,
    /// `SANDCELL_MAX_ATTEMPTS`, default 3: claims of one job before it is failed.
    pub max_attempts: i32,
    /// `SANDCELL_WORKER_METRICS_ADDR`, default `127.0.0.1:9465`.
    pub metrics_addr: SocketAddr,
}

impl Config {
    /// Read the configuration from the environment.
    pub fn from_env() -> Result<Self> {
        let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
        let default_id = if host.is_empty() { "worker-1".to_string() } else { host };
        Ok(Config {
            services: Services::from_env()?,
            policy: config::limit_policy_from_env()?,
            worker_id: config::var_or("SANDCELL_WORKER_ID", &default_id),
            slots: config::parse_or("SANDCELL_WORKER_SLOTS", 4u16)?.max(1),
            exec: ExecSettings {
                image: config::var_required("SANDCELL_SANDBOX_IMAGE")?,
                runtime: config::var_or("SANDCELL_DOCKER_RUNTIME", "runc"),
                start_timeout: Duration::from_millis(config::parse_or("SANDCELL_SANDBOX_START_TIMEOUT_MS", 30_000u64)?),
            },
            max_attempts: config::parse_or("SANDCELL_MAX_ATTEMPTS", 3i32)?.max(1),
            metrics_addr: config::parse_or("SANDCELL_WORKER_METRICS_ADDR", SocketAddr::from(([127, 0, 0, 1], 9465)))?,
        })
    }
}

/// Connect to Docker (whatever API version the daemon speaks) and check it answers.
pub async fn connect_docker() -> Result<bollard::Docker> {
    let docker = bollard::Docker::connect_with_defaults().context("configuring the Docker client")?;
    let docker = docker.negotiate_version().await.context("negotiating the Docker API version")?;
    docker.ping().await.context("pinging Docker")?;
    Ok(docker)
}

/// Run the worker until a fatal error. Services that are down are waited for, not fatal.
pub async fn run(cfg: Config) -> Result<()> {
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    metrics.slots.set(i64::from(cfg.slots));
    let docker = sandcell_core::retry_forever("docker", |_| connect_docker()).await;
    let removed = sandbox::remove_leftovers(&docker, &cfg.worker_id).await?;
    if removed > 0 {
        tracing::warn!(removed, worker_id = %cfg.worker_id, "removed sandboxes left by a previous run");
    }
    let db_url = cfg.services.database_url.clone();
    let pool = sandcell_core::retry_forever("postgres", |_| sandcell_core::jobs::connect(&db_url, u32::from(cfg.slots) + 2)).await;
    let jobs = JobStore::new(pool);
    let store = ArtifactStore::new(&cfg.services.s3);

    let broker_up = Arc::new(AtomicBool::new(false));
    let health: sandcell_core::telemetry::HealthCheck = {
        let (jobs, docker, broker_up) = (jobs.clone(), docker.clone(), broker_up.clone());
        Arc::new(move || {
            let (jobs, docker) = (jobs.clone(), docker.clone());
            let up = broker_up.load(Ordering::Relaxed);
            Box::pin(async move {
                jobs.ping().await?;
                docker.ping().await.context("docker ping")?;
                anyhow::ensure!(up, "not connected to RabbitMQ");
                Ok(())
            })
        })
    };
    let server = tokio::spawn(sandcell_core::telemetry::serve(cfg.metrics_addr, metrics.registry.clone(), health));
    let ctx = consumer::WorkerContext { cfg: Arc::new(cfg), docker, jobs, store, metrics };
    let consuming = tokio::spawn(consumer::run(ctx, broker_up));
    tokio::select! {
        r = server => r.context("metrics task panicked")?.context("metrics endpoint failed"),
        r = consuming => r.context("consumer task panicked"),
        _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted; stopping"); Ok(()) }
    }
}
