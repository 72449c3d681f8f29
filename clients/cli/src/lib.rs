//! The sandcell client: publish submissions to RabbitMQ, read results from Postgres.
//!
//! This is the flow the design prescribes for asynchronous agents: submit through the queue
//! (with publisher confirms, so a returned `Ok` means the broker has the job), then poll the
//! `job_results` view — or, as [`Client::wait`] does, `LISTEN` on the tenant's own
//! notification channel: a job's final notification carries its result record when it fits
//! ([`JobNotification`]), else the result is read when it arrives, with a periodic re-read in
//! case a notification was lost while the listener reconnected.
//!
//! A tenant connects with its own broker user and database role (`sandcell-admin tenant
//! create`): submissions carry `user_id` = the broker user, which RabbitMQ verifies, and
//! row-level security shows the role only its own rows. An operator's trusted backend may
//! connect as the service user and name any tenant.
#![warn(missing_docs)]

use std::time::Duration;

use anyhow::Context;
use lapin::Channel;
use sandcell_core::{broker, reads};
pub use sandcell_protocol::JobNotification;
use sandcell_protocol::{ArtifactState, JobResult, Session, Submission};
use sqlx::postgres::{PgListener, PgPool};

/// What can go wrong for a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No job with that id for that tenant.
    #[error("no job {job_id:?} for tenant {tenant:?}")]
    NotFound {
        /// Tenant.
        tenant: String,
        /// Job id.
        job_id: String,
    },
    /// The job has no artifact at that path.
    #[error("job has no artifact {0:?}")]
    NoSuchArtifact(String),
    /// The artifact's TTL passed and it was deleted.
    #[error("artifact_expired: {0:?} has expired and was deleted")]
    ArtifactExpired(String),
    /// The job did not finish in time.
    #[error("job did not finish within {0:?}; last status {1}")]
    Timeout(Duration, String),
    /// Anything else (connection, broker, database).
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A connected client.
pub struct Client {
    conn: lapin::Connection,
    publisher: Channel,
    db: PgPool,
    database_url: String,
    /// The broker user, sent as `user_id` on every submission.
    user: Option<String>,
    /// The listeners [`Client::wait`] shares, by tenant, connected on a first wait for that
    /// tenant: a listener of its own per call cost every wait a database connection (a login, a
    /// backend process) even for a job that had finished. At most [`MAX_SHARED_WATCHERS`].
    watchers: tokio::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<Watcher>>>,
    /// A lock per tenant whose listener is being connected, held through the login (the map's
    /// lock is not): one login per tenant at a time, and none of them in another tenant's way.
    connecting: tokio::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
}

/// The most tenants whose listeners a [`Client`] keeps for [`Client::wait`] (a trusted backend
/// waits for many): past it, one no wait is using is closed for the new one, and if every one
/// is in use the new one serves its wait only.
pub const MAX_SHARED_WATCHERS: usize = 8;

impl Client {
    /// Connect to the broker and the database.
    pub async fn connect(amqp_url: &str, database_url: &str) -> Result<Self, ClientError> {
        // No topology declaration: a tenant's user may not configure anything; the scheduler
        // declares the intake exchange.
        let conn = broker::connect(amqp_url, "sandcell-client").await?;
        let publisher = broker::publisher_channel(&conn).await?;
        let pool = sandcell_core::pool::options(4).connect(database_url).await.with_context(|| format!("connecting to {}", broker::redact(database_url)))?;
        Ok(Client {
            conn,
            publisher,
            db: pool,
            database_url: database_url.to_string(),
            user: broker::url_user(amqp_url),
            watchers: Default::default(),
            connecting: Default::default(),
        })
    }

    /// Connect using `SANDCELL_AMQP_URL` and `SANDCELL_DATABASE_URL`.
    pub async fn from_env() -> Result<Self, ClientError> {
        let amqp = sandcell_core::config::var_required("SANDCELL_AMQP_URL")?;
        let db = sandcell_core::config::var_required("SANDCELL_DATABASE_URL")?;
        Client::connect(&amqp, &db).await
    }

