//! Refusals the intake makes without judging a submission under its tenant's lock, recorded
//! in batches: an invalid submission whose job id is known, and a tenant's submission refused
//! from its remembered quota refusal ([`crate::quota_memory`]).
//!
//! Why: a refusal written on its own is a transaction, a commit and a notification (~3 ms of
//! Postgres at four at a time on the local stack), so a tenant flooding past its quota, or
//! flooding invalid submissions, was refused a few hundred a second while every other tenant's
//! submission waited behind its flood in the intake's partitions. One task writes whatever
//! refusals are waiting when it is free, up to [`MAX_BATCH`], as one statement and one commit
//! ([`JobStore::record_refusals`]): the more are waiting, the larger the batch.

use anyhow::{anyhow, Result};
use prometheus::Histogram;
use sandcell_core::jobs::JobStore;
use sandcell_protocol::Reason;
use tokio::sync::{mpsc, oneshot};

/// The most refusals one transaction writes.
pub const MAX_BATCH: usize = 256;

/// A refusal waiting to be written, and where to say whether its row was.
struct Waiting {
    refusal: (String, String, Reason),
    written: oneshot::Sender<Result<bool, String>>,
}

/// The writer's handle, cheap to clone.
#[derive(Clone)]
pub struct Refusals {
    waiting: mpsc::Sender<Waiting>,
}

impl Refusals {
    /// Start the writer on `jobs` (a task that ends once every handle is dropped).
    pub fn start(jobs: JobStore, batch_size: Histogram) -> Refusals {
        let (waiting, rx) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(write(jobs, batch_size, rx));
        Refusals { waiting }
    }

    /// Record `tenant`'s job `job_id` as refused for `reason`, with the batch it lands in:
    /// whether its row was written (`false`: the job id was taken), or why the batch failed.
    pub async fn record(&self, tenant: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        let (written, answer) = oneshot::channel();
        let refusal = (tenant.to_owned(), job_id.to_owned(), reason.clone());
        self.waiting.send(Waiting { refusal, written }).await.map_err(|_| anyhow!("the refusal writer has stopped"))?;
        match answer.await {
            Ok(Ok(written)) => Ok(written),
            Ok(Err(e)) => Err(anyhow!("recording a batch of refusals: {e}")),
            Err(_) => Err(anyhow!("the refusal writer stopped before it answered")),
        }
    }
}

/// Write what is waiting, batch after batch, until every handle is gone.
async fn write(jobs: JobStore, batch_size: Histogram, mut rx: mpsc::Receiver<Waiting>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        batch_size.observe(batch.len() as f64);
        let refusals: Vec<_> = batch.iter().map(|w| w.refusal.clone()).collect();
        let mut result = jobs.record_refusals(&refusals).await;
        if result.as_ref().is_err_and(deadlocked) {
            // Chosen by Postgres to break a cycle with another transaction (a sweep): once more.
            result = jobs.record_refusals(&refusals).await;
        }
        match result {
            Ok(written) => {
                for (w, written) in batch.drain(..).zip(written) {
                    let _ = w.written.send(Ok(written));
                }
            }
            Err(e) => {
                let e = format!("{e:#}");
                tracing::warn!(error = %e, refusals = batch.len(), "a batch of refusals could not be written; each is judged again");
                for w in batch.drain(..) {
                    let _ = w.written.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Whether Postgres ended the batch's transaction to break a deadlock or a serialization conflict.
fn deadlocked(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()).and_then(|d| d.code()).is_some_and(|code| code == "40P01" || code == "40001")
    })
}
