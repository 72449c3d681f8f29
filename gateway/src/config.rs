//! Every setting of the gateway, from environment variables with documented defaults
//! (`docs/configuration.md`, "Gateway").

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_core::config::{parse_or, var_or, var_required};

/// The gateway's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `SANDCELL_GATEWAY_ADDR` (default `127.0.0.1:9480`): where E2B's SDK is pointed, both as
    /// `E2B_API_URL` and `E2B_SANDBOX_URL`; `/metrics` and `/healthz` are served here too.
    pub addr: SocketAddr,
    /// `SANDCELL_AMQP_URL`: the service's broker user. The gateway is a trusted publisher
    /// (`SANDCELL_TRUSTED_PUBLISHERS`): it names the tenant its API key belongs to.
    pub amqp_url: String,
    /// `SANDCELL_DATABASE_URL`: the service's role (reads results, API keys, its own sandboxes).
    pub database_url: String,
    /// `SANDCELL_GATEWAY_SECRET`: signs each sandbox's access token (HMAC-SHA256 of its id).
    /// Unset: a random secret per process — tokens then stop working when the gateway restarts,
    /// and several gateways cannot share sandboxes, so the local stack sets one.
    pub secret: Vec<u8>,
    /// `SANDCELL_GATEWAY_TEMPLATES` (default `code-interpreter-v1,base`): the template ids a
    /// create may name. All of them are sandcell's one sandbox image.
    pub templates: Vec<String>,
    /// `SANDCELL_GATEWAY_OPEN_WAIT_S` (default 120): how long a create waits for the session's
    /// container before answering 503.
    pub open_wait: Duration,
    /// `SANDCELL_GATEWAY_RUN_TIMEOUT_MS` (default 300000): the time limit of a run. E2B's SDK
    /// sends none (its timeout is the client's own); the worker clamps it to its maximum.
    pub run_timeout_ms: u64,
    /// `SANDCELL_GATEWAY_MEMORY_MB` (default 1024): a sandbox's memory limit.
    pub memory_mb: u64,
    /// `SANDCELL_GATEWAY_CPUS` (default 1.0): a sandbox's CPU quota.
    pub cpus: f64,
    /// `SANDCELL_GATEWAY_KEY_CACHE_S` (default 10): how long an API key's lookup is reused, so
    /// a revoked key is refused within this time.
    pub key_cache: Duration,
    /// `SANDCELL_GATEWAY_POLL_MS` (default 1000): while a run waits for its live output's `end`,
    /// the result is also read this often, so a lost event delays an answer by at most this.
    pub poll: Duration,
    /// `SANDCELL_GATEWAY_UNREAD_BYTES` (default 67108864, 64 MiB): what a tenant's streamed
    /// answers (`/execute`, commands) may hold written and not yet read by their clients, all
    /// together. A live line that would pass it abandons its answer (the job is cancelled, as
    /// for a client that went away); a closing line waits for room; one line larger than it
    /// goes when it is alone ([`crate::body`]).
    pub unread_bytes: usize,
    /// `SANDCELL_GATEWAY_STALL_S` (default 60): a streamed answer holding unread lines that its
    /// client has read none of for this long is abandoned, its lines dropped.
    pub stall: Duration,
}

impl Settings {
    /// Read every setting.
    pub fn from_env() -> Result<Self> {
        let secret = match std::env::var("SANDCELL_GATEWAY_SECRET") {
            Ok(s) if !s.is_empty() => s.into_bytes(),
            _ => {
                tracing::warn!("SANDCELL_GATEWAY_SECRET is unset: sandbox access tokens are valid only until this process ends");
                sandcell_core::tenants::random_hex(64).into_bytes()
            }
        };
        Ok(Settings {
            addr: var_or("SANDCELL_GATEWAY_ADDR", "127.0.0.1:9480").parse().context("SANDCELL_GATEWAY_ADDR")?,
            amqp_url: var_required("SANDCELL_AMQP_URL")?,
            database_url: var_required("SANDCELL_DATABASE_URL")?,
            secret,
            templates: var_or("SANDCELL_GATEWAY_TEMPLATES", "code-interpreter-v1,base")
                .split(',')
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
                .collect(),
            open_wait: Duration::from_secs(parse_or("SANDCELL_GATEWAY_OPEN_WAIT_S", 120)?),
            run_timeout_ms: parse_or("SANDCELL_GATEWAY_RUN_TIMEOUT_MS", 300_000)?,
            memory_mb: parse_or("SANDCELL_GATEWAY_MEMORY_MB", 1024)?,
            cpus: parse_or("SANDCELL_GATEWAY_CPUS", 1.0)?,
            key_cache: Duration::from_secs(parse_or("SANDCELL_GATEWAY_KEY_CACHE_S", 10)?),
            poll: Duration::from_millis(parse_or("SANDCELL_GATEWAY_POLL_MS", 1000)?.max(50)),
            unread_bytes: parse_or("SANDCELL_GATEWAY_UNREAD_BYTES", 64usize << 20)?.max(1),
            stall: Duration::from_secs(parse_or("SANDCELL_GATEWAY_STALL_S", 60)?.max(1)),
        })
    }
}
