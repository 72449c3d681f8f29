//! Consuming execution jobs: claim, execute, store, commit, ack.
//!
//! Invariants:
//! - prefetch = slots: the broker never hands this worker more jobs than it can run at once,
//!   and every unacked delivery is a busy slot;
//! - a job is acked only after its result is committed in Postgres; if the worker dies before,
//!   the broker redelivers it and the next claim runs it again (`attempts` counts the claims);
//! - a redelivered job that is already finished is acked without running (claim refuses it);
//! - only a redelivered message may take over a `running` job (its worker died); a fresh
//!   delivery of a job that is already running is acked without running it again;
//! - a job claimed more than `SANDCELL_MAX_ATTEMPTS` times is failed with `too_many_attempts`
//!   instead of being run again (a job that crashes workers cannot crash them forever).

use std::collections::HashMap;
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
use sandcell_core::jobs::{Finished, JobStore};
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::{ErrorCode, ExecutionJob, JobStatus, Reason};

use crate::execute::{execute, Outcome};
use crate::metrics::Metrics;
use crate::sandbox::container::{LABEL_JOB, LABEL_TENANT, LABEL_WORKER};
use crate::Config;

/// Everything a job handler needs.
#[derive(Clone)]
pub struct WorkerContext {
    /// Settings.
    pub cfg: Arc<Config>,
    /// Docker client.
    pub docker: Docker,
    /// Job store.
    pub jobs: JobStore,
    /// Artifact store.
    pub store: ArtifactStore,
    /// Metrics.
    pub metrics: Metrics,
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
    let ch = conn.create_channel().await.context("opening channel")?;
    broker::declare_topology(&ch).await?;
    ch.basic_qos(ctx.cfg.slots, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut consumer = ch
        .basic_consume(broker::JOBS_QUEUE.into(), name.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .context("consuming jobs")?;
    broker_up.store(true, Ordering::Relaxed);
    tracing::info!(worker_id = %ctx.cfg.worker_id, slots = ctx.cfg.slots, "worker consuming");
    let mut running = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            next = consumer.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a job")?;
                let ctx = ctx.clone();
                running.spawn(async move { handle_delivery(&ctx, delivery).await });
            }
            Some(done) = running.join_next(), if !running.is_empty() => {
                done.context("job handler panicked")??;
            }
        }
    }
    Ok(())
}

async fn handle_delivery(ctx: &WorkerContext, delivery: Delivery) -> Result<()> {
    let job: ExecutionJob = match serde_json::from_slice(&delivery.data) {
        Ok(j) => j,
        Err(e) => {
            // Only the scheduler publishes here; a message it did not write is poison.
            tracing::error!(error = %e, bytes = delivery.data.len(), "undecodable execution job; dead-lettering");
            delivery.nack(BasicNackOptions { requeue: false, ..Default::default() }).await.context("dead-lettering job")?;
            return Ok(());
        }
    };
    ctx.metrics.busy_slots.inc();
    let result = process(ctx, &job, delivery.redelivered).await;
    ctx.metrics.busy_slots.dec();
    result?;
    delivery.ack(BasicAckOptions::default()).await.context("acking job")?;
    Ok(())
}

/// Run one job to a committed result. An error means nothing was committed: the delivery must
/// stay unacked.
async fn process(ctx: &WorkerContext, job: &ExecutionJob, redelivered: bool) -> Result<()> {
    let (tenant, job_id) = (job.tenant.as_str(), job.job_id.as_str());
    let Some(claim) = ctx.jobs.claim(tenant, job_id, &ctx.cfg.worker_id, redelivered).await? else {
        tracing::info!(tenant, job_id, redelivered, "job already running, finished or unknown; not run again");
        return Ok(());
    };
    let wait = (chrono::Utc::now() - claim.queued_at).to_std().unwrap_or_default();
    ctx.metrics.queue_wait_seconds.observe(wait.as_secs_f64());
    if claim.attempt > ctx.cfg.max_attempts {
        let reason = Reason::new(ErrorCode::TooManyAttempts, format!("claimed {} times without completing", claim.attempt - 1));
        ctx.jobs.fail(tenant, job_id, JobStatus::InfrastructureError, &reason).await?;
        ctx.metrics.jobs.with_label_values(&[JobStatus::InfrastructureError.as_str()]).inc();
        return Ok(());
    }
    let started = Instant::now();
    let limits = ctx.cfg.policy.cap(&job.limits);
    let labels = HashMap::from([
        (LABEL_WORKER.to_string(), ctx.cfg.worker_id.clone()),
        (LABEL_TENANT.to_string(), tenant.to_string()),
        (LABEL_JOB.to_string(), job_id.to_string()),
    ]);
    tracing::info!(tenant, job_id, attempt = claim.attempt, "running job");
    let outcome = execute(&ctx.docker, &ctx.cfg.exec, labels, job, &limits).await;
    if let Some(d) = outcome.sandbox_start {
        ctx.metrics.container_start_seconds.observe(d.as_secs_f64());
    }
    let finished = finish(ctx, job, &limits, outcome).await;
    commit(ctx, tenant, job_id, &finished).await?;
    ctx.metrics.jobs.with_label_values(&[finished.status.as_str()]).inc();
    ctx.metrics.execution_seconds.observe(started.elapsed().as_secs_f64());
    tracing::info!(tenant, job_id, status = %finished.status, elapsed_ms = started.elapsed().as_millis() as u64, "job finished");
    Ok(())
}

/// Store the outcome's files and turn it into the row to commit.
async fn finish(ctx: &WorkerContext, job: &ExecutionJob, limits: &sandcell_protocol::ExecutionLimits, o: Outcome) -> Finished {
    let mut fin = Finished {
        status: o.status,
        stdout: o.stdout.text,
        stderr: o.stderr.text,
        stdout_truncated: o.stdout.truncated,
        stderr_truncated: o.stderr.truncated,
        exit_code: o.exit_code,
        error: o.error,
        reason: o.reason,
        outputs: Vec::new(),
        artifacts: Vec::new(),
    };
    match crate::artifacts::store_all(&ctx.store, &job.tenant, &job.job_id, limits, o.files, o.outputs).await {
        Ok(stored) => {
            fin.outputs = stored.outputs;
            fin.artifacts = stored.artifacts;
        }
        Err(e) => {
            tracing::error!(tenant = %job.tenant, job_id = %job.job_id, error = format!("{e:#}"), "storing artifacts failed");
            fin.status = JobStatus::InfrastructureError;
            fin.reason = Some(Reason::new(ErrorCode::StorageFailed, format!("{e:#}")));
        }
    }
    fin
}

/// Commit with a few retries (the database may be restarting). Gives up with an error, leaving
/// the delivery unacked so that the job is redelivered.
async fn commit(ctx: &WorkerContext, tenant: &str, job_id: &str, fin: &Finished) -> Result<()> {
    let committed = sandcell_core::retry("committing a result", 6, |_| ctx.jobs.finish(tenant, job_id, fin)).await?;
    if !committed {
        tracing::warn!(tenant, job_id, "job was finished elsewhere; this result is discarded");
    }
    Ok(())
}
