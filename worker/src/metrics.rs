//! The worker's Prometheus collectors.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use sandcell_protocol::{JobStatus, MoveCause};

/// Collectors, cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// `sandcell_worker_jobs_total{status}`: jobs finished by this worker, by final status.
    pub jobs: IntCounterVec,
    /// `sandcell_execution_seconds`: claim to result committed.
    pub execution_seconds: Histogram,
    /// `sandcell_queue_wait_seconds`: recorded by the scheduler to claimed by a worker.
    pub queue_wait_seconds: Histogram,
    /// `sandcell_container_start_seconds`: container create to driver ready, of the starts a
    /// job waited for (warm-pool refills start in the background and are not observed).
    pub container_start_seconds: Histogram,
    /// `sandcell_sandbox_links_total{link}`: sandboxes started, by how their driver speaks:
    /// `socket` (its own Unix socket) or `attach` (Docker's attach stream: no channel
    /// directory, or a runtime whose sandboxes cannot connect to a host socket, like gVisor).
    pub sandbox_links: IntCounterVec,
    /// `sandcell_worker_busy_slots`: jobs running now.
    pub busy_slots: IntGauge,
    /// `sandcell_worker_slots`: capacity.
    pub slots: IntGauge,
    /// `sandcell_worker_sessions`: sessions held now.
    pub sessions: IntGauge,
    /// `sandcell_worker_max_sessions`: sessions it may hold (`SANDCELL_WORKER_MAX_SESSIONS`):
    /// with `sessions`, the fleet's room for new sessions (alerts, dashboard).
    pub max_sessions: IntGauge,
    /// `sandcell_warm_pool_size`: warm kernels ready now (one killed meanwhile counts until it
    /// is found dead, within a second).
    pub pool_size: IntGauge,
    /// `sandcell_warm_pool_takes_total{outcome}`: `hit`, `empty` (miss: pool empty) or `shape`
    /// (miss: the job needs limits or a network the pool's kernels do not have).
    pub pool_takes: IntCounterVec,
    /// `sandcell_oneoff_sandboxes_total{outcome}`: how one-off jobs got their sandbox:
    /// `reused` (one bound to the job's tenant, waiting idle) or `new` (warm pool or fresh).
    pub oneoff_sandboxes: IntCounterVec,
    /// `sandcell_oneoff_idle_sandboxes`: one-off sandboxes waiting for their tenant's next job.
    pub oneoff_idle: IntGauge,
    /// `sandcell_oneoff_recycled_total{why}`: one-off sandboxes destroyed: `jobs`, `age`, `idle`,
    /// `evicted` (too many idle), `dirty` (the job did not leave it clean: timeout, OOM, a
    /// driver that could not vouch for it), `lost` (died while it waited), `shutdown`.
    pub oneoff_recycled: IntCounterVec,
    /// `sandcell_idle_sandboxes_lost_total{pool}`: sandboxes found dead while they waited idle in
    /// the warm pool (`warm`) or bound to a tenant (`oneoff`): killed outside the worker (an
    /// operator, the engine, the host's OOM killer). Destroyed, never handed a job.
    pub idle_sandboxes_lost: IntCounterVec,
    /// `sandcell_kernel_restarts_total`: session kernels replaced after dying or being killed.
    pub kernel_restarts: IntCounter,
    /// `sandcell_worker_ack_failures_total{disposition}`: settling a job's message failed (its
    /// channel closed, or the broker left it unanswered); the broker redelivers it.
    pub ack_failures: IntCounterVec,
    /// `sandcell_worker_redeliveries_absorbed_total`: copies of a job already in flight here
    /// that arrived (after a broker reconnect) and were not run again.
    pub redeliveries_absorbed: IntCounter,
    /// `sandcell_worker_jobs_recovered_total`: session jobs routed here that were read back from
    /// Postgres when this worker (re)connected to the broker (their messages are transient: a
    /// broker restart drops those still queued) and handed to their sessions.
    pub jobs_recovered: IntCounter,
    /// `sandcell_worker_sandbox_start_retries_total`: sandboxes that failed to start and were
    /// tried again.
    pub sandbox_start_retries: IntCounter,
    /// `sandcell_worker_events_published_total`: live output events handed to the broker.
    pub events_published: IntCounter,
    /// `sandcell_worker_events_dropped_total`: live output events dropped (the publisher's
    /// buffer full, or no broker); their jobs' results are complete all the same.
    pub events_dropped: IntCounter,
    /// `sandcell_worker_opening_jobs_returned_total`: jobs opening a session that reached this
    /// worker when it had no room and went back to the queue (its new-sessions consumer had not
    /// caught up with its room yet).
    pub opening_returned: IntCounter,
    /// `sandcell_worker_inputs_left_in_postgres_total`: session jobs that waited without their
    /// inputs in memory (`SANDCELL_WORKER_HELD_INPUT_BYTES` was held) and read them back.
    pub inputs_left_in_postgres: IntCounter,
    /// `sandcell_worker_session_jobs_acked_on_arrival_total`: session jobs acked as they arrived,
    /// their session holding its window of unacked messages (`registry::WindowPlace`), and
    /// held from then on as read back from Postgres.
    pub acked_on_arrival: IntCounter,
    /// `sandcell_worker_fetch_budget_waits_total`: jobs whose uploads waited for the worker's
    /// fetch budget (`SANDCELL_WORKER_FETCH_BYTES`) before they were fetched.
    pub fetch_budget_waits: IntCounter,
    /// `sandcell_worker_sessions_adopted_total{cause}`: sessions this worker took over from a
    /// worker that died or restarted (`worker_lost`) or drained (`drained`).
    pub sessions_adopted: IntCounterVec,
}