    /// Publish a submission; returns once the broker confirmed it.
    pub async fn submit(&self, sub: &Submission) -> Result<(), ClientError> {
        let body = serde_json::to_vec(sub).context("serializing submission")?;
        self.publish(&body, Some(&sub.job_id), self.user.as_deref(), broker::intake_routing_key(sub)).await
    }

    /// Ask sandcell to stop `tenant`'s job `job_id` in session `session_id` (the session's id is
    /// the routing key, so the request follows the job's submission through the intake). The
    /// job ends `cancelled` if it was running or next to run; otherwise nothing happens.
    pub async fn cancel(&self, tenant: &str, job_id: &str, session_id: &str) -> Result<(), ClientError> {
        use sandcell_protocol::cancel::{CancelRequest, CANCEL_MESSAGE_TYPE};
        let body = serde_json::to_vec(&CancelRequest { tenant: tenant.into(), job_id: job_id.into() }).context("serializing a cancel request")?;
        let mut props = broker::json_properties(job_id).with_type(CANCEL_MESSAGE_TYPE.into());
        if let Some(user) = &self.user {
            props = props.with_user_id(user.as_str().into());
        }
        broker::publish_to(&self.publisher, broker::INTAKE_EXCHANGE, session_id, &body, props).await?;
        Ok(())
    }

    /// Ask for presigned PUT URLs for large input files (`docs/protocol.md` §1a); returns once
    /// the broker confirmed the request. The answer is read with [`Client::upload_grant`].
    pub async fn request_upload(&self, req: &sandcell_protocol::upload::UploadRequest) -> Result<(), ClientError> {
        use sandcell_protocol::upload::UPLOAD_MESSAGE_TYPE;
        let body = serde_json::to_vec(req).context("serializing an upload request")?;
        let mut props = broker::json_properties(&req.upload_id).with_type(UPLOAD_MESSAGE_TYPE.into());
        if let Some(user) = &self.user {
            props = props.with_user_id(user.as_str().into());
        }
        broker::publish_to(&self.publisher, broker::INTAKE_EXCHANGE, &req.upload_id, &body, props).await?;
        Ok(())
    }

    /// The scheduler's answer to an upload request, once there is one.
    pub async fn upload_grant(&self, tenant: &str, upload_id: &str) -> Result<Option<sandcell_protocol::upload::UploadGrant>, ClientError> {
        Ok(reads::upload_grant(&self.db, tenant, upload_id).await?)
    }

    /// Publish raw bytes as a submission (for testing how sandcell treats bad input).
    pub async fn submit_raw(&self, body: &[u8], message_id: Option<&str>) -> Result<(), ClientError> {
        self.submit_raw_as(body, message_id, self.user.as_deref()).await
    }

    /// Publish raw bytes with the given `user_id` property (`None`: without one). The broker
    /// refuses a `user_id` other than the connection's user by closing the channel.
    pub async fn submit_raw_as(&self, body: &[u8], message_id: Option<&str>, user_id: Option<&str>) -> Result<(), ClientError> {
        self.publish(body, message_id, user_id, "").await
    }

    /// Publish to the intake with `routing_key`: the session's id for a job in a session, so the
    /// session's submissions share an intake partition and keep their order (see
    /// `docs/protocol.md`).
    async fn publish(&self, body: &[u8], message_id: Option<&str>, user_id: Option<&str>, routing_key: &str) -> Result<(), ClientError> {
        let mut props = match message_id {
            Some(id) => broker::json_properties(id),
            None => lapin::BasicProperties::default().with_delivery_mode(2),
        };
        if let Some(user) = user_id {
            props = props.with_user_id(user.into());
        }
        broker::publish_to(&self.publisher, broker::INTAKE_EXCHANGE, routing_key, body, props).await?;
        Ok(())
    }

