//! The scheduler: the first stop of every submission and the keeper of artifact TTLs.
//!
//! - [`intake`] consumes `sandcell.submissions`, takes the tenant from the broker-validated
//!   `user_id`, judges each message with [`sandcell_protocol::parse_submission`], checks the
//!   tenant's quotas, records the job (or its rejection) in Postgres and publishes the
//!   execution job to `sandcell.jobs` (or the session's worker queue);
//! - [`dispatch`] publishes jobs held for fair share as their tenants' jobs finish, round-robin
//!   across tenants;
//! - [`sweeper`] deletes expired artifacts from the object store and marks them expired, and
//!   declares the sessions of workers whose heartbeat stopped `lost`;
//! - [`metrics`] holds the Prometheus collectors, served on `/metrics` with `/healthz`.
#![warn(missing_docs)]

mod dispatch;
mod intake;
mod metrics;
mod sweeper;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_core::config::{self, Services};
use sandcell_core::jobs::JobStore;
use sandcell_core::store::ArtifactStore;
use sandcell_core::tenants::Quotas;
use sandcell_protocol::{IntakeLimits, KeepAlivePolicy, LimitPolicy};

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Broker, database, object store.
    pub services: Services,
    /// Operator's limit policy.
    pub policy: LimitPolicy,
    /// Intake size bounds.
    pub intake: IntakeLimits,
    /// `SANDCELL_SCHEDULER_METRICS_ADDR`, default `127.0.0.1:9464`.
    pub metrics_addr: SocketAddr,
    /// `SANDCELL_SWEEP_INTERVAL_S`, default 30.
    pub sweep_interval: Duration,
    /// `SANDCELL_INTAKE_PREFETCH`, default 32: submissions handled concurrently.
    pub prefetch: u16,
    /// Session keep-alive rules.
    pub keep_alive: KeepAlivePolicy,
    /// `SANDCELL_WORKER_DEAD_AFTER_S`, default 30: a worker silent this long has lost its sessions.
    pub worker_dead_after: Duration,
    /// `SANDCELL_DISPATCH_INTERVAL_MS`, default 100: how often the dispatcher looks for held
    /// jobs whose tenant has room again (the most a held job waits beyond a free place).
    pub dispatch_interval: Duration,
    /// `SANDCELL_STUCK_AFTER_S`, default 3600: a job still `queued` (or a session `starting`)
    /// this long after it was recorded is ended with `stuck` and releases its quota.
    pub stuck_after: Duration,
    /// `SANDCELL_TRUSTED_PUBLISHERS`, default `sandcell`: broker users that may submit for any
    /// tenant (the body's `tenant` is believed). Every other user submits as itself.
    pub trusted_publishers: HashSet<String>,
    /// `SANDCELL_DEFAULT_MAX_*`: quotas of tenants registered on their first job.
    pub tenant_defaults: Quotas,
}

impl Config {
    /// Read the configuration from the environment.
    pub fn from_env() -> Result<Self> {
        Ok(Config {
            services: Services::from_env()?,
            policy: config::limit_policy_from_env()?,
            intake: config::intake_limits_from_env()?,
            metrics_addr: config::parse_or("SANDCELL_SCHEDULER_METRICS_ADDR", SocketAddr::from(([127, 0, 0, 1], 9464)))?,
            sweep_interval: Duration::from_secs_f64(config::parse_or("SANDCELL_SWEEP_INTERVAL_S", 30.0f64)?.max(0.1)),
            prefetch: config::parse_or("SANDCELL_INTAKE_PREFETCH", 32u16)?.max(1),
            keep_alive: config::keep_alive_policy_from_env()?,
            worker_dead_after: Duration::from_secs_f64(config::parse_or("SANDCELL_WORKER_DEAD_AFTER_S", 30.0f64)?.max(1.0)),
            dispatch_interval: Duration::from_millis(config::parse_or("SANDCELL_DISPATCH_INTERVAL_MS", 100u64)?.max(1)),
            stuck_after: Duration::from_secs_f64(config::parse_or("SANDCELL_STUCK_AFTER_S", 3600.0f64)?.max(1.0)),
            trusted_publishers: config::var_or("SANDCELL_TRUSTED_PUBLISHERS", "sandcell")
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            tenant_defaults: Quotas::from_env()?,
        })
    }
}

/// Run the scheduler until a fatal error. Services that are down are waited for, not fatal.
pub async fn run(cfg: Config) -> Result<()> {
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    let db_url = cfg.services.database_url.clone();
    let pool = sandcell_core::retry_forever("postgres", |_| sandcell_core::jobs::connect(&db_url, 8)).await;
    let jobs = JobStore::new(pool).with_tenant_defaults(cfg.tenant_defaults);
    let store = ArtifactStore::new(&cfg.services.s3);
    // Backstop for the sweeper: lifecycle rules count whole days, so one day past the longest TTL.
    let days = i32::try_from(cfg.policy.max.artifact_ttl_s.div_ceil(86_400) + 1).unwrap_or(i32::MAX);
    if let Err(e) = store.ensure_lifecycle(days).await {
        tracing::warn!(error = format!("{e:#}"), "could not set the bucket lifecycle backstop; the sweeper alone enforces TTLs");
    }

    let broker_up = Arc::new(AtomicBool::new(false));
    let health: sandcell_core::telemetry::HealthCheck = {
        let jobs = jobs.clone();
        let broker_up = broker_up.clone();
        Arc::new(move || {
            let jobs = jobs.clone();
            let up = broker_up.load(Ordering::Relaxed);
            Box::pin(async move {
                jobs.ping().await?;
                anyhow::ensure!(up, "not connected to RabbitMQ");
                Ok(())
            })
        })
    };
    let server = tokio::spawn(sandcell_core::telemetry::serve(cfg.metrics_addr, metrics.registry.clone(), health));
    let sweeper = tokio::spawn(sweeper::run(jobs.clone(), store, metrics.clone(), cfg.sweep_interval, cfg.worker_dead_after, cfg.stuck_after));
    let dispatcher = tokio::spawn(dispatch::run(cfg.services.amqp_url.clone(), jobs.clone(), metrics.clone(), cfg.dispatch_interval));
    let intake = tokio::spawn(intake::run(cfg, jobs, metrics, broker_up));

    tokio::select! {
        r = server => r.context("metrics task panicked")?.context("metrics endpoint failed"),
        r = sweeper => r.context("sweeper task panicked"),
        r = dispatcher => r.context("dispatcher task panicked"),
        r = intake => r.context("intake task panicked"),
        _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted; stopping"); Ok(()) }
    }
}
