//! RabbitMQ: the queue topology and the two operations everything else uses — confirmed
//! publishing and consuming with manual acks.
//!
//! Topology (declared idempotently by the scheduler and workers at start-up, with identical
//! arguments):
//! - `sandcell.intake` (fanout exchange) → `sandcell.intake.partitions` (consistent-hash
//!   exchange, on the routing key) → `sandcell.submissions.<p>` for `p` in
//!   `0..SANDCELL_INTAKE_PARTITIONS` (quorum, single active consumer; declared by the scheduler,
//!   [`declare_intake_partitions`]): clients publish
//!   [`Submission`](sandcell_protocol::Submission)s to the intake exchange, with the `user_id`
//!   property set to their broker user and the session id (or the job id) as the routing key,
//!   so one session's submissions share a partition. A tenant's broker user may write to the
//!   intake exchange and nothing else, so it cannot reach the jobs or worker queues, nor read any queue;
//! - `sandcell.jobs` (quorum, delivery limit): the scheduler publishes one-off
//!   [`ExecutionJob`](sandcell_protocol::ExecutionJob)s here, workers consume;
//! - `sandcell.sessions.new` (quorum, delivery limit): jobs that open a session; a worker
//!   consumes it only while it has room for another session, with its room as its consumer
//!   priority, so the broker offers a new session to the worker with the most room first;
//! - `sandcell.worker.<id>` (classic, one per worker, declared by that worker): the scheduler
//!   routes every job of a session to the queue of the worker that holds the session;
//! - `sandcell.dlx` (fanout exchange) → `sandcell.dead` (quorum): poison messages, kept for
//!   operators (the newest 256 MiB, a week: [`dead_letter_queue_policy`]); and →
//!   `sandcell.dead.outcomes` (quorum, declared by the scheduler,
//!   [`declare_dead_letter_outcomes`]): a copy of each, from which the scheduler records the
//!   outcome of the job it carried.

use anyhow::{anyhow, Context, Result};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

/// The single submissions queue of earlier versions: no longer bound to the intake; the
/// owner of partition 0 drains what is left in it (see [`declare_intake_partitions`]).
pub const LEGACY_SUBMISSIONS_QUEUE: &str = "sandcell.submissions";
/// The consistent-hash exchange that spreads submissions over the partition queues by routing key.
pub const INTAKE_PARTITIONS_EXCHANGE: &str = "sandcell.intake.partitions";
/// Partitions of the intake when `SANDCELL_INTAKE_PARTITIONS` is not set. Every scheduler of a
/// fleet must use the same number.
pub const DEFAULT_INTAKE_PARTITIONS: u16 = 8;

/// The queue of intake partition `partition`.
pub fn submissions_queue(partition: u16) -> String {
    format!("sandcell.submissions.{partition}")
}

/// The routing key a client publishes a submission with: its session's id when it names one
/// (so a session's submissions share a partition, and keep their order across schedulers),
/// else its job id (so the rest spread over the partitions).
pub fn intake_routing_key(sub: &sandcell_protocol::Submission) -> &str {
    sub.session.as_ref().and_then(|s| s.id.as_deref()).unwrap_or(&sub.job_id)
}
/// Where the scheduler publishes execution jobs for workers.
pub const JOBS_QUEUE: &str = "sandcell.jobs";
/// Where the scheduler publishes jobs that open a session (see [`shared_queue`]).
pub const NEW_SESSIONS_QUEUE: &str = "sandcell.sessions.new";
/// Dead-letter exchange for poison messages.
pub const DEAD_LETTER_EXCHANGE: &str = "sandcell.dlx";
/// Queue collecting dead-lettered messages.
pub const DEAD_LETTER_QUEUE: &str = "sandcell.dead";
/// The scheduler's copy of every dead letter: it records the outcome of the job a dead letter
/// carried (a client would otherwise wait for it for ever), while [`DEAD_LETTER_QUEUE`] keeps
/// the message for operators.
pub const DEAD_LETTER_OUTCOMES_QUEUE: &str = "sandcell.dead.outcomes";
/// A message returned to a quorum queue more often than this is dead-lettered
/// (a consumer that crashes on it every time cannot loop forever).
pub const DELIVERY_LIMIT: i64 = 5;

