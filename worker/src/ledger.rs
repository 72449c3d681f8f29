//! Who acks a job's message: handlers decide a [`Disposition`]; the [`Ledger`] acts on it.
//!
//! Every delivery of an execution job enters the ledger when it arrives and leaves it through
//! [`Ticket::settle`] — the one place this worker acks, requeues or dead-letters a job. That
//! place upholds the worker's delivery invariants:
//! - **ack only after the commit**: handlers settle with [`Disposition::Ack`] once the job's
//!   outcome is durable in Postgres (or the job must not run);
//! - **a redelivered copy of a job in flight here is absorbed, not run again**: after a broker
//!   reconnect the broker redelivers every unacked message; a copy of a job this worker is
//!   still running (or holds in a session's mailbox) takes the place of the dead delivery, and
//!   the running handler settles it when the job is committed;
//! - **nothing is left unsettled**: a ticket dropped on an unexpected path (a panic, a bug)
//!   requeues its message, so the job is redelivered rather than stranded;
//! - **ack failures are named, logged and counted** (`sandcell_worker_ack_failures_total`): the
//!   job's outcome is already durable, and its redelivery is acked without running (the claim
//!   refuses a finished job);
//! - **a session job read back from Postgres is held like a delivery** ([`Ledger::enter_recovered`]):
//!   session jobs travel in transient messages, so after a reconnect the worker reads the jobs
//!   routed to it; one already held here is not entered twice (nor read again), a copy the
//!   queue still delivers is acked at once (absorbed: the job stays held as read back, so a
//!   session's copies never stand in its window), and one whose handler fails is read again
//!   from Postgres and published, persistent, to this worker's queue while it is still `queued`;
//! - **a session holds at most its window of unacked messages** ([`Ticket::release`]): a job
//!   past it is acked on arrival and held from then on as read back from Postgres.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lapin::message::Delivery;
use sandcell_core::broker;
use sandcell_core::jobs::{Arrival, JobStore};
use sandcell_protocol::ExecutionJob;

use crate::metrics::Metrics;

pub use sandcell_core::broker::Disposition;

/// How long a failed handler waits before its message goes back to the queue, so that an
/// outage does not spin the job through the broker.
const FAILED_REQUEUE_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// The disposition of a handler's result, the one rule for failed handlers (one-off, opening or
/// in a session: a job never takes the consumer, the session or another job down). A handler
/// fails only after its database steps were tried again in place (an outage of the database for
/// as long as it lasts), and then:
/// - a job of a shared queue (one-off, opening or taking over a session) goes back to it, after
///   a pause: the broker dead-letters it after `DELIVERY_LIMIT` returns;
/// - a job of an existing session is dead-lettered at once. It came through its worker's
///   queue, one per worker and shared by all its sessions, where the broker bounds no returns
///   (a job failing for good came back for ever), and a redelivery may run a cell that had run
///   already, after the session's later ones. Its session goes on; the scheduler records the
///   job `rejected/too_many_attempts` from the dead letter (the sweeper ends it, had it been
///   claimed).
pub async fn disposition_of(job: &ExecutionJob, result: anyhow::Result<Disposition>) -> Disposition {
    match result {
        Ok(d) => d,
        Err(e) if in_existing_session(job) => {
            tracing::error!(tenant = %job.tenant, job_id = %job.job_id, error = format!("{e:#}"), "a session's job handler failed; dead-lettering the job");
            Disposition::DeadLetter
        }
        Err(e) => {
            tracing::error!(tenant = %job.tenant, job_id = %job.job_id, error = format!("{e:#}"), "job handler failed; returning the job to the queue");
            tokio::time::sleep(FAILED_REQUEUE_DELAY).await;
            Disposition::Requeue
        }
    }
}

/// Whether a job runs in a session that exists already (neither opening nor taking one over):
/// such jobs travel on their worker's own queue.
fn in_existing_session(job: &ExecutionJob) -> bool {
    job.session.as_ref().is_some_and(|s| !s.new && s.adopt.is_none())
}

/// `(tenant, job_id)`: a job's identity.
type Key = (String, String);

/// The jobs this worker holds, by job, each with what settles it. Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    held: Arc<Mutex<HashMap<Key, Source>>>,
    metrics: Metrics,
}

