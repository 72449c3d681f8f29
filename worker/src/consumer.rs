//! Consuming execution jobs from two queues and sending each where it runs.
//!
//! - `sandcell.jobs` (shared by all workers, prefetch = slots): one-off jobs, run here in a
//!   kernel that is destroyed afterwards, and jobs that open a session, which this worker then
//!   holds ([`crate::session::open`]). A worker at its session capacity returns an opening job
//!   to the queue after a pause, for a worker with room.
//! - `sandcell.worker.<id>` (this worker's own): jobs of sessions it holds, handed to the
//!   session's task in delivery order; a job for a session it does not hold is refused with
//!   the session's reason.
//!
//! Invariants (as before sessions):
//! - a job is acked only after its result is committed in Postgres; if the worker dies before,
//!   the broker redelivers it and the next claim runs it again (`attempts` counts the claims);
//! - a redelivered job that is already finished is acked without running (claim refuses it);
//! - only a redelivered message may take over a `running` job (its worker died);
//! - a job claimed more than `SANDCELL_MAX_ATTEMPTS` times is failed with `too_many_attempts`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bollard::Docker;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use sandcell_core::broker;
use sandcell_core::jobs::JobStore;
use sandcell_core::sessions::SessionStore;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::{ErrorCode, ExecutionJob, Reason};
use tokio::sync::Semaphore;

use crate::kernel::OnTimeout;
use crate::metrics::Metrics;
use crate::pool::WarmPool;
use crate::run::{self, Extras};
use crate::session::{Registry, Work};
use crate::Config;

/// How long a worker at its session capacity holds an opening job before returning it.
const FULL_REQUEUE_DELAY: Duration = Duration::from_secs(1);

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
    /// Warm kernels.
    pub pool: WarmPool,
    /// Sessions held here.
    pub registry: Registry,
    /// Cells running at once (`SANDCELL_WORKER_SLOTS`).
    pub slots: Arc<Semaphore>,
    /// Sessions held at once (`SANDCELL_WORKER_MAX_SESSIONS`).
    pub session_capacity: Arc<Semaphore>,
}

