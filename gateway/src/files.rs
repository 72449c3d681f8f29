//! E2B's envd (the sandbox's port 49983): files (`GET`/`POST /files`, Connect's
//! `filesystem.Filesystem/ListDir`), commands (`process.Process/Start`, Connect server
//! streaming) and `/health`. Each is a job in the sandbox's session: a write is a job that brings
//! the file, a read a job that returns it as an artifact (fetched from the store), a listing a
//! job with `list_files`, a command a bash job whose live output becomes the stream. Paths are
//! the workspace's: `/home/user/...` or relative to it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use sandcell_protocol::event::EventBody;
use sandcell_protocol::{InputFile, JobResult, JobStatus, Language, SessionRequest, Submission};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::SandboxCaller;
use crate::connect;
use crate::control::is_running;
use crate::error::ApiError;
use crate::runs::job_id;
use crate::sandboxes::SandboxRow;
use crate::Gateway;

/// The sandbox user's home, the workspace.
pub const HOME: &str = "/home/user";
/// Largest file a write carries (the protocol's inline limit).
const MAX_FILE_BYTES: usize = 8 << 20;

/// A path as E2B's SDK names it → the workspace-relative path sandcell takes.
pub fn workspace_path(p: &str) -> Result<String, ApiError> {
    let rel = match p.strip_prefix(HOME) {
        Some(rest) if rest.starts_with('/') => rest.trim_start_matches('/'),
        Some("") => "",
        _ if p.starts_with('/') => return Err(ApiError::bad_request(format!("{p}: only files under {HOME} are reachable in a sandcell sandbox"))),
        _ => p.strip_prefix("./").unwrap_or(p),
    };
    if rel.is_empty() {
        return Ok(String::new()); // the workspace itself (a directory)
    }
    match sandcell_protocol::paths::validate_workspace_path(rel) {
        Ok(_) => Ok(rel.to_string()),
        Err(e) => Err(ApiError::bad_request(format!("{p}: {e}"))),
    }
}

/// A job in the sandbox's session, waited for; a refused job (the session ended meanwhile) is
/// the sandbox not running.
async fn session_job(gw: &Gateway, sb: &SandboxRow, language: Language, code: &str, fill: impl FnOnce(&mut Submission)) -> Result<JobResult, ApiError> {
    if !is_running(gw, &sb.tenant, &sb.session_id).await? {
        return Err(ApiError::not_running(&sb.session_id));
    }
    let mut sub = Submission::new(&sb.tenant, job_id(), language, code);
    sub.session = Some(SessionRequest { new: false, id: Some(sb.session_id.clone()), keep_alive_s: None, close: false });
    fill(&mut sub);
    let r = gw.runs.run(&sub, Duration::from_secs(180), |_| {}).await.map_err(|e| ApiError::internal("running a file job", &e))?;
    if r.status == JobStatus::Rejected {
        return Err(crate::error::refusal(&sb.session_id, r.reason.as_ref()));
    }
    Ok(r)
}

/// The store's answer for one artifact of `r` through `http`, its body not yet read.
async fn artifact_response(http: &reqwest::Client, r: &JobResult, path: &str) -> Result<reqwest::Response, ApiError> {
    let Some(url) = r.artifacts.iter().find(|a| a.path == path).and_then(|a| a.download_url.clone()) else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("{path}: not stored")));
    };
    let resp = http.get(&url).send().await.map_err(|e| ApiError::internal("fetching a file from the store", &e.into()))?;
    if !resp.status().is_success() {
        return Err(ApiError::internal("fetching a file from the store", &anyhow::anyhow!("store answered {}", resp.status())));
    }
    Ok(resp)
}

/// The bytes of one artifact of `r`, from the store, whole (an image to inline in a line).
pub async fn artifact_bytes(gw: &Gateway, r: &JobResult, path: &str) -> Result<Bytes, ApiError> {
    let resp = artifact_response(&gw.http, r, path).await?;
    resp.bytes().await.map_err(|e| ApiError::internal("reading a file from the store", &e.into()))
}

/// The query of `/files`.
#[derive(Debug, Deserialize)]
pub struct FileQuery {
    path: Option<String>,
}

