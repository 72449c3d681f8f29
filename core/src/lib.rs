//! Infrastructure shared by the scheduler and the worker.
//!
//! Each module owns one concern so that the binaries never talk to a service directly:
//! - [`config`]: environment variables, their defaults, and the operator's limit policy;
//! - [`broker`]: RabbitMQ connection, the queue topology, confirmed publishing;
//! - [`jobs`]: the job store in Postgres — every status transition goes through it;
//! - [`store`]: the S3 artifact store (upload, presign, delete, lifecycle backstop);
//! - [`telemetry`]: structured logs, the Prometheus registry, `/metrics` and `/healthz`.

pub mod broker;
pub mod config;
pub mod jobs;
pub mod store;
pub mod telemetry;

/// Run `f` until it succeeds, waiting with capped exponential backoff between tries and logging
/// every failure. Used for connecting to services that may still be starting or restarting.
pub async fn retry_forever<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut delay = std::time::Duration::from_millis(200);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => {
                tracing::warn!(target: "sandcell::retry", what, error = format!("{e:#}"), retry_in_ms = delay.as_millis() as u64, "not available yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}
