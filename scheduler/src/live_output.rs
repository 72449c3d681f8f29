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
//! its broker user barred from connecting, every connection of it closed with the reason (the
//! client reads it in the close), its live queues deleted (a deleted queue takes its bindings)
//! and its bindings of `sandcell.events` to an exchange too (durable, they would outlive it),
//! and then it may connect again, within its limits: a client reconnecting at once does not
//! race the deletions. Nothing of another tenant, and no job, is touched: live output is a
//! copy, every result stays in Postgres.
//!
//! Invariants: a queue counts for the tenant its name names (only that tenant's user and the
//! service's may declare it), a binding for its queue's tenant or, to an exchange, for the
//! tenant its key names (its topic permission); only that tenant's connections are closed, and
//! the service's own user is never held. Checking and enforcing are idempotent, so every
//! scheduler of a fleet may run the watch. A failed check (the management API unreachable, or
//! not at that URL) is logged and counted, and tried again at the next tick; it harms nothing
//! else.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use sandcell_core::broker::{self, EVENTS_EXCHANGE};
use sandcell_core::management::{encode_component, Management};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How much of the broker's live output each tenant may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `SANDCELL_TENANT_MAX_LIVE_QUEUES`: queues in its namespace.
    pub max_queues: u32,
    /// `SANDCELL_TENANT_MAX_LIVE_BINDINGS`: bindings of `sandcell.events` it made (to its queues,
    /// or to an exchange with its keys).
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
    /// Its bindings from `sandcell.events` to an exchange (`sandcell.intake`, the only other
    /// exchange it may bind to): destination and properties key, to delete. Durable, they
    /// would outlive its connections.
    pub exchange_bindings: Vec<(String, String)>,
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

/// A binding from `sandcell.events`, as the management API lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct Binding {
    /// The queue or exchange it routes to.
    pub destination: String,
    /// `queue` or `exchange`.
    pub destination_type: String,
    /// The key it binds (a tenant's start with its name and a dot: its topic permission).
    pub routing_key: String,
    /// What names it in the API's paths.
    pub properties_key: String,
}

impl Binding {
    /// The tenant it counts for: a queue's is the tenant whose namespace the queue is in (the
    /// gateway's and workers' queues are no tenant's, whatever keys they bind); an exchange's
    /// is the tenant its routing key names (only a tenant binds `sandcell.events` to an
    /// exchange, and its topic permission holds it to its own keys).
    fn tenant(&self) -> Option<&str> {
        match self.destination_type.as_str() {
            "queue" => broker::live_queue_tenant(&self.destination),
            _ => self.routing_key.split_once('.').map(|(t, _)| t).filter(|t| sandcell_protocol::submission::is_valid_tenant(t)),
        }
    }
}

/// The tenants over a limit, from the queues' names and the bindings of `sandcell.events`.
/// `spared` (the service's own user) is never one.
pub fn breaches<'a>(queues: impl IntoIterator<Item = &'a str>, bindings: &[Binding], limits: Limits, spared: &str) -> Vec<Breach> {
    #[derive(Default)]
    struct Held {
        queues: Vec<String>,
        bindings: u64,
        exchange_bindings: Vec<(String, String)>,
    }
    let mut held: BTreeMap<&str, Held> = BTreeMap::new();
    for q in queues {
        if let Some(tenant) = broker::live_queue_tenant(q) {
            held.entry(tenant).or_default().queues.push(q.to_string());
        }
    }
    for b in bindings {
        if let Some(tenant) = b.tenant() {
            let h = held.entry(tenant).or_default();
            h.bindings += 1;
            if b.destination_type != "queue" {
                h.exchange_bindings.push((b.destination.clone(), b.properties_key.clone()));
            }
        }
    }
    held.into_iter()
        .filter(|(tenant, _)| *tenant != spared)
        .filter_map(|(tenant, h)| {
            let (limit, held, allowed) = if h.queues.len() as u64 > u64::from(limits.max_queues) {
                ("queues", h.queues.len() as u64, limits.max_queues)
            } else if h.bindings > u64::from(limits.max_bindings) {
                ("bindings", h.bindings, limits.max_bindings)
            } else {
                return None;
            };
            Some(Breach { tenant: tenant.to_string(), limit, held, allowed, queues: h.queues, exchange_bindings: h.exchange_bindings })
        })
        .collect()
}

#[derive(Deserialize)]
struct Named {
    name: String,
}

/// Deletions in flight at once against the management API.
const CONCURRENT_CALLS: usize = 8;

