//! The result record: what a client reads back from Postgres (`job_results.result`).
//!
//! The JSON is assembled by the `job_results` view (see `migrations/`): the job row's identity
//! and bookkeeping, merged with the [`Execution`] document the worker committed. [`JobResult`]
//! is its exact shape, and every read decodes it with [`JobResult::from_document`], which
//! refuses unknown fields, so the view and this type cannot drift apart unnoticed.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Reason;
use crate::limits::ExecutionLimits;
use crate::session::Session;
use crate::status::JobStatus;
use crate::submission::Language;

/// Everything known about one job: who and where (`job_id` … `session`, kept by the job's
/// row) and what its code did ([`Execution`], one document written by the worker). The record
/// is flat: a client reads `stdout` next to `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub struct JobResult {
    /// The client's job id.
    pub job_id: String,
    /// Owner.
    pub tenant: String,
    /// Where the job is; terminal statuses never change.
    pub status: JobStatus,
    /// Language, when the submission was valid enough to tell.
    pub language: Option<Language>,
    /// Why the job was rejected or could not run, if so.
    pub reason: Option<Reason>,
    /// Files the job produced, stored in the object store.
    pub artifacts: Vec<Artifact>,
    /// The limits the job ran under (absent for rejected jobs).
    pub limits: Option<ExecutionLimits>,
    /// When things happened.
    pub timings: Timings,
    /// The worker that ran the job.
    pub worker_id: Option<String>,
    /// How many times a worker claimed the job (more than 1 after a worker died mid-job).
    pub attempts: i32,
    /// The session the job ran in, as it is now (absent for one-off jobs).
    pub session: Option<Session>,
    /// What the code did: its output, errors, figures and what it left behind.
    #[serde(flatten)]
    pub execution: Execution,
}

impl JobResult {
    /// Decode a result record strictly: a field this type does not know is an error, so the
    /// `job_results` view and this type cannot drift apart unnoticed. (`deny_unknown_fields`
    /// does not combine with the flattened [`Execution`].)
    pub fn from_document(document: serde_json::Value) -> Result<JobResult, String> {
        let result: JobResult = serde_json::from_value(document.clone()).map_err(|e| format!("decoding a job result: {e}"))?;
        let known = serde_json::to_value(&result).map_err(|e| format!("encoding a job result: {e}"))?;
        if let (Some(got), Some(known)) = (document.as_object(), known.as_object()) {
            let unknown: Vec<&str> = got.keys().filter(|k| !known.contains_key(*k)).map(String::as_str).collect();
            if !unknown.is_empty() {
                return Err(format!("a job result has fields this client does not know: {unknown:?}"));
            }
        }
        Ok(result)
    }
}

/// What a job's code did: the execution part of a result. The worker produces it from the
/// driver's events and stores it as one document (`jobs.execution`), which the `job_results`
/// view merges into the record as it is — a field added here needs no SQL. Empty (the
/// default) until the job has run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Execution {
    /// Captured standard output (UTF-8, invalid bytes replaced), at most `limits.stdout_bytes`.
    pub stdout: String,
    /// Captured standard error, at most `limits.stderr_bytes`.
    pub stderr: String,
    /// Output beyond the cap was dropped.
    pub stdout_truncated: bool,
    /// Error output beyond the cap was dropped.
    pub stderr_truncated: bool,
    /// Process exit code: 0/1 for Python (exception), the script's code for bash.
    pub exit_code: Option<i32>,
    /// The exception the code raised, if any.
    pub error: Option<ExecError>,
    /// Rich outputs in order: the last expression's value, displayed objects, figures.
    pub outputs: Vec<Output>,
    /// The session's kernel died or had to be killed during this job and was replaced by a
    /// fresh one: variables, imports and workspace files are gone (`reason` says why).
    pub kernel_restarted: bool,
    /// Workspace listing after the code ran, when the job asked `list_files`.
    pub files: Option<FileListing>,
    /// The sandbox limits the job ran into, whatever its final status: a fork bomb that
    /// still finished in time has `["pids"]`. Empty when it stayed within every limit.
    pub limits_hit: Vec<LimitHit>,
    /// Workspace files the job wrote or asked for that were not stored, and why.
    pub skipped_files: Vec<SkippedFile>,
    /// Processes the code left running (a background `sleep`, a daemon) that were killed when
    /// the cell ended.
    pub processes_killed: u32,
    /// What the code used while it ran: wall time, and the sandbox's CPU time and peak memory
    /// from its cgroup. Absent until the job has run, and for jobs that never reached a sandbox.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Set on the job that took its session over on another worker (its worker died or
    /// drained): where the session came from, which files were put back, which variables were
    /// lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved: Option<crate::session::SessionMove>,
    /// Python: the kernel's execution count after the cell (a notebook's `In [n]`; in a session,
    /// counted per context). Absent for bash and for a cell that did not finish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<u32>,
}

