//! `sandcell-bench`: what an agent waits for, measured on the local stack.
//!
//! Run by `deploy/local/bench.sh`, which starts release builds of the scheduler and worker. It
//! prints, and writes under `docs/benchmarks/` as JSON, a markdown table and a PNG:
//! - in-session round trip of `1+1`: publish → terminal notification → result row read;
//! - first result of a new session, with a warm-pool hit and with a cold start (pool miss);
//! - throughput of 16 sessions fed concurrently, and where the machine's CPU went per job in
//!   that phase: scheduler, worker, Postgres, RabbitMQ, the sandboxes (the results' `usage`)
//!   and the whole machine (`/proc/stat`);
//! - memory of an idle session's container (cgroup);
//! - one-off jobs: sequential `1+1` round trips, a burst of `1+1` jobs published at once (twice:
//!   the second once the tenant's sandboxes are bound), and a burst of pandas jobs reading a
//!   small CSV (jobs/s);
//! - the baseline: `docker run --rm` of the same image per job, through the Docker API;
//! - where the time of a sequential `1+1` goes, stage by stage ([`stages`]), in a session and
//!   one-off, and what the jobs' code used (CPU time, peak memory: the results' `usage`).
//!
//! The PNG is drawn by sandcell itself: the samples go in as a CSV, matplotlib draws, the
//! chart comes back as an artifact.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use futures::StreamExt;
use sandcell_client::{Client, Watcher};
use sandcell_core::tenants::{Quotas, TenantStore};
use sandcell_protocol::{EventBody, InputFile, JobResult, JobStatus, Language, SessionRequest, Submission};
use serde::Serialize;

mod fleet;
mod gateway;
mod stages;
use stages::{Breakdown, Cost, Stages, Trip};

#[derive(Parser)]
struct Args {
    /// Sequential `1+1` jobs in one session.
    #[arg(long, default_value_t = 500)]
    in_session_jobs: usize,
    /// New sessions opened per pool case.
    #[arg(long, default_value_t = 10)]
    new_sessions: usize,
    /// Sessions fed concurrently in the throughput run.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Jobs per session in the throughput run.
    #[arg(long, default_value_t = 100)]
    jobs_per_session: usize,
    /// Sequential one-off `1+1` jobs (one tenant: its sandbox is reused).
    #[arg(long, default_value_t = 200)]
    oneoff_jobs: usize,
    /// One-off `1+1` jobs published at once.
    #[arg(long, default_value_t = 200)]
    oneoff_burst: usize,
    /// One-off pandas jobs reading a small CSV, published at once.
    #[arg(long, default_value_t = 50)]
    pandas_burst: usize,
    /// Baseline `docker run` jobs.
    #[arg(long, default_value_t = 20)]
    baseline_jobs: usize,
    /// Sequential in-session jobs that print their own clock, for print → live event latency.
    #[arg(long, default_value_t = 100)]
    live_jobs: usize,
    /// In-session `1+1` jobs through the Python SDK (run when `SANDCELL_BENCH_PYTHON` names a
    /// Python with the SDK installed).
    #[arg(long, default_value_t = 200)]
    sdk_jobs: usize,
    /// In-session `1+1` jobs through the E2B gateway, interleaved with as many native ones
    /// (0: none).
    #[arg(long, default_value_t = 300)]
    gateway_jobs: usize,
    /// Files in the workspace of a session whose in-session `1+1` round trip is measured apart
    /// (an unpacked dataset a session keeps; 0: not measured). Made by the session's first
    /// cell, empty, 1,000 to a directory.
    #[arg(long, default_value_t = 2000)]
    workspace_files: usize,
    /// Sequential in-session `1+1` jobs in that session.
    #[arg(long, default_value_t = 100)]
    workspace_jobs: usize,
    /// Available artifacts the bench's tenant holds before anything runs, as rows only (no
    /// objects): what an earlier bulk run leaves for its TTL. Every figure is then of a tenant
    /// carrying them; the rows go at the end.
    #[arg(long, default_value_t = 0)]
    stored_artifacts: usize,
    /// The E2B gateway's address.
    #[arg(long, default_value = "127.0.0.1:9480")]
    gateway: String,
    /// Worker metrics endpoint (pool size and takes).
    #[arg(long, default_value = "127.0.0.1:9465")]
    worker_metrics: String,
    /// Measure only the fleet figures ([`fleet`]) with this many workers running, and merge
    /// them into fleet.json and fleet.md.
    #[arg(long)]
    fleet: Option<usize>,
    /// Schedulers running (recorded with the fleet figures).
    #[arg(long, default_value_t = 2)]
    fleet_schedulers: usize,
    /// New sessions published at once in the fleet run.
    #[arg(long, default_value_t = 50)]
    fleet_burst: usize,
    /// Where to write latest.json, README.md and latency.png.
    #[arg(long, default_value = "docs/benchmarks")]
    out: std::path::PathBuf,
}

/// The job ids of the rows [`carry_stored_artifacts`] writes.
const STORED_JOB_PREFIX: &str = "bench-stored-";

