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
//!
//! The same task releases the *parked* jobs of sessions that move to another worker
//! ([`release_round`], the steps in `sandcell_core::jobs::parked`): the oldest goes to the
//! new-sessions queue to take the session over (`session.adopt`), the rest follow to the new
//! owner's queue, in the order they were recorded, once it bound the session.

use std::time::Duration;

use anyhow::{Context, Result};
use lapin::Channel;
use sandcell_core::broker;
use sandcell_core::jobs::{JobStore, Release};
use sandcell_protocol::{Adoption, ExecutionJob};

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
        release_round(jobs, publisher, metrics).await?;
    }
}

/// Most sessions with parked jobs looked at per tick.
const SESSIONS_PER_ROUND: i64 = 256;

/// Release what can be released of moving sessions' parked jobs. Returns how many jobs were
/// published.
pub async fn release_round(jobs: &JobStore, publisher: &Channel, metrics: &Metrics) -> Result<usize> {
    let mut published = 0;
    for session_id in jobs.sessions_with_parked_jobs(SESSIONS_PER_ROUND).await? {
        // One session's failure (a broker or database error) is retried next round and never
        // holds the others back.
        match release_one(jobs, publisher, metrics, &session_id).await {
            Ok(n) => published += n,
            // A closed channel (the broker restarted) fails every later publish: the
            // dispatcher reconnects. (Seen in the chaos test: a session moving during a broker
            // restart left its parked jobs retried on a dead channel for minutes.)
            Err(e) if !publisher.status().connected() => return Err(e.context("the dispatcher's channel closed")),
            Err(e) => tracing::warn!(%session_id, error = format!("{e:#}"), "could not release a moving session's parked jobs; retrying next round"),
        }
    }
    Ok(published)
}

/// Release what can be released of one session's parked jobs; returns how many were published.
async fn release_one(jobs: &JobStore, publisher: &Channel, metrics: &Metrics, session_id: &str) -> Result<usize> {
    let published = match jobs.release_parked(session_id).await? {
        None => 0,
        Some(Release::TakeOver(t)) => {
            let mut job: ExecutionJob = serde_json::from_slice(&t.routed).with_context(|| format!("decoding parked job {}/{}", t.tenant, t.job_id))?;
            if let Some(s) = job.session.as_mut() {
                s.adopt = Some(Adoption { from_worker: t.from_worker.clone(), cause: t.cause });
            }
            let payload = serde_json::to_vec(&job).context("serializing the taking-over job")?;
            let props = broker::json_properties(&format!("{}/{}", t.tenant, t.job_id));
            broker::publish_confirmed(publisher, broker::NEW_SESSIONS_QUEUE, &payload, props)
                .await
                .with_context(|| format!("publishing taking-over job {}/{}", t.tenant, t.job_id))?;
            tracing::info!(tenant = %t.tenant, job_id = %t.job_id, %session_id, from_worker = %t.from_worker, cause = t.cause.as_str(), "job sent to take a moving session over");
            t.dispatched().await?;
            metrics.parked_released.inc();
            1
        }
        Some(Release::Follow(f)) => {
            let queue = broker::worker_queue(&f.owner);
            for (tenant, job_id, payload) in &f.jobs {
                let props = broker::json_properties(&format!("{tenant}/{job_id}"));
                broker::publish_confirmed(publisher, &queue, payload, props).await.with_context(|| format!("publishing parked job {tenant}/{job_id}"))?;
            }
            let n = f.jobs.len();
            tracing::info!(%session_id, jobs = n, owner = %f.owner, "parked jobs follow their session to its new owner");
            f.dispatched().await?;
            metrics.parked_released.inc_by(n as u64);
            n
        }
    };
    Ok(published)
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
