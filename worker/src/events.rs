//! Live output: a running job's stdout, stderr, rich outputs and error, published as they
//! happen for the tenant that submitted it, and its `end` once the result is committed
//! ([`sandcell_protocol::event`] is the contract).
//!
//! Events are a convenience beside the result, never a condition of it: a job never waits for
//! them. Each job's [`LiveJob`] turns what [`crate::outcome::apply`] added to its outcome into
//! events (so they carry exactly what the result keeps, within the same caps) and hands them to
//! one publisher task through a bounded buffer, in order. The publisher sends them to the
//! `sandcell.events` topic exchange on the channel the consumer opened at its last connect,
//! without confirms. A full buffer, or no broker, drops the event, and the drop is counted
//! (`sandcell_worker_events_dropped_total`): the client then sees a gap in `seq` and reads the
//! result from Postgres as it would anyway.

use std::sync::Arc;

use base64::Engine as _;
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel};
use prometheus::IntCounter;
use sandcell_protocol::event::{routing_key, EventBody, JobEvent, EVENTS_EXCHANGE, MAX_INLINE_EVENT_BYTES};
use sandcell_protocol::{ExecutionJob, JobStatus};
use tokio::sync::{mpsc, watch};

use crate::outcome::{Outcome, OutputKind};

/// Events waiting for the publisher, across all jobs of this worker. Beyond it, events drop.
const BUFFER: usize = 4096;

/// One event, encoded, with its routing key.
struct Message {
    key: String,
    body: Vec<u8>,
}

/// The worker's side of live output: cheap to clone, shared by every job.
#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<Message>,
    channel: Arc<watch::Sender<Option<Channel>>>,
    dropped: IntCounter,
}

/// The task that publishes what [`Events`] buffers (run it with [`Publisher::run`]).
pub struct Publisher {
    rx: mpsc::Receiver<Message>,
    channel: watch::Receiver<Option<Channel>>,
    published: IntCounter,
    dropped: IntCounter,
}

impl Events {
    /// The handle, and the publisher task to spawn; `published`/`dropped` count events.
    pub fn new(published: IntCounter, dropped: IntCounter) -> (Events, Publisher) {
        let (tx, rx) = mpsc::channel(BUFFER);
        let (channel_tx, channel_rx) = watch::channel(None);
        let events = Events { tx, channel: Arc::new(channel_tx), dropped: dropped.clone() };
        (events, Publisher { rx, channel: channel_rx, published, dropped })
    }

    /// Publish on `ch` from now on (the consumer's channel of its latest connection).
    pub fn attach(&self, ch: Channel) {
        self.channel.send_replace(Some(ch));
    }

    /// The events of one attempt of `job` (`attempt` 0: a job refused before it ran).
    pub fn job(&self, job: &ExecutionJob, attempt: i32) -> LiveJob {
        let attempt = u32::try_from(attempt).unwrap_or(0);
        LiveJob {
            events: self.clone(),
            key: routing_key(&job.tenant, &job.job_id),
            tenant: job.tenant.clone(),
            job_id: job.job_id.clone(),
            attempt,
            seq: 0,
            muted: false,
        }
    }

    /// A handle that publishes nothing: for the worker's own cells in a session (saving and
    /// restoring its variables when it moves), which are no client's job.
    pub fn muted(&self, job: &ExecutionJob) -> LiveJob {
        LiveJob { muted: true, ..self.job(job, 0) }
    }

    fn send(&self, key: &str, event: &JobEvent) {
        let body = match serde_json::to_vec(event) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "an event could not be encoded; dropped");
                self.dropped.inc();
                return;
            }
        };
        if self.tx.try_send(Message { key: key.to_string(), body }).is_err() {
            self.dropped.inc();
        }
    }
}

impl Publisher {
    /// Publish buffered events, in order, until every [`Events`] handle is gone.
    pub async fn run(mut self) {
        let props = BasicProperties::default().with_content_type("application/json".into()).with_delivery_mode(1);
        while let Some(msg) = self.rx.recv().await {
            let ch = self.channel.borrow().clone();
            let Some(ch) = ch.filter(|c| c.status().connected()) else {
                self.dropped.inc();
                continue;
            };
            match ch.basic_publish(EVENTS_EXCHANGE.into(), msg.key.as_str().into(), BasicPublishOptions::default(), &msg.body, props.clone()).await {
                Ok(_) => self.published.inc(),
                Err(e) => {
                    tracing::debug!(error = %e, "publishing an event failed; dropped");
                    self.dropped.inc();
                }
            }
        }
    }
}

/// What an outcome held before an event was applied to it.
#[derive(Debug, Clone, Copy)]
struct Mark {
    stdout: usize,
    stderr: usize,
    outputs: usize,
    error: bool,
}

/// The events of one attempt of one job, numbered.
pub struct LiveJob {
    events: Events,
    key: String,
    tenant: String,
    job_id: String,
    attempt: u32,
    seq: u64,
    /// Publishes nothing ([`Events::muted`]).
    muted: bool,
}

impl LiveJob {
    /// Apply one change to `out` and publish what it added.
    pub fn observe<T>(&mut self, out: &mut Outcome, change: impl FnOnce(&mut Outcome) -> T) -> T {
        let mark = Mark { stdout: out.stdout.text.len(), stderr: out.stderr.text.len(), outputs: out.outputs.len(), error: out.error.is_some() };
        let result = change(out);
        self.since(mark, out);
        result
    }