/// Give `tenant` `n` available artifacts of 50 kB, each of a finished job of its own, written as
/// rows in two statements (no objects: nothing reads them, and the sweeper's delete of a missing
/// object succeeds should a run die before [`drop_stored_artifacts`]).
async fn carry_stored_artifacts(pool: &sqlx::PgPool, tenant: &str, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let n = i64::try_from(n).context("--stored-artifacts is too large")?;
    sqlx::query(
        "INSERT INTO jobs (tenant, job_id, status, language, submission_sha256, limits, queued_at, finished_at, execution)
         SELECT $1, $2 || g, 'succeeded', 'python', '', '{}'::jsonb, now(), now(), '{}'::jsonb FROM generate_series(1, $3) g",
    )
    .bind(tenant)
    .bind(STORED_JOB_PREFIX)
    .bind(n)
    .execute(pool)
    .await
    .context("writing the stored artifacts' jobs")?;
    sqlx::query(
        "INSERT INTO artifacts (tenant, job_id, path, kind, size_bytes, content_type, sha256, s3_key, expires_at)
         SELECT $1, $2 || g, 'chart.png', 'display', 50000, 'image/png', '', $1 || '/' || $2 || g, now() + interval '1 hour'
           FROM generate_series(1, $3) g",
    )
    .bind(tenant)
    .bind(STORED_JOB_PREFIX)
    .bind(n)
    .execute(pool)
    .await
    .context("writing the stored artifacts")?;
    println!("the tenant carries {n} stored artifacts");
    Ok(())
}

/// Remove what [`carry_stored_artifacts`] wrote (the artifacts go with their jobs).
async fn drop_stored_artifacts(pool: &sqlx::PgPool, tenant: &str) -> Result<()> {
    sqlx::query("DELETE FROM jobs WHERE tenant = $1 AND starts_with(job_id, $2)")
        .bind(tenant)
        .bind(STORED_JOB_PREFIX)
        .execute(pool)
        .await
        .context("removing the stored artifacts")?;
    Ok(())
}

/// Percentiles of one latency sample, in milliseconds.
#[derive(Debug, Serialize, Clone)]
struct Summary {
    n: usize,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
    mean_ms: f64,
    max_ms: f64,
}

