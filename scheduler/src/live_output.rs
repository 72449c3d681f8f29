//! The live-output watch: each tenant's share of the broker's queues and bindings.
//!
//! A tenant's broker user may declare queues in its own namespace (`sandcell.live.<tenant>.…`)
//! and bind them to `sandcell.events` for its live output (`sandcell_core::broker::
//! tenant_permissions`). The broker bounds what each queue holds (an operator policy) and how
//! many connections and channels a user opens, but not how many queues or bindings a user
//! declares: measured on RabbitMQ 3.10, one connection declared 335 queues a second at ~41 KB
//! each (and 1,400 bindings a second at ~2.7 KB), so one tenant would reach the broker's memory
//! alarm within minutes — and the alarm blocks every publisher, every tenant's submissions and
//! the workers' results included.
//!
//! So every `SANDCELL_LIVE_OUTPUT_CHECK_S` the scheduler counts each tenant's live queues and
//! their bindings on `sandcell.events` through the management API. A tenant holding more than
//! `SANDCELL_TENANT_MAX_LIVE_QUEUES` queues or `SANDCELL_TENANT_MAX_LIVE_BINDINGS` bindings has
//! every connection of its broker user closed, with the reason (the client reads it in the
//! close), and then its live queues deleted (an exclusive queue goes with its connection; a
//! deleted queue takes its bindings). It may reconnect at once, within its limits. Nothing of
//! another tenant, and no job, is touched: live output is a copy, every result stays in Postgres.
//!
//! Invariants: a queue counts for the tenant its name names (only that tenant's user and the
//! service's may declare it), and only that tenant's connections are closed; the service's own
//! user is never. Checking and enforcing are idempotent, so every scheduler of a fleet may run
//! the watch. A failed check (the management API unreachable) is logged and counted, and tried
//! again at the next tick; it harms nothing else.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use sandcell_core::broker::{self, EVENTS_EXCHANGE};
use sandcell_core::management::{encode_component, Management};
use serde::Deserialize;

use crate::metrics::Metrics;

/// How much of the broker's live output each tenant may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `SANDCELL_TENANT_MAX_LIVE_QUEUES`: queues in its namespace.
    pub max_queues: u32,
    /// `SANDCELL_TENANT_MAX_LIVE_BINDINGS`: bindings from `sandcell.events` to its queues.
    pub max_bindings: u32,
}

/// What a tenant held when it was found over a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breach {
    /// The tenant (its broker user).
    pub tenant: String,
    /// `"queues"` or `"bindings"`: the limit it passed (queues first).
    pub limit: &'static str,
    /// How many it held.
    pub held: u64,
    /// The limit.
    pub allowed: u32,
    /// Its live queues, to delete.
    pub queues: Vec<String>,
}

impl Breach {
    /// What the tenant's client reads when its connection is closed.
    pub fn reason(&self) -> String {
        format!(
            "sandcell: tenant {} held {} live-output {}, more than its {}; its connections were closed and its live queues deleted",
            self.tenant, self.held, self.limit, self.allowed
        )
    }
}

/// The tenants over a limit, from the queues' names and the bindings' destinations (queues
/// only) on `sandcell.events`. `spared` (the service's own user) is never one.
pub fn breaches<'a>(queues: impl IntoIterator<Item = &'a str>, bindings: impl IntoIterator<Item = &'a str>, limits: Limits, spared: &str) -> Vec<Breach> {
    let mut held: BTreeMap<&str, (Vec<String>, u64)> = BTreeMap::new();
    for q in queues {
        if let Some(tenant) = broker::live_queue_tenant(q) {
            held.entry(tenant).or_default().0.push(q.to_string());
        }
    }
    for destination in bindings {
        if let Some(tenant) = broker::live_queue_tenant(destination) {
            held.entry(tenant).or_default().1 += 1;
        }
    }
    held.into_iter()
        .filter(|(tenant, _)| *tenant != spared)
        .filter_map(|(tenant, (queues, bindings))| {
            let (limit, held, allowed) = if queues.len() as u64 > u64::from(limits.max_queues) {
                ("queues", queues.len() as u64, limits.max_queues)
            } else if bindings > u64::from(limits.max_bindings) {
                ("bindings", bindings, limits.max_bindings)
            } else {
                return None;
            };
            Some(Breach { tenant: tenant.to_string(), limit, held, allowed, queues })
        })
        .collect()
}

#[derive(Deserialize)]
struct Named {
    name: String,
}

#[derive(Deserialize)]
struct Binding {
    destination: String,
    destination_type: String,
}

#[derive(Deserialize)]
struct Connection {
    name: String,
    user: String,
}

/// Deletions and closes in flight at once against the management API.
const CONCURRENT_CALLS: usize = 8;

