//! E2B's code interpreter (the sandbox's port 49999): `POST /execute` answers NDJSON lines as
//! the code runs — `stdout`/`stderr`, `result` (MIME bundles, `is_main_result`), `error` — from
//! the job's live output, and completes them from the job's result when it is committed: what
//! an event lost along the way (the broker restarted, a full buffer) is sent from the record, so
//! the stream always ends with everything the result holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use bytes::Bytes;
use sandcell_protocol::event::EventBody;
use sandcell_protocol::{JobResult, JobStatus, Language, Output, SessionRequest, Submission};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::SandboxCaller;
use crate::control::is_running;
use crate::error::ApiError;
use crate::runs::job_id;
use crate::Gateway;

/// The one context a sandbox has: its session's kernel.
pub const DEFAULT_CONTEXT: &str = "default";

/// The body of `POST /execute`.
#[derive(Debug, Deserialize)]
pub struct ExecuteBody {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<HashMap<String, String>>,
}

/// MIME type → the key of E2B's `result` line.
const MIME_KEYS: [(&str, &str); 10] = [
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
];

fn now_ns() -> i64 {
    chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
}

/// A `result` line from a MIME bundle (`application/json` as JSON when it parses).
pub fn result_line(data: &BTreeMap<String, String>, is_main_result: bool) -> Value {
    let mut line = json!({"type": "result", "is_main_result": is_main_result});
    let mut extra = serde_json::Map::new();
    for (mime, value) in data {
        match MIME_KEYS.iter().find(|(m, _)| m == mime) {
            Some((_, "json")) => line["json"] = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.clone())),
            Some((_, key)) => line[*key] = Value::String(value.clone()),
            None => {
                extra.insert(mime.clone(), Value::String(value.clone()));
            }
        }
    }
    if !extra.is_empty() {
        line["extra"] = Value::Object(extra);
    }
    line
}

fn error_line(name: &str, value: &str, traceback: &str) -> Value {
    json!({"type": "error", "name": name, "value": value, "traceback": traceback})
}

/// What has been streamed so far, so the result adds only what the events missed.
#[derive(Debug, Default)]
pub struct Streamed {
    stdout: usize,
    stderr: usize,
    /// Outputs seen (the index of the next in the result's `outputs`).
    outputs: usize,
    /// Outputs not sent live because an image was left out of their event (over 1 MiB): sent
    /// from the result, with the image from the store.
    deferred: Vec<usize>,
    error: bool,
}

impl Streamed {
    /// The lines of one live event (none for events that have no E2B form).
    pub fn event(&mut self, body: EventBody) -> Option<Value> {
        match body {
            EventBody::Stdout { text } => {
                self.stdout += text.len();
                Some(json!({"type": "stdout", "text": text, "timestamp": now_ns()}))
            }
            EventBody::Stderr { text } => {
                self.stderr += text.len();
                Some(json!({"type": "stderr", "text": text, "timestamp": now_ns()}))
            }
            EventBody::Output { output_type, data, omitted } => {
                self.outputs += 1;
                if !omitted.is_empty() {
                    self.deferred.push(self.outputs - 1);
                    return None;
                }
                Some(result_line(&data, output_type == "execute_result"))
            }
            EventBody::Error { ename, evalue, traceback } => {
                self.error = true;
                Some(error_line(&ename, &evalue, &traceback.join("\n")))
            }
            EventBody::End { .. } => None,
        }
    }