    /// The tenant's notification channel, waiting up to `timeout` for the tenant to be
    /// registered (a tenant submitting for the first time through a trusted backend).
    async fn channel_of(&self, tenant: &str, timeout: Duration) -> Result<Option<String>, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(c) = reads::notify_channel(&self.db, tenant).await? {
                return Ok(Some(c));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The job's current result record, if the job exists.
    pub async fn result(&self, tenant: &str, job_id: &str) -> Result<Option<JobResult>, ClientError> {
        Ok(reads::result(&self.db, tenant, job_id).await?)
    }

    /// Wait until the job reaches a terminal status and return its result.
    ///
    /// Woken by the job's final notification on the tenant's channel, through a listener this
    /// client shares between its waits for that tenant ([`Watcher`]), and re-reading the row
    /// every second regardless (a notification sent while the listener reconnected is lost).
    /// The final notification carries the result when it fits: then there is nothing to read.
    pub async fn wait(&self, tenant: &str, job_id: &str, timeout: Duration) -> Result<JobResult, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = "not recorded yet".to_string();
        let mut watcher: Option<std::sync::Arc<Watcher>> = None;
        loop {
            if watcher.as_ref().is_some_and(|w| !w.is_listening()) {
                watcher = None;
            }
            // Watched before the read: a final notification sent after it is not missed.
            let notified = watcher.as_ref().map(|w| w.watch_until_dropped(tenant, job_id));
            if let Some(r) = self.result(tenant, job_id).await? {
                if r.status.is_terminal() {
                    return Ok(r);
                }
                last = r.status.to_string();
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(ClientError::Timeout(timeout, last));
            }
            let wake = (deadline - now).min(Duration::from_secs(1));
            let Some(mut notified) = notified else {
                // Not listening yet: a tenant registered meanwhile is listened for, and the row
                // read again (the job may have finished before the listener was there). Within
                // the wait's deadline: a login the database is slow to accept does not outlast it.
                watcher = tokio::time::timeout_at(deadline, self.shared_watcher(tenant, wake)).await.unwrap_or(Ok(None))?;
                continue;
            };
            if let Ok(Ok(n)) = tokio::time::timeout(wake, &mut notified.rx).await {
                if let Some(r) = n.result.filter(|r| r.status.is_terminal()) {
                    return Ok(r);
                }
            }
        }
    }

    /// How many listeners [`Client::wait`] shares, and how many jobs they watch (for tests of
    /// what waits leave behind).
    #[doc(hidden)]
    pub async fn shared_watches(&self) -> (usize, usize) {
        let watchers = self.watchers.lock().await;
        (watchers.len(), watchers.values().map(|w| w.watched()).sum())
    }

    /// The listener [`Client::wait`] shares for `tenant`, connecting one if there is none
    /// listening, once the tenant is registered (waiting up to `registered_within` for it);
    /// `None` if it is not.
    async fn shared_watcher(&self, tenant: &str, registered_within: Duration) -> Result<Option<std::sync::Arc<Watcher>>, ClientError> {
        // The tenant's listener in `watchers`, if it still listens.
        let listening = |watchers: &std::collections::HashMap<String, std::sync::Arc<Watcher>>| watchers.get(tenant).filter(|w| w.is_listening()).cloned();
        if let Some(w) = listening(&*self.watchers.lock().await) {
            return Ok(Some(w));
        }
        let Some(channel) = self.channel_of(tenant, registered_within).await? else { return Ok(None) };
        // One login at a time per tenant, under the tenant's own lock, not the map's: other
        // tenants' waits do not wait for this login (nor for a database slow to accept one),
        // and the first waits of one tenant do not each connect a listener.
        let connecting = self.connecting.lock().await.entry(tenant.to_string()).or_default().clone();
        let connected = {
            let _one_login = connecting.lock().await;
            let meanwhile = listening(&*self.watchers.lock().await); // the map's lock ends here
            match meanwhile {
                Some(w) => Ok(Some(w)), // another wait connected it meanwhile
                None => self.connect_watcher(tenant, &channel).await,
            }
        };
        let mut locks = self.connecting.lock().await;
        if locks.get(tenant).is_some_and(|l| std::sync::Arc::ptr_eq(l, &connecting)) {
            locks.remove(tenant);
        }
        connected
    }

