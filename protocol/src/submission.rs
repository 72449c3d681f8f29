//! The submission: what a client publishes to the intake queue, and the intake's judgement of it.
//!
//! [`parse_submission`] is the single gate every message passes. It either returns a
//! [`Submission`] that is safe to record and run, or a [`Rejection`] with an [`ErrorCode`] and,
//! whenever the message let us recover them, the `tenant` and `job_id` under which the client
//! will find the rejection.

use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{ErrorCode, Reason};
use crate::limits::{IntakeLimits, ResourceRequest};
use crate::paths::validate_workspace_path;
pub use crate::session::SessionRequest;

/// Languages a job may be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// Python 3, run by an IPython shell: the last expression's value is returned.
    Python,
    /// A bash script, run with `bash -c` in the workspace.
    Bash,
}

impl Language {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }
}

/// A file placed in the workspace (`/home/user`) before the code runs: inline (`content_b64`)
/// or by reference to an object the client uploaded (`s3_key`). Exactly one of the two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InputFile {
    /// Path relative to the workspace, e.g. `data/transactions.csv`.
    pub path: String,
    /// The file's bytes, standard base64 with padding (up to `SANDCELL_MAX_INLINE_FILE_BYTES`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_b64: Option<String>,
    /// Key of an object in the artifact bucket under `<tenant>/_uploads/`, for large files
    /// (up to `SANDCELL_MAX_UPLOAD_FILE_BYTES`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3_key: Option<String>,
}

impl InputFile {
    /// An inline file.
    pub fn inline(path: impl Into<String>, bytes: &[u8]) -> Self {
        InputFile { path: path.into(), content_b64: Some(base64::engine::general_purpose::STANDARD.encode(bytes)), s3_key: None }
    }

    /// At most how many bytes its inline content decodes to ([`decoded_len`]; 0 for a file by
    /// `s3_key`).
    pub fn inline_len(&self) -> u64 {
        self.content_b64.as_deref().map_or(0, decoded_len)
    }
}

/// At most how many bytes standard base64 text decodes to (its padding not taken off), read
/// from its length alone: every bound on inline content is checked with it before anything is
/// decoded.
pub fn decoded_len(b64: &str) -> u64 {
    b64.len() as u64 / 4 * 3
}

/// How long standard base64 text (padded) of `bytes` bytes is: what an upload is held as once
/// fetched for a sandbox.
pub fn encoded_len(bytes: u64) -> u64 {
    bytes.div_ceil(3).saturating_mul(4)
}

/// Most entries in `get_files`.
pub const MAX_GET_FILES: usize = 64;

/// The longest object key the store takes (S3's limit; Garage fails a longer one with an
/// internal error): a key is `<tenant>/<job_id>/<path>` or an upload's, and a workspace path
/// alone may be 1024 bytes.
pub const MAX_OBJECT_KEY_BYTES: usize = 1024;

/// The object-key prefix under which a tenant uploads input files (job ids cannot contain `_`,
/// so uploads never collide with artifact keys `<tenant>/<job_id>/...`).
pub fn upload_prefix(tenant: &str) -> String {
    format!("{tenant}/_uploads/")
}

/// A request to run code. Published as JSON to the `sandcell.intake` exchange, with the session id (else the job id) as the routing key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    /// Client-chosen id, unique per tenant; the idempotency key. 1–128 of `[A-Za-z0-9._:-]`.
    pub job_id: String,
    /// The tenant the job belongs to. 1–64 of `[a-z0-9_-]`.
    pub tenant: String,
    /// `python` or `bash`.
    pub language: Language,
    /// The code to run. May be empty only when the job does something else: `get_files`,
    /// `list_files` or `session.close`.
    pub code: String,
    /// Files placed in the workspace before the code runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<InputFile>,
    /// Wall-clock timeout in milliseconds (clamped to the operator's range).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Memory limit in MiB (clamped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// CPU quota in CPUs (clamped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Seconds the job's artifacts stay downloadable (clamped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_ttl_s: Option<u64>,
    /// Open a session with this job, or run in an existing one. Absent: a one-off sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionRequest>,
    /// Workspace files to return as artifacts after the code ran, changed or not (`get_file`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub get_files: Vec<String>,
    /// Return a listing of the workspace after the code ran (`files` in the result).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub list_files: bool,
    /// Environment variables of this job's code only: Python sees them in `os.environ` during
    /// the cell (restored after it), bash in its environment. At most [`MAX_ENV_VARS`], names
    /// `[A-Za-z_][A-Za-z0-9_]*`, no NUL, [`MAX_ENV_BYTES`] in all.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
    /// In a session, the Python namespace the code runs in: each context has its own
    /// variables, imports and execution count, and shares the session's files and processes.
    /// Absent: the session's default namespace. 1–64 of `[A-Za-z0-9_-]`; Python only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
}