/// Count, and hold every tenant over a limit to it. Returns the breaches acted on.
pub async fn check_once(api: &Management, limits: Limits, spared: &str, metrics: &Metrics) -> Result<Vec<Breach>> {
    let queues: Vec<Named> = listing(api, "queues/{vhost}?disable_stats=true&enable_queue_totals=true&columns=name").await?;
    let bindings: Vec<Binding> = listing(
        api,
        &format!("exchanges/{{vhost}}/{}/bindings/source?columns=destination,destination_type,routing_key,properties_key", encode_component(EVENTS_EXCHANGE)),
    )
    .await?;
    let found = breaches(queues.iter().map(|q| q.name.as_str()), &bindings, limits, spared);
    for breach in &found {
        metrics.live_output_enforced.with_label_values(&[breach.limit]).inc();
        enforce(api, breach).await;
    }
    Ok(found)
}

/// A listing of the management API; an answer of 404 is an error (a URL that is not the API's
/// root would otherwise look like an empty broker, and the watch would hold no one).
async fn listing<T: serde::de::DeserializeOwned>(api: &Management, path: &str) -> Result<Vec<T>> {
    api.get(path).await?.with_context(|| format!("the management API has no /api/{path} (is SANDCELL_RABBITMQ_MANAGEMENT_URL its root, http://host:15672?)"))
}

/// Hold `breach`'s tenant to its limit: its broker user may open no connection meanwhile, each
/// of its connections is closed with the reason, its live queues and its exchange bindings are
/// deleted, and then it may connect again (up to [`broker::TENANT_MAX_CONNECTIONS`]: a client
/// that reconnects at once, declaring again, is not racing the deletions). Every step is tried
/// whatever the last one did; a step that failed is logged, and the next check finds what is
/// left. A stop waits for this to end; should the process die between the block and its end,
/// the next watch to start lifts the bar ([`lift_leftover_bars`]).
async fn enforce(api: &Management, breach: &Breach) {
    let reason = breach.reason();
    tracing::warn!(tenant = %breach.tenant, limit = breach.limit, held = breach.held, allowed = breach.allowed, "a tenant holds more live output than its limit: closing its connections and deleting its live queues");
    let limit_path = format!("user-limits/{}/max-connections", encode_component(&breach.tenant));
    if let Err(e) = api.put(&limit_path, serde_json::json!({"value": 0})).await {
        tracing::warn!(tenant = %breach.tenant, error = format!("{e:#}"), "could not stop the tenant connecting while its live output is deleted");
    }
    // By user: the broker's own tracking of its connections, which knows a connection the
    // moment it opens (the API's listing of connections learns of it with its first
    // statistics, up to 5 s later).
    let closed = match api.delete(&format!("connections/username/{}", encode_component(&breach.tenant)), Some(&reason)).await {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(tenant = %breach.tenant, error = format!("{e:#}"), "could not close the tenant's connections");
            false
        }
    };
    let mut paths: Vec<String> = breach.queues.iter().map(|q| format!("queues/{{vhost}}/{}", encode_component(q))).collect();
    paths.extend(breach.exchange_bindings.iter().map(|(destination, props)| {
        format!("bindings/{{vhost}}/e/{}/e/{}/{}", encode_component(EVENTS_EXCHANGE), encode_component(destination), encode_component(props))
    }));
    let deleted = deletes(api, paths).await;
    let restored = api.put(&limit_path, serde_json::json!({"value": broker::TENANT_MAX_CONNECTIONS})).await;
    if let Err(e) = &restored {
        tracing::error!(tenant = %breach.tenant, error = format!("{e:#}"), "could not let the tenant connect again; `sandcell-admin tenant permissions <tenant>` does");
    }
    tracing::info!(tenant = %breach.tenant, connections_closed = closed, queues_and_bindings_deleted = deleted, reconnect_allowed = restored.is_ok(), "held a tenant to its live-output limit");
}

