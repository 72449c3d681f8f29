//! The job store: jobs in Postgres, from intake to their end.
//!
//! This file records submissions and moves jobs through their states (claim, refusal, failure);
//! [`held`] holds fair share's waiting jobs, [`results`] commits a job's result and artifacts and
//! reads it back, [`artifacts`] finds the expired ones.
//!
//! Every status change of a job happens here, and only through a guarded `UPDATE` whose source
//! states come from [`JobStatus::sources_of`], so the state machine in `sandcell_protocol::status`
//! is enforced by the database even when two workers race on the same job.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use sandcell_protocol::storable;
use sandcell_protocol::{ErrorCode, ExecutionLimits, JobStatus, Reason, Submission};

use crate::tenants::{self, Quotas};

mod artifacts;
mod held;
mod parked;
mod results;

pub use artifacts::ExpiredArtifact;
pub use held::HeldJob;
pub use parked::{Follow, Release, TakeOver};
pub use results::{Finished, NewArtifact};
use sqlx::postgres::PgPool;
use sqlx::Row;

/// The execution document of a job that has not run: every job row has one, so a client
/// reads `stdout: ""` for a queued job as for any other.
fn not_run() -> serde_json::Value {
    static EMPTY: std::sync::LazyLock<serde_json::Value> =
        std::sync::LazyLock::new(|| serde_json::to_value(sandcell_protocol::Execution::default()).unwrap_or(serde_json::Value::Null));
    EMPTY.clone()
}

/// Delete a tenant's oldest refusals past the newest [`tenants::KEPT_REFUSALS_OVER_QUOTA`], only
/// while it keeps its `max_result_bytes` or more (migration 0026).
async fn forget_old_refusals(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, tenant: &str) -> Result<()> {
    // Only while the tenant is over its quota. The refusals this writes have no session:
    // a session's job rejected after it was queued (a moving session's taking-over job
    // among them) is left to the retention. The newest ones are read without a lock
    // (`jobs_refused`, migration 0026) for the cutoff; only the rows older than it are
    // locked, and those another recording is deleting are skipped, not waited for.
    let forgotten = sqlx::query(
        "DELETE FROM jobs j USING (
                 SELECT r.tenant, r.job_id FROM jobs r
                  WHERE sandcell_over_result_bytes($1)
                    AND r.tenant = $1 AND r.status = 'rejected' AND r.session_id IS NULL
                    AND r.finished_at < (SELECT k.finished_at FROM jobs k
                                          WHERE k.tenant = $1 AND k.status = 'rejected' AND k.session_id IS NULL
                                          ORDER BY k.finished_at DESC OFFSET $2 - 1 LIMIT 1)
                  FOR UPDATE SKIP LOCKED) old
              WHERE j.tenant = old.tenant AND j.job_id = old.job_id",
    )
    .bind(tenant)
    .bind(tenants::KEPT_REFUSALS_OVER_QUOTA)
    .execute(&mut **tx)
    .await
    .context("deleting the old refusals of a tenant over its result bytes quota")?
    .rows_affected();
    if forgotten > 0 {
        tracing::debug!(tenant, forgotten, "deleted old refusals of a tenant over its result bytes quota");
    }
    Ok(())
}

/// Embedded migrations from `migrations/`, applied at start-up by every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Connect to Postgres and apply pending migrations.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool> {
    let pool = crate::pool::options(max_connections).connect(url).await.with_context(|| format!("connecting to Postgres at {}", crate::broker::redact(url)))?;
    MIGRATOR.run(&pool).await.context("applying database migrations")?;
    Ok(pool)
}

/// A worker whose `running` jobs will never be committed ([`JobStore::end_jobs_of_gone_worker`]).
#[derive(Debug, Clone, Copy)]
pub enum Gone<'a> {
    /// This worker started again: what its previous life was running died with it.
    Restarted(&'a str),
    /// Any worker whose heartbeat is older than this.
    Silent(Duration),
}

/// What happened when a submission was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// A new job; it must be dispatched: to this worker, the owner of its session, or (`None`:
    /// a one-off job or one opening a session) to the shared queue.
    New {
        /// The worker holding the job's session.
        routed_to: Option<String>,
    },
    /// A new job of the shared queue, held: its tenant has `max_jobs_in_flight` jobs out
    /// already (or older jobs held). The dispatcher publishes it when one of them finishes.
    Held,
    /// A new job of a session that is moving (or whose owner changed since it was routed):
    /// parked; the dispatcher publishes it to the session's next owner.
    Parked,
    /// The job id was already used by this tenant.
    Duplicate {
        /// Status of the existing job.
        status: JobStatus,
        /// Whether the earlier submission had the same body.
        same_payload: bool,
        /// The session the existing job runs in.
        session_id: Option<String>,
        /// The existing job is held for the dispatcher (which will publish it).
        held: bool,
        /// The worker holding the session the job names, when it is routed there now (`None`
        /// for a session that is moving, or a job without an existing session).
        routed_to: Option<String>,
    },
    /// The job's session cannot take it (there is none, or it is not active); nothing was
    /// recorded (the caller records the refusal).
    SessionRefused(Reason),
    /// The tenant is at a quota; nothing was recorded (the caller records the refusal).
    OverQuota(Reason),
}

