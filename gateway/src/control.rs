//! E2B's control plane (`E2B_API_URL`): create, connect, get info, list, set timeout and kill
//! sandboxes. A sandbox is a sandcell session; its timeout is the session's keep-alive.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::Utc;
use sandcell_protocol::{ErrorCode, JobStatus, Language, Session, SessionRequest, SessionState, Submission};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::runs::job_id;
use crate::sandboxes::SandboxRow;
use crate::Gateway;

/// The envd version the gateway reports: the SDK gates behaviour on it (0.5.7 and later:
/// octet-stream uploads; below 0.4.0 it would send a username with every file call).
pub const ENVD_VERSION: &str = "0.5.7";
/// `clientID` in every sandbox document (E2B's node id; sandcell has none to show).
const CLIENT_ID: &str = "sandcell";

/// The body of `POST /v2/sandboxes`. Fields of E2B's API not listed here are ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateBody {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    /// Seconds the sandbox lives: its keep-alive.
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<HashMap<String, String>>,
    #[serde(default)]
    env_vars: Option<HashMap<String, String>>,
    #[serde(default)]
    auto_pause: Option<bool>,
}

/// The body of `POST /sandboxes/{id}/timeout` and of connect.
#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    timeout: Option<u64>,
}

/// What create and connect answer.
fn created(gw: &Gateway, row: &SandboxRow) -> Value {
    let token = gw.tokens.token(&row.session_id);
    json!({
        "templateID": row.template_id,
        "sandboxID": row.session_id,
        "clientID": CLIENT_ID,
        "alias": row.template_id,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
    })
}

/// What get-info and list answer for one sandbox.
fn described(row: &SandboxRow, ends: Option<chrono::DateTime<Utc>>) -> Value {
    json!({
        "templateID": row.template_id,
        "sandboxID": row.session_id,
        "clientID": CLIENT_ID,
        "alias": row.template_id,
        "startedAt": row.created_at.to_rfc3339(),
        "endAt": ends.unwrap_or_else(Utc::now).to_rfc3339(),
        "envdVersion": ENVD_VERSION,
        "cpuCount": row.cpu_count,
        "memoryMB": row.memory_mb,
        "diskSizeMB": row.disk_mb,
        "metadata": row.metadata,
        "state": "running",
    })
}

fn is_live(s: &Session) -> bool {
    matches!(s.state, SessionState::Starting | SessionState::Active | SessionState::Moving)
}

/// The sandbox `id` of `tenant`, if it is running; 404 otherwise (another tenant's sandbox is
/// answered exactly as one that does not exist).
pub async fn live_sandbox(gw: &Gateway, tenant: &str, id: &str) -> Result<(SandboxRow, Session), ApiError> {
    let row = gw.sandboxes.row(id).await.map_err(|e| ApiError::internal("reading the sandbox", &e))?;
    let Some(row) = row.filter(|r| r.tenant == tenant) else {
        return Err(ApiError::sandbox_not_found(id));
    };
    match gw.runs.session(tenant, id).await.map_err(|e| ApiError::internal("reading the session", &e))? {
        Some(s) if is_live(&s) => Ok((row, s)),
        _ => Err(ApiError::sandbox_not_found(id)),
    }
}

