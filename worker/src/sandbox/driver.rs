//! The driver protocol's messages, as the worker sees them.
//!
//! The worker sends one [`ExecuteRequest`] per cell; the driver answers with a stream of
//! [`DriverEvent`]s ending in [`DriverEvent::Done`], and for a fresh request one
//! [`DriverEvent::Settled`] after it. Fields the worker does not use are ignored,
//! so the driver may add information without breaking older workers.

use std::collections::BTreeMap;

use sandcell_protocol::{ExecutionJob, ExecutionLimits, InputFile, Language};
use serde::{Deserialize, Serialize};

/// Version of the driver protocol this worker speaks.
pub const DRIVER_PROTOCOL_VERSION: u32 = 6;

/// Prepare a sandbox for fresh requests before the first one (see the driver's `prepare`).
#[derive(Debug, Serialize)]
pub struct PrepareRequest {
    /// Always `prepare`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Echoed on the answer.
    pub id: &'static str,
}

impl Default for PrepareRequest {
    fn default() -> Self {
        PrepareRequest { kind: "prepare", id: "prepare" }
    }
}

/// Run one cell.
#[derive(Debug, Serialize)]
pub struct ExecuteRequest<'a> {
    /// Always `execute`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Echoed on every event.
    pub id: &'a str,
    /// Language of `code`.
    pub language: Language,
    /// The code.
    pub code: &'a str,
    /// Files to write into the workspace first.
    pub files: &'a [InputFile],
    /// Informational: the worker enforces the wall clock itself.
    pub timeout_ms: u64,
    /// stdout cap in bytes.
    pub stdout_limit: u64,
    /// stderr cap in bytes.
    pub stderr_limit: u64,
    /// Largest single output file collected.
    pub max_file_bytes: u64,
    /// Most output files collected.
    pub max_artifact_files: u32,
    /// Most output bytes collected.
    pub max_artifact_bytes: u64,
    /// Files to send back whether changed or not.
    pub get_files: &'a [String],
    /// Send a workspace listing after the cell.
    pub list_files: bool,
    /// Run the code in a process forked for it from a kernel that never ran user code, and
    /// empty everything the job could write afterwards (a one-off job in a sandbox reused for
    /// its tenant); otherwise the code runs in the kernel and its state persists (a session).
    pub fresh: bool,
    /// Environment variables of this cell's code only.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: &'a BTreeMap<String, String>,
    /// The session's Python namespace to run in (absent: the default one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<&'a str>,
}

impl<'a> ExecuteRequest<'a> {
    /// The request for `job`'s code, with its inputs `files` (resolved to inline content)
    /// under `limits`; `fresh` for a one-off job.
    pub fn new(job: &'a ExecutionJob, files: &'a [InputFile], limits: &ExecutionLimits, fresh: bool) -> Self {
        ExecuteRequest {
            kind: "execute",
            id: &job.job_id,
            language: job.language,
            code: &job.code,
            files,
            timeout_ms: limits.timeout_ms,
            stdout_limit: limits.stdout_bytes,
            stderr_limit: limits.stderr_bytes,
            max_file_bytes: limits.artifact_bytes,
            max_artifact_files: limits.artifact_files,
            max_artifact_bytes: limits.artifact_bytes,
            get_files: &job.get_files,
            list_files: job.list_files,
            fresh,
            env: &job.env,
            context: job.context.as_deref(),
        }
    }
}

