//! Tenants' database sessions that hold what every tenant shares are ended.
//!
//! A tenant reads its results through a database login of its own (row-level security shows
//! it only its rows), so it can also keep a transaction open: idle in it, in one long
//! statement, with a short statement every few seconds, or by not reading its connection
//! (Postgres sends a listener its notifications inside a transaction, and waits to write them).
//! Such a transaction holds what all tenants share:
//! - vacuum's horizon, for every table (the job rows every commit rewrites);
//! - a listener's place in Postgres' notification queue. Every job's commit writes to that queue
//!   (`sandcell_notify_job`), the queue cannot be trimmed past its slowest listener, and once
//!   it is full (8 GB) every commit that notifies fails. Two connections of one tenant, one
//!   listening in an open transaction and one notifying, filled it in 44 s on this project's
//!   2-core machine.
//!
//! Postgres' own timeouts (`idle_in_transaction_session_timeout`, `statement_timeout`) cannot
//! be imposed on a role: any session may `SET` them, and neither sees a transaction kept busy.
//! So every `SANDCELL_TENANT_DB_CHECK_MS` the scheduler looks at the tenants' sessions
//! ([`sandcell_core::tenants::sessions_holding`]: by when their transaction began, not their
//! last statement) and ends (`pg_terminate_backend`: the connection closes, the transaction
//! rolls back) each one whose transaction began `SANDCELL_TENANT_DB_HOLD_S` ago. Every scheduler
//! of a fleet does; ending a session twice is harmless. Seeing them needs `pg_read_all_stats`
//! and ending them `pg_signal_backend`, which `deploy/postgres/lockdown.sql` grants (the
//! scheduler says at start if either is missing).

use std::time::Duration;

use sandcell_core::tenants;
use sqlx::PgPool;

use crate::metrics::Metrics;

/// Look every `every` and end the tenants' sessions whose transaction began `hold` ago, until
/// the process ends.
pub async fn run(pool: PgPool, metrics: Metrics, every: Duration, hold: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // An ending refused (no `pg_signal_backend`) is said loudly once, then quietly.
    let mut refusal_said = false;
    loop {
        tick.tick().await;
        let found = match tenants::sessions_holding(&pool, hold).await {
            Ok(found) => found,
            Err(e) => {
                tracing::debug!(error = format!("{e:#}"), "could not look at tenants' database sessions; looking again next tick");
                continue;
            }
        };
        for session in found {
            match tenants::end_tenant_session(&pool, &session).await {
                Ok(true) => {
                    metrics.tenant_db_sessions_ended.inc();
                    tracing::warn!(
                        role = %session.role,
                        pid = session.pid,
                        hold_s = hold.as_secs_f64(),
                        "ended a tenant's database session whose transaction held what every tenant shares"
                    );
                }
                Ok(false) => {}
                Err(e) if !refusal_said => {
                    refusal_said = true;
                    tracing::error!(
                        error = format!("{e:#}"),
                        role = %session.role,
                        "could not end a tenant's database session that holds what every tenant shares (apply deploy/postgres/lockdown.sql)"
                    );
                }
                Err(e) => tracing::debug!(error = format!("{e:#}"), role = %session.role, "could not end a tenant's database session"),
            }
        }
    }
}