/// Most environment variables a job sets.
pub const MAX_ENV_VARS: usize = 64;
/// Most bytes of a job's environment variables (names and values together).
pub const MAX_ENV_BYTES: usize = 64 << 10;

/// Whether `name` is an acceptable environment variable name.
pub fn is_valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') && name.len() <= 255
}

/// Whether `name` is an acceptable context name.
pub fn is_valid_context(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The environment and context rules of a submission (also checked by the driver).
fn validate_env_and_context(sub: &Submission) -> Result<(), Reason> {
    let invalid = |m: String| Err(Reason::new(ErrorCode::InvalidValue, m));
    if sub.env.len() > MAX_ENV_VARS {
        return invalid(format!("env sets {} variables; the limit is {MAX_ENV_VARS}", sub.env.len()));
    }
    let mut total = 0;
    for (name, value) in &sub.env {
        if !is_valid_env_name(name) {
            return invalid(format!("env name {name:?} must match [A-Za-z_][A-Za-z0-9_]* (at most 255 characters)"));
        }
        if value.contains('\0') {
            return invalid(format!("env value of {name} contains NUL"));
        }
        total += name.len() + value.len();
    }
    if total > MAX_ENV_BYTES {
        return invalid(format!("env is {total} bytes; the limit is {MAX_ENV_BYTES}"));
    }
    if let Some(context) = &sub.context {
        if !is_valid_context(context) {
            return invalid(format!("context {context:?} must be 1-64 characters of [A-Za-z0-9_-]"));
        }
        if sub.session.is_none() {
            return invalid("context is for jobs in a session (a one-off job has a fresh interpreter anyway)".into());
        }
        if sub.language != Language::Python {
            return invalid("context applies to python code only".into());
        }
    }
    Ok(())
}

impl Submission {
    /// A submission of `code` with every optional field at its default.
    pub fn new(tenant: impl Into<String>, job_id: impl Into<String>, language: Language, code: impl Into<String>) -> Self {
        Submission {
            job_id: job_id.into(),
            tenant: tenant.into(),
            language,
            code: code.into(),
            files: Vec::new(),
            timeout_ms: None,
            memory_mb: None,
            cpus: None,
            artifact_ttl_s: None,
            session: None,
            get_files: Vec::new(),
            list_files: false,
            env: Default::default(),
            context: None,
        }
    }

    /// The resource requests this submission makes.
    pub fn resource_request(&self) -> ResourceRequest {
        ResourceRequest { timeout_ms: self.timeout_ms, memory_mb: self.memory_mb, cpus: self.cpus, artifact_ttl_s: self.artifact_ttl_s }
    }

    /// Whether this job does nothing but close its session: no code, no input file, nothing to
    /// read back, no variables or context (which its stored execution job would carry). Such a job adds nothing to what the tenant stores (its result is a few hundred
    /// bytes) and frees a sandbox, so the quotas on stored bytes (artifacts, results kept) do not
    /// refuse it: a tenant over them can still end its sessions rather than leave them running
    /// out their keep-alive.
    pub fn only_closes_its_session(&self) -> bool {
        self.session.as_ref().is_some_and(|s| s.close && s.id.is_some())
            && self.code.trim().is_empty()
            && self.files.is_empty()
            && self.get_files.is_empty()
            && !self.list_files
            && self.env.is_empty()
            && self.context.is_none()
    }
}

/// A submission the intake refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Why.
    pub reason: Reason,
    /// The tenant, when the message named a valid one.
    pub tenant: Option<String>,
    /// The job id, when the message named a valid one.
    pub job_id: Option<String>,
}

