//! Infrastructure shared by the scheduler and the worker.
//!
//! Each module owns one concern so that the binaries never talk to a service directly:
//! - [`config`]: environment variables, their defaults, and the operator's limit policy;
//! - [`broker`]: RabbitMQ connection, the queue topology, confirmed publishing;
//! - [`reads`]: a client's read (a job's result, a session, the notification channel);
//!
//! and, with the `services` feature (on by default; a client turns it off and does without the
//! S3 SDK, the HTTP server and the stores' write paths):
//! - [`jobs`]: the job store in Postgres — every status transition goes through it;
//! - [`sessions`]: the session store — every session write but its creation (recorded with
//!   its opening job by [`jobs`]), through the session state machine;
//! - [`tenants`]: quotas as stored, tenant database roles, artifact reservations (the admission
//!   check itself is the SQL function `sandcell_record_job` that [`jobs`] calls);
//! - [`api_keys`]: API keys (stored hashed), each naming a tenant;
//! - [`management`]: RabbitMQ's management API (tenants' broker users, the live-output watch);
//! - [`retention`]: how long finished results and upload answers are kept, and their deletion;
//! - [`store`]: the S3 artifact store (upload, presign, delete, lifecycle backstop);
//! - [`telemetry`]: structured logs, the Prometheus registry, `/metrics` and `/healthz`.
#![warn(missing_docs)]

#[cfg(feature = "services")]
pub mod api_keys;
pub mod broker;
pub mod config;
#[cfg(feature = "services")]
pub mod jobs;
#[cfg(feature = "services")]
pub mod management;
pub mod pool;
pub mod reads;
#[cfg(feature = "services")]
pub mod retention;
#[cfg(feature = "services")]
pub mod sessions;
#[cfg(feature = "services")]
pub mod store;
#[cfg(feature = "services")]
pub mod telemetry;
#[cfg(feature = "services")]
pub mod tenants;
#[cfg(feature = "services")]
pub mod uploads;

/// Run `f` until it succeeds, waiting with capped exponential backoff between tries and logging
/// every failure. Used for connecting to services that may still be starting or restarting.
pub async fn retry_forever<T, F, Fut>(what: &str, f: F) -> T
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    match retry(what, u32::MAX, f).await {
        Ok(v) => v,
        Err(_) => unreachable!("u32::MAX tries at up to 5 s each outlast any process"),
    }
}

/// Run `f` (given the 1-based try number) up to `tries` times with capped exponential backoff
/// (200 ms doubling to 5 s), logging each failure; returns the last error when all tries fail.
/// The one retry policy for transient service failures (broker, database, store).
pub async fn retry<T, F, Fut>(what: &str, tries: u32, f: F) -> anyhow::Result<T>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    retry_classified(what, tries, |_| Failure::Transient, f).await
}

/// What a failure says about trying the same work again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A later try may succeed: it counts against the tries.
    Transient,
    /// The service is out (for the database, `jobs::is_unavailable`): retried for as long as the
    /// outage lasts, not counted. The work is not at fault, and giving it up would only send it
    /// back through the broker, which dead-letters a message after a few returns.
    Outage,
    /// The same work can never succeed (for the database, `jobs::is_permanent`): given up at once.
    Permanent,
}

/// [`retry`], with each failure's [`Failure`] as `classify` says: an outage is retried until the
/// service is back, without counting against `tries`; a permanent failure is returned at once.
/// `what` is written out only when a try fails (a job's step names its job without a `format!`
/// on every call).
pub async fn retry_classified<T, F, Fut>(what: impl std::fmt::Display, tries: u32, classify: fn(&anyhow::Error) -> Failure, mut f: F) -> anyhow::Result<T>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut delay = std::time::Duration::from_millis(200);
    let (mut attempt, mut counted) = (1, 1);
    loop {
        let e = match f(attempt).await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let failure = classify(&e);
        if failure == Failure::Permanent || (failure == Failure::Transient && counted >= tries) {
            return Err(e.context(format!("{what}: giving up after {attempt} tries")));
        }
        tracing::warn!(target: "sandcell::retry", %what, attempt, ?failure, error = format!("{e:#}"), retry_in_ms = delay.as_millis() as u64, "failed; retrying");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(std::time::Duration::from_secs(5));
        attempt += 1;
        counted += u32::from(failure == Failure::Transient);
    }
}
