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
//!
//! A message that names no job (not JSON, no usable ids, no `user_id`) is recorded for
//! operators in `intake_rejections` and dead-lettered: a writer of its own records those
//! ([`IntakeRejections`]), for the same reason.

use anyhow::Result;
use prometheus::Histogram;
use sandcell_core::jobs::{IntakeRejection, JobStore};
use sandcell_protocol::Reason;

use crate::batches::Batcher;

/// The most refusals one transaction writes.
pub const MAX_BATCH: usize = 256;

/// The writer's handle, cheap to clone.
#[derive(Clone)]
pub struct Refusals {
    writer: Batcher<(String, String, Reason), bool>,
}

impl Refusals {
    /// Start the writer on `jobs` (a task that ends once every handle is dropped).
    pub fn start(jobs: JobStore, batch_size: Histogram) -> Refusals {
        let writer = Batcher::start("refusals", MAX_BATCH, batch_size, move |refusals: Vec<(String, String, Reason)>| {
            let jobs = jobs.clone();
            async move { crate::batches::once_more_if_deadlocked(|| jobs.record_refusals(&refusals)).await }
        });
        Refusals { writer }
    }

    /// Record `tenant`'s job `job_id` as refused for `reason`, with the batch it lands in:
    /// whether its row was written (`false`: the job id was taken), or why the batch failed.
    pub async fn record(&self, tenant: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        self.writer.write((tenant.to_owned(), job_id.to_owned(), reason.clone())).await
    }
}

/// The writer of the messages the intake cannot attribute to a job: those waiting when it is
/// free, up to [`MAX_BATCH`], recorded in one transaction ([`JobStore::record_intake_rejections`]).
///
/// Why: recorded one statement each, 4 at a time through their publisher's gate, 3,000 such
/// messages of a tenant held another tenant's job published behind them 3.2-4.0 s (0.44-1.02 s
/// in batches; release, back to back).
#[derive(Clone)]
pub struct IntakeRejections {
    writer: Batcher<IntakeRejection, ()>,
}

impl IntakeRejections {
    /// Start the writer on `jobs` (a task that ends once every handle is dropped).
    pub fn start(jobs: JobStore, batch_size: Histogram) -> IntakeRejections {
        let writer = Batcher::start("intake rejections", MAX_BATCH, batch_size, move |rejections: Vec<IntakeRejection>| {
            let jobs = jobs.clone();
            async move {
                let n = rejections.len();
                crate::batches::once_more_if_deadlocked(|| jobs.record_intake_rejections(&rejections)).await?;
                Ok(vec![(); n])
            }
        });
        IntakeRejections { writer }
    }

    /// Record `rejection` with the batch it lands in, or say why the batch failed.
    pub async fn record(&self, rejection: IntakeRejection) -> Result<()> {
        self.writer.write(rejection).await
    }
}