/// One message from the driver.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DriverEvent {
    /// The driver is up.
    Ready {
        /// Protocol version it speaks.
        driver_version: u32,
        /// User code runs in a kernel process under another uid than the driver. The worker
        /// runs no job in a sandbox where it does not (an image or container user that does
        /// not match this worker).
        #[serde(default)]
        kernel_isolated: bool,
    },
    /// Output text.
    Stream {
        /// `stdout` or `stderr`.
        name: String,
        /// The text.
        text: String,
    },
    /// Value of the last expression.
    ExecuteResult {
        /// MIME bundle (binary types base64).
        data: BTreeMap<String, serde_json::Value>,
    },
    /// A displayed object or captured figure.
    DisplayData {
        /// MIME bundle (binary types base64).
        data: BTreeMap<String, serde_json::Value>,
    },
    /// The cell raised.
    Error {
        /// Exception class.
        ename: String,
        /// Exception message.
        evalue: String,
        /// Traceback lines.
        traceback: Vec<String>,
    },
    /// An output file; its bytes follow as [`DriverEvent::FileData`] chunks.
    File {
        /// Workspace-relative path.
        path: String,
        /// Its size in bytes (what the chunks must add up to).
        size: u64,
        /// Sent because the job named it in `get_files` (it may be unchanged).
        #[serde(default)]
        requested: bool,
    },
    /// The next chunk (at most 1 MiB) of the file announced last.
    FileData {
        /// The bytes, base64.
        content_b64: String,
    },
    /// The workspace listing asked for with `list_files`.
    FileList {
        /// Regular files, sorted by path.
        entries: Vec<sandcell_protocol::FileEntry>,
        /// More files exist than listed.
        #[serde(default)]
        truncated: bool,
    },
    /// An output file that was not collected.
    FileSkipped {
        /// Workspace-relative path.
        path: String,
        /// Why (`not_regular_file`, `too_large`, `limit_reached`, `not_found`, `invalid_path`).
        reason: String,
    },
    /// An input file could not be written.
    FileError {
        /// The path.
        path: String,
        /// Why.
        message: String,
    },
    /// The answer to a [`PrepareRequest`]: the kernel forked the first fresh request's process.
    Prepared {
        /// The kernel answered as it was when it became ready (else the sandbox is not used).
        ready: bool,
    },
    /// The driver could not understand the request or failed internally.
    ProtocolError {
        /// What went wrong.
        message: String,
    },
    /// The cell is over.
    Done {
        /// `ok`, `error` or `input_error`.
        status: String,
        /// Exit code (0/1 for Python).
        exit_code: Option<i32>,
        /// Driver dropped stdout beyond the cap.
        #[serde(default)]
        stdout_truncated: bool,
        /// Driver dropped stderr beyond the cap.
        #[serde(default)]
        stderr_truncated: bool,
        /// Processes the cell left running, killed at its end.
        #[serde(default)]
        processes_killed: u32,
        /// The workspace or `/tmp` filled up.
        #[serde(default)]
        workspace_full: bool,
        /// The kernel's execution count after the cell.
        #[serde(default)]
        execution_count: Option<u32>,
    },
    /// After the `done` of a fresh request, its last frame: the job's process has exited and
    /// the driver cleaned up after it. Sent apart so that the job's result waits for neither.
    Settled {
        /// Nothing of the job is left (files, processes, IPC objects) and the kernel lives as
        /// it was, so the sandbox may take its tenant's next one-off job.
        reusable: bool,
    },
    /// A message type this worker does not know; ignored.
    #[serde(other)]
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_events_decode_and_ignore_extra_fields() {
        let e: DriverEvent = serde_json::from_str(r#"{"type":"stream","id":"j","name":"stdout","text":"hi\n"}"#).unwrap();
        assert_eq!(e, DriverEvent::Stream { name: "stdout".into(), text: "hi\n".into() });
        let e: DriverEvent =
            serde_json::from_str(r#"{"type":"done","id":"j","status":"ok","exit_code":0,"stdout_truncated":false,"stderr_truncated":true,"duration_ms":3.2}"#)
                .unwrap();
        assert_eq!(
            e,
            DriverEvent::Done {
                status: "ok".into(),
                exit_code: Some(0),
                stdout_truncated: false,
                stderr_truncated: true,
                processes_killed: 0,
                workspace_full: false,
                execution_count: None
            }
        );
        let e: DriverEvent = serde_json::from_str(r#"{"type":"settled","id":"j","reusable":true}"#).unwrap();
        assert_eq!(e, DriverEvent::Settled { reusable: true });
        let e: DriverEvent = serde_json::from_str(r#"{"type":"something_new","x":1}"#).unwrap();
        assert_eq!(e, DriverEvent::Unknown);
    }
}
