//! Running a job: the one function every job goes through, one-off or in a session —
//! [`job`]: fetch inputs uploaded by reference, claim, get a kernel and run the cell under a
//! slot, store outputs, commit. The difference between a one-off job and a session's is the
//! [`Host`] that owns the kernel: [`OneOff`] here, the session's task in [`crate::session`].
//!
//! Order matters: inputs are resolved *before* the claim, so a job whose upload is missing is
//! `rejected` without ever running; outputs are stored *before* the commit, and the delivery is
//! acked only after it (see [`crate::ledger`]).
//!
//! The slot rule: a job's container start and its cell hold one of the worker's slots
//! (`SANDCELL_WORKER_SLOTS`) — starting a sandbox takes the CPU a cell would. [`kernel_for`]
//! takes a [`Slot`] as proof, so no path starts a job's sandbox without one. The warm pool's
//! refills are the one exception: they run in the background, one at a time.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result};
use sandcell_core::jobs::{Arrival, Claim, Finished};
use sandcell_protocol::{ErrorCode, ExecutionJob, ExecutionLimits, InputFile, JobStatus, Reason};

use crate::bound::Bound;
use crate::context::{Slot, WorkerContext};
use crate::inputs::Resolved;
use crate::kernel::{CellRun, Kernel, OnTimeout, Priority, StartPriority, Stop};
use crate::ledger::Disposition;
use crate::outcome::{Extras, Outcome};
use crate::sandbox::container::{ContainerShape, SandboxSpec, LABEL_JOB, LABEL_SESSION, LABEL_TENANT, LABEL_WORKER};

/// Who owns the kernel a job runs in: the one difference between a one-off job ([`OneOff`])
/// and a session's (the session's task).
pub trait Host {
    /// What to do when the job's wall clock runs out.
    fn on_timeout(&self, ctx: &WorkerContext) -> OnTimeout;
    /// Whether the job runs in a process forked for it that leaves nothing behind (one-off),
    /// or in the kernel itself, whose state persists (a session).
    fn fresh(&self) -> bool;
    /// Where a cancel of the job reaches its cell (a session's jobs may be cancelled; a
    /// one-off job may not).
    fn cancel_signal(&self) -> Option<tokio::sync::watch::Receiver<Vec<String>>> {
        None
    }
    /// The kernel to run the job in, got while the job holds `slot`. An error ends the job
    /// with `sandbox_unavailable`.
    async fn kernel(&mut self, ctx: &WorkerContext, job: &ExecutionJob, limits: &ExecutionLimits, slot: &Slot) -> Result<&mut Kernel>;
    /// After the cell (its slot released), before the commit: what becomes of the kernel, and
    /// what the commit carries besides the outcome.
    async fn after(&mut self, ctx: &WorkerContext, job: &ExecutionJob, cell: CellRun) -> (Outcome, Extras);
    /// A slot the host already holds for this job: a new session's, taken to start its
    /// container, is kept for its opening job (which would otherwise queue for a slot behind
    /// every container start waiting, and a burst of new sessions would see its first results
    /// only once every container had started).
    fn held_slot(&mut self) -> Option<Slot> {
        None
    }
    /// Files to write into the workspace before the job's own: a moved session's workspace,
    /// put back from the store for the job that took it over. They are what a job's uploads
    /// are fetched beside ([`crate::inputs::resolve`]), and kept for the next job should this one be
    /// refused.
    fn restored(&self) -> &[InputFile] {
        &[]
    }
    /// The files of [`Host::restored`], handed to the job that runs.
    fn take_restored(&mut self) -> Vec<InputFile> {
        Vec::new()
    }
}

/// A one-off job's host: a sandbox bound to the job's tenant (one that waits in
/// [`crate::bound`] after the tenant's previous one-off job, else a warm or fresh one, bound
/// now); the job runs in a process forked for it, the sandbox is killed at the deadline, and
/// after the cell it goes back to wait for the tenant's next job if the driver vouched that
/// nothing of this one is left.
///
/// With reuse off (`SANDCELL_ONEOFF_REUSE_JOBS=1`, the default under gVisor) the job runs in the
/// sandbox's kernel itself, as a session's first cell would, and the sandbox is destroyed after.
pub struct OneOff {
    bound: Option<Bound>,
    /// Whether one-off sandboxes are reused (then the job runs fresh).
    reuse: bool,
}

