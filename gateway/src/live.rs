//! Live output for every run the gateway waits on, over one broker connection: one exclusive
//! queue, bound to `sandcell.events` once per tenant the gateway serves (`<tenant>.#`), whose
//! events are handed to the run waiting for that job. A run registers *before* it submits
//! (events are not kept for late subscribers); an event for a job nobody here waits on (the
//! tenant's other clients) is dropped. The broker going away loses events, never results: a
//! run also reads its result on a timer (`SANDCELL_GATEWAY_POLL_MS`), and the connection is
//! made again with every tenant bound again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use sandcell_core::broker;
use sandcell_protocol::JobEvent;
use tokio::sync::mpsc;

type Routes = Arc<Mutex<HashMap<(String, String), mpsc::UnboundedSender<JobEvent>>>>;

/// The channel and queue of the current connection, and the tenants bound (or to bind).
struct Binding {
    channel: Option<Channel>,
    queue: String,
    tenants: HashSet<String>,
}

/// The hub (cheap to clone).
#[derive(Clone)]
pub struct Live {
    routes: Routes,
    binding: Arc<tokio::sync::Mutex<Binding>>,
}

/// A run's events, until it is dropped.
pub struct Subscription {
    key: (String, String),
    routes: Routes,
    /// The job's events, in the order they arrived.
    pub events: mpsc::UnboundedReceiver<JobEvent>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Ok(mut routes) = self.routes.lock() {
            routes.remove(&self.key);
        }
    }
}

impl Live {
    /// Start the hub's connection task (it connects, and reconnects, by itself).
    pub fn start(amqp_url: String) -> Self {
        let live = Live {
            routes: Arc::default(),
            binding: Arc::new(tokio::sync::Mutex::new(Binding { channel: None, queue: String::new(), tenants: HashSet::new() })),
        };
        let hub = live.clone();
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(200);
            loop {
                match hub.serve(&amqp_url).await {
                    Ok(()) => tracing::warn!("live output consumer ended; reconnecting"),
                    Err(e) => tracing::warn!(error = format!("{e:#}"), retry_in_ms = delay.as_millis() as u64, "live output connection failed; reconnecting"),
                }
                hub.binding.lock().await.channel = None;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        });
        live
    }

    /// One connection's life: declare the queue, bind every tenant, route deliveries.
    async fn serve(&self, amqp_url: &str) -> Result<()> {
        let conn = broker::connect(amqp_url, "sandcell-gateway-live").await?;
        let ch = conn.create_channel().await.context("opening the live output channel")?;
        let name = format!("sandcell.gateway.{}", uuid::Uuid::new_v4().simple());
        ch.queue_declare(name.as_str().into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
            .await
            .context("declaring the gateway's live output queue")?;
        let mut consumer = ch
            .basic_consume(name.as_str().into(), "".into(), BasicConsumeOptions { no_ack: true, exclusive: true, ..Default::default() }, FieldTable::default())
            .await
            .context("consuming live output")?;
        {
            let mut b = self.binding.lock().await;
            for tenant in &b.tenants {
                bind(&ch, &name, tenant).await?;
            }
            b.channel = Some(ch.clone());
            b.queue = name;
        }
        tracing::info!("live output connected");
        while let Some(delivery) = consumer.next().await {
            let delivery = delivery.context("live output delivery")?;
            let event: JobEvent = match serde_json::from_slice(&delivery.data) {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "a message on sandcell.events is not an event; skipped");
                    continue;
                }
            };
            let key = (event.tenant.clone(), event.job_id.clone());
            if let Ok(routes) = self.routes.lock() {
                if let Some(tx) = routes.get(&key) {
                    let _ = tx.send(event);
                }
            }
        }
        Ok(())
    }

    /// Be handed the events of `tenant`'s job `job_id` (call before submitting it). When the
    /// broker is away the subscription still works, empty: the run reads its result instead.
    pub async fn subscribe(&self, tenant: &str, job_id: &str) -> Subscription {
        {
            let mut b = self.binding.lock().await;
            if !b.tenants.contains(tenant) {
                if let Some(ch) = b.channel.clone() {
                    // Bounded: a broker that does not answer must not hold every new run here.
                    let bound = tokio::time::timeout(BIND_WAIT, bind(&ch, &b.queue, tenant))
                        .await
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {BIND_WAIT:?}")));
                    if let Err(e) = bound {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            tenant,
                            "binding the tenant's live output failed; its runs read results only until the next connection"
                        );
                    }
                }
                b.tenants.insert(tenant.to_string());
            }
        }
        let (tx, events) = mpsc::unbounded_channel();
        let key = (tenant.to_string(), job_id.to_string());
        if let Ok(mut routes) = self.routes.lock() {
            routes.insert(key.clone(), tx);
        }
        Subscription { key, routes: self.routes.clone(), events }
    }
}

/// How long binding a tenant's events may take before its runs go without live output.
const BIND_WAIT: Duration = Duration::from_secs(5);

async fn bind(ch: &Channel, queue: &str, tenant: &str) -> Result<()> {
    let key = format!("{tenant}.#");
    ch.queue_bind(queue.into(), broker::EVENTS_EXCHANGE.into(), key.as_str().into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .with_context(|| format!("binding {key} on {}", broker::EVENTS_EXCHANGE))
}
