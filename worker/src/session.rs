//! Sessions on this worker: one task per session it holds (found through [`crate::registry`])
//! that owns its kernel, runs its jobs one at a time in arrival order, and ends it.
//!
//! Invariants:
//! - a session is in the registry from just before its binding in Postgres until just after it
//!   is ended there, so every job the scheduler routes here while it is `active` finds it;
//! - only the session's task touches its kernel; jobs reach the task through its mailbox, in the
//!   order the worker's queue delivered them (the scheduler published them in submission order);
//! - the keep-alive timer runs only while the mailbox is empty: a job waiting to run is never
//!   refused because the session expired under it;
//! - when the task ends, jobs still in its mailbox are refused with the session's final reason,
//!   and the container and its workspace are destroyed.

use std::time::Duration;

use anyhow::{Context, Result};
use sandcell_core::jobs::SessionTouch;
use sandcell_protocol::{ErrorCode, ExecutionJob, ExecutionLimits, InputFile, JobStatus, Reason, SessionMove, SessionState};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::context::{Slot, WorkerContext};
use crate::kernel::{CellRun, Kernel, OnTimeout};
use crate::ledger::{self, Disposition};
use crate::outcome::{Extras, Outcome};
use crate::registry::{Inputs, Mail, Work};
use crate::run;
use crate::sandbox::container::SandboxSpec;

/// Why a session's task stopped.
enum End {
    Expired,
    Closed,
    Lost(Reason),
}

/// Open the session `work.job` asks for and run the job in it. `work` is already claimed;
/// `permit` is the session's place in this worker's capacity, released when it ends.
pub async fn open(ctx: WorkerContext, work: Work, permit: OwnedSemaphorePermit) {
    let Work { job, ticket, claim, inputs } = work;
    let disposition = match bind_new(&ctx, &job, permit).await {
        Ok(Opened::Task(task, rx)) => {
            tokio::spawn((*task).run(Work { job, ticket, claim, inputs }, rx));
            return;
        }
        Ok(Opened::Refused) => Disposition::Ack,
        Err(e) => ledger::disposition_of(&job, Err(e.context("opening the session"))).await,
    };
    ticket.settle(disposition).await;
}

enum Opened {
    /// The session is bound here; its task runs the opening job. (Boxed: a task holds its
    /// kernel, far larger than the refusal.)
    Task(Box<SessionTask>, mpsc::UnboundedReceiver<Mail>),
    /// The job was refused (no sandbox, or the session ended meanwhile) and that is recorded.
    Refused,
}