impl OneOff {
    /// The host of one one-off job; `reuse`: [`crate::bound::BoundPool::reuses`].
    pub fn new(reuse: bool) -> Self {
        OneOff { bound: None, reuse }
    }
}

impl Host for OneOff {
    fn on_timeout(&self, _ctx: &WorkerContext) -> OnTimeout {
        OnTimeout::Kill
    }

    fn fresh(&self) -> bool {
        self.reuse
    }

    async fn kernel(&mut self, ctx: &WorkerContext, job: &ExecutionJob, limits: &ExecutionLimits, slot: &Slot) -> Result<&mut Kernel> {
        let spec = spec_for(ctx, job, limits);
        let shape = spec.shape();
        let bound = match ctx.bound.take(&job.tenant, &shape) {
            Some(bound) => bound,
            None if self.reuse && (ctx.pool.is_empty_for(&shape) || ctx.bound.is_settling(&job.tenant, &shape)) => {
                start_or_take_returned(ctx, &job.tenant, spec, shape, slot).await?
            }
            None => {
                let kernel = kernel_for(ctx, &spec, slot).await?;
                ctx.bound.count_new();
                Bound::new(kernel, &job.tenant, shape)
            }
        };
        Ok(&mut self.bound.insert(bound).kernel)
    }

    async fn after(&mut self, ctx: &WorkerContext, _job: &ExecutionJob, cell: CellRun) -> (Outcome, Extras) {
        let container_id = self.bound.as_ref().map(|b| b.kernel.id().to_string());
        if let Some(mut bound) = self.bound.take() {
            if self.reuse && cell.alive && cell.outcome.done {
                // The result goes on to its commit while the sandbox settles: its job's process
                // exits and the driver cleans up, then says whether the sandbox may be reused.
                let (pool, settled) = (ctx.bound.clone(), ctx.bound.settling(&bound));
                tokio::spawn(async move {
                    let clean = bound.kernel.settle(SETTLE_WITHIN).await;
                    pool.put_back(bound, clean, Some(settled)).await;
                });
            } else {
                // A job that timed out, was killed or broke the protocol leaves its sandbox
                // dirty; without reuse the sandbox is recycled for its one job (`jobs`).
                ctx.bound.put_back(bound, !self.reuse, None).await;
            }
        }
        (cell.outcome, Extras { container_id, ..Default::default() })
    }
}

/// Longest wait for a one-off sandbox to settle after its job (its process to exit and the
/// driver to clean up: milliseconds, more for a job that left many files); past it the sandbox
/// is destroyed.
const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Longest a one-off job waits for its tenant's sandboxes settling before it takes a warm one
/// or starts one.
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Run one job to its commit (or its refusal) in the kernel `host` provides; `claimed` when
/// the job was claimed before it got here (a session's opening job). `Ok` is the disposition
/// of its message; an error means nothing was committed.
pub async fn job<H: Host>(ctx: &WorkerContext, job: &ExecutionJob, arrival: Arrival, claimed: Option<Claim>, host: &mut H) -> Result<Disposition> {
    // Taken first, so that it is released on every path, the job's refusal included. A job
    // with uploads gives it back before it waits for the fetch budget, and takes a slot once
    // they are fetched: a job waiting for a slot may hold the budget, so no job holding a slot
    // waits for it (`inputs::FetchBudget`).
    let held = host.held_slot().filter(|_| !crate::inputs::has_uploads(job));
    let Some((inputs, claim)) = prepare(ctx, job, arrival, claimed, host.restored()).await? else { return Ok(Disposition::Ack) };
    let inputs = Resolved { files: with_restored(host.take_restored(), inputs.files), held: inputs.held };
    let session_id = job.session.as_ref().map(|s| s.id.as_str());
    let started = Instant::now();
    let limits = ctx.cfg.policy.cap(&job.limits);
    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, session_id, attempt = claim.attempt, "running job");
    let (on_timeout, fresh, cancel) = (host.on_timeout(ctx), host.fresh(), host.cancel_signal());
    let mut live = ctx.events.job(job, claim.attempt);
    let cell = {
        let slot = match held {
            Some(slot) => slot,
            None => ctx.slot().await?,
        };
        match host.kernel(ctx, job, &limits, &slot).await {
            Ok(kernel) => kernel.run(job, inputs, &limits, Stop { on_timeout, cancel }, fresh, &mut live).await,
            Err(e) => CellRun { outcome: Outcome::new(&limits).infra(ErrorCode::SandboxUnavailable, format!("{e:#}")), alive: false },
        }
    };
    let (outcome, extras) = host.after(ctx, job, cell).await;
    let status = commit(ctx, job, &limits, outcome, extras).await?;
    live.end(status);
    ctx.metrics.execution_seconds.observe(started.elapsed().as_secs_f64());
    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, session_id, %status, elapsed_ms = started.elapsed().as_millis() as u64, "job finished");
    Ok(Disposition::Ack)
}