/// How long a worker's queue survives without a consumer (its worker is gone for good).
pub const WORKER_QUEUE_EXPIRES_MS: i64 = 15 * 60 * 1000;

/// The shared queue a job goes to when no particular worker must run it: the one that opens
/// sessions, or the one-off jobs' queue. (A job of an existing session goes to its owner's
/// [`worker_queue`].)
pub fn shared_queue(job: &sandcell_protocol::ExecutionJob) -> &'static str {
    if job.session.as_ref().is_some_and(|s| s.new) {
        NEW_SESSIONS_QUEUE
    } else {
        JOBS_QUEUE
    }
}

/// The queue of the worker `worker_id`: jobs of the sessions it holds.
pub fn worker_queue(worker_id: &str) -> String {
    format!("sandcell.worker.{worker_id}")
}

/// Declare a worker's own queue. Classic rather than quorum: a session lives in one worker's
/// memory, so replicating its queue would not save the session; low latency matters more.
/// It expires [`WORKER_QUEUE_EXPIRES_MS`] after its worker stops consuming.
pub async fn declare_worker_queue(ch: &Channel, worker_id: &str) -> Result<String> {
    let name = worker_queue(worker_id);
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("classic".into()));
    args.insert("x-expires".into(), AMQPValue::LongLongInt(WORKER_QUEUE_EXPIRES_MS));
    args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(DEAD_LETTER_EXCHANGE.into()));
    ch.queue_declare(name.as_str().into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .with_context(|| format!("declaring queue {name}"))?;
    Ok(name)
}

/// The user name in an AMQP URL (what the broker authenticates the connection as).
pub fn url_user(url: &str) -> Option<String> {
    let uri: lapin::uri::AMQPUri = url.parse().ok()?;
    Some(uri.authority.userinfo.username).filter(|u| !u.is_empty())
}

/// Open a connection to the broker.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, props).await.with_context(|| format!("connecting to RabbitMQ at {}", redact(url)))
}

/// Strip the password from an AMQP or Postgres URL for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{}:***{}", &url[..s + 3], user, &url[at..])
        }
        _ => url.to_string(),
    }
}

/// The exchange clients publish submissions to (a fanout bound only to [`INTAKE_PARTITIONS_EXCHANGE`]).
pub const INTAKE_EXCHANGE: &str = "sandcell.intake";

pub use sandcell_protocol::event::EVENTS_EXCHANGE;

/// The permissions `tenant`'s broker user gets (configure, write, read regexes): publish to
/// [`INTAKE_EXCHANGE`]; declare queues in its own namespace (`sandcell.live.<tenant>.…`), bind
/// them to [`EVENTS_EXCHANGE`] and consume them. Which routing keys it may bind there is its
/// topic permission ([`tenant_topic_permission`]). Not server-named queues (`amq.gen-…`): that
/// name space is every user's, so a tenant could use another's non-exclusive one. Tenant names
/// hold no regex metacharacter.
pub fn tenant_permissions(tenant: &str) -> (String, String, String) {
    let own = format!("sandcell\\.live\\.{tenant}\\..*");
    (format!("^({own})$"), format!("^(sandcell\\.intake|{own})$"), format!("^(sandcell\\.events|{own})$"))
}

/// The prefix of the queues a tenant may declare (see [`tenant_permissions`]).
pub fn tenant_queue_prefix(tenant: &str) -> String {
    format!("{LIVE_QUEUE_PREFIX}{tenant}.")
}

/// What every tenant queue's name starts with: `sandcell.live.`, then the tenant's name.
pub const LIVE_QUEUE_PREFIX: &str = "sandcell.live.";

