//! Intake: `sandcell.submissions.<p>` (this scheduler's share of the partitions, [`partitions`]) → identity → validation → quotas → Postgres → `sandcell.jobs`.
//!
//! Invariants:
//! - the tenant of a job is the broker user that published it (RabbitMQ checks the `user_id`
//!   property against the connection's user), unless that user is operator-trusted
//!   (`SANDCELL_TRUSTED_PUBLISHERS`); a body naming another tenant is `rejected` with
//!   `tenant_mismatch` under the publisher's tenant, and a message without `user_id` is
//!   recorded in `intake_rejections` (`unauthenticated`) and dead-lettered;
//! - a job over one of its tenant's quotas is `rejected` with `quota_exceeded`;
//! - a submission is acked only after its outcome is durable: the job row exists and the
//!   execution job is confirmed by the broker, or the rejection is recorded;
//! - nothing is dropped silently: a message whose `(tenant, job_id)` can be recovered gets a
//!   `rejected` job row the client can poll; any other bad message is recorded in
//!   `intake_rejections` and dead-lettered;
//! - a job id is run once per tenant: a duplicate is acked without dispatch, except when the
//!   job is still queued and this delivery is a retry or a redelivery (the scheduler failed
//!   between its record and its ack, perhaps before its publish), in which case it is
//!   dispatched now. A job dispatched twice runs once: a fresh delivery never takes over a job
//!   that is already running or ended (the worker's claim);
//! - jobs of one session are handled one after the other in the order their submissions
//!   arrived (a lane per session), and published to the queue of the worker holding the
//!   session, which runs them in that order; other submissions are handled concurrently;
//! - a job that opens a session goes to the shared `sandcell.jobs` queue (any worker with room);
//!   a job naming a session that is not active is `rejected` with the session's reason.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use sandcell_core::broker;
use sandcell_core::jobs::{IntakeRejection, JobSessionRecord, JobStore, Recorded};
use sandcell_protocol::session::new_session_id;
use sandcell_protocol::{parse_submission, ErrorCode, ExecutionJob, JobSession, JobStatus, Reason, Rejection, Submission};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::quota_memory::{self, QuotaMemory};
use crate::refusals::{IntakeRejections, Refusals};
use crate::tenant_gates::{self, Gate, TenantGates};
use crate::uploads::{Grants, Prepared, UploadRefusals};
use crate::{partitions, Config};
use sandcell_core::store::ArtifactStore;
use sandcell_core::uploads::Granted;
use sandcell_protocol::upload::UploadGrant;

use sandcell_core::broker::Disposition;

/// Consume submissions until `shutdown`, reconnecting after broker or database failures.
pub async fn run(cfg: Config, jobs: JobStore, store: ArtifactStore, metrics: Metrics, broker_up: Arc<AtomicBool>, shutdown: CancellationToken) {
    let gates = TenantGates::new(cfg.tenant_concurrency);
    let refused = QuotaMemory::new(cfg.quota_memory);
    let refusals = Refusals::start(jobs.clone(), metrics.refusal_batch_size.clone());
    let grants = Grants::start(jobs.pool().clone(), cfg.tenant_defaults, metrics.upload_grant_batch_size.clone());
    let upload_refusals = UploadRefusals::start(jobs.pool().clone(), metrics.upload_refusal_batch_size.clone());
    let unattributable = IntakeRejections::start(jobs.clone(), metrics.unattributable_batch_size.clone());
    let shared =
        Shared { cfg, jobs, store, metrics, lanes: Arc::new(Mutex::new(Lanes::default())), gates, refused, refusals, grants, upload_refusals, unattributable };
    loop {
        let result = consume(&shared, &broker_up, &shutdown).await;
        broker_up.store(false, Ordering::Relaxed);
        shared.metrics.partitions_held.set(0);
        if shutdown.is_cancelled() {
            tracing::info!("intake stopped");
            return;
        }
        match result {
            Ok(()) => tracing::warn!("submission consumer ended; reconnecting"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "submission consumer failed; reconnecting"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What every partition's consumer and every handler share.
#[derive(Clone)]
struct Shared {
    cfg: Config,
    jobs: JobStore,
    store: ArtifactStore,
    metrics: Metrics,
    /// One session's submissions wait for each other, whichever partition brought them.
    lanes: Arc<Mutex<Lanes>>,
    /// One tenant's handlers hold at most `SANDCELL_INTAKE_TENANT_CONCURRENCY` of the database
    /// connections, whichever partitions brought them.
    gates: TenantGates,
    /// Tenants found at a quota in the last `SANDCELL_INTAKE_QUOTA_MEMORY_MS`: their flood is
    /// refused without taking their lock for each submission ([`crate::quota_memory`]).
    refused: QuotaMemory,
    /// Writes the refusals made without a judgment under a tenant's lock (from that memory, or
    /// of invalid submissions whose job id is known), many to a transaction.
    refusals: Refusals,
    /// Records upload grants, many to a transaction ([`crate::uploads::Grants`]).
    grants: Grants,
    /// Records upload refusals, many to a transaction ([`crate::uploads::UploadRefusals`]).
    upload_refusals: UploadRefusals,
    /// Records the messages that name no job, many to a transaction
    /// ([`crate::refusals::IntakeRejections`]).
    unattributable: IntakeRejections,
}

/// A partition being consumed: how to stop it, and its task (which ends once the partition's
/// channel is closed).
struct Running {
    stop: CancellationToken,
    task: JoinHandle<Result<()>>,
}

/// One broker connection's life: take this scheduler's share of the partitions and consume them,
/// looking at the fleet every `SANDCELL_INTAKE_REBALANCE_MS`, until shutdown or a failure; then
/// stop every partition (finishing what was taken) before the locks go.
async fn consume(shared: &Shared, broker_up: &AtomicBool, shutdown: &CancellationToken) -> Result<()> {
    let url = shared.cfg.services.amqp_url.clone();
    let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&url, "sandcell-scheduler")).await;
    let result = consume_on(shared, &conn, broker_up, shutdown).await;
    let _ = conn.close(200, "scheduler intake stopping".into()).await;
    result
}

/// [`consume`] on an open connection.
async fn consume_on(shared: &Shared, conn: &Connection, broker_up: &AtomicBool, shutdown: &CancellationToken) -> Result<()> {
    let cfg = &shared.cfg;
    let topology_ch = conn.create_channel().await.context("opening a channel to declare the topology")?;
    broker::declare_topology(&topology_ch).await?;
    let legacy_left = broker::declare_intake_partitions(conn, cfg.intake_partitions).await?;
    let publisher = broker::publisher_channel(conn).await?;
    let mut ownership = partitions::Ownership::connect(&cfg.services.database_url, cfg.intake_partitions).await?;
    broker_up.store(true, Ordering::Relaxed);

    let mut running: BTreeMap<u16, Running> = BTreeMap::new();
    let mut tick = tokio::time::interval(cfg.rebalance_interval);
    let result = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = tick.tick() => {}
        }
        if let Some((p, _)) = running.iter().find(|(_, r)| r.task.is_finished()) {
            break Err(anyhow::anyhow!("the consumer of intake partition {p} ended"));
        }
        if !conn.status().connected() {
            break Err(anyhow::anyhow!("the broker connection closed"));
        }
        let change = match ownership.rebalance().await {
            Ok(change) => change,
            Err(e) => break Err(e),
        };
        let mut released = Ok(());
        for p in change.give_up {
            if let Some(r) = running.remove(&p) {
                stop_partition(p, r).await;
            }
            released = ownership.release(p).await;
            if released.is_err() {
                break;
            }
            tracing::info!(partition = p, "intake partition given up to another scheduler");
        }
        if let Err(e) = released {
            break Err(e);
        }
        let mut opened = Ok(());
        for p in change.take {
            let ch = match conn.create_channel().await {
                Ok(ch) => ch,
                Err(e) => {
                    opened = Err(anyhow::Error::new(e).context(format!("opening the channel of intake partition {p}")));
                    break;
                }
            };
            let stop = CancellationToken::new();
            let drain_legacy = legacy_left && p == 0;
            let task = tokio::spawn(consume_partition(shared.clone(), ch, publisher.clone(), p, drain_legacy, stop.clone()));
            running.insert(p, Running { stop, task });
        }
        if let Err(e) = opened {
            break Err(e);
        }
        shared.metrics.partitions_held.set(i64::try_from(running.len()).unwrap_or(i64::MAX));
    };
    // Finish what every partition took, close their channels, then let the locks go.
    for (p, r) in std::mem::take(&mut running) {
        stop_partition(p, r).await;
    }
    ownership.close().await;
    result
}