/// The job's input files after the files put back into the workspace: one file per path (the
/// driver refuses a path twice), the last one written winning, the job's own last of all.
fn with_restored(restored: Vec<InputFile>, own: Vec<InputFile>) -> Vec<InputFile> {
    if restored.is_empty() {
        return own;
    }
    let mut all: Vec<InputFile> = restored.into_iter().chain(own).collect();
    let mut seen = std::collections::HashSet::new();
    // Keep the last of each path, in the order of those kept.
    all.reverse();
    all.retain(|f| seen.insert(f.path.clone()));
    all.reverse();
    all
}

/// Inputs first (`restored`: as for [`crate::inputs::resolve`]), then the claim
/// (unless `claimed` already): the files to run with and the claim, or `None` when the job must
/// not run — it was refused (missing upload) or is not claimable — and its message is to be
/// acked.
pub async fn prepare(
    ctx: &WorkerContext,
    job: &ExecutionJob,
    arrival: Arrival,
    claimed: Option<Claim>,
    restored: &[InputFile],
) -> Result<Option<(Resolved, Claim)>> {
    let files = match crate::inputs::resolve(ctx, job, restored).await {
        Ok(f) => f,
        Err(reason) => {
            refuse(ctx, job, &reason).await?;
            return Ok(None);
        }
    };
    let claim = match claimed {
        Some(c) => Some(c),
        None => claim(ctx, job, arrival).await?,
    };
    Ok(claim.map(|c| (files, c)))
}

/// Claim a job; `None` when it must not run (finished, running elsewhere, unknown, or claimed
/// too often — the last is failed with `too_many_attempts` here).
pub async fn claim(ctx: &WorkerContext, job: &ExecutionJob, arrival: Arrival) -> Result<Option<Claim>> {
    let (tenant, job_id) = (job.tenant.as_str(), job.job_id.as_str());
    // Tried again in place when the database fails (as a commit is), rather than returned to
    // the queue: a session's job sent back would land behind the session's later jobs, and
    // run after them. A try after the first may find its own claim, committed with the answer
    // lost, and takes it.
    let claimed = with_db_retries(tenant, job_id, "claiming the job", |attempt| {
        ctx.jobs.claim(tenant, job_id, &ctx.cfg.worker_id, arrival, ctx.cfg.worker_dead_after, attempt > 1)
    })
    .await?;
    let Some(claim) = claimed else {
        tracing::info!(tenant, job_id, redelivered = arrival.redelivered, "job already running, finished or unknown; not run again");
        return Ok(None);
    };
    let wait = (chrono::Utc::now() - claim.queued_at).to_std().unwrap_or_default();
    ctx.metrics.queue_wait_seconds.observe(wait.as_secs_f64());
    if claim.attempt > ctx.cfg.max_attempts {
        let reason = Reason::new(ErrorCode::TooManyAttempts, format!("claimed {} times without completing", claim.attempt - 1));
        ctx.jobs.fail(tenant, job_id, JobStatus::InfrastructureError, &reason).await?;
        ctx.events.job(job, claim.attempt).end(JobStatus::InfrastructureError);
        ctx.metrics.jobs.with_label_values(&[JobStatus::InfrastructureError.as_str()]).inc();
        return Ok(None);
    }
    Ok(Some(claim))
}

/// Refuse a job that cannot run (its inputs or session are gone) and count it.
pub async fn refuse(ctx: &WorkerContext, job: &ExecutionJob, reason: &Reason) -> Result<()> {
    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, code = %reason.code, "job refused: {}", reason.message);
    if with_db_retries(&job.tenant, &job.job_id, "refusing the job", |_| ctx.jobs.refuse(&job.tenant, &job.job_id, reason)).await? {
        ctx.events.job(job, 0).end(JobStatus::Rejected);
        ctx.metrics.jobs.with_label_values(&[JobStatus::Rejected.as_str()]).inc();
    }
    Ok(())
}