/// The tenant whose namespace a queue named `queue` is in (the only broker user besides the
/// service's that may declare it, [`tenant_permissions`]), if it is a tenant queue.
pub fn live_queue_tenant(queue: &str) -> Option<&str> {
    let rest = queue.strip_prefix(LIVE_QUEUE_PREFIX)?;
    let (tenant, _) = rest.split_once('.')?;
    Some(tenant).filter(|t| sandcell_protocol::submission::is_valid_tenant(t))
}

/// `SANDCELL_TENANT_MAX_LIVE_QUEUES`' default: a client holds one live-output queue (the
/// Python SDK and the CLI, one per connection), and a tenant at most
/// [`TENANT_MAX_CONNECTIONS`]; an idle queue costs the broker ~40 KB.
pub const DEFAULT_TENANT_MAX_LIVE_QUEUES: u32 = 64;
/// `SANDCELL_TENANT_MAX_LIVE_BINDINGS`' default: a binding a watched job (the default
/// `max_queued_jobs` is 1,000); a binding costs the broker ~2.7 KB.
pub const DEFAULT_TENANT_MAX_LIVE_BINDINGS: u32 = 4096;

/// Most connections a tenant's broker user may hold at once.
pub const TENANT_MAX_CONNECTIONS: u32 = 32;
/// Most channels a tenant's broker user may hold at once.
pub const TENANT_MAX_CHANNELS: u32 = 256;
/// The operator policy every tenant queue (`sandcell.live.…`) is held to, whatever it asked
/// for: (name, pattern, definition). Bounded bytes (the oldest dropped), events that expire, and
/// queues that disappear an hour after their last use.
pub fn tenant_queue_policy() -> (&'static str, &'static str, serde_json::Value) {
    ("sandcell-tenant-queues", "^sandcell\\.live\\.", serde_json::json!({"max-length-bytes": 64u64 << 20, "message-ttl": 600_000, "expires": 3_600_000}))
}

/// Most bytes of dead letters [`DEAD_LETTER_QUEUE`] keeps: the newest are kept, the oldest dropped.
pub const DEAD_LETTER_MAX_BYTES: u64 = 256 << 20;
/// How long [`DEAD_LETTER_QUEUE`] keeps a dead letter: a week, for operators to read it.
pub const DEAD_LETTER_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// The operator policy [`DEAD_LETTER_QUEUE`] is held to: (name, pattern, definition). A tenant
/// can get what it publishes dead-lettered (a message the intake cannot attribute, up to the
/// broker's `max_message_size` each), and the queue has no consumer: unbounded, it would grow
/// until the broker's disk alarm blocks every publisher, every tenant's included.
pub fn dead_letter_queue_policy() -> (&'static str, &'static str, serde_json::Value) {
    ("sandcell-dead-letters", "^sandcell\\.dead$", serde_json::json!({"max-length-bytes": DEAD_LETTER_MAX_BYTES, "message-ttl": DEAD_LETTER_TTL_MS}))
}

/// Every operator policy of the shared broker, set where tenants are made (the only untrusted
/// publishers): [`tenant_queue_policy`] and [`dead_letter_queue_policy`].
pub fn operator_policies() -> [(&'static str, &'static str, serde_json::Value); 2] {
    [tenant_queue_policy(), dead_letter_queue_policy()]
}

/// A tenant's topic permission on [`EVENTS_EXCHANGE`] (exchange, write, read regexes): it may
/// bind only routing keys that start with its own name and a dot (tenant names hold no dot or
/// regex metacharacter), and publish nothing there.
pub fn tenant_topic_permission(tenant: &str) -> (&'static str, String, String) {
    (EVENTS_EXCHANGE, "^$".to_string(), format!("^{tenant}\\."))
}

