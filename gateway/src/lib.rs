//! `sandcell-gateway`: an E2B-compatible front door. Agents built on E2B's SDK
//! (`e2b-code-interpreter`) run their code in sandcell by setting `E2B_API_URL` and
//! `E2B_SANDBOX_URL` to the gateway and `E2B_API_KEY` to a key from `sandcell-admin key create`.
//! The gateway is only a client of sandcell: submissions to the queue, live output from the
//! events exchange, results from Postgres. See `docs/e2b-compatibility.md`.
//!
//! The map, in the order a request meets it:
//! - [`config`]: every setting;
//! - [`auth`]: an API key → a tenant (control plane); a sandbox's access token → that sandbox
//!   (its own ports). The only place a handler learns a tenant;
//! - [`control`]: E2B's control plane — create, connect, info, list, timeout, kill;
//! - [`interpreter`]: the code interpreter — `/execute` as NDJSON, contexts;
//! - [`files`]: envd — files, listing, commands (`process.Process/Start`), `/health`;
//! - [`connect`]: the Connect protocol's envelopes and errors (envd's RPCs);
//! - [`runs`]: a request → a sandcell job, submitted and waited for; [`live`]: its live output;
//!   [`body`]: a streamed answer, and the bound on what the gateway holds for clients that do
//!   not read it;
//! - [`sandboxes`]: what the gateway records about the sandboxes it opened;
//! - [`error`]: how every failure is answered; [`metrics`]: what is counted.
#![warn(missing_docs)]

pub mod auth;
pub mod body;
pub mod config;
pub mod connect;
pub mod control;
pub mod error;
pub mod files;
pub mod interpreter;
pub mod live;
pub mod metrics;
pub mod runs;
pub mod sandboxes;

use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::serve::ListenerExt;
use axum::Router;
use prometheus::{Encoder, TextEncoder};

/// What every handler shares.
pub struct Gateway {
    /// Settings.
    pub settings: config::Settings,
    /// API keys → tenants.
    pub keys: auth::Keys,
    /// Sandbox access tokens.
    pub tokens: auth::Tokens,
    /// Submitting and waiting.
    pub runs: runs::Runs,
    /// The sandboxes opened here.
    pub sandboxes: sandboxes::Sandboxes,
    /// Streamed responses: a tenant's unread bytes, bounded.
    pub bodies: body::Bodies,
    /// Fetches artifacts from the store (presigned URLs), whole, within 120 s.
    pub http: reqwest::Client,
    /// Passes a file from the store through to a client as it reads (`GET /files`): no limit on
    /// the whole transfer, which goes at the client's pace.
    pub passthrough: reqwest::Client,
    /// Metrics.
    pub metrics: metrics::Metrics,
}

impl Gateway {
    /// Connect to sandcell (retrying until the services answer).
    pub async fn connect(settings: config::Settings) -> Result<Arc<Self>> {
        let db = sandcell_core::retry_forever("connecting to Postgres", |_| sandcell_core::jobs::connect(&settings.database_url, 8)).await;
        let runs = runs::Runs::connect(&settings.amqp_url, &settings.database_url, settings.poll).await?;
        let metrics = metrics::Metrics::new()?;
        Ok(Arc::new(Gateway {
            bodies: body::Bodies::new(settings.unread_bytes, settings.stall, metrics.abandoned.clone()),
            keys: auth::Keys::new(sandcell_core::api_keys::ApiKeys::new(db.clone()), settings.key_cache),
            tokens: auth::Tokens::new(settings.secret.clone()),
            runs,
            sandboxes: sandboxes::Sandboxes::new(db),
            http: reqwest::Client::builder().timeout(std::time::Duration::from_secs(120)).build().context("building the HTTP client")?,
            passthrough: reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(10)).build().context("building the HTTP client")?,
            metrics,
            settings,
        }))
    }
}

/// Every route: the control plane, the code interpreter and envd on one address (E2B's SDK
/// sends sandbox traffic to `E2B_SANDBOX_URL` with the sandbox in `E2b-Sandbox-Id`), and the
/// gateway's own `/healthz` and `/metrics`.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes/{id}", get(control::info).delete(control::kill))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/execute", post(interpreter::execute))
        .route("/contexts", get(interpreter::list_contexts).post(interpreter::create_context))
        .route("/contexts/{id}", delete(interpreter::delete_context))
        .route("/contexts/{id}/restart", post(interpreter::restart_context))
        .route("/files", get(files::read).post(files::write))
        .route("/filesystem.Filesystem/ListDir", post(files::list_dir))
        .route("/filesystem.Filesystem/{method}", post(files::rpc_unsupported))
        .route("/process.Process/Start", post(files::start_process))
        .route("/process.Process/{method}", post(files::rpc_unsupported))
        .route("/health", get(files::health))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(unsupported)
        .layer(axum::extract::DefaultBodyLimit::max(12 << 20))
        .layer(axum::middleware::from_fn_with_state(gw.clone(), count))
        .with_state(gw)
}

/// Count every request by its route and status.
async fn count(State(gw): State<Arc<Gateway>>, request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let timer = gw.metrics.request_seconds.with_label_values(&[&route]).start_timer();
    let response = next.run(request).await;
    timer.observe_duration();
    gw.metrics.requests.with_label_values(&[&route, response.status().as_str()]).inc();
    response
}

/// Any other route: a call of E2B's API that sandcell does not offer, answered as JSON so the
/// SDK raises a readable error (an empty 404 makes it fail decoding the body).
async fn unsupported(request: Request) -> error::ApiError {
    error::ApiError::unsupported(&format!("{} {}", request.method(), request.uri().path()))
}

/// Healthy when Postgres answers (the broker connections reconnect by themselves, and a run
/// falls back to reading results when live output is away).
async fn healthz(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.sandboxes.ping().await {
        Ok(()) => (StatusCode::OK, axum::Json(serde_json::json!({"status": "ok"}))).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "unhealthy", "error": format!("{e:#}")}))).into_response(),
    }
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&gw.metrics.registry.gather(), &mut buf) {
        Ok(()) => ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], buf).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Serve until SIGTERM or SIGINT, then finish the requests in flight (their runs end by their
/// own time limits) and stop.
pub async fn serve(gw: Arc<Gateway>) -> Result<()> {
    let addr = gw.settings.addr;
    // TCP_NODELAY: a run's answer is a stream of small writes, which Nagle's algorithm would
    // otherwise hold for the client's delayed ACK (40 ms a run, measured).
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "setting TCP_NODELAY on a connection failed");
        }
    });
    tracing::info!(%addr, "E2B-compatible gateway listening");
    axum::serve(listener, router(gw))
        .with_graceful_shutdown(async {
            let signal = sandcell_core::telemetry::stop_signal().await;
            tracing::info!(signal, "stopping: no new connections, finishing the ones open");
        })
        .await
        .context("serving")
}
