//! Error codes: the one list of every machine-readable reason sandcell gives a client.
//!
//! A job that did not produce a normal result carries a [`Reason`] with one of these codes.
//! `docs/protocol.md` has a table generated from [`ErrorCode::ALL`] and [`ErrorCode::meaning`];
//! a test keeps the two in step.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A machine-readable error code. Serialized in `snake_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The message body is not valid JSON.
    MalformedJson,
    /// A field has the wrong JSON type.
    WrongType,
    /// A required field is missing.
    MissingField,
    /// The message has a field the protocol does not define.
    UnknownField,
    /// A field has the right type but a value outside its rules.
    InvalidValue,
    /// `language` is not one sandcell runs.
    UnknownLanguage,
    /// The whole message is larger than the operator allows.
    OversizeMessage,
    /// `code` is larger than the operator allows.
    OversizeCode,
    /// One inline input file, or all of them together, are larger than allowed.
    OversizeFile,
    /// More input files than allowed.
    TooManyFiles,
    /// An input file name is absolute, contains `..`, a NUL byte, or is too long.
    InvalidFilePath,
    /// Two input files have the same path.
    DuplicateFilePath,
    /// An input file's `content_b64` is not valid base64.
    InvalidBase64,
    /// No session with this id belongs to the job's tenant.
    SessionNotFound,
    /// The session's first job has not reached a worker yet.
    SessionNotReady,
    /// The session's keep-alive ran out.
    SessionExpired,
    /// The session was closed.
    SessionClosed,
    /// The session's kernel could not be restarted, or no worker could take it over.
    SessionLost,
    /// The session's kernel died or was killed during the job and was replaced.
    KernelRestarted,
    /// An input file given by `s3_key` could not be fetched (missing, too large).
    UploadFailed,
    /// The sandbox could not be created or started (image missing, Docker down, limits refused).
    SandboxUnavailable,
    /// The in-sandbox driver broke the framing protocol or ended without a result.
    DriverProtocol,
    /// The job's input files could not be placed in the workspace.
    InputFileRejected,
    /// The job's output files could not be stored.
    StorageFailed,
    /// The job was delivered too many times without completing (it keeps crashing workers).
    TooManyAttempts,
    /// The artifact's time to live has passed; it has been deleted.
    ArtifactExpired,
    /// The message carries no broker-validated publisher (`user_id`).
    Unauthenticated,
    /// The body's `tenant` is not the tenant the broker authenticated.
    TenantMismatch,
    /// The tenant is at one of its quotas (sessions, queued jobs, artifact bytes).
    QuotaExceeded,
    /// The code hit the process limit: a fork or thread creation failed.
    PidsLimit,
    /// The workspace (or `/tmp`) filled up: a write failed for lack of space.
    WorkspaceFull,
    /// The result could not be stored as produced; only its status and reason were kept.
    ResultNotStorable,
    /// No worker had room for a new session in time.
    Capacity,
    /// The job stayed queued, or its session starting, past the bound.
    Stuck,
    /// The worker running the job died; the job's session continues on another worker.
    WorkerLost,
}

impl ErrorCode {
    /// Every code, in documentation order.
    pub const ALL: [ErrorCode; 35] = [
        ErrorCode::MalformedJson,
        ErrorCode::WrongType,
        ErrorCode::MissingField,
        ErrorCode::UnknownField,
        ErrorCode::InvalidValue,
        ErrorCode::UnknownLanguage,
        ErrorCode::OversizeMessage,
        ErrorCode::OversizeCode,
        ErrorCode::OversizeFile,
        ErrorCode::TooManyFiles,
        ErrorCode::InvalidFilePath,
        ErrorCode::DuplicateFilePath,
        ErrorCode::InvalidBase64,
        ErrorCode::SessionNotFound,
        ErrorCode::SessionNotReady,
        ErrorCode::SessionExpired,
        ErrorCode::SessionClosed,
        ErrorCode::SessionLost,
        ErrorCode::KernelRestarted,
        ErrorCode::UploadFailed,
        ErrorCode::SandboxUnavailable,
        ErrorCode::DriverProtocol,
        ErrorCode::InputFileRejected,
        ErrorCode::StorageFailed,
        ErrorCode::TooManyAttempts,
        ErrorCode::ArtifactExpired,
        ErrorCode::Unauthenticated,
        ErrorCode::TenantMismatch,
        ErrorCode::QuotaExceeded,
        ErrorCode::PidsLimit,
        ErrorCode::WorkspaceFull,
        ErrorCode::ResultNotStorable,
        ErrorCode::Capacity,
        ErrorCode::Stuck,
        ErrorCode::WorkerLost,
    ];