/// Start the session's kernel and bind the session to this worker.
async fn bind_new(ctx: &WorkerContext, job: &ExecutionJob, permit: OwnedSemaphorePermit) -> Result<Opened> {
    let Some(session) = job.session.clone() else { anyhow::bail!("open called for a job without a session") };
    let limits = ctx.cfg.policy.cap(&job.limits);
    let spec = run::spec_for(ctx, job, &limits);
    // A session taken over: its workspace as the store has it, read before a container exists.
    let restore = match &session.adopt {
        Some(_) => Some(crate::moving::restore_workspace(ctx, job).await?),
        None => None,
    };
    // The slot that starts the container is kept for the opening job (`Host::held_slot`).
    let slot = ctx.slot().await?;
    let started = run::kernel_for(ctx, &spec, &slot).await;
    let kernel = match started {
        Ok(k) => k,
        Err(e) => {
            let reason = Reason::new(ErrorCode::SandboxUnavailable, format!("{e:#}"));
            if session.adopt.is_some() {
                ctx.sessions.end_adoption(&session.id, &job.job_id, &reason).await?;
            } else {
                ctx.sessions.end(&session.id, None, SessionState::Failed, Some(&reason)).await?;
            }
            run::commit(ctx, job, &limits, Outcome::new(&limits).infra(reason.code, reason.message.clone()), Extras::default()).await?;
            return Ok(Opened::Refused);
        }
    };
    // In the registry before it is active in Postgres: a job routed here finds it.
    let (tx, rx) = mpsc::unbounded_channel();
    let (cancel_tx, cancel) = tokio::sync::watch::channel(Vec::new());
    ctx.registry.insert(&session.id, &job.tenant, tx, cancel_tx);
    let container = kernel.id().to_string();
    let bound = match &session.adopt {
        // Tried again like a job's claim (an outage for as long as it lasts), rather than the
        // opening job refused for a blip: a bind may be repeated (an active session whose opening
        // job is this one binds again), so a try whose answer was lost does no harm.
        None => sandcell_core::retry_classified("binding the session", 6, sandcell_core::jobs::failure, |_| {
            ctx.sessions.bind(&session.id, &job.job_id, &ctx.cfg.worker_id, &container)
        })
        .await
        .map(|b| b.then_some(None)),
        // Repeatable the same way (the same job, worker and container take it over again).
        Some(_) => sandcell_core::retry_classified("taking the session over", 6, sandcell_core::jobs::failure, |_| {
            ctx.sessions.adopt(&session.id, &job.job_id, &ctx.cfg.worker_id, &container)
        })
        .await
        .map(|a| a.map(Some)),
    };
    let adopted = match bound {
        Ok(Some(adopted)) => adopted,
        Ok(None) | Err(_) => {
            ctx.registry.remove(&session.id);
            kernel.destroy().await;
            // Bound after all, should the database's answer have been lost: without its kernel
            // it cannot live here (this matches only a session bound to this worker).
            let unbound = Reason::new(ErrorCode::SessionLost, "the session could not be bound to this worker");
            if let Err(e) = ctx.sessions.end(&session.id, Some(&ctx.cfg.worker_id), SessionState::Lost, Some(&unbound)).await {
                tracing::warn!(session_id = %session.id, error = format!("{e:#}"), "could not make sure a session that failed to bind is not left bound here");
            }
            let state = ctx.sessions.state(&job.tenant, &session.id).await.ok().flatten();
            let reason = state
                .and_then(|s| s.refusal(&session.id))
                .unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, "the session could not be bound to this worker"));
            run::refuse(ctx, job, &reason).await?;
            return Ok(Opened::Refused);
        }
    };
    ctx.metrics.sessions.inc();
    let keep_alive_s = adopted.as_ref().map_or(session.keep_alive_s, |a| a.keep_alive_s);
    let mut kernel = kernel;
    let (restore, moved) = match (restore, adopted) {
        (Some((mut files, mut missing)), Some(a)) => {
            // The variables a drain saved, loaded with the files before the first job here
            // (without a snapshot the files go with that job).
            let mut files_restored = u32::try_from(files.len()).unwrap_or(u32::MAX);
            let (variables_restored, variables_lost) = match &a.snapshot {
                None => (false, vec!["*".to_string()]),
                Some(snapshot) => match crate::moving::fetch_snapshot(ctx, snapshot).await {
                    // The pickle is written to the workspace too: when it does not fit beside the
                    // files, the files come back (with the first job) and the variables do not.
                    Ok(pickle) if !crate::moving::fits(&files, pickle.len(), ctx.cfg.policy.cap(&job.limits).workspace_mb) => {
                        tracing::warn!(session_id = %session.id, pickle_bytes = pickle.len(), "the saved variables do not fit in the workspace beside its files; left out");
                        (false, vec!["*".to_string()])
                    }
                    Ok(pickle) => {
                        let paths: Vec<String> = files.iter().map(|f| f.path.clone()).collect();
                        let r = crate::moving::restore(ctx, &mut kernel, job, std::mem::take(&mut files), snapshot, pickle).await;
                        if !r.files {
                            files_restored = 0;
                            missing.extend(paths);
                        }
                        (r.variables, r.lost)
                    }
                    Err(e) => {
                        tracing::warn!(session_id = %session.id, error = format!("{e:#}"), "the saved variables of a moved session could not be read");
                        (false, vec!["*".to_string()])
                    }
                },
            };
            // A snapshot is for this move only: used or not, its object goes.
            if let Some(snapshot) = &a.snapshot {
                crate::moving::discard_snapshot(ctx, &snapshot.key).await;
            }
            ctx.metrics.sessions_adopted.with_label_values(&[a.cause.as_str()]).inc();
            tracing::info!(tenant = %job.tenant, session_id = %session.id, from_worker = %a.from_worker, cause = a.cause.as_str(),
                files = files_restored, missing = missing.len(), variables_restored, container = %kernel.id(), "session taken over");
            let moved = SessionMove { from_worker: a.from_worker, cause: a.cause, files_restored, files_missing: missing, variables_restored, variables_lost };
            (files, Some(moved))
        }
        _ => {
            tracing::info!(tenant = %job.tenant, session_id = %session.id, keep_alive_s, container = %kernel.id(), "session opened");
            (Vec::new(), None)
        }
    };
    let task = SessionTask {
        id: session.id.clone(),
        tenant: job.tenant.clone(),
        keep_alive: Duration::from_secs(keep_alive_s.max(1)),
        restore,
        moved,
        spec,
        kernel: Some(kernel),
        opening_slot: Some(slot),
        end: None,
        cancel,
        ctx: ctx.clone(),
        _permit: permit,
    };
    Ok(Opened::Task(Box::new(task), rx))
}

