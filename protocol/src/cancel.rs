//! Cancelling a job: a client asks on the intake (AMQP `type` [`CANCEL_MESSAGE_TYPE`]); the
//! scheduler forwards it to the worker holding the job's session ([`CancelJob`]), which
//! interrupts the job's cell if it is the one running (then, as at a timeout, kills it after the
//! grace). The job ends `cancelled`, the session keeps its state when the interrupt sufficed.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The AMQP `type` of a cancel request (on the intake) and of a forwarded cancel (on a
/// worker's queue).
pub const CANCEL_MESSAGE_TYPE: &str = "sandcell.cancel";

/// A client's request to stop one of its jobs (published to `sandcell.intake` with the AMQP
/// `type` `sandcell.cancel`, `user_id` as for a submission, and the job's session id as the
/// routing key). Only a job of a session that is running, or next to run, is stopped; otherwise
/// the request does nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// The job's tenant (must be the publisher's unless it is trusted).
    pub tenant: String,
    /// The job to stop.
    pub job_id: String,
}

/// A cancel forwarded by the scheduler to `sandcell.worker.<id>` of the worker holding the
/// job's session (internal).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelJob {
    /// The job's tenant.
    pub tenant: String,
    /// The job to stop.
    pub job_id: String,
    /// Its session.
    pub session_id: String,
}