fn latency_buckets() -> Vec<f64> {
    vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
}

impl Metrics {
    /// Create and register the collectors.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let jobs = IntCounterVec::new(Opts::new("sandcell_worker_jobs_total", "Jobs finished by final status"), &["status"])?;
        let execution_seconds = Histogram::with_opts(HistogramOpts::new("sandcell_execution_seconds", "Claim to committed result").buckets(latency_buckets()))?;
        let queue_wait_seconds = Histogram::with_opts(HistogramOpts::new("sandcell_queue_wait_seconds", "Recorded to claimed").buckets(latency_buckets()))?;
        let container_start_seconds =
            Histogram::with_opts(HistogramOpts::new("sandcell_container_start_seconds", "Container create to driver ready").buckets(latency_buckets()))?;
        let sandbox_links =
            IntCounterVec::new(Opts::new("sandcell_sandbox_links_total", "Sandboxes started, by how their driver speaks: socket, attach"), &["link"])?;
        registry.register(Box::new(sandbox_links.clone()))?;
        let busy_slots = IntGauge::new("sandcell_worker_busy_slots", "Jobs running now")?;
        let slots = IntGauge::new("sandcell_worker_slots", "Concurrent job capacity")?;
        registry.register(Box::new(jobs.clone()))?;
        registry.register(Box::new(execution_seconds.clone()))?;
        registry.register(Box::new(queue_wait_seconds.clone()))?;
        registry.register(Box::new(container_start_seconds.clone()))?;
        registry.register(Box::new(busy_slots.clone()))?;
        registry.register(Box::new(slots.clone()))?;
        let sessions = IntGauge::new("sandcell_worker_sessions", "Sessions held now")?;
        let max_sessions = IntGauge::new("sandcell_worker_max_sessions", "Sessions this worker may hold")?;
        registry.register(Box::new(max_sessions.clone()))?;
        let pool_size = IntGauge::new("sandcell_warm_pool_size", "Warm kernels ready now")?;
        let pool_takes = IntCounterVec::new(Opts::new("sandcell_warm_pool_takes_total", "Kernel requests by outcome: hit, empty, shape"), &["outcome"])?;
        let kernel_restarts = IntCounter::new("sandcell_kernel_restarts_total", "Session kernels replaced after dying or being killed")?;
        registry.register(Box::new(sessions.clone()))?;
        registry.register(Box::new(pool_size.clone()))?;
        registry.register(Box::new(pool_takes.clone()))?;
        registry.register(Box::new(kernel_restarts.clone()))?;
        let ack_failures =
            IntCounterVec::new(Opts::new("sandcell_worker_ack_failures_total", "Job messages whose ack/nack failed, by disposition"), &["disposition"])?;
        let redeliveries_absorbed =
            IntCounter::new("sandcell_worker_redeliveries_absorbed_total", "Copies of jobs already in flight here that were not run again")?;
        let jobs_recovered = IntCounter::new(
            "sandcell_worker_jobs_recovered_total",
            "Session jobs read back from Postgres on a broker (re)connection and handed to their sessions",
        )?;
        let sandbox_start_retries = IntCounter::new("sandcell_worker_sandbox_start_retries_total", "Sandboxes that failed to start and were tried again")?;
        registry.register(Box::new(ack_failures.clone()))?;
        registry.register(Box::new(redeliveries_absorbed.clone()))?;
        registry.register(Box::new(jobs_recovered.clone()))?;
        registry.register(Box::new(sandbox_start_retries.clone()))?;
        let oneoff_sandboxes =
            IntCounterVec::new(Opts::new("sandcell_oneoff_sandboxes_total", "One-off jobs by how they got a sandbox: reused, new"), &["outcome"])?;
        let oneoff_idle = IntGauge::new("sandcell_oneoff_idle_sandboxes", "One-off sandboxes waiting for their tenant's next job")?;
        let oneoff_recycled = IntCounterVec::new(Opts::new("sandcell_oneoff_recycled_total", "One-off sandboxes destroyed, by why"), &["why"])?;
        registry.register(Box::new(oneoff_sandboxes.clone()))?;
        registry.register(Box::new(oneoff_idle.clone()))?;
        registry.register(Box::new(oneoff_recycled.clone()))?;
        let idle_sandboxes_lost = IntCounterVec::new(
            Opts::new("sandcell_idle_sandboxes_lost_total", "Sandboxes found dead while they waited idle, by the pool they waited in: warm, oneoff"),
            &["pool"],
        )?;
        registry.register(Box::new(idle_sandboxes_lost.clone()))?;
        let events_published = IntCounter::new("sandcell_worker_events_published_total", "Live output events handed to the broker")?;
        let events_dropped = IntCounter::new("sandcell_worker_events_dropped_total", "Live output events dropped (buffer full or no broker)")?;
        registry.register(Box::new(events_published.clone()))?;
        registry.register(Box::new(events_dropped.clone()))?;
        let opening_returned =
            IntCounter::new("sandcell_worker_opening_jobs_returned_total", "Jobs opening a session returned to the queue for lack of room here")?;
        registry.register(Box::new(opening_returned.clone()))?;
        let inputs_left_in_postgres = IntCounter::new(
            "sandcell_worker_inputs_left_in_postgres_total",
            "Session jobs that waited with their inputs left in Postgres (the held-input budget was full)",
        )?;
        registry.register(Box::new(inputs_left_in_postgres.clone()))?;
        let acked_on_arrival = IntCounter::new(
            "sandcell_worker_session_jobs_acked_on_arrival_total",
            "Session jobs acked as they arrived (their session held its window of unacked messages), held from then on as read back from Postgres",
        )?;
        registry.register(Box::new(acked_on_arrival.clone()))?;
        let fetch_budget_waits = IntCounter::new(
            "sandcell_worker_fetch_budget_waits_total",
            "Jobs whose uploads waited for the worker's fetch budget (SANDCELL_WORKER_FETCH_BYTES) before they were fetched",
        )?;
        registry.register(Box::new(fetch_budget_waits.clone()))?;
        let sessions_adopted =
            IntCounterVec::new(Opts::new("sandcell_worker_sessions_adopted_total", "Sessions taken over from another worker, by why they moved"), &["cause"])?;
        registry.register(Box::new(sessions_adopted.clone()))?;
        // Every series a label can take is exposed from the start, at 0: an alert's rate() over a
        // series that does not exist yet would stay silent, and a scrape shows what exists.
        for status in JobStatus::ALL.iter().filter(|s| s.is_terminal()) {
            jobs.with_label_values(&[status.as_str()]);
        }
        for outcome in ["hit", "empty", "shape"] {
            pool_takes.with_label_values(&[outcome]);
        }
        for outcome in ["reused", "new"] {
            oneoff_sandboxes.with_label_values(&[outcome]);
        }
        for pool in ["warm", "oneoff"] {
            idle_sandboxes_lost.with_label_values(&[pool]);
        }
        for disposition in ["ack", "requeue", "dead_letter"] {
            ack_failures.with_label_values(&[disposition]);
        }
        for cause in [MoveCause::WorkerLost, MoveCause::Drained] {
            sessions_adopted.with_label_values(&[cause.as_str()]);
        }
        Ok(Metrics {
            max_sessions,
            sessions_adopted,
            opening_returned,
            inputs_left_in_postgres,
            acked_on_arrival,
            fetch_budget_waits,
            events_published,
            events_dropped,
            oneoff_sandboxes,
            oneoff_idle,
            oneoff_recycled,
            idle_sandboxes_lost,
            registry,
            jobs,
            execution_seconds,
            queue_wait_seconds,
            container_start_seconds,
            sandbox_links,
            busy_slots,
            slots,
            sessions,
            pool_size,
            pool_takes,
            kernel_restarts,
            ack_failures,
            redeliveries_absorbed,
            jobs_recovered,
            sandbox_start_retries,
        })
    }
}