impl Rejection {
    /// `(tenant, job_id)` when both were recovered, i.e. the client can poll for the rejection.
    pub fn recoverable_key(&self) -> Option<(&str, &str)> {
        Some((self.tenant.as_deref()?, self.job_id.as_deref()?))
    }
}

/// Whether `s` is a valid job id.
pub fn is_valid_job_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

/// Whether `s` is a valid tenant name.
pub fn is_valid_tenant(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Judge one intake message.
pub fn parse_submission(body: &[u8], limits: &IntakeLimits) -> Result<Submission, Rejection> {
    if body.len() > limits.max_message_bytes {
        // Not parsed into a tree: only the two ids are picked out, without keeping the rest.
        let (tenant, job_id) = peek_ids(body);
        return Err(reject(tenant, job_id, ErrorCode::OversizeMessage, too_big("message", body.len(), limits.max_message_bytes, "")));
    }
    // Parse as untyped JSON first, so that ids can be recovered from messages that fail later.
    // A repeated key anywhere makes the message invalid JSON: two readers of it could
    // otherwise disagree on what it says.
    let value = match serde_json::from_slice::<StrictValue>(body) {
        Ok(v) => v.0,
        Err(e) => return Err(reject(None, None, ErrorCode::MalformedJson, format!("message is not valid JSON: {e}"))),
    };
    let (tenant, job_id) = recover_ids(&value);
    let fail = |code, message: String| Err(reject(tenant.clone(), job_id.clone(), code, message));

    if !value.is_object() {
        return fail(ErrorCode::MalformedJson, "message must be a JSON object".into());
    }
    let sub: Submission = match serde_json::from_value(value) {
        Ok(s) => s,
        Err(e) => {
            let msg = e.to_string();
            return fail(classify_serde_error(&msg), msg);
        }
    };
    validate(&sub, limits).map_err(|reason| Rejection { reason, tenant, job_id })?;
    Ok(sub)
}

fn too_big(what: &str, got: usize, max: usize, detail: &str) -> String {
    let mut m = format!("{what} is {got} bytes; the limit is {max} bytes");
    if !detail.is_empty() {
        m.push_str(" (");
        m.push_str(detail);
        m.push(')');
    }
    m
}

fn reject(tenant: Option<String>, job_id: Option<String>, code: ErrorCode, message: String) -> Rejection {
    Rejection { reason: Reason::new(code, message), tenant, job_id }
}

/// `tenant` and `job_id` of a message too large to judge, read without building the rest of it.
fn peek_ids(body: &[u8]) -> (Option<String>, Option<String>) {
    #[derive(Deserialize)]
    struct Ids {
        tenant: Option<String>,
        job_id: Option<String>,
    }
    match serde_json::from_slice::<Ids>(body) {
        Ok(ids) => (ids.tenant.filter(|t| is_valid_tenant(t)), ids.job_id.filter(|j| is_valid_job_id(j))),
        Err(_) => (None, None),
    }
}

/// A JSON value parsed with repeated object keys refused (serde_json keeps the last one).
struct StrictValue(serde_json::Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(serde_json::Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            let StrictValue(v) = map.next_value()?;
            object.insert(key, v);
        }
        Ok(serde_json::Value::Object(object))
    }
}

/// Recover `tenant` and `job_id` from a message that may be invalid elsewhere.
fn recover_ids(value: &serde_json::Value) -> (Option<String>, Option<String>) {
    let get = |k: &str, ok: fn(&str) -> bool| value.get(k).and_then(|v| v.as_str()).filter(|s| ok(s)).map(str::to_owned);
    (get("tenant", is_valid_tenant), get("job_id", is_valid_job_id))
}