/// `GET /files?path=`: a file's bytes.
pub async fn read(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, Query(q): Query<FileQuery>) -> Result<Response, ApiError> {
    let Some(path) = q.path else { return Err(ApiError::bad_request("path is required")) };
    let rel = workspace_path(&path)?;
    if rel.is_empty() {
        return Err(ApiError::bad_request(format!("{path} is a directory")));
    }
    let r = session_job(&gw, &caller.sandbox, Language::Python, "", |s| s.get_files = vec![rel.clone()]).await?;
    if !r.artifacts.iter().any(|a| a.path == rel) {
        let why = r.execution.skipped_files.iter().find(|s| s.path == rel).map_or("no such file", |s| s.reason.as_str()).to_string();
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("{path}: {why}")));
    }
    // Passed through as the client reads it, not read whole first: a file may be as large as a
    // job's artifact limit, and a client that reads slowly (or not at all) would otherwise make
    // the gateway hold all of it. It goes at the client's pace, with no limit on the whole
    // transfer (a large file to a slow client); what a stalled one holds is the connection's
    // write buffer and the store connection's.
    let resp = artifact_response(&gw.passthrough, &r, &rel).await?;
    let chunks = futures::stream::unfold(Some(resp), |resp| async move {
        let mut resp = resp?;
        match resp.chunk().await {
            Ok(Some(chunk)) => Some((Ok(chunk), Some(resp))),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e)), None)),
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], axum::body::Body::from_stream(chunks)).into_response())
}

/// `POST /files?path=`: multipart (each part `file`, its file name the path when no `path` is
/// given) or the raw body; answers the written entries.
pub async fn write(
    State(gw): State<Arc<Gateway>>,
    caller: SandboxCaller,
    Query(q): Query<FileQuery>,
    headers: HeaderMap,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let multipart = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("multipart/form-data"));
    if headers.get(header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes() != b"identity") {
        return Err(ApiError::unsupported("compressed uploads (Content-Encoding)"));
    }
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if multipart {
        let mut form = Multipart::from_request(request, &gw).await.map_err(|e| ApiError::bad_request(format!("multipart body: {e}")))?;
        while let Some(field) = form.next_field().await.map_err(|e| ApiError::bad_request(format!("multipart body: {e}")))? {
            let name = match (&q.path, field.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) => f.to_string(),
                (None, None) => return Err(ApiError::bad_request("a multipart part without a file name, and no path")),
            };
            let data = field.bytes().await.map_err(|e| ApiError::bad_request(format!("multipart body: {e}")))?;
            files.push((name, data));
        }
    } else {
        let Some(path) = q.path.clone() else { return Err(ApiError::bad_request("path is required")) };
        let data = Bytes::from_request(request, &gw).await.map_err(|e| ApiError::bad_request(format!("body: {e}")))?;
        files.push((path, data));
    }
    if files.is_empty() {
        return Err(ApiError::bad_request("no file in the request"));
    }
    let mut inputs = Vec::new();
    let mut written = Vec::new();
    for (path, data) in &files {
        if data.len() > MAX_FILE_BYTES {
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("{path}: files over 8 MiB are not supported through the gateway")));
        }
        let rel = workspace_path(path)?;
        if rel.is_empty() {
            return Err(ApiError::bad_request(format!("{path} is a directory")));
        }
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_string();
        written.push(json!({"name": name, "type": "file", "path": format!("{HOME}/{rel}")}));
        inputs.push(InputFile::inline(rel, data));
    }
    let r = session_job(&gw, &caller.sandbox, Language::Python, "pass", |s| s.files = inputs).await?;
    if r.status != JobStatus::Succeeded {
        let message = r.reason.as_ref().map(|r| r.message.clone()).unwrap_or_else(|| r.status.to_string());
        return Err(ApiError::bad_request(format!("writing failed: {message}")));
    }
    Ok(Json(Value::Array(written)))
}