/// Stop a partition's consumer and wait until its channel is closed.
async fn stop_partition(p: u16, r: Running) {
    r.stop.cancel();
    match r.task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(partition = p, error = format!("{e:#}"), "intake partition ended with an error"),
        Err(e) => tracing::error!(partition = p, error = %e, "intake partition task panicked"),
    }
}

/// Consume intake partition `p` until `stop`: each delivery is judged and handled in a task of its
/// own (a failing submission never takes the consumer down). On `stop` it takes no more, waits for
/// the handlers it started, and closes its channel: what the broker had sent but no handler
/// started goes back to the head of the queue, in order, for the partition's next owner.
async fn consume_partition(shared: Shared, ch: Channel, publisher: Channel, p: u16, drain_legacy: bool, stop: CancellationToken) -> Result<()> {
    ch.basic_qos(shared.cfg.prefetch, BasicQosOptions::default()).await.context("setting prefetch")?;
    let queue = broker::submissions_queue(p);
    let tag = format!("sandcell-scheduler-{p}");
    let consumer = ch
        .basic_consume(queue.as_str().into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .with_context(|| format!("consuming {queue}"))?;
    let mut deliveries = if drain_legacy {
        let legacy = ch
            .basic_consume(broker::LEGACY_SUBMISSIONS_QUEUE.into(), "sandcell-scheduler-legacy".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .context("consuming the legacy submissions queue")?;
        futures::stream::select(consumer, legacy).boxed()
    } else {
        consumer.boxed()
    };
    tracing::info!(%queue, prefetch = shared.cfg.prefetch, drain_legacy, "intake partition consuming");

    // Every handler holds a clone of `in_flight`; when all are dropped, `settled` ends.
    let (in_flight, mut settled) = mpsc::channel::<()>(1);
    let result = loop {
        let delivery = tokio::select! {
            biased;
            _ = stop.cancelled() => break Ok(()),
            d = deliveries.next() => d,
        };
        let Some(delivery) = delivery else { break Err(anyhow::anyhow!("the broker cancelled the consumer of {queue}")) };
        let delivery = match delivery {
            Ok(d) => d,
            Err(e) => break Err(anyhow::Error::new(e).context(format!("receiving a submission from {queue}"))),
        };
        take(&shared, &publisher, delivery, in_flight.clone()).await;
    };
    drop(in_flight);
    let _ = settled.recv().await;
    drop(deliveries);
    if let Err(e) = ch.close(200, "intake partition handed over".into()).await {
        tracing::debug!(partition = p, error = %e, "closing the partition's channel failed (it was closed already)");
    }
    result
}

/// Start handling one delivery: strays are dropped, upload requests answered, submissions judged
/// and entered in their session's lane, each handled in a task of its own holding `in_flight`.
async fn take(shared: &Shared, publisher: &Channel, delivery: Delivery, in_flight: mpsc::Sender<()>) {
    let metrics = &shared.metrics;
    if !published_to_intake(&delivery) {
        // A tenant may bind sandcell.intake as the destination of an exchange it can read
        // (sandcell.events) or name it as a queue's dead-letter exchange: RabbitMQ cannot
        // tell that write permission from a publish. Such copies are nobody's submission.
        metrics.submissions.with_label_values(&["not_published_to_intake"]).inc();
        tracing::warn!(exchange = %delivery.exchange, routing_key = %delivery.routing_key, "dropping a message that reached the intake by a binding, not by a publish to it");
        settle(&delivery, Disposition::Ack, metrics, "a stray intake message").await;
        return;
    }
    let (s, publisher) = (shared.clone(), publisher.clone());
    let from = Publisher::of(&delivery, &shared.cfg.trusted_publishers);
    // Whom the message is for, by the intake's identity rules (a trusted publisher is believed):
    // its gate, and the tenant part of its lane. A tenant naming another's session is kept out
    // of that session's lane: it would hold the other's submissions up behind its own gate.
    let named = || matches!(from, Publisher::Trusted(_)).then(|| tenant_gates::named_tenant(&delivery.data)).flatten();
    if crate::uploads::is_upload_request(delivery.properties.kind().as_ref().map(|k| k.as_str())) {
        // No place at the gate for a grant: the grant writer holds one connection whatever the
        // flood, the refusal writer one more. Its handler takes a place only to write on its own
        // (a busy tenant, a failed batch).
        let gate = shared.gates.gate(from.attributed(named().as_deref()));
        spawn_in_lane(None, None, shared, in_flight, async move { handle_upload(&s, gate, delivery).await });
        return;
    }
    if crate::cancels::is_cancel_request(delivery.properties.kind().as_ref().map(|k| k.as_str())) {
        // In its session's lane (its routing key is the session id): judged after the
        // submissions of that session published before it, so it finds their jobs recorded.
        let named = named();
        let tenant = from.attributed(named.as_deref());
        let key = (!delivery.routing_key.as_str().is_empty()).then(|| format!("{tenant}/{}", delivery.routing_key));
        let gate = shared.gates.gate(tenant);
        spawn_in_lane(key, Some(gate), shared, in_flight, async move { handle_cancel(&s.cfg, &s.jobs, &s.metrics, &publisher, delivery).await });
        return;
    }
    // Judged once, here: the lane, the gate and the handler read the same verdict.
    let verdict = parse_submission(&delivery.data, &shared.cfg.intake);
    let tenant = from.attributed(verdict.as_ref().ok().map(|sub| sub.tenant.as_str()));
    let key = session_key(tenant, &verdict);
    let gate = shared.gates.gate(tenant);
    // Refused without a judgment under the tenant's lock, and so without a place at its gate:
    // not a redelivery (its job may be recorded and still to be dispatched). A refusal takes no
    // turn in its session's lane either: a flood into one session is refused in batches, not
    // one write after another (its refusal then stands, [`handle_delivery`]).
    let mut unjudged = (!delivery.redelivered).then(|| unjudged_refusal(&shared.refused, &verdict, &from)).flatten();
    if let Some(u) = unjudged.as_mut() {
        u.stands = u.from_memory && key.is_some();
    }
    let key = if unjudged.is_some() { None } else { key };
    spawn_in_lane(key, None, shared, in_flight, async move { handle_delivery(&s, &publisher, delivery, verdict, gate, unjudged).await });
}

/// Handle a delivery in a task of its own holding `in_flight`: after the deliveries entered
/// before it in its lane `key` (none: at once), once its tenant's `gate` lets it in (a
/// submission's handler takes its place itself, [`handle_delivery`]). The lane comes first: a
/// handler holding a place never waits for another handler.
fn spawn_in_lane(
    key: Option<String>,
    gate: Option<Gate>,
    shared: &Shared,
    in_flight: mpsc::Sender<()>,
    work: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (before, done) = match shared.lanes.lock() {
        Ok(mut lanes) => lanes.enter(key),
        Err(poisoned) => poisoned.into_inner().enter(key),
    };
    tokio::spawn(async move {
        if let Some(before) = before {
            // Err only means the previous handler's task ended without signalling.
            let _ = before.await;
        }
        let place = match gate {
            Some(gate) => Some(gate.enter().await),
            None => None,
        };
        work.await;
        drop(place);
        if let Some(done) = done {
            let _ = done.send(());
        }
        drop(in_flight);
    });
}

/// Answer an upload request ([`crate::uploads`]) and settle its delivery: acked once answered
/// (or unattributable), returned to the queue when the database or the store failed. A grant
/// goes to the grant writer, a refusal (the grant writer's, or of an invalid request) to the
/// upload refusal writer; a grant whose tenant's row was held, or what a failed batch held, is
/// written on its own with a place at its tenant's `gate`.
async fn handle_upload(shared: &Shared, gate: Gate, delivery: Delivery) {
    let (cfg, pool) = (&shared.cfg, shared.jobs.pool());
    let publisher = Publisher::of(&delivery, &cfg.trusted_publishers);
    let trusted = matches!(publisher, Publisher::Trusted(_));
    let answered = async {
        let ask = match crate::uploads::prepare(&shared.store, &delivery.data, publisher.name(), trusted, cfg.upload_terms()).await? {
            Prepared::Unattributable => return Ok(None),
            Prepared::Refused(refused) => return record_upload_refusal(shared, gate, refused).await.map(Some),
            Prepared::Grant(ask) => ask,
        };
        match shared.grants.grant(ask.clone()).await {
            Ok(Granted::Answered(recorded)) => return Ok(Some(recorded.grant)),
            Ok(Granted::Refused(refused)) => return record_upload_refusal(shared, gate, refused).await.map(Some),
            Ok(Granted::Busy) => tracing::debug!(upload_id = ask.grant.upload_id, "an upload grant's tenant was busy; it is recorded on its own"),
            Err(e) => tracing::warn!(upload_id = ask.grant.upload_id, error = format!("{e:#}"), "an upload grant's batch failed; it is recorded on its own"),
        }
        let _place = gate.enter().await;
        // An outage of the database is waited out, as for a submission; another failure returns it.
        let recorded = sandcell_core::retry_classified("answering an upload request", 1, outage_or_transient, |_| {
            sandcell_core::uploads::grant(pool, &ask.grant, ask.bytes, ask.objects_expire_at, &cfg.tenant_defaults)
        })
        .await?;
        anyhow::Ok(Some(recorded.grant))
    }
    .await;
    let outcome = answered.map(|grant| match &grant {
        Some(g) if g.status == "ready" => "upload_ready",
        Some(_) => "upload_rejected",
        None => {
            tracing::warn!(message_id = ?delivery.properties.message_id(), "an upload request names no tenant and upload id it may use; dropped");
            "upload_unattributable"
        }
    });
    settle_request(&delivery, &shared.metrics, "an upload request", outcome).await;
}

/// Record an upload request's refusal in a batch ([`crate::uploads::UploadRefusals`]), or, if
/// its batch failed, on its own with a place at its tenant's `gate`: the answer that stands for
/// its upload id. An outage of the database is waited out.
async fn record_upload_refusal(shared: &Shared, gate: Gate, refused: UploadGrant) -> Result<UploadGrant> {
    match shared.upload_refusals.record(refused.clone()).await {
        Ok(recorded) => return Ok(recorded.grant),
        Err(e) => tracing::warn!(upload_id = refused.upload_id, error = format!("{e:#}"), "an upload refusal's batch failed; it is recorded on its own"),
    }
    let _place = gate.enter().await;
    let pool = shared.jobs.pool();
    let recorded =
        sandcell_core::retry_classified("answering an upload request", 1, outage_or_transient, |_| sandcell_core::uploads::record(pool, &refused)).await?;
    Ok(recorded.grant)
}

/// Settle a delivery: the one place this scheduler acks, requeues or dead-letters a message
/// (through [`sandcell_core::broker::settle`], bounded in time). A settlement that did not reach
/// the broker is logged and counted: the broker still holds the message and redelivers it.
async fn settle(delivery: &Delivery, disposition: Disposition, metrics: &Metrics, what: &str) {
    if let Err(e) = sandcell_core::broker::settle(delivery, disposition).await {
        metrics.ack_failures.with_label_values(&[disposition.as_str()]).inc();
        tracing::warn!(disposition = disposition.as_str(), message = what, error = format!("{e:#}"), "settling a message failed; the broker will redeliver it");
    }
}

/// Settle a request that is not a submission (an upload request, a cancel): counted under its
/// outcome and acked once answered; returned to the queue (after [`FAILED_REQUEUE_DELAY`]) when
/// the database (other than by an outage, waited out), the store or the broker failed.
async fn settle_request(delivery: &Delivery, metrics: &Metrics, what: &str, outcome: anyhow::Result<&'static str>) {
    let disposition = match outcome {
        Ok(outcome) => {
            metrics.submissions.with_label_values(&[outcome]).inc();
            Disposition::Ack
        }
        Err(e) => {
            let message_id = delivery.properties.message_id().as_ref().map(|m| m.as_str());
            tracing::error!(error = format!("{e:#}"), request = what, message_id, "a request could not be handled; returning it to the queue");
            tokio::time::sleep(FAILED_REQUEUE_DELAY).await;
            Disposition::Requeue
        }
    };
    settle(delivery, disposition, metrics, what).await;
}

/// Judge and forward a cancel request ([`crate::cancels`]) and settle its delivery: acked once
/// judged, returned to the queue when the database or the broker failed.
async fn handle_cancel(cfg: &Config, jobs: &JobStore, metrics: &Metrics, publisher_ch: &Channel, delivery: Delivery) {
    let publisher = Publisher::of(&delivery, &cfg.trusted_publishers);
    let trusted = matches!(publisher, Publisher::Trusted(_));
    // An outage of the database is waited out, as for a submission; another failure returns it.
    let outcome = sandcell_core::retry_classified("judging a cancel request", 1, outage_or_transient, |_| {
        crate::cancels::handle(jobs.pool(), publisher_ch, &delivery.data, publisher.name(), trusted)
    })
    .await
    .map(|o| o.label());
    settle_request(&delivery, metrics, "a cancel request", outcome).await;
}

/// Whether a delivery was published to the intake exchange itself: not routed there from
/// another exchange (an exchange-to-exchange binding keeps the publish's exchange) nor
/// dead-lettered into it (`x-death`).
fn published_to_intake(delivery: &Delivery) -> bool {
    let dead_lettered = delivery.properties.headers().as_ref().is_some_and(|h| h.inner().contains_key("x-death"));
    delivery.exchange.as_str() == broker::INTAKE_EXCHANGE && !dead_lettered
}

/// The per-session lanes that keep one session's submissions in arrival order.
#[derive(Default)]
struct Lanes {
    /// Session key → completion of the latest handler entered in that lane.
    tails: HashMap<String, oneshot::Receiver<()>>,
}

impl Lanes {
    /// Enter a delivery into its lane: returns what to wait for first and what to signal when done.
    fn enter(&mut self, key: Option<String>) -> (Option<oneshot::Receiver<()>>, Option<oneshot::Sender<()>>) {
        let Some(key) = key else { return (None, None) };
        if self.tails.len() >= 1024 {
            // Forget lanes whose last handler has finished.
            self.tails.retain(|_, rx| matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)));
        }
        let (tx, rx) = oneshot::channel();
        (self.tails.insert(key, rx), Some(tx))
    }
}

