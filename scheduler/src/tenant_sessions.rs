//! Tenants' database sessions that hold what every tenant shares are ended.
//!
//! A tenant reads its results through a database login of its own (row-level security shows
//! it only its rows), so it can also keep a transaction open, run one statement for long, or
//! stop reading its connection. Each of these holds what all tenants share:
//! - vacuum's horizon, for every table (the job rows every commit rewrites);
//! - a listener's place in Postgres' notification queue. Every job's commit writes to that queue
//!   (`sandcell_notify_job`), the queue cannot be trimmed past its slowest listener, and once
//!   it is full (8 GB) every commit that notifies fails. Two connections of one tenant, one
//!   listening in an open transaction and one notifying, filled it in 44 s on this project's
//!   2-core machine.
//!
//! Postgres' own timeouts (`idle_in_transaction_session_timeout`, `statement_timeout`) cannot
//! be imposed on a role: any session may `SET` them. So every `SANDCELL_TENANT_DB_CHECK_MS` the
//! scheduler looks at the tenants' sessions ([`sandcell_core::tenants::sessions_holding`]) and
//! ends (`pg_terminate_backend`: the connection closes, the transaction rolls back) each one
//! idle in a transaction, or in one statement, for `SANDCELL_TENANT_DB_HOLD_S`, or seen blocked
//! writing to its client at every look for that long ([`judge`]). Every scheduler of a fleet
//! does; ending a session twice is harmless. Seeing them needs `pg_read_all_stats` and ending
//! them `pg_signal_backend`, which `deploy/postgres/lockdown.sql` grants (the scheduler says at
//! start if either is missing).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sandcell_core::tenants::{self, Holding, TenantSession};
use sqlx::PgPool;

use crate::metrics::Metrics;

/// A session seen blocked writing to its client, by process id and backend start.
type Sighting = (i32, chrono::DateTime<chrono::Utc>);

/// Which of the sessions `found` by one look to end now. Postgres times the first two kinds
/// itself (`found` holds only those past `hold`); for one blocked writing it keeps no time, so
/// `seen` remembers when each was first seen so, and a session is ended once it has been seen
/// blocked at every look for `hold`. A session a look does not find blocked is forgotten: a
/// client slow to read for a moment never adds up to `hold`.
fn judge(seen: &mut HashMap<Sighting, Instant>, found: Vec<TenantSession>, now: Instant, hold: Duration) -> Vec<TenantSession> {
    let blocked_now: Vec<Sighting> = found.iter().filter(|s| s.holding == Holding::NotReading).map(|s| (s.pid, s.started)).collect();
    seen.retain(|k, _| blocked_now.contains(k));
    found
        .into_iter()
        .filter(|s| match s.holding {
            Holding::IdleInTransaction | Holding::LongStatement => true,
            Holding::NotReading => now.saturating_duration_since(*seen.entry((s.pid, s.started)).or_insert(now)) >= hold,
        })
        .collect()
}

/// Look every `every` and end the tenants' sessions that held what all share for `hold`, until
/// the process ends.
pub async fn run(pool: PgPool, metrics: Metrics, every: Duration, hold: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = HashMap::new();
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
        for session in judge(&mut seen, found, Instant::now(), hold) {
            match tenants::end_tenant_session(&pool, &session).await {
                Ok(true) => {
                    metrics.tenant_db_sessions_ended.with_label_values(&[session.holding.as_str()]).inc();
                    tracing::warn!(
                        role = %session.role,
                        pid = session.pid,
                        holding = session.holding.as_str(),
                        hold_s = hold.as_secs_f64(),
                        "ended a tenant's database session that held what every tenant shares"
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

#[cfg(test)]
mod tests {
    use super::*;

    fn session(pid: i32, holding: Holding) -> TenantSession {
        TenantSession { pid, started: chrono::DateTime::<chrono::Utc>::UNIX_EPOCH, role: "sandcell_t_0123456789abcdef".into(), holding }
    }

    #[test]
    fn sessions_postgres_timed_past_the_hold_are_ended_at_the_first_look() {
        let mut seen = HashMap::new();
        let found = vec![session(1, Holding::IdleInTransaction), session(2, Holding::LongStatement)];
        let ended = judge(&mut seen, found.clone(), Instant::now(), Duration::from_secs(10));
        assert_eq!(ended, found);
    }

    #[test]
    fn a_session_blocked_writing_is_ended_once_seen_so_at_every_look_for_the_hold() {
        let hold = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut seen = HashMap::new();
        for s in 0..10 {
            assert!(judge(&mut seen, vec![session(7, Holding::NotReading)], t0 + Duration::from_secs(s), hold).is_empty(), "at {s} s");
        }
        assert_eq!(judge(&mut seen, vec![session(7, Holding::NotReading)], t0 + hold, hold), vec![session(7, Holding::NotReading)]);
    }

    #[test]
    fn a_client_slow_to_read_for_a_moment_is_forgotten_between_looks() {
        let hold = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut seen = HashMap::new();
        assert!(judge(&mut seen, vec![session(7, Holding::NotReading)], t0, hold).is_empty());
        assert!(judge(&mut seen, vec![], t0 + Duration::from_secs(5), hold).is_empty(), "it read");
        assert!(judge(&mut seen, vec![session(7, Holding::NotReading)], t0 + Duration::from_secs(11), hold).is_empty(), "a new sighting starts again");
        assert!(seen.len() == 1);
    }

    #[test]
    fn a_reused_process_id_is_another_session() {
        let hold = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut seen = HashMap::new();
        assert!(judge(&mut seen, vec![session(7, Holding::NotReading)], t0, hold).is_empty());
        let mut later = session(7, Holding::NotReading);
        later.started += chrono::Duration::seconds(3);
        assert!(judge(&mut seen, vec![later], t0 + hold, hold).is_empty(), "not the session first seen");
    }
}
