//! What a cell produced: the driver's events folded into an [`Outcome`] with its caps applied.
//!
//! The conversation that produces the events is [`crate::kernel`]'s; this module only decides
//! what each event means for the result (status, capped text, rich outputs, files).

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine as _;
use sandcell_protocol::{ErrorCode, ExecError, ExecutionLimits, JobStatus, Language, LimitHit, Reason, SkippedFile};

use crate::sandbox::protocol::DriverEvent;

/// Most rich outputs kept per job.
const MAX_OUTPUTS: usize = 64;
/// Most workspace entries kept in a listing (the driver sends at most this many).
const MAX_LISTED_FILES: usize = 1000;
/// Most skipped files reported per job.
const MAX_SKIPPED_FILES: usize = 100;

/// Text with a byte cap; what does not fit is dropped and flagged.
#[derive(Debug, Default, Clone)]
pub struct CappedText {
    /// The kept text.
    pub text: String,
    /// Something was dropped.
    pub truncated: bool,
    limit: usize,
}

impl CappedText {
    /// Empty text capped at `limit` bytes.
    pub fn new(limit: u64) -> Self {
        CappedText { text: String::new(), truncated: false, limit: usize::try_from(limit).unwrap_or(usize::MAX) }
    }

    /// Append, cutting at a character boundary when the cap is reached.
    pub fn push(&mut self, s: &str) {
        let room = self.limit.saturating_sub(self.text.len());
        if s.len() <= room {
            self.text.push_str(s);
            return;
        }
        let mut cut = room;
        while cut > 0 && !s.is_char_boundary(cut) {
            cut -= 1;
        }
        self.text.push_str(&s[..cut]);
        self.truncated = true;
    }
}

/// Which kind of rich output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// Last expression's value.
    ExecuteResult,
    /// Displayed object or figure.
    DisplayData,
}

/// A rich output before its binary parts are stored.
#[derive(Debug, Clone)]
pub struct RawOutput {
    /// Kind.
    pub kind: OutputKind,
    /// Text representations.
    pub text: BTreeMap<String, String>,
    /// Binary representations (decoded), by MIME type.
    pub binary: Vec<(String, Vec<u8>)>,
}

/// Everything a job produced, before storage.
#[derive(Debug)]
pub struct Outcome {
    /// Terminal status.
    pub status: JobStatus,
    /// stdout.
    pub stdout: CappedText,
    /// stderr.
    pub stderr: CappedText,
    /// Exit code.
    pub exit_code: Option<i32>,
    /// Exception.
    pub error: Option<ExecError>,
    /// Why the job did not complete normally.
    pub reason: Option<Reason>,
    /// Rich outputs.
    pub outputs: Vec<RawOutput>,
    /// Output files (path, bytes, asked for by `get_files`).
    pub files: Vec<(String, Vec<u8>, bool)>,
    /// Workspace listing, when asked for.
    pub listing: Option<sandcell_protocol::FileListing>,
    /// Sandbox limits the job ran into.
    pub limits_hit: BTreeSet<LimitHit>,
    /// Files not collected, and why.
    pub skipped_files: Vec<SkippedFile>,
    /// Processes the cell left running, killed at its end.
    pub processes_killed: u32,
}

impl Outcome {
    /// An empty outcome under `limits` (status `infrastructure_error` until `done` says otherwise).
    pub fn new(limits: &ExecutionLimits) -> Self {
        Outcome {
            status: JobStatus::InfrastructureError,
            stdout: CappedText::new(limits.stdout_bytes),
            stderr: CappedText::new(limits.stderr_bytes),
            exit_code: None,
            error: None,
            reason: None,
            outputs: Vec::new(),
            files: Vec::new(),
            listing: None,
            limits_hit: BTreeSet::new(),
            skipped_files: Vec::new(),
            processes_killed: 0,
        }
    }

    /// Note a file that was not collected.
    pub fn skip(&mut self, path: String, reason: &str) {
        if matches!(reason, "too_large" | "limit_reached" | "quota_exceeded") {
            self.limits_hit.insert(LimitHit::Artifacts);
        }
        // A job cannot make the result grow without bound by writing many unstorable files.
        if self.skipped_files.len() < MAX_SKIPPED_FILES {
            self.skipped_files.push(SkippedFile { path, reason: reason.to_string() });
        }
    }