/// What a job's code used: the cost of one execution. CPU time and peak memory are the
/// sandbox container's (its cgroup's), measured from the moment the job was handed to the
/// sandbox until its code ended: the code, the processes it started and the sandbox's own
/// bookkeeping for the job. They are absent where the worker cannot read the sandbox's cgroup
/// (see `SANDCELL_CGROUP_ROOT`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// Wall-clock time from handing the job to the sandbox until its code ended, in
    /// milliseconds.
    pub wall_ms: f64,
    /// CPU time the sandbox used meanwhile (user and system, all its processes), in
    /// milliseconds.
    pub cpu_ms: Option<f64>,
    /// The sandbox's highest memory use meanwhile, in bytes (page cache included): for a
    /// one-off job this includes the pre-imported interpreter the job was forked from.
    pub peak_memory_bytes: Option<u64>,
}

/// A sandbox limit a job ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LimitHit {
    /// The memory limit: the kernel's OOM killer ended a process (`status: oom_killed`).
    Memory,
    /// The wall clock (`status: timed_out`).
    Time,
    /// The process limit: a fork or thread creation failed (`reason.code: pids_limit` when
    /// the job failed).
    Pids,
    /// The workspace or `/tmp` quota: a write failed for lack of space (`reason.code:
    /// workspace_full` when the job failed).
    Workspace,
    /// The stdout or stderr cap: output was dropped (`stdout_truncated`/`stderr_truncated`).
    Output,
    /// The artifact limits (files per job, bytes per file or job, the tenant's stored bytes):
    /// some files were not stored (see `skipped_files`).
    Artifacts,
}

/// A workspace file that was not stored as an artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SkippedFile {
    /// Path relative to the workspace.
    pub path: String,
    /// Why: `not_regular_file` (a symlink, device, directory, or a path through a symlink),
    /// `too_large`, `limit_reached` (files or bytes per job), `quota_exceeded` (the tenant's
    /// stored artifact bytes), `unreadable`, `not_found`, `invalid_path`.
    pub reason: String,
}

/// The workspace's regular files after a job (symlinks and tool caches are not listed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileListing {
    /// Files sorted by path.
    pub entries: Vec<FileEntry>,
    /// More files existed than are listed (at most 1000 are, whose paths take at most 256 KiB).
    pub truncated: bool,
}

/// One listed file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Path relative to the workspace.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: f64,
}

/// A Python exception, Jupyter-style.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecError {
    /// Exception class name, e.g. `ZeroDivisionError`.
    pub ename: String,
    /// `str(exception)`, e.g. `division by zero`.
    pub evalue: String,
    /// Traceback lines, plain text.
    pub traceback: Vec<String>,
}

