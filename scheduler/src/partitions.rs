//! Which intake partitions this scheduler consumes: several schedulers share the intake, and each
//! session's submissions are still handled one at a time, in the order they were published.
//!
//! Submissions reach the schedulers through `SANDCELL_INTAKE_PARTITIONS` queues
//! (`sandcell.submissions.<p>`), filled by a consistent-hash exchange on the routing key — a
//! session's id (`broker::intake_routing_key`), so all of one session's submissions share a
//! partition. Two guarantees, from two places:
//! - **order** comes from the broker: each partition queue has a *single active consumer*, so at
//!   most one scheduler takes its messages at any time, however the schedulers' own bookkeeping
//!   goes. A scheduler that gives a partition up stops taking from it, finishes the submissions it
//!   took, and only then closes the partition's channel, which returns what the broker had sent
//!   but nobody started to the head of the queue, in order. A scheduler that dies has its
//!   unacknowledged messages returned the same way (its connection closes). Within a partition,
//!   the intake's lanes keep one session's submissions in order while others run concurrently;
//! - **spread** comes from Postgres: schedulers share the partitions out with advisory locks
//!   ([`Ownership`]). Each counts the live schedulers (each holds a presence lock), holds at most
//!   its fair share (`ceil(P / live)`), gives up the excess, and takes free partitions up to its
//!   share. A scheduler's locks live as long as its database connection: a killed scheduler's
//!   partitions are free at once, taken by the others at their next look (`SANDCELL_INTAKE_REBALANCE_MS`).
//!
//! A lock is taken before the partition's consumer starts and released only after its channel is
//! closed, so a partition changes hands only between a closed channel and a new consumer.

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use sqlx::{Connection, PgConnection};

/// `pg_advisory_lock(CLASS, p)`: partition `p` is this scheduler's.
const PARTITION_LOCK_CLASS: i32 = 0x5343_0001;
/// `pg_advisory_lock(CLASS, random)`: this scheduler is alive (its connection is open).
const PRESENCE_LOCK_CLASS: i32 = 0x5343_0002;

/// The most partitions one of `live` schedulers should hold, so that together they hold all `partitions`.
pub fn fair_share(partitions: u16, live: usize) -> usize {
    usize::from(partitions).div_ceil(live.max(1))
}

/// What to change after a look at the fleet: partitions to take (their locks already held) and
/// partitions to give up (stop them, then [`Ownership::release`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Newly locked: start consuming them.
    pub take: Vec<u16>,
    /// Over the fair share: stop consuming them, then release them.
    pub give_up: Vec<u16>,
}

/// Which of `held` to give up to stay within `share`: the highest-numbered first.
pub fn excess(held: &BTreeSet<u16>, share: usize) -> Vec<u16> {
    held.iter().rev().take(held.len().saturating_sub(share)).copied().collect()
}

/// The order in which a scheduler tries free partitions: from its own offset around the ring, so
/// schedulers that start together do not all contend for partition 0 first.
pub fn candidates(partitions: u16, offset: u16, held: &BTreeSet<u16>) -> Vec<u16> {
    (0..partitions).map(|i| (i + offset) % partitions.max(1)).filter(|p| !held.contains(p)).collect()
}

/// This scheduler's partition locks, on a database connection of their own.
pub struct Ownership {
    conn: PgConnection,
    partitions: u16,
    offset: u16,
    held: BTreeSet<u16>,
}

impl Ownership {
    /// Connect and announce this scheduler (its presence lock). The locks it takes later are
    /// released when this value is dropped (the connection closes) or the process dies.
    pub async fn connect(database_url: &str, partitions: u16) -> Result<Self> {
        let mut conn = PgConnection::connect(database_url).await.context("connecting to Postgres for the intake's partition locks")?;
        loop {
            let key = i32::from(rand_u16());
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(PRESENCE_LOCK_CLASS)
                .bind(key)
                .fetch_one(&mut conn)
                .await
                .context("taking the scheduler's presence lock")?;
            if got {
                let offset = u16::try_from(key).unwrap_or(0) % partitions.max(1);
                return Ok(Ownership { conn, partitions, offset, held: BTreeSet::new() });
            }
        }
    }

    /// Schedulers alive now (holding a presence lock in this database).
    async fn live(&mut self) -> Result<usize> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
             AND classid = $1::int4::oid AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(PRESENCE_LOCK_CLASS)
        .fetch_one(&mut self.conn)
        .await
        .context("counting live schedulers")?;
        Ok(usize::try_from(n).unwrap_or(1).max(1))
    }

    /// Look at the fleet and decide: lock free partitions up to the fair share, or name those
    /// over it. An error means the lock connection failed: every lock may be gone.
    pub async fn rebalance(&mut self) -> Result<Change> {
        let share = fair_share(self.partitions, self.live().await?);
        let give_up = excess(&self.held, share);
        let mut take = Vec::new();
        if give_up.is_empty() {
            for p in candidates(self.partitions, self.offset, &self.held) {
                if self.held.len() >= share {
                    break;
                }
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                    .bind(PARTITION_LOCK_CLASS)
                    .bind(i32::from(p))
                    .fetch_one(&mut self.conn)
                    .await
                    .with_context(|| format!("locking intake partition {p}"))?;
                if got {
                    self.held.insert(p);
                    take.push(p);
                }
            }
        }
        Ok(Change { take, give_up })
    }

    /// Release partition `p`; call only once its channel is closed.
    pub async fn release(&mut self, p: u16) -> Result<()> {
        self.held.remove(&p);
        sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1, $2)")
            .bind(PARTITION_LOCK_CLASS)
            .bind(i32::from(p))
            .fetch_one(&mut self.conn)
            .await
            .with_context(|| format!("unlocking intake partition {p}"))?;
        Ok(())
    }

    /// Close the connection: every lock goes with it.
    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}

/// A random number for the presence lock (no need for a crypto RNG: collisions are retried).
fn rand_u16() -> u16 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let mixed = nanos ^ std::process::id().rotate_left(16);
    u16::try_from(mixed % 65_521).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn together_the_fair_shares_cover_every_partition() {
        for partitions in 1..=16u16 {
            for live in 1..=20usize {
                assert!(fair_share(partitions, live) * live >= usize::from(partitions), "{partitions} partitions, {live} schedulers");
            }
        }
        assert_eq!(fair_share(8, 1), 8);
        assert_eq!(fair_share(8, 2), 4);
        assert_eq!(fair_share(8, 3), 3);
        assert_eq!(fair_share(8, 0), 8, "no one counted (a race at start): take everything");
    }

    #[test]
    fn a_scheduler_over_its_share_gives_up_its_highest_partitions() {
        let held: BTreeSet<u16> = [0, 1, 2, 5, 7].into();
        assert_eq!(excess(&held, 3), vec![7, 5]);
        assert!(excess(&held, 5).is_empty());
        assert!(excess(&held, 8).is_empty());
    }

    #[test]
    fn free_partitions_are_tried_around_the_ring_from_the_schedulers_offset() {
        let held: BTreeSet<u16> = [5].into();
        assert_eq!(candidates(8, 4, &held), vec![4, 6, 7, 0, 1, 2, 3]);
        assert_eq!(candidates(8, 0, &BTreeSet::new()), (0..8).collect::<Vec<_>>());
    }
}