fn summarize(samples: &[Duration]) -> Summary {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| if ms.is_empty() { f64::NAN } else { ms[((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1] };
    Summary {
        n: ms.len(),
        p50_ms: round(pct(0.50)),
        p95_ms: round(pct(0.95)),
        p99_ms: round(pct(0.99)),
        mean_ms: round(ms.iter().sum::<f64>() / ms.len().max(1) as f64),
        max_ms: round(ms.last().copied().unwrap_or(f64::NAN)),
    }
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[derive(Serialize)]
struct Report {
    measured_at: String,
    git_commit: String,
    machine: String,
    /// Available artifacts the tenant carried (`--stored-artifacts`).
    stored_artifacts: usize,
    in_session_round_trip: Summary,
    /// Files in the workspace of the session of `in_session_with_files_round_trip`.
    workspace_files: usize,
    in_session_with_files_round_trip: Option<Summary>,
    new_session_warm_pool_hit: Summary,
    new_session_cold_start: Summary,
    warm_pool_hits_observed: u64,
    throughput_sessions: usize,
    throughput_jobs: usize,
    throughput_seconds: f64,
    throughput_jobs_per_s: f64,
    cpu_ms_per_job_scheduler: Option<f64>,
    cpu_ms_per_job_worker: Option<f64>,
    /// Every `postgres` process of the machine, in the 16-session phase.
    cpu_ms_per_job_postgres: Option<f64>,
    /// Every `beam.smp` process (RabbitMQ) of the machine, in the 16-session phase.
    cpu_ms_per_job_broker: Option<f64>,
    /// The sandboxes, from the 16-session phase's results (`usage.cpu_ms`).
    cpu_ms_per_job_sandboxes: Option<f64>,
    /// The whole machine (`/proc/stat`, all but idle and iowait), in the 16-session phase.
    cpu_ms_per_job_machine: Option<f64>,
    idle_session_memory_mib: f64,
    idle_session_memory_without_cache_mib: f64,
    oneoff_round_trip: Summary,
    oneoff_burst_jobs: usize,
    oneoff_burst_jobs_per_s: f64,
    /// The same burst again once the first one's sandboxes are bound and the warm pool refilled.
    oneoff_burst_again_jobs_per_s: f64,
    pandas_burst_jobs: usize,
    pandas_burst_jobs_per_s: f64,
    pandas_burst_latency: Summary,
    baseline_docker_run: Summary,
    in_session_stages: Breakdown,
    oneoff_stages: Breakdown,
    in_session_cost: Cost,
    oneoff_cost: Cost,
    pandas_cost: Cost,
    print_to_event: Summary,
    sdk_in_session_round_trip: Option<Summary>,
    sdk_print_to_on_stdout: Option<Summary>,
    gateway_run_code: Option<Summary>,
    gateway_native_interleaved: Option<Summary>,
}

struct Bench {
    client: Client,
    watcher: Watcher,
    tenant: String,
}

impl Bench {
    /// Submit and wait for the terminal result; the time is publish → result row read.
    async fn run(&self, sub: &Submission) -> Result<(Duration, JobResult)> {
        let (d, r, _) = self.run_timed(sub).await?;
        Ok((d, r))
    }

    /// [`Bench::run`], with the client's clock at publish, notification and read.
    async fn run_timed(&self, sub: &Submission) -> Result<(Duration, JobResult, Trip)> {
        let done = self.watcher.watch(&sub.tenant, &sub.job_id);
        let t0 = Instant::now();
        let published = chrono::Utc::now();
        self.client.submit(sub).await?;
        let notice = tokio::time::timeout(Duration::from_secs(120), done).await.context("no result within 120 s")?.context("watcher ended")?;
        let notified = chrono::Utc::now();
        // The notification carries the result when it fits; else it is read, as a client would.
        let r = match notice.result {
            Some(r) => r,
            None => self.client.result(&sub.tenant, &sub.job_id).await?.context("result row missing")?,
        };
        let trip = Trip { published, notified, read: chrono::Utc::now() };
        Ok((t0.elapsed(), r, trip))
    }

    /// `n` sequential jobs of `make()`, which must succeed: their round trips, stages and
    /// results.
    async fn sequential(&self, n: usize, make: impl Fn() -> Submission) -> Result<(Vec<Duration>, Vec<Stages>, Vec<JobResult>)> {
        let (mut times, mut stages, mut results) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for _ in 0..n {
            let (d, r, trip) = self.run_timed(&make()).await?;
            anyhow::ensure!(r.status == JobStatus::Succeeded, "job failed: {r:?}");
            times.push(d);
            stages.extend(Stages::of(&trip, &r));
            results.push(r);
        }
        Ok((times, stages, results))
    }

    fn job(&self, code: &str, session: Option<SessionRequest>) -> Submission {
        let mut s = Submission::new(self.tenant.clone(), format!("bench-{}", uuid::Uuid::new_v4().simple()), Language::Python, code);
        s.session = session;
        s
    }

    async fn open(&self, code: &str, memory_mb: Option<u64>) -> Result<(Duration, String)> {
        let mut sub = self.job(code, Some(SessionRequest { new: true, ..Default::default() }));
        sub.memory_mb = memory_mb;
        let (d, r) = self.run(&sub).await?;
        if r.status != JobStatus::Succeeded {
            bail!("opening a session failed: {:?}", r.reason);
        }
        Ok((d, r.session.context("no session in result")?.id))
    }

    async fn close(&self, id: &str) -> Result<()> {
        let sub = self.job("", Some(SessionRequest { id: Some(id.to_string()), close: true, ..Default::default() }));
        self.run(&sub).await?;
        Ok(())
    }

    /// Publish every job at once and wait for all: the seconds from the first publish to the
    /// last result, and each job's publish → terminal notification latency. Every job must
    /// succeed.
    async fn burst(&self, subs: &[Submission]) -> Result<(f64, Vec<Duration>)> {
        let t0 = Instant::now();
        let mut waits = Vec::with_capacity(subs.len());
        for sub in subs {
            let (published, w) = (Instant::now(), self.watcher.watch(&sub.tenant, &sub.job_id));
            // Each job's latency is taken when its own notification arrives (all are awaited
            // together, not one after another, which would charge a job for those before it).
            waits.push(async move {
                let status = tokio::time::timeout(Duration::from_secs(600), w).await.context("burst job timed out")??.status;
                anyhow::ensure!(status == JobStatus::Succeeded, "a burst job ended {status}");
                anyhow::Ok(published.elapsed())
            });
            self.client.submit(sub).await?;
        }
        let latencies = futures::future::join_all(waits).await.into_iter().collect::<Result<Vec<_>>>()?;
        Ok((t0.elapsed().as_secs_f64(), latencies))
    }

    fn in_session(&self, id: &str, code: &str) -> Submission {
        self.job(code, Some(SessionRequest { id: Some(id.to_string()), ..Default::default() }))
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = Client::from_env().await?;
    let tenant = format!("bench{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    // The throughput run queues 1600 jobs at once: more than a default tenant may.
    let pool = sqlx::PgPool::connect(client.database_url()).await.context("connecting to Postgres")?;
    let quotas = Quotas {
        max_sessions: 64,
        max_queued_jobs: 100_000,
        max_artifact_bytes: 1 << 40,
        max_jobs_in_flight: 1_000,
        max_result_bytes: 1 << 40,
        max_db_connections: 64,
    };
    TenantStore::new(pool.clone()).set_quotas(&tenant, &quotas).await?;
    carry_stored_artifacts(&pool, &tenant, args.stored_artifacts).await?;
    let watcher = Watcher::connect(&client, &tenant).await?;
    let b = Bench { client, watcher, tenant };
    if let Some(workers) = args.fleet {
        let a = fleet::FleetArgs {
            workers,
            schedulers: args.fleet_schedulers,
            burst: args.fleet_burst,
            sessions: args.sessions,
            jobs_per_session: args.jobs_per_session,
            sequential: args.in_session_jobs.min(300),
        };
        return fleet::run(&b, &a, &args.out).await;
    }

    // 1. In-session round trip.
    let (_, sid) = b.open("x = 0", None).await?;
    for _ in 0..20 {
        b.run(&b.in_session(&sid, "1+1")).await?;
    }
    let (in_session, in_session_stages, in_session_results) = b.sequential(args.in_session_jobs, || b.in_session(&sid, "1+1")).await?;
    println!("in-session 1+1 round trip: {:?}", summarize(&in_session));
    let in_session_stages = stages::breakdown(&in_session_stages);
    let in_session_cost = stages::cost(&in_session_results);
    println!("in-session 1+1 stages: {in_session_stages:?}\ncost: {in_session_cost:?}");

    // 4. Idle memory of that session's container, after a moment of rest.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (mem, mem_nocache) = idle_memory(&b, &sid).await?;
    println!("idle session memory: {mem:.1} MiB ({mem_nocache:.1} MiB without page cache)");
    b.close(&sid).await?;

    // 1b. In-session round trip in a session that keeps many files in its workspace.
    let with_files = match args.workspace_files {
        0 => None,
        n => {
            let make = format!(
                "import os\nfor i in range({n}):\n    d = 'bench_data/d%d' % (i // 1000)\n    os.makedirs(d, exist_ok=True)\n    open('%s/f%d.jpg' % (d, i), 'w').close()"
            );
            let (_, sid) = b.open(&make, None).await?;
            for _ in 0..5 {
                b.run(&b.in_session(&sid, "1+1")).await?;
            }
            let (times, _, _) = b.sequential(args.workspace_jobs, || b.in_session(&sid, "1+1")).await?;
            b.close(&sid).await?;
            println!("in-session 1+1 round trip, {n} files in the workspace: {:?}", summarize(&times));
            Some(summarize(&times))
        }
    };

    // 2. New sessions: warm-pool hits, then cold starts (a memory limit no warm kernel has).
    let mut warm = Vec::new();
    let hits_before = pool_metric(&args.worker_metrics, "sandcell_warm_pool_takes_total{outcome=\"hit\"}").await.unwrap_or(0.0);
    for _ in 0..args.new_sessions {
        wait_for_pool(&args.worker_metrics).await?;
        let (d, id) = b.open("1+1", None).await?;
        warm.push(d);
        b.close(&id).await?;
    }
    let hits = pool_metric(&args.worker_metrics, "sandcell_warm_pool_takes_total{outcome=\"hit\"}").await.unwrap_or(0.0) - hits_before;
    println!("new session, warm pool hit: {:?} ({hits} hits)", summarize(&warm));
    let mut cold = Vec::new();
    for _ in 0..args.new_sessions {
        let (d, id) = b.open("1+1", Some(1000)).await?;
        cold.push(d);
        b.close(&id).await?;
    }
    println!("new session, cold start: {:?}", summarize(&cold));

    // 3. Throughput: N sessions, each fed its jobs back to back without waiting.
    let mut sessions = Vec::new();
    for _ in 0..args.sessions {
        sessions.push(b.open("n = 0", None).await?.1);
    }
    // A mark for whoever profiles the machine around this phase alone (the sessions' opening
    // cold starts are over by now).
    println!("throughput: {} sessions open, feeding {} jobs each", sessions.len(), args.jobs_per_session);
    let cpu_before = (cpu_ms("SANDCELL_SCHEDULER_PID"), cpu_ms("SANDCELL_WORKER_PID"));
    let shared_before = (cpu_ms_of_processes(POSTGRES_COMM), cpu_ms_of_processes(BROKER_COMM), machine_busy_ms());
    let t0 = Instant::now();
    let feeds = sessions.iter().map(|id| {
        let b = &b;
        async move {
            let mut waits = Vec::new();
            for _ in 0..args.jobs_per_session {
                let sub = b.in_session(id, "n += 1");
                waits.push(b.watcher.watch(&sub.tenant, &sub.job_id));
                b.client.submit(&sub).await?;
            }
            // What the sandboxes used, from the results the notifications carry (None once one
            // did not carry its usage).
            let mut sandbox_cpu_ms = Some(0.0);
            for w in waits {
                let n = tokio::time::timeout(Duration::from_secs(300), w).await.context("throughput job timed out")??;
                let used = n.result.as_ref().and_then(|r| r.execution.usage.as_ref()).and_then(|u| u.cpu_ms);
                sandbox_cpu_ms = sandbox_cpu_ms.zip(used).map(|(a, b)| a + b);
            }
            anyhow::Ok(sandbox_cpu_ms)
        }
    });
    let sandbox_cpu_ms = futures::stream::iter(feeds).buffer_unordered(args.sessions).collect::<Vec<_>>().await.into_iter().collect::<Result<Vec<_>>>()?;
    let elapsed = t0.elapsed();
    let shared_after = (cpu_ms_of_processes(POSTGRES_COMM), cpu_ms_of_processes(BROKER_COMM), machine_busy_ms());
    let total = args.sessions * args.jobs_per_session;
    let cpu_after = (cpu_ms("SANDCELL_SCHEDULER_PID"), cpu_ms("SANDCELL_WORKER_PID"));
    let per_job = |a: Option<f64>, b: Option<f64>| Some(round((b? - a?) / total as f64));
    let cpu_sched = per_job(cpu_before.0, cpu_after.0);
    let cpu_worker = per_job(cpu_before.1, cpu_after.1);
    let cpu_postgres = per_job(shared_before.0, shared_after.0);
    let cpu_broker = per_job(shared_before.1, shared_after.1);
    let cpu_machine = per_job(shared_before.2, shared_after.2);
    let cpu_sandboxes = sandbox_cpu_ms.into_iter().sum::<Option<f64>>().map(|ms| round(ms / total as f64));
    // Every job ran, in order: each session counted to jobs_per_session.
    for id in &sessions {
        let (_, r) = b.run(&b.in_session(id, "n")).await?;
        let got = r.execution.outputs.iter().find_map(|o| match o {
            sandcell_protocol::Output::ExecuteResult { data, .. } => data.get("text/plain").cloned(),
            _ => None,
        });
        anyhow::ensure!(got.as_deref() == Some(args.jobs_per_session.to_string().as_str()), "session {id} counted {got:?}");
        b.close(id).await?;
    }
    let jobs_per_s = round(total as f64 / elapsed.as_secs_f64());
    println!("throughput: {total} jobs in {:.2} s over {} sessions = {jobs_per_s} jobs/s", elapsed.as_secs_f64(), args.sessions);
    println!(
        "CPU per job: scheduler {cpu_sched:?} ms, worker {cpu_worker:?} ms, Postgres {cpu_postgres:?} ms, RabbitMQ {cpu_broker:?} ms, \
         sandboxes {cpu_sandboxes:?} ms, the machine {cpu_machine:?} ms"
    );

    // 5. One-off jobs: sequential round trips, then bursts published at once.
    for _ in 0..20 {
        b.run(&b.job("1+1", None)).await?;
    }
    let (oneoff, oneoff_stages, oneoff_results) = b.sequential(args.oneoff_jobs, || b.job("1+1", None)).await?;
    println!("one-off 1+1 round trip: {:?}", summarize(&oneoff));
    let oneoff_stages = stages::breakdown(&oneoff_stages);
    let oneoff_cost = stages::cost(&oneoff_results);
    println!("one-off 1+1 stages: {oneoff_stages:?}\ncost: {oneoff_cost:?}");
    let burst: Vec<Submission> = (0..args.oneoff_burst).map(|_| b.job("1+1", None)).collect();
    let (burst_s, _) = b.burst(&burst).await?;
    let burst_per_s = round(burst.len() as f64 / burst_s);
    println!("one-off burst: {} jobs in {burst_s:.2} s = {burst_per_s} jobs/s", burst.len());
    // Again, once the tenant's sandboxes are bound and the warm pool has refilled (a cold start
    // takes about a second): what a tenant's bulk run sees after its first burst.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let again: Vec<Submission> = (0..args.oneoff_burst).map(|_| b.job("1+1", None)).collect();
    let (again_s, _) = b.burst(&again).await?;
    let again_per_s = round(again.len() as f64 / again_s);
    println!("one-off burst again: {} jobs in {again_s:.2} s = {again_per_s} jobs/s", again.len());
    let csv: String = std::iter::once("category,amount\n".to_string()).chain((0..200).map(|i| format!("c{},{}\n", i % 7, i))).collect();
    let pandas: Vec<Submission> = (0..args.pandas_burst)
        .map(|_| {
            let mut sub = b.job("import pandas as pd\npd.read_csv('sales.csv').groupby('category')['amount'].sum().to_dict()", None);
            sub.files = vec![InputFile::inline("sales.csv", csv.as_bytes())];
            sub
        })
        .collect();
    let (pandas_s, pandas_latency) = b.burst(&pandas).await?;
    let pandas_per_s = round(pandas.len() as f64 / pandas_s);
    println!("one-off pandas burst: {} jobs in {pandas_s:.2} s = {pandas_per_s} jobs/s; latency {:?}", pandas.len(), summarize(&pandas_latency));
    let mut pandas_results = Vec::with_capacity(pandas.len());
    for sub in &pandas {
        pandas_results.push(b.client.result(&sub.tenant, &sub.job_id).await?.context("pandas result row missing")?);
    }
    let pandas_cost = stages::cost(&pandas_results);
    println!("pandas job cost: {pandas_cost:?}");

    // 7. Live output: a printed line (carrying the sandbox's clock, which is the host's) → its
    // stdout event at the client; then the same through the Python SDK, and its round trip.
    let (live_sid, print_to_event) = {
        let (_, sid) = b.open("import time", None).await?;
        let mut live = b.client.live(&b.tenant, None).await?;
        let mut samples = Vec::with_capacity(args.live_jobs);
        for _ in 0..args.live_jobs {
            let sub = b.in_session(&sid, "print(repr(time.time()), flush=True)\ntime.sleep(0.02)");
            b.client.submit(&sub).await?;
            let mut first = None;
            loop {
                let event =
                    tokio::time::timeout(Duration::from_secs(60), live.next()).await.context("no live event within 60 s")?.context("live output ended")?;
                if event.job_id != sub.job_id {
                    continue;
                }
                match event.body {
                    EventBody::Stdout { text } if first.is_none() => {
                        let printed: f64 = text.split_whitespace().next().unwrap_or_default().parse().context("the printed clock")?;
                        let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
                        first = Some(Duration::from_secs_f64((now - printed).max(0.0)));
                    }
                    EventBody::End { .. } => break,
                    _ => {}
                }
            }
            samples.extend(first);
        }
        (sid, samples)
    };
    b.close(&live_sid).await?;
    println!("print → live stdout event: {:?}", summarize(&print_to_event));
    let sdk = match std::env::var("SANDCELL_BENCH_PYTHON") {
        Ok(python) if args.sdk_jobs > 0 => Some(sdk_figures(&python, &b.tenant, args.sdk_jobs, args.live_jobs)?),
        _ => None,
    };
    if let Some((rt, live)) = &sdk {
        println!("Python SDK in-session 1+1: {:?}\nprint → on_stdout (SDK): {:?}", summarize(rt), summarize(live));
    }

    // The E2B gateway's run_code("1+1"), interleaved with native in-session jobs.
    let gateway = match args.gateway_jobs {
        0 => None,
        n => Some(gateway::measure(&b, &args.gateway, n).await?),
    };
    if let Some(g) = &gateway {
        println!(
            "E2B gateway run_code 1+1: {:?}
native, interleaved: {:?}",
            summarize(&g.gateway),
            summarize(&g.native)
        );
    }

    // 6. Baseline: a container per job.
    let baseline = docker_run_baseline(args.baseline_jobs).await?;
    println!("baseline docker run --rm: {:?}", summarize(&baseline));

    drop_stored_artifacts(&pool, &b.tenant).await?;

    let report = Report {
        measured_at: chrono::Utc::now().to_rfc3339(),
        stored_artifacts: args.stored_artifacts,
        git_commit: std::env::var("SANDCELL_GIT_COMMIT").unwrap_or_default(),
        machine: std::env::var("SANDCELL_MACHINE").unwrap_or_default(),
        in_session_round_trip: summarize(&in_session),
        workspace_files: args.workspace_files,
        in_session_with_files_round_trip: with_files,
        new_session_warm_pool_hit: summarize(&warm),
        new_session_cold_start: summarize(&cold),
        warm_pool_hits_observed: hits.max(0.0) as u64,
        throughput_sessions: args.sessions,
        throughput_jobs: total,
        throughput_seconds: round(elapsed.as_secs_f64()),
        throughput_jobs_per_s: jobs_per_s,
        cpu_ms_per_job_scheduler: cpu_sched,
        cpu_ms_per_job_worker: cpu_worker,
        cpu_ms_per_job_postgres: cpu_postgres,
        cpu_ms_per_job_broker: cpu_broker,
        cpu_ms_per_job_sandboxes: cpu_sandboxes,
        cpu_ms_per_job_machine: cpu_machine,
        idle_session_memory_mib: round(mem),
        idle_session_memory_without_cache_mib: round(mem_nocache),
        oneoff_round_trip: summarize(&oneoff),
        oneoff_burst_jobs: burst.len(),
        oneoff_burst_jobs_per_s: burst_per_s,
        oneoff_burst_again_jobs_per_s: again_per_s,
        pandas_burst_jobs: pandas.len(),
        pandas_burst_jobs_per_s: pandas_per_s,
        pandas_burst_latency: summarize(&pandas_latency),
        baseline_docker_run: summarize(&baseline),
        in_session_stages,
        oneoff_stages,
        in_session_cost,
        oneoff_cost,
        pandas_cost,
        print_to_event: summarize(&print_to_event),
        sdk_in_session_round_trip: sdk.as_ref().map(|(rt, _)| summarize(rt)),
        sdk_print_to_on_stdout: sdk.as_ref().map(|(_, live)| summarize(live)),
        gateway_run_code: gateway.as_ref().map(|g| summarize(&g.gateway)),
        gateway_native_interleaved: gateway.as_ref().map(|g| summarize(&g.native)),
    };
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("latest.json"), serde_json::to_string_pretty(&report)? + "\n")?;
    std::fs::write(args.out.join("README.md"), markdown(&report))?;
    plot(
        &b,
        &args.out,
        &[
            ("in-session 1+1", &in_session),
            ("one-off 1+1", &oneoff),
            ("new session (warm)", &warm),
            ("new session (cold)", &cold),
            ("docker run --rm", &baseline),
        ],
    )
    .await?;
    println!("wrote {}/latest.json, README.md, latency.png", args.out.display());
    Ok(())
}

/// Run `clients/python/bench/sdk_bench.py` with `python` for `tenant`: its in-session round
/// trips and print → `on_stdout` latencies.
fn sdk_figures(python: &str, tenant: &str, jobs: usize, live_jobs: usize) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python/bench/sdk_bench.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(["--tenant", tenant, "--jobs", &jobs.to_string(), "--live-jobs", &live_jobs.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("the SDK bench's JSON")?;
    let ms = |key: &str| -> Vec<Duration> {
        v[key].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).map(|m| Duration::from_secs_f64(m.max(0.0) / 1000.0)).collect()).unwrap_or_default()
    };
    Ok((ms("in_session_ms"), ms("print_to_on_stdout_ms")))
}

/// The command name of Postgres' processes (postmaster, backends, background workers).
const POSTGRES_COMM: &str = "postgres";
/// The command name of RabbitMQ's Erlang VM.
const BROKER_COMM: &str = "beam.smp";

/// CPU time (user + system) in ms of every process named `comm` now running: a service's share
/// of a phase, when its processes outlive the phase (Postgres' pooled backends, the broker's VM);
/// the CPU of a process that ends meanwhile is not counted. `None` when none runs.
fn cpu_ms_of_processes(comm: &str) -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().filter(|p| p.bytes().all(|b| b.is_ascii_digit())).map(str::to_string) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if stat.get(open + 1..close) != Some(comm) {
            continue;
        }
        if let Some(ms) = stat_cpu_ms(&stat) {
            total = Some(total.unwrap_or(0.0) + ms);
        }
    }
    total
}

/// The machine's busy CPU time in ms since boot, all cores (`/proc/stat`'s first line, every
/// column but idle and iowait).
fn machine_busy_ms() -> Option<f64> {
    busy_ms(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// [`machine_busy_ms`] from the text of `/proc/stat`.
fn busy_ms(stat: &str) -> Option<f64> {
    let cols: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).map(|c| c.parse::<f64>()).collect::<Result<_, _>>().ok()?;
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let busy: f64 = cols.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    Some(busy * 10.0) // USER_HZ is 100 on Linux
}

/// Process CPU time (user + system) in ms of the pid named by `var`.
fn cpu_ms(var: &str) -> Option<f64> {
    let pid = std::env::var(var).ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_cpu_ms(&stat)
}

/// utime + stime in ms from the text of a `/proc/<pid>/stat`.
fn stat_cpu_ms(stat: &str) -> Option<f64> {
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks * 10.0) // USER_HZ is 100 on Linux
}

async fn metrics_text(addr: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

async fn pool_metric(addr: &str, name: &str) -> Result<f64> {
    let text = metrics_text(addr).await?;
    let line = text.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name}"))?;
    Ok(line.rsplit(' ').next().unwrap_or("0").parse()?)
}

async fn wait_for_pool(addr: &str) -> Result<()> {
    for _ in 0..300 {
        if pool_metric(addr, "sandcell_warm_pool_size").await.unwrap_or(0.0) >= 1.0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the warm pool did not refill within 30 s")
}

/// Memory of the session's container from its cgroup: total, and without inactive page cache
/// (what `docker stats` shows).
async fn idle_memory(b: &Bench, session_id: &str) -> Result<(f64, f64)> {
    let pool = sqlx::PgPool::connect(b.client.database_url()).await?;
    let container: String =
        sqlx::query_scalar("SELECT container_id FROM sessions WHERE session_id = $1").bind(session_id).fetch_one(&pool).await.context("session container")?;
    let docker = bollard::Docker::connect_with_defaults()?.negotiate_version().await?;
    let mut stats = docker.stats(&container, Some(bollard::query_parameters::StatsOptions { stream: false, one_shot: false }));
    let s = stats.next().await.context("no stats")??;
    let m = s.memory_stats.context("no memory stats")?;
    let usage = m.usage.unwrap_or(0) as f64;
    let inactive = m.stats.as_ref().and_then(|st| st.get("inactive_file").copied()).unwrap_or(0) as f64;
    Ok((usage / 1048576.0, (usage - inactive) / 1048576.0))
}

/// The seed's baseline: create, attach, start, wait and remove a container of the same image
/// per job, through the Docker API.
async fn docker_run_baseline(n: usize) -> Result<Vec<Duration>> {
    use bollard::query_parameters::{AttachContainerOptions, RemoveContainerOptions, StartContainerOptions, WaitContainerOptions};
    let image = std::env::var("SANDCELL_SANDBOX_IMAGE").context("SANDCELL_SANDBOX_IMAGE")?;
    let docker = bollard::Docker::connect_with_defaults()?.negotiate_version().await?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n + 2 {
        let t0 = Instant::now();
        let body = bollard::models::ContainerCreateBody {
            image: Some(image.clone()),
            cmd: Some(vec!["python3".into(), "-c".into(), "print(1+1)".into()]),
            attach_stdout: Some(true),
            host_config: Some(bollard::models::HostConfig { network_mode: Some("none".into()), ..Default::default() }),
            ..Default::default()
        };
        let id = docker.create_container(None::<bollard::query_parameters::CreateContainerOptions>, body).await?.id;
        let mut attach = docker.attach_container(&id, Some(AttachContainerOptions { stdout: true, stream: true, ..Default::default() })).await?;
        docker.start_container(&id, None::<StartContainerOptions>).await?;
        let mut text = String::new();
        while let Some(Ok(chunk)) = attach.output.next().await {
            text.push_str(&chunk.to_string());
        }
        let _ = docker.wait_container(&id, None::<WaitContainerOptions>).collect::<Vec<_>>().await;
        docker.remove_container(&id, Some(RemoveContainerOptions { force: true, ..Default::default() })).await?;
        anyhow::ensure!(text.trim() == "2", "baseline printed {text:?}");
        out.push(t0.elapsed());
    }
    // The first two warm Docker's caches, as the in-session warm-up does for sandcell.
    Ok(out.split_off(2))
}

fn row(name: &str, s: &Summary, target: &str) -> String {
    format!("| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {target} |\n", s.n, s.p50_ms, s.p95_ms, s.p99_ms, s.max_ms)
}

fn markdown(r: &Report) -> String {
    let mut m = String::from("# sandcell benchmark\n\n");
    m += "Produced by `bash deploy/local/bench.sh` (release builds, local stack, runc). Do not edit by hand;\n";
    m += "the raw figures are in [`latest.json`](latest.json), the distributions in [`latency.png`](latency.png).\n\n";
    m += &format!("Measured {} at commit `{}` on {}.\n\n", r.measured_at, r.git_commit, r.machine);
    if r.stored_artifacts > 0 {
        m += &format!("The bench's tenant carried {} stored artifacts (`--stored-artifacts`).\n\n", r.stored_artifacts);
    }
    m += "## Latency: publish → result visible to a client (ms)\n\n";
    m += "| case | n | p50 | p95 | p99 | max | target |\n|---|---|---|---|---|---|---|\n";
    m += &row("in-session `1+1`", &r.in_session_round_trip, "p50 ≤ 5, p99 ≤ 25");
    if let Some(s) = &r.in_session_with_files_round_trip {
        m += &row(&format!("in-session `1+1`, {} files in the session's workspace", r.workspace_files), s, "—");
    }
    m += &row("new session, warm pool hit", &r.new_session_warm_pool_hit, "p50 ≤ 40");
    m += &row("new session, cold start (pool miss)", &r.new_session_cold_start, "—");
    m += &row("one-off `1+1` (sequential, one tenant)", &r.oneoff_round_trip, "p50 ≤ 15, p99 ≤ 50");
    m += &row("one-off pandas CSV job, in a burst (publish → notified)", &r.pandas_burst_latency, "—");
    m += &row("baseline: `docker run --rm` per job (Docker API, no queue or store)", &r.baseline_docker_run, "—");
    if let Some(s) = &r.sdk_in_session_round_trip {
        m += &row("in-session `1+1` through the Python SDK (`Sandbox.run_code`)", s, "p50 ≤ 5");
    }
    if let (Some(g), Some(n)) = (&r.gateway_run_code, &r.gateway_native_interleaved) {
        m += &row("in-session `1+1` through the E2B gateway (`POST /execute`, NDJSON read to its end)", g, "p50 ≤ native + 2");
        m += &row("in-session `1+1`, native, interleaved job by job with the gateway's", n, "—");
    }
    m += "\n## Live output: a printed line → the client (ms)\n\n";
    m += "| path | n | p50 | p95 | p99 | max | target |\n|---|---|---|---|---|---|---|\n";
    m += &row("`print(..., flush=True)` → stdout event (Rust client)", &r.print_to_event, "p50 ≤ 10");
    if let Some(s) = &r.sdk_print_to_on_stdout {
        m += &row("`print(..., flush=True)` → `on_stdout` (Python SDK)", s, "p50 ≤ 10");
    }
    m += &format!("\nWarm-pool hits observed during the warm case: {} of {}.\n\n", r.warm_pool_hits_observed, r.new_session_warm_pool_hit.n);
    m += "## Throughput and cost\n\n| figure | value | target |\n|---|---|---|\n";
    m += &format!(
        "| in-session throughput, {} sessions, {} jobs | {:.1} jobs/s ({:.2} s) | ≥ 300 jobs/s |\n",
        r.throughput_sessions, r.throughput_jobs, r.throughput_jobs_per_s, r.throughput_seconds
    );
    m += &format!("| one-off `1+1` burst, {} jobs published at once | {:.1} jobs/s | ≥ 100 jobs/s |\n", r.oneoff_burst_jobs, r.oneoff_burst_jobs_per_s);
    m += &format!(
        "| the same burst again, 5 s later (the tenant's sandboxes bound, the warm pool refilled) | {:.1} jobs/s | ≥ 100 jobs/s |\n",
        r.oneoff_burst_again_jobs_per_s
    );
    m += &format!("| one-off pandas CSV burst, {} jobs | {:.1} jobs/s | — |\n", r.pandas_burst_jobs, r.pandas_burst_jobs_per_s);
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.2} ms")).unwrap_or_else(|| "n/a".into());
    m += &format!("| scheduler CPU per job (16 sessions) | {} | — |\n", opt(r.cpu_ms_per_job_scheduler));
    m += &format!("| worker CPU per job (16 sessions; excluding the sandbox) | {} | — |\n", opt(r.cpu_ms_per_job_worker));
    m += &format!("| Postgres CPU per job (16 sessions; all its processes) | {} | — |\n", opt(r.cpu_ms_per_job_postgres));
    m += &format!("| RabbitMQ CPU per job (16 sessions) | {} | — |\n", opt(r.cpu_ms_per_job_broker));
    m += &format!("| sandbox CPU per job (16 sessions; the results' `usage`) | {} | — |\n", opt(r.cpu_ms_per_job_sandboxes));
    m += &format!("| the machine's CPU per job (16 sessions; `/proc/stat`, all cores, not idle) | {} | — |\n", opt(r.cpu_ms_per_job_machine));
    m += &format!(
        "| idle session memory (cgroup, without page cache) | {:.1} MiB ({:.1} MiB with cache) | ≤ 150 MiB |\n",
        r.idle_session_memory_without_cache_mib, r.idle_session_memory_mib
    );
    m += "\n## Where a sequential `1+1` spends its time (ms)\n\n";
    m += "Stages follow each other and add up to the round trip; see `bench/src/stages.rs` for what each one covers.\n\n";
    m += "| stage | in-session p50 | mean | one-off p50 | mean |\n|---|---|---|---|---|\n";
    for (s, o) in r.in_session_stages.stages.iter().zip(&r.oneoff_stages.stages) {
        m += &format!("| {} | {:.2} | {:.2} | {:.2} | {:.2} |\n", s.stage, s.p50_ms, s.mean_ms, o.p50_ms, o.mean_ms);
    }
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.2}")).unwrap_or_else(|| "n/a".into());
    m += &format!(
        "\nRecorded → dispatch confirmed by the broker (p50): {} ms in a session, {} ms one-off.\n",
        opt(r.in_session_stages.dispatch_confirmed_p50_ms),
        opt(r.oneoff_stages.dispatch_confirmed_p50_ms)
    );
    m += "\n## Cost per job (the results' `usage`: the sandbox's cgroup during the job)\n\n";
    m += "| job | n | CPU p50 (ms) | CPU mean (ms) | peak memory p50 (MiB) |\n|---|---|---|---|---|\n";
    for (name, c) in [("in-session `1+1`", &r.in_session_cost), ("one-off `1+1`", &r.oneoff_cost), ("one-off pandas CSV job", &r.pandas_cost)] {
        m += &format!("| {name} | {} | {} | {} | {} |\n", c.n, opt(c.cpu_ms_p50), opt(c.cpu_ms_mean), opt(c.peak_memory_mib_p50));
    }
    m
}