    /// Publish what `out` gained since `mark`: text the caps let in, a new rich output, the error.
    fn since(&mut self, mark: Mark, out: &Outcome) {
        if let Some(text) = out.stdout.text.get(mark.stdout..).filter(|t| !t.is_empty()) {
            self.emit(EventBody::Stdout { text: text.to_string() });
        }
        if let Some(text) = out.stderr.text.get(mark.stderr..).filter(|t| !t.is_empty()) {
            self.emit(EventBody::Stderr { text: text.to_string() });
        }
        for raw in out.outputs.iter().skip(mark.outputs) {
            let mut data = raw.text.clone();
            let mut omitted = Vec::new();
            for part in &raw.binary {
                if part.bytes.len() <= MAX_INLINE_EVENT_BYTES && !data.contains_key(&part.mime) {
                    data.insert(part.mime.clone(), base64::engine::general_purpose::STANDARD.encode(&part.bytes));
                } else if !data.contains_key(&part.mime) {
                    omitted.push(part.mime.clone());
                }
            }
            let output_type = match raw.kind {
                OutputKind::ExecuteResult => "execute_result",
                OutputKind::DisplayData => "display_data",
            };
            self.emit(EventBody::Output { output_type: output_type.to_string(), data, omitted });
        }
        if let (false, Some(error)) = (mark.error, &out.error) {
            self.emit(EventBody::error(error));
        }
    }

    /// The attempt's last event: its result is committed with `status`.
    pub fn end(&mut self, status: JobStatus) {
        self.emit(EventBody::End { status });
    }

    fn emit(&mut self, body: EventBody) {
        if self.muted {
            return;
        }
        let event = JobEvent { tenant: self.tenant.clone(), job_id: self.job_id.clone(), attempt: self.attempt, seq: self.seq, body };
        self.seq += 1;
        self.events.send(&self.key, &event);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use sandcell_protocol::{ExecutionJob, Language, LimitPolicy};

    use super::*;
    use crate::outcome::{apply, Outcome};
    use crate::sandbox::driver::DriverEvent;

    fn job() -> ExecutionJob {
        ExecutionJob {
            tenant: "acme".into(),
            job_id: "j1".into(),
            language: Language::Python,
            code: "1".into(),
            files: vec![],
            limits: LimitPolicy::default().default,
            session: None,
            get_files: vec![],
            list_files: false,
            env: Default::default(),
            context: None,
        }
    }

    fn received(publisher: &mut Publisher) -> Vec<(String, JobEvent)> {
        let mut got = Vec::new();
        while let Ok(m) = publisher.rx.try_recv() {
            got.push((m.key, serde_json::from_slice(&m.body).unwrap()));
        }
        got
    }

    #[test]
    fn events_carry_what_the_outcome_kept_numbered_under_the_jobs_routing_key() {
        let (events, mut publisher) = Events::new(IntCounter::new("p", "p").unwrap(), IntCounter::new("d", "d").unwrap());
        let mut limits = LimitPolicy::default().default;
        limits.stdout_bytes = 5;
        let mut out = Outcome::new(&limits);
        let mut live = events.job(&job(), 1);
        let step = |out: &mut Outcome, ev: DriverEvent| apply(out, ev, Language::Python, &limits);
        live.observe(&mut out, |o| step(o, DriverEvent::Stream { name: "stdout".into(), text: "abc".into() }));
        live.observe(&mut out, |o| step(o, DriverEvent::Stream { name: "stdout".into(), text: "defgh".into() }));
        // Beyond the cap: the result drops it, so no event carries it.
        live.observe(&mut out, |o| step(o, DriverEvent::Stream { name: "stdout".into(), text: "ijk".into() }));
        let data = BTreeMap::from([("text/plain".to_string(), serde_json::json!("42"))]);
        live.observe(&mut out, |o| step(o, DriverEvent::ExecuteResult { data }));
        let error = DriverEvent::Error { ename: "ValueError".into(), evalue: "bad".into(), traceback: vec!["tb".into()] };
        live.observe(&mut out, |o| step(o, error));
        live.end(JobStatus::Failed);

        let got = received(&mut publisher);
        assert!(got.iter().all(|(key, e)| key == "acme.j1" && e.tenant == "acme" && e.job_id == "j1" && e.attempt == 1));
        let bodies: Vec<EventBody> = got.into_iter().map(|(_, e)| e.body).collect();
        assert_eq!(
            bodies,
            [
                EventBody::Stdout { text: "abc".into() },
                EventBody::Stdout { text: "de".into() },
                EventBody::Output { output_type: "execute_result".into(), data: BTreeMap::from([("text/plain".into(), "42".into())]), omitted: vec![] },
                EventBody::Error { ename: "ValueError".into(), evalue: "bad".into(), traceback: vec!["tb".into()] },
                EventBody::End { status: JobStatus::Failed },
            ]
        );
        assert_eq!(out.stdout.text, "abcde");
    }

    #[test]
    fn a_full_buffer_drops_events_and_counts_them_without_waiting() {
        let dropped = IntCounter::new("d", "d").unwrap();
        let (events, publisher) = Events::new(IntCounter::new("p", "p").unwrap(), dropped.clone());
        let mut live = events.job(&job(), 1);
        for _ in 0..BUFFER + 10 {
            live.end(JobStatus::Succeeded);
        }
        assert_eq!(dropped.get(), 10);
        drop(publisher);
    }
}
