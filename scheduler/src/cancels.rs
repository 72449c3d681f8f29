//! Cancel requests (`docs/protocol.md` §2c): a client's ask to stop one of its jobs, published
//! to the intake with the AMQP `type` [`CANCEL_MESSAGE_TYPE`]. The tenant is the one the broker
//! vouches for, as for submissions. A job of a session that is queued or running is forwarded to
//! the worker holding the session, which interrupts it if it is the one running or the next to
//! run; anything else (a one-off job, a job already ended, an unknown id) is only counted.

use anyhow::{Context, Result};
use lapin::Channel;
use sandcell_core::broker;
use sandcell_protocol::cancel::{CancelJob, CancelRequest, CANCEL_MESSAGE_TYPE};
use sqlx::PgPool;

/// Whether a delivery's AMQP `type` marks it a cancel request.
pub fn is_cancel_request(kind: Option<&str>) -> bool {
    kind == Some(CANCEL_MESSAGE_TYPE)
}

/// What became of a cancel request (the `outcome` label of `sandcell_submissions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Sent to the worker holding the job's session.
    Forwarded,
    /// The job is not one a worker could stop: unknown, ended, one-off, or its session is held
    /// by no worker right now.
    NotCancellable,
    /// The message is not a cancel request, or names a tenant its publisher may not.
    Refused,
}

impl Outcome {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Forwarded => "cancel_forwarded",
            Outcome::NotCancellable => "cancel_not_cancellable",
            Outcome::Refused => "cancel_refused",
        }
    }
}

/// Judge one cancel request from `publisher` (`trusted`: it may name any tenant) and forward it.
/// An error is the database's or the broker's: the request may be tried again.
pub async fn handle(pool: &PgPool, publisher_ch: &Channel, body: &[u8], publisher: Option<&str>, trusted: bool) -> Result<Outcome> {
    let Some(publisher) = publisher else { return Ok(Outcome::Refused) };
    let Ok(request) = serde_json::from_slice::<CancelRequest>(body) else { return Ok(Outcome::Refused) };
    if !trusted && request.tenant != publisher {
        return Ok(Outcome::Refused);
    }
    let row: Option<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT j.status, j.session_id, s.worker_id FROM jobs j LEFT JOIN sessions s ON s.session_id = j.session_id \
         WHERE j.tenant = $1 AND j.job_id = $2 AND s.state = 'active'",
    )
    .bind(&request.tenant)
    .bind(&request.job_id)
    .fetch_optional(pool)
    .await
    .context("looking up the job to cancel")?;
    let (status, Some(session_id), Some(worker)) = row.unwrap_or_default() else { return Ok(Outcome::NotCancellable) };
    if status != "queued" && status != "running" {
        return Ok(Outcome::NotCancellable);
    }
    let forward = CancelJob { tenant: request.tenant, job_id: request.job_id, session_id };
    let payload = serde_json::to_vec(&forward).context("serializing a cancel")?;
    let props = broker::json_properties(&forward.job_id).with_type(CANCEL_MESSAGE_TYPE.into());
    broker::publish_confirmed(publisher_ch, &broker::worker_queue(&worker), &payload, props).await?;
    tracing::info!(tenant = %forward.tenant, job_id = %forward.job_id, session_id = %forward.session_id, worker, "cancel forwarded");
    Ok(Outcome::Forwarded)
}