/// `filesystem.Filesystem/ListDir`'s request.
#[derive(Debug, Deserialize)]
struct ListDir {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

/// The entries of `dir` (workspace-relative, "" for the root) down to `depth` levels, from a
/// listing of the workspace's regular files: directories are those files' parents.
pub fn list_entries(files: &[(String, u64, f64)], dir: &str, depth: u32) -> Vec<Value> {
    let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
    let mut dirs = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for (path, size, mtime) in files {
        let Some(rest) = path.strip_prefix(&prefix) else { continue };
        let parts: Vec<&str> = rest.split('/').collect();
        for level in 1..parts.len() {
            if level as u32 <= depth {
                dirs.insert(parts[..level].join("/"));
            }
        }
        if parts.len() as u32 <= depth {
            let modified = chrono::DateTime::from_timestamp(*mtime as i64, 0).unwrap_or_default().to_rfc3339();
            out.push(json!({
                "name": parts[parts.len() - 1], "type": "FILE_TYPE_FILE", "path": format!("{HOME}/{path}"),
                "size": size.to_string(), "mode": 0o644, "permissions": "-rw-r--r--", "owner": "user", "group": "user",
                "modifiedTime": modified,
            }));
        }
    }
    for d in dirs {
        let name = d.rsplit('/').next().unwrap_or(&d).to_string();
        out.push(json!({
            "name": name, "type": "FILE_TYPE_DIRECTORY", "path": format!("{HOME}/{prefix}{d}"),
            "size": "0", "mode": 0o755, "permissions": "drwxr-xr-x", "owner": "user", "group": "user",
        }));
    }
    out
}

/// `POST /filesystem.Filesystem/ListDir` (Connect, JSON codec).
pub async fn list_dir(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, body: Bytes) -> Response {
    let req: ListDir = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return connect::unary_error("invalid_argument", &format!("ListDir request: {e}")),
    };
    let dir = match workspace_path(&req.path) {
        Ok(d) => d,
        Err(e) => return connect::unary_error("invalid_argument", &e.message),
    };
    let r = match session_job(&gw, &caller.sandbox, Language::Python, "", |s| s.list_files = true).await {
        Ok(r) => r,
        Err(e) => return connect::unary_error(connect::code_of(e.status), &e.message),
    };
    let files: Vec<(String, u64, f64)> = r.execution.files.map(|f| f.entries.into_iter().map(|e| (e.path, e.size, e.mtime)).collect()).unwrap_or_default();
    let entries = list_entries(&files, &dir, req.depth.unwrap_or(1).max(1));
    if entries.is_empty() && !dir.is_empty() {
        return connect::unary_error("not_found", &format!("{}: no such directory", req.path));
    }
    Json(json!({"entries": entries})).into_response()
}

/// Every other `filesystem.Filesystem` and `process.Process` method: Connect's `unimplemented`.
pub async fn rpc_unsupported(_caller: SandboxCaller, request: Request) -> Response {
    let method = request.uri().path().trim_start_matches('/').to_string();
    connect::unary_error("unimplemented", &format!("{method} is not supported by sandcell's E2B gateway (docs/e2b-compatibility.md)"))
}

/// `process.Process/Start`'s request (the fields the gateway uses).
#[derive(Debug, Deserialize)]
struct StartRequest {
    process: ProcessConfig,
}

#[derive(Debug, Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The bash script that runs a process as `Start` describes it: the SDK's own `bash -l -c CMD`
/// becomes CMD; anything else is quoted word by word. Environment and directory come first.
pub fn script_of(p: &ProcessConfigView) -> Result<String, String> {
    let mut script = String::new();
    for (k, v) in p.envs {
        if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || k.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!("invalid environment variable name {k:?}"));
        }
        script.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    if let Some(cwd) = p.cwd.filter(|c| !c.is_empty()) {
        script.push_str(&format!("cd {} || exit 1\n", shell_quote(cwd)));
    }
    let is_bash = p.cmd == "/bin/bash" || p.cmd == "bash";
    match p.args {
        [flag_l, flag_c, cmd] if is_bash && flag_l == "-l" && flag_c == "-c" => script.push_str(cmd),
        [flag_c, cmd] if is_bash && flag_c == "-c" => script.push_str(cmd),
        args => {
            script.push_str(&shell_quote(p.cmd));
            for a in args {
                script.push(' ');
                script.push_str(&shell_quote(a));
            }
        }
    }
    Ok(script)
}