/// The session side of recording a job.
#[derive(Debug, Clone, Copy)]
pub enum JobSessionRecord<'a> {
    /// The job opens this new session with this keep-alive (seconds).
    Open(&'a str, u64),
    /// The job runs in this existing session, which the record routes (see [`Recorded`]):
    /// `routed` is the execution job as published, kept while the session lives (it is
    /// published again should the session move before the job ran, and its input files help
    /// put a moved session's workspace back).
    Existing {
        /// The session.
        id: &'a str,
        /// The execution job.
        routed: &'a [u8],
    },
}

/// What committing a session job does to its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTouch {
    /// The session.
    pub id: String,
    /// Close it (the job asked `session.close`); otherwise extend its keep-alive.
    pub close: bool,
    /// The session's new keep-alive (the job asked `session.keep_alive_s`), before extending.
    pub keep_alive_s: Option<u64>,
}

/// What a store error says about trying the same statement again ([`crate::retry_classified`]):
/// [`is_permanent`], [`is_unavailable`] (an outage), or neither (transient).
pub fn failure(e: &anyhow::Error) -> crate::Failure {
    if is_permanent(e) {
        crate::Failure::Permanent
    } else if is_unavailable(e) {
        crate::Failure::Outage
    } else {
        crate::Failure::Transient
    }
}

/// Whether a store error says the database cannot be reached or cannot serve anyone right now:
/// the connection failed or timed out, the server is shutting down or starting (SQLSTATE
/// 57P01–57P03), a connection exception (class 08), too many connections (53300) or a full disk
/// (53100). Not an out-of-memory or a configuration limit (53200, 53400), which one statement may
/// cause on its own. Nothing is wrong with the work at hand, and every other piece of work
/// would fail the same way, so it waits for the database ([`crate::Failure::Outage`])
/// rather than being given up on (for a message: returned, and dead-lettered after a few returns).
/// A closed pool (the process is stopping) is not an outage.
pub fn is_unavailable(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| match cause.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolTimedOut) => true,
        Some(sqlx::Error::Database(db)) => {
            db.code().is_some_and(|c| c.starts_with("08") || matches!(c.as_ref(), "53100" | "53300" | "57P01" | "57P02" | "57P03"))
        }
        _ => false,
    })
}

/// Whether a store error is the database refusing the data itself (a data exception, an
/// integrity or size violation, or a value that cannot be encoded) rather than a failure to
/// reach it: retrying the same data cannot succeed.
pub fn is_permanent(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        if let Some(err) = cause.downcast_ref::<sqlx::Error>() {
            return match err {
                sqlx::Error::Database(db) => db.code().is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c.starts_with("54")),
                sqlx::Error::Encode(_) | sqlx::Error::ColumnDecode { .. } | sqlx::Error::TypeNotFound { .. } => true,
                _ => false,
            };
        }
        cause.downcast_ref::<serde_json::Error>().is_some()
    })
}

/// A duration as the whole milliseconds a statement takes (`$n * interval '1 millisecond'`),
/// saturating rather than failing for one too long to count.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How a job's message reached the worker claiming it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Arrival {
    /// The broker gave this message to a consumer before (which may have died mid-job): only
    /// such a delivery may take over a `running` job.
    pub redelivered: bool,
    /// When the scheduler published it ([`crate::broker::dispatched_at`]).
    pub dispatched_at: Option<DateTime<Utc>>,
}

/// A job a worker has claimed.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    /// 1 on the first delivery, more after a worker died mid-job.
    pub attempt: i32,
    /// When the scheduler recorded the job (for queue-wait metrics).
    pub queued_at: DateTime<Utc>,
}

/// How many intake rejections are kept per publisher, the newest: enough for an operator to see
/// what a client sends wrong; a tenant publishing messages the intake cannot read must not grow
/// the table without bound (each is counted in `sandcell_submissions_total{outcome="dead_lettered"}`
/// all the same).
pub const KEPT_INTAKE_REJECTIONS: i64 = 1000;

/// A message the intake could not attribute to a job (not JSON, no usable ids, no `user_id`),
/// as `intake_rejections` keeps it for operators: why, who published it as the broker vouches,
/// and its first 512 bytes, never the whole body.
#[derive(Debug, Clone)]
pub struct IntakeRejection {
    /// The message's `message_id` property, if it had one.
    pub message_id: Option<String>,
    /// The broker user that published it, when the broker vouched for one.
    pub publisher: Option<String>,
    /// Why the intake could not take it.
    pub reason: Reason,
    /// The body's length.
    pub body_bytes: usize,
    /// The body's first 512 bytes, as text (what is not UTF-8 replaced).
    pub body_prefix: String,
}