/// Declare the queues and exchanges. Safe to call from every process, every start.
pub async fn declare_topology(ch: &Channel) -> Result<()> {
    ch.exchange_declare(
        DEAD_LETTER_EXCHANGE.into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions { durable: true, ..Default::default() },
        FieldTable::default(),
    )
    .await
    .context("declaring the dead-letter exchange")?;
    declare_quorum(ch, DEAD_LETTER_QUEUE, false, false).await?;
    ch.queue_bind(DEAD_LETTER_QUEUE.into(), DEAD_LETTER_EXCHANGE.into(), "".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .context("binding the dead-letter queue")?;
    declare_quorum(ch, JOBS_QUEUE, true, false).await?;
    declare_quorum(ch, NEW_SESSIONS_QUEUE, true, false).await?;
    ch.exchange_declare(INTAKE_EXCHANGE.into(), ExchangeKind::Fanout, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .context("declaring the intake exchange")?;
    ch.exchange_declare(EVENTS_EXCHANGE.into(), ExchangeKind::Topic, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .context("declaring the events exchange")?;
    Ok(())
}

/// Declare the intake's partitions (the scheduler's part of the topology): the consistent-hash
/// exchange bound to the intake, and `partitions` queues with a single active consumer each, one
/// share of the hash ring each. Safe from every scheduler, every start, as long as all use the
/// same `partitions`. Returns whether the [`LEGACY_SUBMISSIONS_QUEUE`] of an earlier version still
/// holds messages: it is unbound from the intake (and deleted when empty), and then drained by
/// the owner of partition 0.
pub async fn declare_intake_partitions(conn: &Connection, partitions: u16) -> Result<bool> {
    let ch = conn.create_channel().await.context("opening a channel to declare the intake partitions")?;
    ch.exchange_declare(
        INTAKE_PARTITIONS_EXCHANGE.into(),
        ExchangeKind::Custom("x-consistent-hash".into()),
        ExchangeDeclareOptions { durable: true, ..Default::default() },
        FieldTable::default(),
    )
    .await
    .context("declaring the intake's consistent-hash exchange (is the rabbitmq_consistent_hash_exchange plugin enabled?)")?;
    ch.exchange_bind(INTAKE_PARTITIONS_EXCHANGE.into(), INTAKE_EXCHANGE.into(), "".into(), ExchangeBindOptions::default(), FieldTable::default())
        .await
        .context("binding the partitions exchange to the intake exchange")?;
    for p in 0..partitions {
        let queue = submissions_queue(p);
        declare_quorum(&ch, &queue, true, true).await?;
        // The binding key of a consistent-hash exchange is the queue's weight on the ring.
        ch.queue_bind(queue.as_str().into(), INTAKE_PARTITIONS_EXCHANGE.into(), "1".into(), QueueBindOptions::default(), FieldTable::default())
            .await
            .with_context(|| format!("binding {queue} to the partitions exchange"))?;
    }
    let _ = ch.close(200, "declared".into()).await;
    legacy_submissions_left(conn).await
}

/// Unbind the [`LEGACY_SUBMISSIONS_QUEUE`] from the intake if it exists, delete it if empty;
/// whether it holds messages still. (A passive declare of a missing queue closes its channel,
/// hence a channel of its own.)
async fn legacy_submissions_left(conn: &Connection) -> Result<bool> {
    let ch = conn.create_channel().await.context("opening a channel to look for the legacy submissions queue")?;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let Ok(queue) = ch.queue_declare(LEGACY_SUBMISSIONS_QUEUE.into(), passive, FieldTable::default()).await else {
        return Ok(false);
    };
    ch.queue_unbind(LEGACY_SUBMISSIONS_QUEUE.into(), INTAKE_EXCHANGE.into(), "".into(), FieldTable::default())
        .await
        .context("unbinding the legacy submissions queue from the intake")?;
    if queue.message_count() > 0 {
        tracing::warn!(messages = queue.message_count(), "the legacy submissions queue still holds messages; the owner of partition 0 drains it");
        return Ok(true);
    }
    ch.queue_delete(LEGACY_SUBMISSIONS_QUEUE.into(), QueueDeleteOptions { if_empty: true, ..Default::default() })
        .await
        .context("deleting the empty legacy submissions queue")?;
    let _ = ch.close(200, "done".into()).await;
    Ok(false)
}

/// Declare a durable quorum queue; `dead_letter`: poison messages go to [`DEAD_LETTER_EXCHANGE`]
/// after [`DELIVERY_LIMIT`] returns; `single_active`: one consumer at a time takes its messages.
async fn declare_quorum(ch: &Channel, name: &str, dead_letter: bool, single_active: bool) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    if single_active {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    if dead_letter {
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(DEAD_LETTER_EXCHANGE.into()));
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(DELIVERY_LIMIT));
    }
    ch.queue_declare(name.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .with_context(|| format!("declaring queue {name}"))?;
    Ok(())
}

/// Declare the scheduler's copy of the dead letters ([`DEAD_LETTER_OUTCOMES_QUEUE`]), bound to
/// the dead-letter exchange. It has no dead-letter exchange of its own (a message it cannot
/// take would come back to it), but a delivery limit: a copy returned more than
/// [`DELIVERY_LIMIT`] times is dropped; the operators' copy stays in [`DEAD_LETTER_QUEUE`].
pub async fn declare_dead_letter_outcomes(ch: &Channel) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(DELIVERY_LIMIT));
    ch.queue_declare(DEAD_LETTER_OUTCOMES_QUEUE.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .with_context(|| format!("declaring queue {DEAD_LETTER_OUTCOMES_QUEUE}"))?;
    ch.queue_bind(DEAD_LETTER_OUTCOMES_QUEUE.into(), DEAD_LETTER_EXCHANGE.into(), "".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .context("binding the scheduler's copy of the dead letters")?;
    Ok(())
}

/// Where and why a message was last dead-lettered: the newest entry of its `x-death` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    /// The queue the message died in (`sandcell.submissions.3`, `sandcell.jobs`, …).
    pub queue: String,
    /// Why: `delivery_limit` (returned more than [`DELIVERY_LIMIT`] times), `rejected` (a
    /// consumer dead-lettered it), `expired`, `maxlen`.
    pub reason: String,
    /// The exchange the message had been published to before it died (as the entry says: one
    /// a publisher forged keeps its own, so this is no proof of anything).
    pub exchange: String,
}

impl Death {
    /// Read the headers of a dead letter. Each time the broker dead-letters a message it puts
    /// the entry of that queue and reason first in `x-death`, writing both itself, even into
    /// an `x-death` its publisher sent; the `x-first-death-*` headers it leaves as a publisher
    /// set them, so they are not read (a tenant could name `sandcell.jobs` there). A message
    /// without `x-death` was published to the dead-letter exchange directly, which only a
    /// worker may (a job it read back from Postgres and could not run), with its queue as the
    /// routing key.
    pub fn of(delivery: &lapin::message::Delivery) -> Death {
        Death::from_headers(delivery.properties.headers().as_ref(), delivery.routing_key.as_str())
    }

    fn from_headers(headers: Option<&FieldTable>, routing_key: &str) -> Death {
        let Some(x_death) = headers.and_then(|h| h.inner().get("x-death")) else {
            return Death { queue: routing_key.to_owned(), reason: "rejected".to_owned(), exchange: String::new() };
        };
        let newest = match x_death {
            AMQPValue::FieldArray(entries) => match entries.as_slice().first() {
                Some(AMQPValue::FieldTable(entry)) => Some(entry.inner()),
                _ => None,
            },
            _ => None,
        };
        let text = |key: &str| match newest.and_then(|e| e.get(key)) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
            _ => String::new(),
        };
        // Unreadable (not what the broker writes): a death in no queue of ours.
        Death { queue: text("queue"), reason: text("reason"), exchange: text("exchange") }
    }

    /// Whether it died in an intake partition (or the legacy submissions queue).
    pub fn in_intake(&self) -> bool {
        self.queue == LEGACY_SUBMISSIONS_QUEUE || self.queue.starts_with("sandcell.submissions.")
    }

    /// Whether it died in a queue of execution jobs: the shared ones or a worker's.
    pub fn in_jobs_queue(&self) -> bool {
        self.queue == JOBS_QUEUE || self.queue == NEW_SESSIONS_QUEUE || self.queue.starts_with("sandcell.worker.")
    }
}

