//! Intake: `sandcell.submissions` → validation → Postgres → `sandcell.jobs`.
//!
//! Invariants:
//! - a submission is acked only after its outcome is durable: the job row exists and the
//!   execution job is confirmed by the broker, or the rejection is recorded;
//! - nothing is dropped silently: a message whose `(tenant, job_id)` can be recovered gets a
//!   `rejected` job row the client can poll; any other bad message is recorded in
//!   `intake_rejections` and dead-lettered;
//! - a job id is run once per tenant: a duplicate is acked without dispatch, except when the
//!   first copy was recorded but never confirmed on the jobs queue and this delivery is a retry
//!   or a redelivery (the scheduler failed in between), in which case it is dispatched now.
//!   Should a job still be dispatched twice, workers run it once: a fresh delivery never takes
//!   over a job that is already running.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use sandcell_core::broker;
use sandcell_core::jobs::{JobStore, Recorded};
use sandcell_protocol::{parse_submission, ExecutionJob, JobStatus, Rejection, Submission};
use sha2::{Digest, Sha256};

use crate::metrics::Metrics;
use crate::Config;

/// What to do with a delivery once handled.
enum Disposition {
    Ack,
    DeadLetter,
}

/// Consume submissions forever, reconnecting after broker failures.
pub async fn run(cfg: Config, jobs: JobStore, metrics: Metrics, broker_up: Arc<AtomicBool>) {
    loop {
        let result = consume(&cfg, &jobs, &metrics, &broker_up).await;
        broker_up.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => tracing::warn!("submission consumer ended; reconnecting"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "submission consumer failed; reconnecting"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn consume(cfg: &Config, jobs: &JobStore, metrics: &Metrics, broker_up: &AtomicBool) -> Result<()> {
    let url = cfg.services.amqp_url.clone();
    let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&url, "sandcell-scheduler")).await;
    let consumer_ch = conn.create_channel().await.context("opening consumer channel")?;
    broker::declare_topology(&consumer_ch).await?;
    let publisher = broker::publisher_channel(&conn).await?;
    consumer_ch.basic_qos(cfg.prefetch, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut consumer = consumer_ch
        .basic_consume(broker::SUBMISSIONS_QUEUE.into(), "sandcell-scheduler".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .context("consuming submissions")?;
    broker_up.store(true, Ordering::Relaxed);
    tracing::info!(queue = broker::SUBMISSIONS_QUEUE, prefetch = cfg.prefetch, "intake consuming");

    // Deliveries are handled concurrently (up to the prefetch); each acks its own message.
    let mut in_flight = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            next = consumer.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a submission")?;
                let (cfg, jobs, metrics, publisher) = (cfg.clone(), jobs.clone(), metrics.clone(), publisher.clone());
                in_flight.spawn(async move { handle_delivery(&cfg, &jobs, &metrics, &publisher, delivery).await });
            }
            Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                // A failed handler left its message unacked; reconnecting makes the broker redeliver it.
                done.context("intake handler panicked")??;
            }
        }
    }
    Ok(())
}

/// Handle one delivery and ack or dead-letter it. Infrastructure errors are retried a few
/// times, then returned (the message stays unacked and is redelivered after reconnecting).
async fn handle_delivery(cfg: &Config, jobs: &JobStore, metrics: &Metrics, publisher: &Channel, delivery: Delivery) -> Result<()> {
    let started = Instant::now();
    let disposition = sandcell_core::retry("handling a submission", 6, |attempt| {
        // A retry of this very delivery, or a redelivery, may finish a dispatch it began.
        let may_redispatch = delivery.redelivered || attempt > 1;
        handle(cfg, jobs, metrics, publisher, &delivery, may_redispatch)
    })
    .await?;
    match disposition {
        Disposition::Ack => {
            delivery.ack(BasicAckOptions::default()).await.context("acking submission")?;
        }
        Disposition::DeadLetter => {
            delivery.nack(BasicNackOptions { requeue: false, ..Default::default() }).await.context("dead-lettering submission")?;
        }
    }
    metrics.intake_seconds.observe(started.elapsed().as_secs_f64());
    Ok(())
}

async fn handle(cfg: &Config, jobs: &JobStore, metrics: &Metrics, publisher: &Channel, delivery: &Delivery, may_redispatch: bool) -> Result<Disposition> {
    let message_id = delivery.properties.message_id().as_ref().map(|s| s.as_str().to_owned());
    match parse_submission(&delivery.data, &cfg.intake) {
        Ok(sub) => accept(cfg, jobs, metrics, publisher, &sub, &delivery.data, may_redispatch).await,
        Err(rejection) => reject(jobs, metrics, &rejection, message_id.as_deref(), &delivery.data).await,
    }
}

async fn accept(
    cfg: &Config,
    jobs: &JobStore,
    metrics: &Metrics,
    publisher: &Channel,
    sub: &Submission,
    body: &[u8],
    may_redispatch: bool,
) -> Result<Disposition> {
    let limits = cfg.policy.resolve(&sub.resource_request());
    let digest = hex::encode(Sha256::digest(body));
    match jobs.record_queued(sub, &limits, &digest).await? {
        Recorded::New => {}
        // Only the delivery that recorded the job (retried, or redelivered after the scheduler
        // died) finishes its dispatch; a concurrent duplicate must not dispatch it a second time.
        Recorded::Duplicate { status: JobStatus::Queued, dispatched: false, .. } if may_redispatch => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "job recorded earlier but never dispatched; dispatching now");
        }
        Recorded::Duplicate { status, same_payload, .. } => {
            if same_payload {
                tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "duplicate submission; not run again");
            } else {
                tracing::warn!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "job id reused with a different payload; the first submission stands");
            }
            metrics.submissions.with_label_values(&["duplicate"]).inc();
            return Ok(Disposition::Ack);
        }
    }
    let job = ExecutionJob {
        tenant: sub.tenant.clone(),
        job_id: sub.job_id.clone(),
        language: sub.language,
        code: sub.code.clone(),
        files: sub.files.clone(),
        limits,
    };
    let payload = serde_json::to_vec(&job).context("serializing execution job")?;
    broker::publish_confirmed(publisher, broker::JOBS_QUEUE, &payload, broker::json_properties(&format!("{}/{}", sub.tenant, sub.job_id))).await?;
    jobs.mark_dispatched(&sub.tenant, &sub.job_id).await?;
    metrics.submissions.with_label_values(&["accepted"]).inc();
    tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, language = sub.language.as_str(), "job queued");
    Ok(Disposition::Ack)
}

async fn reject(jobs: &JobStore, metrics: &Metrics, rej: &Rejection, message_id: Option<&str>, body: &[u8]) -> Result<Disposition> {
    if let Some((tenant, job_id)) = rej.recoverable_key() {
        let written = jobs.record_rejection(tenant, job_id, &rej.reason).await?;
        if !written {
            tracing::warn!(tenant, job_id, code = %rej.reason.code, "invalid resubmission of an existing job id; the existing job is kept");
        }
        tracing::info!(tenant, job_id, code = %rej.reason.code, message = %rej.reason.message, "submission rejected");
        metrics.submissions.with_label_values(&["rejected"]).inc();
        return Ok(Disposition::Ack);
    }
    jobs.record_intake_rejection(message_id, &rej.reason, body).await?;
    tracing::warn!(message_id, code = %rej.reason.code, message = %rej.reason.message, body_bytes = body.len(), "unattributable submission dead-lettered");
    metrics.submissions.with_label_values(&["dead_lettered"]).inc();
    Ok(Disposition::DeadLetter)
}
