//! The dead-letter recorder: the outcome of a job whose message the broker gave up on.
//!
//! A quorum queue dead-letters a message returned to it more than `DELIVERY_LIMIT` times (its
//! handler failed each time, by something other than an outage, which is waited out). Before
//! this, such a submission was never recorded (its client waited for ever) and such an
//! execution job stayed `queued` until the sweeper's `SANDCELL_STUCK_AFTER_S` (an hour).
//! Now the scheduler consumes a copy of every dead letter (`sandcell.dead.outcomes`; the
//! operators' copy stays in `sandcell.dead`) and records what became of the job:
//! - a **submission** returned to its intake partition too often (`delivery_limit`) is judged
//!   by the intake's own identity rules ([`crate::intake::decide`]): a valid one never recorded
//!   is recorded `rejected` with `too_many_attempts`; an invalid one with recoverable ids gets
//!   the rejection its first delivery should have recorded; any other is recorded in
//!   `intake_rejections`. A job recorded already is left alone: it may be waiting in a workers'
//!   queue (the intake notes no dispatch); if not, the stuck sweep ends it. One the intake
//!   itself dead-lettered (`rejected`: unattributable, and recorded then) is left alone too;
//! - an **execution job** returned too often to a shared queue, or dead-lettered by a worker (a
//!   session's job that failed even when tried again in place: its worker's queue bounds no
//!   returns), still `queued`, is ended `rejected` with `too_many_attempts`, with the session it
//!   was opening; one running or ended is left to its worker and the sweeper;
//! - an **upload request** returned to its intake partition too often is answered, unless a
//!   grant was recorded already, as its first delivery should have been when the intake refuses
//!   it, else `rejected` with `too_many_attempts` (attributed and judged by the intake's own
//!   rules, [`crate::uploads::attribute`] and [`crate::uploads::judge`]);
//! - anything else (a cancel request, an undecodable job, a message that expired or
//!   overflowed) is counted and logged.
//!
//! Where and why a message died is read from the newest entry of its `x-death` header, which
//! the broker writes itself ([`Death`]); only trusted publishers can write to the dead-letter
//! exchange, and a tenant's message dies only in the intake, where its tenant is the broker
//! user that published it. So no tenant's message can end another tenant's job.
//!
//! Invariants: recording is idempotent (a job already ended keeps its outcome), so two
//! schedulers consuming the queue, or a copy redelivered, change nothing; an outage of the
//! database is waited out, and any other failure returns the copy (dropped after
//! `DELIVERY_LIMIT` returns). Not guaranteed: that every dead letter is seen. Quorum queues
//! dead-letter at most once (a copy may be lost in a broker restart or a leader change), and
//! copies of dead letters from before the first scheduler declared `sandcell.dead.outcomes` were
//! never made; such jobs are ended by the stuck sweep (`SANDCELL_STUCK_AFTER_S`).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use sandcell_core::broker::{self, Death, Disposition};
use sandcell_core::jobs::{IntakeRejection, JobStore};
use sandcell_core::sessions::SessionStore;
use sandcell_protocol::{parse_submission, ErrorCode, ExecutionJob, IntakeLimits, Reason};

use crate::intake::{decide, outage_or_transient, Decision, Publisher};
use crate::metrics::Metrics;

/// What the recorder needs of the scheduler's settings.
#[derive(Clone)]
pub struct Rules {
    /// `SANDCELL_TRUSTED_PUBLISHERS`: who may name a submission's tenant in its body.
    pub trusted_publishers: HashSet<String>,
    /// The intake's size bounds, to judge a dead-lettered submission as the intake does.
    pub intake: IntakeLimits,
    /// `SANDCELL_MAX_UPLOAD_FILE_BYTES`: to judge a dead-lettered upload request likewise.
    pub max_upload_bytes: u64,
}

/// Every outcome label of `sandcell_dead_letters_total`.
pub const OUTCOMES: [&str; 10] = [
    "submission_rejected",
    "job_rejected",
    "upload_rejected",
    "intake_rejection",
    "left_alone",
    "recorded_at_intake",
    "request",
    "undecodable",
    "not_published_to_intake",
    "other",
];

/// Copies handled at once (they are few, and each is a statement or two).
const PREFETCH: u16 = 8;