/// Map serde_json's data error messages onto protocol codes.
fn classify_serde_error(msg: &str) -> ErrorCode {
    if msg.starts_with("missing field") {
        ErrorCode::MissingField
    } else if msg.starts_with("unknown field") {
        ErrorCode::UnknownField
    } else if msg.starts_with("unknown variant") {
        // `language` is the only enum in a submission.
        ErrorCode::UnknownLanguage
    } else if msg.starts_with("invalid type") {
        ErrorCode::WrongType
    } else {
        ErrorCode::InvalidValue
    }
}

fn validate(sub: &Submission, limits: &IntakeLimits) -> Result<(), Reason> {
    let invalid = |m: String| Err(Reason::new(ErrorCode::InvalidValue, m));
    if !is_valid_job_id(&sub.job_id) {
        return invalid("job_id must be 1-128 characters of [A-Za-z0-9._:-]".into());
    }
    if !is_valid_tenant(&sub.tenant) {
        return invalid("tenant must be 1-64 characters of [a-z0-9_-]".into());
    }
    let other_work = !sub.get_files.is_empty() || sub.list_files || sub.session.as_ref().is_some_and(|s| s.close);
    if sub.code.trim().is_empty() && !other_work {
        return invalid("code is empty (it may be empty only with get_files, list_files or session.close)".into());
    }
    if sub.code.len() > limits.max_code_bytes {
        return Err(Reason::new(ErrorCode::OversizeCode, too_big("code", sub.code.len(), limits.max_code_bytes, "")));
    }
    if sub.cpus.is_some_and(|c| !c.is_finite()) {
        return invalid("cpus must be a finite number".into());
    }
    if let Some(session) = &sub.session {
        session.check().map_err(|m| Reason::new(ErrorCode::InvalidValue, m))?;
    }
    if sub.get_files.len() > MAX_GET_FILES {
        return invalid(format!("get_files names {} files; the limit is {MAX_GET_FILES}", sub.get_files.len()));
    }
    for path in &sub.get_files {
        if let Err(e) = validate_workspace_path(path) {
            return Err(Reason::new(ErrorCode::InvalidFilePath, format!("get_files entry {path:?}: {e}")));
        }
    }
    validate_env_and_context(sub)?;
    validate_files(&sub.tenant, &sub.files, limits)
}

