//! Consuming execution jobs from two queues and sending each where it runs.
//!
//! - `sandcell.jobs` (shared by all workers, prefetch = slots): one-off jobs, run here in a
//!   sandbox that serves only their tenant;
//! - `sandcell.sessions.new` (shared): jobs that open a session, which this worker then holds
//!   ([`crate::session::open`]). It is consumed only while this worker has room for another
//!   session ([`NewSessions`]), with its room as the consumer's priority (the broker offers a
//!   job to the highest-priority consumer that can take it) and its prefetch: the worker with
//!   the most room is offered a new session first, and a full worker is offered none. Should
//!   one arrive when the room is gone after all (the room is re-read every
//!   [`ROOM_CHECK`]), it is returned to the queue a few times, for a worker with room; the
//!   last time it waits for room here (`SANDCELL_SESSION_START_WAIT_S`) and then refuses the
//!   job with `capacity`.
//! - `sandcell.worker.<id>` (this worker's own): jobs of sessions it holds, handed to the
//!   session's task in delivery order; a job for a session it does not hold is refused with
//!   the session's reason, unless the session moved to another worker (the job follows it).
//!   A session holds at most its window of this queue's unacked messages
//!   ([`crate::registry::WindowPlace`]); its jobs past it are acked as they arrive and held as
//!   read back from Postgres, so that one session's backlog never holds the others' jobs.
//!   A job that takes a moving session over arrives like an opening job, on `sandcell.sessions.new`.
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
//!   earlier life or from a worker whose heartbeat stopped (or a claim tried again in place,
//!   whose first try's answer was lost: from this worker alone);
//! - a job's database steps (claim, refusal, commit) are tried again in place, for as long as an
//!   outage of the database lasts and ~2 minutes for other failures, before its handler fails:
//!   a database restart or outage sends no job back through the broker;
//! - a job claimed more than `SANDCELL_MAX_ATTEMPTS` times is failed with `too_many_attempts`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use sandcell_core::broker;
use sandcell_protocol::{ErrorCode, ExecutionJob, JobStatus, Reason, SessionState};
use tokio::sync::OwnedSemaphorePermit;

use crate::context::WorkerContext;
use crate::ledger::{self, Disposition, Ticket};
use crate::registry::{WindowPlace, Work};
use crate::run::{self, OneOff};

/// How long a worker at its session capacity holds an opening job before returning it.
const FULL_REQUEUE_DELAY: Duration = Duration::from_secs(1);
/// How often the consumer of new sessions compares its priority and prefetch with the room.
const ROOM_CHECK: Duration = Duration::from_millis(100);

/// The consumer of `sandcell.sessions.new`, kept in step with this worker's room for sessions:
/// none while full; otherwise one whose priority is the room and whose prefetch is what is left
/// of the opening jobs this worker takes at once (its slots, [`NewSessions::in_flight`]). A
/// change replaces the consumer; the replaced one's deliveries still in flight are read to its
/// end (its messages stay on the channel, so their acks still work). A replaced consumer's
/// unacknowledged messages do not count against its successor's prefetch, hence the count of its
/// own: without it, each re-subscription would take another window of opening jobs, and the
/// first jobs of a burst of new sessions would queue for slots behind every container start
/// (measured: a burst of 50 on one worker, first results all at ~35 s).
struct NewSessions {
    ch: lapin::Channel,
    name: String,
    /// Opening jobs delivered here and not yet settled take one place each (a place is held by
    /// the job's ticket).
    in_flight: Arc<tokio::sync::Semaphore>,
    /// The current consumer's tag and (priority, prefetch).
    current: Option<(String, (usize, u16))>,
    serial: u64,
    /// Current and replaced consumers, until each ends.
    streams: futures::stream::SelectAll<lapin::Consumer>,
}

impl NewSessions {
    async fn new(conn: &lapin::Connection, name: &str, slots: u16) -> Result<Self> {
        let ch = conn.create_channel().await.context("opening the new sessions channel")?;
        let in_flight = Arc::new(tokio::sync::Semaphore::new(usize::from(slots)));
        Ok(NewSessions { ch, name: name.to_string(), in_flight, current: None, serial: 0, streams: futures::stream::SelectAll::new() })
    }