/// DELETE each of `paths`, a few at once; how many existed. A failure is logged, not fatal
/// (the next check finds what is left).
async fn deletes(api: &Management, paths: Vec<String>) -> u64 {
    let results: Vec<(String, Result<bool>)> = futures::stream::iter(paths)
        .map(|path| async move { (path.clone(), api.delete(&path, None).await) })
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

/// Run the watch every `interval` (not at all when it is zero) until `stop`; an enforcement
/// under way when `stop` comes is finished (a tenant is never left barred by a stop).
pub async fn run(api: Management, limits: Limits, spared: String, metrics: Metrics, interval: Duration, stop: CancellationToken) {
    if interval.is_zero() {
        tracing::info!("the live-output watch is off (SANDCELL_LIVE_OUTPUT_CHECK_S=0)");
        return stop.cancelled().await; // the scheduler ends when one of its tasks does
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut bars_lifted = false;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !bars_lifted {
            // Once, as soon as the broker answers (it may still be starting).
            bars_lifted = lift_leftover_bars(&api, &spared).await;
        }
        if let Err(e) = check_once(&api, limits, &spared, &metrics).await {
            metrics.live_output_check_failures.inc();
            tracing::warn!(error = format!("{e:#}"), "the live-output watch could not check the broker; trying again at the next tick");
        }
    }
}

/// A broker user's `max-connections` of 0 is the watch's: set while a tenant's live output is
/// deleted, lifted at the end. A scheduler that died in between (killed, out of memory) left its
/// tenant barred: the next watch to start lets every such user connect again. Returns whether
/// the broker's limits could be read.
async fn lift_leftover_bars(api: &Management, spared: &str) -> bool {
    #[derive(Deserialize)]
    struct UserLimits {
        user: String,
        value: serde_json::Map<String, serde_json::Value>,
    }
    let limits: Vec<UserLimits> = match listing(api, "user-limits").await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                error = format!("{e:#}"),
                "could not read the broker users' limits to lift bars a stopped scheduler left; trying again at the next tick"
            );
            return false;
        }
    };
    for l in limits.iter().filter(|l| l.user != spared && l.value.get("max-connections").and_then(|v| v.as_i64()) == Some(0)) {
        let path = format!("user-limits/{}/max-connections", encode_component(&l.user));
        match api.put(&path, serde_json::json!({"value": broker::TENANT_MAX_CONNECTIONS})).await {
            Ok(()) => tracing::warn!(tenant = %l.user, "a tenant left barred from the broker by a stopped scheduler may connect again"),
            Err(e) => tracing::warn!(tenant = %l.user, error = format!("{e:#}"), "could not let a tenant left barred connect again"),
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_queues: 2, max_bindings: 3 };

    fn to_queue(queue: &str, key: &str) -> Binding {
        Binding { destination: queue.into(), destination_type: "queue".into(), routing_key: key.into(), properties_key: key.into() }
    }

    #[test]
    fn a_tenant_within_its_limits_is_left_alone() {
        let queues = ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.jobs", "sandcell.live.beta.a"];
        let mut bindings =
            vec![to_queue("sandcell.live.acme.a", "acme.1"), to_queue("sandcell.live.acme.a", "acme.2"), to_queue("sandcell.live.acme.b", "acme.#")];
        // The gateway's queue binds tenants' keys: no tenant's.
        bindings.extend((0..4).map(|i| to_queue("sandcell.gateway.x", &format!("acme.{i}"))));
        assert!(breaches(queues, &bindings, LIMITS, "sandcell").is_empty());
    }

    #[test]
    fn a_tenant_over_its_queue_limit_is_named_with_all_its_queues_and_no_other_tenants() {
        let queues = ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.live.acme.c", "sandcell.live.beta.a", "sandcell.live.beta.b"];
        let found = breaches(queues, &[], LIMITS, "sandcell");
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].tenant.as_str(), found[0].limit, found[0].held, found[0].allowed), ("acme", "queues", 3, 2));
        assert_eq!(found[0].queues, ["sandcell.live.acme.a", "sandcell.live.acme.b", "sandcell.live.acme.c"]);
        assert!(found[0].reason().contains("held 3 live-output queues, more than its 2"));
    }

    #[test]
    fn a_tenant_over_its_binding_limit_is_named() {
        let bindings: Vec<Binding> = (0..4).map(|i| to_queue("sandcell.live.acme.a", &format!("acme.{i}"))).collect();
        let found = breaches(["sandcell.live.acme.a"], &bindings, LIMITS, "sandcell");
        assert_eq!((found[0].tenant.as_str(), found[0].limit, found[0].held), ("acme", "bindings", 4));
    }

    #[test]
    fn a_tenants_bindings_to_an_exchange_count_by_their_key_and_are_deleted_with_its_queues() {
        let mut bindings: Vec<Binding> = (0..3)
            .map(|i| Binding {
                destination: "sandcell.intake".into(),
                destination_type: "exchange".into(),
                routing_key: format!("acme.{i}"),
                properties_key: format!("acme.{i}"),
            })
            .collect();
        bindings.push(to_queue("sandcell.live.acme.a", "acme.x"));
        let found = breaches(["sandcell.live.acme.a"], &bindings, LIMITS, "sandcell");
        assert_eq!((found[0].tenant.as_str(), found[0].limit, found[0].held), ("acme", "bindings", 4));
        assert_eq!(found[0].exchange_bindings.len(), 3);
        assert_eq!(found[0].exchange_bindings[0], ("sandcell.intake".to_string(), "acme.0".to_string()));
    }

    #[test]
    fn the_service_user_is_never_held_to_a_tenants_limit() {
        let queues = ["sandcell.live.sandcell.a", "sandcell.live.sandcell.b", "sandcell.live.sandcell.c"];
        assert!(breaches(queues, &[], LIMITS, "sandcell").is_empty());
    }
}