/// How a job held here reached this worker, and so how it is settled. (Unboxed: the ledger held
/// a `Delivery` per job before, and a box would be an allocation per job for nothing.)
#[allow(clippy::large_enum_variant)]
enum Source {
    /// A message of the broker's: acked, returned or dead-lettered on its channel.
    Message(Delivery),
    /// Read back from Postgres on a (re)connection: no message to ack.
    Recovered(Recovered),
}

/// A session job read back from Postgres when this worker (re)connected to the broker
/// (`JobStore::routed_to_worker`): its transient message may have been dropped by a broker
/// restart. There is no message to ack; should its handler fail, the job is published again,
/// persistent, to this worker's queue, as Postgres still keeps it (read again then, not held
/// meanwhile: a backlog read back would otherwise keep every job's inputs in memory, outside
/// the mailboxes' budget).
pub struct Recovered {
    /// A channel of the connection that read it, to publish it again on.
    pub channel: lapin::Channel,
    /// This worker's own queue.
    pub queue: String,
    /// Where the execution job, as the scheduler routed it, is kept while it is `queued`.
    pub jobs: JobStore,
}

impl Recovered {
    /// A job read back (or acked on arrival) on the connection of `channel`, for `queue`.
    pub fn new(channel: &lapin::Channel, queue: &str, jobs: &JobStore) -> Self {
        Recovered { channel: channel.clone(), queue: queue.to_string(), jobs: jobs.clone() }
    }
}

/// A job's place in the ledger: whoever holds it must settle it.
pub struct Ticket {
    key: Option<Key>,
    ledger: Ledger,
    /// How the first delivery of this job to reach this worker arrived: a redelivery (the
    /// broker gave it to a consumer before, which may have died mid-job) or not, and when the
    /// scheduler published it.
    pub arrival: Arrival,
    /// How often the broker had this message returned before (`x-delivery-count` of quorum
    /// queues); a message returned more than [`sandcell_core::broker::DELIVERY_LIMIT`] times is
    /// dead-lettered.
    pub returns: i64,
    /// A place this job holds until it is settled (a new session's place among the opening
    /// jobs in flight, see `consumer::NewSessions`).
    hold: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new(metrics: Metrics) -> Self {
        Ledger { held: Arc::new(Mutex::new(HashMap::new())), metrics }
    }

    /// Enter a delivery of `job`. `None` when this worker already holds the job: the new
    /// delivery replaces the old one (whose channel is gone after a reconnect, or which is
    /// acked here when it is a second copy on a live channel), and the handler already running
    /// the job will settle it.
    pub async fn enter(&self, job: &ExecutionJob, delivery: Delivery) -> Option<Ticket> {
        let key = (job.tenant.clone(), job.job_id.clone());
        let arrival = Arrival { redelivered: delivery.redelivered, dispatched_at: broker::dispatched_at(&delivery.properties) };
        let returns = delivery_count(&delivery);
        let replaced = {
            let Ok(mut held) = self.held.lock() else {
                // A poisoned lock means a panic elsewhere; run the job rather than lose it.
                return Some(Ticket { key: None, ledger: self.clone(), arrival, returns, hold: None });
            };
            match held.get_mut(&key) {
                // Held as read back from Postgres (after a reconnect, or past its session's
                // window): it stays so, and this copy is retired below. Taking its place, the
                // copy would stand unacked outside any window, and a session's copies could
                // fill the prefetch again.
                Some(Source::Recovered(_)) => Some(Source::Message(delivery)),
                Some(current) => Some(std::mem::replace(current, Source::Message(delivery))),
                None => {
                    held.insert(key.clone(), Source::Message(delivery));
                    None
                }
            }
        };
        match replaced {
            None => Some(Ticket { key: Some(key), ledger: self.clone(), arrival, returns, hold: None }),
            Some(old) => {
                tracing::info!(tenant = %key.0, job_id = %key.1, "a copy of a job in flight here arrived; it will be settled with the running one");
                self.metrics.redeliveries_absorbed.inc();
                // A message: on a closed channel this fails harmlessly; on a live one it retires
                // the copy (the new one, when the job is held as read back). A job read back
                // from Postgres has nothing to retire.
                if let Source::Message(old) = old {
                    apply(&old, Disposition::Ack, &self.metrics).await;
                }
                None
            }
        }
    }