/// The container spec for a job (or a session opened by it).
pub fn spec_for(ctx: &WorkerContext, job: &ExecutionJob, limits: &ExecutionLimits) -> SandboxSpec {
    let mut labels = HashMap::from([
        (LABEL_WORKER.to_string(), ctx.cfg.worker_id.clone()),
        (LABEL_TENANT.to_string(), job.tenant.clone()),
        (LABEL_JOB.to_string(), job.job_id.clone()),
    ]);
    if let Some(s) = &job.session {
        labels.insert(LABEL_SESSION.to_string(), s.id.clone());
    }
    SandboxSpec {
        image: ctx.cfg.kernel.image.clone(),
        runtime: ctx.cfg.kernel.runtime.clone(),
        limits: limits.clone(),
        labels,
        egress: ctx.cfg.egress_for(&job.tenant),
        preload: ctx.cfg.kernel.preload.clone(),
        // A job waits for this start: its kernel prepares for forked jobs after its first.
        prepare_at_start: false,
    }
}

/// A one-off job's sandbox when none of its tenant's waits and the warm pool has none, or one
/// of the tenant's is settling after its job: while one settles, wait for it (it is back in
/// milliseconds); else take a warm one if the pool has one by now, or start
/// one, but take one of the tenant's sandboxes if another job of the tenant returns it first (a
/// job takes milliseconds, a start about a second of CPU: in a burst, a job waited up to 3.7 s
/// for a start while its tenant's sandboxes went back idle). A start that lost goes on without
/// the job, in the background ([`StartPriority::to_background`]), is prepared for fresh jobs
/// there ([`Kernel::prepare`]), and waits, bound to the tenant, for its next job: the burst
/// grows the tenant's sandboxes as before, and neither a job nor the burst's CPU waits for it.
///
/// At most one start per tenant and shape is in flight ([`crate::bound::BoundPool::start_ticket`]):
/// a job that finds one waits for a return or for that start's end, then looks again.
async fn start_or_take_returned(ctx: &WorkerContext, tenant: &str, spec: SandboxSpec, shape: ContainerShape, _slot: &Slot) -> Result<Bound> {
    let mut starting: Option<(tokio::task::JoinHandle<Result<Kernel>>, StartPriority, crate::bound::InFlight)> = None;
    // A settle takes milliseconds; one that takes longer (a job that left a great many files)
    // is not waited for past this, while the job holds its slot.
    let settles_until = tokio::time::Instant::now() + SETTLE_WAIT;
    loop {
        let returned = ctx.bound.returned();
        tokio::pin!(returned);
        returned.as_mut().enable();
        if let Some(bound) = ctx.bound.take(tenant, &shape) {
            if let Some((handle, priority, ticket)) = starting.take() {
                // The start goes on without this job, in the background (no job waits for it,
                // so it takes no CPU running jobs want); its sandbox waits for the tenant's next.
                priority.to_background();
                let (pool, tenant, shape) = (ctx.bound.clone(), tenant.to_string(), shape.clone());
                tokio::spawn(async move {
                    match handle.await {
                        Ok(Ok(mut kernel)) => {
                            // Its preparation for fresh jobs too, before it waits: the tenant's
                            // jobs on it do not wait for it. At full weight: it is a fraction of
                            // a start (~0.3 s of CPU), timed by the driver's wall clock, and in
                            // the idle class a busy machine would starve it past that. Not after
                            // a lull (as a warm-pool refill waits): the start's ticket is held
                            // until it is kept, and in a burst that would keep the sandbox out
                            // of it, and the tenant from starting another, for up to 10 s.
                            priority.end(&mut kernel);
                            if kernel.prepare(SETTLE_WITHIN).await {
                                pool.count_new();
                                pool.keep(Bound::new(kernel, &tenant, shape)).await;
                            } else {
                                kernel.destroy().await;
                            }
                        }
                        Ok(Err(e)) => tracing::warn!(tenant, error = format!("{e:#}"), "a one-off sandbox started ahead of demand failed"),
                        Err(e) => tracing::warn!(tenant, error = %e, "a one-off sandbox start was lost"),
                    }
                    drop(ticket);
                });
            }
            return Ok(bound);
        }
        if starting.is_none() && ctx.bound.is_settling(tenant, &shape) && tokio::time::Instant::now() < settles_until {
            // A settle's end (kept or destroyed) wakes this one.
            let _ = tokio::time::timeout_at(settles_until, returned).await;
            continue;
        }
        if starting.is_none() {
            if let Some(kernel) = if ctx.pool.is_empty_for(&shape) { None } else { ctx.pool.take(&shape) } {
                ctx.bound.count_new();
                return Ok(Bound::new(kernel, tenant, shape));
            }
            if let Some(ticket) = ctx.bound.start_ticket(tenant, &shape) {
                let priority = StartPriority::new(Priority::Foreground, &ctx.cfg.kernel.cgroup_root);
                let start =
                    start_kernel(ctx.docker.clone(), ctx.cfg.kernel.clone(), spec.clone(), ctx.cfg.sandbox_start_tries, ctx.metrics.clone(), priority.clone());
                starting = Some((tokio::spawn(start), priority, ticket));
            }
        }
        match starting.as_mut() {
            Some((handle, _, _)) => tokio::select! {
                started = handle => {
                    let kernel = started.context("the sandbox start was lost")??;
                    ctx.bound.count_new();
                    return Ok(Bound::new(kernel, tenant, shape));
                }
                () = &mut returned => {}
            },
            // Another job's start is in flight: a return, or its end, wakes this one.
            None => returned.await,
        }
    }
}

