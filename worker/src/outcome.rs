//! What a cell produced: the driver's events folded into an [`Outcome`] with its caps applied.
//!
//! The conversation that produces the events is [`crate::kernel`]'s; this module only decides
//! what each event means for the result (status, capped text, rich outputs, files).

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine as _;
use sandcell_core::jobs::Finished;
use sandcell_protocol::paths::validate_workspace_path;
use sandcell_protocol::{ErrorCode, ExecError, Execution, ExecutionLimits, JobStatus, Language, LimitHit, Reason, SkippedFile};

use crate::sandbox::driver::DriverEvent;

/// Most rich outputs kept per job.
const MAX_OUTPUTS: usize = 64;
/// Most workspace entries kept in a listing (the driver sends at most this many).
const MAX_LISTED_FILES: usize = 1000;
/// Path bytes of a listing's entries, all together.
const MAX_LISTED_PATH_BYTES: usize = 256 * 1024;
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
    /// Binary representations (decoded) to store as artifacts.
    pub binary: Vec<DisplayPart>,
}

/// One binary (or oversize text) representation of a rich output, stored as an artifact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisplayPart {
    /// MIME type.
    pub mime: String,
    /// Artifact path: `_display/<n>.<ext>`, unique within the job.
    pub path: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// An output file arriving in chunks.
#[derive(Debug)]
struct Incoming {
    file: OutputFile,
    size: u64,
    /// Fits the job's artifact limits (room was reserved); otherwise its chunks are dropped.
    admitted: bool,
}

/// An output file before it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFile {
    /// Workspace-relative path (checked by the path rules).
    pub path: String,
    /// The bytes.
    pub bytes: Vec<u8>,
    /// Sent because the job named it in `get_files`.
    pub requested: bool,
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
    /// Output files.
    pub files: Vec<OutputFile>,
    /// Artifacts (files and display parts) kept so far, and their bytes: both count against
    /// the job's `artifact_files` and `artifact_bytes`.
    artifacts_kept: (u32, u64),
    /// Display parts named so far (for unique `_display/<n>` paths).
    display_parts: u32,
    /// Bytes of rich outputs' text kept inline so far: all together they stay within the job's
    /// `stdout_bytes`, as its printed output does ([`push_output`]).
    inline_output_bytes: u64,
    /// The file whose chunks are arriving: announced, with its expected size; `None` bytes
    /// when it does not fit the job's limits (its chunks are read and dropped).
    incoming: Option<Incoming>,
    /// Workspace listing, when asked for.
    pub listing: Option<sandcell_protocol::FileListing>,
    /// Sandbox limits the job ran into.
    pub limits_hit: BTreeSet<LimitHit>,
    /// Files not collected, and why.
    pub skipped_files: Vec<SkippedFile>,
    /// Processes the cell left running, killed at its end.
    pub processes_killed: u32,
    /// What the cell used ([`crate::sandbox::cgroup`]), once it has run.
    pub usage: Option<sandcell_protocol::Usage>,
    /// The driver ended the request with `done` (not a protocol error): of a fresh request, a
    /// `settled` frame follows ([`crate::kernel::Kernel::settle`]).
    pub done: bool,
    /// The kernel's execution count after the cell (Python).
    pub execution_count: Option<u32>,
}

impl Outcome {
    /// What the commit records: the status, the reason and the execution document, with the
    /// files and rich outputs still to upload (their stored form fills `execution.outputs`).
    pub fn into_finished(self, extras: Extras) -> (Finished, Vec<OutputFile>, Vec<RawOutput>) {
        let execution = Execution {
            stdout: self.stdout.text,
            stderr: self.stderr.text,
            stdout_truncated: self.stdout.truncated,
            stderr_truncated: self.stderr.truncated,
            exit_code: self.exit_code,
            error: self.error,
            outputs: Vec::new(),
            kernel_restarted: extras.kernel_restarted,
            files: self.listing,
            limits_hit: self.limits_hit.into_iter().collect(),
            skipped_files: self.skipped_files,
            processes_killed: self.processes_killed,
            usage: self.usage,
            moved: extras.moved,
            execution_count: self.execution_count,
        };
        let fin =
            Finished { status: self.status, reason: self.reason, execution, artifacts: Vec::new(), container_id: extras.container_id, session: extras.session };
        (fin, self.files, self.outputs)
    }

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
            artifacts_kept: (0, 0),
            display_parts: 0,
            inline_output_bytes: 0,
            incoming: None,
            listing: None,
            limits_hit: BTreeSet::new(),
            skipped_files: Vec::new(),
            processes_killed: 0,
            usage: None,
            done: false,
            execution_count: None,
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