impl IntakeRejection {
    /// The record of `body`, refused for `reason`.
    pub fn new(message_id: Option<&str>, publisher: Option<&str>, reason: &Reason, body: &[u8]) -> IntakeRejection {
        IntakeRejection {
            message_id: message_id.map(str::to_owned),
            publisher: publisher.map(str::to_owned),
            reason: reason.clone(),
            body_bytes: body.len(),
            body_prefix: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        }
    }
}

/// Handle on the job tables.
#[derive(Clone)]
pub struct JobStore {
    pool: PgPool,
    /// Quotas of tenants registered on their first job.
    tenant_defaults: Quotas,
}

fn status_list(next: JobStatus) -> Vec<String> {
    JobStatus::sources_of(next).into_iter().map(|s| s.as_str().to_string()).collect()
}

impl JobStore {
    /// Wrap a pool.
    pub fn new(pool: PgPool) -> Self {
        JobStore { pool, tenant_defaults: Quotas::default() }
    }

    /// Use `defaults` as the quotas of tenants registered on their first job.
    pub fn with_tenant_defaults(mut self, defaults: Quotas) -> Self {
        self.tenant_defaults = defaults;
        self
    }

    /// The underlying pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Record an accepted submission as `queued`, or report the existing job with that id. A job
    /// that opens a session records the session (`starting`) in the same statement, so a
    /// duplicate submission never creates a second session. The tenant's row lock, its quotas,
    /// its fair share and the rows are one round trip: the function `sandcell_record_job`
    /// (`migrations/0014_record_job_routes.sql`), which owns the quota checks and the route of a
    /// job in an existing session. A job that only closes its session passes the quotas on stored
    /// bytes (`migrations/0024_closing_past_stored_quotas.sql`).
    ///
    /// `shared` is the execution job of a job that travels on the shared queue (one-off, or
    /// opening a session): when its tenant already has `max_jobs_in_flight` such jobs out, or
    /// older ones held, it is recorded held (fair share) and the caller must not publish it.
    pub async fn record_queued(
        &self,
        sub: &Submission,
        limits: &ExecutionLimits,
        sha256: &str,
        session: Option<JobSessionRecord<'_>>,
        shared: Option<&[u8]>,
    ) -> Result<Recorded> {
        let limits_json = serde_json::to_value(limits).context("serializing limits")?;
        let (open, keep_alive_s, existing) = match session {
            Some(JobSessionRecord::Open(id, keep_alive_s)) => (Some(id), Some(i32::try_from(keep_alive_s).unwrap_or(i32::MAX)), None),
            Some(JobSessionRecord::Existing { id, .. }) => (None, None, Some(id)),
            None => (None, None, None),
        };
        // A session job's execution job is kept while the session lives (the opening job's too:
        // its input files are part of the workspace a moved session gets back).
        let routed = match session {
            Some(JobSessionRecord::Existing { routed, .. }) => Some(routed),
            Some(JobSessionRecord::Open(..)) => shared,
            None => None,
        };
        // The session's route, lock, quotas, fair share and the rows, in one statement
        // (migrations 0012 and 0014). `None`: the id was recorded meanwhile by a path that takes
        // no tenant lock (a refusal), a duplicate. The route read there may be stale by the time
        // the job is published (the session moved meanwhile): such a stray is parked by the
        // sweeper (`SessionStore::park_strays`).
        let record = || async {
            let recorded = sqlx::query(
                "SELECT outcome, used, quota, session_state, routed_to FROM sandcell_record_job($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .bind(&sub.tenant)
            .bind(&sub.job_id)
            .bind(sub.language.as_str())
            .bind(sha256)
            .bind(&limits_json)
            .bind(not_run())
            .bind(open)
            .bind(keep_alive_s)
            .bind(existing)
            .bind(shared)
            .bind(routed)
            .bind(sub.only_closes_its_session())
            .fetch_one(&self.pool)
            .await;
            match recorded {
                Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("SCDUP") => Ok(None),
                other => other.map(Some).context("recording job"),
            }
        };
        let mut row = record().await?;
        // A tenant's first job registers it, then goes again.
        if let Some(r) = &row {
            if r.try_get::<&str, _>("outcome")? == "unknown_tenant" {
                let mut tx = self.pool.begin().await.context("beginning transaction")?;
                tenants::ensure(&mut tx, &sub.tenant, &self.tenant_defaults).await?;
                tx.commit().await.with_context(|| format!("registering tenant {}", sub.tenant))?;
                row = record().await?;
            }
        }
        let mut routed_to = None;
        if let Some(row) = row {
            let outcome: String = row.try_get("outcome")?;
            let (used, quota): (i64, i64) = (row.try_get("used")?, row.try_get("quota")?);
            routed_to = row.try_get("routed_to")?;
            let refuse = |m: String| Ok(Recorded::OverQuota(Reason::new(ErrorCode::QuotaExceeded, m)));
            match outcome.as_str() {
                "new" => return Ok(Recorded::New { routed_to }),
                "session_refused" => {
                    let state: Option<String> = row.try_get("session_state")?;
                    return Ok(Recorded::SessionRefused(crate::sessions::refusal(&sub.tenant, existing.unwrap_or_default(), state.as_deref())?));
                }
                "held" => return Ok(Recorded::Held),
                "parked" => return Ok(Recorded::Parked),
                "duplicate" => {}
                "over_queued_jobs" => return refuse(format!("tenant has {used} jobs queued or running; its quota is {quota}")),
                "over_sessions" => return refuse(format!("tenant has {used} live sessions; its quota is {quota}")),
                "over_artifact_bytes" => {
                    return refuse(format!("tenant stores {used} bytes of artifacts; its quota is {quota} (wait for artifacts to expire; a job that only closes a session is still accepted)"))
                }
                "over_result_bytes" => {
                    return refuse(format!(
                        "tenant keeps {used} bytes of job results and upload answers in the database; its quota is {quota} (results are deleted SANDCELL_RESULT_RETENTION_S after they end; a job that only closes a session is still accepted)"
                    ))
                }
                other => bail!("recording job {} of tenant {}: unexpected outcome {other:?}", sub.job_id, sub.tenant),
            }
        }
        let row = sqlx::query(
            "SELECT status, submission_sha256, session_id, held_job IS NOT NULL OR parked AS held
             FROM jobs WHERE tenant = $1 AND job_id = $2",
        )
        .bind(&sub.tenant)
        .bind(&sub.job_id)
        .fetch_one(&self.pool)
        .await
        .context("reading existing job")?;
        let status: String = row.try_get("status")?;
        let previous: Option<String> = row.try_get("submission_sha256")?;
        Ok(Recorded::Duplicate {
            status: JobStatus::parse(&status).with_context(|| format!("unknown status {status:?} in database"))?,
            same_payload: previous.as_deref() == Some(sha256),
            session_id: row.try_get("session_id")?,
            held: row.try_get("held")?,
            routed_to,
        })
    }

    /// Refuse a queued job without running it (its session ended before it ran): `rejected`;
    /// a job that was already claimed becomes `infrastructure_error`. Returns whether it changed.
    pub async fn refuse(&self, tenant: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        let n = sqlx::query(
            // Composed from constants only.
            sqlx::AssertSqlSafe(format!("UPDATE jobs SET {REFUSE_SET}, reason = $3, finished_at = now() WHERE tenant = $1 AND job_id = $2 AND {REFUSE_WHERE}")),
        )
        .bind(tenant)
        .bind(job_id)
        .bind(storable::json(reason)?)
        .execute(&self.pool)
        .await
        .context("refusing job")?
        .rows_affected();
        Ok(n == 1)
    }

    /// Record a rejected submission under its `(tenant, job_id)`. An existing job with that id is
    /// left alone (a bad retry must not overwrite a good job); returns whether a row was written.
    /// A tenant keeping its `max_result_bytes` or more keeps only its newest
    /// [`tenants::KEPT_REFUSALS_OVER_QUOTA`] refusals: older ones are deleted in the same transaction.
    pub async fn record_rejection(&self, tenant: &str, job_id: &str, reason: &Reason) -> Result<bool> {
        let written = self.record_refusals(&[(tenant.to_owned(), job_id.to_owned(), reason.clone())]).await?;
        Ok(written.first().copied().unwrap_or(false))
    }

    /// Record rejected submissions in one transaction: one commit, one statement for their rows,
    /// however many tenants and jobs. Each is written as [`JobStore::record_rejection`] says (a
    /// tenant never seen is registered with the default quotas; an existing job with that id is
    /// left alone; a tenant over its `max_result_bytes` keeps its newest refusals only), and the
    /// answer says, for each in order, whether its row was written.
    pub async fn record_refusals(&self, refusals: &[(String, String, Reason)]) -> Result<Vec<bool>> {
        // Rows, and the tenants' counts their triggers update, are locked in one order in every
        // batch, so two batches cannot deadlock each other (a deadlock with another kind of
        // transaction is Postgres' to break: the caller may try again).
        let mut sorted: Vec<&(String, String, Reason)> = refusals.iter().collect();
        sorted.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        let (mut owners, mut job_ids, mut reasons) = (Vec::new(), Vec::new(), Vec::new());
        for (tenant, job_id, reason) in sorted {
            owners.push(tenant.as_str());
            job_ids.push(job_id.as_str());
            reasons.push(storable::json(reason)?);
        }
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let mut distinct = owners.clone();
        distinct.dedup();
        for tenant in distinct {
            tenants::ensure(&mut tx, tenant, &self.tenant_defaults).await?;
        }
        let written: Vec<(String, String)> = sqlx::query_as(
            "INSERT INTO jobs (tenant, job_id, status, reason, execution, finished_at)
             SELECT t, j, 'rejected', r, $4, clock_timestamp() FROM unnest($1::text[], $2::text[], $3::jsonb[]) AS u(t, j, r)
             ON CONFLICT (tenant, job_id) DO NOTHING
             RETURNING tenant, job_id",
        )
        .bind(&owners)
        .bind(&job_ids)
        .bind(&reasons)
        .bind(not_run())
        .fetch_all(&mut *tx)
        .await
        .context("recording refusals")?;
        let written: std::collections::HashSet<(&str, &str)> = written.iter().map(|(t, j)| (t.as_str(), j.as_str())).collect();
        let mut trimmed = std::collections::HashSet::new();
        for (tenant, _) in &written {
            if trimmed.insert(*tenant) {
                forget_old_refusals(&mut tx, tenant).await?;
            }
        }
        tx.commit().await.context("committing refusals")?;
        // A job id twice in one batch is written once: the first asking is answered `true`.
        let mut answered = std::collections::HashSet::new();
        Ok(refusals.iter().map(|(t, j, _)| written.contains(&(t.as_str(), j.as_str())) && answered.insert((t.as_str(), j.as_str()))).collect())
    }

    /// Record a message that named no usable job id ([`JobStore::record_intake_rejections`]
    /// of one).
    pub async fn record_intake_rejection(&self, rejection: &IntakeRejection) -> Result<()> {
        self.record_intake_rejections(std::slice::from_ref(rejection)).await
    }

    /// Record messages that named no usable job id, in one transaction, keeping the newest
    /// [`KEPT_INTAKE_REJECTIONS`] of each publisher's (older ones are deleted in the same
    /// transaction). Messages without a publisher the broker vouched for are kept as one group.
    ///
    /// Why in batches: recorded one statement each, 4 at a time through the publisher's gate,
    /// a tenant's flood of messages the intake cannot read held the submissions of other tenants
    /// queued behind it in the intake's partitions (`scheduler::refusals::IntakeRejections`).
    pub async fn record_intake_rejections(&self, rejections: &[IntakeRejection]) -> Result<()> {
        if rejections.is_empty() {
            return Ok(());
        }
        let n = rejections.len();
        let (mut message_ids, mut codes, mut messages, mut sizes, mut prefixes, mut publishers) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for r in rejections {
            message_ids.push(r.message_id.as_deref().map(|m| storable::text(m).into_owned()));
            codes.push(r.reason.code.as_str());
            messages.push(storable::text(&r.reason.message).into_owned());
            sizes.push(i32::try_from(r.body_bytes).unwrap_or(i32::MAX));
            prefixes.push(storable::text(&r.body_prefix).into_owned());
            publishers.push(r.publisher.as_deref().map(|p| storable::text(p).into_owned()));
        }
        // Each publisher's group once, in one order: two batches trim their groups in turn.
        let groups: std::collections::BTreeSet<String> = publishers.iter().map(|p| p.clone().unwrap_or_default()).collect();
        let groups: Vec<String> = groups.into_iter().collect();
        let mut tx = self.pool.begin().await.context("beginning a batch of intake rejections")?;
        sqlx::query(
            "INSERT INTO intake_rejections (message_id, code, message, body_bytes, body_prefix, publisher)
             SELECT m, c, t, b, p, u FROM unnest($1::text[], $2::text[], $3::text[], $4::int4[], $5::text[], $6::text[])
                 WITH ORDINALITY AS r(m, c, t, b, p, u, n) ORDER BY n",
        )
        .bind(&message_ids)
        .bind(&codes)
        .bind(&messages)
        .bind(&sizes)
        .bind(&prefixes)
        .bind(&publishers)
        .execute(&mut *tx)
        .await
        .context("recording intake rejections")?;
        // Each group's newest KEPT_INTAKE_REJECTIONS stay, these among them (migration 0020
        // indexes the walk).
        sqlx::query(
            "DELETE FROM intake_rejections r USING (
                 SELECT g, (SELECT id FROM intake_rejections WHERE COALESCE(publisher, '') = g ORDER BY id DESC OFFSET $2 LIMIT 1) AS cutoff
                 FROM unnest($1::text[]) AS g) k
             WHERE COALESCE(r.publisher, '') = k.g AND r.id <= k.cutoff",
        )
        .bind(&groups)
        .bind(KEPT_INTAKE_REJECTIONS)
        .execute(&mut *tx)
        .await
        .context("forgetting old intake rejections")?;
        tx.commit().await.context("committing intake rejections")?;
        Ok(())
    }

