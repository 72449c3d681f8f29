//! The E2B gateway's round trip: `run_code("1+1")` as E2B's SDK sends it (`POST /execute`,
//! NDJSON read to its end) over a kept-alive HTTP connection, next to sandcell's own in-session
//! `1+1` through the Rust client, the two interleaved job by job in one run, so that their
//! difference is the gateway's overhead and not the machine's drift.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::Bench;

/// The two series, sample `i` of each taken one after the other.
pub struct Figures {
    /// Through the gateway.
    pub gateway: Vec<Duration>,
    /// Native, interleaved with the gateway's.
    pub native: Vec<Duration>,
}

/// Measure `n` of each against the gateway at `addr` (after 20 of each to warm up).
pub async fn measure(b: &Bench, addr: &str, n: usize) -> Result<Figures> {
    let pool = sqlx::PgPool::connect(b.client.database_url()).await.context("connecting to Postgres")?;
    let key = sandcell_core::api_keys::ApiKeys::new(pool).create(&b.tenant).await?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    let base = format!("http://{addr}");
    let created: Value = http
        .post(format!("{base}/v2/sandboxes"))
        .header("X-API-KEY", &key.key)
        .json(&json!({"templateID": "code-interpreter-v1", "timeout": 300, "metadata": {}, "envVars": {}}))
        .send()
        .await
        .context("creating a sandbox through the gateway (is sandcell-gateway running?)")?
        .error_for_status()?
        .json()
        .await?;
    let id = created["sandboxID"].as_str().context("no sandboxID")?.to_string();
    let token = created["envdAccessToken"].as_str().context("no envdAccessToken")?.to_string();
    let run_code = || async {
        let t0 = Instant::now();
        let body = http
            .post(format!("{base}/execute"))
            .header("E2b-Sandbox-Id", &id)
            .header("E2b-Sandbox-Port", "49999")
            .header("X-Access-Token", &token)
            .json(&json!({"code": "1+1", "context_id": null, "language": null, "env_vars": null}))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        anyhow::ensure!(body.lines().any(|l| l.contains("\"text\":\"2\"")), "run_code(\"1+1\") through the gateway answered {body:?}");
        anyhow::Ok(t0.elapsed())
    };
    let (_, sid) = b.open("x = 0", None).await?;
    let native = || async { anyhow::Ok(b.run(&b.in_session(&sid, "1+1")).await?.0) };
    for _ in 0..20 {
        run_code().await?;
        native().await?;
    }
    let (mut gateway, mut own) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        gateway.push(run_code().await?);
        own.push(native().await?);
    }
    http.delete(format!("{base}/sandboxes/{id}")).header("X-API-KEY", &key.key).send().await?.error_for_status()?;
    b.close(&sid).await?;
    Ok(Figures { gateway, native: own })
}
