//! The sessions this worker holds, by id: where a job of a held session is handed to that
//! session's task (its mailbox), and how a draining worker asks each to save its variables.
//! The tasks themselves are [`crate::session`]'s; this module only finds them, so that the
//! worker's context can hold the registry without depending on the session code.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sandcell_core::jobs::Claim;
use sandcell_protocol::ExecutionJob;
use tokio::sync::{mpsc, oneshot, watch};

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
    /// The session's jobs cancelled last (at most [`CANCELS_KEPT`]): its running job, and each
    /// job as it starts, reads them (see [`crate::kernel::Kernel::run`]).
    cancel: watch::Sender<Vec<String>>,
}

/// The sessions this worker holds, cheap to clone.
#[derive(Clone, Default)]
pub struct Registry {
    map: Arc<Mutex<HashMap<String, Entry>>>,
}

impl Registry {
    /// Hand `work` to the session it names. Gives the work back when this worker does not hold
    /// that session for that tenant.
    pub fn deliver(&self, work: Work) -> Result<(), Box<Work>> {
        let Some(session) = work.job.session.as_ref() else { return Err(Box::new(work)) };
        let Ok(map) = self.map.lock() else { return Err(Box::new(work)) };
        match map.get(&session.id) {
            Some(e) if e.tenant == work.job.tenant => match e.mailbox.send(Mail::Job(Box::new(work))) {
                Err(mpsc::error::SendError(Mail::Job(w))) => Err(w),
                // Sent (a snapshot request is never what comes back here).
                _ => Ok(()),
            },
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
            m.insert(id.to_string(), Entry { tenant: tenant.to_string(), mailbox, cancel });
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