    /// Match the consumer to `room` and the places left for opening jobs (none of either: no consumer).
    async fn follow(&mut self, room: usize) -> Result<()> {
        let window = u16::try_from(room.min(self.in_flight.available_permits())).unwrap_or(u16::MAX);
        let want = (room, window);
        if self.current.as_ref().map_or((0, 0), |(_, w)| *w) == want || (window == 0 && self.current.is_none()) {
            return Ok(());
        }
        self.stop().await;
        if window == 0 {
            return Ok(());
        }
        self.serial += 1;
        let tag = format!("{}-new-sessions-{}", self.name, self.serial);
        self.ch.basic_qos(window, BasicQosOptions::default()).await.context("setting the new sessions prefetch")?;
        let mut args = FieldTable::default();
        args.insert("x-priority".into(), AMQPValue::LongInt(i32::try_from(room).unwrap_or(i32::MAX)));
        let consumer = self
            .ch
            .basic_consume(broker::NEW_SESSIONS_QUEUE.into(), tag.as_str().into(), BasicConsumeOptions::default(), args)
            .await
            .context("consuming new sessions")?;
        self.streams.push(consumer);
        self.current = Some((tag, want));
        Ok(())
    }

    /// Count an opening job delivered here among those in flight until its ticket is settled.
    fn take_place(&self, ticket: &mut Ticket) {
        if let Ok(place) = self.in_flight.clone().try_acquire_owned() {
            ticket.hold(place);
        }
    }

    /// Cancel the current consumer (what it was sent still arrives on its stream).
    async fn stop(&mut self) {
        if let Some((tag, _)) = self.current.take() {
            if let Err(e) = self.ch.basic_cancel(tag.as_str().into(), Default::default()).await {
                tracing::warn!(error = %e, consumer = tag, "cancelling the new sessions consumer failed");
            }
        }
    }

