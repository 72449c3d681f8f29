//! The scheduler: the first stop of every submission and the keeper of artifact TTLs.
//!
//! - [`partitions`] shares the intake's partition queues out among the schedulers of a fleet
//!   (Postgres advisory locks; the broker's single active consumer keeps each in order);
//! - [`intake`] consumes this scheduler's partitions (`sandcell.submissions.<p>`), takes the tenant from the broker-validated
//!   `user_id`, judges each message with [`sandcell_protocol::parse_submission`], checks the
//!   tenant's quotas, records the job (or its rejection) in Postgres and publishes the
//!   execution job to `sandcell.jobs` (or the session's worker queue);
//! - [`dispatch`] publishes jobs held for fair share as their tenants' jobs finish, round-robin
//!   across tenants, and the parked jobs of sessions moving to another worker, in order;
//! - [`sweeper`] deletes expired artifacts and uploads from the object store and marks them
//!   (a task of its own: a hung store holds up nothing else), sets the sessions of workers whose
//!   heartbeat stopped `moving`, and ends what waited too long;
//! - [`tenant_gates`] bounds how many of one tenant's messages the intake handles at once, so
//!   that a tenant's flood cannot hold every database connection;
//! - [`uploads`] answers tenants' upload requests (which arrive through the intake too) with
//!   presigned PUT URLs under their own upload prefix, the grants recorded in batches;
//! - [`refusals`] records the intake's refusals made without a look under the tenant's lock, in
//!   batches; [`batches`] is the one batch writer both are;
//! - [`dead_letters`] records the outcome of a job whose message was dead-lettered (a
//!   submission or an execution job returned to its queue too often, or a session's job its
//!   worker gave up on), from a copy of each;
//! - [`live_output`] holds each tenant to its share of the broker's live-output queues and
//!   bindings (closing its connections and deleting its queues past it);
//! - [`tenant_sessions`] ends tenants' database sessions that hold what every tenant shares
//!   (a transaction kept open);
//! - [`metrics`] holds the Prometheus collectors, served on `/metrics` with `/healthz`.
#![warn(missing_docs)]

mod batches;
mod cancels;
mod dead_letters;
mod dispatch;
mod intake;
mod live_output;
mod metrics;
mod partitions;
mod quota_memory;
mod refusals;
mod sweeper;
mod tenant_gates;
mod tenant_sessions;
mod uploads;

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
use tokio_util::sync::CancellationToken;

/// The scheduler's database connections unless `SANDCELL_SCHEDULER_DB_CONNECTIONS` says.
pub const DEFAULT_DB_CONNECTIONS: u32 = 8;