/// Record the outcomes of dead letters for ever, reconnecting after broker failures.
pub async fn run(amqp_url: String, rules: Rules, jobs: JobStore, metrics: Metrics) {
    let sessions = SessionStore::new(jobs.pool().clone());
    loop {
        let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&amqp_url, "sandcell-scheduler-dead-letters")).await;
        if let Err(e) = consume(&conn, &rules, &jobs, &sessions, &metrics).await {
            tracing::warn!(error = format!("{e:#}"), "the dead-letter recorder's consumer ended; reconnecting");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn consume(conn: &lapin::Connection, rules: &Rules, jobs: &JobStore, sessions: &SessionStore, metrics: &Metrics) -> Result<()> {
    let ch = conn.create_channel().await.context("opening the dead-letter recorder's channel")?;
    broker::declare_topology(&ch).await?;
    broker::declare_dead_letter_outcomes(&ch).await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut deliveries = ch
        .basic_consume(
            broker::DEAD_LETTER_OUTCOMES_QUEUE.into(),
            "sandcell-scheduler-dead-letters".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("consuming {}", broker::DEAD_LETTER_OUTCOMES_QUEUE))?;
    tracing::info!(queue = broker::DEAD_LETTER_OUTCOMES_QUEUE, "dead-letter recorder consuming");
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery.context("receiving a dead letter")?;
        handle(&delivery, rules, jobs, sessions, metrics).await;
    }
    anyhow::bail!("the broker cancelled the consumer of {}", broker::DEAD_LETTER_OUTCOMES_QUEUE)
}

/// Record one dead letter's outcome and settle its copy: the one place this recorder acks or
/// returns a message.
async fn handle(delivery: &Delivery, rules: &Rules, jobs: &JobStore, sessions: &SessionStore, metrics: &Metrics) {
    let death = Death::of(delivery);
    let carried = Carried::of(delivery, &death, rules);
    let recorded =
        sandcell_core::retry_classified("recording a dead letter's outcome", 3, outage_or_transient, |_| record(&carried, &death, delivery, jobs, sessions))
            .await;
    let disposition = match recorded {
        Ok(outcome) => {
            metrics.dead_letters.with_label_values(&[outcome]).inc();
            tracing::warn!(queue = %death.queue, reason = %death.reason, outcome, carried = ?carried.key(), "dead letter recorded");
            Disposition::Ack
        }
        Err(e) => {
            tracing::error!(queue = %death.queue, reason = %death.reason, carried = ?carried.key(), error = format!("{e:#}"), "recording a dead letter's outcome failed; returning its copy");
            tokio::time::sleep(Duration::from_secs(1)).await;
            Disposition::Requeue
        }
    };
    if let Err(e) = broker::settle(delivery, disposition).await {
        metrics.ack_failures.with_label_values(&[disposition.as_str()]).inc();
        tracing::warn!(disposition = disposition.as_str(), error = format!("{e:#}"), "settling a dead letter's copy failed; the broker will redeliver it");
    }
}

/// What a dead letter carried, as far as its outcome is concerned.
#[derive(Debug)]
enum Carried {
    /// A submission, judged as the intake judges one.
    Submission(Decision),
    /// An execution job.
    Job { tenant: String, job_id: String },
    /// An upload request, attributed as the intake attributes one, with the intake's refusal
    /// of it if it has one.
    Upload { tenant: String, upload_id: String, refusal: Option<Reason> },
    /// Something recorded already, or nothing that has an outcome: counted under this label.
    Nothing(&'static str),
}

impl Carried {
    fn of(delivery: &Delivery, death: &Death, rules: &Rules) -> Carried {
        let kind = delivery.properties.kind().as_ref().map(|k| k.as_str());
        if death.in_intake() {
            if crate::cancels::is_cancel_request(kind) {
                return Carried::Nothing("request");
            }
            match death.reason.as_str() {
                // The intake dead-letters only what it could attribute to no job, having recorded it.
                "rejected" => return Carried::Nothing("recorded_at_intake"),
                // Handled and failed on every delivery. (One that expired or overflowed was never
                // handled: the intake may have dropped it on purpose.)
                "delivery_limit" => {}
                _ => return Carried::Nothing("other"),
            }
            // Only a publish to the intake is a submission or an upload request (as the intake
            // itself checks).
            if death.exchange != broker::INTAKE_EXCHANGE {
                return Carried::Nothing("not_published_to_intake");
            }
            let from = Publisher::of(delivery, &rules.trusted_publishers);
            if crate::uploads::is_upload_request(kind) {
                // Its client still waits for a grant: the one its first delivery should have
                // recorded (a refusal), or `too_many_attempts`.
                let trusted = matches!(from, Publisher::Trusted(_));
                let Some(a) = from.name().and_then(|p| crate::uploads::attribute(&delivery.data, p, trusted)) else {
                    return Carried::Nothing("request");
                };
                let refusal = crate::uploads::judge(&a, trusted, rules.max_upload_bytes).err();
                return Carried::Upload { tenant: a.tenant, upload_id: a.upload_id, refusal };
            }
            return Carried::Submission(decide(parse_submission(&delivery.data, &rules.intake), &from));
        }
        // Returned too often to a shared queue, or dead-lettered by a worker (a job of a session
        // that failed even when tried again in place).
        if death.in_jobs_queue() && matches!(death.reason.as_str(), "delivery_limit" | "rejected") {
            return match serde_json::from_slice::<ExecutionJob>(&delivery.data) {
                Ok(job) => Carried::Job { tenant: job.tenant, job_id: job.job_id },
                Err(_) => Carried::Nothing("undecodable"),
            };
        }
        Carried::Nothing("other")
    }