    /// Keep the output files that fit in `budget` bytes, in order; skip the rest as
    /// `quota_exceeded` (the tenant's artifact quota).
    pub fn keep_files_within(&mut self, mut budget: u64) {
        let files = std::mem::take(&mut self.files);
        for (path, bytes, requested) in files {
            let size = bytes.len() as u64;
            if size <= budget {
                budget -= size;
                self.files.push((path, bytes, requested));
            } else {
                self.skip(path, "quota_exceeded");
            }
        }
    }

    /// Settle what the limits did: the output caps, and a reason for a failure that a limit
    /// explains (`pids_limit`, `workspace_full`), unless a reason is already set.
    pub fn settle_limits(&mut self, limits: &ExecutionLimits) {
        if self.stdout.truncated || self.stderr.truncated {
            self.limits_hit.insert(LimitHit::Output);
        }
        match self.status {
            JobStatus::TimedOut => {
                self.limits_hit.insert(LimitHit::Time);
            }
            JobStatus::OomKilled => {
                self.limits_hit.insert(LimitHit::Memory);
            }
            _ => {}
        }
        if self.status != JobStatus::Failed || self.reason.is_some() {
            return;
        }
        if self.limits_hit.contains(&LimitHit::Pids) {
            self.reason = Some(Reason::new(
                ErrorCode::PidsLimit,
                format!("the code hit the process limit ({} processes and threads): creating one failed", limits.pids),
            ));
        } else if self.limits_hit.contains(&LimitHit::Workspace) {
            self.reason = Some(Reason::new(
                ErrorCode::WorkspaceFull,
                format!("the workspace ({} MB) or /tmp ran out of space", limits.workspace_mb),
            ));
        }
    }

    /// An outcome for a job that could not run: infrastructure error with a reason.
    pub fn infra(mut self, code: ErrorCode, message: String) -> Self {
        self.status = JobStatus::InfrastructureError;
        self.reason = Some(Reason::new(code, message));
        self
    }
}

/// Fold one driver event into the outcome. Returns true on `done`.
pub fn apply(out: &mut Outcome, event: DriverEvent, language: Language, limits: &ExecutionLimits, file_bytes: &mut u64) -> bool {
    match event {
        DriverEvent::Stream { name, text } => match name.as_str() {
            "stderr" => out.stderr.push(&text),
            _ => out.stdout.push(&text),
        },
        DriverEvent::ExecuteResult { data } => push_output(out, OutputKind::ExecuteResult, data, limits),
        DriverEvent::DisplayData { data } => push_output(out, OutputKind::DisplayData, data, limits),
        DriverEvent::Error { ename, evalue, traceback } => out.error = Some(ExecError { ename, evalue, traceback }),
        DriverEvent::File { path, content_b64, requested } => {
            match base64::engine::general_purpose::STANDARD.decode(content_b64.as_bytes()) {
                Ok(bytes) if out.files.len() < limits.artifact_files as usize && *file_bytes + bytes.len() as u64 <= limits.artifact_bytes => {
                    *file_bytes += bytes.len() as u64;
                    out.files.push((path, bytes, requested));
                }
                Ok(_) => out.skip(path, "limit_reached"),
                Err(e) => {
                    tracing::warn!(path, error = %e, "driver sent a file with invalid base64");
                    out.skip(path, "unreadable");
                }
            }
        }
        DriverEvent::FileSkipped { path, reason } => {
            tracing::debug!(path, reason, "output file not collected");
            out.skip(path, &reason);
        }
        DriverEvent::FileList { mut entries, truncated } => {
            entries.truncate(MAX_LISTED_FILES);
            out.listing = Some(sandcell_protocol::FileListing { entries, truncated });
        }
        DriverEvent::FileError { path, message } => {
            out.reason = Some(Reason::new(ErrorCode::InputFileRejected, format!("input file {path:?}: {message}")));
        }
        DriverEvent::ProtocolError { message } => {
            // The driver could not run the request; nothing more will come for it.
            tracing::warn!(message, "driver reported a protocol error");
            out.status = JobStatus::InfrastructureError;
            out.reason = Some(Reason::new(ErrorCode::DriverProtocol, format!("the sandbox driver failed: {message}")));
            return true;
        }
        DriverEvent::Ready { .. } | DriverEvent::Unknown => {}
        DriverEvent::Done { status, exit_code, stdout_truncated, stderr_truncated, processes_killed, workspace_full } => {
            out.stdout.truncated |= stdout_truncated;
            out.stderr.truncated |= stderr_truncated;
            out.processes_killed = processes_killed;
            if workspace_full {
                out.limits_hit.insert(LimitHit::Workspace);
            }
            out.exit_code = exit_code;
            let ok = match language {
                Language::Python => status == "ok",
                Language::Bash => status == "ok" && exit_code == Some(0),
            };
            out.status = if ok { JobStatus::Succeeded } else { JobStatus::Failed };
            if status == "input_error" && out.reason.is_none() {
                out.reason = Some(Reason::new(ErrorCode::InputFileRejected, "the sandbox refused an input file"));
            }
            return true;
        }
    }
    false
}