    /// Claim a job for running. Returns the claim, or `None` if the job is already finished (a
    /// redelivery of work that was committed but not acked), unknown, or running where it may
    /// still finish. A fresh delivery never takes over a running job, so a job dispatched twice
    /// by accident still runs once. A redelivered message (`arrival.redelivered`) takes a
    /// `running` job over only when its worker is this one (an earlier life of it died mid-job)
    /// or has not beaten for `dead_after`: after a broker restart, a job still running on a live
    /// worker is left to it.
    ///
    /// A session job is claimed only by its session's worker, or by the worker opening or
    /// taking over the session with it: a copy left in the queue of a worker the session moved
    /// away from is never run there. A parked job is claimed only by the worker the dispatcher
    /// addressed it to (`routed_to`), its session's new owner.
    ///
    /// The claim also records when the job was dispatched (`arrival.dispatched_at`), unless the
    /// dispatcher noted it already.
    ///
    /// `again`: this worker tried to claim this very delivery a moment ago and the try failed,
    /// so its answer may have been lost after the claim was committed. Such a try may take over
    /// a `running` job whose worker is this one (no handler here runs it: the ledger holds one
    /// per job), and, unless the delivery is a redelivery, none other.
    pub async fn claim(&self, tenant: &str, job_id: &str, worker_id: &str, arrival: Arrival, dead_after: Duration, again: bool) -> Result<Option<Claim>> {
        let mut sources = status_list(JobStatus::Running);
        if !arrival.redelivered && !again {
            sources.retain(|s| s != JobStatus::Running.as_str());
        }
        let row = sqlx::query(
            // A claim taken back by a try in place (`again`, not a redelivery) is the same claim:
            // it does not count as another attempt.
            "UPDATE jobs SET status = 'running', worker_id = $3, started_at = now(),
                             attempts = attempts + CASE WHEN status = 'running' AND worker_id = $3 AND NOT $7 THEN 0 ELSE 1 END,
                             dispatched_at = COALESCE(dispatched_at, $6)
             WHERE tenant = $1 AND job_id = $2 AND status = ANY($4) AND (NOT parked OR routed_to = $3)
               AND (status <> 'running' OR worker_id = $3
                    OR ($7 AND (worker_id IS NULL OR sandcell_worker_silent(jobs.worker_id, $5))))
               AND (session_id IS NULL OR EXISTS (
                    SELECT 1 FROM sessions s WHERE s.session_id = jobs.session_id
                      AND (s.worker_id = $3 OR s.created_by_job = jobs.job_id OR (s.state = 'moving' AND s.adopting_job = jobs.job_id))))
             RETURNING attempts, queued_at",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(worker_id)
        .bind(sources)
        .bind(millis(dead_after))
        .bind(arrival.dispatched_at)
        .bind(arrival.redelivered)
        .fetch_optional(&self.pool)
        .await
        .context("claiming job")?;
        row.map(|r| Ok(Claim { attempt: r.try_get("attempts")?, queued_at: r.try_get("queued_at")? })).transpose()
    }

    /// The session jobs addressed to `worker_id`'s own queue that have not run (`queued`, not
    /// parked), oldest first: each as `(tenant, job_id)`, its execution job as routed to read
    /// with [`JobStore::routed_job`], one at a time (a backlog of jobs with inline files of up to
    /// 10 MiB each must not come into the worker's memory at once). Their messages are transient
    /// ([`crate::broker::session_dispatch_properties`]), so a broker restart drops those still
    /// in the queue; the worker reads these whenever it (re)connects and runs them before
    /// anything its queue delivers. Read through `jobs_unfinished`: the backlog of unfinished
    /// jobs, once per connection, not on a job's path.
    pub async fn routed_to_worker(&self, worker_id: &str) -> Result<Vec<(String, String)>> {
        let rows = sqlx::query(
            "SELECT tenant, job_id FROM jobs
             WHERE status = 'queued' AND routed_to = $1 AND NOT parked AND routed IS NOT NULL
             ORDER BY queued_at, job_id",
        )
        .bind(worker_id)
        .fetch_all(&self.pool)
        .await
        .context("reading the jobs routed to this worker")?;
        rows.into_iter().map(|r| Ok((r.try_get("tenant")?, r.try_get("job_id")?))).collect()
    }

    /// The execution job kept for a job of a session (`jobs.routed`, as it was routed), while
    /// the job is still `queued`: a worker that left a waiting job's inputs here, rather than
    /// in its memory, reads them back when the job's turn comes; one that (re)connected reads
    /// each job routed to it ([`JobStore::routed_to_worker`]), and each it must return to its
    /// queue.
    pub async fn routed_job(&self, tenant: &str, job_id: &str) -> Result<Option<Vec<u8>>> {
        let routed = sqlx::query_scalar::<_, Option<Vec<u8>>>("SELECT routed FROM jobs WHERE tenant = $1 AND job_id = $2 AND status = 'queued'")
            .bind(tenant)
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await
            .context("reading a job's kept execution job")?;
        Ok(routed.flatten())
    }

    /// End `infrastructure_error/worker_lost` the jobs still `running` on a worker that is gone
    /// (it restarted, or its heartbeat is older than the given silence): their worker will never
    /// commit them. A redelivered copy of such a job is taken over by another worker only once
    /// its worker looks dead, and the first copy usually arrives before that (the broker
    /// redelivers the moment the connection drops) and is dropped; without this the job stayed
    /// `running` forever. Ended, any later copy is dropped too: the job is not run again (it may
    /// have had effects), as with the jobs of sessions. Returns how many were ended.
    pub async fn end_jobs_of_gone_worker(&self, gone: Gone<'_>) -> Result<u64> {
        let why = match gone {
            Gone::Restarted(worker_id) => format!("worker {worker_id} restarted while running the job"),
            Gone::Silent(silence) => format!("the worker running the job stopped responding for more than {} s", silence.as_secs()),
        };
        let reason = storable::json(&Reason::new(ErrorCode::WorkerLost, format!("{why}; the job is not run again (it may have had effects)")))?;
        let query = match gone {
            Gone::Restarted(worker_id) => sqlx::query(
                "UPDATE jobs SET status = 'infrastructure_error', reason = $1, finished_at = now()
                 WHERE status = 'running' AND worker_id = $2",
            )
            .bind(reason)
            .bind(worker_id),
            Gone::Silent(silence) => sqlx::query(
                "UPDATE jobs SET status = 'infrastructure_error', reason = $1, finished_at = now()
                 WHERE status = 'running' AND worker_id IS NOT NULL AND sandcell_worker_silent(worker_id, $2)",
            )
            .bind(reason)
            .bind(millis(silence)),
        };
        let n = query.execute(&self.pool).await.context("ending the jobs of a gone worker")?.rows_affected();
        Ok(n)
    }

    /// End `infrastructure_error/stuck` the jobs still `running` `margin` past their time limit
    /// since their claim: their worker lost track of them (a claim whose answer was lost, a
    /// commit that gave up) while it kept beating, so no silence will ever end them, and a
    /// redelivered copy is refused while that worker lives. Returns how many were ended.
    pub async fn end_overdue(&self, margin: Duration) -> Result<u64> {
        let reason = storable::json(&Reason::new(
            ErrorCode::Stuck,
            format!("it was still running {} s past its time limit; its worker lost track of it, and it is not run again", margin.as_secs()),
        ))?;
        let n = sqlx::query(
            "UPDATE jobs SET status = 'infrastructure_error', reason = $1, finished_at = now()
             WHERE status = 'running'
               AND started_at < now() - (COALESCE((limits->>'timeout_ms')::bigint, 0) + $2) * interval '1 millisecond'",
        )
        .bind(reason)
        .bind(millis(margin))
        .execute(&self.pool)
        .await
        .context("ending overdue jobs")?
        .rows_affected();
        Ok(n)
    }

    /// Move an unfinished job to a terminal status with a reason (infrastructure failures).
    pub async fn fail(&self, tenant: &str, job_id: &str, status: JobStatus, reason: &Reason) -> Result<bool> {
        let n = sqlx::query(
            "UPDATE jobs SET status = $3, reason = $4, finished_at = now()
             WHERE tenant = $1 AND job_id = $2 AND status = ANY($5)",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(status.as_str())
        .bind(storable::json(reason)?)
        .bind(status_list(status))
        .execute(&self.pool)
        .await
        .context("recording job failure")?
        .rows_affected();
        Ok(n == 1)
    }

    /// Count of jobs by status (for the `sandcell_jobs` gauge).
    pub async fn count_by_status(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT status, count(*) AS n FROM jobs GROUP BY status").fetch_all(&self.pool).await.context("counting jobs by status")?;
        rows.into_iter().map(|r| Ok((r.try_get("status")?, r.try_get("n")?))).collect()
    }

    /// Check the database answers.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await.context("database ping")?;
        Ok(())
    }
}

/// How a job that cannot run because its session or input is gone ends: `queued` (never ran) →
/// `rejected`, `running` (its kernel went away under it) → `infrastructure_error`. Shared by
/// [`JobStore::refuse`] and [`refuse_jobs_of_sessions`].
const REFUSE_SET: &str = "status = CASE WHEN status = 'queued' THEN 'rejected' ELSE 'infrastructure_error' END";
/// The jobs [`REFUSE_SET`] applies to.
const REFUSE_WHERE: &str = "status IN ('queued', 'running')";

/// End the unfinished jobs of ended sessions by the rule of [`REFUSE_SET`], in the session
/// store's transaction that ends them.
pub(crate) async fn refuse_jobs_of_sessions(tx: &mut sqlx::PgConnection, sessions: &[String], reason: &serde_json::Value) -> Result<()> {
    debug_assert!(JobStatus::Queued.can_become(JobStatus::Rejected) && JobStatus::Running.can_become(JobStatus::InfrastructureError));
    // Composed from constants only.
    sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE jobs SET {REFUSE_SET}, reason = $2, finished_at = now() WHERE session_id = ANY($1) AND {REFUSE_WHERE}")))
        .bind(sessions)
        .bind(reason)
        .execute(tx)
        .await
        .context("ending the jobs of ended sessions")?;
    Ok(())
}

/// Reject the jobs that stayed `queued` longer than `millis` since they were dispatched (their
/// message was lost), in the sweeper's transaction; fair share's held jobs are waiting, not
/// lost. Returns how many.
pub(crate) async fn reject_stuck(tx: &mut sqlx::PgConnection, millis: i64, reason: &serde_json::Value) -> Result<u64> {
    debug_assert!(JobStatus::Queued.can_become(JobStatus::Rejected));
    let n = sqlx::query(
        "UPDATE jobs SET status = 'rejected', reason = $2, finished_at = now()
         WHERE status = 'queued' AND held_job IS NULL AND NOT parked
           AND COALESCE(dispatched_at, queued_at) < now() - $1 * interval '1 millisecond'",
    )
    .bind(millis)
    .bind(reason)
    .execute(tx)
    .await
    .context("ending stuck jobs")?
    .rows_affected();
    Ok(n)
}

/// What [`reject_undelivered`] did.
pub(crate) enum Undelivered {
    /// Ended `rejected`; it ran in this session, if any.
    Rejected { session_id: Option<String> },
    /// Left alone: it ended or runs already, its copy waits in Postgres, or it is unknown.
    LeftAlone,
}

/// End a job whose message was dead-lettered, in the session store's transaction
/// ([`crate::sessions::SessionStore::end_undelivered`]): still `queued`, and neither held nor
/// parked (their copy is in Postgres, and the dispatcher publishes it), it can no longer reach
/// a worker, so it becomes `rejected`.
pub(crate) async fn reject_undelivered(tx: &mut sqlx::PgConnection, tenant: &str, job_id: &str, reason: &serde_json::Value) -> Result<Undelivered> {
    debug_assert!(JobStatus::Queued.can_become(JobStatus::Rejected));
    let ended: Option<Option<String>> = sqlx::query_scalar(
        "UPDATE jobs SET status = 'rejected', reason = $3, finished_at = now()
         WHERE tenant = $1 AND job_id = $2 AND status = 'queued' AND held_job IS NULL AND NOT parked
         RETURNING session_id",
    )
    .bind(tenant)
    .bind(job_id)
    .bind(reason)
    .fetch_optional(tx)
    .await
    .context("ending a dead-lettered job")?;
    Ok(ended.map_or(Undelivered::LeftAlone, |session_id| Undelivered::Rejected { session_id }))
}

#[cfg(test)]
mod tests {
    use super::{is_permanent, is_unavailable};
    use anyhow::Context;