    /// The closing lines: what the result holds that no event carried, then an error line for
    /// an end that is not the code's own exception (time limit, memory, a refused job). Images
    /// the events left out are not fetched here: `images` gets (line index, MIME, artifact path).
    pub fn closing(&mut self, r: &JobResult) -> (Vec<Value>, Vec<(usize, String, String)>) {
        let mut lines = Vec::new();
        let mut images = Vec::new();
        let e = &r.execution;
        if let Some(rest) = e.stdout.get(self.stdout..).filter(|s| !s.is_empty()) {
            lines.push(json!({"type": "stdout", "text": rest, "timestamp": now_ns()}));
        }
        if let Some(rest) = e.stderr.get(self.stderr..).filter(|s| !s.is_empty()) {
            lines.push(json!({"type": "stderr", "text": rest, "timestamp": now_ns()}));
        }
        for (_, output) in e.outputs.iter().enumerate().filter(|(i, _)| *i >= self.outputs || self.deferred.contains(i)) {
            let (data, artifacts, main) = match output {
                Output::ExecuteResult { data, artifacts } => (data, artifacts, true),
                Output::DisplayData { data, artifacts } => (data, artifacts, false),
            };
            for (mime, path) in artifacts {
                images.push((lines.len(), mime.clone(), path.clone()));
            }
            lines.push(result_line(data, main));
        }
        if let Some(count) = e.execution_count {
            lines.push(json!({"type": "number_of_executions", "execution_count": count}));
        }
        if let (Some(err), false) = (&e.error, self.error) {
            lines.push(error_line(&err.ename, &err.evalue, &err.traceback.join("\n")));
        } else if e.error.is_none() {
            let reason = r.reason.as_ref().map(|r| r.message.as_str()).unwrap_or("");
            match r.status {
                JobStatus::Succeeded | JobStatus::Running | JobStatus::Queued => {}
                JobStatus::TimedOut => lines.push(error_line("TimeoutError", &format!("the code ran past its time limit: {reason}"), "")),
                JobStatus::OomKilled => lines.push(error_line("MemoryError", &format!("the sandbox ran out of memory: {reason}"), "")),
                other => lines.push(error_line("SandboxError", &format!("{other}: {reason}"), "")),
            }
        }
        (lines, images)
    }
}

fn ndjson(line: &Value) -> Bytes {
    let mut b = serde_json::to_vec(line).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

/// The most image bytes (before base64) one run's closing lines carry, fetched from the store:
/// images past it are left out, like one the store could not give. A run's closing lines are
/// built whole before the tenant's unread-bytes budget (`body.rs`) applies to them, so without
/// this bound a tenant's sandboxes finishing together with 100 MiB of figures each (a job's
/// artifact limit) made the gateway hold ~370 MiB a run, ~7 GB for 20 sandboxes.
const MAX_RUN_IMAGE_BYTES: u64 = 16 << 20;

/// The images to fetch, in order, while their recorded sizes fit in `budget` together; an
/// image with no artifact of that path is skipped (there is nothing to fetch). Also returns how
/// many were left out for the budget.
fn within_image_budget(r: &JobResult, images: Vec<(usize, String, String)>, budget: u64) -> (Vec<(usize, String, String)>, usize) {
    let mut left = budget;
    let mut over = 0;
    let mut kept = Vec::with_capacity(images.len());
    for image in images {
        let Some(size) = r.artifacts.iter().find(|a| a.path == image.2).map(|a| u64::try_from(a.size_bytes).unwrap_or(u64::MAX)) else { continue };
        if size > left {
            over += 1;
            continue;
        }
        left -= size;
        kept.push(image);
    }
    (kept, over)
}

/// Fill in images the events left out (over 1 MiB), from the result's artifacts, up to
/// [`MAX_RUN_IMAGE_BYTES`] a run.
async fn fetch_images(gw: &Gateway, r: &JobResult, lines: &mut [Value], images: Vec<(usize, String, String)>) {
    let b64 = base64::engine::general_purpose::STANDARD;
    let (images, over) = within_image_budget(r, images, MAX_RUN_IMAGE_BYTES);
    if over > 0 {
        tracing::warn!(job_id = r.job_id, left_out = over, budget = MAX_RUN_IMAGE_BYTES, "images of a result over the run's image budget; left out");
    }
    for (i, mime, path) in images {
        let Some(key) = MIME_KEYS.iter().find(|(m, _)| *m == mime).map(|(_, k)| *k) else { continue };
        match crate::files::artifact_bytes(gw, r, &path).await {
            Ok(bytes) => lines[i][key] = Value::String(b64.encode(bytes)),
            Err(e) => tracing::warn!(error = e.message, path, "an image of a result could not be fetched; left out"),
        }
    }
}

/// `POST /execute`: run code in the sandbox's kernel, streaming its output as NDJSON.
pub async fn execute(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, Json(body): Json<ExecuteBody>) -> Result<Response, ApiError> {
    let sb = caller.sandbox;
    let language = match body.language.as_deref().unwrap_or("python") {
        "python" | "python3" => Language::Python,
        "bash" | "sh" => Language::Bash,
        other => return Err(ApiError::bad_request(format!("language {other:?} is not supported: python or bash"))),
    };
    let env = run_env(&sb.env, body.env_vars.unwrap_or_default())?;
    let context = match body.context_id.as_deref() {
        None | Some(DEFAULT_CONTEXT) => None,
        Some(id) => match gw.sandboxes.namespace(&sb.session_id, id).await.map_err(|e| ApiError::internal("reading the context", &e))? {
            Some(namespace) => Some(namespace),
            None => return Err(ApiError::new(StatusCode::NOT_FOUND, format!("context {id} not found"))),
        },
    };
    if context.is_some() && language != Language::Python {
        return Err(ApiError::bad_request("a context other than the default runs python only"));
    }
    if !is_running(&gw, &sb.tenant, &sb.session_id).await? {
        return Err(ApiError::not_running(&sb.session_id));
    }
    let mut sub = Submission::new(&sb.tenant, job_id(), language, body.code);
    sub.session = Some(SessionRequest { new: false, id: Some(sb.session_id.clone()), keep_alive_s: None, close: false });
    sub.timeout_ms = Some(gw.settings.run_timeout_ms);
    sub.env = env;
    sub.context = context;
    let wait = Duration::from_millis(gw.settings.run_timeout_ms) + Duration::from_secs(120);
    let (tx, body) = gw.bodies.channel(&sb.tenant);
    let started = std::time::Instant::now();
    tokio::spawn(async move {
        let mut streamed = Streamed::default();
        let result = {
            let events_tx = tx.clone();
            let run = gw.runs.run(&sub, wait, |event| {
                if let Some(line) = streamed.event(event) {
                    events_tx.send(ndjson(&line));
                }
            });
            // Ignored by E2B's SDK: written so that a client that went away is noticed.
            crate::runs::follow(&gw, &sub, run, &tx, ndjson(&json!({"type": "keepalive"}))).await
        };
        let lines = match result {
            Ok(r) => {
                let (mut lines, images) = streamed.closing(&r);
                fetch_images(&gw, &r, &mut lines, images).await;
                gw.metrics.runs.with_label_values(&[r.status.as_str()]).inc();
                lines
            }
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), job_id = sub.job_id, "a run had no result");
                gw.metrics.runs.with_label_values(&["no_result"]).inc();
                vec![error_line("SandboxError", "sandcell did not answer this run in time; the sandbox may still be running it", "")]
            }
        };
        for line in lines {
            if !tx.send_paced(ndjson(&line)).await {
                break;
            }
        }
        gw.metrics.run_seconds.observe(started.elapsed().as_secs_f64());
        tx.finish(crate::runs::KEEPALIVE).await;
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}

