//! The sessions this worker holds, by id: where a job of a held session is handed to that
//! session's task (its mailbox), and how a draining worker asks each to save its variables.
//! The tasks themselves are [`crate::session`]'s; this module only finds them, so that the
//! worker's context can hold the registry without depending on the session code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sandcell_core::jobs::Claim;
use sandcell_protocol::ExecutionJob;
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};

use crate::ledger::Ticket;

/// How many cancelled job ids a session keeps: more than the jobs a client could have queued
/// in it and cancel at once in practice (job ids are never reused, so an old one is harmless).
pub const CANCELS_KEPT: usize = 64;

/// A job on its way to a session, with the ticket to settle once it is committed.
pub struct Work {
    /// The job.
    pub job: ExecutionJob,
    /// Its message's place in the ledger.
    pub ticket: Ticket,
    /// Set when the job was claimed before it reached the session (the opening job).
    pub claim: Option<Claim>,
    /// Where the job's code and inline input files wait for its turn ([`Registry::deliver`]).
    pub inputs: Inputs,
}

impl Work {
    /// A job with its inputs in hand (not yet in a mailbox).
    pub fn new(job: ExecutionJob, ticket: Ticket, claim: Option<Claim>) -> Self {
        Work { job, ticket, claim, inputs: Inputs::InHand }
    }
}

/// A session job's place in its session's window: the jobs of one session this worker holds on
/// unacked messages of its queue ([`crate::config::Config::session_window`]).
///
/// Why: a worker's queue is shared by all its sessions, and the broker delivers it in order,
/// at most `SANDCELL_SESSION_PREFETCH` (256) unacked at a time. One tenant's session running a
/// slow cell, fed 300 jobs, took the whole prefetch with them: every other session on the
/// worker, other tenants' included, waited for that slow cell before its next job was even
/// delivered, and so did the tenant's own cancel of it. Now a session holds at most its window
/// on messages; its later jobs are acked as they arrive and wait as if read back after a
/// reconnect (Postgres keeps every session job as routed, `jobs.routed`), their inputs in the
/// mailbox within the budget like any waiting job's ([`Inputs`]). The sessions held take at
/// most `max_sessions × window` of the prefetch, so a job of any other session is delivered at
/// once. What a worker holds of its waiting jobs is then bounded by the budget, plus a stub of
/// each (well under 1 KiB) for as many as its sessions' tenants may queue (`max_queued_jobs`).
pub enum WindowPlace {
    /// Taken: the job's ticket holds it until the job is settled.
    Taken(OwnedSemaphorePermit),
    /// The session holds its window's worth: the job's message is acked on arrival.
    Full,
    /// Not a session this worker holds for that tenant: the job is refused, or follows it.
    NotHeld,
}