    /// Connect a listener on `channel` for `tenant`'s waits and keep it among those shared.
    async fn connect_watcher(&self, tenant: &str, channel: &str) -> Result<Option<std::sync::Arc<Watcher>>, ClientError> {
        let w = std::sync::Arc::new(Watcher::listen(&self.database_url, channel).await?);
        let mut watchers = self.watchers.lock().await;
        watchers.retain(|_, w| w.is_listening());
        if watchers.len() >= MAX_SHARED_WATCHERS {
            // Close one no wait is using (its only holder is this map), if there is one.
            let idle = watchers.iter().find(|(_, w)| std::sync::Arc::strong_count(w) == 1).map(|(t, _)| t.clone());
            match idle {
                Some(t) => {
                    watchers.remove(&t);
                }
                None => return Ok(Some(w)),
            }
        }
        watchers.insert(tenant.to_string(), w.clone());
        Ok(Some(w))
    }

    /// Subscribe to the live output of `tenant`'s job `job_id` — or, with `job_id` `None`, of
    /// all its jobs — *before* submitting it: events published earlier are not kept for anyone.
    /// The queue is `sandcell.live.<tenant>.<uuid>`, exclusive and gone with the subscription;
    /// the broker lets a tenant's user bind only its own tenant's routing keys.
    pub async fn live(&self, tenant: &str, job_id: Option<&str>) -> Result<LiveOutput, ClientError> {
        use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        let ch = self.conn.create_channel().await.context("opening a channel for live output")?;
        // In the tenant's own queue namespace, the only one its broker user may declare in.
        let name = format!("{}{}", broker::tenant_queue_prefix(tenant), uuid::Uuid::new_v4().simple());
        let queue = ch
            .queue_declare(name.as_str().into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
            .await
            .context("declaring a queue for live output")?;
        let key = match job_id {
            Some(job_id) => sandcell_protocol::event::routing_key(tenant, job_id),
            None => format!("{tenant}.#"),
        };
        ch.queue_bind(queue.name().clone(), broker::EVENTS_EXCHANGE.into(), key.as_str().into(), QueueBindOptions::default(), FieldTable::default())
            .await
            .with_context(|| format!("binding {key} on {} (may this user read that tenant's events?)", broker::EVENTS_EXCHANGE))?;
        let consumer = ch
            .basic_consume(queue.name().clone(), "".into(), BasicConsumeOptions { no_ack: true, exclusive: true, ..Default::default() }, FieldTable::default())
            .await
            .context("consuming live output")?;
        Ok(LiveOutput { _channel: ch, consumer })
    }

    /// The database URL this client reads from.
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// A session's current state, if the tenant has that session.
    pub async fn session(&self, tenant: &str, session_id: &str) -> Result<Option<Session>, ClientError> {
        Ok(reads::session(&self.db, tenant, session_id).await?)
    }

    /// The download URL of one artifact, or [`ClientError::ArtifactExpired`] once it expired.
    pub async fn artifact_url(&self, tenant: &str, job_id: &str, path: &str) -> Result<String, ClientError> {
        let r = self.result(tenant, job_id).await?.ok_or_else(|| ClientError::NotFound { tenant: tenant.into(), job_id: job_id.into() })?;
        let a = r.artifacts.into_iter().find(|a| a.path == path).ok_or_else(|| ClientError::NoSuchArtifact(path.into()))?;
        match (a.state, a.download_url) {
            (ArtifactState::Available, Some(url)) if a.expires_at > chrono::Utc::now() => Ok(url),
            _ => Err(ClientError::ArtifactExpired(path.into())),
        }
    }
}

/// A subscription to live output ([`Client::live`]); dropping it ends the subscription.
pub struct LiveOutput {
    _channel: Channel,
    consumer: lapin::Consumer,
}

impl LiveOutput {
    /// The next event, in the order the worker published it; `None` when the subscription
    /// ended (its channel or connection closed). A message that is not an event is skipped.
    pub async fn next(&mut self) -> Option<sandcell_protocol::JobEvent> {
        use futures::StreamExt;
        loop {
            let delivery = self.consumer.next().await?.ok()?;
            match serde_json::from_slice(&delivery.data) {
                Ok(event) => return Some(event),
                Err(e) => tracing::warn!(error = %e, "a live output message is not an event; skipped"),
            }
        }
    }
}

/// Jobs being waited for, by `(tenant, job_id)`, with where to send their final notification.
/// Several may wait for one job (two [`Client::wait`] calls): each is told.
type Waiting = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<(String, String), Vec<tokio::sync::oneshot::Sender<JobNotification>>>>>;

/// Waits for many jobs over one `LISTEN` connection: register a job with [`Watcher::watch`]
/// *before* submitting it, then await the returned receiver; it resolves with the job's final
/// notification, which carries the result record when it fit ([`JobNotification::result`];
/// read it with [`Client::result`] otherwise). For pipelining agents and benchmarks, which
/// register their jobs before they submit them; [`Client::wait`] shares one of its own per
/// tenant.
pub struct Watcher {
    waiting: Waiting,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    /// Connect a listener for `tenant`'s jobs (the tenant must be registered).
    pub async fn connect(client: &Client, tenant: &str) -> Result<Self, ClientError> {
        let channel =
            client.channel_of(tenant, Duration::ZERO).await?.ok_or_else(|| anyhow::anyhow!("tenant {tenant:?} is not registered (no notification channel)"))?;
        Watcher::listen(&client.database_url, &channel).await
    }