/// Refuse variables a job could not carry (the protocol's rules).
pub fn check_env(env: &HashMap<String, String>) -> Result<(), ApiError> {
    use sandcell_protocol::submission::{is_valid_env_name, MAX_ENV_BYTES, MAX_ENV_VARS};
    if env.len() > MAX_ENV_VARS {
        return Err(ApiError::bad_request(format!("{} environment variables; at most {MAX_ENV_VARS}", env.len())));
    }
    if let Some(bad) = env.keys().find(|k| !is_valid_env_name(k)) {
        return Err(ApiError::bad_request(format!("environment variable name {bad:?} must match [A-Za-z_][A-Za-z0-9_]*")));
    }
    if env.values().any(|v| v.contains('\0')) {
        return Err(ApiError::bad_request("an environment variable's value contains NUL"));
    }
    if env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() > MAX_ENV_BYTES {
        return Err(ApiError::bad_request(format!("environment variables over {MAX_ENV_BYTES} bytes")));
    }
    Ok(())
}

/// The sandbox's variables with a run's own over them.
pub fn run_env(sandbox: &Value, run: HashMap<String, String>) -> Result<BTreeMap<String, String>, ApiError> {
    check_env(&run)?;
    let mut env: BTreeMap<String, String> =
        sandbox.as_object().map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect()).unwrap_or_default();
    env.extend(run);
    Ok(env)
}

fn context_doc(id: &str, language: &str, cwd: &str) -> Value {
    json!({"id": id, "language": language, "cwd": cwd})
}