struct SessionTask {
    id: String,
    tenant: String,
    keep_alive: Duration,
    spec: SandboxSpec,
    kernel: Option<Kernel>,
    /// The slot its container started under, until the opening job takes it.
    opening_slot: Option<Slot>,
    /// A taken-over session's workspace, written before its first job here.
    restore: Vec<InputFile>,
    /// What the first job here reports of the move.
    moved: Option<SessionMove>,
    /// Set by the job that ends the session (it closed it, or its kernel could not be replaced).
    end: Option<End>,
    /// The job a client asked to cancel ([`crate::registry::Registry::cancel`]).
    cancel: tokio::sync::watch::Receiver<Vec<String>>,
    ctx: WorkerContext,
    _permit: OwnedSemaphorePermit,
}

/// A session's job runs in the session's kernel: interrupted at the deadline so that it keeps
/// its variables, and replaced when it dies.
impl run::Host for SessionTask {
    fn on_timeout(&self, ctx: &WorkerContext) -> OnTimeout {
        OnTimeout::Interrupt(ctx.cfg.kernel.interrupt_grace)
    }

    fn fresh(&self) -> bool {
        false
    }

    fn cancel_signal(&self) -> Option<tokio::sync::watch::Receiver<Vec<String>>> {
        Some(self.cancel.clone())
    }

    fn held_slot(&mut self) -> Option<Slot> {
        self.opening_slot.take()
    }

    fn restored(&self) -> &[InputFile] {
        &self.restore
    }

    fn take_restored(&mut self) -> Vec<InputFile> {
        std::mem::take(&mut self.restore)
    }

    async fn kernel(&mut self, _ctx: &WorkerContext, _job: &ExecutionJob, _limits: &ExecutionLimits, _slot: &Slot) -> Result<&mut Kernel> {
        let id = &self.id;
        self.kernel.as_mut().ok_or_else(|| anyhow::anyhow!("session {id} has no kernel"))
    }

    async fn after(&mut self, ctx: &WorkerContext, job: &ExecutionJob, cell: CellRun) -> (Outcome, Extras) {
        let close = job.session.as_ref().is_some_and(|s| s.close);
        // A new keep-alive asked by this job (set_timeout): the session's clock from now on.
        let keep_alive_s = job.session.as_ref().filter(|s| !s.new && s.keep_alive_s > 0).map(|s| s.keep_alive_s);
        if let Some(k) = keep_alive_s {
            self.keep_alive = Duration::from_secs(k);
        }
        let mut outcome = cell.outcome;
        let container_id = self.kernel.as_ref().map(|k| k.id().to_string());
        let mut extras = Extras {
            kernel_restarted: false,
            container_id,
            session: Some(SessionTouch { id: self.id.clone(), close, keep_alive_s }),
            moved: self.moved.take(),
        };
        self.end = close.then_some(End::Closed);
        if cell.alive {
            return (outcome, extras);
        }
        let why = match outcome.status {
            JobStatus::OomKilled => "the kernel ran out of memory".to_string(),
            JobStatus::TimedOut => format!("the cell did not stop within {:?} of the interrupt and the kernel was killed", ctx.cfg.kernel.interrupt_grace),
            _ => format!("the kernel died (exit code {:?})", outcome.exit_code),
        };
        if close {
            if let Some(k) = self.kernel.take() {
                k.destroy().await;
            }
            return (outcome, extras);
        }
        match self.restart().await {
            Ok(container) => {
                extras.kernel_restarted = true;
                extras.container_id = Some(container);
                outcome.reason =
                    Some(Reason::new(ErrorCode::KernelRestarted, format!("{why}; it was restarted: variables, imports and workspace files are gone")));
            }
            Err(e) => {
                let reason = Reason::new(ErrorCode::SessionLost, format!("{why}, and no new kernel could be started: {e:#}"));
                outcome.reason = Some(reason.clone());
                extras.session = None;
                self.end = Some(End::Lost(reason));
            }
        }
        (outcome, extras)
    }
}