/// `tenant/session_id` of a valid submission that names an existing session, `tenant` being
/// whom the intake attributes it to ([`Publisher::attributed`]). Invalid ones are only
/// recorded, never dispatched, so they need no lane.
fn session_key(tenant: &str, verdict: &Result<Submission, Rejection>) -> Option<String> {
    let sub = verdict.as_ref().ok()?;
    let id = sub.session.as_ref()?.id.as_ref()?;
    Some(format!("{tenant}/{id}"))
}

/// How long a submission whose handling failed waits before it goes back to the queue (so that
/// an outage does not spin it through the broker).
const FAILED_REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// Handle one delivery and settle it: the one place a submission is acked, requeued or
/// dead-lettered. Infrastructure errors are retried a few times (an outage of the database for as
/// long as it lasts); then the message goes back to the queue for a later try — a failing
/// submission never takes the consumer or any other submission down.
async fn handle_delivery(
    shared: &Shared,
    publisher: &Channel,
    delivery: Delivery,
    verdict: Result<Submission, Rejection>,
    gate: Gate,
    unjudged: Option<Unjudged>,
) {
    let metrics = &shared.metrics;
    let mut started = Instant::now();
    let tried = unjudged.is_some();
    // A place at its tenant's gate only for a submission judged under the tenant's lock.
    let mut _place = None;
    let mut disposition = match unjudged {
        // A session's job refused from memory was taken out of its session's lane: judged now,
        // it could be admitted ahead of the session's jobs published before it. Its refusal
        // stands (written on its own if its batch fails, an outage waited out); only should that
        // fail too does it go back to the queue.
        Some(u) if u.stands => match refuse_unjudged(shared, &u).await {
            Ok(disposition) => Some(disposition),
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), tenant = %u.tenant, job_id = %u.job_id, "a refusal could not be written; returning the submission to the queue");
                tokio::time::sleep(FAILED_REQUEUE_DELAY).await;
                Some(Disposition::Requeue)
            }
        },
        Some(u) => refuse_unjudged(shared, &u)
            .await
            .inspect_err(|e| {
                tracing::warn!(error = format!("{e:#}"), tenant = %u.tenant, job_id = %u.job_id, "a refusal could not be written in its batch; judging the submission")
            })
            .ok(),
        None if !delivery.redelivered => dead_letter_unjudged(shared, &delivery, &verdict).await,
        None => None,
    };
    if disposition.is_none() {
        _place = Some(gate.enter().await);
        // Measured from here, as before a submission's handler took its place itself.
        started = Instant::now();
        // The tenant may have been found at a quota while this one waited at its gate (a flood
        // arriving as the memory lapsed waits there for the first new look).
        if !tried && !delivery.redelivered {
            let from = Publisher::of(&delivery, &shared.cfg.trusted_publishers);
            if let Some(u) = unjudged_refusal(&shared.refused, &verdict, &from) {
                // Still in its lane: should the write fail, the submission is judged.
                disposition = refuse_unjudged(shared, &u).await.ok();
            }
        }
    }
    let disposition = match disposition {
        Some(disposition) => disposition,
        None => {
            // While the database is unreachable the submission waits here, however long that
            // takes: it is not at fault, the partition's later submissions could not be
            // recorded either, and each return to the queue would bring it closer to the dead
            // letters (`DELIVERY_LIMIT`).
            let handled = sandcell_core::retry_classified("handling a submission", 6, outage_or_transient, |attempt| {
                // A retry of this very delivery, or a redelivery, may finish a dispatch it began.
                let may_redispatch = delivery.redelivered || attempt > 1;
                handle(shared, publisher, &delivery, &verdict, may_redispatch)
            })
            .await;
            match handled {
                Ok(disposition) => disposition,
                Err(e) => {
                    tracing::error!(error = format!("{e:#}"), message_id = ?delivery.properties.message_id(), "a submission could not be handled; returning it to the queue");
                    tokio::time::sleep(FAILED_REQUEUE_DELAY).await;
                    Disposition::Requeue
                }
            }
        }
    };
    // The redelivery of a submission whose settlement failed finds the job recorded.
    settle(&delivery, disposition, metrics, "a submission").await;
    metrics.intake_seconds.observe(started.elapsed().as_secs_f64());
}