/// A kernel for `spec`: a warm one when the pool has one of that shape, else a fresh one. A
/// sandbox that fails to start (it died, or never became ready) is replaced by a fresh one up
/// to `SANDCELL_SANDBOX_START_TRIES` times before the error is final (`sandbox_unavailable`).
/// The caller holds a slot while it waits (the slot rule, above).
pub async fn kernel_for(ctx: &WorkerContext, spec: &SandboxSpec, _slot: &Slot) -> Result<Kernel> {
    if let Some(k) = ctx.pool.take(&spec.shape()) {
        return Ok(k);
    }
    let priority = StartPriority::new(Priority::Foreground, &ctx.cfg.kernel.cgroup_root);
    start_kernel(ctx.docker.clone(), ctx.cfg.kernel.clone(), spec.clone(), ctx.cfg.sandbox_start_tries, ctx.metrics.clone(), priority).await
}

/// Start a kernel for `spec` at `priority` (a job waits for it, unless the job sends it to the
/// background), replacing one that fails to start up to `tries` times while a job waits for it.
/// Owns its arguments, so it can run on as a task of its own.
async fn start_kernel(
    docker: bollard::Docker,
    settings: crate::kernel::KernelSettings,
    spec: SandboxSpec,
    tries: u32,
    metrics: crate::metrics::Metrics,
    priority: StartPriority,
) -> Result<Kernel> {
    let mut attempt = 1;
    loop {
        match Kernel::start(&docker, &settings, &spec, &priority).await {
            Ok(k) => {
                k.count_start(&metrics);
                return Ok(k);
            }
            // A start no job waits for any more is not tried again: on a machine busy enough to
            // starve it, another would fare no better.
            Err(e) if attempt < tries && priority.get() == Priority::Foreground => {
                tracing::warn!(attempt, tries, error = format!("{e:#}"), "a sandbox failed to start; starting a fresh one");
                metrics.sandbox_start_retries.inc();
                attempt += 1;
            }
            Err(e) => return Err(e.context(format!("the sandbox failed to start {tries} times"))),
        }
    }
}