/// Consume forever, reconnecting after broker failures.
pub async fn run(ctx: WorkerContext, broker_up: Arc<AtomicBool>) {
    loop {
        let result = consume(&ctx, &broker_up).await;
        broker_up.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => tracing::warn!("job consumer ended; reconnecting"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "job consumer failed; reconnecting"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn consume(ctx: &WorkerContext, broker_up: &AtomicBool) -> Result<()> {
    let url = ctx.cfg.services.amqp_url.clone();
    let name = format!("sandcell-worker-{}", ctx.cfg.worker_id);
    let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&url, &name)).await;
    let shared_ch = conn.create_channel().await.context("opening channel")?;
    broker::declare_topology(&shared_ch).await?;
    shared_ch.basic_qos(ctx.cfg.slots, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut shared = shared_ch
        .basic_consume(broker::JOBS_QUEUE.into(), name.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .context("consuming jobs")?;
    let own_ch = conn.create_channel().await.context("opening channel")?;
    let own_queue = broker::declare_worker_queue(&own_ch, &ctx.cfg.worker_id).await?;
    own_ch.basic_qos(ctx.cfg.session_prefetch, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut own = own_ch
        .basic_consume(own_queue.as_str().into(), format!("{name}-sessions").as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .with_context(|| format!("consuming {own_queue}"))?;
    broker_up.store(true, Ordering::Relaxed);
    tracing::info!(worker_id = %ctx.cfg.worker_id, slots = ctx.cfg.slots, own_queue, "worker consuming");
    let mut running = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            next = shared.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a job")?;
                let ctx = ctx.clone();
                running.spawn(async move { handle_shared(&ctx, delivery).await });
            }
            next = own.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a session job")?;
                // Handed to the session synchronously, so delivery order is mailbox order.
                handle_own(ctx, delivery).await?;
            }
            Some(done) = running.join_next(), if !running.is_empty() => {
                done.context("job handler panicked")??;
            }
        }
    }
    Ok(())
}

/// Decode an execution job; a message the scheduler did not write is dead-lettered.
async fn decode(delivery: &Delivery) -> Result<Option<ExecutionJob>> {
    match serde_json::from_slice(&delivery.data) {
        Ok(j) => Ok(Some(j)),
        Err(e) => {
            tracing::error!(error = %e, bytes = delivery.data.len(), "undecodable execution job; dead-lettering");
            delivery.nack(BasicNackOptions { requeue: false, ..Default::default() }).await.context("dead-lettering job")?;
            Ok(None)
        }
    }
}

async fn handle_shared(ctx: &WorkerContext, delivery: Delivery) -> Result<()> {
    let Some(job) = decode(&delivery).await? else { return Ok(()) };
    match &job.session {
        None => one_off(ctx, job, delivery).await,
        Some(s) if s.new => {
            let Ok(permit) = ctx.session_capacity.clone().try_acquire_owned() else {
                tracing::info!(job_id = %job.job_id, held = ctx.registry.len(), "at session capacity; returning an opening job to the queue");
                tokio::time::sleep(FULL_REQUEUE_DELAY).await;
                delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.context("requeueing job")?;
                return Ok(());
            };
            let Some(claim) = run::claim(ctx, &job, delivery.redelivered).await? else {
                delivery.ack(BasicAckOptions::default()).await.context("acking job")?;
                return Ok(());
            };
            crate::session::open(ctx.clone(), Work { job, delivery, claim: Some(claim) }, permit).await
        }
        // Jobs of existing sessions travel on workers' own queues; accept one here all the same.
        Some(_) => route_to_session(ctx, Work { job, delivery, claim: None }).await,
    }
}

async fn handle_own(ctx: &WorkerContext, delivery: Delivery) -> Result<()> {
    let Some(job) = decode(&delivery).await? else { return Ok(()) };
    route_to_session(ctx, Work { job, delivery, claim: None }).await
}

/// Give a job to the session it names, or refuse it with the session's reason.
async fn route_to_session(ctx: &WorkerContext, work: Work) -> Result<()> {
    let Err(work) = ctx.registry.deliver(work) else { return Ok(()) };
    let job = &work.job;
    let id = job.session.as_ref().map(|s| s.id.as_str()).unwrap_or_default();
    let reason = match ctx.sessions.state(&job.tenant, id).await? {
        None => Reason::new(ErrorCode::SessionNotFound, format!("tenant {} has no session {id}", job.tenant)),
        Some(state) => state
            .refusal(id)
            .unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, format!("session {id} is not held by worker {}", ctx.cfg.worker_id))),
    };
    run::refuse(ctx, job, &reason).await?;
    work.delivery.ack(BasicAckOptions::default()).await.context("acking job")?;
    Ok(())
}

/// Run a job without a session in its own kernel, destroyed afterwards.
async fn one_off(ctx: &WorkerContext, job: ExecutionJob, delivery: Delivery) -> Result<()> {
    let Some((files, claim)) = run::prepare(ctx, &job, &delivery, None).await? else { return Ok(()) };
    let started = Instant::now();
    let limits = ctx.cfg.policy.cap(&job.limits);
    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, attempt = claim.attempt, "running job");
    let (outcome, container) = {
        let _slot = ctx.slots.acquire().await.context("slots closed")?;
        ctx.metrics.busy_slots.inc();
        let spec = run::spec_for(ctx, &job, &limits);
        let result = match run::kernel_for(ctx, &spec).await {
            Ok(mut kernel) => {
                let cell = kernel.run(&job, &files, &limits, OnTimeout::Kill).await;
                let id = kernel.id().to_string();
                kernel.destroy().await;
                (cell.outcome, Some(id))
            }
            Err(e) => (crate::execute::Outcome::new(&limits).infra(ErrorCode::SandboxUnavailable, format!("{e:#}")), None),
        };
        ctx.metrics.busy_slots.dec();
        result
    };
    let status = run::commit(ctx, &job, &limits, outcome, Extras { container_id: container, ..Default::default() }).await?;
    delivery.ack(BasicAckOptions::default()).await.context("acking job")?;
    ctx.metrics.execution_seconds.observe(started.elapsed().as_secs_f64());
    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, %status, elapsed_ms = started.elapsed().as_millis() as u64, "job finished");
    Ok(())
}