/// `GET /contexts`: the default context, then those created.
pub async fn list_contexts(State(gw): State<Arc<Gateway>>, caller: SandboxCaller) -> Result<Json<Value>, ApiError> {
    let mut out = vec![context_doc(DEFAULT_CONTEXT, "python", crate::files::HOME)];
    let made = gw.sandboxes.contexts(&caller.sandbox.session_id).await.map_err(|e| ApiError::internal("listing contexts", &e))?;
    out.extend(made.iter().map(|(id, language, cwd)| context_doc(id, language, cwd)));
    Ok(Json(Value::Array(out)))
}

/// The body of `POST /contexts`.
#[derive(Debug, Default, Deserialize)]
pub struct ContextBody {
    language: Option<String>,
    cwd: Option<String>,
}

/// `POST /contexts`: a new context — a namespace of the sandbox's kernel, made on its first run.
pub async fn create_context(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, body: Option<Json<ContextBody>>) -> Result<Json<Value>, ApiError> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let language = body.language.unwrap_or_else(|| "python".to_string());
    if language != "python" {
        return Err(ApiError::bad_request(format!("language {language:?}: contexts run python only")));
    }
    let cwd = body.cwd.unwrap_or_else(|| crate::files::HOME.to_string());
    if cwd.trim_end_matches('/') != crate::files::HOME {
        return Err(ApiError::bad_request(format!("cwd {cwd:?}: a context's working directory is {}", crate::files::HOME)));
    }
    let id = uuid::Uuid::new_v4().to_string();
    let made = gw
        .sandboxes
        .create_context(&caller.sandbox.session_id, &id, &language, crate::files::HOME)
        .await
        .map_err(|e| ApiError::internal("creating the context", &e))?;
    if !made {
        return Err(ApiError::bad_request(format!("a sandbox has at most {} contexts besides the default one", crate::sandboxes::MAX_CONTEXTS)));
    }
    Ok(Json(context_doc(&id, &language, crate::files::HOME)))
}

/// `DELETE /contexts/{id}`: runs naming it are refused from then on (its namespace stays in
/// the kernel's memory until the sandbox ends).
pub async fn delete_context(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    if id == DEFAULT_CONTEXT {
        return Err(ApiError::bad_request("the default context cannot be deleted"));
    }
    match gw.sandboxes.delete_context(&caller.sandbox.session_id, &id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::new(StatusCode::NOT_FOUND, format!("context {id} not found"))),
        Err(e) => Err(ApiError::internal("deleting the context", &e)),
    }
}