/// Store the outcome's files and commit the result (with retries). An error means nothing was
/// committed: the delivery must stay unacked.
pub async fn commit(ctx: &WorkerContext, job: &ExecutionJob, limits: &ExecutionLimits, mut o: Outcome, extras: Extras) -> Result<JobStatus> {
    // The tenant's artifact quota: figures and files beyond what it may still store are
    // skipped and reported. The bytes are reserved before the upload, so the tenant's jobs
    // committing at the same moment cannot together store more than the quota.
    let max_key = ctx.cfg.services.s3.max_key_bytes;
    o.skip_unstorable(|path| sandcell_core::store::artifact_key_fits(&job.tenant, &job.job_id, path, max_key));
    let wanted = o.artifact_bytes();
    if wanted > 0 {
        let (tenant, job_id) = (job.tenant.as_str(), job.job_id.as_str());
        let granted =
            with_db_retries(tenant, job_id, "reserving the tenant's artifact bytes", |_| ctx.tenants.reserve_artifact_bytes(tenant, job_id, wanted)).await?;
        o.keep_within_quota(granted);
    }
    o.settle_display_paths();
    let (mut fin, files, outputs) = o.into_finished(extras);
    match crate::artifacts::store_all(&ctx.store, &job.tenant, &job.job_id, limits, files, outputs).await {
        Ok(stored) => {
            fin.execution.outputs = stored.outputs;
            fin.artifacts = stored.artifacts;
        }
        Err(e) => {
            tracing::error!(tenant = %job.tenant, job_id = %job.job_id, error = format!("{e:#}"), "storing artifacts failed");
            fin.status = JobStatus::InfrastructureError;
            fin.reason = Some(Reason::new(ErrorCode::StorageFailed, format!("{e:#}")));
        }
    }
    let (tenant, job_id) = (job.tenant.as_str(), job.job_id.as_str());
    let mut status = fin.status;
    let committed = match commit_with_retries(ctx, tenant, job_id, &fin).await {
        Ok(c) => c,
        Err(e) if sandcell_core::jobs::is_permanent(&e) => {
            // The database refused this result as it is (it was never meant to): record the
            // job's end with its own error rather than rerun it or stall the worker.
            tracing::error!(tenant, job_id, error = format!("{e:#}"), "the database refused a result; recording result_not_storable");
            let reason = Reason::new(ErrorCode::ResultNotStorable, format!("the result could not be stored ({status} as run): {e:#}"));
            let fallback = Finished::bare(JobStatus::InfrastructureError, reason, fin.container_id.clone(), fin.session.clone());
            status = fallback.status;
            commit_with_retries(ctx, tenant, job_id, &fallback).await?
        }
        Err(e) => return Err(e),
    };
    if !committed {
        tracing::warn!(tenant, job_id, "job was finished elsewhere; this result is discarded");
    }
    ctx.metrics.jobs.with_label_values(&[status.as_str()]).inc();
    Ok(status)
}

/// Commit a result, retrying transient failures (the database restarting) for about two
/// minutes (an outage of the database for as long as it lasts); a permanent refusal is returned
/// at once.
async fn commit_with_retries(ctx: &WorkerContext, tenant: &str, job_id: &str, fin: &Finished) -> Result<bool> {
    with_db_retries(tenant, job_id, "committing a result", |_| ctx.jobs.finish(tenant, job_id, fin)).await
}

/// Run a database step of a job (its claim, its refusal, its commit) until it succeeds, fails
/// permanently, or has failed [`DB_TRIES`] times for another reason than an outage of the
/// database (`jobs::is_unavailable`: retried for as long as the outage lasts, since the job is
/// not at fault and returning it to the queue would only bring it closer to the dead letters);
/// `step` is given the 1-based try number.
async fn with_db_retries<T, F, Fut>(tenant: &str, job_id: &str, what: &str, step: F) -> Result<T>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    sandcell_core::retry_classified(JobStep { what, tenant, job_id }, DB_TRIES, sandcell_core::jobs::failure, step).await
}

/// A job's database step as its retries name it: "<what> of job <tenant>/<job id>".
struct JobStep<'a> {
    what: &'a str,
    tenant: &'a str,
    job_id: &'a str,
}

impl std::fmt::Display for JobStep<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of job {}/{}", self.what, self.tenant, self.job_id)
    }
}

/// Failures of a job's database step, outages of the database aside, before its handler fails
/// and the job's message goes back to the queue (~2 minutes of backoff).
const DB_TRIES: u32 = 30;

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, content: &str) -> InputFile {
        InputFile::inline(path, content.as_bytes())
    }

    #[test]
    fn a_restored_workspace_keeps_the_last_version_of_each_path_and_the_jobs_own_files_win() {
        let restored = vec![file("a.txt", "1"), file("b.txt", "1"), file("a.txt", "2")];
        let own = vec![file("b.txt", "job")];
        let files = with_restored(restored, own);
        let paths: Vec<_> = files.iter().map(|f| (f.path.as_str(), f.content_b64.clone())).collect();
        assert_eq!(paths, vec![("a.txt", file("a.txt", "2").content_b64), ("b.txt", file("b.txt", "job").content_b64)]);
    }

    #[test]
    fn without_a_restored_workspace_the_jobs_files_are_unchanged() {
        let own = vec![file("x", "1"), file("y", "2")];
        assert_eq!(with_restored(Vec::new(), own.clone()), own);
    }
}
