//! RabbitMQ: the queue topology and the two operations everything else uses — confirmed
//! publishing and consuming with manual acks.
//!
//! Topology (declared idempotently by the scheduler and workers at start-up, with identical
//! arguments):
//! - `sandcell.intake` (fanout exchange) → `sandcell.submissions` (quorum): clients publish
//!   [`Submission`](sandcell_protocol::Submission)s to the exchange, with the `user_id`
//!   property set to their broker user. A tenant's broker user may write to this exchange and
//!   nothing else, so it cannot reach the jobs or worker queues, nor read any queue;
//! - `sandcell.jobs` (quorum, delivery limit): the scheduler publishes
//!   [`ExecutionJob`](sandcell_protocol::ExecutionJob)s here, workers consume;
//! - `sandcell.worker.<id>` (classic, one per worker, declared by that worker): the scheduler
//!   routes every job of a session to the queue of the worker that holds the session;
//! - `sandcell.dlx` (fanout exchange) → `sandcell.dead` (quorum): poison messages, kept for operators.

use anyhow::{anyhow, Context, Result};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

/// Where clients publish submissions.
pub const SUBMISSIONS_QUEUE: &str = "sandcell.submissions";
/// Where the scheduler publishes execution jobs for workers.
pub const JOBS_QUEUE: &str = "sandcell.jobs";
/// Dead-letter exchange for poison messages.
pub const DEAD_LETTER_EXCHANGE: &str = "sandcell.dlx";
/// Queue collecting dead-lettered messages.
pub const DEAD_LETTER_QUEUE: &str = "sandcell.dead";
/// A message returned to a quorum queue more often than this is dead-lettered
/// (a consumer that crashes on it every time cannot loop forever).
pub const DELIVERY_LIMIT: i64 = 5;

/// How long a worker's queue survives without a consumer (its worker is gone for good).
pub const WORKER_QUEUE_EXPIRES_MS: i64 = 15 * 60 * 1000;

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

/// The exchange clients publish submissions to (a fanout bound only to [`SUBMISSIONS_QUEUE`]).
pub const INTAKE_EXCHANGE: &str = "sandcell.intake";

/// The permissions a tenant's broker user gets (configure, write, read regexes): publish to
/// [`INTAKE_EXCHANGE`], nothing else.
pub const TENANT_PERMISSIONS: (&str, &str, &str) = ("^$", "^sandcell\\.intake$", "^$");

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
    declare_quorum(ch, DEAD_LETTER_QUEUE, false).await?;
    ch.queue_bind(DEAD_LETTER_QUEUE.into(), DEAD_LETTER_EXCHANGE.into(), "".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .context("binding the dead-letter queue")?;
    declare_quorum(ch, SUBMISSIONS_QUEUE, true).await?;
    declare_quorum(ch, JOBS_QUEUE, true).await?;
    ch.exchange_declare(INTAKE_EXCHANGE.into(), ExchangeKind::Fanout, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .context("declaring the intake exchange")?;
    ch.queue_bind(SUBMISSIONS_QUEUE.into(), INTAKE_EXCHANGE.into(), "".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .context("binding the submissions queue to the intake exchange")?;
    Ok(())
}

async fn declare_quorum(ch: &Channel, name: &str, dead_letter: bool) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    if dead_letter {
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(DEAD_LETTER_EXCHANGE.into()));
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(DELIVERY_LIMIT));
    }
    ch.queue_declare(name.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .with_context(|| format!("declaring queue {name}"))?;
    Ok(())
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

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(super::redact("amqp://sandcell:s3cret@127.0.0.1:5672/%2f"), "amqp://sandcell:***@127.0.0.1:5672/%2f");
        assert_eq!(super::redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
    }
}
