//! Live output: the events a worker publishes while a job runs, for the tenant that submitted it.
//!
//! Events travel on the topic exchange [`EVENTS_EXCHANGE`] with the routing key
//! [`routing_key`]`(tenant, job_id)`; the broker lets each tenant bind only keys that start with
//! its own name (topic authorisation), so no tenant can hear another's jobs. They are a
//! convenience, not the record: they are published without confirms and may be missed (no
//! subscriber yet, a broker restart, a worker's full buffer); the job's row in Postgres is the
//! result, complete, whatever happened to its events.
//!
//! Within one attempt of a job, `seq` counts from 0 without gaps on the worker's side; a client
//! that sees a gap missed an event. A job that is run again (its worker died) starts a new
//! `attempt` from `seq` 0. The last event of an attempt is `end`, sent once its result is
//! committed: after it the row is there to read.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result::ExecError;
use crate::JobStatus;

impl EventBody {
    /// The event of an exception.
    pub fn error(e: &ExecError) -> Self {
        EventBody::Error { ename: e.ename.clone(), evalue: e.evalue.clone(), traceback: e.traceback.clone() }
    }
}

/// The topic exchange live output is published to.
pub const EVENTS_EXCHANGE: &str = "sandcell.events";

/// The routing key of a job's events: `<tenant>.<job_id>`. Tenant names hold no `.`, so the
/// first word is always the tenant.
pub fn routing_key(tenant: &str, job_id: &str) -> String {
    format!("{tenant}.{job_id}")
}

/// One event of a running job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobEvent {
    /// The tenant that submitted the job.
    pub tenant: String,
    /// The job.
    pub job_id: String,
    /// Which run of the job (1 for the first; more when a worker died and it ran again).
    pub attempt: u32,
    /// Position within the attempt, from 0, without gaps.
    pub seq: u64,
    /// What happened.
    #[serde(flatten)]
    pub body: EventBody,
}

/// What an event says, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventBody {
    /// Text the code wrote to stdout. Counted against the job's stdout limit: what the result
    /// drops, no event carries.
    Stdout {
        /// The text.
        text: String,
    },
    /// Text the code wrote to stderr (within the stderr limit).
    Stderr {
        /// The text.
        text: String,
    },
    /// A rich output: the last expression's value or a displayed object (a chart).
    Output {
        /// `execute_result` or `display_data`.
        output_type: String,
        /// MIME type → representation: text as it is, images (`image/png`, …) base64-encoded.
        /// An image larger than [`MAX_INLINE_EVENT_BYTES`] is left out (listed in `omitted`):
        /// the result stores it as an artifact.
        data: BTreeMap<String, String>,
        /// MIME types left out of `data` for their size.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        omitted: Vec<String>,
    },
    /// The exception the code ended with (as the result's `error`).
    Error {
        /// Exception class name, e.g. `ZeroDivisionError`.
        ename: String,
        /// `str(exception)`.
        evalue: String,
        /// Traceback lines, plain text.
        traceback: Vec<String>,
    },
    /// The attempt is over and its result committed (read it from `job_results`).
    End {
        /// The job's status.
        status: JobStatus,
    },
}

/// Largest image, in bytes before base64, an `output` event carries.
pub const MAX_INLINE_EVENT_BYTES: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_flat_json_tagged_by_type() {
        let e = JobEvent { tenant: "acme".into(), job_id: "j1".into(), attempt: 1, seq: 3, body: EventBody::Stdout { text: "a\n".into() } };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v, serde_json::json!({"tenant": "acme", "job_id": "j1", "attempt": 1, "seq": 3, "type": "stdout", "text": "a\n"}));
        assert_eq!(serde_json::from_value::<JobEvent>(v).unwrap(), e);
        let end = JobEvent { seq: 4, body: EventBody::End { status: JobStatus::Succeeded }, ..e };
        assert_eq!(serde_json::to_value(&end).unwrap()["status"], "succeeded");
    }

    #[test]
    fn an_error_event_carries_the_traceback_at_its_top_level() {
        let e = JobEvent {
            tenant: "acme".into(),
            job_id: "j1".into(),
            attempt: 1,
            seq: 0,
            body: EventBody::error(&ExecError { ename: "ZeroDivisionError".into(), evalue: "division by zero".into(), traceback: vec!["tb".into()] }),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["ename"], "ZeroDivisionError");
        assert_eq!(v["traceback"], serde_json::json!(["tb"]));
        assert_eq!(serde_json::from_value::<JobEvent>(v).unwrap(), e);
    }

    #[test]
    fn the_routing_key_starts_with_the_tenant() {
        assert_eq!(routing_key("acme", "job.1"), "acme.job.1");
    }
}
