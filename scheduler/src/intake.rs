//! Intake: `sandcell.submissions` → identity → validation → quotas → Postgres → `sandcell.jobs`.
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
//!   first copy was recorded but never confirmed on the jobs queue and this delivery is a retry
//!   or a redelivery (the scheduler failed in between), in which case it is dispatched now.
//!   Should a job still be dispatched twice, workers run it once: a fresh delivery never takes
//!   over a job that is already running;
//! - jobs of one session are handled one after the other in the order their submissions
//!   arrived (a lane per session), and published to the queue of the worker holding the
//!   session, which runs them in that order; other submissions are handled concurrently;
//! - a job that opens a session goes to the shared `sandcell.jobs` queue (any worker with room);
//!   a job naming a session that is not active is `rejected` with the session's reason.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use sandcell_core::broker;
use sandcell_core::jobs::{JobSessionRecord, JobStore, Recorded};
use sandcell_core::sessions::{Route, SessionStore};
use sandcell_protocol::session::new_session_id;
use sandcell_protocol::{parse_submission, ErrorCode, ExecutionJob, JobSession, JobStatus, Reason, Rejection, Submission};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::Config;

/// What to do with a delivery once handled.
enum Disposition {
    Ack,
    DeadLetter,
}

/// Consume submissions forever, reconnecting after broker failures.
pub async fn run(cfg: Config, jobs: JobStore, metrics: Metrics, broker_up: Arc<AtomicBool>) {
    loop {
        let result = consume(&cfg, &jobs, &metrics, &broker_up).await;
        broker_up.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => tracing::warn!("submission consumer ended; reconnecting"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "submission consumer failed; reconnecting"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn consume(cfg: &Config, jobs: &JobStore, metrics: &Metrics, broker_up: &AtomicBool) -> Result<()> {
    let url = cfg.services.amqp_url.clone();
    let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&url, "sandcell-scheduler")).await;
    let consumer_ch = conn.create_channel().await.context("opening consumer channel")?;
    broker::declare_topology(&consumer_ch).await?;
    let publisher = broker::publisher_channel(&conn).await?;
    consumer_ch.basic_qos(cfg.prefetch, BasicQosOptions::default()).await.context("setting prefetch")?;
    let mut consumer = consumer_ch
        .basic_consume(broker::SUBMISSIONS_QUEUE.into(), "sandcell-scheduler".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .context("consuming submissions")?;
    broker_up.store(true, Ordering::Relaxed);
    tracing::info!(queue = broker::SUBMISSIONS_QUEUE, prefetch = cfg.prefetch, "intake consuming");

    // Deliveries are handled concurrently (up to the prefetch), each in a task of its own: a
    // reconnect of this consumer never cancels a submission half-way. Deliveries naming the same
    // session wait for the one before them (their lane).
    let mut lanes = Lanes::default();
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery.context("receiving a submission")?;
        // Judged once, here: the lane and the handler read the same verdict.
        let verdict = parse_submission(&delivery.data, &cfg.intake);
        let (before, done) = lanes.enter(session_key(&verdict));
        let (cfg, jobs, metrics, publisher) = (cfg.clone(), jobs.clone(), metrics.clone(), publisher.clone());
        tokio::spawn(async move {
            if let Some(before) = before {
                // Err only means the previous handler's task ended without signalling.
                let _ = before.await;
            }
            handle_delivery(&cfg, &jobs, &metrics, &publisher, delivery, verdict).await;
            if let Some(done) = done {
                let _ = done.send(());
            }
        });
    }
    Ok(())
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

/// `tenant/session_id` of a valid submission that names an existing session. Invalid ones are
/// only recorded, never dispatched, so they need no lane.
fn session_key(verdict: &Result<Submission, Rejection>) -> Option<String> {
    let sub = verdict.as_ref().ok()?;
    let id = sub.session.as_ref()?.id.as_ref()?;
    Some(format!("{}/{id}", sub.tenant))
}

/// How long a submission whose handling failed waits before it goes back to the queue (so that
/// an outage does not spin it through the broker).
const FAILED_REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// Handle one delivery and settle it: the one place a submission is acked, requeued or
/// dead-lettered. Infrastructure errors are retried a few times; then the message goes back to
/// the queue for a later try — a failing submission never takes the consumer or any other
/// submission down.
async fn handle_delivery(cfg: &Config, jobs: &JobStore, metrics: &Metrics, publisher: &Channel, delivery: Delivery, verdict: Result<Submission, Rejection>) {
    let started = Instant::now();
    let handled = sandcell_core::retry("handling a submission", 6, |attempt| {
        // A retry of this very delivery, or a redelivery, may finish a dispatch it began.
        let may_redispatch = delivery.redelivered || attempt > 1;
        handle(cfg, jobs, metrics, publisher, &delivery, &verdict, may_redispatch)
    })
    .await;
    let (settled, what) = match handled {
        Ok(Disposition::Ack) => (delivery.ack(BasicAckOptions::default()).await, "ack"),
        Ok(Disposition::DeadLetter) => (delivery.nack(BasicNackOptions { requeue: false, ..Default::default() }).await, "dead_letter"),
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), message_id = ?delivery.properties.message_id(), "a submission could not be handled; returning it to the queue");
            tokio::time::sleep(FAILED_REQUEUE_DELAY).await;
            (delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await, "requeue")
        }
    };
    if let Err(e) = settled {
        // The channel closed: the broker redelivers, and the redelivery finds the job recorded.
        metrics.ack_failures.with_label_values(&[what]).inc();
        tracing::warn!(disposition = what, error = %e, "settling a submission failed; the broker will redeliver it");
    }
    metrics.intake_seconds.observe(started.elapsed().as_secs_f64());
}