/// Marker appended to a text representation cut at the cap.
pub const TRUNCATION_MARKER: &str = "\n…[truncated by sandcell]";

/// Text representations longer than this are stored in full as artifacts; the result keeps
/// this much inline as a preview.
pub const INLINE_OUTPUT_BYTES: u64 = 64 * 1024;

/// Keep rich outputs small in the result row: a text representation longer than
/// [`INLINE_OUTPUT_BYTES`] goes to the object store in full (up to the artifact byte limit) and
/// is cut inline, with a marker; binary representations always go to the store.
fn push_output(out: &mut Outcome, kind: OutputKind, data: BTreeMap<String, serde_json::Value>, limits: &ExecutionLimits) {
    let text_cap = limits.stdout_bytes.min(INLINE_OUTPUT_BYTES);
    if out.outputs.len() >= MAX_OUTPUTS {
        return;
    }
    let mut raw = RawOutput { kind, text: BTreeMap::new(), binary: Vec::new() };
    for (mime, value) in data {
        let is_binary = mime.starts_with("image/") && mime != "image/svg+xml";
        match (is_binary, value) {
            (true, serde_json::Value::String(b64)) => match base64::engine::general_purpose::STANDARD.decode(b64.trim().as_bytes()) {
                Ok(bytes) => raw.binary.push((mime, bytes)),
                Err(e) => tracing::warn!(mime, error = %e, "driver sent undecodable binary output"),
            },
            (_, value) => {
                let s = match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                if s.len() as u64 > INLINE_OUTPUT_BYTES {
                    let mut full = s.clone().into_bytes();
                    full.truncate(usize::try_from(limits.artifact_bytes).unwrap_or(usize::MAX));
                    raw.binary.push((mime.clone(), full));
                }
                raw.text.insert(mime, cap_text(s, text_cap));
            }
        }
    }
    out.outputs.push(raw);
}