/// Where a job's inputs (code, inline files, environment, …) are while it waits in a session's
/// mailbox.
///
/// Why: a worker takes up to `SANDCELL_SESSION_PREFETCH` (256) session jobs from its queue, each
/// up to 16 MiB, and its sessions' mailboxes held them all: one tenant's session running a slow
/// cell, fed 20 jobs of 10 MiB of inline files, made the worker hold ~500 MiB and, in a pod,
/// killed it with every other tenant's sessions on it. Now a mailbox holds a job's inputs only
/// while all the worker's waiting jobs' inputs fit `SANDCELL_WORKER_HELD_INPUT_BYTES`; beyond
/// that they stay in Postgres (`jobs.routed`, kept for every session job) and are read back when
/// the job's turn comes.
pub enum Inputs {
    /// With the job, not counted (not yet delivered to a mailbox).
    InHand,
    /// With the job, counted against the budget until the job is done with (the bytes are only
    /// held, for their `Drop`).
    Held(#[allow(dead_code)] HeldBytes),
    /// Left out of the job (its code empty, its inline files without content): read back.
    InPostgres,
}

/// Bytes counted against the worker's budget for inputs held in mailboxes, given back when
/// dropped (the job ran, or was refused).
pub struct HeldBytes {
    bytes: u64,
    total: Arc<AtomicU64>,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// The bytes a waiting job holds beyond its stub: its code, its input files (base64 as held,
/// paths and keys), the files it asks for, its environment and its context. A job carries up to
/// 16 MiB of code and files but also 64 KiB of environment and 64 KiB of paths asked for; with a
/// session's backlog past its window in the mailbox, those counted too.
fn input_bytes(job: &ExecutionJob) -> u64 {
    let files: usize = job.files.iter().map(|f| f.path.len() + f.content_b64.as_ref().map_or(0, String::len) + f.s3_key.as_ref().map_or(0, String::len)).sum();
    let asked: usize = job.get_files.iter().map(String::len).sum();
    let env: usize = job.env.iter().map(|(k, v)| k.len() + v.len()).sum();
    (job.code.len() + files + asked + env + job.context.as_ref().map_or(0, String::len)) as u64
}

/// Reduce `job` to its stub (its ids, session, language, flags and limits): nothing
/// [`input_bytes`] counts. The rest — code, files, `get_files`, environment, context — is read
/// back from Postgres, the whole job as routed, when its turn comes (`SessionTask::step`).
fn keep_stub(job: &mut ExecutionJob) {
    job.code = String::new();
    job.files = Vec::new();
    job.get_files = Vec::new();
    job.env = Default::default();
    job.context = None;
}

/// Reserve `bytes` of `budget` in `total`, unless they do not fit (then nothing is reserved).
fn reserve(total: &Arc<AtomicU64>, budget: u64, bytes: u64) -> Option<HeldBytes> {
    total
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| held.checked_add(bytes).filter(|n| *n <= budget))
        .ok()
        .map(|_| HeldBytes { bytes, total: total.clone() })
}

/// What reaches a session's task.
pub enum Mail {
    /// A job to run (boxed: a job is far larger than a snapshot request).
    Job(Box<Work>),
    /// Save the session's variables to the store before it moves (a draining worker); the
    /// task answers once it is done (or could not).
    Snapshot(oneshot::Sender<()>),
}

struct Entry {
    tenant: String,
    mailbox: mpsc::UnboundedSender<Mail>,
    /// The session's places on unacked messages ([`WindowPlace`]).
    window: Arc<Semaphore>,
    /// The session's jobs cancelled last (at most [`CANCELS_KEPT`]): its running job, and each
    /// job as it starts, reads them (see [`crate::kernel::Kernel::run`]).
    cancel: watch::Sender<Vec<String>>,
}

/// The sessions this worker holds, cheap to clone.
#[derive(Clone)]
pub struct Registry {
    map: Arc<Mutex<HashMap<String, Entry>>>,
    /// Bytes of inputs held by jobs in mailboxes, and the most they may be.
    held_inputs: Arc<AtomicU64>,
    input_budget: u64,
    /// Places of each session's window ([`WindowPlace`]).
    window: usize,
    /// `sandcell_worker_inputs_left_in_postgres_total`.
    left_in_postgres: prometheus::IntCounter,
}

impl Registry {
    /// An empty registry whose mailboxes hold at most `input_budget` bytes of jobs' inputs,
    /// counting in `left_in_postgres` the jobs whose inputs did not fit, and whose sessions
    /// each hold at most `window` jobs on unacked messages.
    pub fn new(input_budget: u64, window: usize, left_in_postgres: prometheus::IntCounter) -> Self {
        Registry { map: Arc::default(), held_inputs: Arc::default(), input_budget, window: window.max(1), left_in_postgres }
    }

    /// A place in the window of the session `job` names ([`WindowPlace`]).
    pub fn window_place(&self, job: &ExecutionJob) -> WindowPlace {
        let Some(session) = job.session.as_ref() else { return WindowPlace::NotHeld };
        let Ok(map) = self.map.lock() else { return WindowPlace::NotHeld };
        match map.get(&session.id) {
            Some(e) if e.tenant == job.tenant => match e.window.clone().try_acquire_owned() {
                Ok(place) => WindowPlace::Taken(place),
                Err(_) => WindowPlace::Full,
            },
            _ => WindowPlace::NotHeld,
        }
    }

    /// Hand `work` to the session it names, its inputs held or left in Postgres ([`Inputs`]).
    /// Gives the work back when this worker does not hold that session for that tenant.
    pub fn deliver(&self, mut work: Work) -> Result<(), Box<Work>> {
        let Some(session) = work.job.session.as_ref() else { return Err(Box::new(work)) };
        let Ok(map) = self.map.lock() else { return Err(Box::new(work)) };
        match map.get(&session.id) {
            Some(e) if e.tenant == work.job.tenant => {
                if matches!(work.inputs, Inputs::InHand) {
                    let bytes = input_bytes(&work.job);
                    work.inputs = match reserve(&self.held_inputs, self.input_budget, bytes) {
                        Some(held) => Inputs::Held(held),
                        None => {
                            tracing::info!(tenant = %work.job.tenant, job_id = %work.job.job_id, bytes, "inputs of a waiting job left in Postgres: the worker holds its budget");
                            self.left_in_postgres.inc();
                            keep_stub(&mut work.job);
                            Inputs::InPostgres
                        }
                    };
                }
                match e.mailbox.send(Mail::Job(Box::new(work))) {
                    Err(mpsc::error::SendError(Mail::Job(w))) => Err(w),
                    // Sent (a snapshot request is never what comes back here).
                    _ => Ok(()),
                }
            }
            _ => Err(Box::new(work)),
        }
    }