/// Count, and hold every tenant over a limit to it. Returns the breaches acted on.
pub async fn check_once(api: &Management, limits: Limits, spared: &str, metrics: &Metrics) -> Result<Vec<Breach>> {
    let queues: Vec<Named> =
        api.get("queues/{vhost}?disable_stats=true&enable_queue_totals=true&columns=name").await.context("listing the broker's queues")?.unwrap_or_default();
    let bindings: Vec<Binding> = api
        .get(&format!("exchanges/{{vhost}}/{}/bindings/source?columns=destination,destination_type", encode_component(EVENTS_EXCHANGE)))
        .await
        .context("listing the bindings of the events exchange")?
        .unwrap_or_default();
    let found = breaches(
        queues.iter().map(|q| q.name.as_str()),
        bindings.iter().filter(|b| b.destination_type == "queue").map(|b| b.destination.as_str()),
        limits,
        spared,
    );
    if found.is_empty() {
        return Ok(found);
    }
    let connections: Vec<Connection> =
        api.get("vhosts/{vhost}/connections?columns=name,user").await.context("listing the broker's connections")?.unwrap_or_default();
    for breach in &found {
        let reason = breach.reason();
        tracing::warn!(tenant = %breach.tenant, limit = breach.limit, held = breach.held, allowed = breach.allowed, "a tenant holds more live output than its limit: closing its connections and deleting its live queues");
        // Its connections first, so that it declares nothing more while its queues go.
        let closes = connections.iter().filter(|c| c.user == breach.tenant).map(|c| format!("connections/{}", encode_component(&c.name))).collect();
        let closed = calls(api, closes, Some(&reason)).await;
        let deletes = breach.queues.iter().map(|q| format!("queues/{{vhost}}/{}", encode_component(q))).collect();
        let deleted = calls(api, deletes, None).await;
        metrics.live_output_enforced.with_label_values(&[breach.limit]).inc();
        tracing::info!(tenant = %breach.tenant, connections_closed = closed, queues_deleted = deleted, "held a tenant to its live-output limit");
    }
    Ok(found)
}

/// DELETE each of `paths`, a few at once; how many existed. A failure is logged, not fatal
/// (the next check finds what is left).
async fn calls(api: &Management, paths: Vec<String>, reason: Option<&str>) -> u64 {
    let results: Vec<(String, Result<bool>)> = futures::stream::iter(paths)
        .map(|path| async move { (path.clone(), api.delete(&path, reason).await) })
        .buffer_unordered(CONCURRENT_CALLS)
        .collect()
        .await;
    let mut done = 0;
    for (path, result) in results {
        match result {
            Ok(true) => done += 1,
            Ok(false) => {}
            Err(e) => tracing::warn!(path, error = format!("{e:#}"), "could not delete through the management API"),
        }
    }
    done
}

/// Run the watch every `interval` (not at all when it is zero).
pub async fn run(api: Management, limits: Limits, spared: String, metrics: Metrics, interval: Duration) {
    if interval.is_zero() {
        tracing::info!("the live-output watch is off (SANDCELL_LIVE_OUTPUT_CHECK_S=0)");
        return std::future::pending().await;
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = check_once(&api, limits, &spared, &metrics).await {
            metrics.live_output_check_failures.inc();
            tracing::warn!(error = format!("{e:#}"), "the live-output watch could not check the broker; trying again at the next tick");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_queues: 2, max_bindings: 3 };

    #[test]
    fn a_tenant_within_its_limits_is_left_alone() {
        let queues = ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.jobs", "sandcell.live.beta.a"];
        let bindings = [
            "sandcell.live.acme.a",
            "sandcell.live.acme.a",
            "sandcell.live.acme.b",
            "sandcell.gateway.x",
            "sandcell.gateway.x",
            "sandcell.gateway.x",
            "sandcell.gateway.x",
        ];
        assert!(breaches(queues, bindings, LIMITS, "sandcell").is_empty());
    }

    #[test]
    fn a_tenant_over_its_queue_limit_is_named_with_all_its_queues_and_no_other_tenants() {
        let queues = ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.live.acme.c", "sandcell.live.beta.a", "sandcell.live.beta.b"];
        let found = breaches(queues, [], LIMITS, "sandcell");
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].tenant.as_str(), found[0].limit, found[0].held, found[0].allowed), ("acme", "queues", 3, 2));
        assert_eq!(found[0].queues, ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.live.acme.c"]);
        assert!(found[0].reason().contains("held 3 live-output queues, more than its 2"));
    }

    #[test]
    fn a_tenant_over_its_binding_limit_is_named() {
        let bindings = ["sandcell.live.acme.a"; 4];
        let found = breaches(["sandcell.live.acme.a"], bindings, LIMITS, "sandcell");
        assert_eq!((found[0].tenant.as_str(), found[0].limit, found[0].held), ("acme", "bindings", 4));
    }

    #[test]
    fn the_service_user_is_never_held_to_a_tenants_limit() {
        let queues = ["sandcell.live.sandcell.a", "sandcell.live.sandcell.b", "sandcell.live.sandcell.c"];
        assert!(breaches(queues, [], LIMITS, "sandcell").is_empty());
    }
}