    /// The wire name (`snake_case`).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::MalformedJson => "malformed_json",
            ErrorCode::WrongType => "wrong_type",
            ErrorCode::MissingField => "missing_field",
            ErrorCode::UnknownField => "unknown_field",
            ErrorCode::InvalidValue => "invalid_value",
            ErrorCode::UnknownLanguage => "unknown_language",
            ErrorCode::OversizeMessage => "oversize_message",
            ErrorCode::OversizeCode => "oversize_code",
            ErrorCode::OversizeFile => "oversize_file",
            ErrorCode::TooManyFiles => "too_many_files",
            ErrorCode::InvalidFilePath => "invalid_file_path",
            ErrorCode::DuplicateFilePath => "duplicate_file_path",
            ErrorCode::InvalidBase64 => "invalid_base64",
            ErrorCode::SessionNotFound => "session_not_found",
            ErrorCode::SessionNotReady => "session_not_ready",
            ErrorCode::SessionExpired => "session_expired",
            ErrorCode::SessionClosed => "session_closed",
            ErrorCode::SessionLost => "session_lost",
            ErrorCode::KernelRestarted => "kernel_restarted",
            ErrorCode::UploadFailed => "upload_failed",
            ErrorCode::SandboxUnavailable => "sandbox_unavailable",
            ErrorCode::DriverProtocol => "driver_protocol",
            ErrorCode::InputFileRejected => "input_file_rejected",
            ErrorCode::StorageFailed => "storage_failed",
            ErrorCode::TooManyAttempts => "too_many_attempts",
            ErrorCode::ArtifactExpired => "artifact_expired",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::TenantMismatch => "tenant_mismatch",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::PidsLimit => "pids_limit",
            ErrorCode::WorkspaceFull => "workspace_full",
            ErrorCode::ResultNotStorable => "result_not_storable",
            ErrorCode::Capacity => "capacity",
            ErrorCode::Stuck => "stuck",
            ErrorCode::WorkerLost => "worker_lost",
        }
    }

    /// One line for the documentation table: when a client sees this code.
    pub fn meaning(self) -> &'static str {
        match self {
            ErrorCode::MalformedJson => "The message body is not valid JSON (or not a JSON object).",
            ErrorCode::WrongType => "A field has the wrong JSON type, e.g. `timeout_ms: \"5\"`.",
            ErrorCode::MissingField => "A required field (`job_id`, `tenant`, `language`, `code`) is missing.",
            ErrorCode::UnknownField => "The message has a field the protocol does not define (typos are not ignored).",
            ErrorCode::InvalidValue => "A value breaks its rule: bad `job_id`/`tenant`/`session` fields, empty code with nothing else to do, both or neither of `content_b64`/`s3_key`.",
            ErrorCode::UnknownLanguage => "`language` is not `python` or `bash`.",
            ErrorCode::OversizeMessage => "The message is larger than `SANDCELL_MAX_MESSAGE_BYTES`.",
            ErrorCode::OversizeCode => "`code` is larger than `SANDCELL_MAX_CODE_BYTES`.",
            ErrorCode::OversizeFile => "An inline file is larger than `SANDCELL_MAX_INLINE_FILE_BYTES`, or all together exceed `SANDCELL_MAX_INLINE_TOTAL_BYTES`.",
            ErrorCode::TooManyFiles => "More than `SANDCELL_MAX_INPUT_FILES` input files.",
            ErrorCode::InvalidFilePath => "An input file or `get_files` path is empty, absolute, has a `..` or empty component, a NUL or control byte, or is too long; or an `s3_key` is outside `<tenant>/_uploads/`.",
            ErrorCode::DuplicateFilePath => "Two input files name the same path.",
            ErrorCode::InvalidBase64 => "An input file's `content_b64` is not standard base64.",
            ErrorCode::SessionNotFound => "`session.id` names no session of this tenant (unknown, or another tenant's: the two are not told apart).",
            ErrorCode::SessionNotReady => "The session's first job has not started yet; submit again once it is running.",
            ErrorCode::SessionExpired => "The session's keep-alive ran out; its variables and files are gone. Open a new session.",
            ErrorCode::SessionClosed => "The session was closed by a job with `session.close`.",
            ErrorCode::SessionLost => "The session's sandbox could not be started or restarted, or no worker could take it over after its worker went away; its state is gone.",
            ErrorCode::KernelRestarted => "The session's kernel died (`os._exit`, OOM) or ignored an interrupt and was replaced: variables and files are gone, the session still works.",
            ErrorCode::UploadFailed => "An input file's `s3_key` object does not exist, is larger than `SANDCELL_MAX_UPLOAD_FILE_BYTES`, or does not fit in what the job's other input files leave of its workspace (`limits.workspace_mb`).",
            ErrorCode::SandboxUnavailable => "The worker could not create or start the sandbox container (infrastructure).",
            ErrorCode::DriverProtocol => "The sandbox ended or spoke out of protocol before reporting a result (infrastructure, or code that killed its own interpreter).",
            ErrorCode::InputFileRejected => "The sandbox refused to write an input file into the workspace.",
            ErrorCode::StorageFailed => "Output files could not be stored in the object store (infrastructure).",
            ErrorCode::TooManyAttempts => "The job was claimed `SANDCELL_MAX_ATTEMPTS` times without completing (`infrastructure_error`), or sandcell failed to handle its message on every try (returned to its queue more than 5 times; a session's job: once, after its tries in place) and dead-lettered it (`rejected`: it never ran). An upload request's grant is `rejected` with it likewise.",
            ErrorCode::ArtifactExpired => "The artifact's TTL has passed and it was deleted from the object store.",
            ErrorCode::Unauthenticated => "The message has no `user_id` property, so the broker did not vouch for its publisher; it is recorded for operators and dead-lettered.",
            ErrorCode::TenantMismatch => "The body's `tenant` differs from the broker user that published it (only operator-trusted publishers may name another tenant); recorded under the publisher's tenant.",
            ErrorCode::QuotaExceeded => "The tenant is at a quota: live sessions, queued and running jobs, or stored bytes (its artifacts and what its live upload grants allow). The message names which; nothing ran.",
            ErrorCode::PidsLimit => "The code hit the sandbox's process limit (`limits.pids`): creating a process or thread failed. The job's status says how it ended.",
            ErrorCode::WorkspaceFull => "The workspace or `/tmp` ran out of space (`limits.workspace_mb`): a write failed. The job's status says how it ended.",
            ErrorCode::ResultNotStorable => "The database refused the result as produced; the job is `infrastructure_error` and the message says why (outputs are not kept).",
            ErrorCode::Capacity => "A job opening a session (or taking a moving one over) found no worker with room for another session within `SANDCELL_SESSION_START_WAIT_S`; nothing ran, the session is `failed` (`lost`).",
            ErrorCode::Stuck => "The job stayed `queued` (or its session `starting`) longer than `SANDCELL_STUCK_AFTER_S`, or `running` 10 minutes past its time limit (its worker lost track of it); it was ended and its quota released.",
            ErrorCode::WorkerLost => "The worker running the job died (or restarted) before it finished. The job is not run again (it may have had effects); a one-off job ends so once its worker is silent for `SANDCELL_WORKER_DEAD_AFTER_S` or starts again, and a session continues on another worker (`moving`, above).",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a job did not run normally: a code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Reason {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// Human-readable explanation, safe to show to the agent.
    pub message: String,
}

/// Most bytes of a reason's message. Messages quote what a client sent (a path, a name, a
/// tenant); one quoting a 16 MiB value would be stored in Postgres for every such message.
pub const MAX_REASON_MESSAGE_BYTES: usize = 4096;

impl Reason {
    /// A reason with the given code and message, cut to [`MAX_REASON_MESSAGE_BYTES`] (at a
    /// character boundary, ending in `…` and how much was cut).
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_REASON_MESSAGE_BYTES {
            let cut = message.len();
            // Room for the note; the note itself is at most 28 bytes.
            let mut end = MAX_REASON_MESSAGE_BYTES - 32;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push_str(&format!("… ({} bytes cut)", cut - end));
        }
        Reason { code, message }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_quoting_a_huge_value_is_cut_at_a_character_boundary() {
        let short = Reason::new(ErrorCode::InvalidValue, "fine");
        assert_eq!(short.message, "fine");
        let huge = Reason::new(ErrorCode::InvalidValue, format!("path {:?} is bad", "é".repeat(8 << 20)));
        assert!(huge.message.len() <= MAX_REASON_MESSAGE_BYTES, "{}", huge.message.len());
        assert!(huge.message.starts_with("path \"éé") && huge.message.ends_with(" bytes cut)"), "{}", huge.message.chars().rev().take(40).collect::<String>());
    }

    #[test]
    fn wire_names_match_serde() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, serde_json::Value::String(code.as_str().to_string()));
        }
    }
}

#[cfg(test)]
mod doc_tests {
    use super::ErrorCode;

    #[test]
    fn every_code_is_documented_in_protocol_md() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md");
        let doc = std::fs::read_to_string(path).expect("docs/protocol.md");
        // Only the error table (section 4); result fields may share a code's name.
        let doc = doc.split("## 4. Errors").nth(1).expect("docs/protocol.md has a section 4. Errors");
        for code in ErrorCode::ALL {
            let row = doc.lines().find(|l| l.starts_with(&format!("| `{}` |", code.as_str())));
            let row = row.unwrap_or_else(|| panic!("docs/protocol.md has no row for `{code}`"));
            assert!(row.ends_with(&format!("| {} |", code.meaning())), "row for `{code}` does not carry its meaning: {row}");
        }
    }
}