/// A refusal the intake writes without judging the submission under its tenant's lock: an
/// invalid submission (or one claiming another tenant) whose job id is known, or a valid one of
/// a tenant found at a quota a moment ago ([`crate::quota_memory`]).
struct Unjudged {
    tenant: String,
    job_id: String,
    reason: Reason,
    from_memory: bool,
    /// Taken out of its session's lane (a session's job refused from memory, [`take`]): judged
    /// instead, it could be admitted ahead of the session's earlier jobs, so its refusal stands.
    stands: bool,
}

/// The refusal of a delivery that needs no judgment under its tenant's lock, if it is one.
fn unjudged_refusal(memory: &QuotaMemory, verdict: &Result<Submission, Rejection>, from: &Publisher) -> Option<Unjudged> {
    match judge(verdict, from) {
        Ok(sub) => {
            let reason = quota_memory::Kind::of(sub).and_then(|kind| memory.recall(&sub.tenant, kind))?;
            Some(Unjudged { tenant: sub.tenant.clone(), job_id: sub.job_id.clone(), reason, from_memory: true, stands: false })
        }
        Err(rejection) => {
            let (tenant, job_id) = rejection.recoverable_key().map(|(t, j)| (t.to_owned(), j.to_owned()))?;
            Some(Unjudged { tenant, job_id, reason: rejection.reason, from_memory: false, stands: false })
        }
    }
}

