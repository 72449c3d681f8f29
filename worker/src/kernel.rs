//! A kernel: one sandbox container whose driver has reported `ready`, and the running of cells
//! in it under a wall clock.
//!
//! A kernel is used for one job (a one-off sandbox) or for many (a session). What happens at
//! the deadline is the caller's choice ([`OnTimeout`]): a one-off kernel is simply killed; a
//! session's kernel is first interrupted (SIGINT → `KeyboardInterrupt`) so that it keeps its
//! variables, and killed only if it does not finish the cell within the grace period.
//! [`Kernel::run`] never fails: every failure becomes an [`Outcome`], and [`CellRun::alive`]
//! says whether the kernel can take another cell.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use bollard::Docker;
use sandcell_protocol::{ErrorCode, ExecutionJob, ExecutionLimits, JobStatus, LimitHit, Reason, Usage};
use tokio::sync::watch;

use crate::events::LiveJob;
use crate::inputs::Resolved;
use crate::outcome::{apply, Outcome, Step};
use crate::sandbox::cgroup::{Cgroup, CpuWeight};
use crate::sandbox::container::SandboxSpec;
use crate::sandbox::driver::{DriverEvent, ExecuteRequest, PrepareRequest, DRIVER_PROTOCOL_VERSION};
use crate::sandbox::Sandbox;

/// Worker-side settings for starting kernels.
#[derive(Debug, Clone)]
pub struct KernelSettings {
    /// `SANDCELL_SANDBOX_IMAGE`: image reference.
    pub image: String,
    /// `SANDCELL_DOCKER_RUNTIME`: OCI runtime (`runc` or `runsc`).
    pub runtime: String,
    /// `SANDCELL_SANDBOX_START_TIMEOUT_MS`: longest wait for the driver's `ready`.
    pub start_timeout: Duration,
    /// `SANDCELL_PRELOAD`: modules a kernel imports before it is ready.
    pub preload: Vec<String>,
    /// `SANDCELL_INTERRUPT_GRACE_MS`: how long an interrupted session cell may take to stop.
    pub interrupt_grace: Duration,
    /// Largest single driver frame ([`crate::sandbox::frames::MAX_FRAME_BYTES`]).
    pub max_frame: usize,
    /// `SANDCELL_CGROUP_ROOT`: the host's cgroup filesystem, for the containers' pids, CPU and memory counters.
    pub cgroup_root: std::path::PathBuf,
    /// `SANDCELL_CHANNEL_DIR`: where the drivers' sockets are made (empty: none, the attach
    /// stream only); must be the same path on the Docker host.
    pub channel_dir: Option<std::path::PathBuf>,
    /// This worker's directory under `channel_dir`, once prepared at start-up
    /// ([`crate::sandbox::channel::ChannelRoot::prepare`]).
    pub channels: Option<crate::sandbox::channel::ChannelRoot>,
}

/// What to do when a cell's wall clock runs out.
#[derive(Debug, Clone, Copy)]
pub enum OnTimeout {
    /// Kill the container (one-off kernels).
    Kill,
    /// Interrupt, then kill if the cell has not stopped after this grace (session kernels).
    Interrupt(Duration),
}

/// How a cell is stopped before it ends by itself.
pub struct Stop {
    /// At its deadline.
    pub on_timeout: OnTimeout,
    /// When a client cancels it: the session's cancel signal, the ids of its jobs cancelled
    /// last (see [`crate::registry::Registry::cancel`]); `None` where a job cannot be cancelled.
    pub cancel: Option<watch::Receiver<Vec<String>>>,
}

impl Stop {
    /// At the deadline only.
    pub fn at_deadline(on_timeout: OnTimeout) -> Self {
        Stop { on_timeout, cancel: None }
    }
}

/// The result of one cell.
#[derive(Debug)]
pub struct CellRun {
    /// What the cell produced.
    pub outcome: Outcome,
    /// The kernel can run another cell (it was not killed and did not die).
    pub alive: bool,
}