/// A waiting job whose inputs were left in Postgres (`registry::Inputs::InPostgres`), whole
/// again: its execution job as it was routed, read back (tried again like a claim through an
/// outage of the database). `None` when the job is no longer queued.
async fn read_back_inputs(ctx: &WorkerContext, job: &ExecutionJob) -> Result<Option<ExecutionJob>> {
    let routed =
        sandcell_core::retry_classified("reading a job's inputs back", 6, sandcell_core::jobs::failure, |_| ctx.jobs.routed_job(&job.tenant, &job.job_id))
            .await?;
    let Some(routed) = routed else { return Ok(None) };
    let whole: ExecutionJob = serde_json::from_slice(&routed).context("decoding a job's kept execution job")?;
    anyhow::ensure!(whole.tenant == job.tenant && whole.job_id == job.job_id, "the kept execution job names another job");
    Ok(Some(whole))
}

impl SessionTask {
    async fn run(mut self, first: Work, mut mailbox: mpsc::UnboundedReceiver<Mail>) {
        let mut end = self.step(first).await;
        let mut deadline = tokio::time::Instant::now() + self.keep_alive;
        while end.is_none() {
            tokio::select! {
                biased;
                mail = mailbox.recv() => match mail {
                    Some(Mail::Job(work)) => {
                        end = self.step(*work).await;
                        deadline = tokio::time::Instant::now() + self.keep_alive;
                    }
                    Some(Mail::Snapshot(done)) => {
                        self.snapshot().await;
                        let _ = done.send(());
                    }
                    None => end = Some(End::Lost(Reason::new(ErrorCode::SessionLost, "the worker is shutting down"))),
                },
                _ = tokio::time::sleep_until(deadline) => end = Some(End::Expired),
            }
        }
        let end = end.unwrap_or(End::Expired);
        self.finish(end, mailbox).await;
    }

    /// Run one job and settle its message. The job's database steps are tried again in place
    /// (through an outage of the database for as long as it lasts), so the session's later jobs
    /// wait behind it and its cells run in order. A job that failed even so (nothing committed) goes back to the
    /// queue and leaves the session as it was: its redelivery runs here again.
    async fn step(&mut self, work: Work) -> Option<End> {
        // The held inputs' bytes are given back once the job is done with (`inputs` dropped at
        // the end of this step).
        let Work { job, ticket, claim, inputs } = work;
        let ctx = self.ctx.clone();
        let job = if matches!(inputs, Inputs::InPostgres) {
            match read_back_inputs(&ctx, &job).await {
                Ok(Some(job)) => job,
                // No longer queued (ended meanwhile: stuck, or a copy of a job that ran): there
                // is nothing to run, as a claim would have found.
                Ok(None) => {
                    tracing::info!(tenant = %job.tenant, job_id = %job.job_id, "a waiting job whose inputs were left in Postgres is no longer queued; dropped");
                    ticket.settle(Disposition::Ack).await;
                    return None;
                }
                Err(e) => {
                    ticket.settle(ledger::disposition_of(&job, Err(e)).await).await;
                    return None;
                }
            }
        } else {
            job
        };
        let result = run::job(&ctx, &job, ticket.arrival, claim, self).await;
        if result.is_err() {
            self.end = None;
        }
        ticket.settle(ledger::disposition_of(&job, result).await).await;
        self.end.take()
    }