    /// Whether one more artifact of `size` bytes fits the job's limits; counts it if so.
    fn admit_artifact(&mut self, size: u64, limits: &ExecutionLimits) -> bool {
        let (count, bytes) = self.artifacts_kept;
        if count >= limits.artifact_files || bytes.saturating_add(size) > limits.artifact_bytes {
            return false;
        }
        self.artifacts_kept = (count + 1, bytes + size);
        true
    }

    /// An output file is announced: its path must pass the path rules and be new in this job,
    /// and its size must fit the job's artifact limits; otherwise it is skipped, with why, and
    /// its chunks are dropped as they come.
    fn begin_file(&mut self, path: String, size: u64, requested: bool, limits: &ExecutionLimits) {
        self.end_file();
        let refusal = if validate_workspace_path(&path).is_err() {
            Some("invalid_path")
        } else if self.files.iter().any(|f| f.path == path) {
            // Two names the sandbox could not tell apart (e.g. undecodable bytes): neither
            // may stand for the other.
            Some("duplicate_path")
        } else if !self.admit_artifact(size, limits) {
            Some("limit_reached")
        } else {
            None
        };
        if let Some(reason) = refusal {
            self.skip(path.clone(), reason);
        }
        let bytes = if refusal.is_none() { Vec::with_capacity(usize::try_from(size.min(1 << 20)).unwrap_or(0)) } else { Vec::new() };
        self.incoming = Some(Incoming { file: OutputFile { path, bytes, requested }, size, admitted: refusal.is_none() });
    }

    /// The next chunk of the announced file. More bytes than announced (or a chunk without a
    /// file) is the sandbox breaking the protocol.
    fn file_chunk(&mut self, bytes: &[u8]) -> Result<(), String> {
        let Some(incoming) = self.incoming.as_mut() else { return Err("a file_data frame without a file".into()) };
        if incoming.admitted {
            if incoming.file.bytes.len() as u64 + bytes.len() as u64 > incoming.size {
                return Err(format!("file {:?} sent more than its announced {} bytes", incoming.file.path, incoming.size));
            }
            incoming.file.bytes.extend_from_slice(bytes);
        }
        Ok(())
    }

    /// The announced file is complete (another frame came): keep it if all its bytes arrived.
    fn end_file(&mut self) {
        let Some(incoming) = self.incoming.take() else { return };
        if !incoming.admitted {
            return;
        }
        if incoming.file.bytes.len() as u64 == incoming.size {
            self.files.push(incoming.file);
        } else {
            let (count, bytes) = self.artifacts_kept;
            self.artifacts_kept = (count.saturating_sub(1), bytes.saturating_sub(incoming.size));
            self.skip(incoming.file.path, "unreadable");
        }
    }

    /// Take a whole output file (in tests; the driver's files arrive in chunks).
    #[cfg(test)]
    pub fn admit_file(&mut self, file: OutputFile, limits: &ExecutionLimits) {
        let OutputFile { path, bytes, requested } = file;
        self.begin_file(path, bytes.len() as u64, requested, limits);
        // The size was announced by us: the chunk cannot overflow it.
        let _ = self.file_chunk(&bytes);
        self.end_file();
    }

    /// Keep the artifacts that fit in `budget` bytes (the tenant's artifact quota), figures
    /// first (they are what an agent usually asked for), then files, in order; skip the rest as
    /// `quota_exceeded`.
    pub fn keep_within_quota(&mut self, mut budget: u64) {
        let mut skipped = Vec::new();
        for output in &mut self.outputs {
            output.binary.retain(|part| {
                let size = part.bytes.len() as u64;
                let keep = size <= budget;
                if keep {
                    budget -= size;
                } else {
                    skipped.push(part.path.clone());
                }
                keep
            });
        }
        let files = std::mem::take(&mut self.files);
        for f in files {
            let size = f.bytes.len() as u64;
            if size <= budget {
                budget -= size;
                self.files.push(f);
            } else {
                skipped.push(f.path);
            }
        }
        for path in skipped {
            self.skip(path, "quota_exceeded");
        }
    }