/// A channel in confirm mode, for publishing.
pub async fn publisher_channel(conn: &Connection) -> Result<Channel> {
    let ch = conn.create_channel().await.context("opening a publisher channel")?;
    ch.confirm_select(ConfirmSelectOptions::default()).await.context("enabling publisher confirms")?;
    Ok(ch)
}

/// Properties for a persistent JSON message.
pub fn json_properties(message_id: &str) -> BasicProperties {
    BasicProperties::default().with_content_type("application/json".into()).with_delivery_mode(2).with_message_id(message_id.into())
}

/// The header of a job's message that says when the scheduler published it to the workers'
/// queues (microseconds since the Unix epoch): the worker's claim records it as the job's
/// `dispatched_at`, so that no statement of its own is spent per job on noting the dispatch.
pub const DISPATCHED_AT_HEADER: &str = "sandcell-dispatched-at-us";

/// Properties of a job's message as the scheduler publishes it to the workers' queues: a
/// persistent JSON message whose [`DISPATCHED_AT_HEADER`] is now.
pub fn dispatch_properties(message_id: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(DISPATCHED_AT_HEADER.into(), AMQPValue::LongLongInt(chrono::Utc::now().timestamp_micros()));
    json_properties(message_id).with_headers(headers)
}

/// Properties of a session job's message to its worker's own queue: as
/// [`dispatch_properties`], but transient. Such a job is recorded before it is published, with
/// its execution job kept (`jobs.routed`) and its worker named (`jobs.routed_to`), so Postgres,
/// not the broker, holds it: the worker reads the jobs routed to it whenever it (re)connects
/// (`JobStore::routed_to_worker`) and runs them before anything its queue delivers, which
/// covers the messages a broker restart drops. A persistent message cost the broker a write and
/// a sync for each job: ~0.3 ms of its CPU a job (16 sessions ran 13 % faster without it).
pub fn session_dispatch_properties(message_id: &str) -> BasicProperties {
    dispatch_properties(message_id).with_delivery_mode(1)
}