/// The fewest the scheduler runs with: one for each batch writer (refusals, upload grants,
/// upload refusals, messages naming no job), one for a sweep and one for the intake.
pub const MIN_DB_CONNECTIONS: u32 = 6;

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
    /// `SANDCELL_SCHEDULER_DB_CONNECTIONS`, default [`DEFAULT_DB_CONNECTIONS`], at least
    /// [`MIN_DB_CONNECTIONS`]: the scheduler's database connections. Every intake handler, the
    /// four batch writers, the sweepers and the dispatcher share them; a tenant's gate
    /// (`tenant_concurrency`) should stay at most half of them, so that one tenant whose row is
    /// held cannot hold them all.
    pub db_connections: u32,
    /// `SANDCELL_SWEEP_INTERVAL_S`, default 30.
    pub sweep_interval: Duration,
    /// `SANDCELL_INTAKE_PREFETCH`, default 32: submissions handled concurrently, per partition.
    pub prefetch: u16,
    /// `SANDCELL_INTAKE_TENANT_CONCURRENCY`, default 4: how many of one tenant's messages this
    /// scheduler handles at once ([`tenant_gates`]). They take the tenant's row lock one after
    /// another anyway; the bound keeps a tenant's flood from holding every database connection.
    pub tenant_concurrency: usize,
    /// `SANDCELL_INTAKE_QUOTA_MEMORY_MS`, default 200 (0: off): after a tenant's submission is
    /// refused for a quota, how long its further submissions of that kind are refused with the
    /// same figures without a look under its lock ([`quota_memory`]): its flood past a quota
    /// leaves the intake's partitions, and other tenants' submissions behind it, that much sooner.
    pub quota_memory: Duration,
    /// `SANDCELL_INTAKE_PARTITIONS`, default 8: the intake's partition queues. Every scheduler
    /// of a fleet must use the same number; more schedulers than partitions leaves some idle.
    pub intake_partitions: u16,
    /// `SANDCELL_INTAKE_REBALANCE_MS`, default 1000: how often a scheduler counts the live
    /// schedulers and takes or gives up partitions (the most a killed scheduler's partitions
    /// wait for another owner).
    pub rebalance_interval: Duration,
    /// `SANDCELL_SCHEDULER_STOP_GRACE_S`, default 20: on SIGTERM/SIGINT, how long the intake may
    /// take to finish the submissions it took before the process exits anyway (the broker then
    /// returns them).
    pub stop_grace: Duration,
    /// Session keep-alive rules.
    pub keep_alive: KeepAlivePolicy,
    /// `SANDCELL_WORKER_DEAD_AFTER_S`, default 30: a worker silent this long has its sessions
    /// moved to other workers.
    pub worker_dead_after: Duration,
    /// `SANDCELL_DISPATCH_INTERVAL_MS`, default 100: how often the dispatcher looks for held
    /// jobs whose tenant has room again (the most a held job waits beyond a free place).
    pub dispatch_interval: Duration,
    /// `SANDCELL_STUCK_AFTER_S`, default 3600: a job still `queued` (or a session `starting`)
    /// this long after it was recorded is ended with `stuck` and releases its quota.
    pub stuck_after: Duration,
    /// `SANDCELL_SESSION_START_WAIT_S`, default 60 (as the workers'): a new session that no
    /// worker took this long after its dispatch (every worker was full) is refused with `capacity`.
    pub session_start_wait: Duration,
    /// `SANDCELL_TRUSTED_PUBLISHERS`, default `sandcell`: broker users that may submit for any
    /// tenant (the body's `tenant` is believed). Every other user submits as itself.
    pub trusted_publishers: HashSet<String>,
    /// `SANDCELL_TENANT_DB_HOLD_S`, default 10: a tenant's database session whose transaction
    /// began this long ago is ended ([`tenant_sessions`]); 0 turns that off.
    pub tenant_db_hold: Duration,
    /// `SANDCELL_TENANT_DB_CHECK_MS`, default 1000: how often the scheduler looks.
    pub tenant_db_check: Duration,
    /// `SANDCELL_DEFAULT_MAX_*`: quotas of tenants registered on their first job.
    pub tenant_defaults: Quotas,
    /// `SANDCELL_MAX_UPLOAD_FILE_BYTES`, default 100 MiB (as the workers'): the largest file an
    /// upload request may ask a URL for.
    pub max_upload_bytes: u64,
    /// `SANDCELL_UPLOAD_URL_TTL_S`, default 900: how long an upload's presigned URLs work.
    pub upload_url_ttl: Duration,
    /// `SANDCELL_UPLOAD_TTL_S`, default 86400 (a day), never less than an hour past the URLs'
    /// time (a PUT begun just before its URL expires may still be writing): how long what a
    /// tenant put through an upload grant is kept for its jobs, counted against its
    /// stored-bytes quota, before the sweeper removes it.
    pub upload_ttl: Duration,
    /// `SANDCELL_RESULT_RETENTION_S`, default 2592000 (30 days), never less than a day past
    /// the longest artifact TTL or the upload TTL (what the store holds outlives no row that
    /// names it): how long a finished job's result, a refusal and an upload's answer are kept
    /// before the sweeper deletes them (`sandcell_core::retention`). A job id is remembered as
    /// long.
    pub result_retention: Duration,
    /// `SANDCELL_RABBITMQ_MANAGEMENT_URL`, default `http://127.0.0.1:15672`: the broker's
    /// management API, where the live-output watch counts tenants' queues (as the user of
    /// `SANDCELL_AMQP_URL`, which must be a broker administrator).
    pub management_url: String,
    /// `SANDCELL_LIVE_OUTPUT_CHECK_S`, default 5 (0: off): how often the live-output watch
    /// counts each tenant's queues and bindings, so about how long a tenant may hold more.
    pub live_output_check: Duration,
    /// `SANDCELL_TENANT_MAX_LIVE_QUEUES` (default 64) and `SANDCELL_TENANT_MAX_LIVE_BINDINGS`
    /// (default 4096): what a tenant may hold of the broker's live output.
    pub live_output_limits: live_output::Limits,
}