    #[test]
    fn a_lost_connection_is_an_outage_and_a_data_error_or_a_closed_pool_is_not() {
        let refused = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"));
        assert!(is_unavailable(&anyhow::Error::from(refused).context("claiming job")));
        let timed_out: anyhow::Error = Err::<(), _>(sqlx::Error::PoolTimedOut).context("beginning transaction").unwrap_err();
        assert!(is_unavailable(&timed_out));
        assert!(!is_unavailable(&anyhow::Error::from(sqlx::Error::PoolClosed)));
        assert!(!is_unavailable(&anyhow::Error::from(sqlx::Error::Encode("value too large".into()))));
        assert!(!is_unavailable(&anyhow::anyhow!("a failure of something else")));
    }

    #[test]
    fn a_data_error_is_permanent_and_a_lost_connection_is_not() {
        let encode: anyhow::Error = Err::<(), _>(sqlx::Error::Encode("value too large".into())).context("updating job result").unwrap_err();
        assert!(is_permanent(&encode));
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        assert!(is_permanent(&anyhow::Error::from(json).context("serializing")));
        let gone: anyhow::Error = Err::<(), _>(sqlx::Error::PoolTimedOut).context("beginning result transaction").unwrap_err();
        assert!(!is_permanent(&gone));
        let io = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert!(!is_permanent(&anyhow::Error::from(io)));
    }
}