/// When the scheduler published a job's message ([`DISPATCHED_AT_HEADER`]); `None` for a message
/// without it (published by an older scheduler, or by the dispatcher, which notes the time in
/// Postgres itself).
pub fn dispatched_at(props: &BasicProperties) -> Option<chrono::DateTime<chrono::Utc>> {
    match props.headers().as_ref()?.inner().get(DISPATCHED_AT_HEADER)? {
        AMQPValue::LongLongInt(us) => chrono::DateTime::from_timestamp_micros(*us),
        _ => None,
    }
}

/// The broker returned a mandatory message: no queue of that name exists.
#[derive(Debug, thiserror::Error)]
#[error("message to {0} was unroutable (queue missing)")]
pub struct Unroutable(pub String);

/// Publish `body` to `queue` through the default exchange and wait for the broker's confirm.
/// The publish is mandatory: a message no queue accepts is an error, not a silent drop.
pub async fn publish_confirmed(ch: &Channel, queue: &str, body: &[u8], props: BasicProperties) -> Result<()> {
    publish_to(ch, "", queue, body, props).await
}

/// Publish `body` to `exchange` with `routing_key`, mandatory and confirmed.
pub async fn publish_to(ch: &Channel, exchange: &str, routing_key: &str, body: &[u8], props: BasicProperties) -> Result<()> {
    let queue = if exchange.is_empty() { routing_key } else { exchange };
    let confirm = ch
        .basic_publish(exchange.into(), routing_key.into(), BasicPublishOptions { mandatory: true, ..Default::default() }, body, props)
        .await
        .with_context(|| format!("publishing to {queue}"))?
        .await
        .with_context(|| format!("waiting for the broker to confirm a publish to {queue}"))?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => Err(Unroutable(queue.to_string()).into()),
        lapin::Confirmation::Nack(_) => Err(anyhow!("broker refused (nack) a message to {queue}")),
        lapin::Confirmation::NotRequested => Err(anyhow!("channel is not in confirm mode")),
    }
}