/// A borrowed view of a process to run (what [`script_of`] needs).
pub struct ProcessConfigView<'a> {
    /// The program.
    pub cmd: &'a str,
    /// Its arguments.
    pub args: &'a [String],
    /// Its environment additions.
    pub envs: &'a std::collections::BTreeMap<String, String>,
    /// Its working directory.
    pub cwd: Option<&'a str>,
}

/// `POST /process.Process/Start` (Connect server streaming, JSON codec): a bash job whose live
/// output is the stream — `start`, then `data` (base64), then `end` with the exit code.
pub async fn start_process(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, headers: HeaderMap, body: Bytes) -> Response {
    let req: StartRequest = match connect::first_message(&body).and_then(|m| serde_json::from_slice(m).map_err(|e| e.to_string())) {
        Ok(r) => r,
        Err(e) => return connect::stream_error("invalid_argument", &format!("Start request: {e}")),
    };
    let p = &req.process;
    let sb = caller.sandbox;
    // The sandbox's variables are the job's environment; the process's own are exported first
    // thing in its script.
    let env = match crate::interpreter::run_env(&sb.env, Default::default()) {
        Ok(env) => env,
        Err(e) => return connect::stream_error("invalid_argument", &e.message),
    };
    let script = match script_of(&ProcessConfigView { cmd: &p.cmd, args: &p.args, envs: &p.envs, cwd: p.cwd.as_deref() }) {
        Ok(s) => s,
        Err(e) => return connect::stream_error("invalid_argument", &e),
    };
    match is_running(&gw, &sb.tenant, &sb.session_id).await {
        Ok(true) => {}
        Ok(false) => return connect::stream_error("unavailable", &format!("sandbox {} is not running", sb.session_id)),
        Err(e) => return connect::stream_error("unavailable", &e.message),
    }
    let timeout_ms = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(gw.settings.run_timeout_ms)
        .min(gw.settings.run_timeout_ms);
    let mut sub = Submission::new(&sb.tenant, job_id(), Language::Bash, script);
    sub.session = Some(SessionRequest { new: false, id: Some(sb.session_id.clone()), keep_alive_s: None, close: false });
    sub.timeout_ms = Some(timeout_ms.max(100));
    sub.env = env;
    let (tx, body) = gw.bodies.channel(&sb.tenant);
    tx.send_control(connect::frame(&json!({"event": {"start": {"pid": 1}}})));
    tokio::spawn(async move {
        let b64 = base64::engine::general_purpose::STANDARD;
        let (mut out_len, mut err_len) = (0usize, 0usize);
        let events_tx = tx.clone();
        let run = gw.runs.run(&sub, Duration::from_millis(timeout_ms) + Duration::from_secs(120), |event| {
            let data = match event {
                EventBody::Stdout { text } => {
                    out_len += text.len();
                    json!({"stdout": b64.encode(text.as_bytes())})
                }
                EventBody::Stderr { text } => {
                    err_len += text.len();
                    json!({"stderr": b64.encode(text.as_bytes())})
                }
                _ => return,
            };
            events_tx.send(connect::frame(&json!({"event": {"data": data}})));
        });
        let result = crate::runs::follow(&gw, &sub, run, &tx, connect::frame(&json!({"event": {"keepalive": {}}}))).await;
        match result {
            Ok(r) => {
                let e = &r.execution;
                if let Some(rest) = e.stdout.get(out_len..).filter(|s| !s.is_empty()) {
                    tx.send_paced(connect::frame(&json!({"event": {"data": {"stdout": b64.encode(rest.as_bytes())}}}))).await;
                }
                if let Some(rest) = e.stderr.get(err_len..).filter(|s| !s.is_empty()) {
                    tx.send_paced(connect::frame(&json!({"event": {"data": {"stderr": b64.encode(rest.as_bytes())}}}))).await;
                }
                let (code, status) = match (r.status, e.exit_code) {
                    (JobStatus::TimedOut, _) => (-1, "signal: killed (time limit)".to_string()),
                    (JobStatus::OomKilled, _) => (137, "signal: killed (out of memory)".to_string()),
                    (_, Some(c)) => (c, format!("exit status {c}")),
                    (s, None) => (-1, s.to_string()),
                };
                tx.send_paced(connect::frame(&json!({"event": {"end": {"exitCode": code, "exited": true, "status": status}}}))).await;
                tx.send_paced(connect::end_frame(None)).await;
                gw.metrics.runs.with_label_values(&[r.status.as_str()]).inc();
            }
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), job_id = sub.job_id, "a command had no result");
                gw.metrics.runs.with_label_values(&["no_result"]).inc();
                tx.send_paced(connect::end_frame(Some(("unavailable", "sandcell did not answer this command in time")))).await;
            }
        }
        tx.finish(crate::runs::KEEPALIVE).await;
    });
    ([(header::CONTENT_TYPE, "application/connect+json")], body).into_response()
}

