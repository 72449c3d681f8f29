//! The fair-share dispatcher: publishes held jobs as their tenants' jobs finish.
//!
//! The intake dispatches a job of the shared queue at once while its tenant has fewer than
//! `max_jobs_in_flight` such jobs dispatched and unfinished; past that it records the job
//! *held* (`jobs.held_job`). This task, every `SANDCELL_DISPATCH_INTERVAL_MS`, goes round the
//! tenants with held jobs — the one dispatched to longest ago first — and publishes one job of
//! each tenant that has room, round after round until a round publishes nothing.
//!
//! Invariants:
//! - a tenant never has more than `max_jobs_in_flight` shared-queue jobs out, so the shared
//!   queue holds at most that many of one tenant's jobs and another tenant's job waits behind
//!   at most the jobs already in flight (about one job's run time when the quota matches the
//!   fleet's slots);
//! - a tenant's jobs are dispatched in the order they were recorded;
//! - a held job is published at least once and run once: the row stays held until the broker
//!   confirmed the publish; a crash in between publishes it again, and the worker's claim
//!   refuses the second copy.

use std::time::Duration;

use anyhow::{Context, Result};
use lapin::Channel;
use sandcell_core::broker;
use sandcell_core::jobs::JobStore;

use crate::metrics::Metrics;

/// Most tenants looked at per round.
const TENANTS_PER_ROUND: i64 = 256;

/// Dispatch held jobs forever, reconnecting after broker or database failures.
pub async fn run(amqp_url: String, jobs: JobStore, metrics: Metrics, every: Duration) {
    loop {
        let conn = sandcell_core::retry_forever("rabbitmq", |_| broker::connect(&amqp_url, "sandcell-scheduler-dispatch")).await;
        let result = match broker::publisher_channel(&conn).await {
            Ok(publisher) => dispatch_forever(&jobs, &publisher, &metrics, every).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::warn!(error = format!("{e:#}"), "dispatcher failed; reconnecting");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn dispatch_forever(jobs: &JobStore, publisher: &Channel, metrics: &Metrics, every: Duration) -> Result<()> {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        while dispatch_round(jobs, publisher, metrics).await? > 0 {}
    }
}

/// One round: at most one held job per tenant with room, tenants in round-robin order.
/// Returns how many were published.
pub async fn dispatch_round(jobs: &JobStore, publisher: &Channel, metrics: &Metrics) -> Result<usize> {
    let mut published = 0;
    for tenant in jobs.tenants_with_held_jobs(TENANTS_PER_ROUND).await? {
        let Some(held) = jobs.take_held(&tenant).await? else { continue };
        let props = broker::json_properties(&format!("{}/{}", held.tenant, held.job_id));
        // Held jobs are shared-queue jobs: one-off, or opening a session.
        let queue = serde_json::from_slice::<sandcell_protocol::ExecutionJob>(&held.payload).map_or(broker::JOBS_QUEUE, |job| broker::shared_queue(&job));
        broker::publish_confirmed(publisher, queue, &held.payload, props)
            .await
            .with_context(|| format!("publishing held job {}/{}", held.tenant, held.job_id))?;
        tracing::info!(tenant = %held.tenant, job_id = %held.job_id, "held job dispatched");
        held.dispatched().await?;
        metrics.held_dispatched.inc();
        published += 1;
    }
    Ok(published)
}