    /// Save the session's variables to the store and record it, for the worker that takes the
    /// session over (this one is draining). A failure only means they do not come along.
    async fn snapshot(&mut self) {
        let ctx = self.ctx.clone();
        let Some(kernel) = self.kernel.as_mut() else { return };
        let limits = self.spec.limits.clone();
        let saved = match crate::moving::snapshot(&ctx, kernel, &self.tenant, &self.id, &limits).await {
            Ok(snapshot) => match ctx.sessions.record_snapshot(&self.id, &ctx.cfg.worker_id, &snapshot).await {
                // An earlier snapshot no move used (a drain that did not end in a move) is
                // replaced: its object goes.
                Ok(Some(replaced)) => {
                    if let Some(old) = replaced.filter(|old| *old != snapshot.key) {
                        crate::moving::discard_snapshot(&ctx, &old).await;
                    }
                    Ok(snapshot.variables_lost.len())
                }
                // Not recorded (the session is no longer active here), or not known to be:
                // nothing will read the object.
                recorded => {
                    crate::moving::discard_snapshot(&ctx, &snapshot.key).await;
                    Err(recorded.err().unwrap_or_else(|| anyhow::anyhow!("the session was no longer active on this worker")))
                }
            },
            Err(e) => Err(e),
        };
        match saved {
            Ok(lost) => tracing::info!(session_id = %self.id, lost, "session variables saved for its move"),
            Err(e) => tracing::warn!(session_id = %self.id, error = format!("{e:#}"), "session variables could not be saved; they will not move with it"),
        }
    }

    /// Replace a dead kernel with a fresh one of the same shape; returns its container id.
    async fn restart(&mut self) -> Result<String> {
        if let Some(k) = self.kernel.take() {
            k.destroy().await;
        }
        let kernel = {
            let slot = self.ctx.slot().await?;
            run::kernel_for(&self.ctx, &self.spec, &slot).await?
        };
        let id = kernel.id().to_string();
        self.ctx.sessions.set_container(&self.id, &self.ctx.cfg.worker_id, &id).await?;
        self.ctx.metrics.kernel_restarts.inc();
        tracing::warn!(session_id = %self.id, container = %id, "kernel restarted");
        self.kernel = Some(kernel);
        Ok(id)
    }

    /// End the session: record it, leave the registry, refuse what is still queued, destroy.
    async fn finish(mut self, end: End, mut mailbox: mpsc::UnboundedReceiver<Mail>) {
        let ctx = self.ctx.clone();
        let (state, reason) = match end {
            End::Expired => (SessionState::Expired, None),
            End::Closed => (SessionState::Closed, None),
            End::Lost(r) => (SessionState::Lost, Some(r)),
        };
        // Closed is recorded by the closing job's commit; the others here, first, so that a
        // job routed from now on is refused by the scheduler rather than sent here.
        if state != SessionState::Closed {
            let ended = sandcell_core::retry_classified("ending a session", 6, sandcell_core::jobs::failure, |_| {
                ctx.sessions.end(&self.id, Some(&ctx.cfg.worker_id), state, reason.as_ref())
            })
            .await;
            if let Err(e) = ended {
                tracing::error!(session_id = %self.id, error = format!("{e:#}"), "could not record the end of a session");
            }
        }
        ctx.registry.remove(&self.id);
        mailbox.close();
        let refusal = reason.clone().or_else(|| state.refusal(&self.id)).unwrap_or_else(|| Reason::new(ErrorCode::SessionLost, "session ended"));
        while let Ok(mail) = mailbox.try_recv() {
            let Mail::Job(work) = mail else { continue };
            let work = *work;
            // A refusal that failed is settled by the one rule for failed handlers: a job of an
            // existing session (all a mailbox holds) is dead-lettered, since its worker's queue
            // bounds no returns.
            let refused = run::refuse(&ctx, &work.job, &refusal).await.map(|()| Disposition::Ack);
            let disposition = ledger::disposition_of(&work.job, refused).await;
            work.ticket.settle(disposition).await;
        }
        if let Some(k) = self.kernel.take() {
            k.destroy().await;
        }
        ctx.metrics.sessions.dec();
        tracing::info!(tenant = %self.tenant, session_id = %self.id, %state, "session ended");
    }
}
