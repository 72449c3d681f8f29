//! The job state machine: the one place that says which status may follow which.
//!
//! ```text
//!            ┌──────────── rejected            (validation failed at intake, or the
//!            │                                 session it names ended before it ran)
//! submit ──▶ queued ──▶ running ──▶ succeeded | failed | timed_out | oom_killed
//!              │           │                   | infrastructure_error
//!              │           ├──▶ running        (redelivered after a worker died)
//!              │           └──▶ cancelled      (cancelled while it ran)
//!              └──▶ cancelled | infrastructure_error | rejected
//! ```
//!
//! Terminal statuses never change again; the database layer only applies transitions that
//! [`JobStatus::can_become`] allows (its SQL guards list the same source states).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Accepted and recorded; waiting for a worker.
    Queued,
    /// A worker has claimed it and the sandbox is running it.
    Running,
    /// The code ran to completion (Python: no exception; bash: exit code 0).
    Succeeded,
    /// The code ran and failed: a Python exception (see `error`) or a non-zero exit code.
    Failed,
    /// The code exceeded its wall-clock timeout: a one-off job's sandbox was killed; a session's
    /// cell was interrupted (the session keeps its state) or, if it did not stop, its kernel
    /// was replaced (`kernel_restarted`).
    TimedOut,
    /// The sandbox exceeded its memory limit and was killed by the kernel.
    OomKilled,
    /// Cancelled before it finished.
    Cancelled,
    /// The submission was invalid; `reason` says why. It never ran.
    Rejected,
    /// sandcell itself failed (sandbox, store, repeated crashes); `reason` says which part.
    InfrastructureError,
}

impl JobStatus {
    /// Every status, in documentation order.
    pub const ALL: [JobStatus; 9] = [
        JobStatus::Queued,
        JobStatus::Running,
        JobStatus::Succeeded,
        JobStatus::Failed,
        JobStatus::TimedOut,
        JobStatus::OomKilled,
        JobStatus::Cancelled,
        JobStatus::Rejected,
        JobStatus::InfrastructureError,
    ];

    /// The wire name, also the value stored in Postgres.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed => "failed",
            JobStatus::TimedOut => "timed_out",
            JobStatus::OomKilled => "oom_killed",
            JobStatus::Cancelled => "cancelled",
            JobStatus::Rejected => "rejected",
            JobStatus::InfrastructureError => "infrastructure_error",
        }
    }

    /// Parse the stored/wire name.
    pub fn parse(s: &str) -> Option<JobStatus> {
        JobStatus::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// A terminal status is final: the result will not change any more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobStatus::Queued | JobStatus::Running)
    }

    /// Whether a job in `self` may move to `next`.
    pub fn can_become(self, next: JobStatus) -> bool {
        use JobStatus::*;
        match (self, next) {
            // Rejected from queued: a worker refused it before running (its session had ended).
            (Queued, Running | Cancelled | Rejected | InfrastructureError) => true,
            // Redelivery after a worker died mid-job: another worker claims it again.
            (Running, Running) => true,
            (Running, Succeeded | Failed | TimedOut | OomKilled | Cancelled | InfrastructureError) => true,
            _ => false,
        }
    }

    /// The statuses from which `next` may be reached (used to write SQL guards).
    pub fn sources_of(next: JobStatus) -> Vec<JobStatus> {
        JobStatus::ALL.into_iter().filter(|s| s.can_become(next)).collect()
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_statuses_never_change() {
        for from in JobStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in JobStatus::ALL {
                assert!(!from.can_become(to), "{from} -> {to} must be refused");
            }
        }
    }

    #[test]
    fn a_queued_job_cannot_finish_without_running() {
        assert!(!JobStatus::Queued.can_become(JobStatus::Succeeded));
        assert!(JobStatus::Queued.can_become(JobStatus::Running));
        assert_eq!(JobStatus::sources_of(JobStatus::Running), vec![JobStatus::Queued, JobStatus::Running]);
    }

    #[test]
    fn names_round_trip() {
        for s in JobStatus::ALL {
            assert_eq!(JobStatus::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), serde_json::json!(s.as_str()));
        }
    }
}
