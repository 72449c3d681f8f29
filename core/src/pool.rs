//! How every sandcell process (and the client library) pools its Postgres connections.
//!
//! sqlx's default pings a pooled connection before handing it out: a round trip to Postgres
//! before every statement, on every job's path (the scheduler's record, the worker's claim and
//! commit, a client's read), each waking a backend and its caller once more. It also pings
//! every connection as it is released (unconditionally, in the background), so a connection in
//! the idle queue was healthy when it went there. It can only have broken since if Postgres
//! went away in between, and no restart, crash recovery or failover of Postgres is over in
//! [`PING_IF_IDLE_FOR`]: a connection idle across one has been idle longer, and is pinged (and
//! replaced if dead) as before. A connection used more recently goes out without a ping.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;

/// A pooled connection idle for at least this long is pinged before it is handed out.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_millis(100);

/// The pool options of every connection pool: at most `max_connections`, connections pinged
/// before use only after [`PING_IF_IDLE_FOR`] idle, and an acquire given up after 10 s.
pub fn options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new().max_connections(max_connections).acquire_timeout(Duration::from_secs(10)).test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= PING_IF_IDLE_FOR {
                conn.ping().await?;
            }
            Ok(true)
        })
    })
}