impl Config {
    /// What an upload grant allows and for how long.
    pub(crate) fn upload_terms(&self) -> uploads::Terms {
        uploads::Terms { max_file_bytes: self.max_upload_bytes, url_ttl: self.upload_url_ttl, objects_ttl: self.upload_ttl }
    }

    /// Read the configuration from the environment.
    pub fn from_env() -> Result<Self> {
        let url_ttl_s = config::parse_or("SANDCELL_UPLOAD_URL_TTL_S", 900u64)?.clamp(1, 7 * 86_400);
        let upload_ttl_s = config::parse_or("SANDCELL_UPLOAD_TTL_S", 86_400u64)?.clamp(url_ttl_s + 3600, 366 * 86_400);
        let policy = config::limit_policy_from_env()?;
        let kept_in_store_s = policy.max.artifact_ttl_s.max(upload_ttl_s);
        let longest_retention_s = 100 * 366 * 86_400;
        let shortest_retention_s = kept_in_store_s.saturating_add(86_400).min(longest_retention_s);
        let retention_s = config::parse_or("SANDCELL_RESULT_RETENTION_S", 30 * 86_400u64)?.clamp(shortest_retention_s, longest_retention_s);
        Ok(Config {
            services: Services::from_env()?,
            policy,
            intake: config::intake_limits_from_env()?,
            metrics_addr: config::parse_or("SANDCELL_SCHEDULER_METRICS_ADDR", SocketAddr::from(([127, 0, 0, 1], 9464)))?,
            db_connections: config::parse_or("SANDCELL_SCHEDULER_DB_CONNECTIONS", DEFAULT_DB_CONNECTIONS)?.clamp(MIN_DB_CONNECTIONS, 1024),
            sweep_interval: Duration::from_secs_f64(config::parse_or("SANDCELL_SWEEP_INTERVAL_S", 30.0f64)?.max(0.1)),
            prefetch: config::parse_or("SANDCELL_INTAKE_PREFETCH", 32u16)?.max(1),
            tenant_concurrency: config::parse_or("SANDCELL_INTAKE_TENANT_CONCURRENCY", tenant_gates::DEFAULT_TENANT_CONCURRENCY)?.max(1),
            quota_memory: Duration::from_millis(config::parse_or("SANDCELL_INTAKE_QUOTA_MEMORY_MS", quota_memory::DEFAULT_QUOTA_MEMORY.as_millis() as u64)?),
            intake_partitions: config::parse_or("SANDCELL_INTAKE_PARTITIONS", sandcell_core::broker::DEFAULT_INTAKE_PARTITIONS)?.clamp(1, 1024),
            rebalance_interval: Duration::from_millis(config::parse_or("SANDCELL_INTAKE_REBALANCE_MS", 1000u64)?.max(50)),
            stop_grace: Duration::from_secs_f64(config::parse_or("SANDCELL_SCHEDULER_STOP_GRACE_S", 20.0f64)?.max(0.0)),
            keep_alive: config::keep_alive_policy_from_env()?,
            worker_dead_after: Duration::from_secs_f64(config::parse_or("SANDCELL_WORKER_DEAD_AFTER_S", 30.0f64)?.max(1.0)),
            dispatch_interval: Duration::from_millis(config::parse_or("SANDCELL_DISPATCH_INTERVAL_MS", 100u64)?.max(1)),
            stuck_after: Duration::from_secs_f64(config::parse_or("SANDCELL_STUCK_AFTER_S", 3600.0f64)?.max(1.0)),
            session_start_wait: Duration::from_secs_f64(config::parse_or("SANDCELL_SESSION_START_WAIT_S", 60.0f64)?.max(0.0)),
            trusted_publishers: config::var_or("SANDCELL_TRUSTED_PUBLISHERS", "sandcell")
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            tenant_db_hold: Duration::from_secs_f64(config::parse_or("SANDCELL_TENANT_DB_HOLD_S", 10.0f64)?.clamp(0.0, 86_400.0)),
            tenant_db_check: Duration::from_millis(config::parse_or("SANDCELL_TENANT_DB_CHECK_MS", 1000u64)?.clamp(100, 60_000)),
            tenant_defaults: Quotas::from_env()?,
            max_upload_bytes: config::parse_or("SANDCELL_MAX_UPLOAD_FILE_BYTES", 100u64 << 20)?,
            upload_url_ttl: Duration::from_secs(url_ttl_s),
            upload_ttl: Duration::from_secs(upload_ttl_s),
            result_retention: Duration::from_secs(retention_s),
            management_url: config::var_or("SANDCELL_RABBITMQ_MANAGEMENT_URL", "http://127.0.0.1:15672"),
            live_output_check: live_output_check(config::parse_or("SANDCELL_LIVE_OUTPUT_CHECK_S", 5.0f64)?)?,
            live_output_limits: live_output::Limits {
                max_queues: config::parse_or("SANDCELL_TENANT_MAX_LIVE_QUEUES", sandcell_core::broker::DEFAULT_TENANT_MAX_LIVE_QUEUES)?,
                max_bindings: config::parse_or("SANDCELL_TENANT_MAX_LIVE_BINDINGS", sandcell_core::broker::DEFAULT_TENANT_MAX_LIVE_BINDINGS)?,
            },
        })
    }
}