/// How many times the refusal of a session's job taken out of its lane is written on its own,
/// once its batch failed, before the submission goes back to the queue (an outage of the
/// database is waited out, not counted).
const REFUSAL_WRITES_OUTSIDE_LANE: u32 = 6;

/// Write an unjudged refusal in a batch ([`crate::refusals`]); the delivery's disposition once
/// written. A refusal that [`Unjudged::stands`] (it left its session's lane) is written on its own should
/// its batch fail, an outage of the database waited out: judged instead, it could be admitted
/// ahead of its session's earlier jobs.
async fn refuse_unjudged(shared: &Shared, u: &Unjudged) -> Result<Disposition> {
    if u.reason.code == ErrorCode::TenantMismatch {
        tracing::warn!(publisher = %u.tenant, job_id = %u.job_id, "submission claims another tenant; refused");
    }
    let written = match shared.refusals.record(&u.tenant, &u.job_id, &u.reason).await {
        Ok(written) => written,
        Err(e) if u.stands => {
            tracing::warn!(error = format!("{e:#}"), tenant = %u.tenant, job_id = %u.job_id, "a refusal could not be written in its batch; writing it on its own");
            sandcell_core::retry_classified("writing a refusal", REFUSAL_WRITES_OUTSIDE_LANE, outage_or_transient, |_| {
                shared.jobs.record_rejection(&u.tenant, &u.job_id, &u.reason)
            })
            .await?
        }
        Err(e) => return Err(e),
    };
    if !written && u.from_memory {
        // A valid submission whose job id was taken: a duplicate, as judging it would say.
        tracing::info!(tenant = %u.tenant, job_id = %u.job_id, "duplicate submission; not run again");
        shared.metrics.submissions.with_label_values(&["duplicate"]).inc();
        return Ok(Disposition::Ack);
    }
    if u.from_memory {
        shared.metrics.refused_from_memory.inc();
    }
    refused(&shared.metrics, &u.tenant, &u.job_id, &u.reason, written);
    Ok(Disposition::Ack)
}

/// Dead-letter a message that names no job (its rejection has no tenant and job id to record
/// it under), recorded for operators in a batch ([`crate::refusals::IntakeRejections`]) without
/// a place at its publisher's gate: its disposition, or `None` if it names a job or its batch
/// failed (then it is judged, and recorded on its own).
async fn dead_letter_unjudged(shared: &Shared, delivery: &Delivery, verdict: &Result<Submission, Rejection>) -> Option<Disposition> {
    let from = Publisher::of(delivery, &shared.cfg.trusted_publishers);
    let rejection = judge(verdict, &from).err().filter(|r| r.recoverable_key().is_none())?;
    let message_id = delivery.properties.message_id().as_ref().map(|m| m.as_str());
    let record = IntakeRejection::new(message_id, from.name(), &rejection.reason, &delivery.data);
    match shared.unattributable.record(record).await {
        Ok(()) => Some(dead_lettered(&shared.metrics, &rejection, message_id, from.name(), delivery.data.len())),
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), message_id, "a message naming no job could not be recorded in its batch; judging it");
            None
        }
    }
}