/// Who published a submission, as the broker vouches (`user_id` is checked by RabbitMQ against
/// the connection's user; a message without one was published by someone who did not say).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Publisher {
    /// No `user_id`: nobody to attribute the message to.
    Unknown,
    /// An operator-trusted user (`SANDCELL_TRUSTED_PUBLISHERS`): the body names the tenant.
    Trusted(String),
    /// A tenant's own user: the tenant is this name, whatever the body says.
    Tenant(String),
}

impl Publisher {
    fn of(delivery: &Delivery, trusted: &std::collections::HashSet<String>) -> Publisher {
        Publisher::from_user_id(delivery.properties.user_id().as_ref().map(|u| u.as_str()), trusted)
    }

    fn from_user_id(user_id: Option<&str>, trusted: &std::collections::HashSet<String>) -> Publisher {
        match user_id {
            None => Publisher::Unknown,
            Some(u) if trusted.contains(u) => Publisher::Trusted(u.to_owned()),
            Some(u) => Publisher::Tenant(u.to_owned()),
        }
    }

    fn name(&self) -> Option<&str> {
        match self {
            Publisher::Unknown => None,
            Publisher::Trusted(u) | Publisher::Tenant(u) => Some(u),
        }
    }
}

async fn handle(
    cfg: &Config,
    jobs: &JobStore,
    metrics: &Metrics,
    publisher: &Channel,
    delivery: &Delivery,
    verdict: &Result<Submission, Rejection>,
    may_redispatch: bool,
) -> Result<Disposition> {
    let message_id = delivery.properties.message_id().as_ref().map(|s| s.as_str().to_owned());
    let from = Publisher::of(delivery, &cfg.trusted_publishers);
    match decide(verdict.clone(), &from) {
        Decision::Accept(sub) => accept(cfg, jobs, metrics, publisher, &sub, &delivery.data, may_redispatch).await,
        Decision::Reject(rejection) => {
            if rejection.reason.code == ErrorCode::TenantMismatch {
                tracing::warn!(publisher = ?from.name(), job_id = ?rejection.job_id, "submission claims another tenant; refused");
            }
            reject(jobs, metrics, &rejection, message_id.as_deref(), from.name(), &delivery.data).await
        }
    }
}