/// A started kernel.
pub struct Kernel {
    sandbox: Sandbox,
    cgroup: Cgroup,
    /// Container create → driver ready.
    pub start_time: Duration,
    /// Lowered while the kernel waits in the warm pool (started in the background); given
    /// back by [`Kernel::bring_to_foreground`].
    weight: Option<CpuWeight>,
    /// How it was started.
    priority: Priority,
}

/// Whether a kernel is started for a job waiting now, or ahead of demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A job waits for it: the start competes for CPU as any container does.
    Foreground,
    /// Ahead of demand (the warm pool's refill, or a start its job no longer waits for): the
    /// idle scheduling class where the kernel has it, else a small share of contended CPU
    /// ([`crate::sandbox::cgroup::CpuWeight`]), and four times the start timeout, so running
    /// jobs come first.
    Background,
}

/// A start's priority, which the one waiting for it may lower while it runs: a one-off job
/// that started a sandbox and then took one its tenant returned no longer waits for the start
/// ([`StartPriority::to_background`]); the start goes on, but no longer takes CPU from running
/// jobs. Cheap to clone: the start holds one, its waiter another.
#[derive(Clone)]
pub struct StartPriority {
    inner: Arc<Mutex<PriorityState>>,
}

struct PriorityState {
    priority: Priority,
    cgroup_root: PathBuf,
    /// The container, once created.
    container: Option<String>,
    /// Held while the container runs in the background, until the kernel takes it.
    weight: Option<CpuWeight>,
}

impl StartPriority {
    /// A start at `priority`, whose container's cgroup is under `cgroup_root`.
    pub fn new(priority: Priority, cgroup_root: &Path) -> Self {
        let state = PriorityState { priority, cgroup_root: cgroup_root.to_path_buf(), container: None, weight: None };
        StartPriority { inner: Arc::new(Mutex::new(state)) }
    }

    /// From now on, nobody waits for this start: it yields the CPU to running jobs.
    pub fn to_background(&self) {
        if let Ok(mut s) = self.inner.lock() {
            s.priority = Priority::Background;
            s.lower();
        }
    }

    /// The priority now.
    pub fn get(&self) -> Priority {
        self.inner.lock().map(|s| s.priority).unwrap_or(Priority::Foreground)
    }

    /// The start created its container `id` (a retry, another one: what was lowered of the
    /// last one went with it).
    fn created(&self, id: &str) {
        if let Ok(mut s) = self.inner.lock() {
            s.container = Some(id.to_string());
            s.weight = None;
            s.lower();
        }
    }

    /// The start is over and its kernel waits for a job: it gets its full weight back, whether
    /// it was lowered before its driver was ready or after.
    pub fn end(&self, kernel: &mut Kernel) {
        kernel.bring_to_foreground();
        if let Some(weight) = self.take_weight() {
            weight.restore();
        }
    }

    /// The lowered weight, for the kernel to give back when a job takes it.
    fn take_weight(&self) -> Option<CpuWeight> {
        self.inner.lock().ok().and_then(|mut s| s.weight.take())
    }
}

impl PriorityState {
    /// Lower the container's weight if it runs in the background and was not lowered yet.
    fn lower(&mut self) {
        if let (Priority::Background, Some(id), None) = (self.priority, &self.container, &self.weight) {
            self.weight = CpuWeight::lower(&self.cgroup_root, id);
        }
    }
}