    /// Skip, as `invalid_path`, the files whose object key (`fits`: the job's key of the path)
    /// the store would not take: a workspace path may be 1024 bytes, a key no longer. Before,
    /// the store refused such a file at its upload, the job ended `storage_failed`, and the
    /// files uploaded before it stayed in the store, counted nowhere.
    pub fn skip_unstorable(&mut self, fits: impl Fn(&str) -> bool) {
        let files = std::mem::take(&mut self.files);
        for f in files {
            if fits(&f.path) {
                self.files.push(f);
            } else {
                self.artifacts_kept.0 = self.artifacts_kept.0.saturating_sub(1);
                self.artifacts_kept.1 = self.artifacts_kept.1.saturating_sub(f.bytes.len() as u64);
                self.skip(f.path, "invalid_path");
            }
        }
    }

    /// Bytes of all artifacts the outcome holds (files and display parts).
    pub fn artifact_bytes(&self) -> u64 {
        let display: u64 = self.outputs.iter().flat_map(|o| &o.binary).map(|p| p.bytes.len() as u64).sum();
        display + self.files.iter().map(|f| f.bytes.len() as u64).sum::<u64>()
    }

    /// Give every display part a path no output file of the job has: a job may write
    /// `_display/1.png` itself, and its file must not be overwritten by a figure (nor the other
    /// way round).
    pub fn settle_display_paths(&mut self) {
        let taken: std::collections::HashSet<String> = self.files.iter().map(|f| f.path.clone()).collect();
        for part in self.outputs.iter_mut().flat_map(|o| o.binary.iter_mut()) {
            if !taken.contains(&part.path) {
                continue;
            }
            let (stem, ext) = part.path.rsplit_once('.').map(|(s, e)| (s.to_string(), format!(".{e}"))).unwrap_or((part.path.clone(), String::new()));
            part.path = (2..).map(|k| format!("{stem}~{k}{ext}")).find(|p| !taken.contains(p)).unwrap_or_default();
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
            self.reason =
                Some(Reason::new(ErrorCode::PidsLimit, format!("the code hit the process limit ({} processes and threads): creating one failed", limits.pids)));
        } else if self.limits_hit.contains(&LimitHit::Workspace) {
            self.reason = Some(Reason::new(ErrorCode::WorkspaceFull, format!("the workspace ({} MB) or /tmp ran out of space", limits.workspace_mb)));
        }
    }

    /// An outcome for a job that could not run: infrastructure error with a reason.
    pub fn infra(mut self, code: ErrorCode, message: String) -> Self {
        self.status = JobStatus::InfrastructureError;
        self.reason = Some(Reason::new(code, message));
        self
    }
}

/// Most bytes of an exception's name kept; its message and traceback are capped like stderr.
const MAX_ENAME_BYTES: u64 = 1024;

/// What the kernel does after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Read the next event.
    More,
    /// The request is over (`done`, or the driver's own `protocol_error`).
    Done,
    /// The sandbox broke the protocol: the outcome says how; the kernel must not be reused.
    Violation,
}