    /// Ask every session held here to save its variables (a draining worker, its jobs done);
    /// resolves when each has answered.
    pub async fn snapshot_all(&self) {
        let waits: Vec<oneshot::Receiver<()>> = match self.map.lock() {
            Ok(map) => map
                .values()
                .filter_map(|e| {
                    let (tx, rx) = oneshot::channel();
                    e.mailbox.send(Mail::Snapshot(tx)).ok().map(|()| rx)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        futures::future::join_all(waits).await;
    }

    /// Number of sessions held.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn insert(&self, id: &str, tenant: &str, mailbox: mpsc::UnboundedSender<Mail>, cancel: watch::Sender<Vec<String>>) {
        if let Ok(mut m) = self.map.lock() {
            let window = Arc::new(Semaphore::new(self.window));
            m.insert(id.to_string(), Entry { tenant: tenant.to_string(), mailbox, window, cancel });
        }
    }

    /// Ask `tenant`'s session `session_id` to stop job `job_id`: interrupted if it is running,
    /// or as it starts if it is the next. Whether this worker holds that session.
    pub fn cancel(&self, tenant: &str, session_id: &str, job_id: &str) -> bool {
        let Ok(map) = self.map.lock() else { return false };
        match map.get(session_id) {
            Some(e) if e.tenant == tenant => {
                e.cancel.send_modify(|ids| {
                    if ids.len() >= CANCELS_KEPT {
                        ids.remove(0);
                    }
                    ids.push(job_id.to_string());
                });
                true
            }
            _ => false,
        }
    }

    pub fn remove(&self, id: &str) {
        if let Ok(mut m) = self.map.lock() {
            m.remove(id);
        }
    }
}

#[cfg(test)]
mod held_input_tests {
    use super::*;

    #[test]
    fn a_waiting_jobs_environment_and_paths_count_against_the_budget_and_its_stub_holds_none() {
        let mut job = ExecutionJob {
            tenant: "acme".into(),
            job_id: "j1".into(),
            language: sandcell_protocol::Language::Python,
            code: "x".repeat(10),
            files: vec![
                sandcell_protocol::InputFile::inline("a.csv", b"abc"),
                sandcell_protocol::InputFile { path: "b".into(), content_b64: None, s3_key: Some("acme/_uploads/k".into()) },
            ],
            limits: sandcell_protocol::LimitPolicy::default().default,
            session: None,
            get_files: vec!["out.png".into()],
            list_files: true,
            env: [("K".to_string(), "v".repeat(65_000))].into(),
            context: Some("ctx".into()),
        };
        assert_eq!(input_bytes(&job), 10 + (5 + 4) + (1 + 15) + 7 + (1 + 65_000) + 3);
        keep_stub(&mut job);
        assert_eq!(input_bytes(&job), 0, "{job:?}");
        assert_eq!((job.tenant.as_str(), job.job_id.as_str(), job.list_files), ("acme", "j1", true), "the stub keeps the job's ids and flags");
    }

    #[test]
    fn inputs_are_held_while_they_fit_the_budget_and_given_back_when_dropped() {
        let total = Arc::new(AtomicU64::new(0));
        let a = reserve(&total, 100, 60).expect("60 of 100 fits");
        assert!(reserve(&total, 100, 50).is_none(), "60 + 50 is over 100");
        let b = reserve(&total, 100, 40).expect("60 + 40 fits exactly");
        assert_eq!(total.load(Ordering::Relaxed), 100);
        drop(a);
        assert_eq!(total.load(Ordering::Relaxed), 40);
        let c = reserve(&total, 100, 50).expect("40 + 50 fits once the first is given back");
        drop((b, c));
        assert_eq!(total.load(Ordering::Relaxed), 0);
        assert!(reserve(&total, 100, u64::MAX).is_none(), "an overflow never fits");
    }
}