impl Kernel {
    /// Create a container for `spec` and wait for its driver's `ready`, at `priority`.
    pub async fn start(docker: &Docker, settings: &KernelSettings, spec: &SandboxSpec, priority: &StartPriority) -> Result<Kernel> {
        let t0 = Instant::now();
        let mut sandbox = Sandbox::start(docker, spec, settings.max_frame, settings.channels.as_ref()).await?;
        priority.created(sandbox.id());
        // A background start may take four times as long: it yields to running jobs. (So may a
        // start sent to the background while it ran.)
        let mut budget = settings.start_timeout;
        let mut ready = tokio::time::timeout(budget, sandbox.next_event()).await;
        if ready.is_err() && priority.get() == Priority::Background {
            ready = tokio::time::timeout(budget * 3, sandbox.next_event()).await;
            budget *= 4;
        }
        match ready {
            Ok(Ok(Some(DriverEvent::Ready { driver_version, kernel_isolated: true }))) if driver_version == DRIVER_PROTOCOL_VERSION => {
                let cgroup = Cgroup::locate(&settings.cgroup_root, sandbox.id());
                Ok(Kernel { sandbox, cgroup, start_time: t0.elapsed(), weight: priority.take_weight(), priority: priority.get() })
            }
            other => {
                let what = match other {
                    Err(_) => format!("the sandbox did not become ready within {budget:?}"),
                    Ok(Ok(None)) => "the sandbox exited before it was ready".to_string(),
                    Ok(Ok(Some(DriverEvent::Ready { driver_version, .. }))) if driver_version != DRIVER_PROTOCOL_VERSION => format!(
                        "the sandbox image {} speaks driver protocol {driver_version}, this worker {DRIVER_PROTOCOL_VERSION}: build the image that matches the worker",
                        spec.image
                    ),
                    Ok(Ok(Some(DriverEvent::Ready { .. }))) => "the sandbox's driver could not run its kernel under another uid \
                         (was the container started as root with CAP_SETUID and CAP_SETGID?); no job runs there"
                        .to_string(),
                    Ok(Ok(Some(ev))) => format!("the sandbox sent {ev:?} before ready"),
                    Ok(Err(e)) => format!("{e:#}"),
                };
                let diag = sandbox.diagnostics();
                sandbox.destroy().await;
                Err(anyhow!("{what}; driver said: {}", diag.trim()))
            }
        }
    }

    /// Give a kernel started in the background its full CPU weight (a job is about to use it).
    pub fn bring_to_foreground(&mut self) {
        if let Some(weight) = self.weight.take() {
            weight.restore();
        }
    }

    /// Count how this kernel's driver speaks (`sandcell_sandbox_links_total`) and, for a start a
    /// job waited for, its start time (a background start is slow on purpose when the machine
    /// is busy: it would only blur what a waiting job sees).
    pub fn count_start(&self, metrics: &crate::metrics::Metrics) {
        if self.priority == Priority::Foreground {
            metrics.container_start_seconds.observe(self.start_time.as_secs_f64());
        }
        metrics.sandbox_links.with_label_values(&[if self.sandbox.on_socket() { "socket" } else { "attach" }]).inc();
    }

    /// The container id.
    pub fn id(&self) -> &str {
        self.sandbox.id()
    }

    /// Whether its driver is known to be gone, without waiting ([`Sandbox::is_gone`]): asked
    /// of a kernel that waited idle before it is handed a job.
    pub fn is_gone(&mut self) -> bool {
        self.sandbox.is_gone()
    }

