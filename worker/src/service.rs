//! The worker as a service: start-up (Docker, Postgres, leftovers of a previous run), the
//! health endpoint, the heartbeat, the consumer, and shutdown — the wiring of the crate's parts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use sandcell_core::jobs::{Gone, JobStore};
use sandcell_core::sessions::SessionStore;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::MoveCause;
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::{consumer, context, ledger, metrics, pool, sandbox};

/// Connect to Docker (whatever API version the daemon speaks) and check it answers.
pub async fn connect_docker() -> Result<bollard::Docker> {
    let docker = bollard::Docker::connect_with_defaults().context("configuring the Docker client")?;
    let docker = docker.negotiate_version().await.context("negotiating the Docker API version")?;
    docker.ping().await.context("pinging Docker")?;
    Ok(docker)
}

/// How long a draining worker waits for its sessions to save their variables.
const SNAPSHOT_GRACE: Duration = Duration::from_secs(20);

/// Run the worker until a fatal error. Services that are down are waited for, not fatal.
pub async fn run(mut cfg: Config) -> Result<()> {
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    metrics.slots.set(i64::from(cfg.slots));
    metrics.max_sessions.set(i64::from(cfg.max_sessions));
    let docker = sandcell_core::retry_forever("docker", |_| connect_docker()).await;
    let removed = sandbox::remove_leftovers(&docker, &cfg.worker_id).await?;
    if removed > 0 {
        tracing::warn!(removed, worker_id = %cfg.worker_id, "removed sandboxes left by a previous run");
    }
    // After the sweep: the sockets of the previous run's sandboxes go with them.
    cfg.kernel.channels = cfg.kernel.channel_dir.as_deref().and_then(|dir| sandbox::channel::ChannelRoot::prepare(dir, &cfg.worker_id));
    let db_url = cfg.services.database_url.clone();
    let pool = sandcell_core::retry_forever("postgres", |_| sandcell_core::jobs::connect(&db_url, u32::from(cfg.slots) + 4)).await;
    let jobs = JobStore::new(pool.clone());
    let sessions = SessionStore::new(pool);
    // The containers of this worker's previous run are gone: its sessions move, each with its
    // next job, to a worker that puts their stored workspace back.
    let moved =
        sandcell_core::retry_forever("postgres", |_| sessions.orphan_worker(&cfg.worker_id, MoveCause::WorkerLost, "the worker holding it restarted")).await;
    if moved > 0 {
        tracing::warn!(moved, worker_id = %cfg.worker_id, "sessions of a previous run set moving");
    }
    // Its one-off jobs that were running died with its containers (a redelivered copy that
    // reaches this worker now is dropped rather than run a second time).
    let ended = sandcell_core::retry_forever("postgres", |_| jobs.end_jobs_of_gone_worker(Gone::Restarted(&cfg.worker_id))).await;
    if ended > 0 {
        tracing::warn!(ended, worker_id = %cfg.worker_id, "jobs a previous run was running ended worker_lost");
    }
    let store = ArtifactStore::new(&cfg.services.s3);
    if cfg.warm_pool_prepared && cfg.reuse.max_jobs <= 1 {
        tracing::warn!(
            "SANDCELL_WARM_POOL_PREPARED is set but one-off sandboxes are not reused (SANDCELL_ONEOFF_REUSE_JOBS=1): no job is forked from a warm kernel, so its preparation is wasted"
        );
    }
    let activity = context::Activity::new();
    let warm = pool::WarmPool::new(cfg.warm_pool, cfg.warm_pool_prepared, &cfg.kernel, cfg.policy.default.clone(), &cfg.worker_id, metrics.clone());
    tokio::spawn(warm.clone().refill_forever(docker.clone(), cfg.kernel.clone(), activity.clone()));
    let bound = crate::bound::BoundPool::new(cfg.reuse.clone(), metrics.clone());
    tokio::spawn(bound.clone().reap_forever());
    // Seen alive before it takes any job: a job claimed by a worker with no heartbeat on record
    // would read as a dead worker's.
    sandcell_core::retry_forever("postgres", |_| sessions.heartbeat(&cfg.worker_id, i32::from(cfg.slots), i32::from(cfg.max_sessions))).await;
    tokio::spawn(heartbeat_forever(sessions.clone(), cfg.worker_id.clone(), cfg.slots, cfg.max_sessions, cfg.heartbeat));

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
    let (events, publisher) = crate::events::Events::new(metrics.events_published.clone(), metrics.events_dropped.clone());
    tokio::spawn(publisher.run());
    let (drain, draining) = tokio::sync::watch::channel(false);
    let (held_input_bytes, left_in_postgres) = (cfg.held_input_bytes, metrics.inputs_left_in_postgres.clone());
    let session_window = cfg.session_window();
    let ctx = context::WorkerContext {
        draining,
        events,
        ledger: ledger::Ledger::new(metrics.clone()),
        slots: Arc::new(Semaphore::new(usize::from(cfg.slots))),
        fetch_budget: crate::inputs::FetchBudget::new(cfg.fetch_bytes, metrics.fetch_budget_waits.clone()),
        activity,
        session_capacity: Arc::new(Semaphore::new(usize::from(cfg.max_sessions))),
        cfg: Arc::new(cfg),
        docker: docker.clone(),
        tenants: sandcell_core::tenants::TenantStore::new(jobs.pool().clone()),
        jobs,
        sessions: sessions.clone(),
        store,
        metrics,
        pool: warm.clone(),
        bound: bound.clone(),
        registry: crate::registry::Registry::new(held_input_bytes, session_window, left_in_postgres),
    };
    let worker_id = ctx.cfg.worker_id.clone();
    let (ledger, grace, registry) = (ctx.ledger.clone(), ctx.cfg.drain_grace, ctx.registry.clone());
    let consuming = tokio::spawn(consumer::run(ctx, broker_up));
    let result = tokio::select! {
        r = server => r.context("metrics task panicked")?.context("metrics endpoint failed"),
        r = consuming => r.context("consumer task panicked"),
        signal = sandcell_core::telemetry::stop_signal() => {
            // Stop taking jobs, and let those held here finish (their results committed and
            // their messages acked) within the grace; what is left then is redelivered.
            tracing::info!(signal, held = ledger.len(), grace_s = grace.as_secs_f64(), "told to stop; draining");
            drain.send_replace(true);
            let deadline = tokio::time::Instant::now() + grace;
            while ledger.len() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Each session saves its variables for the worker that takes it over (its jobs
            // are done, or the grace is over and the snapshot waits behind them).
            let saving = tokio::time::timeout(SNAPSHOT_GRACE, registry.snapshot_all()).await;
            tracing::info!(unfinished = ledger.len(), snapshots_done = saving.is_ok(), "drained; stopping");
            Ok(())
        }
    };
    // The sessions move: each continues on another worker with its next job (its jobs still
    // queued here are parked for the new owner), now rather than after the heartbeat times out.
    match sessions.orphan_worker(&worker_id, MoveCause::Drained, "the worker holding it was stopped").await {
        Ok(n) => tracing::info!(sessions = n, "this worker's sessions are moving to other workers"),
        Err(e) => tracing::warn!(error = format!("{e:#}"), "could not hand this worker's sessions over; the sweeper will once its heartbeat stops"),
    }
    warm.drain().await;
    bound.drain().await;
    if let Err(e) = sandbox::remove_leftovers(&docker, &worker_id).await {
        tracing::warn!(error = format!("{e:#}"), "could not remove this worker's sandboxes");
    }
    result
}

/// Tell Postgres this worker is alive, forever. The sweeper declares the sessions of a worker
/// that stops beating lost.
async fn heartbeat_forever(sessions: SessionStore, worker_id: String, slots: u16, max_sessions: u16, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Bounded by its period: a beat stuck on a dead connection must not stop the next ones.
        match tokio::time::timeout(every, sessions.heartbeat(&worker_id, i32::from(slots), i32::from(max_sessions))).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = format!("{e:#}"), "heartbeat failed"),
            Err(_) => tracing::warn!(timeout_ms = every.as_millis() as u64, "heartbeat timed out"),
        }
    }
}