    /// `(tenant, job_id)` of the job it carried, for the logs.
    fn key(&self) -> Option<(&str, &str)> {
        match self {
            Carried::Submission(Decision::Accept(sub)) => Some((&sub.tenant, &sub.job_id)),
            Carried::Submission(Decision::Reject(rej)) => rej.recoverable_key(),
            Carried::Job { tenant, job_id } => Some((tenant, job_id)),
            Carried::Upload { tenant, upload_id, .. } => Some((tenant, upload_id)),
            Carried::Nothing(_) => None,
        }
    }
}

/// Why a job whose message was dead-lettered did not run.
fn undelivered(death: &Death) -> Reason {
    let why = if death.reason == "delivery_limit" {
        format!("its message was returned to {} more than {} times without being handled, and dead-lettered", death.queue, broker::DELIVERY_LIMIT)
    } else {
        format!("its worker could not handle it, even when tried again in place, and dead-lettered its message from {}", death.queue)
    };
    Reason::new(ErrorCode::TooManyAttempts, why)
}

/// Record the outcome; returns its label.
async fn record(carried: &Carried, death: &Death, delivery: &Delivery, jobs: &JobStore, sessions: &SessionStore) -> Result<&'static str> {
    match carried {
        Carried::Nothing(label) => Ok(label),
        // A job recorded before its handling failed is left alone: it may wait in a workers'
        // queue (the intake notes no dispatch), or be another submission's with the same id. If
        // it never reached a worker, the stuck sweep ends it.
        Carried::Submission(Decision::Accept(sub)) => {
            Ok(if jobs.record_rejection(&sub.tenant, &sub.job_id, &undelivered(death)).await? { "submission_rejected" } else { "left_alone" })
        }
        Carried::Submission(Decision::Reject(rej)) => match rej.recoverable_key() {
            Some((tenant, job_id)) => Ok(if jobs.record_rejection(tenant, job_id, &rej.reason).await? { "submission_rejected" } else { "left_alone" }),
            None => {
                let message_id = delivery.properties.message_id().as_ref().map(|m| m.as_str());
                let publisher = delivery.properties.user_id().as_ref().map(|u| u.as_str());
                jobs.record_intake_rejection(&IntakeRejection::new(message_id, publisher, &rej.reason, &delivery.data)).await?;
                Ok("intake_rejection")
            }
        },
        Carried::Job { tenant, job_id } => Ok(if sessions.end_undelivered(tenant, job_id, &undelivered(death)).await? { "job_rejected" } else { "left_alone" }),
        // The first answer recorded stands (a grant is recorded once): one recorded before the
        // handling failed is kept.
        Carried::Upload { tenant, upload_id, refusal } => {
            let reason = refusal.clone().unwrap_or_else(|| undelivered(death));
            let recorded = sandcell_core::uploads::record(jobs.pool(), &sandcell_protocol::upload::UploadGrant::rejected(tenant, upload_id, reason)).await?;
            Ok(if recorded.inserted { "upload_rejected" } else { "left_alone" })
        }
    }
}