    /// Run `job`'s code (with `inputs` already resolved to inline content, dropped once sent)
    /// under `limits`; `fresh`: in a process forked for it, leaving nothing behind (a one-off
    /// job). What each driver event adds to the outcome is published on `live` as it arrives.
    pub async fn run(&mut self, job: &ExecutionJob, inputs: Resolved, limits: &ExecutionLimits, stop: Stop, fresh: bool, live: &mut LiveJob) -> CellRun {
        let Stop { on_timeout, cancel } = stop;
        let mut out = Outcome::new(limits);
        if cancel.as_ref().is_some_and(|rx| rx.borrow().contains(&job.job_id)) {
            // Cancelled before it started: it does not run.
            out.status = JobStatus::Cancelled;
            out.reason = None;
            return CellRun { outcome: out, alive: true };
        }
        let request = ExecuteRequest::new(job, &inputs.files, limits, fresh);
        let meter = self.cgroup.start();
        let sent = match serde_json::to_vec(&request) {
            Ok(payload) => self.sandbox.send(&payload).await,
            Err(e) => Err(e.into()),
        };
        // The files are the sandbox's now: their memory and their part of the fetch budget go
        // back before the cell runs.
        drop(inputs);
        if let Err(e) = sent {
            self.sandbox.kill().await;
            let outcome = out.infra(ErrorCode::DriverProtocol, format!("sending the job to the sandbox: {e:#}"));
            return CellRun { outcome, alive: false };
        }

        // Read before a kill too: a killed container's cgroup disappears.
        let mut reading = None;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(limits.timeout_ms);
        let mut grace_deadline = None;
        let mut alive = true;
        // A cancel of this job ends it as its deadline would: now.
        let mut cancel = cancel;
        let mut cancelled = false;
        let mut deadline = deadline;
        // The driver ignores an interrupt until it has taken the request: a cancel in the first
        // instant interrupts a moment later.
        let interruptible_from = tokio::time::Instant::now() + CANCEL_SETTLE;
        loop {
            let next = tokio::select! {
                next = tokio::time::timeout_at(grace_deadline.unwrap_or(deadline), self.sandbox.next_event()) => next,
                () = cancelled_job(&mut cancel, &job.job_id), if !cancelled && grace_deadline.is_none() => {
                    tracing::info!(job_id = %job.job_id, "cancelled: interrupting the cell");
                    cancelled = true;
                    deadline = deadline.min(interruptible_from.max(tokio::time::Instant::now()));
                    continue;
                }
            };
            match next {
                Err(_) => match (on_timeout, grace_deadline) {
                    (OnTimeout::Interrupt(grace), None) => {
                        self.sandbox.interrupt().await;
                        grace_deadline = Some(tokio::time::Instant::now() + grace);
                    }
                    _ => {
                        reading = Some(self.cgroup.read(&meter));
                        self.sandbox.kill().await;
                        out.status = if cancelled { JobStatus::Cancelled } else { JobStatus::TimedOut };
                        out.reason = None;
                        alive = false;
                        break;
                    }
                },
                Ok(Err(e)) => {
                    reading = Some(self.cgroup.read(&meter));
                    self.sandbox.kill().await;
                    out = out.infra(ErrorCode::DriverProtocol, format!("{e:#}"));
                    alive = false;
                    break;
                }
                Ok(Ok(None)) => {
                    // The driver's output ended without `done`: it was killed or killed itself.
                    reading = Some(self.cgroup.read(&meter));
                    let state = self.sandbox.exit_state().await;
                    out.exit_code = state.exit_code.and_then(|c| i32::try_from(c).ok());
                    if state.oom_killed {
                        out.status = JobStatus::OomKilled;
                        out.reason = None;
                    } else {
                        out.status = JobStatus::Failed;
                        out.reason = Some(Reason::new(
                            ErrorCode::DriverProtocol,
                            format!("the interpreter exited (code {:?}) before the job finished", state.exit_code),
                        ));
                    }
                    alive = false;
                    break;
                }
                Ok(Ok(Some(event))) => match live.observe(&mut out, |out| apply(out, event, job.language, limits)) {
                    Step::More => {}
                    Step::Done => break,
                    Step::Violation => {
                        reading = Some(self.cgroup.read(&meter));
                        self.sandbox.kill().await;
                        alive = false;
                        break;
                    }
                },
            }
        }
        let interrupted = out.error.as_ref().is_some_and(|e| e.ename == "KeyboardInterrupt");
        if grace_deadline.is_some() && alive && (!cancelled || interrupted) {
            // Interrupted in time: the cell ended with KeyboardInterrupt, the kernel lives on.
            // (A cancelled cell that ended by itself meanwhile keeps its own ending.)
            out.status = if cancelled { JobStatus::Cancelled } else { JobStatus::TimedOut };
            out.reason = None;
        }
        let reading = reading.unwrap_or_else(|| self.cgroup.read(&meter));
        if reading.pids_refused.is_some_and(|n| n > 0) {
            out.limits_hit.insert(LimitHit::Pids);
        }
        out.usage = Some(Usage { wall_ms: round3(reading.wall_ms), cpu_ms: reading.cpu_ms.map(round3), peak_memory_bytes: reading.peak_memory_bytes });
        out.settle_limits(limits);
        let diag = self.sandbox.take_diagnostics();
        if !diag.trim().is_empty() {
            tracing::debug!(job_id = %job.job_id, diagnostics = %diag.trim(), "driver diagnostics");
        }
        CellRun { outcome: out, alive }
    }