/// One rich output, in the order the code produced it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Output {
    /// The value of the cell's last expression.
    ExecuteResult {
        /// Text representations by MIME type (`text/plain`, `text/html`, ...).
        data: BTreeMap<String, String>,
        /// Representations stored as artifacts, by MIME type → artifact path.
        #[serde(default)]
        artifacts: BTreeMap<String, String>,
    },
    /// An object displayed by the code (`display(...)`, a matplotlib figure).
    DisplayData {
        /// Text representations by MIME type.
        data: BTreeMap<String, String>,
        /// Binary representations (e.g. `image/png`) stored as artifacts: MIME type → artifact path.
        #[serde(default)]
        artifacts: BTreeMap<String, String>,
    },
}

/// Where an artifact came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// A file the code wrote in the workspace.
    File,
    /// A rich output (figure) captured from the interpreter; path is `_display/N.ext`.
    Display,
    /// An unchanged workspace file the job asked for in `get_files`.
    Fetched,
}

/// Whether an artifact can still be downloaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactState {
    /// In the object store; `download_url` works until `expires_at`.
    Available,
    /// Deleted by the TTL sweeper; fetching it answers `artifact_expired`.
    Expired,
}

/// A stored output file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// Path relative to the workspace (or `_display/N.png` for figures).
    pub path: String,
    /// File or rich output.
    pub kind: ArtifactKind,
    /// Size in bytes.
    pub size_bytes: i64,
    /// MIME type guessed from the extension.
    pub content_type: String,
    /// Hex SHA-256 of the content.
    pub sha256: String,
    /// Object key in the bucket: `<tenant>/<job_id>/<path>`.
    pub s3_key: String,
    /// When the artifact expires and is deleted.
    pub expires_at: DateTime<Utc>,
    /// Available or expired.
    pub state: ArtifactState,
    /// Presigned GET URL, valid until `expires_at`; null once expired.
    pub download_url: Option<String>,
}

/// Timestamps of a job's life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Timings {
    /// When the scheduler recorded the submission.
    pub queued_at: DateTime<Utc>,
    /// When the scheduler handed it to the workers' queue: the time its message carries,
    /// recorded by the worker's claim (by the dispatcher itself for jobs held for fair share or
    /// parked while their session moved). Absent until a worker claims the job, and for jobs
    /// never dispatched (rejected or refused ones).
    #[serde(default)]
    pub dispatched_at: Option<DateTime<Utc>>,
    /// When a worker started running it.
    pub started_at: Option<DateTime<Utc>>,
    /// When the result was committed.
    pub finished_at: Option<DateTime<Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn queued() -> serde_json::Value {
        let mut v = json!({
            "job_id": "j", "tenant": "t", "status": "queued", "language": "python", "reason": null,
            "artifacts": [], "limits": null, "timings": {"queued_at": "2026-11-22T12:00:00Z", "started_at": null, "finished_at": null},
            "worker_id": null, "attempts": 0, "session": null,
        });
        let execution = serde_json::to_value(Execution::default()).unwrap();
        v.as_object_mut().unwrap().extend(execution.as_object().unwrap().clone());
        v
    }

    #[test]
    fn a_record_is_its_row_merged_with_the_execution_document() {
        let mut v = queued();
        v["stdout"] = json!("4\n");
        v["processes_killed"] = json!(2);
        let r = JobResult::from_document(v).unwrap();
        assert_eq!(r.execution.stdout, "4\n");
        assert_eq!(r.execution.processes_killed, 2);
        assert_eq!(r.status, JobStatus::Queued);
    }

    #[test]
    fn a_field_the_type_does_not_know_is_refused() {
        let mut v = queued();
        v["cpu_seconds"] = json!(1.5);
        let err = JobResult::from_document(v).unwrap_err();
        assert!(err.contains("cpu_seconds"), "{err}");
    }

    #[test]
    fn a_missing_execution_field_is_refused() {
        let mut v = queued();
        v.as_object_mut().unwrap().remove("stderr");
        assert!(JobResult::from_document(v).is_err());
    }
}