/// Fold one driver event into the outcome.
pub fn apply(out: &mut Outcome, event: DriverEvent, language: Language, limits: &ExecutionLimits) -> Step {
    if !matches!(event, DriverEvent::FileData { .. }) {
        out.end_file();
    }
    match event {
        DriverEvent::Stream { name, text } => match name.as_str() {
            "stderr" => out.stderr.push(&text),
            _ => out.stdout.push(&text),
        },
        DriverEvent::ExecuteResult { data } => push_output(out, OutputKind::ExecuteResult, data, limits),
        DriverEvent::DisplayData { data } => push_output(out, OutputKind::DisplayData, data, limits),
        DriverEvent::Error { ename, evalue, traceback } => {
            // The driver caps these too; the worker trusts no sandbox to have done so.
            let mut budget = limits.stderr_bytes;
            let mut kept = Vec::new();
            for line in traceback {
                if line.len() as u64 > budget {
                    kept.push(cap_text(line, budget));
                    break;
                }
                budget -= line.len() as u64;
                kept.push(line);
            }
            out.error = Some(ExecError {
                ename: cap_text(ename, MAX_ENAME_BYTES),
                evalue: cap_text(evalue, limits.stderr_bytes.min(INLINE_OUTPUT_BYTES)),
                traceback: kept,
            });
        }
        DriverEvent::File { path, size, requested } => out.begin_file(path, size, requested, limits),
        DriverEvent::FileData { content_b64 } => {
            let chunk = match base64::engine::general_purpose::STANDARD.decode(content_b64.as_bytes()) {
                Ok(bytes) => out.file_chunk(&bytes),
                Err(e) => Err(format!("a file chunk is not base64: {e}")),
            };
            if let Err(message) = chunk {
                out.status = JobStatus::InfrastructureError;
                out.reason = Some(Reason::new(ErrorCode::DriverProtocol, format!("the sandbox broke the file protocol: {message}")));
                return Step::Violation;
            }
        }
        DriverEvent::FileSkipped { path, reason } => {
            tracing::debug!(path, reason, "output file not collected");
            out.skip(path, &reason);
        }
        DriverEvent::FileList { mut entries, truncated } => {
            let kept = listed_within_bounds(&entries);
            let truncated = truncated || kept < entries.len();
            entries.truncate(kept);
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
            return Step::Done;
        }
        // Settled belongs after done, to Kernel::settle, and prepared to Kernel::prepare; one in a
        // cell's events means nothing.
        DriverEvent::Ready { .. } | DriverEvent::Settled { .. } | DriverEvent::Prepared { .. } | DriverEvent::Unknown => {}
        DriverEvent::Done { status, exit_code, stdout_truncated, stderr_truncated, processes_killed, workspace_full, execution_count } => {
            out.done = true;
            out.execution_count = execution_count.filter(|_| language == Language::Python);
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
            return Step::Done;
        }
    }
    Step::More
}

/// How many of a listing's first entries the result keeps: at most [`MAX_LISTED_FILES`],
/// whose paths together take at most [`MAX_LISTED_PATH_BYTES`] (a path may be 4 KiB long, so
/// a thousand of them alone made a 4 MB result).
fn listed_within_bounds(entries: &[sandcell_protocol::FileEntry]) -> usize {
    let mut bytes = 0usize;
    entries
        .iter()
        .take(MAX_LISTED_FILES)
        .take_while(|e| {
            bytes += e.path.len();
            bytes <= MAX_LISTED_PATH_BYTES
        })
        .count()
}

/// Marker appended to a text representation cut at the cap.
pub const TRUNCATION_MARKER: &str = "\n…[truncated by sandcell]";

/// Text representations longer than this are stored in full as artifacts; the result keeps
/// this much inline as a preview.
pub const INLINE_OUTPUT_BYTES: u64 = 64 * 1024;

/// Keep rich outputs small in the result row: a text representation longer than
/// [`INLINE_OUTPUT_BYTES`] goes to the object store in full (up to the artifact byte limit) and
/// is cut inline, with a marker; binary representations always go to the store.
///
/// The text kept inline, over all of a job's rich outputs, is at most its `stdout_bytes`, as
/// for what it prints: a representation cut for either bound goes to the store in full (if the
/// artifact limits allow; otherwise it is skipped, named in `skipped_files`), and once the
/// budget is spent a later one keeps only the marker inline. Without this bound, 64 outputs of six kept types each 64 KiB made a
/// result of 20.8 MB that Postgres kept, however small the job's output limit.
fn push_output(out: &mut Outcome, kind: OutputKind, data: BTreeMap<String, serde_json::Value>, limits: &ExecutionLimits) {
    if out.outputs.len() >= MAX_OUTPUTS {
        return;
    }
    let mut raw = RawOutput { kind, text: BTreeMap::new(), binary: Vec::new() };
    for (mime, value) in data {
        let is_binary = mime.starts_with("image/") && mime != "image/svg+xml";
        match (is_binary, value) {
            (true, serde_json::Value::String(b64)) => match base64::engine::general_purpose::STANDARD.decode(b64.trim().as_bytes()) {
                Ok(bytes) => push_part(out, &mut raw, mime, bytes, limits),
                Err(e) => tracing::warn!(mime, error = %e, "driver sent undecodable binary output"),
            },
            (_, value) => {
                let s = match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                let cap = limits.stdout_bytes.saturating_sub(out.inline_output_bytes).min(INLINE_OUTPUT_BYTES);
                let len = s.len() as u64;
                if len > cap {
                    let mut full = s.clone().into_bytes();
                    full.truncate(usize::try_from(limits.artifact_bytes).unwrap_or(usize::MAX));
                    push_part(out, &mut raw, mime.clone(), full, limits);
                }
                out.inline_output_bytes += len.min(cap);
                raw.text.insert(mime, cap_text(s, cap));
            }
        }
    }
    out.outputs.push(raw);
}