/// `GET /health` on envd: 204 while the sandbox runs, 502 "was not found" after (the SDK's
/// `is_running`), 503 when sandcell cannot tell.
pub async fn health(State(gw): State<Arc<Gateway>>, caller: SandboxCaller) -> Result<StatusCode, ApiError> {
    match is_running(&gw, &caller.sandbox.tenant, &caller.sandbox.session_id).await? {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(ApiError::not_running(&caller.sandbox.session_id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_paths_map_into_the_workspace_and_others_are_refused() {
        assert_eq!(workspace_path("/home/user/a/b.txt").ok(), Some("a/b.txt".to_string()));
        assert_eq!(workspace_path("b.txt").ok(), Some("b.txt".to_string()));
        assert_eq!(workspace_path("./b.txt").ok(), Some("b.txt".to_string()));
        assert!(workspace_path("/etc/passwd").is_err());
        assert!(workspace_path("/home/userx/a").is_err());
        assert!(workspace_path("../x").is_err());
        assert!(workspace_path("/home/user/../x").is_err());
    }

    #[test]
    fn a_listing_shows_one_level_with_directories_made_from_deeper_files() {
        let files = vec![("a.txt".to_string(), 3, 0.0), ("d/b.txt".to_string(), 4, 0.0), ("d/e/c.txt".to_string(), 5, 0.0)];
        let names = |v: Vec<Value>| v.iter().map(|e| format!("{}:{}", e["type"].as_str().unwrap_or(""), e["path"].as_str().unwrap_or(""))).collect::<Vec<_>>();
        assert_eq!(names(list_entries(&files, "", 1)), vec!["FILE_TYPE_FILE:/home/user/a.txt", "FILE_TYPE_DIRECTORY:/home/user/d"]);
        assert_eq!(names(list_entries(&files, "d", 1)), vec!["FILE_TYPE_FILE:/home/user/d/b.txt", "FILE_TYPE_DIRECTORY:/home/user/d/e"]);
        assert_eq!(list_entries(&files, "", 3).len(), 5);
    }

    #[test]
    fn the_sdks_bash_command_runs_as_written_and_other_programs_are_quoted() {
        let envs = [("GREETING".to_string(), "it's".to_string())].into_iter().collect();
        let args = vec!["-l".to_string(), "-c".to_string(), "echo $GREETING".to_string()];
        let s = script_of(&ProcessConfigView { cmd: "/bin/bash", args: &args, envs: &envs, cwd: Some("/home/user/d") });
        assert_eq!(s.as_deref(), Ok("export GREETING='it'\\''s'\ncd '/home/user/d' || exit 1\necho $GREETING"));
        let none = Default::default();
        let args = vec!["a b".to_string()];
        assert_eq!(script_of(&ProcessConfigView { cmd: "ls", args: &args, envs: &none, cwd: None }).as_deref(), Ok("'ls' 'a b'"));
        let bad = [("A-B".to_string(), "x".to_string())].into_iter().collect();
        assert!(script_of(&ProcessConfigView { cmd: "ls", args: &[], envs: &bad, cwd: None }).is_err());
    }
}