/// What becomes of a delivered message once its handler is done with it: handlers decide, and
/// each consumer's one settling place acts on it through [`settle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Done with: its outcome is durable, or it must not be acted on. Removed from its queue.
    Ack,
    /// Nothing durable happened and it should be handled again: returned to its queue.
    Requeue,
    /// It can never be handled (unreadable, or refused for good): parked in the dead-letter queue.
    DeadLetter,
}

impl Disposition {
    /// The label it carries in logs and in the consumers' `*_ack_failures_total{disposition}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Disposition::Ack => "ack",
            Disposition::Requeue => "requeue",
            Disposition::DeadLetter => "dead_letter",
        }
    }
}

/// Longest wait for the broker to take a settlement. An ack sent in the instant the connection
/// dies can be left unanswered for good (seen in CI: a worker's ack sent 6 ms after a broker
/// restart reset the connection never completed, and the task that sent it waited until the
/// worker stopped). Past this the settlement counts as failed, as on a closed channel.
pub const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// [`publish_to`], waiting at most [`SETTLE_WITHIN`] for the confirm: how a job held without a
/// message (a session job read back from Postgres) is settled when its handler fails, bounded
/// like [`settle`], so that a half-open connection cannot stall the session that settles it.
pub async fn publish_within_settle(ch: &Channel, exchange: &str, routing_key: &str, body: &[u8], props: BasicProperties) -> Result<()> {
    match tokio::time::timeout(SETTLE_WITHIN, publish_to(ch, exchange, routing_key, body, props)).await {
        Ok(result) => result,
        Err(_) => Err(anyhow!("publishing to {routing_key}: no confirm from the broker within {} s", SETTLE_WITHIN.as_secs())),
    }
}

/// Ack, requeue or dead-letter `delivery`, waiting at most [`SETTLE_WITHIN`]. An error means the
/// settlement did not reach the broker (its channel closed, or it went unanswered): the broker
/// still holds the message and redelivers it once the connection is gone, so a caller logs and
/// counts the error and does nothing else.
pub async fn settle(delivery: &lapin::message::Delivery, disposition: Disposition) -> Result<()> {
    use lapin::options::{BasicAckOptions, BasicNackOptions};
    let settled = async {
        match disposition {
            Disposition::Ack => delivery.ack(BasicAckOptions::default()).await,
            Disposition::Requeue => delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await,
            Disposition::DeadLetter => delivery.nack(BasicNackOptions { requeue: false, ..Default::default() }).await,
        }
    };
    match tokio::time::timeout(SETTLE_WITHIN, settled).await {
        Ok(result) => result.map(drop).with_context(|| format!("settling a message ({})", disposition.as_str())),
        Err(_) => Err(anyhow!("settling a message ({}): no answer from the broker within {} s", disposition.as_str(), SETTLE_WITHIN.as_secs())),
    }
}

#[cfg(test)]
mod tests {
    use super::Death;
    use lapin::types::{AMQPValue, FieldArray, FieldTable};

    fn entry(queue: &str, reason: &str) -> AMQPValue {
        let mut e = FieldTable::default();
        e.insert("queue".into(), AMQPValue::LongString(queue.into()));
        e.insert("reason".into(), AMQPValue::LongString(reason.into()));
        e.insert("exchange".into(), AMQPValue::LongString("sandcell.intake".into()));
        AMQPValue::FieldTable(e)
    }