/// Name a display part `_display/<n>.<ext>` and keep it if it fits the job's artifact limits
/// (display parts and files share them); otherwise skip it, with why.
fn push_part(out: &mut Outcome, raw: &mut RawOutput, mime: String, bytes: Vec<u8>, limits: &ExecutionLimits) {
    out.display_parts += 1;
    let ext = mime_guess::get_mime_extensions_str(&mime).and_then(|e| e.first()).copied().unwrap_or("bin");
    let path = format!("_display/{}.{ext}", out.display_parts);
    if out.admit_artifact(bytes.len() as u64, limits) {
        raw.binary.push(DisplayPart { mime, path, bytes });
    } else {
        out.skip(path, "limit_reached");
    }
}

fn cap_text(s: String, cap: u64) -> String {
    let mut c = CappedText::new(cap);
    c.push(&s);
    if c.truncated {
        c.text.push_str(TRUNCATION_MARKER);
    }
    c.text
}

/// What a job's commit carries besides the cell's outcome.
#[derive(Debug, Default)]
pub struct Extras {
    /// The session's kernel was replaced.
    pub kernel_restarted: bool,
    /// The container that ran the job.
    pub container_id: Option<String>,
    /// The session to extend or close.
    pub session: Option<sandcell_core::jobs::SessionTouch>,
    /// The job took its session over from another worker.
    pub moved: Option<sandcell_protocol::SessionMove>,
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
        let file = |p: &str, n: usize| OutputFile { path: p.into(), bytes: vec![0; n], requested: false };
        out.files = vec![file("a", 600), file("b", 600), file("c", 400)];
        out.keep_within_quota(1000);
        assert_eq!(out.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(out.skipped_files, [SkippedFile { path: "b".into(), reason: "quota_exceeded".into() }]);
        assert!(out.limits_hit.contains(&LimitHit::Artifacts));
    }

    #[test]
    fn display_outputs_and_files_share_the_jobs_artifact_limits() {
        let mut limits = sandcell_protocol::LimitPolicy::default().default;
        limits.artifact_files = 2;
        limits.artifact_bytes = 1000;
        let mut out = Outcome::new(&limits);
        let png = |n: usize| serde_json::json!(base64::engine::general_purpose::STANDARD.encode(vec![7u8; n]));
        for n in [400, 400, 10] {
            let data = BTreeMap::from([("image/png".to_string(), png(n))]);
            apply(&mut out, DriverEvent::DisplayData { data }, Language::Python, &limits);
        }
        apply(&mut out, DriverEvent::File { path: "out.csv".into(), size: 10, requested: false }, Language::Python, &limits);
        let chunk = DriverEvent::FileData { content_b64: base64::engine::general_purpose::STANDARD.encode([1u8; 10]) };
        apply(&mut out, chunk, Language::Python, &limits);
        assert_eq!(out.outputs.iter().map(|o| o.binary.len()).collect::<Vec<_>>(), [1, 1, 0]);
        let skipped: Vec<_> = out.skipped_files.iter().map(|s| (s.path.as_str(), s.reason.as_str())).collect();
        assert_eq!(skipped, [("_display/3.png", "limit_reached"), ("out.csv", "limit_reached")]);
        assert!(out.limits_hit.contains(&LimitHit::Artifacts));
        // The tenant's quota counts them too: figures first.
        out.keep_within_quota(500);
        assert_eq!(out.artifact_bytes(), 400);
        assert_eq!(out.skipped_files.last().map(|s| s.path.as_str()), Some("_display/2.png"));
    }