    /// A session job routed here, found on a (re)connection, that this worker already holds
    /// (its delivery from before the reconnect waits in a mailbox or runs): from now on it is
    /// settled as read back, since that delivery's channel is gone and a broker restart dropped
    /// its message (a message that survived takes the place back when the queue redelivers it).
    /// Returns whether it was held; the handler holding it goes on.
    pub fn hold_as_recovered(&self, tenant: &str, job_id: &str, recovered: Recovered) -> bool {
        let Ok(mut held) = self.held.lock() else { return false };
        match held.get_mut(&(tenant.to_string(), job_id.to_string())) {
            Some(current) => {
                *current = Source::Recovered(recovered);
                true
            }
            None => false,
        }
    }

    /// Enter a session job read back from Postgres on a (re)connection, not held here
    /// ([`Ledger::hold_as_recovered`] first). `None` when it is held after all (entered since).
    pub fn enter_recovered(&self, job: &ExecutionJob, recovered: Recovered) -> Option<Ticket> {
        let key = (job.tenant.clone(), job.job_id.clone());
        // Not a redelivery: the claim takes it only while it is `queued`. Its dispatch is now.
        let arrival = Arrival { redelivered: false, dispatched_at: Some(chrono::Utc::now()) };
        let Ok(mut held) = self.held.lock() else {
            return Some(Ticket { key: None, ledger: self.clone(), arrival, returns: 0, hold: None });
        };
        if let Some(current) = held.get_mut(&key) {
            *current = Source::Recovered(recovered);
            return None;
        }
        held.insert(key.clone(), Source::Recovered(recovered));
        Some(Ticket { key: Some(key), ledger: self.clone(), arrival, returns: 0, hold: None })
    }

    /// Jobs held now (running, waiting for a slot, or in a session's mailbox).
    pub fn len(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    fn take(&self, key: &Key) -> Option<Source> {
        self.held.lock().ok().and_then(|mut h| h.remove(key))
    }
}

impl Ticket {
    /// Keep `permit` until this ticket is settled (or dropped).
    pub fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.hold = Some(permit);
    }

    /// Ack this job's message now and hold the job as read back from Postgres from here on
    /// (`recovered`), as its session holds its window of unacked messages
    /// (`registry::WindowPlace`): Postgres keeps the job as routed while it is `queued` (should
    /// this worker die or drain, it is parked with its session's other jobs and follows the
    /// session to its next owner, `SessionStore::orphan_worker`). Whether the message was acked
    /// (a job held otherwise, read back already, is left as it is). Should the ack fail (the
    /// channel closed), a redelivery of the message is acked on arrival (`Ledger::enter`).
    pub async fn release(&self, recovered: Recovered) -> bool {
        let Some(key) = &self.key else { return false };
        let message = {
            let Ok(mut held) = self.ledger.held.lock() else { return false };
            match held.get_mut(key) {
                Some(current @ Source::Message(_)) => Some(std::mem::replace(current, Source::Recovered(recovered))),
                _ => None,
            }
        };
        match message {
            Some(Source::Message(delivery)) => apply(&delivery, Disposition::Ack, &self.ledger.metrics).await,
            _ => false,
        }
    }

    /// Settle the job's current delivery: the one place a job's message is acked, requeued or
    /// dead-lettered.
    pub async fn settle(mut self, disposition: Disposition) {
        let Some(key) = self.key.take() else { return };
        match self.ledger.take(&key) {
            Some(source) => source.settle(&key, disposition, &self.ledger.metrics).await,
            None => tracing::warn!(tenant = %key.0, job_id = %key.1, "a job left the ledger before it was settled"),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        tracing::error!(tenant = %key.0, job_id = %key.1, "a job's ticket was dropped unsettled; requeueing its message");
        let ledger = self.ledger.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Some(source) = ledger.take(&key) {
                    source.settle(&key, Disposition::Requeue, &ledger.metrics).await;
                }
            });
        }
    }
}