    #[test]
    fn a_dead_letter_says_where_and_why_it_last_died_and_one_published_to_the_exchange_names_its_queue() {
        let mut headers = FieldTable::default();
        // The newest entry first, as the broker writes it; a forged first-death header is not read.
        let entries = FieldArray::from(vec![entry("sandcell.submissions.3", "delivery_limit"), entry("sandcell.live.acme.q", "expired")]);
        headers.insert("x-death".into(), AMQPValue::FieldArray(entries));
        headers.insert("x-first-death-queue".into(), AMQPValue::LongString("sandcell.jobs".into()));
        let death = Death::from_headers(Some(&headers), "job-1");
        assert_eq!((death.queue.as_str(), death.reason.as_str(), death.exchange.as_str()), ("sandcell.submissions.3", "delivery_limit", "sandcell.intake"));
        assert!(death.in_intake() && !death.in_jobs_queue());
        // An x-death that is not the broker's: a death in no queue of ours.
        let mut forged = FieldTable::default();
        forged.insert("x-death".into(), AMQPValue::LongString("sandcell.jobs".into()));
        let unreadable = Death::from_headers(Some(&forged), "sandcell.jobs");
        assert!(!unreadable.in_intake() && !unreadable.in_jobs_queue(), "{unreadable:?}");
        let direct = Death::from_headers(None, "sandcell.worker.w1");
        assert_eq!((direct.queue.as_str(), direct.reason.as_str()), ("sandcell.worker.w1", "rejected"));
        assert!(direct.in_jobs_queue() && !direct.in_intake());
        for queue in [super::JOBS_QUEUE, super::NEW_SESSIONS_QUEUE] {
            assert!(Death::from_headers(None, queue).in_jobs_queue(), "{queue}");
        }
        // A tenant's own queue is neither.
        let theirs = Death::from_headers(None, "sandcell.live.acme.q");
        assert!(!theirs.in_intake() && !theirs.in_jobs_queue());
    }

    #[test]
    fn a_tenants_queue_namespace_is_its_own() {
        let (configure, write, read) = super::tenant_permissions("acme");
        assert_eq!(configure, "^(sandcell\\.live\\.acme\\..*)$");
        assert!(write.starts_with("^(sandcell\\.intake|") && read.starts_with("^(sandcell\\.events|"));
        assert_eq!(super::tenant_queue_prefix("acme"), "sandcell.live.acme.");
        assert_eq!(super::live_queue_tenant("sandcell.live.acme.q.1"), Some("acme"));
        assert_eq!(super::live_queue_tenant("sandcell.live.acme"), None);
        assert_eq!(super::live_queue_tenant("sandcell.live..q"), None);
        assert_eq!(super::live_queue_tenant("sandcell.gateway.abc"), None);
    }

    #[test]
    fn a_tenants_topic_permission_matches_only_its_own_routing_keys() {
        let (_, write, read) = super::tenant_topic_permission("acme");
        assert_eq!(write, "^$");
        assert_eq!(read, "^acme\\.");
        // As RabbitMQ applies it: a regex search of the binding key.
        let starts = |key: &str| key.starts_with("acme.");
        assert!(starts(&sandcell_protocol::event::routing_key("acme", "j1")));
        assert!(!starts(&sandcell_protocol::event::routing_key("acme-2", "j1")));
        assert!(!starts("#"));
    }

    #[test]
    fn a_dispatched_jobs_message_says_when_it_was_published_and_a_message_without_it_says_nothing() {
        let before = chrono::Utc::now();
        let props = super::dispatch_properties("t/j");
        let at = super::dispatched_at(&props).expect("the dispatch time");
        assert!(before <= at && at <= chrono::Utc::now(), "{at} not between {before} and now");
        assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("t/j"));
        assert_eq!(super::dispatched_at(&super::json_properties("t/j")), None);
    }

    #[test]
    fn a_session_jobs_message_is_transient_and_every_other_jobs_message_persistent() {
        let session = super::session_dispatch_properties("t/j");
        assert_eq!(*session.delivery_mode(), Some(1));
        assert!(super::dispatched_at(&session).is_some());
        assert_eq!(*super::dispatch_properties("t/j").delivery_mode(), Some(2));
        assert_eq!(*super::json_properties("t/j").delivery_mode(), Some(2));
    }

    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(super::redact("amqp://sandcell:s3cret@127.0.0.1:5672/%2f"), "amqp://sandcell:***@127.0.0.1:5672/%2f");
        assert_eq!(super::redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
    }
}
