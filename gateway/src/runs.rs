//! The gateway as a client of sandcell, and nothing more: every request it serves becomes a
//! submission published to the intake (as a trusted publisher naming the key's tenant), its
//! live output followed on `sandcell.events`, and its result read from Postgres. No side path
//! into workers.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_client::Client;
use sandcell_protocol::event::EventBody;
use sandcell_protocol::{JobResult, Session, Submission};
use tokio::sync::RwLock;

use crate::body::BodyTx;
use crate::live::Live;

/// Submits and waits; reconnects to the broker and database when a submission fails.
pub struct Runs {
    client: RwLock<Arc<Client>>,
    amqp_url: String,
    database_url: String,
    live: Live,
    poll: Duration,
}

/// How often a streamed run writes a keep-alive line while it is silent: writing is how a
/// client that went away is noticed (the connection refuses the write).
pub const KEEPALIVE: Duration = Duration::from_secs(1);

/// Drive `run` (a job of `sub`'s session, streaming into `tx`) to its end, writing `keepalive`
/// every [`KEEPALIVE`]; when the client goes away meanwhile (or stops reading: its response is
/// abandoned, [`crate::body`]), cancel the job once (its cell is interrupted, the session keeps
/// its state) and go on waiting for its result.
pub async fn follow<T>(gw: &crate::Gateway, sub: &Submission, run: impl std::future::Future<Output = T>, tx: &BodyTx, keepalive: bytes::Bytes) -> T {
    tokio::pin!(run);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let mut gone = false;
    loop {
        tokio::select! {
            out = &mut run => return out,
            _ = tick.tick(), if !gone => {
                // Checked here too, so a run that goes on is cancelled once its client stalls.
                if !tx.check_stall() {
                    tx.send_control(keepalive.clone());
                }
            }
            () = tx.closed(), if !gone => {
                gone = true;
                let session = sub.session.as_ref().and_then(|s| s.id.as_deref()).unwrap_or_default();
                tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, session_id = session, "the client went away mid-run: cancelling the job");
                gw.metrics.client_gone.inc();
                if let Err(e) = gw.runs.cancel(&sub.tenant, &sub.job_id, session).await {
                    tracing::warn!(error = format!("{e:#}"), job_id = %sub.job_id, "cancelling a job whose client went away failed; it runs to its time limit");
                }
            }
        }
    }
}

/// A fresh job id for a gateway request (unique per tenant, the idempotency key).
pub fn job_id() -> String {
    format!("gw-{}", uuid::Uuid::new_v4().simple())
}

impl Runs {
    /// Connect (retrying until the broker and the database answer).
    pub async fn connect(amqp_url: &str, database_url: &str, poll: Duration) -> Result<Self> {
        let client = sandcell_core::retry_forever("connecting to sandcell (broker, database)", |_| async {
            Client::connect(amqp_url, database_url).await.map_err(anyhow::Error::from)
        })
        .await;
        Ok(Runs {
            client: RwLock::new(Arc::new(client)),
            amqp_url: amqp_url.to_string(),
            database_url: database_url.to_string(),
            live: Live::start(amqp_url.to_string()),
            poll,
        })
    }

    async fn client(&self) -> Arc<Client> {
        self.client.read().await.clone()
    }

    /// Publish `sub` (without waiting for it to run); on a failure, connect again once and publish again (the job id makes a
    /// second copy harmless).
    pub async fn submit(&self, sub: &Submission) -> Result<()> {
        let first = self.client().await.submit(sub).await;
        let Err(e) = first else { return Ok(()) };
        tracing::warn!(error = format!("{e:#}"), job_id = sub.job_id, "submitting failed; reconnecting to sandcell and trying again");
        let fresh = Arc::new(Client::connect(&self.amqp_url, &self.database_url).await.context("reconnecting to sandcell")?);
        *self.client.write().await = fresh.clone();
        fresh.submit(sub).await.with_context(|| format!("submitting job {}", sub.job_id))
    }

    /// Submit `sub` and wait (at most `wait`) for its terminal result, handing each live event
    /// to `on_event` as it arrives. The result row is the record: events only add speed.
    pub async fn run(&self, sub: &Submission, wait: Duration, mut on_event: impl FnMut(EventBody)) -> Result<JobResult> {
        let mut sub_events = self.live.subscribe(&sub.tenant, &sub.job_id).await;
        self.submit(sub).await?;
        let deadline = tokio::time::Instant::now() + wait;
        let mut live = true;
        // Events are forwarded while they come without a gap; after one (an event dropped by the
        // worker or the broker), only `end` is awaited and the caller completes from the result.
        let (mut next_seq, mut contiguous) = (0u64, true);
        loop {
            let check = tokio::select! {
                event = sub_events.events.recv(), if live => match event {
                    Some(e) => match e.body {
                        EventBody::End { .. } => true,
                        body => {
                            contiguous &= e.attempt <= 1 && e.seq == next_seq;
                            next_seq = e.seq + 1;
                            if contiguous {
                                on_event(body);
                            }
                            false
                        }
                    },
                    None => { live = false; true }
                },
                _ = tokio::time::sleep(self.poll) => true,
            };
            if check {
                if let Some(r) = self.result(&sub.tenant, &sub.job_id).await? {
                    if r.status.is_terminal() {
                        return Ok(r);
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                // Given up on: it must not run on for nobody, holding its session.
                if let Some(session) = sub.session.as_ref().and_then(|s| s.id.as_deref()) {
                    if let Err(e) = self.cancel(&sub.tenant, &sub.job_id, session).await {
                        tracing::warn!(error = format!("{e:#}"), job_id = %sub.job_id, "cancelling a run given up on failed");
                    }
                }
                anyhow::bail!("job {} had no result within {wait:?}", sub.job_id);
            }
        }
    }

    /// Ask sandcell to stop a job of a session (the client went away mid-run).
    pub async fn cancel(&self, tenant: &str, job_id: &str, session_id: &str) -> Result<()> {
        Ok(self.client().await.cancel(tenant, job_id, session_id).await?)
    }

    /// A job's result record, if recorded.
    pub async fn result(&self, tenant: &str, job_id: &str) -> Result<Option<JobResult>> {
        Ok(self.client().await.result(tenant, job_id).await?)
    }

    /// A session of `tenant`, if it has that session.
    pub async fn session(&self, tenant: &str, id: &str) -> Result<Option<Session>> {
        Ok(self.client().await.session(tenant, id).await?)
    }
}