/// `POST /contexts/{id}/restart`: the context's next run starts in a fresh namespace.
pub async fn restart_context(State(gw): State<Arc<Gateway>>, caller: SandboxCaller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    if id == DEFAULT_CONTEXT {
        return Err(ApiError::unsupported("restarting the default context"));
    }
    match gw.sandboxes.restart_context(&caller.sandbox.session_id, &id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::new(StatusCode::NOT_FOUND, format!("context {id} not found"))),
        Err(e) => Err(ApiError::internal("restarting the context", &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_images_are_fetched_only_while_their_sizes_fit_its_budget() {
        let mut r = record("", JobStatus::Succeeded, None);
        for (path, size) in [("_display/0.png", 6i64), ("_display/1.png", 5), ("_display/2.png", 3)] {
            r.artifacts.push(sandcell_protocol::Artifact {
                path: path.into(),
                kind: sandcell_protocol::ArtifactKind::Display,
                size_bytes: size,
                content_type: "image/png".into(),
                sha256: String::new(),
                s3_key: format!("t/j/{path}"),
                expires_at: chrono::Utc::now(),
                state: sandcell_protocol::ArtifactState::Available,
                download_url: None,
            });
        }
        let images =
            |paths: &[&str]| -> Vec<(usize, String, String)> { paths.iter().enumerate().map(|(i, p)| (i, "image/png".to_string(), p.to_string())).collect() };
        let paths = |kept: &[(usize, String, String)]| kept.iter().map(|k| k.2.clone()).collect::<Vec<_>>();
        // 6 + 5 fit in 12; the third (3 more) does not; one of no artifact is not counted.
        let (kept, over) = within_image_budget(&r, images(&["_display/0.png", "_display/1.png", "_display/2.png", "_display/9.png"]), 12);
        assert_eq!((paths(&kept), over), (vec!["_display/0.png".to_string(), "_display/1.png".to_string()], 1));
        // A smaller image after one that did not fit still does.
        let (kept, over) = within_image_budget(&r, images(&["_display/0.png", "_display/1.png", "_display/2.png"]), 9);
        assert_eq!((paths(&kept), over), (vec!["_display/0.png".to_string(), "_display/2.png".to_string()], 1));
    }

    #[test]
    fn a_mime_bundle_becomes_e2b_result_keys_and_unknown_types_go_to_extra() {
        let data: BTreeMap<String, String> =
            [("text/plain", "1"), ("text/html", "<b>1</b>"), ("application/json", "{\"a\": 1}"), ("application/x-custom", "z")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let line = result_line(&data, true);
        assert_eq!(line["type"], "result");
        assert_eq!(line["text"], "1");
        assert_eq!(line["html"], "<b>1</b>");
        assert_eq!(line["json"]["a"], 1);
        assert_eq!(line["extra"]["application/x-custom"], "z");
        assert_eq!(line["is_main_result"], true);
    }

    fn record(stdout: &str, status: JobStatus, error: Option<(&str, &str)>) -> JobResult {
        let mut v = json!({
            "job_id": "j", "tenant": "t", "status": status.as_str(), "attempts": 1, "artifacts": [],
            "timings": {"queued_at": "2026-11-23T00:00:00Z"},
            "language": null, "reason": null, "limits": null, "worker_id": null, "session": null,
            "stdout": stdout, "stderr": "", "outputs": [{"type": "execute_result", "data": {"text/plain": "2"}}],
            "stdout_truncated": false, "stderr_truncated": false, "exit_code": null, "error": null, "kernel_restarted": false,
            "files": null, "limits_hit": [], "skipped_files": [], "processes_killed": 0,
        });
        if let Some((n, m)) = error {
            v["error"] = json!({"ename": n, "evalue": m, "traceback": ["line 1", "line 2"]});
        }
        serde_json::from_value(v).unwrap_or_else(|e| panic!("test record: {e}"))
    }

    #[test]
    fn the_result_adds_exactly_what_the_events_did_not_carry() {
        let mut s = Streamed::default();
        assert!(s.event(EventBody::Stdout { text: "a\n".into() }).is_some());
        let (lines, images) = s.closing(&record("a\nb\n", JobStatus::Succeeded, None));
        assert!(images.is_empty());
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["text"], "b\n");
        assert_eq!(lines[1]["text"], "2");
    }

    #[test]
    fn an_output_whose_image_was_left_out_is_sent_from_the_result() {
        let mut s = Streamed::default();
        let omitted = EventBody::Output { output_type: "execute_result".into(), data: BTreeMap::new(), omitted: vec!["image/png".into()] };
        assert!(s.event(omitted).is_none(), "held back, not sent without its image");
        let (lines, _) = s.closing(&record("", JobStatus::Succeeded, None));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["text"], "2");
    }

    #[test]
    fn nothing_is_sent_twice_when_every_event_arrived() {
        let mut s = Streamed::default();
        s.event(EventBody::Stdout { text: "a\n".into() });
        s.event(EventBody::Output { output_type: "execute_result".into(), data: BTreeMap::new(), omitted: vec![] });
        s.event(EventBody::Error { ename: "ZeroDivisionError".into(), evalue: "x".into(), traceback: vec![] });
        let (lines, _) = s.closing(&record("a\n", JobStatus::Failed, Some(("ZeroDivisionError", "x"))));
        assert!(lines.is_empty(), "{lines:?}");
    }

    #[test]
    fn an_end_that_is_not_the_codes_exception_becomes_an_error_line() {
        let mut s = Streamed { outputs: 1, ..Default::default() };
        let (lines, _) = s.closing(&record("", JobStatus::TimedOut, None));
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["name"], "TimeoutError");
        let (lines, _) = Streamed { outputs: 1, ..Default::default() }.closing(&record("", JobStatus::Failed, Some(("ZeroDivisionError", "x"))));
        assert_eq!(lines[0]["traceback"], "line 1\nline 2");
    }
}
