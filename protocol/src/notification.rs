//! What a tenant's notification channel says about a job: the payload of the one `NOTIFY` sent
//! when the job's status becomes final (`docs/protocol.md` §2, `migrations/0017`).
//!
//! It carries the job's whole result record when that fits a notification, so a client that
//! was listening needs no read after it; when it does not fit (a notification must be shorter
//! than 8,000 bytes: a job with a large stdout, many outputs or artifacts), `result` is absent
//! and the client reads the row from `job_results` as before.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{JobResult, JobStatus};

/// A job's final notification.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobNotification {
    /// The job's tenant.
    pub tenant: String,
    /// The job.
    pub job_id: String,
    /// Its status, always final.
    pub status: JobStatus,
    /// The job's result record as `job_results` shows it at the commit that made the status
    /// final; absent when the notification could not hold it (read the row then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<JobResult>,
}

impl JobNotification {
    /// Decode a notification's payload: `None` for one that is not about a job (an upload's
    /// grant is announced on the same channel), an error for a payload that says no job's
    /// tenant, id and status. A result record that does not decode as strictly as a row read
    /// from `job_results` ([`JobResult::from_document`]), or that is another job's, is left
    /// out: the client then reads the row, and that read reports what is wrong with it.
    pub fn parse(payload: &str) -> Result<Option<JobNotification>, String> {
        let mut doc: serde_json::Value = serde_json::from_str(payload).map_err(|e| format!("a notification is not JSON: {e}"))?;
        let Some(fields) = doc.as_object_mut() else { return Err("a notification is not a JSON object".into()) };
        if !fields.contains_key("job_id") {
            return Ok(None);
        }
        let result = fields.remove("result").and_then(|r| JobResult::from_document(r).ok());
        let mut n: JobNotification = serde_json::from_value(doc).map_err(|e| format!("decoding a job's notification: {e}"))?;
        n.result = result.filter(|r| (r.tenant.as_str(), r.job_id.as_str(), r.status) == (n.tenant.as_str(), n.job_id.as_str(), n.status));
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A result record as `job_results` builds it (the row's part merged with an execution).
    fn record(job_id: &str, status: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "job_id": job_id, "tenant": "acme", "status": status, "language": "python", "reason": null,
            "artifacts": [], "limits": null, "timings": {"queued_at": "2026-11-25T12:00:00Z", "started_at": null, "finished_at": null},
            "worker_id": "w1", "attempts": 1, "session": null,
        });
        let mut execution = serde_json::to_value(crate::Execution::default()).expect("an execution encodes");
        execution["stdout"] = serde_json::json!("2\n");
        if let (Some(v), Some(e)) = (v.as_object_mut(), execution.as_object()) {
            v.extend(e.clone());
        }
        v
    }

    fn parsed(payload: serde_json::Value) -> JobNotification {
        match JobNotification::parse(&payload.to_string()) {
            Ok(Some(n)) => n,
            other => panic!("expected a job's notification, got {other:?}"),
        }
    }

    #[test]
    fn a_notification_with_the_result_carries_it() {
        let n = parsed(serde_json::json!({"tenant": "acme", "job_id": "j1", "status": "succeeded", "result": record("j1", "succeeded")}));
        assert_eq!(n.status, JobStatus::Succeeded);
        assert_eq!(n.result.map(|r| r.execution.stdout), Some("2\n".to_string()));
    }

    #[test]
    fn a_result_the_client_cannot_read_strictly_is_left_for_the_row_read() {
        let mut unknown = record("j1", "succeeded");
        unknown["surprise"] = serde_json::json!(1);
        let n = parsed(serde_json::json!({"tenant": "acme", "job_id": "j1", "status": "succeeded", "result": unknown}));
        assert_eq!((n.status, n.result), (JobStatus::Succeeded, None));
    }

    #[test]
    fn a_notification_without_the_result_says_only_the_status() {
        let n = JobNotification::parse(r#"{"tenant":"acme","job_id":"j1","status":"failed"}"#).expect("decodes").expect("a job's");
        assert_eq!((n.status, n.result.is_none()), (JobStatus::Failed, true));
    }

    #[test]
    fn an_uploads_notification_is_not_a_jobs() {
        let parsed = JobNotification::parse(r#"{"tenant":"acme","upload_id":"u1","status":"ready"}"#).expect("decodes");
        assert!(parsed.is_none());
    }

    #[test]
    fn another_jobs_result_is_left_out_and_a_payload_without_a_job_is_an_error() {
        let n = parsed(serde_json::json!({"tenant": "acme", "job_id": "j1", "status": "succeeded", "result": record("j2", "succeeded")}));
        assert_eq!((n.job_id.as_str(), n.result), ("j1", None));
        assert!(JobNotification::parse("not json").is_err());
        assert!(JobNotification::parse(r#"{"job_id":"j1"}"#).is_err());
    }
}