    #[test]
    fn files_with_one_name_or_a_bad_name_are_skipped_not_merged() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let f = |p: &str, b: u8| OutputFile { path: p.into(), bytes: vec![b; 3], requested: false };
        out.admit_file(f("a\u{FFFD}", 1), &limits);
        out.admit_file(f("a\u{FFFD}", 2), &limits);
        out.admit_file(f("../etc/passwd", 3), &limits);
        out.admit_file(f("_display/1.png", 4), &limits);
        assert_eq!(out.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["a\u{FFFD}", "_display/1.png"]);
        let skipped: Vec<_> = out.skipped_files.iter().map(|s| (s.path.as_str(), s.reason.as_str())).collect();
        assert_eq!(skipped, [("a\u{FFFD}", "duplicate_path"), ("../etc/passwd", "invalid_path")]);
        // A figure never takes the path of a file the job wrote.
        let data = BTreeMap::from([("image/png".to_string(), serde_json::json!("iVBORw0KGgo="))]);
        apply(&mut out, DriverEvent::DisplayData { data }, Language::Python, &limits);
        out.settle_display_paths();
        assert_eq!(out.outputs[0].binary[0].path, "_display/1~2.png");
    }

    #[test]
    fn a_file_arrives_in_chunks_and_more_bytes_than_announced_is_a_violation() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let b64 = |b: &[u8]| DriverEvent::FileData { content_b64: base64::engine::general_purpose::STANDARD.encode(b) };
        apply(&mut out, DriverEvent::File { path: "a.txt".into(), size: 6, requested: false }, Language::Python, &limits);
        assert_eq!(apply(&mut out, b64(b"abc"), Language::Python, &limits), Step::More);
        assert_eq!(apply(&mut out, b64(b"def"), Language::Python, &limits), Step::More);
        // A file cut short is not stored as if complete.
        apply(&mut out, DriverEvent::File { path: "short.txt".into(), size: 6, requested: false }, Language::Python, &limits);
        apply(&mut out, b64(b"abc"), Language::Python, &limits);
        apply(&mut out, DriverEvent::File { path: "long.txt".into(), size: 2, requested: false }, Language::Python, &limits);
        assert_eq!(apply(&mut out, b64(b"abc"), Language::Python, &limits), Step::Violation);
        assert_eq!(out.files, [OutputFile { path: "a.txt".into(), bytes: b"abcdef".to_vec(), requested: false }]);
        assert_eq!(out.skipped_files, [SkippedFile { path: "short.txt".into(), reason: "unreadable".into() }]);
        assert_eq!(out.reason.map(|r| r.code), Some(ErrorCode::DriverProtocol));
    }

    #[test]
    fn an_exceptions_message_and_traceback_are_capped() {
        let mut limits = sandcell_protocol::LimitPolicy::default().default;
        limits.stderr_bytes = 100;
        let mut out = Outcome::new(&limits);
        let error = DriverEvent::Error { ename: "E".repeat(5000), evalue: "v".repeat(5000), traceback: vec!["t".repeat(60); 5] };
        apply(&mut out, error, Language::Python, &limits);
        let e = out.error.unwrap();
        assert_eq!(e.ename.len(), MAX_ENAME_BYTES as usize + TRUNCATION_MARKER.len());
        assert_eq!(e.evalue.len(), 100 + TRUNCATION_MARKER.len());
        assert_eq!(e.traceback.len(), 2);
        assert_eq!(e.traceback[1], format!("{}{TRUNCATION_MARKER}", "t".repeat(40)));
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
        let done = DriverEvent::Done {
            status: "ok".into(),
            exit_code: Some(3),
            stdout_truncated: false,
            stderr_truncated: false,
            processes_killed: 0,
            workspace_full: false,
            execution_count: Some(4),
        };
        assert_eq!(apply(&mut out, done.clone(), Language::Bash, &limits), Step::Done);
        assert_eq!(out.execution_count, None, "bash has no execution count");
        assert_eq!(out.status, JobStatus::Failed);
        let mut out = Outcome::new(&limits);
        apply(&mut out, done, Language::Python, &limits);
        assert_eq!(out.status, JobStatus::Succeeded);
    }

    #[test]
    fn a_huge_repr_is_cut_at_the_cap_with_a_marker() {
        let mut limits = sandcell_protocol::LimitPolicy::default().default;
        limits.stdout_bytes = 10;
        let mut out = Outcome::new(&limits);
        let data = BTreeMap::from([("text/plain".to_string(), serde_json::json!("x".repeat(1000)))]);
        apply(&mut out, DriverEvent::ExecuteResult { data }, Language::Python, &limits);
        assert_eq!(out.outputs[0].text["text/plain"], format!("{}{TRUNCATION_MARKER}", "x".repeat(10)));
    }

    #[test]
    fn a_large_html_output_is_kept_in_full_as_an_artifact_and_previewed_inline() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let html = format!("<table>{}</table>", "<tr><td>1</td></tr>".repeat(10_000));
        let data = BTreeMap::from([("text/html".to_string(), serde_json::json!(html.clone()))]);
        apply(&mut out, DriverEvent::ExecuteResult { data }, Language::Python, &limits);
        let o = &out.outputs[0];
        assert_eq!(o.binary, vec![DisplayPart { mime: "text/html".into(), path: "_display/1.htm".into(), bytes: html.clone().into_bytes() }]);
        assert_eq!(o.text["text/html"].len(), INLINE_OUTPUT_BYTES as usize + TRUNCATION_MARKER.len());
    }

    #[test]
    fn rich_outputs_keep_no_more_text_inline_than_the_jobs_output_limit_and_store_the_rest() {
        let mut limits = sandcell_protocol::LimitPolicy::default().default;
        limits.stdout_bytes = 100_000;
        let mut out = Outcome::new(&limits);
        let text = "y".repeat(40_000);
        for _ in 0..4 {
            let data = BTreeMap::from([("text/plain".to_string(), serde_json::json!(text.clone()))]);
            apply(&mut out, DriverEvent::DisplayData { data }, Language::Python, &limits);
        }
        let inline: Vec<usize> = out.outputs.iter().map(|o| o.text["text/plain"].len()).collect();
        let marker = TRUNCATION_MARKER.len();
        // 40,000 + 40,000 in full, the 20,000 left of the budget, then the marker alone.
        assert_eq!(inline, vec![40_000, 40_000, 20_000 + marker, marker]);
        let stored: Vec<usize> = out.outputs.iter().map(|o| o.binary.iter().map(|b| b.bytes.len()).sum()).collect();
        assert_eq!(stored, vec![0, 0, 40_000, 40_000], "what was cut inline is stored in full");
    }

    #[test]
    fn a_listing_of_long_paths_is_cut_at_its_path_bytes_and_says_so() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let entry = |i: usize| sandcell_protocol::FileEntry { path: format!("{i:04}/{}", "d".repeat(4000)), size: 0, mtime: 0.0 };
        let mut out = Outcome::new(&limits);
        apply(&mut out, DriverEvent::FileList { entries: (0..1000).map(entry).collect(), truncated: false }, Language::Python, &limits);
        let listing = out.listing.expect("a listing");
        assert_eq!((listing.entries.len(), listing.truncated), (MAX_LISTED_PATH_BYTES / 4005, true));
        let mut out = Outcome::new(&limits);
        apply(&mut out, DriverEvent::FileList { entries: (0..3).map(entry).collect(), truncated: false }, Language::Python, &limits);
        assert_eq!(out.listing.map(|l| (l.entries.len(), l.truncated)), Some((3, false)));
    }

    #[test]
    fn figures_are_decoded_as_binary_and_text_kept_inline() {
        let limits = sandcell_protocol::LimitPolicy::default().default;
        let mut out = Outcome::new(&limits);
        let data = BTreeMap::from([("image/png".to_string(), serde_json::json!("iVBORw0KGgo=")), ("text/plain".to_string(), serde_json::json!("<Figure>"))]);
        apply(&mut out, DriverEvent::DisplayData { data }, Language::Python, &limits);
        assert_eq!(out.outputs[0].binary[0].bytes[..4], [0x89, b'P', b'N', b'G']);
        assert_eq!(out.outputs[0].text["text/plain"], "<Figure>");
    }
}