    /// The next opening job delivered to this worker (pending forever while no consumer runs).
    async fn next(&mut self) -> Option<lapin::Result<Delivery>> {
        if self.streams.is_empty() {
            std::future::pending::<()>().await;
        }
        self.streams.next().await
    }
}

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
    let mut draining = ctx.draining.clone();
    let already = *draining.borrow();
    if already {
        // Reconnected while draining: take nothing new; the jobs held finish on their own.
        return hold_while_draining(conn).await;
    }
    let shared_ch = conn.create_channel().await.context("opening channel")?;
    broker::declare_topology(&shared_ch).await?;
    let own_ch = conn.create_channel().await.context("opening channel")?;
    let own_queue = broker::declare_worker_queue(&own_ch, &ctx.cfg.worker_id).await?;
    // Live output goes out on a channel of this connection (declared with the topology): before
    // the jobs read back below start, so that theirs is not dropped.
    ctx.events.attach(conn.create_channel().await.context("opening the events channel")?);
    // Before any consumer of this connection: the session jobs routed here, from Postgres.
    let republish = broker::publisher_channel(&conn).await?;
    recover_routed_jobs(ctx, &republish, &own_queue).await?;
    shared_ch.basic_qos(ctx.cfg.slots, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut shared = shared_ch
        .basic_consume(broker::JOBS_QUEUE.into(), name.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .context("consuming jobs")?;
    own_ch.basic_qos(ctx.cfg.session_prefetch, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut own = own_ch
        .basic_consume(own_queue.as_str().into(), format!("{name}-sessions").as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .with_context(|| format!("consuming {own_queue}"))?;
    let mut new_sessions = NewSessions::new(&conn, &name, ctx.cfg.slots).await?;
    new_sessions.follow(ctx.session_capacity.available_permits()).await?;
    let mut room_check = tokio::time::interval(ROOM_CHECK);
    room_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    broker_up.store(true, Ordering::Relaxed);
    tracing::info!(worker_id = %ctx.cfg.worker_id, slots = ctx.cfg.slots, own_queue, "worker consuming");
    loop {
        tokio::select! {
            () = until_draining(&mut draining) => {
                // Told to stop: no more deliveries. The connection stays open, so the jobs
                // running here can still ack their messages once their results are committed.
                for (ch, tag) in [(&shared_ch, name.clone()), (&own_ch, format!("{name}-sessions"))] {
                    if let Err(e) = ch.basic_cancel(tag.as_str().into(), Default::default()).await {
                        tracing::warn!(error = %e, consumer = tag, "cancelling a consumer failed");
                    }
                }
                new_sessions.stop().await;
                tracing::info!(held = ctx.ledger.len(), "draining: no more jobs are taken");
                return hold_while_draining(conn).await;
            }
            _ = room_check.tick() => new_sessions.follow(ctx.session_capacity.available_permits()).await?,
            next = new_sessions.next() => {
                let Some(delivery) = next else { continue };
                let delivery = delivery.context("receiving an opening job")?;
                if let Some((job, mut ticket)) = admit(ctx, delivery).await {
                    new_sessions.take_place(&mut ticket);
                    // The session's place is taken now, not in the task: the room the consumer
                    // follows (below) drops at once, so a worker that became full stops
                    // consuming before this job's ack frees a place in its prefetch window.
                    let place = ctx.session_capacity.clone().try_acquire_owned().ok();
                    tokio::spawn(handle_shared(ctx.clone(), job, ticket, place));
                }
                // Fewer places left: a smaller window, at once.
                new_sessions.follow(ctx.session_capacity.available_permits()).await?;
            }
            next = shared.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a job")?;
                if let Some((job, ticket)) = admit(ctx, delivery).await {
                    // A task of its own: a reconnect of this consumer never cancels it.
                    tokio::spawn(handle_shared(ctx.clone(), job, ticket, None));
                }
            }
            next = own.next() => {
                let Some(delivery) = next else { break };
                let delivery = delivery.context("receiving a session job")?;
                if is_cancel(&delivery) {
                    cancel(ctx, delivery).await;
                    continue;
                }
                if let Some((job, ticket)) = admit(ctx, delivery).await {
                    let work = within_window(ctx, Work::new(job, ticket, None), &republish, &own_queue).await;
                    // Handed to the session synchronously, so delivery order is mailbox order.
                    route_to_session(ctx, work).await;
                }
            }
        }
    }
    Ok(())
}

/// Give a job of this worker's queue its place in its session's window of unacked messages
/// (`registry::WindowPlace`), held by its ticket; past the window, its message is acked now
/// and the job waits as read back from Postgres (`republish`, `queue`: as for the jobs read
/// back on a connection), its inputs within the mailboxes' budget like any waiting job's.
async fn within_window(ctx: &WorkerContext, mut work: Work, republish: &lapin::Channel, queue: &str) -> Work {
    match ctx.registry.window_place(&work.job) {
        WindowPlace::Taken(place) => work.ticket.hold(place),
        WindowPlace::Full => {
            if work.ticket.release(crate::ledger::Recovered::new(republish, queue, &ctx.jobs)).await {
                ctx.metrics.acked_on_arrival.inc();
            }
        }
        WindowPlace::NotHeld => {}
    }
    work
}

/// Hand this worker's sessions the jobs routed to it that have not run, read from Postgres, before
/// anything this connection delivers. Their messages are transient
/// (`broker::session_dispatch_properties`): a broker restart drops those still in the queue, and
/// Postgres holds each such job as it was routed. A job this worker already holds (its delivery
/// from before the reconnect waits in a mailbox or runs) is held from now on as read back: that
/// delivery's channel is gone, and its message may be too. A copy the queue still delivers is
/// absorbed by the ledger, or refused by the claim once the job ran. Jobs recorded from now on
/// arrive through the queue, after these: a session's order holds. `republish`: a channel in
/// confirm mode, on which a job read back whose handler fails is published again.
async fn recover_routed_jobs(ctx: &WorkerContext, republish: &lapin::Channel, queue: &str) -> Result<()> {
    let routed = sandcell_core::retry_classified("reading back the jobs routed to this worker", 6, sandcell_core::jobs::failure, |_| {
        ctx.jobs.routed_to_worker(&ctx.cfg.worker_id)
    })
    .await?;
    let mut recovered = 0u64;
    let source = || crate::ledger::Recovered::new(republish, queue, &ctx.jobs);
    for (tenant, job_id) in routed {
        if ctx.ledger.hold_as_recovered(&tenant, &job_id, source()) {
            continue; // held here already, with its inputs (or its place in the budget)
        }
        // One job's execution job in memory at a time: its mailbox keeps its inputs only within
        // the worker's budget (`registry::Inputs`), like those its queue delivers. A job that
        // cannot be read is left in Postgres, for the next connection or the stuck sweep.
        let read = sandcell_core::retry_classified("reading back a job routed to this worker", 6, sandcell_core::jobs::failure, |_| {
            ctx.jobs.routed_job(&tenant, &job_id)
        });
        let payload = match read.await {
            Ok(Some(payload)) => payload,
            Ok(None) => continue, // no longer queued (cancelled, ended)
            Err(e) => {
                tracing::error!(%tenant, %job_id, error = format!("{e:#}"), "a job routed to this worker could not be read back; left for the next connection");
                continue;
            }
        };
        let job = match serde_json::from_slice::<ExecutionJob>(&payload) {
            Ok(job) if job.tenant == tenant && job.job_id == job_id => job,
            Ok(_) => {
                tracing::error!(%tenant, %job_id, "a job routed to this worker holds another job's execution job; not run");
                continue;
            }
            Err(e) => {
                // Written by a scheduler that spoke another protocol: its message, if still
                // queued, is dead-lettered as undecodable; otherwise the sweeper ends it stuck.
                tracing::error!(%tenant, %job_id, error = %e, "a job routed to this worker cannot be decoded; not run");
                continue;
            }
        };
        drop(payload);
        if let Some(ticket) = ctx.ledger.enter_recovered(&job, source()) {
            route_to_session(ctx, Work::new(job, ticket, None)).await;
            recovered += 1;
        }
    }
    if recovered > 0 {
        ctx.metrics.jobs_recovered.inc_by(recovered);
        tracing::info!(recovered, "session jobs routed here read back from Postgres and handed to their sessions");
    }
    Ok(())
}

/// Resolves once the worker is draining.
async fn until_draining(draining: &mut tokio::sync::watch::Receiver<bool>) {
    if draining.wait_for(|d| *d).await.is_err() {
        std::future::pending::<()>().await; // the worker is going away anyway
    }
}

/// Keep the broker connection (and the channels of the deliveries held) open until the
/// process stops.
async fn hold_while_draining(conn: lapin::Connection) -> Result<()> {
    std::future::pending::<()>().await;
    drop(conn);
    Ok(())
}

fn is_cancel(delivery: &Delivery) -> bool {
    delivery.properties.kind().as_ref().map(|k| k.as_str()) == Some(sandcell_protocol::cancel::CANCEL_MESSAGE_TYPE)
}

/// A cancel forwarded by the scheduler: handed to the session, if this worker holds it (its job
/// is interrupted if running, or as it starts if next); settled at once either way.
async fn cancel(ctx: &WorkerContext, delivery: Delivery) {
    match serde_json::from_slice::<sandcell_protocol::cancel::CancelJob>(&delivery.data) {
        Ok(c) => {
            let held = ctx.registry.cancel(&c.tenant, &c.session_id, &c.job_id);
            tracing::info!(tenant = %c.tenant, job_id = %c.job_id, session_id = %c.session_id, held, "cancel received");
            ledger::settle_control(&delivery, true, &ctx.metrics).await;
        }
        Err(e) => {
            tracing::error!(error = %e, "undecodable cancel; dead-lettering");
            ledger::settle_control(&delivery, false, &ctx.metrics).await;
        }
    }
}

/// Decode a delivery and enter it in the ledger. `None` when there is nothing to run: the
/// message was not a job (dead-lettered) or is a copy of a job in flight here (absorbed).
async fn admit(ctx: &WorkerContext, mut delivery: Delivery) -> Option<(ExecutionJob, Ticket)> {
    match serde_json::from_slice::<ExecutionJob>(&delivery.data) {
        Ok(job) => {
            // Decoded, the body is not needed to settle the message: the ledger keeps the
            // delivery without it (a job's inputs are not held twice).
            delivery.data = Vec::new();
            ctx.ledger.enter(&job, delivery).await.map(|ticket| (job, ticket))
        }
        Err(e) => {
            tracing::error!(error = %e, bytes = delivery.data.len(), "undecodable execution job; dead-lettering");
            ledger::settle_undecodable(&delivery, &ctx.metrics).await;
            None
        }
    }
}

/// Run a job of a shared queue; `place`: the session place already taken for an opening job.
async fn handle_shared(ctx: WorkerContext, job: ExecutionJob, ticket: Ticket, place: Option<OwnedSemaphorePermit>) {
    match &job.session {
        None => {
            let result = run::job(&ctx, &job, ticket.arrival, None, &mut OneOff::new(ctx.bound.reuses())).await;
            let disposition = ledger::disposition_of(&job, result).await;
            ticket.settle(disposition).await;
        }
        // Opening a session, or taking over one whose worker died or drained.
        Some(s) if s.new || s.adopt.is_some() => open_session(ctx, job, ticket, place).await,
        // Jobs of existing sessions travel on workers' own queues; accept one here all the same.
        Some(_) => route_to_session(&ctx, Work::new(job, ticket, None)).await,
    }
}

/// Open the session a job asks for, when this worker has room for it (`place`: taken already).
async fn open_session(ctx: WorkerContext, job: ExecutionJob, ticket: Ticket, place: Option<OwnedSemaphorePermit>) {
    let permit = match place.map_or_else(|| ctx.session_capacity.clone().try_acquire_owned(), Ok) {
        Ok(p) => p,
        // Returned a few times so that a worker with room can take it; then waited for here.
        Err(_) if ticket.returns + 1 < broker::DELIVERY_LIMIT => {
            tracing::info!(job_id = %job.job_id, held = ctx.registry.len(), returns = ticket.returns, "at session capacity; returning an opening job to the queue");
            ctx.metrics.opening_returned.inc();
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
    match run::claim(&ctx, &job, ticket.arrival).await {
        Ok(Some(claim)) => crate::session::open(ctx, Work::new(job, ticket, Some(claim)), permit).await,
        Ok(None) => ticket.settle(Disposition::Ack).await,
        Err(e) => {
            let disposition = ledger::disposition_of(&job, Err(e)).await;
            ticket.settle(disposition).await;
        }
    }
}

/// Refuse a job that opens a session (and fail the session it would have opened) or takes one
/// over (and end that session `lost`).
async fn refuse_opening(ctx: &WorkerContext, job: &ExecutionJob, reason: &Reason) -> Result<Disposition> {
    // Only a job still queued, and its session only then: a copy of a job another worker has
    // claimed (and is starting or restoring the session for) changes nothing. Both ends are
    // guarded again (`failed` is entered only from `starting`; `end_adoption` only while this
    // job is the session's taking-over job).
    // `rejected` is reached only from `queued` (JobStatus::can_become).
    if !ctx.jobs.fail(&job.tenant, &job.job_id, JobStatus::Rejected, reason).await? {
        return Ok(Disposition::Ack);
    }
    ctx.events.job(job, 0).end(JobStatus::Rejected);
    ctx.metrics.jobs.with_label_values(&[JobStatus::Rejected.as_str()]).inc();
    if let Some(s) = &job.session {
        if s.adopt.is_some() {
            ctx.sessions.end_adoption(&s.id, &job.job_id, reason).await?;
        } else {
            ctx.sessions.end(&s.id, None, SessionState::Failed, Some(reason)).await?;
        }
    }
    Ok(Disposition::Ack)
}

/// Give a job to the session it names, or refuse it with the session's reason.
async fn route_to_session(ctx: &WorkerContext, work: Work) {
    let Err(work) = ctx.registry.deliver(work) else { return };
    // Refused in a task of its own: its database steps wait out an outage of the database, and
    // the consumer calling this must go on meanwhile (a refused job keeps no order).
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let Work { job, ticket, .. } = *work;
        let disposition = ledger::disposition_of(&job, refuse_unheld(&ctx, &job).await).await;
        ticket.settle(disposition).await;
    });
}

/// Refuse a job of a session this worker does not hold, with the session's own reason — unless
/// the session moved: then this is a copy left in this worker's queue (the job was parked and
/// follows the session), and it is dropped without touching the job.
async fn refuse_unheld(ctx: &WorkerContext, job: &ExecutionJob) -> Result<Disposition> {
    let id = job.session.as_ref().map(|s| s.id.as_str()).unwrap_or_default();
    let reason = match ctx.sessions.holder(&job.tenant, id).await? {
        None => Reason::new(ErrorCode::SessionNotFound, format!("tenant {} has no session {id}", job.tenant)),
        Some((SessionState::Moving, _)) => {
            // Recorded for this worker in the instant its session moved (a stray): parked, it
            // follows the session like the others; a copy of a job already parked is dropped.
            let parked = ctx.jobs.park_stray(&job.tenant, &job.job_id, &ctx.cfg.worker_id).await?;
            tracing::info!(job_id = %job.job_id, session_id = id, parked, "a job of a session that moved away; left to follow it");
            return Ok(Disposition::Ack);
        }
        Some((SessionState::Active, Some(w))) if w != ctx.cfg.worker_id => {
            let parked = ctx.jobs.park_stray(&job.tenant, &job.job_id, &ctx.cfg.worker_id).await?;
            tracing::info!(job_id = %job.job_id, session_id = id, holder = %w, parked, "a job of a session now held by another worker; left to it");
            return Ok(Disposition::Ack);
        }
        Some((state, _)) => {
            state.refusal(id).unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, format!("session {id} is not held by worker {}", ctx.cfg.worker_id)))
        }
    };
    run::refuse(ctx, job, &reason).await?;
    Ok(Disposition::Ack)
}