/// What the intake does with a judged delivery, given who published it.
#[derive(Debug, PartialEq)]
enum Decision {
    /// A valid submission whose tenant is its publisher's (or named by a trusted publisher).
    Accept(Submission),
    /// Recorded as an intake rejection: under the publishing tenant whenever there is one.
    Reject(Rejection),
}

/// The identity rules: a message without `user_id` is refused; a tenant's broker user can only
/// submit as that tenant; a trusted publisher names the tenant in the body; a refusal is recorded
/// under the publishing tenant, never under the one its body claims.
fn decide(verdict: Result<Submission, Rejection>, from: &Publisher) -> Decision {
    match (verdict, from) {
        (_, Publisher::Unknown) => {
            let reason = Reason::new(ErrorCode::Unauthenticated, "the message has no user_id property: publish with user_id set to your broker user");
            Decision::Reject(Rejection { reason, tenant: None, job_id: None })
        }
        (Ok(sub), Publisher::Tenant(tenant)) if sub.tenant != *tenant => {
            let reason = Reason::new(
                ErrorCode::TenantMismatch,
                format!("the body names tenant {:?} but the message was published by broker user {tenant:?}", sub.tenant),
            );
            Decision::Reject(Rejection { reason, tenant: Some(tenant.clone()), job_id: Some(sub.job_id) })
        }
        (Ok(sub), _) => Decision::Accept(sub),
        (Err(mut rejection), _) => {
            if let Publisher::Tenant(tenant) = from {
                rejection.tenant = Some(tenant.clone());
            }
            Decision::Reject(rejection)
        }
    }
}

async fn accept(
    cfg: &Config,
    jobs: &JobStore,
    metrics: &Metrics,
    publisher: &Channel,
    sub: &Submission,
    body: &[u8],
    may_redispatch: bool,
) -> Result<Disposition> {
    let sessions = SessionStore::new(jobs.pool().clone());
    let limits = cfg.policy.resolve(&sub.resource_request());
    let digest = hex::encode(Sha256::digest(body));
    // Where the job goes: a session's owner, or any worker.
    let (mut session, queue) = match &sub.session {
        None => (None, broker::JOBS_QUEUE.to_string()),
        Some(req) if req.new => {
            let keep_alive_s = cfg.keep_alive.resolve(req.keep_alive_s);
            (Some(JobSession { id: new_session_id(), new: true, keep_alive_s, close: false }), broker::JOBS_QUEUE.to_string())
        }
        Some(req) => {
            let id = req.id.clone().unwrap_or_default();
            match sessions.route(&sub.tenant, &id).await? {
                Route::Worker(w) => (Some(JobSession { id, new: false, keep_alive_s: 0, close: req.close }), broker::worker_queue(&w)),
                Route::Refuse(reason) => return refuse(jobs, metrics, sub, &reason).await,
            }
        }
    };
    let record = session.as_ref().map(|s| if s.new { JobSessionRecord::Open(&s.id, s.keep_alive_s) } else { JobSessionRecord::Existing(&s.id) });
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
    };
    let mut payload = serde_json::to_vec(&job).context("serializing execution job")?;
    // Jobs of the shared queue are subject to their tenant's fair share.
    let shared = (queue == broker::JOBS_QUEUE).then_some(payload.as_slice());
    match jobs.record_queued(sub, &limits, &digest, record, shared).await? {
        Recorded::New => {}
        Recorded::Held => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "tenant at its jobs in flight; job held for the dispatcher");
            metrics.submissions.with_label_values(&["held"]).inc();
            return Ok(Disposition::Ack);
        }
        // Only the delivery that recorded the job (retried, or redelivered after the scheduler
        // died) finishes its dispatch; a concurrent duplicate must not dispatch it a second time.
        // A held job is the dispatcher's to publish.
        Recorded::Duplicate { status: JobStatus::Queued, dispatched: false, held: false, session_id, .. } if may_redispatch => {
            tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "job recorded earlier but never dispatched; dispatching now");
            // The session the first copy opened, not the one this copy would have.
            if let (Some(s), Some(recorded)) = (session.as_mut(), session_id) {
                s.id = recorded;
                job.session = session;
                payload = serde_json::to_vec(&job).context("serializing execution job")?;
            }
        }
        Recorded::OverQuota(reason) => return refuse(jobs, metrics, sub, &reason).await,
        Recorded::Duplicate { status, same_payload, .. } => {
            if same_payload {
                tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "duplicate submission; not run again");
            } else {
                tracing::warn!(tenant = %sub.tenant, job_id = %sub.job_id, %status, "job id reused with a different payload; the first submission stands");
            }
            metrics.submissions.with_label_values(&["duplicate"]).inc();
            return Ok(Disposition::Ack);
        }
    }
    let props = broker::json_properties(&format!("{}/{}", sub.tenant, sub.job_id));
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
    jobs.mark_dispatched(&sub.tenant, &sub.job_id).await?;
    metrics.submissions.with_label_values(&["accepted"]).inc();
    tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, language = sub.language.as_str(), queue, "job queued");
    Ok(Disposition::Ack)
}

