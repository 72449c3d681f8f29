//! The scheduler's Prometheus collectors.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGaugeVec, Opts, Registry};
use sandcell_protocol::JobStatus;

/// Collectors, cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// `sandcell_submissions_total{outcome}`: accepted, held, duplicate, rejected, dead_lettered.
    pub submissions: IntCounterVec,
    /// `sandcell_intake_seconds`: from delivery to ack for accepted submissions.
    pub intake_seconds: Histogram,
    /// `sandcell_jobs{status}`: jobs in the database by status (refreshed by the sweeper).
    pub jobs: IntGaugeVec,
    /// `sandcell_artifacts_expired_total`.
    pub artifacts_expired: prometheus::IntCounter,
    /// `sandcell_uploads_removed_total`: upload grants whose objects the sweeper removed.
    pub uploads_removed: prometheus::IntCounter,
    /// `sandcell_retention_deleted_total{what}`: finished jobs (`job`), upload answers
    /// (`upload`) and ended sessions (`session`) deleted past `SANDCELL_RESULT_RETENTION_S`.
    pub retention_deleted: IntCounterVec,
    /// `sandcell_intake_ack_failures_total{disposition}`: settling a submission or a request
    /// failed (its channel closed, or the broker left it unanswered); the broker redelivers it.
    pub ack_failures: IntCounterVec,
    /// `sandcell_stuck_ended_total{what}`: jobs (`job`) and sessions (`session`) ended by the
    /// sweeper after staying `queued`/`starting` past `SANDCELL_STUCK_AFTER_S`.
    pub stuck_ended: IntCounterVec,
    /// `sandcell_held_jobs_dispatched_total`: held jobs (fair share) published by the dispatcher.
    pub held_dispatched: prometheus::IntCounter,
    /// `sandcell_intake_partitions_held`: intake partitions this scheduler consumes now.
    pub partitions_held: prometheus::IntGauge,
    /// `sandcell_parked_jobs_released_total`: jobs of moving sessions published by the
    /// dispatcher (those sent to take a session over, and those that followed it).
    pub parked_released: prometheus::IntCounter,
    /// `sandcell_dead_letters_total{outcome}`: dead letters whose outcome the recorder wrote
    /// (`submission_rejected`, `job_rejected`, `intake_rejection`), found written
    /// (`recorded_at_intake`), left alone (`left_alone`: the job was
    /// running, ended, or its copy waits in Postgres), or that carried no job (`request`,
    /// `undecodable`, `not_published_to_intake`, `other`).
    pub dead_letters: IntCounterVec,
    /// `sandcell_live_output_enforced_total{limit}`: tenants found holding more live-output
    /// `queues` or `bindings` than their limit, whose connections were closed and live queues
    /// deleted.
    pub live_output_enforced: IntCounterVec,
    /// `sandcell_tenant_db_sessions_ended_total`: tenants' database sessions ended for keeping a
    /// transaction open past `SANDCELL_TENANT_DB_HOLD_S`.
    pub tenant_db_sessions_ended: prometheus::IntCounter,
    /// `sandcell_live_output_check_failures_total`: live-output checks that could not read the
    /// broker (its management API unreachable or refusing).
    pub live_output_check_failures: prometheus::IntCounter,
    /// `sandcell_intake_refused_from_memory_total`: submissions refused with the figures of their
    /// tenant's refusal a moment before, without a look under its lock (also counted in
    /// `sandcell_submissions_total{outcome="rejected"}`; [`crate::quota_memory`]).
    pub refused_from_memory: prometheus::IntCounter,
    /// `sandcell_intake_refusal_batch_size`: refusals written by one transaction of the refusal
    /// writer ([`crate::refusals`]); its count is the writer's transactions.
    pub refusal_batch_size: Histogram,
    /// `sandcell_intake_upload_grant_batch_size`: upload grants recorded by one statement of the
    /// grant writer ([`crate::uploads::Grants`]); its count is the writer's transactions.
    pub upload_grant_batch_size: Histogram,
    /// `sandcell_intake_upload_refusal_batch_size`: upload refusals recorded by one transaction
    /// of the intake's upload refusal writer.
    pub upload_refusal_batch_size: Histogram,
    /// `sandcell_intake_unattributable_batch_size`: messages naming no job recorded in
    /// `intake_rejections` by one transaction of the intake's writer of them
    /// ([`crate::refusals::IntakeRejections`]).
    pub unattributable_batch_size: Histogram,
}

