//! Consuming execution jobs from two queues and sending each where it runs.
//!
//! - `sandcell.jobs` (shared by all workers, prefetch = slots): one-off jobs, run here in a
//!   kernel that is destroyed afterwards, and jobs that open a session, which this worker then
//!   holds ([`crate::session::open`]). A worker at its session capacity returns an opening job
//!   to the queue a few times, for a worker with room; the last time it waits for room here
//!   (`SANDCELL_SESSION_START_WAIT_S`) and then refuses the job with `capacity`.
//! - `sandcell.worker.<id>` (this worker's own): jobs of sessions it holds, handed to the
//!   session's task in delivery order; a job for a session it does not hold is refused with
//!   the session's reason.
//!
//! Every delivery enters the [`Ledger`](crate::ledger::Ledger), and every handler ends by
//! settling its ticket with a [`Disposition`] — the one place messages are acked. Handlers run
//! as tasks of their own, not of the consumer: a broker reconnect replaces the consumer but
//! never cancels a running job; the copies the broker then redelivers are absorbed by the
//! ledger. A handler that fails returns its message to the queue; it never takes the consumer
//! (or any other job) down.
//!
//! Invariants:
//! - a job is acked only after its result is committed in Postgres; if the worker dies before,
//!   the broker redelivers it and the next claim runs it again (`attempts` counts the claims);
//! - a redelivered job that is already finished is acked without running (claim refuses it);
//! - only a redelivered message may take over a `running` job, and only from this worker's
//!   earlier life or from a worker whose heartbeat stopped;
//! - a job claimed more than `SANDCELL_MAX_ATTEMPTS` times is failed with `too_many_attempts`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use sandcell_core::broker;
use sandcell_protocol::{ErrorCode, ExecutionJob, Reason, SessionState};

use crate::context::WorkerContext;
use crate::ledger::{self, Disposition, Ticket};
use crate::run::{self, OneOff};
use crate::session::Work;

/// How long a worker at its session capacity holds an opening job before returning it.
const FULL_REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// Consume forever, reconnecting after broker failures.
pub async fn run(ctx: WorkerContext, broker_up: Arc<AtomicBool>) {
    loop {
        let result = consume(&ctx, &broker_up).await;
        broker_up.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => tracing::warn!("job consumer ended; reconnecting"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), held = ctx.ledger.len(), "job consumer failed; reconnecting (running jobs go on)"),
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
    loop {
        tokio::select! {
            next = shared.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a job")?;
                if let Some((job, ticket)) = admit(ctx, delivery).await {
                    // A task of its own: a reconnect of this consumer never cancels it.
                    tokio::spawn(handle_shared(ctx.clone(), job, ticket));
                }
            }
            next = own.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a session job")?;
                if let Some((job, ticket)) = admit(ctx, delivery).await {
                    // Handed to the session synchronously, so delivery order is mailbox order.
                    route_to_session(ctx, Work { job, ticket, claim: None }).await;
                }
            }
        }
    }
    Ok(())
}

/// Decode a delivery and enter it in the ledger. `None` when there is nothing to run: the
/// message was not a job (dead-lettered) or is a copy of a job in flight here (absorbed).
async fn admit(ctx: &WorkerContext, delivery: Delivery) -> Option<(ExecutionJob, Ticket)> {
    match serde_json::from_slice::<ExecutionJob>(&delivery.data) {
        Ok(job) => ctx.ledger.enter(&job, delivery).await.map(|ticket| (job, ticket)),
        Err(e) => {
            tracing::error!(error = %e, bytes = delivery.data.len(), "undecodable execution job; dead-lettering");
            ledger::settle_undecodable(&delivery, &ctx.metrics).await;
            None
        }
    }
}

async fn handle_shared(ctx: WorkerContext, job: ExecutionJob, ticket: Ticket) {
    match &job.session {
        None => {
            let result = run::job(&ctx, &job, ticket.redelivered, None, &mut OneOff::new(ctx.bound.reuses())).await;
            let disposition = ledger::disposition_of(&job, result).await;
            ticket.settle(disposition).await;
        }
        Some(s) if s.new => open_session(ctx, job, ticket).await,
        // Jobs of existing sessions travel on workers' own queues; accept one here all the same.
        Some(_) => route_to_session(&ctx, Work { job, ticket, claim: None }).await,
    }
}

/// Open the session a job asks for, when this worker has room for it.
async fn open_session(ctx: WorkerContext, job: ExecutionJob, ticket: Ticket) {
    let permit = match ctx.session_capacity.clone().try_acquire_owned() {
        Ok(p) => p,
        // Returned a few times so that a worker with room can take it; then waited for here.
        Err(_) if ticket.returns + 1 < broker::DELIVERY_LIMIT => {
            tracing::info!(job_id = %job.job_id, held = ctx.registry.len(), returns = ticket.returns, "at session capacity; returning an opening job to the queue");
            tokio::time::sleep(FULL_REQUEUE_DELAY).await;
            ticket.settle(Disposition::Requeue).await;
            return;
        }
        Err(_) => {
            let wait = ctx.cfg.session_start_wait;
            match tokio::time::timeout(wait, ctx.session_capacity.clone().acquire_owned()).await {
                Ok(Ok(p)) => p,
                _ => {
                    let reason = Reason::new(ErrorCode::Capacity, format!("no worker had room for another session within {} s", wait.as_secs()));
                    let disposition = ledger::disposition_of(&job, refuse_opening(&ctx, &job, &reason).await).await;
                    ticket.settle(disposition).await;
                    return;
                }
            }
        }
    };
    match run::claim(&ctx, &job, ticket.redelivered).await {
        Ok(Some(claim)) => crate::session::open(ctx, Work { job, ticket, claim: Some(claim) }, permit).await,
        Ok(None) => ticket.settle(Disposition::Ack).await,
        Err(e) => {
            let disposition = ledger::disposition_of(&job, Err(e)).await;
            ticket.settle(disposition).await;
        }
    }
}

/// Refuse a job that opens a session, and fail the session it would have opened.
async fn refuse_opening(ctx: &WorkerContext, job: &ExecutionJob, reason: &Reason) -> Result<Disposition> {
    if let Some(s) = &job.session {
        ctx.sessions.end(&s.id, None, SessionState::Failed, Some(reason)).await?;
    }
    run::refuse(ctx, job, reason).await?;
    Ok(Disposition::Ack)
}

/// Give a job to the session it names, or refuse it with the session's reason.
async fn route_to_session(ctx: &WorkerContext, work: Work) {
    let Err(work) = ctx.registry.deliver(work) else { return };
    let Work { job, ticket, .. } = *work;
    let disposition = ledger::disposition_of(&job, refuse_unheld(ctx, &job).await).await;
    ticket.settle(disposition).await;
}

/// Refuse a job of a session this worker does not hold, with the session's own reason.
async fn refuse_unheld(ctx: &WorkerContext, job: &ExecutionJob) -> Result<Disposition> {
    let id = job.session.as_ref().map(|s| s.id.as_str()).unwrap_or_default();
    let reason = match ctx.sessions.state(&job.tenant, id).await? {
        None => Reason::new(ErrorCode::SessionNotFound, format!("tenant {} has no session {id}", job.tenant)),
        Some(state) => {
            state.refusal(id).unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, format!("session {id} is not held by worker {}", ctx.cfg.worker_id)))
        }
    };
    run::refuse(ctx, job, &reason).await?;
    Ok(Disposition::Ack)
}