/// Record a valid submission that cannot run because of its session.
async fn refuse(jobs: &JobStore, metrics: &Metrics, sub: &Submission, reason: &Reason) -> Result<Disposition> {
    let written = jobs.record_rejection(&sub.tenant, &sub.job_id, reason).await?;
    if !written {
        tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, "resubmission of an existing job id; the existing job is kept");
    }
    tracing::info!(tenant = %sub.tenant, job_id = %sub.job_id, code = %reason.code, "submission refused: {}", reason.message);
    metrics.submissions.with_label_values(&["rejected"]).inc();
    Ok(Disposition::Ack)
}

async fn reject(jobs: &JobStore, metrics: &Metrics, rej: &Rejection, message_id: Option<&str>, publisher: Option<&str>, body: &[u8]) -> Result<Disposition> {
    if let Some((tenant, job_id)) = rej.recoverable_key() {
        let written = jobs.record_rejection(tenant, job_id, &rej.reason).await?;
        if !written {
            tracing::warn!(tenant, job_id, code = %rej.reason.code, "invalid resubmission of an existing job id; the existing job is kept");
        }
        tracing::info!(tenant, job_id, code = %rej.reason.code, message = %rej.reason.message, "submission rejected");
        metrics.submissions.with_label_values(&["rejected"]).inc();
        return Ok(Disposition::Ack);
    }
    jobs.record_intake_rejection(message_id, publisher, &rej.reason, body).await?;
    tracing::warn!(message_id, publisher, code = %rej.reason.code, message = %rej.reason.message, body_bytes = body.len(), "unattributable submission dead-lettered");
    metrics.submissions.with_label_values(&["dead_lettered"]).inc();
    Ok(Disposition::DeadLetter)
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
        assert_eq!(decide(Ok(sub("acme")), &Publisher::Tenant("acme".into())), Decision::Accept(sub("acme")));
        let Decision::Reject(r) = decide(Ok(sub("other")), &Publisher::Tenant("acme".into())) else { panic!("accepted") };
        assert_eq!(r.reason.code, ErrorCode::TenantMismatch);
        assert_eq!((r.tenant.as_deref(), r.job_id.as_deref()), (Some("acme"), Some("job-1")), "recorded under the publisher");
    }

    #[test]
    fn a_trusted_publisher_names_the_tenant_in_the_body() {
        assert_eq!(decide(Ok(sub("any")), &Publisher::Trusted("sandcell".into())), Decision::Accept(sub("any")));
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
        assert_eq!(session_key(&Ok(sub("acme"))), None, "one-off");
        let mut opening = sub("acme");
        opening.session = Some(SessionRequest { new: true, ..Default::default() });
        assert_eq!(session_key(&Ok(opening)), None, "a new session has no earlier job");
        let mut next = sub("acme");
        next.session = Some(SessionRequest { id: Some("ses_1".into()), ..Default::default() });
        assert_eq!(session_key(&Ok(next)), Some("acme/ses_1".into()));
        let refused = Rejection { reason: Reason::new(ErrorCode::MissingField, "code"), tenant: None, job_id: None };
        assert_eq!(session_key(&Err(refused)), None, "refused: never dispatched");
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