impl Metrics {
    /// Create and register the collectors.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let submissions = IntCounterVec::new(Opts::new("sandcell_submissions_total", "Submissions by intake outcome"), &["outcome"])?;
        let intake_seconds = Histogram::with_opts(
            HistogramOpts::new("sandcell_intake_seconds", "Time to validate, record and dispatch a submission")
                .buckets(vec![0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
        )?;
        let jobs = IntGaugeVec::new(Opts::new("sandcell_jobs", "Jobs in the database by status"), &["status"])?;
        let artifacts_expired = prometheus::IntCounter::new("sandcell_artifacts_expired_total", "Artifacts deleted by the TTL sweeper")?;
        let uploads_removed = prometheus::IntCounter::new("sandcell_uploads_removed_total", "Upload grants whose objects the TTL sweeper removed")?;
        registry.register(Box::new(submissions.clone()))?;
        registry.register(Box::new(intake_seconds.clone()))?;
        registry.register(Box::new(jobs.clone()))?;
        registry.register(Box::new(artifacts_expired.clone()))?;
        registry.register(Box::new(uploads_removed.clone()))?;
        let retention_deleted = IntCounterVec::new(
            Opts::new("sandcell_retention_deleted_total", "Finished jobs, upload answers and ended sessions deleted past their retention"),
            &["what"],
        )?;
        registry.register(Box::new(retention_deleted.clone()))?;
        for what in ["job", "upload", "session"] {
            retention_deleted.with_label_values(&[what]);
        }
        let ack_failures =
            IntCounterVec::new(Opts::new("sandcell_intake_ack_failures_total", "Submissions whose ack/nack failed, by disposition"), &["disposition"])?;
        let stuck_ended =
            IntCounterVec::new(Opts::new("sandcell_stuck_ended_total", "Jobs and sessions ended after staying queued/starting too long"), &["what"])?;
        registry.register(Box::new(ack_failures.clone()))?;
        registry.register(Box::new(stuck_ended.clone()))?;
        let held_dispatched = prometheus::IntCounter::new("sandcell_held_jobs_dispatched_total", "Held jobs published by the fair-share dispatcher")?;
        registry.register(Box::new(held_dispatched.clone()))?;
        let partitions_held = prometheus::IntGauge::new("sandcell_intake_partitions_held", "Intake partitions this scheduler consumes")?;
        registry.register(Box::new(partitions_held.clone()))?;
        let parked_released = prometheus::IntCounter::new("sandcell_parked_jobs_released_total", "Jobs of moving sessions published by the dispatcher")?;
        registry.register(Box::new(parked_released.clone()))?;
        let dead_letters = IntCounterVec::new(Opts::new("sandcell_dead_letters_total", "Dead letters by the outcome the scheduler recorded"), &["outcome"])?;
        registry.register(Box::new(dead_letters.clone()))?;
        let live_output_enforced = IntCounterVec::new(
            Opts::new("sandcell_live_output_enforced_total", "Tenants held to their live-output limit (connections closed, live queues deleted)"),
            &["limit"],
        )?;
        registry.register(Box::new(live_output_enforced.clone()))?;
        for limit in ["queues", "bindings"] {
            live_output_enforced.with_label_values(&[limit]);
        }
        let live_output_check_failures =
            prometheus::IntCounter::new("sandcell_live_output_check_failures_total", "Live-output checks that could not read the broker's management API")?;
        registry.register(Box::new(live_output_check_failures.clone()))?;
        let tenant_db_sessions_ended = prometheus::IntCounter::new(
            "sandcell_tenant_db_sessions_ended_total",
            "Tenants' database sessions ended for keeping a transaction open past SANDCELL_TENANT_DB_HOLD_S",
        )?;
        registry.register(Box::new(tenant_db_sessions_ended.clone()))?;
        let refused_from_memory = prometheus::IntCounter::new(
            "sandcell_intake_refused_from_memory_total",
            "Submissions refused with their tenant's quota refusal of a moment before, without a new look",
        )?;
        registry.register(Box::new(refused_from_memory.clone()))?;
        let refusal_batch_size =
            batch_size_histogram(&registry, "sandcell_intake_refusal_batch_size", "Refusals written by one transaction of the intake's refusal writer")?;
        let upload_grant_batch_size =
            batch_size_histogram(&registry, "sandcell_intake_upload_grant_batch_size", "Upload grants recorded by one statement of the intake's grant writer")?;
        let upload_refusal_batch_size = batch_size_histogram(
            &registry,
            "sandcell_intake_upload_refusal_batch_size",
            "Upload refusals recorded by one transaction of the intake's upload refusal writer",
        )?;
        let unattributable_batch_size = batch_size_histogram(
            &registry,
            "sandcell_intake_unattributable_batch_size",
            "Messages naming no job recorded in intake_rejections by one transaction of the intake's writer of them",
        )?;
        // Every series a label can take is exposed from the start, at 0 (an alert's rate() over a
        // series that does not exist yet stays silent).
        for outcome in ["accepted", "held", "parked", "duplicate", "rejected", "dead_lettered", "not_published_to_intake"] {
            submissions.with_label_values(&[outcome]);
        }
        for disposition in ["ack", "requeue", "dead_letter"] {
            ack_failures.with_label_values(&[disposition]);
        }
        for what in ["job", "session", "session_capacity", "moving_session", "job_of_dead_worker", "job_overdue"] {
            stuck_ended.with_label_values(&[what]);
        }
        for outcome in crate::dead_letters::OUTCOMES {
            dead_letters.with_label_values(&[outcome]);
        }
        for status in JobStatus::ALL {
            jobs.with_label_values(&[status.as_str()]);
        }
        Ok(Metrics {
            registry,
            submissions,
            intake_seconds,
            jobs,
            artifacts_expired,
            uploads_removed,
            retention_deleted,
            ack_failures,
            stuck_ended,
            held_dispatched,
            partitions_held,
            parked_released,
            dead_letters,
            live_output_enforced,
            live_output_check_failures,
            tenant_db_sessions_ended,
            refused_from_memory,
            refusal_batch_size,
            upload_grant_batch_size,
            upload_refusal_batch_size,
            unattributable_batch_size,
        })
    }
}

/// A histogram of the sizes of one [`crate::batches::Batcher`]'s batches (1 to 256, the most any
/// of them writes at once), registered in `registry`.
fn batch_size_histogram(registry: &Registry, name: &str, help: &str) -> prometheus::Result<Histogram> {
    let sizes = Histogram::with_opts(HistogramOpts::new(name, help).buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]))?;
    registry.register(Box::new(sizes.clone()))?;
    Ok(sizes)
}