/// Log and count a message that names no job, recorded: it is dead-lettered.
fn dead_lettered(metrics: &Metrics, rej: &Rejection, message_id: Option<&str>, publisher: Option<&str>, body_bytes: usize) -> Disposition {
    tracing::warn!(message_id, publisher, code = %rej.reason.code, message = %rej.reason.message, body_bytes, "unattributable submission dead-lettered");
    metrics.submissions.with_label_values(&["dead_lettered"]).inc();
    Disposition::DeadLetter
}

/// How the intake tries a message again: an outage of the database for as long as it lasts,
/// anything else as often as its handler allows (a refusal of the data included).
pub(crate) fn outage_or_transient(e: &anyhow::Error) -> sandcell_core::Failure {
    if sandcell_core::jobs::is_unavailable(e) {
        sandcell_core::Failure::Outage
    } else {
        sandcell_core::Failure::Transient
    }
}

/// Who published a submission, as the broker vouches (`user_id` is checked by RabbitMQ against
/// the connection's user; a message without one was published by someone who did not say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Publisher {
    /// No `user_id`: nobody to attribute the message to.
    Unknown,
    /// An operator-trusted user (`SANDCELL_TRUSTED_PUBLISHERS`): the body names the tenant.
    Trusted(String),
    /// A tenant's own user: the tenant is this name, whatever the body says.
    Tenant(String),
}

impl Publisher {
    pub(crate) fn of(delivery: &Delivery, trusted: &std::collections::HashSet<String>) -> Publisher {
        Publisher::from_user_id(delivery.properties.user_id().as_ref().map(|u| u.as_str()), trusted)
    }

    fn from_user_id(user_id: Option<&str>, trusted: &std::collections::HashSet<String>) -> Publisher {
        match user_id {
            None => Publisher::Unknown,
            Some(u) if trusted.contains(u) => Publisher::Trusted(u.to_owned()),
            Some(u) => Publisher::Tenant(u.to_owned()),
        }
    }

    /// The tenant a message is attributed to, its gate ([`crate::tenant_gates`]) and the tenant
    /// part of its lane: a tenant's own user whatever the body `named` (a tenant naming another
    /// must not take that tenant's places, nor enter its session's lane); the tenant the body
    /// names when a trusted publisher sent it (the gateway publishes for every tenant), or that
    /// publisher when the body names none; and, for every message without a `user_id`, the
    /// empty name (no tenant or broker user has it), so that they all share one gate.
    pub(crate) fn attributed<'a>(&'a self, named: Option<&'a str>) -> &'a str {
        match self {
            Publisher::Unknown => "",
            Publisher::Trusted(user) => named.unwrap_or(user),
            Publisher::Tenant(user) => user,
        }
    }

    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Publisher::Unknown => None,
            Publisher::Trusted(u) | Publisher::Tenant(u) => Some(u),
        }
    }
}

async fn handle(
    shared: &Shared,
    publisher: &Channel,
    delivery: &Delivery,
    verdict: &Result<Submission, Rejection>,
    may_redispatch: bool,
) -> Result<Disposition> {
    let (cfg, jobs, metrics) = (&shared.cfg, &shared.jobs, &shared.metrics);
    let message_id = delivery.properties.message_id().as_ref().map(|s| s.as_str().to_owned());
    let from = Publisher::of(delivery, &cfg.trusted_publishers);
    match judge(verdict, &from) {
        Ok(sub) => accept(shared, publisher, sub, &delivery.data, may_redispatch).await,
        Err(rejection) => {
            if rejection.reason.code == ErrorCode::TenantMismatch {
                tracing::warn!(publisher = ?from.name(), job_id = ?rejection.job_id, "submission claims another tenant; refused");
            }
            reject(jobs, metrics, &rejection, message_id.as_deref(), from.name(), &delivery.data).await
        }
    }
}

/// What the intake does with a judged delivery, given who published it.
#[derive(Debug, PartialEq)]
pub(crate) enum Decision {
    /// A valid submission whose tenant is its publisher's (or named by a trusted publisher).
    Accept(Box<Submission>),
    /// Recorded as an intake rejection: under the publishing tenant whenever there is one.
    Reject(Rejection),
}

/// The identity rules: a message without `user_id` is refused; a tenant's broker user can only
/// submit as that tenant; a trusted publisher names the tenant in the body; a refusal is recorded
/// under the publishing tenant, never under the one its body claims.
///
/// Reads the verdict without taking it: the submission the intake may accept, or the refusal
/// to record.
pub(crate) fn judge<'a>(verdict: &'a Result<Submission, Rejection>, from: &Publisher) -> Result<&'a Submission, Rejection> {
    match (verdict, from) {
        (_, Publisher::Unknown) => {
            let reason = Reason::new(ErrorCode::Unauthenticated, "the message has no user_id property: publish with user_id set to your broker user");
            Err(Rejection { reason, tenant: None, job_id: None })
        }
        (Ok(sub), Publisher::Tenant(tenant)) if sub.tenant != *tenant => {
            let reason = Reason::new(
                ErrorCode::TenantMismatch,
                format!("the body names tenant {:?} but the message was published by broker user {tenant:?}", sub.tenant),
            );
            Err(Rejection { reason, tenant: Some(tenant.clone()), job_id: Some(sub.job_id.clone()) })
        }
        (Ok(sub), _) => Ok(sub),
        (Err(rejection), _) => {
            let mut rejection = rejection.clone();
            if let Publisher::Tenant(tenant) = from {
                rejection.tenant = Some(tenant.clone());
            }
            Err(rejection)
        }
    }
}

/// [`judge`], taking the verdict: for callers that keep the decision.
pub(crate) fn decide(verdict: Result<Submission, Rejection>, from: &Publisher) -> Decision {
    if let Err(rejection) = judge(&verdict, from) {
        return Decision::Reject(rejection);
    }
    match verdict {
        Ok(sub) => Decision::Accept(Box::new(sub)),
        Err(rejection) => Decision::Reject(rejection),
    }
}