/// `POST /v2/sandboxes` (and `/sandboxes`): open a session, answer 201.
pub async fn create(State(gw): State<Arc<Gateway>>, caller: Caller, Json(body): Json<CreateBody>) -> Result<Response, ApiError> {
    let template = body.template_id.unwrap_or_else(|| "code-interpreter-v1".to_string());
    if !gw.settings.templates.contains(&template) {
        return Err(ApiError::bad_request(format!("unknown template {template:?}; this gateway offers {}", gw.settings.templates.join(", "))));
    }
    let env = body.env_vars.unwrap_or_default();
    crate::interpreter::check_env(&env)?;
    let metadata = body.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    if body.auto_pause == Some(true) {
        return Err(ApiError::unsupported("auto-pause"));
    }
    let mut sub = Submission::new(&caller.tenant, job_id(), Language::Python, "pass");
    sub.session = Some(SessionRequest { new: true, id: None, keep_alive_s: Some(body.timeout.unwrap_or(300).max(1)), close: false });
    sub.memory_mb = Some(gw.settings.memory_mb);
    sub.cpus = Some(gw.settings.cpus);
    let r = gw.runs.run(&sub, gw.settings.open_wait, |_| {}).await.map_err(|e| ApiError::internal("opening the sandbox", &e))?;
    let session = match (r.status, &r.session) {
        (JobStatus::Succeeded, Some(s)) => s.clone(),
        (JobStatus::Rejected, _) => {
            let reason = r.reason.as_ref();
            let message = reason.map(|r| r.message.clone()).unwrap_or_default();
            return Err(match reason.map(|r| r.code) {
                Some(ErrorCode::QuotaExceeded) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, message),
                _ => ApiError::bad_request(message),
            });
        }
        (status, _) => {
            let message = r.reason.as_ref().map(|r| r.message.clone()).unwrap_or_default();
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the sandbox did not start ({status}): {message}")));
        }
    };
    let limits = r.limits.as_ref();
    let row = SandboxRow {
        session_id: session.id.clone(),
        tenant: caller.tenant.clone(),
        template_id: template,
        metadata: serde_json::to_value(metadata).unwrap_or_default(),
        cpu_count: limits.map_or(1, |l| l.cpus.ceil().max(1.0) as i32),
        memory_mb: limits.map_or(0, |l| l.memory_mb as i32),
        disk_mb: limits.map_or(0, |l| l.workspace_mb as i32),
        env: serde_json::to_value(env).unwrap_or_default(),
        created_at: Utc::now(),
    };
    gw.sandboxes.insert(&row).await.map_err(|e| ApiError::internal("recording the sandbox", &e))?;
    tracing::info!(tenant = caller.tenant, sandbox = row.session_id, "sandbox created");
    Ok((StatusCode::CREATED, Json(created(&gw, &row))).into_response())
}

/// Most metadata entries a sandbox carries, and most bytes of them in all.
const MAX_METADATA_ENTRIES: usize = 64;
const MAX_METADATA_BYTES: usize = 16 << 10;

fn check_metadata(metadata: &HashMap<String, String>) -> Result<(), ApiError> {
    let bytes: usize = metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if metadata.len() > MAX_METADATA_ENTRIES || bytes > MAX_METADATA_BYTES {
        return Err(ApiError::bad_request(format!(
            "metadata has {} entries and {bytes} bytes; at most {MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes",
            metadata.len()
        )));
    }
    Ok(())
}

/// Give a session a new keep-alive: a job that does nothing, with `keep_alive_s`, submitted and
/// not waited for. It runs after the session's current run, if any — which is when a keep-alive
/// counts from anyway (a session never expires while it runs a job).
async fn set_keep_alive(gw: &Gateway, tenant: &str, id: &str, seconds: u64) -> Result<(), ApiError> {
    let mut sub = Submission::new(tenant, job_id(), Language::Python, "pass");
    sub.session = Some(SessionRequest { new: false, id: Some(id.to_string()), keep_alive_s: Some(seconds.max(1)), close: false });
    gw.runs.submit(&sub).await.map_err(|e| ApiError::internal("setting the timeout", &e))
}