/// Draw the latency distributions with sandcell itself and save the PNG artifact.
async fn plot(b: &Bench, out: &std::path::Path, series: &[(&str, &Vec<Duration>)]) -> Result<()> {
    let mut csv = String::from("series,ms\n");
    for (name, samples) in series {
        for d in samples.iter() {
            csv += &format!("{name},{:.3}\n", d.as_secs_f64() * 1000.0);
        }
    }
    let code = r#"
import pandas as pd, matplotlib.pyplot as plt, numpy as np
df = pd.read_csv('samples.csv')
fig, ax = plt.subplots(figsize=(9, 5))
for name, g in df.groupby('series', sort=False):
    v = np.sort(g['ms'].values)
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where='post', label=f"{name} (n={len(v)}, p50={np.median(v):.1f} ms)")
ax.set_xscale('log'); ax.set_xlabel('publish → result visible (ms, log scale)'); ax.set_ylabel('fraction of jobs')
ax.set_title('sandcell latency distributions'); ax.grid(True, which='both', alpha=.3); ax.legend(loc='lower right')
fig.tight_layout(); fig.savefig('latency.png', dpi=110)
"#;
    let mut sub = b.job(code, None);
    sub.files = vec![InputFile::inline("samples.csv", csv.as_bytes())];
    let (_, r) = b.run(&sub).await?;
    let url = r
        .artifacts
        .iter()
        .find(|a| a.path == "latency.png")
        .and_then(|a| a.download_url.clone())
        .with_context(|| format!("no chart: {:?}", r.execution.error))?;
    let png = http_get(&url).await?;
    std::fs::write(out.join("latency.png"), png)?;
    Ok(())
}

async fn http_get(url: &str) -> Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").context("http only")?;
    let (host, path) = rest.split_once('/').context("no path")?;
    let mut s = tokio::net::TcpStream::connect(host).await?;
    s.write_all(format!("GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no header end")?;
    anyhow::ensure!(raw.starts_with(b"HTTP/1.1 200") || raw.starts_with(b"HTTP/1.0 200"), "download failed");
    Ok(raw[split + 4..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_cpu_time_is_read_past_a_command_name_with_parentheses_and_spaces() {
        let stat = "4242 (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 1 0 100 0 0";
        assert_eq!(stat_cpu_ms(stat), Some(3250.0));
    }

    #[test]
    fn the_machine_is_busy_in_every_column_but_idle_and_iowait() {
        let stat = "cpu  100 1 20 5000 300 2 3 4 0 0\ncpu0 50 0 10 2500 150 1 1 2 0 0\n";
        assert_eq!(busy_ms(stat), Some((100.0 + 1.0 + 20.0 + 2.0 + 3.0 + 4.0) * 10.0));
    }
}