async fn accept(shared: &Shared, publisher: &Channel, sub: &Submission, body: &[u8], may_redispatch: bool) -> Result<Disposition> {
    let (cfg, jobs, metrics) = (&shared.cfg, &shared.jobs, &shared.metrics);
    let limits = cfg.policy.resolve(&sub.resource_request());
    let digest = hex::encode(Sha256::digest(body));
    // An existing session's job goes to its owner, which the record reads (and routes); any
    // other job to a shared queue.
    let mut session = sub.session.as_ref().map(|req| {
        if req.new {
            let keep_alive_s = cfg.keep_alive.resolve(req.keep_alive_s);
            JobSession { id: new_session_id(), new: true, keep_alive_s, close: false, adopt: None }
        } else {
            let keep_alive_s = req.keep_alive_s.map_or(0, |k| cfg.keep_alive.resolve(Some(k)));
            JobSession { id: req.id.clone().unwrap_or_default(), new: false, keep_alive_s, close: req.close, adopt: None }
        }
    });
    let existing = session.as_ref().is_some_and(|s| !s.new);
    let mut job = ExecutionJob {
        tenant: sub.tenant.clone(),
        job_id: sub.job_id.clone(),
        language: sub.language,
        code: sub.code.clone(),
        files: sub.files.clone(),
        limits: limits.clone(),
        session: session.clone(),
        get_files: sub.get_files.clone(),
        list_files: sub.list_files,
        env: sub.env.clone(),
        context: sub.context.clone(),
    };
    let mut payload = serde_json::to_vec(&job).context("serializing execution job")?;
    let record = match &session {
        Some(s) if s.new => Some(JobSessionRecord::Open(&s.id, s.keep_alive_s)),
        Some(s) => Some(JobSessionRecord::Existing { id: &s.id, routed: &payload }),
        None => None,
    };
    // Jobs of the shared queues are subject to their tenant's fair share.
    let fair_shared = (!existing).then_some(payload.as_slice());
    let routed_to = match jobs.record_queued(sub, &limits, &digest, record, fair_shared).await? {
        Recorded::New { routed_to } => routed_to,
        Recorded::Parked => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "session moving; job parked for its new owner");
            metrics.submissions.with_label_values(&["parked"]).inc();
            return Ok(Disposition::Ack);
        }
        Recorded::Held => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "tenant at its jobs in flight; job held for the dispatcher");
            metrics.submissions.with_label_values(&["held"]).inc();
            return Ok(Disposition::Ack);
        }
        // Only a delivery that may have recorded the job (retried, or redelivered after the
        // scheduler died) finishes its dispatch; a concurrent duplicate must not dispatch it a
        // second time. Whether the first attempt's publish reached the broker is not noted (it
        // would cost a statement per job): a job still queued is published again, and should
        // the first copy exist too, the worker's claim runs the job once. A held job is the
        // dispatcher's to publish, a parked one (its session moving, no owner to route to) too.
        Recorded::Duplicate { status: JobStatus::Queued, held: false, session_id, routed_to, .. } if may_redispatch && (!existing || routed_to.is_some()) => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "job recorded earlier but never dispatched; dispatching now");
            // The session the first copy opened, not the one this copy would have.
            if let (Some(s), Some(recorded)) = (session.as_mut(), session_id) {
                s.id = recorded;
                job.session = session;
                payload = serde_json::to_vec(&job).context("serializing execution job")?;
            }
            routed_to
        }
        Recorded::OverQuota(reason) => {
            if let Some(kind) = quota_memory::Kind::of(sub) {
                shared.refused.remember(&sub.tenant, kind, &reason);
            }
            return refuse(jobs, metrics, sub, &reason).await;
        }
        Recorded::SessionRefused(reason) => return refuse(jobs, metrics, sub, &reason).await,
        Recorded::Duplicate { status, same_payload, .. } => {
            if same_payload {
                tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "duplicate submission; not run again");
            } else {
                tracing::warn!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "job id reused with a different payload; the first submission stands");
            }
            metrics.submissions.with_label_values(&["duplicate"]).inc();
            return Ok(Disposition::Ack);
        }
    };
    // Where it goes: its session's owner, or a shared queue (one-off jobs, or new sessions).
    let queue = match &routed_to {
        Some(w) => broker::worker_queue(w),
        None => broker::shared_queue(&job).to_string(),
    };
    // The dispatch's time travels in the message, and the worker's claim records it: noting it
    // here would cost a statement per job. A session job's message is transient: the worker
    // reads the jobs routed to it from Postgres whenever it (re)connects.
    let message_id = format!("{}/{}", sub.tenant, sub.job_id);
    let props = if routed_to.is_some() { broker::session_dispatch_properties(&message_id) } else { broker::dispatch_properties(&message_id) };
    if let Err(e) = broker::publish_confirmed(publisher, &queue, &payload, props).await {
        if e.downcast_ref::<broker::Unroutable>().is_none() {
            return Err(e);
        }
        // The session's worker queue is gone: so is the worker, and the session with it.
        let reason = Reason::new(ErrorCode::SessionLost, format!("the worker holding the session is gone ({queue} does not exist)"));
        jobs.refuse(&sub.tenant, &sub.job_id, &reason).await?;
        metrics.submissions.with_label_values(&["rejected"]).inc();
        tracing::warn!(tenant = %sub.tenant, job_id = %sub.job_id, queue, "session worker queue missing; job refused");
        return Ok(Disposition::Ack);
    }
    metrics.submissions.with_label_values(&["accepted"]).inc();
    tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, language = sub.language.as_str(), queue, "job queued");
    Ok(Disposition::Ack)
}

/// Record a valid submission that cannot run because of its session.
async fn refuse(jobs: &JobStore, metrics: &Metrics, sub: &Submission, reason: &Reason) -> Result<Disposition> {
    let written = jobs.record_rejection(&sub.tenant, &sub.job_id, reason).await?;
    refused(metrics, &sub.tenant, &sub.job_id, reason, written);
    Ok(Disposition::Ack)
}