/// `POST /sandboxes/{id}/timeout`: the sandbox now lives `timeout` seconds after its last use.
pub async fn set_timeout(
    State(gw): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<TimeoutBody>,
) -> Result<StatusCode, ApiError> {
    live_sandbox(&gw, &caller.tenant, &id).await?;
    let Some(seconds) = body.timeout else {
        return Err(ApiError::bad_request("timeout (seconds) is required"));
    };
    set_keep_alive(&gw, &caller.tenant, &id, seconds).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v2/sandboxes/{id}/connect`: a running sandbox's tokens (its timeout renewed when one
/// is given).
pub async fn connect(State(gw): State<Arc<Gateway>>, caller: Caller, Path(id): Path<String>, body: Option<Json<TimeoutBody>>) -> Result<Response, ApiError> {
    let (row, _) = live_sandbox(&gw, &caller.tenant, &id).await?;
    if let Some(seconds) = body.and_then(|Json(b)| b.timeout) {
        set_keep_alive(&gw, &caller.tenant, &id, seconds).await?;
    }
    Ok((StatusCode::OK, Json(created(&gw, &row))).into_response())
}

/// `GET /sandboxes/{id}`.
pub async fn info(State(gw): State<Arc<Gateway>>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let (row, session) = live_sandbox(&gw, &caller.tenant, &id).await?;
    Ok(Json(described(&row, session.expires_at)))
}

/// `DELETE /sandboxes/{id}`: close the session (204), or 404 when there is no running one.
pub async fn kill(State(gw): State<Arc<Gateway>>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    live_sandbox(&gw, &caller.tenant, &id).await?;
    // A kill does not wait for the sandbox's runs: each is cancelled, then the close runs.
    let unfinished = gw.sandboxes.unfinished_jobs(&caller.tenant, &id).await.map_err(|e| ApiError::internal("killing the sandbox", &e))?;
    for job in &unfinished {
        if let Err(e) = gw.runs.cancel(&caller.tenant, job, &id).await {
            tracing::warn!(error = format!("{e:#}"), job_id = job, "cancelling a run of a sandbox being killed failed; the close waits for it");
        }
    }
    let mut sub = Submission::new(&caller.tenant, job_id(), Language::Python, "");
    sub.session = Some(SessionRequest { new: false, id: Some(id.clone()), keep_alive_s: None, close: true });
    let r = gw.runs.run(&sub, Duration::from_secs(60), |_| {}).await.map_err(|e| ApiError::internal("killing the sandbox", &e))?;
    if r.status == JobStatus::Rejected {
        return Err(ApiError::sandbox_not_found(&id));
    }
    gw.sandboxes.forget(&id);
    tracing::info!(tenant = caller.tenant, sandbox = id, "sandbox killed");
    Ok(StatusCode::NO_CONTENT)
}

/// The query of `GET /v2/sandboxes`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    /// `k=v&k2=v2`, URL-encoded: only sandboxes whose metadata holds all of these.
    metadata: Option<String>,
    /// `running`, `paused` or both (comma-separated): sandcell has only running ones.
    state: Option<String>,
    limit: Option<i64>,
    next_token: Option<String>,
}

/// Parse `k=v&k2=v2` (each part URL-encoded).
fn metadata_filter(q: &str) -> Result<Vec<(String, String)>, ApiError> {
    let decode = |s: &str| -> Result<String, ApiError> {
        let bytes = s.replace('+', " ");
        percent_decode(&bytes).ok_or_else(|| ApiError::bad_request("metadata filter is not valid percent-encoding"))
    };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Ok((decode(k)?, decode(v)?))
        })
        .collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `GET /v2/sandboxes` (and `/sandboxes`): the key's running sandboxes; the next page's token in
/// the `x-next-token` header.
pub async fn list(State(gw): State<Arc<Gateway>>, caller: Caller, Query(q): Query<ListQuery>) -> Result<Response, ApiError> {
    let wants_running = q.state.as_deref().is_none_or(|s| s.split(',').any(|s| s.trim() == "running"));
    let filter = match q.metadata.as_deref() {
        Some(m) => metadata_filter(m)?,
        None => Vec::new(),
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let offset: i64 = match q.next_token.as_deref() {
        Some(t) if !t.is_empty() => t.parse::<u32>().map_err(|_| ApiError::bad_request("invalid nextToken"))?.into(),
        _ => 0,
    };
    let mut out = Vec::new();
    let mut next = None;
    if wants_running {
        let wanted = Value::Object(filter.into_iter().map(|(k, v)| (k, Value::String(v))).collect());
        let page = gw.sandboxes.live(&caller.tenant, &wanted, offset, limit + 1).await.map_err(|e| ApiError::internal("listing sandboxes", &e))?;
        if page.len() as i64 > limit {
            next = Some(offset + limit);
        }
        out.extend(page.iter().take(limit as usize).map(|l| described(&l.row, l.expires_at)));
    }
    let mut headers = HeaderMap::new();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n.to_string()).ok()) {
        headers.insert("x-next-token", n);
    }
    Ok((StatusCode::OK, headers, Json(out)).into_response())
}

/// Whether `tenant`'s session `id` is running (what the sandbox's own ports check first).
pub async fn is_running(gw: &Gateway, tenant: &str, id: &str) -> Result<bool, ApiError> {
    let session = gw.runs.session(tenant, id).await.map_err(|e| ApiError::internal("reading the session", &e))?;
    Ok(session.as_ref().is_some_and(is_live))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metadata_filter_is_decoded_pair_by_pair() {
        let f = metadata_filter("user%3Did=a%26b&kind=x+y&empty=").unwrap_or_default();
        assert_eq!(f, vec![("user=id".into(), "a&b".into()), ("kind".into(), "x y".into()), ("empty".into(), "".into())]);
        assert!(metadata_filter("bad=%zz").is_err());
    }
}