/// `SANDCELL_LIVE_OUTPUT_CHECK_S` as a period: 0 turns the watch off; otherwise at least half a
/// second (each check lists the broker's queues) and at most an hour.
fn live_output_check(secs: f64) -> Result<Duration> {
    anyhow::ensure!(secs.is_finite() && secs >= 0.0, "SANDCELL_LIVE_OUTPUT_CHECK_S must be a number of seconds, 0 or more; got {secs}");
    Ok(if secs == 0.0 { Duration::ZERO } else { Duration::from_secs_f64(secs.clamp(0.5, 3600.0)) })
}

/// Run the scheduler until a fatal error. Services that are down are waited for, not fatal.
pub async fn run(cfg: Config) -> Result<()> {
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    let db_url = cfg.services.database_url.clone();
    if cfg.tenant_concurrency.saturating_mul(2) > cfg.db_connections as usize {
        tracing::warn!(
            tenant_concurrency = cfg.tenant_concurrency,
            db_connections = cfg.db_connections,
            "SANDCELL_INTAKE_TENANT_CONCURRENCY is more than half of SANDCELL_SCHEDULER_DB_CONNECTIONS: one tenant whose row is held can keep every other tenant's submissions waiting for a connection"
        );
    }
    let connections = cfg.db_connections;
    let pool = sandcell_core::retry_forever("postgres", |_| sandcell_core::jobs::connect(&db_url, connections)).await;
    match sandcell_core::tenants::lockdown_missing(&pool).await {
        Ok(missing) if !missing.is_empty() => tracing::error!(
            missing = missing.join(", "),
            "one tenant's database login can stop every other's jobs here (advisory locks fill Postgres' lock table, large \
             objects its disk, and without pg_read_all_stats and pg_signal_backend this scheduler cannot see or end a \
             tenant's session that holds the notification queue): apply deploy/postgres/lockdown.sql to this database as a superuser"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = format!("{e:#}"), "could not check what tenants' database logins can execute"),
    }
    let jobs = JobStore::new(pool).with_tenant_defaults(cfg.tenant_defaults);
    let store = ArtifactStore::new(&cfg.services.s3);
    // Backstop for the sweeper: lifecycle rules count whole days, so one day past the longest
    // TTL (an artifact's, or an upload's).
    let longest_s = cfg.policy.max.artifact_ttl_s.max(cfg.upload_ttl.as_secs());
    let days = i32::try_from(longest_s.div_ceil(86_400) + 1).unwrap_or(i32::MAX);
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
    let store_for_uploads = store.clone();
    let limits = sweeper::SweepLimits {
        worker_dead_after: cfg.worker_dead_after,
        stuck_after: cfg.stuck_after,
        session_start_wait: cfg.session_start_wait,
        result_retention: cfg.result_retention,
    };
    let sweeper = tokio::spawn(sweeper::run(jobs.clone(), metrics.clone(), cfg.sweep_interval, limits));
    let store_sweeper = tokio::spawn(sweeper::run_store(jobs.clone(), store, metrics.clone(), cfg.sweep_interval));
    let dispatcher = tokio::spawn(dispatch::run(cfg.services.amqp_url.clone(), jobs.clone(), metrics.clone(), cfg.dispatch_interval));
    let rules = dead_letters::Rules { trusted_publishers: cfg.trusted_publishers.clone(), intake: cfg.intake.clone(), max_upload_bytes: cfg.max_upload_bytes };
    let recorder = tokio::spawn(dead_letters::run(cfg.services.amqp_url.clone(), rules, jobs.clone(), metrics.clone()));
    let management = sandcell_core::management::Management::new(&cfg.management_url, &cfg.services.amqp_url, Duration::from_secs(30))?;
    let service_user = sandcell_core::broker::url_user(&cfg.services.amqp_url).unwrap_or_default();
    let shutdown = CancellationToken::new();
    let mut live_watch =
        tokio::spawn(live_output::run(management, cfg.live_output_limits, service_user, metrics.clone(), cfg.live_output_check, shutdown.clone()));
    let tenant_watch = if cfg.tenant_db_hold.is_zero() {
        tokio::spawn(std::future::pending::<()>())
    } else {
        tokio::spawn(tenant_sessions::run(jobs.pool().clone(), metrics.clone(), cfg.tenant_db_check, cfg.tenant_db_hold))
    };
    let stop_grace = cfg.stop_grace;
    let mut intake = tokio::spawn(intake::run(cfg, jobs, store_for_uploads, metrics, broker_up, shutdown.clone()));

    tokio::select! {
        r = server => r.context("metrics task panicked")?.context("metrics endpoint failed"),
        r = sweeper => r.context("sweeper task panicked"),
        r = store_sweeper => r.context("store sweeper task panicked"),
        r = dispatcher => r.context("dispatcher task panicked"),
        r = recorder => r.context("dead-letter recorder task panicked"),
        r = tenant_watch => r.context("tenant session watch task panicked"),
        r = &mut live_watch => r.context("live-output watch task panicked"),
        r = &mut intake => r.context("intake task panicked"),
        signal = sandcell_core::telemetry::stop_signal() => {
            // Stop taking submissions, finish those taken, close the partitions' channels (the
            // broker hands what was not started to the next owner), then release the locks.
            tracing::info!(%signal, grace_s = stop_grace.as_secs_f64(), "stopping: finishing the submissions taken");
            shutdown.cancel();
            if tokio::time::timeout(stop_grace, intake).await.is_err() {
                tracing::warn!("the intake did not finish within the grace; exiting (the broker returns what was not acked)");
            }
            // A tenant being held to its live-output limit is let in again before the exit.
            if tokio::time::timeout(stop_grace, live_watch).await.is_err() {
                tracing::warn!("the live-output watch did not finish within the grace; exiting (the next scheduler to start lets a barred tenant connect again)");
            }
            Ok(())
        }
    }
}