/// Log and count the refusal of a submission whose job id is known: recorded (`written`), or
/// the job id was taken and the existing job is kept.
fn refused(metrics: &Metrics, tenant: &str, job_id: &str, reason: &Reason, written: bool) {
    if !written {
        tracing::info!(tenant, job_id, code = %reason.code, "resubmission of an existing job id refused; the existing job is kept");
    }
    tracing::info!(tenant, job_id, code = %reason.code, "submission refused: {}", reason.message);
    metrics.submissions.with_label_values(&["rejected"]).inc();
}

async fn reject(jobs: &JobStore, metrics: &Metrics, rej: &Rejection, message_id: Option<&str>, publisher: Option<&str>, body: &[u8]) -> Result<Disposition> {
    if let Some((tenant, job_id)) = rej.recoverable_key() {
        let written = jobs.record_rejection(tenant, job_id, &rej.reason).await?;
        refused(metrics, tenant, job_id, &rej.reason, written);
        return Ok(Disposition::Ack);
    }
    jobs.record_intake_rejection(&IntakeRejection::new(message_id, publisher, &rej.reason, body)).await?;
    Ok(dead_lettered(metrics, rej, message_id, publisher, body.len()))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use sandcell_protocol::{Language, SessionRequest};

    use super::*;

    fn sub(tenant: &str) -> Submission {
        Submission::new(tenant, "job-1", Language::Python, "1 + 1")
    }

    fn trusted() -> HashSet<String> {
        HashSet::from(["sandcell".to_string()])
    }

    #[test]
    fn a_broker_user_is_a_tenant_unless_the_operator_trusts_it() {
        assert_eq!(Publisher::from_user_id(None, &trusted()), Publisher::Unknown);
        assert_eq!(Publisher::from_user_id(Some("sandcell"), &trusted()), Publisher::Trusted("sandcell".into()));
        assert_eq!(Publisher::from_user_id(Some("acme"), &trusted()), Publisher::Tenant("acme".into()));
    }

    #[test]
    fn a_message_without_a_user_id_is_refused_whatever_its_body() {
        let Decision::Reject(r) = decide(Ok(sub("acme")), &Publisher::Unknown) else { panic!("accepted") };
        assert_eq!((r.reason.code, r.tenant, r.job_id), (ErrorCode::Unauthenticated, None, None));
    }

    #[test]
    fn a_tenant_submits_as_itself_only() {
        assert_eq!(decide(Ok(sub("acme")), &Publisher::Tenant("acme".into())), Decision::Accept(Box::new(sub("acme"))));
        let Decision::Reject(r) = decide(Ok(sub("other")), &Publisher::Tenant("acme".into())) else { panic!("accepted") };
        assert_eq!(r.reason.code, ErrorCode::TenantMismatch);
        assert_eq!((r.tenant.as_deref(), r.job_id.as_deref()), (Some("acme"), Some("job-1")), "recorded under the publisher");
    }

    #[test]
    fn a_trusted_publisher_names_the_tenant_in_the_body() {
        assert_eq!(decide(Ok(sub("any")), &Publisher::Trusted("sandcell".into())), Decision::Accept(Box::new(sub("any"))));
    }

    #[test]
    fn a_tenants_invalid_submission_is_recorded_under_that_tenant_not_the_one_it_claims() {
        let claimed = Rejection { reason: Reason::new(ErrorCode::MissingField, "code"), tenant: Some("victim".into()), job_id: Some("j".into()) };
        let Decision::Reject(r) = decide(Err(claimed.clone()), &Publisher::Tenant("acme".into())) else { panic!("accepted") };
        assert_eq!(r.tenant.as_deref(), Some("acme"));
        // A trusted publisher's rejection keeps the tenant its body named.
        let Decision::Reject(r) = decide(Err(claimed), &Publisher::Trusted("sandcell".into())) else { panic!("accepted") };
        assert_eq!(r.tenant.as_deref(), Some("victim"));
    }

    #[test]
    fn only_jobs_of_an_existing_session_have_a_lane() {
        assert_eq!(session_key("acme", &Ok(sub("acme"))), None, "one-off");
        let mut opening = sub("acme");
        opening.session = Some(SessionRequest { new: true, ..Default::default() });
        assert_eq!(session_key("acme", &Ok(opening)), None, "a new session has no earlier job");
        let mut next = sub("acme");
        next.session = Some(SessionRequest { id: Some("ses_1".into()), ..Default::default() });
        assert_eq!(session_key("acme", &Ok(next)), Some("acme/ses_1".into()));
        let refused = Rejection { reason: Reason::new(ErrorCode::MissingField, "code"), tenant: None, job_id: None };
        assert_eq!(session_key("acme", &Err(refused)), None, "refused: never dispatched");
    }

    #[test]
    fn a_tenant_naming_another_tenants_session_is_not_entered_in_its_lane() {
        let mut theirs = sub("victim");
        theirs.session = Some(SessionRequest { id: Some("ses_v".into()), ..Default::default() });
        let verdict = Ok(theirs);
        let from = Publisher::Tenant("acme".into());
        let tenant = from.attributed(verdict.as_ref().ok().map(|s: &Submission| s.tenant.as_str()));
        assert_eq!(session_key(tenant, &verdict), Some("acme/ses_v".into()));
        // A trusted publisher is believed: the job joins the lane of the tenant it names.
        let trusted = Publisher::Trusted("sandcell".into());
        let tenant = trusted.attributed(Some("victim"));
        assert_eq!(session_key(tenant, &verdict), Some("victim/ses_v".into()));
    }

    #[tokio::test]
    async fn a_sessions_deliveries_wait_for_the_one_before_and_other_sessions_do_not() {
        let mut lanes = Lanes::default();
        let (first_wait, first_done) = lanes.enter(Some("acme/ses_1".into()));
        assert!(first_wait.is_none(), "the first of a lane waits for nothing");
        let (second_wait, _second_done) = lanes.enter(Some("acme/ses_1".into()));
        let (other_wait, _) = lanes.enter(Some("acme/ses_2".into()));
        assert!(other_wait.is_none(), "another session's lane is independent");
        let (wait, done) = lanes.enter(None);
        assert!(wait.is_none() && done.is_none(), "a one-off job has no lane");
        let mut second_wait = second_wait.expect("the second waits for the first");
        assert!(matches!(second_wait.try_recv(), Err(oneshot::error::TryRecvError::Empty)), "not before the first is done");
        first_done.expect("a lane's handler signals").send(()).expect("the second is waiting");
        assert_eq!(second_wait.await, Ok(()));
    }
}