impl Source {
    async fn settle(self, key: &Key, disposition: Disposition, metrics: &Metrics) {
        match self {
            Source::Message(delivery) => {
                apply(&delivery, disposition, metrics).await;
            }
            Source::Recovered(_) if disposition == Disposition::Ack => {}
            // As the broker would do with its message: a job whose handler failed goes back to
            // this worker's queue (now persistent), one that can never run to the dead letters.
            // A job not yet claimed runs from there; one claimed whose commit failed is not run
            // again (its copy is no redelivery, and a session's job may have had effects, as
            // when its worker dies): the sweeper ends it `stuck` once overdue. Should the publish
            // fail too, the job is still in Postgres, and the next connection reads it back.
            // A job no longer `queued` (claimed) has no kept copy to return: as before, its
            // claim would refuse it, and the sweeper ends it.
            Source::Recovered(r) => {
                let read = sandcell_core::retry_classified("reading a job back to return it to this worker's queue", 6, sandcell_core::jobs::failure, |_| {
                    r.jobs.routed_job(&key.0, &key.1)
                });
                let payload = match read.await {
                    Ok(Some(payload)) => payload,
                    Ok(None) => {
                        tracing::info!(tenant = %key.0, job_id = %key.1, disposition = disposition.as_str(), "a job read back from Postgres is no longer queued; nothing to return to the queue");
                        return;
                    }
                    Err(e) => {
                        metrics.ack_failures.with_label_values(&[disposition.as_str()]).inc();
                        tracing::warn!(tenant = %key.0, job_id = %key.1, error = format!("{e:#}"), "reading a job back to return it to this worker's queue failed; the next connection reads it again");
                        return;
                    }
                };
                let props = broker::dispatch_properties(&format!("{}/{}", key.0, key.1));
                let (exchange, routing_key) = match disposition {
                    Disposition::DeadLetter => (broker::DEAD_LETTER_EXCHANGE, r.queue.as_str()),
                    _ => ("", r.queue.as_str()),
                };
                if let Err(e) = broker::publish_within_settle(&r.channel, exchange, routing_key, &payload, props).await {
                    metrics.ack_failures.with_label_values(&[disposition.as_str()]).inc();
                    tracing::warn!(
                        tenant = %key.0,
                        job_id = %key.1,
                        disposition = disposition.as_str(),
                        error = format!("{e:#}"),
                        "returning a job read back from Postgres to this worker's queue failed; the next connection reads it again"
                    );
                }
            }
        }
    }
}

/// The `x-delivery-count` header of a delivery (0 when absent: a first delivery).
fn delivery_count(delivery: &Delivery) -> i64 {
    use lapin::types::AMQPValue;
    let headers = delivery.properties.headers().as_ref();
    match headers.and_then(|h| h.inner().get("x-delivery-count")) {
        Some(AMQPValue::LongLongInt(n)) => *n,
        Some(AMQPValue::LongInt(n)) => i64::from(*n),
        Some(AMQPValue::LongUInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortUInt(n)) => i64::from(*n),
        Some(AMQPValue::Timestamp(n)) => i64::try_from(*n).unwrap_or(i64::MAX),
        _ => 0,
    }
}

/// Settle a control message (a cancel), which never becomes a ticket: acked once acted on,
/// dead-lettered when it could not be decoded.
pub async fn settle_control(delivery: &Delivery, decoded: bool, metrics: &Metrics) {
    apply(delivery, if decoded { Disposition::Ack } else { Disposition::DeadLetter }, metrics).await;
}

/// Settle a message that never became a ticket (it could not be decoded).
pub async fn settle_undecodable(delivery: &Delivery, metrics: &Metrics) {
    apply(delivery, Disposition::DeadLetter, metrics).await;
}

/// Settle `delivery`; whether the broker took it.
async fn apply(delivery: &Delivery, disposition: Disposition, metrics: &Metrics) -> bool {
    let settled = sandcell_core::broker::settle(delivery, disposition).await;
    if let Err(e) = &settled {
        // The channel closed (a broker restart): the broker redelivers the message if it kept it
        // (not a session job's transient one), and the redelivery finds the job finished (ack) or
        // in flight here (absorbed).
        metrics.ack_failures.with_label_values(&[disposition.as_str()]).inc();
        tracing::warn!(
            disposition = disposition.as_str(),
            delivery_tag = delivery.delivery_tag,
            error = format!("{e:#}"),
            "settling a job's message failed; the broker redelivers it if it kept it (a session job's transient message is gone after a broker restart)"
        );
    }
    settled.is_ok()
}