fn cap_text(s: String, cap: u64) -> String {
    let mut c = CappedText::new(cap);
    c.push(&s);
    if c.truncated {
        c.text.push_str(TRUNCATION_MARKER);
    }
    c.text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_text_cuts_at_a_char_boundary_and_flags() {
        let mut c = CappedText::new(5);
        c.push("abc");
        c.push("déf");
        assert_eq!(c.text, "abcd");
        assert!(c.truncated);
    }

    #[test]
    fn a_failure_after_a_limit_hit_is_explained_by_that_limit() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let failed_with = |hit: LimitHit| {
            let mut out = Outcome::new(&limits);
            out.status = JobStatus::Failed;
            out.limits_hit.insert(hit);
            out.settle_limits(&limits);
            out.reason.map(|r| r.code)
        };
        assert_eq!(failed_with(LimitHit::Pids), Some(ErrorCode::PidsLimit));
        assert_eq!(failed_with(LimitHit::Workspace), Some(ErrorCode::WorkspaceFull));
        // A success keeps no reason, but still lists what it ran into.
        let mut out = Outcome::new(&limits);
        out.status = JobStatus::Succeeded;
        out.stdout.truncated = true;
        out.limits_hit.insert(LimitHit::Pids);
        out.settle_limits(&limits);
        assert!(out.reason.is_none());
        assert_eq!(out.limits_hit.into_iter().collect::<Vec<_>>(), [LimitHit::Pids, LimitHit::Output]);
    }

    #[test]
    fn files_beyond_the_quota_budget_are_skipped_in_order() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        out.files = vec![("a".into(), vec![0; 600], false), ("b".into(), vec![0; 600], false), ("c".into(), vec![0; 400], false)];
        out.keep_files_within(1000);
        assert_eq!(out.files.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(out.skipped_files, [SkippedFile { path: "b".into(), reason: "quota_exceeded".into() }]);
        assert!(out.limits_hit.contains(&LimitHit::Artifacts));
    }

    #[test]
    fn a_skipped_file_is_reported_and_the_list_is_bounded() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        for n in 0..(MAX_SKIPPED_FILES + 10) {
            out.skip(format!("f{n}"), "not_regular_file");
        }
        assert_eq!(out.skipped_files.len(), MAX_SKIPPED_FILES);
        assert!(out.limits_hit.is_empty(), "a symlink is not a limit");
        out.skip("big".into(), "too_large");
        assert!(out.limits_hit.contains(&LimitHit::Artifacts));
    }

    #[test]
    fn bash_with_nonzero_exit_is_failed_and_python_ok_is_succeeded() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let done = DriverEvent::Done { status: "ok".into(), exit_code: Some(3), stdout_truncated: false, stderr_truncated: false, processes_killed: 0, workspace_full: false };
        assert!(apply(&mut out, done.clone(), Language::Bash, &limits, &mut 0));
        assert_eq!(out.status, JobStatus::Failed);
        let mut out = Outcome::new(&limits);
        apply(&mut out, done, Language::Python, &limits, &mut 0);
        assert_eq!(out.status, JobStatus::Succeeded);
    }

    #[test]
    fn a_huge_repr_is_cut_at_the_cap_with_a_marker() {
        let mut limits = sandcell_protocol::LimitPolicy::default().default;
        limits.stdout_bytes = 10;
        let mut out = Outcome::new(&limits);
        let data = BTreeMap::from([("text/plain".to_string(), serde_json::json!("x".repeat(1000)))]);
        apply(&mut out, DriverEvent::ExecuteResult { data }, Language::Python, &limits, &mut 0);
        assert_eq!(out.outputs[0].text["text/plain"], format!("{}{TRUNCATION_MARKER}", "x".repeat(10)));
    }

    #[test]
    fn a_large_html_output_is_kept_in_full_as_an_artifact_and_previewed_inline() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let html = format!("<table>{}</table>", "<tr><td>1</td></tr>".repeat(10_000));
        let data = BTreeMap::from([("text/html".to_string(), serde_json::json!(html.clone()))]);
        apply(&mut out, DriverEvent::ExecuteResult { data }, Language::Python, &limits, &mut 0);
        let o = &out.outputs[0];
        assert_eq!(o.binary, vec![("text/html".to_string(), html.clone().into_bytes())]);
        assert_eq!(o.text["text/html"].len(), INLINE_OUTPUT_BYTES as usize + TRUNCATION_MARKER.len());
    }

    #[test]
    fn figures_are_decoded_as_binary_and_text_kept_inline() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let data = BTreeMap::from([
            ("image/png".to_string(), serde_json::json!("iVBORw0KGgo=")),
            ("text/plain".to_string(), serde_json::json!("<Figure>")),
        ]);
        apply(&mut out, DriverEvent::DisplayData { data }, Language::Python, &limits, &mut 0);
        assert_eq!(out.outputs[0].binary[0].1[..4], [0x89, b'P', b'N', b'G']);
        assert_eq!(out.outputs[0].text["text/plain"], "<Figure>");
    }
}