/// Whether `key` is an acceptable upload reference for `tenant`: under its upload prefix, no
/// empty, `.` or `..` segments, no control characters, at most 1024 bytes.
pub fn is_valid_upload_key(tenant: &str, key: &str) -> bool {
    let Some(rest) = key.strip_prefix(&upload_prefix(tenant)) else { return false };
    key.len() <= MAX_OBJECT_KEY_BYTES
        && !rest.is_empty()
        && !key.chars().any(char::is_control)
        && rest.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

fn validate_files(tenant: &str, files: &[InputFile], limits: &IntakeLimits) -> Result<(), Reason> {
    if files.len() > limits.max_input_files {
        return Err(Reason::new(ErrorCode::TooManyFiles, format!("{} input files; the limit is {}", files.len(), limits.max_input_files)));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    for f in files {
        if let Err(e) = validate_workspace_path(&f.path) {
            return Err(Reason::new(ErrorCode::InvalidFilePath, format!("input file {:?}: {e}", f.path)));
        }
        if !seen.insert(f.path.as_str()) {
            return Err(Reason::new(ErrorCode::DuplicateFilePath, format!("input file {:?} appears twice", f.path)));
        }
        let content_b64 = match (&f.content_b64, &f.s3_key) {
            (Some(b64), None) => b64,
            (None, Some(key)) => {
                if !is_valid_upload_key(tenant, key) {
                    return Err(Reason::new(
                        ErrorCode::InvalidFilePath,
                        format!("input file {:?}: s3_key must be a plain key under {:?}", f.path, upload_prefix(tenant)),
                    ));
                }
                continue;
            }
            _ => {
                return Err(Reason::new(ErrorCode::InvalidValue, format!("input file {:?}: give exactly one of content_b64 and s3_key", f.path)));
            }
        };
        // Estimate first so that a huge payload is refused without decoding it.
        let estimated = usize::try_from(decoded_len(content_b64)).unwrap_or(usize::MAX);
        if estimated > limits.max_inline_file_bytes.saturating_add(3) {
            return Err(Reason::new(ErrorCode::OversizeFile, too_big(&format!("input file {:?}", f.path), estimated, limits.max_inline_file_bytes, "")));
        }
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(content_b64)
            .map_err(|e| Reason::new(ErrorCode::InvalidBase64, format!("input file {:?}: {e}", f.path)))?;
        if decoded.len() > limits.max_inline_file_bytes {
            return Err(Reason::new(ErrorCode::OversizeFile, too_big(&format!("input file {:?}", f.path), decoded.len(), limits.max_inline_file_bytes, "")));
        }
        total += decoded.len();
        if total > limits.max_inline_total_bytes {
            return Err(Reason::new(ErrorCode::OversizeFile, too_big("input files together", total, limits.max_inline_total_bytes, "")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<Submission, Rejection> {
        parse_submission(v.to_string().as_bytes(), &IntakeLimits::default())
    }

    fn code_of(r: Result<Submission, Rejection>) -> ErrorCode {
        r.expect_err("must be rejected").reason.code
    }

    fn valid() -> serde_json::Value {
        json!({"job_id": "j-1", "tenant": "acme", "language": "python", "code": "print(1)"})
    }

    #[test]
    fn env_and_context_are_accepted_within_their_rules_and_refused_outside() {
        let mut v = valid();
        v["env"] = json!({"GREETING": "hey", "_X1": ""});
        v["session"] = json!({"id": "ses_0123456789abcdef0123456789abcdef"});
        v["context"] = json!("ctx-1_a");
        let s = parse(v.clone()).unwrap();
        assert_eq!(s.env.get("GREETING").map(String::as_str), Some("hey"));
        assert_eq!(s.context.as_deref(), Some("ctx-1_a"));
        for (field, bad) in
            [("env", json!({"1A": "x"})), ("env", json!({"A-B": "x"})), ("env", json!({"A": "x\u{0}y"})), ("context", json!("a b")), ("context", json!(""))]
        {
            let mut b = v.clone();
            b[field] = bad.clone();
            assert_eq!(code_of(parse(b)), ErrorCode::InvalidValue, "{field} = {bad}");
        }
        let mut one_off = v.clone();
        one_off.as_object_mut().map(|o| o.remove("session"));
        assert_eq!(code_of(parse(one_off)), ErrorCode::InvalidValue, "a context needs a session");
        let mut bash = v.clone();
        bash["language"] = json!("bash");
        assert_eq!(code_of(parse(bash)), ErrorCode::InvalidValue, "a context is python only");
        let mut many = valid();
        many["env"] = serde_json::Value::Object((0..=MAX_ENV_VARS).map(|i| (format!("V{i}"), json!("x"))).collect());
        assert_eq!(code_of(parse(many)), ErrorCode::InvalidValue);
    }

    #[test]
    fn a_minimal_submission_is_accepted() {
        let s = parse(valid()).unwrap();
        assert_eq!(s.language, Language::Python);
        assert!(s.files.is_empty());
    }

    #[test]
    fn a_repeated_key_anywhere_is_malformed_json_not_resolved() {
        let limits = IntakeLimits::default();
        let top = br#"{"job_id":"j-1","tenant":"acme","language":"python","code":"1","code":"2"}"#;
        let r = parse_submission(top, &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::MalformedJson);
        assert!(r.reason.message.contains("duplicate key \"code\""), "{}", r.reason.message);
        let nested = br#"{"job_id":"j-1","tenant":"acme","language":"python","code":"1","session":{"id":"ses_a","id":"ses_b"}}"#;
        assert_eq!(parse_submission(nested, &limits).unwrap_err().reason.code, ErrorCode::MalformedJson);
    }

    #[test]
    fn nul_in_names_and_values_is_judged_like_any_other_character() {
        let limits = IntakeLimits::default();
        let r = parse_submission(br#"{"job_id":"j-1","tenant":"acme","language":"py\u0000thon","code":"1"}"#, &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::UnknownLanguage);
        assert_eq!(r.recoverable_key(), Some(("acme", "j-1")));
        let r = parse_submission(br#"{"job_id":"j-1","tenant":"acme","language":"python","code":"1","x\u0000":1}"#, &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::UnknownField);
        let r = parse_submission(b"{\"job_id\":\"j\x00\"}", &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::MalformedJson);
        // NUL in code is the code's own business: accepted, and stored nowhere but the queue.
        assert!(parse_submission(br#"{"job_id":"j-1","tenant":"acme","language":"python","code":"'\u0000'"}"#, &limits).is_ok());
    }

    #[test]
    fn an_oversize_message_is_refused_without_parsing_it_whole() {
        let limits = IntakeLimits { max_message_bytes: 64, ..IntakeLimits::default() };
        let body = format!(r#"{{"tenant":"acme","job_id":"j-1","code":"{}","language":"python"}}"#, "x".repeat(1000));
        let r = parse_submission(body.as_bytes(), &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::OversizeMessage);
        assert_eq!(r.recoverable_key(), Some(("acme", "j-1")));
        let r = parse_submission(&vec![b'['; 1000], &limits).unwrap_err();
        assert_eq!((r.reason.code, r.recoverable_key()), (ErrorCode::OversizeMessage, None));
    }

    #[test]
    fn malformed_json_has_no_recoverable_key() {
        let r = parse_submission(b"{\"job_id\": ", &IntakeLimits::default()).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::MalformedJson);
        assert_eq!(r.recoverable_key(), None);
    }

    #[test]
    fn a_json_array_is_malformed() {
        assert_eq!(code_of(parse(json!([1, 2]))), ErrorCode::MalformedJson);
    }

    #[test]
    fn missing_code_is_missing_field_with_recovered_ids() {
        let mut v = valid();
        v.as_object_mut().unwrap().remove("code");
        let r = parse(v).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::MissingField);
        assert_eq!(r.recoverable_key(), Some(("acme", "j-1")));
    }

    #[test]
    fn wrong_type_is_reported() {
        let mut v = valid();
        v["timeout_ms"] = json!("5000");
        assert_eq!(code_of(parse(v)), ErrorCode::WrongType);
        let mut v = valid();
        v["code"] = json!(42);
        assert_eq!(code_of(parse(v)), ErrorCode::WrongType);
    }

    #[test]
    fn unknown_language_and_unknown_field() {
        let mut v = valid();
        v["language"] = json!("ruby");
        assert_eq!(code_of(parse(v)), ErrorCode::UnknownLanguage);
        let mut v = valid();
        v["timout_ms"] = json!(5);
        assert_eq!(code_of(parse(v)), ErrorCode::UnknownField);
    }

    #[test]
    fn bad_ids_and_empty_code_are_invalid_values() {
        let mut v = valid();
        v["job_id"] = json!("has space");
        let r = parse(v).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::InvalidValue);
        assert_eq!(r.job_id, None, "an invalid id is never used as a key");
        let mut v = valid();
        v["code"] = json!("   ");
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
    }

    #[test]
    fn oversize_message_and_code() {
        let limits = IntakeLimits { max_message_bytes: 100, max_code_bytes: 10, ..IntakeLimits::default() };
        let mut v = valid();
        v["code"] = json!("x".repeat(200));
        let r = parse_submission(v.to_string().as_bytes(), &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::OversizeMessage);
        assert_eq!(r.recoverable_key(), Some(("acme", "j-1")));
        let limits = IntakeLimits { max_code_bytes: 10, ..IntakeLimits::default() };
        assert_eq!(parse_submission(v.to_string().as_bytes(), &limits).unwrap_err().reason.code, ErrorCode::OversizeCode);
    }

    #[test]
    fn hostile_file_names_and_bad_files() {
        for bad in ["../etc/passwd", "/abs", "a\u{0}b", ""] {
            let mut v = valid();
            v["files"] = json!([{"path": bad, "content_b64": "aGk="}]);
            assert_eq!(code_of(parse(v)), ErrorCode::InvalidFilePath, "{bad:?}");
        }
        let mut v = valid();
        v["files"] = json!([{"path": "a", "content_b64": "aGk="}, {"path": "a", "content_b64": "aGk="}]);
        assert_eq!(code_of(parse(v)), ErrorCode::DuplicateFilePath);
        let mut v = valid();
        v["files"] = json!([{"path": "a", "content_b64": "not base64!"}]);
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidBase64);
    }

    #[test]
    fn oversize_inline_file() {
        let limits = IntakeLimits { max_inline_file_bytes: 4, ..IntakeLimits::default() };
        let mut v = valid();
        v["files"] = json!([{"path": "a", "content_b64": "aGVsbG8gd29ybGQ="}]);
        let r = parse_submission(v.to_string().as_bytes(), &limits).unwrap_err();
        assert_eq!(r.reason.code, ErrorCode::OversizeFile);
    }

    #[test]
    fn session_fields_are_checked_together() {
        let mut v = valid();
        v["session"] = json!({"new": true, "keep_alive_s": 60});
        assert!(parse(v).is_ok());
        let mut v = valid();
        v["session"] = json!({"keep_alive_s": 60});
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
        let mut v = valid();
        v["session"] = json!({"id": "../other-tenant"});
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
        let mut v = valid();
        v["session"] = json!({"new": "yes"});
        assert_eq!(code_of(parse(v)), ErrorCode::WrongType);
    }

    #[test]
    fn empty_code_is_allowed_only_with_other_work() {
        let mut v = valid();
        v["code"] = json!("");
        assert_eq!(code_of(parse(v.clone())), ErrorCode::InvalidValue);
        v["list_files"] = json!(true);
        assert!(parse(v).is_ok());
        let mut v = valid();
        v["code"] = json!("");
        v["session"] = json!({"id": crate::session::new_session_id(), "close": true});
        assert!(parse(v).is_ok());
    }

    #[test]
    fn get_files_paths_follow_the_workspace_rules() {
        let mut v = valid();
        v["get_files"] = json!(["ok.csv", "../../etc/shadow"]);
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidFilePath);
        let mut v = valid();
        v["get_files"] = json!(vec!["a"; MAX_GET_FILES + 1]);
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
    }

    #[test]
    fn upload_references_must_stay_under_the_tenants_prefix() {
        for (key, ok) in [
            ("acme/_uploads/big.csv", true),
            ("acme/_uploads/dir/big.csv", true),
            ("other/_uploads/big.csv", false),
            ("acme/_uploads/../../other/uploads/x", false),
            ("acme/_uploads/", false),
            ("acme/_uploads//x", false),
            ("acme/j-1/chart.png", false),
        ] {
            let mut v = valid();
            v["files"] = json!([{"path": "in.csv", "s3_key": key}]);
            assert_eq!(parse(v).is_ok(), ok, "{key}");
        }
        let mut v = valid();
        v["files"] = json!([{"path": "in.csv", "s3_key": "acme/_uploads/x", "content_b64": "aGk="}]);
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
        let mut v = valid();
        v["files"] = json!([{"path": "in.csv"}]);
        assert_eq!(code_of(parse(v)), ErrorCode::InvalidValue);
    }

    #[test]
    fn only_a_job_with_nothing_but_a_close_counts_as_only_closing_its_session() {
        let close = || {
            let mut v = valid();
            v["code"] = json!("");
            v["session"] = json!({"id": "ses_0123456789abcdef0123456789abcdef", "close": true});
            v
        };
        assert!(parse(close()).unwrap().only_closes_its_session());
        let mut blank = close();
        blank["code"] = json!("  \n");
        assert!(parse(blank).unwrap().only_closes_its_session());
        for (field, value) in [
            ("code", json!("print(1)")),
            ("files", json!([{"path": "in.csv", "content_b64": "aGk="}])),
            ("get_files", json!(["out.csv"])),
            ("list_files", json!(true)),
            ("env", json!({"A": "x"})),
            ("context", json!("ctx-1")),
        ] {
            let mut v = close();
            v[field] = value.clone();
            assert!(!parse(v).unwrap().only_closes_its_session(), "{field} = {value}");
        }
        assert!(!parse(valid()).unwrap().only_closes_its_session());
    }
}