    /// After a fresh request's `done`: wait up to `within` for the driver's `settled` frame
    /// (the job's process gone and everything it could leave removed) and return whether the
    /// driver vouched for the sandbox. Anything else — another frame, the driver gone, silence
    /// — is a no: the sandbox is then not reused.
    pub async fn settle(&mut self, within: Duration) -> bool {
        let verdict = match self.answer(within, "settled").await {
            Ok(DriverEvent::Settled { reusable: true }) => return true,
            Ok(DriverEvent::Settled { reusable: false }) => "the driver found something of the job left".to_string(),
            Ok(other) => format!("the driver sent {other:?} instead of settled"),
            Err(why) => why,
        };
        self.given_up(&verdict, tracing::Level::INFO, "a one-off sandbox is not reused");
        false
    }

    /// Have a kernel that will run fresh jobs only, and ran none yet, prepare for them now
    /// (the driver's `prepare`: the zygote's one-off preparation and the first job's process),
    /// rather than after its first job; whether it did, within `within`. Anything else is a no:
    /// the sandbox is then not used.
    pub async fn prepare(&mut self, within: Duration) -> bool {
        let sent = match serde_json::to_vec(&PrepareRequest::default()) {
            Ok(request) => self.sandbox.send(&request).await.map_err(|e| format!("{e:#}")),
            Err(e) => Err(format!("encoding the prepare request: {e}")),
        };
        let verdict = match sent {
            Err(why) => why,
            Ok(()) => match self.answer(within, "prepared").await {
                Ok(DriverEvent::Prepared { ready: true }) => return true,
                Ok(DriverEvent::Prepared { ready: false }) => "the kernel did not answer as it was".to_string(),
                Ok(other) => format!("the driver sent {other:?} instead of prepared"),
                Err(why) => why,
            },
        };
        self.given_up(&verdict, tracing::Level::WARN, "a one-off sandbox could not be prepared");
        false
    }

    /// The driver's next frame within `within`, awaited as its `what` answer; why none came.
    async fn answer(&mut self, within: Duration, what: &str) -> Result<DriverEvent, String> {
        match tokio::time::timeout(within, self.sandbox.next_event()).await {
            Ok(Ok(Some(event))) => Ok(event),
            Ok(Ok(None)) => Err(format!("the driver exited before it sent {what}")),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(_) => Err(format!("the driver sent no {what} within {within:?}")),
        }
    }

    /// Log why a one-off sandbox is given up, with what its driver said.
    fn given_up(&mut self, verdict: &str, level: tracing::Level, message: &'static str) {
        let diagnostics = self.sandbox.take_diagnostics();
        let (container, diagnostics) = (self.id(), diagnostics.trim());
        if level == tracing::Level::WARN {
            tracing::warn!(container, verdict, diagnostics, "{message}");
        } else {
            tracing::info!(container, verdict, diagnostics, "{message}");
        }
    }

    /// Remove the container and its workspace.
    pub async fn destroy(self) {
        self.sandbox.destroy().await;
    }
}

/// How long after a request is sent a cancel waits before it interrupts (the driver takes the
/// request within it).
const CANCEL_SETTLE: Duration = Duration::from_millis(100);

/// Resolves when `cancel` names `job_id` (at once if it already does); never without a
/// signal, or once its sender is gone.
async fn cancelled_job(cancel: &mut Option<watch::Receiver<Vec<String>>>, job_id: &str) {
    let Some(rx) = cancel.as_mut() else { return std::future::pending().await };
    loop {
        if rx.borrow_and_update().iter().any(|id| id == job_id) {
            return;
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Milliseconds to the microsecond: the counters are not more precise than that.
fn round3(ms: f64) -> f64 {
    (ms * 1000.0).round() / 1000.0
}