    /// Connect a listener to `database_url` and `LISTEN` on `channel`.
    async fn listen(database_url: &str, channel: &str) -> Result<Self, ClientError> {
        let mut listener = PgListener::connect(database_url).await.context("connecting listener")?;
        listener.listen(channel).await.context("LISTEN on the tenant's channel")?;
        let waiting: Waiting = Default::default();
        let map = waiting.clone();
        let task = tokio::spawn(async move {
            while let Ok(n) = listener.recv().await {
                let n = match JobNotification::parse(n.payload()) {
                    Ok(Some(n)) if n.status.is_terminal() => n,
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "a notification on the tenant's channel is not one this client can read; skipped");
                        continue;
                    }
                };
                for tx in map.lock().ok().and_then(|mut m| m.remove(&(n.tenant.clone(), n.job_id.clone()))).unwrap_or_default() {
                    let _ = tx.send(n.clone());
                }
            }
            // The listener could not reconnect: whoever waits re-reads the row on its own.
            tracing::warn!("the listener on the tenant's channel ended");
        });
        Ok(Watcher { waiting, task })
    }

    /// Be told when `(tenant, job_id)` reaches a terminal status (its final notification).
    /// Until then the watch is kept, whether or not its receiver is: for a job that may never
    /// end, [`Client::wait`] is the way.
    pub fn watch(&self, tenant: &str, job_id: &str) -> tokio::sync::oneshot::Receiver<JobNotification> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Ok(mut m) = self.waiting.lock() {
            m.entry((tenant.to_string(), job_id.to_string())).or_default().push(tx);
        }
        rx
    }

    /// [`Watcher::watch`], forgotten when the returned watch is dropped.
    fn watch_until_dropped(&self, tenant: &str, job_id: &str) -> Watch {
        Watch { rx: self.watch(tenant, job_id), key: (tenant.to_string(), job_id.to_string()), waiting: self.waiting.clone() }
    }

    /// Whether the listener still runs (it ends when it cannot reconnect).
    pub fn is_listening(&self) -> bool {
        !self.task.is_finished()
    }

    /// How many jobs are being watched (for tests of what a wait leaves behind).
    #[doc(hidden)]
    pub fn watched(&self) -> usize {
        self.waiting.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// A watch that is forgotten when dropped ([`Watcher::watch_until_dropped`]): a wait that
/// timed out or was given up leaves nothing in the watcher it shares.
struct Watch {
    rx: tokio::sync::oneshot::Receiver<JobNotification>,
    key: (String, String),
    waiting: Waiting,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(mut m) = self.waiting.lock() {
            if let Some(senders) = m.get_mut(&self.key) {
                senders.retain(|tx| !tx.is_closed());
                if senders.is_empty() {
                    m.remove(&self.key);
                }
            }
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}
