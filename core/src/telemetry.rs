//! Structured logs, the Prometheus registry, and the `/metrics` + `/healthz` HTTP endpoint.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use prometheus::{Encoder, Registry, TextEncoder};
use tracing_subscriber::EnvFilter;

/// Initialise logging: `SANDCELL_LOG` (an env-filter, default `info`) and `SANDCELL_LOG_FORMAT`
/// (`text`, default, or `json`).
pub fn init_tracing() {
    let filter = EnvFilter::try_from_env("SANDCELL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(true).with_ansi(ansi);
    if crate::config::var_or("SANDCELL_LOG_FORMAT", "text") == "json" {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// A health check: `Ok` when the component is usable, an error saying what is not.
pub type HealthCheck = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<()>> + Send>> + Send + Sync>;

/// Serve `GET /metrics` (Prometheus text format) and `GET /healthz` (200 when `health` passes,
/// 503 with the error otherwise) on `addr`, until the process ends.
pub async fn serve(addr: SocketAddr, registry: Registry, health: HealthCheck) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding metrics endpoint {addr}"))?;
    tracing::info!(%addr, "metrics and health endpoint listening");
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a metrics connection failed");
                continue;
            }
        };
        let registry = registry.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let registry = registry.clone();
                let health = health.clone();
                async move { Ok::<_, Infallible>(route(req.uri().path(), &registry, &health).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await {
                tracing::debug!(error = %e, "metrics connection ended with an error");
            }
        });
    }
}

async fn route(path: &str, registry: &Registry, health: &HealthCheck) -> Response<Full<Bytes>> {
    match path {
        "/metrics" => {
            let mut buf = Vec::new();
            match TextEncoder::new().encode(&registry.gather(), &mut buf) {
                Ok(()) => respond(StatusCode::OK, "text/plain; version=0.0.4", buf),
                Err(e) => respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", e.to_string().into_bytes()),
            }
        }
        "/healthz" => match health().await {
            Ok(()) => respond(StatusCode::OK, "application/json", br#"{"status":"ok"}"#.to_vec()),
            Err(e) => {
                let body = serde_json::json!({"status": "unhealthy", "error": format!("{e:#}")}).to_string();
                respond(StatusCode::SERVICE_UNAVAILABLE, "application/json", body.into_bytes())
            }
        },
        _ => respond(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
    }
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// Wait for SIGINT or SIGTERM (what Kubernetes and `stop_sandcell` send); the signal's name.
/// Both binaries stop gracefully on either.
pub async fn stop_signal() -> &'static str {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops this process gracefully");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term => "SIGTERM",
    }
}
