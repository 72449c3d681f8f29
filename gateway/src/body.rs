//! A streamed response's body (`/execute`, `process.Process/Start`), and the one bound on what
//! the gateway holds for clients that do not read.
//!
//! A run's task writes its lines as the run goes; the connection takes them as the client reads.
//! What is written and not yet taken is *unread*. Before, it had no bound: a client that stopped
//! reading (a tiny receive window, a connection left open) made the gateway keep every line of
//! every run it started, for as long as it kept the connection, and one tenant could so grow
//! the process every tenant's requests go through until it was killed.
//!
//! Now, per tenant, over all its streamed responses:
//! - its unread bytes stay within `SANDCELL_GATEWAY_UNREAD_BYTES`: a line that would pass it is
//!   written only when it is alone (the tenant has nothing else unread). A live line
//!   ([`BodyTx::send`], written as the run produces it) that cannot be written abandons its
//!   response; a closing line ([`BodyTx::send_paced`]) waits for room, but only
//!   [`MAX_WAITING`] of a tenant's answers wait at once (each holds its run's result), and the
//!   next one that would is abandoned;
//! - control lines ([`BodyTx::send_control`]: keep-alives, a stream's opening frame) are written
//!   whatever the budget: a few bytes
//!   a second, bounded by the stall time;
//! - a response holding unread bytes that its connection has taken none of for
//!   `SANDCELL_GATEWAY_STALL_S` is abandoned.
//!
//! An abandoned response's unread bytes are dropped at once and its connection is ended with an
//! error; the run's task sees it as a client gone ([`BodyTx::closed`]) and cancels the job, as
//! for a client that hung up. Counted in `sandcell_gateway_responses_abandoned_total{why}`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::IntCounterVec;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// The largest piece a line is queued in. The connection counts a piece as taken once it is in
/// its own write buffer (some 400 KB), so a whole line of megabytes would leave the count (and
/// the stall watch) while the client had read none of it; pieces keep what is unread counted.
const PIECE: usize = 64 << 10;

/// How often a closing line waiting for room looks again.
const ROOM_POLL: Duration = Duration::from_millis(20);

/// How many of a tenant's answers may wait for room at once: each holds its run's result (up to
/// its output limits) while it waits.
pub const MAX_WAITING: usize = 4;

/// A tenant's streamed answers, together.
#[derive(Default)]
struct TenantBodies {
    /// Written and not yet taken by their connections.
    unread: AtomicUsize,
    /// Answers waiting for room in [`BodyTx::send_paced`].
    waiting: AtomicUsize,
}

/// One place in a tenant's [`TenantBodies::waiting`], given back when dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The streamed responses of every tenant: where their unread bytes are counted.
pub struct Bodies {
    budget: usize,
    stall: Duration,
    tenants: Mutex<HashMap<String, Arc<TenantBodies>>>,
    abandoned: IntCounterVec,
}

/// Why a response was abandoned (the metric's `why`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// A live line would have taken its tenant past its unread bytes.
    OverBudget,
    /// Its connection took nothing of what was waiting for the stall time.
    Stalled,
}

impl Abandoned {
    fn as_str(self) -> &'static str {
        match self {
            Abandoned::OverBudget => "over_budget",
            Abandoned::Stalled => "stalled",
        }
    }
}

impl Bodies {
    /// `budget`: a tenant's unread bytes; `stall`: how long a response may hold unread bytes
    /// its connection takes none of; `abandoned`: counts abandoned responses by why.
    pub fn new(budget: usize, stall: Duration, abandoned: IntCounterVec) -> Self {
        Bodies { budget: budget.max(1), stall, tenants: Mutex::new(HashMap::new()), abandoned }
    }

    /// A streamed response of `tenant`: the sender its run's task writes into, and the body.
    pub fn channel(&self, tenant: &str) -> (BodyTx, axum::body::Body) {
        let counts = lock(&self.tenants).entry(tenant.to_string()).or_default().clone();
        let (tx, rx) = unbounded_channel();
        let shared = Arc::new(Shared {
            state: Mutex::new(State { rx: Some(rx), unread: 0, since: Instant::now(), waker: None }),
            tenant: counts,
            budget: self.budget,
            stall: self.stall,
            abandoned: self.abandoned.clone(),
        });
        let body = axum::body::Body::from_stream(BodyStream { shared: shared.clone(), ended: false });
        (BodyTx { tx, shared }, body)
    }

    /// The bytes `tenant`'s streamed responses hold unread now.
    pub fn unread(&self, tenant: &str) -> usize {
        lock(&self.tenants).get(tenant).map_or(0, |t| t.unread.load(Ordering::SeqCst))
    }
}

/// What the run's task and the connection share of one response.
struct Shared {
    state: Mutex<State>,
    /// The tenant's answers, together.
    tenant: Arc<TenantBodies>,
    budget: usize,
    stall: Duration,
    abandoned: IntCounterVec,
}

struct State {
    /// `None` once the response is abandoned or its body dropped: lines are refused from then on.
    rx: Option<UnboundedReceiver<Bytes>>,
    /// This response's unread bytes (part of the tenant's).
    unread: usize,
    /// Since when this response has waited for its connection: its last take, or the write that
    /// found it with nothing unread.
    since: Instant,
    /// The connection's task, when it waits for a line: woken when the response is abandoned
    /// (the channel's own waker goes with the receiver, unwoken).
    waker: Option<Waker>,
}

impl Shared {
    /// Whether a line of `len` bytes fits its tenant's budget now.
    fn admits(&self, len: usize) -> bool {
        let unread = self.tenant.unread.load(Ordering::SeqCst);
        unread == 0 || unread + len <= self.budget
    }

    /// Queue `bytes` (the state locked), in pieces of at most [`PIECE`]: `false` when the
    /// response no longer takes lines.
    fn push(&self, st: &mut State, tx: &UnboundedSender<Bytes>, mut bytes: Bytes) -> bool {
        if st.rx.is_none() {
            return false;
        }
        let len = bytes.len();
        if st.unread == 0 {
            st.since = Instant::now();
        }
        st.unread += len;
        self.tenant.unread.fetch_add(len, Ordering::SeqCst);
        // The receiver is in `st`, locked here: it cannot be dropped under these sends.
        while bytes.len() > PIECE {
            if tx.send(bytes.split_to(PIECE)).is_err() {
                return false;
            }
        }
        tx.send(bytes).is_ok()
    }

    /// Drop what is unread and refuse further lines, releasing the lock before the receiver
    /// (and the lines in it) is dropped. Returns whether the response took lines until now.
    fn close(&self, mut st: MutexGuard<'_, State>) -> bool {
        self.tenant.unread.fetch_sub(st.unread, Ordering::SeqCst);
        st.unread = 0;
        if let Some(waker) = st.waker.take() {
            waker.wake(); // it finds the receiver gone and ends the body with an error
        }
        let rx = st.rx.take();
        drop(st);
        rx.is_some()
    }

    /// [`Shared::close`], counted and logged as an abandonment.
    fn abandon(&self, st: MutexGuard<'_, State>, why: Abandoned) {
        if self.close(st) {
            self.abandoned.with_label_values(&[why.as_str()]).inc();
            tracing::info!(why = why.as_str(), "a streamed response's client did not read it: abandoned, its unread lines dropped");
        }
    }

    fn stalled(&self, st: &State) -> bool {
        st.unread > 0 && st.since.elapsed() >= self.stall
    }
}

/// The run's side of a streamed response. Clones write into the same response.
#[derive(Clone)]
pub struct BodyTx {
    tx: UnboundedSender<Bytes>,
    shared: Arc<Shared>,
}

impl BodyTx {
    /// Write a live line (keep-alives, the run's output as it comes). A line its tenant's budget
    /// has no room for abandons the response. Returns whether the line was queued.
    pub fn send(&self, bytes: Bytes) -> bool {
        let mut st = lock(&self.shared.state);
        if !self.shared.admits(bytes.len()) {
            self.shared.abandon(st, Abandoned::OverBudget);
            return false;
        }
        self.shared.push(&mut st, &self.tx, bytes)
    }

    /// Write a closing line once its tenant's budget has room for it (or it is alone), or give
    /// up when the response is abandoned, its client gone, or it stalls meanwhile; abandon it
    /// at once when [`MAX_WAITING`] of its tenant's answers already wait. Returns whether the
    /// line was queued.
    pub async fn send_paced(&self, bytes: Bytes) -> bool {
        let mut place = None;
        loop {
            {
                let mut st = lock(&self.shared.state);
                if st.rx.is_none() {
                    return false;
                }
                if self.shared.admits(bytes.len()) {
                    return self.shared.push(&mut st, &self.tx, bytes);
                }
                if place.is_none() {
                    let waiting = &self.shared.tenant.waiting;
                    let taken = Waiting(waiting);
                    if waiting.fetch_add(1, Ordering::SeqCst) >= MAX_WAITING {
                        drop(taken);
                        self.shared.abandon(st, Abandoned::OverBudget);
                        return false;
                    }
                    place = Some(taken);
                }
                if self.shared.stalled(&st) {
                    self.shared.abandon(st, Abandoned::Stalled);
                    return false;
                }
            }
            tokio::time::sleep(ROOM_POLL).await;
        }
    }

    /// Write a control line (a keep-alive, a stream's opening frame), whatever the budget: a
    /// few bytes a second, bounded by the stall time. Returns whether the line was queued.
    pub fn send_control(&self, bytes: Bytes) -> bool {
        let mut st = lock(&self.shared.state);
        self.shared.push(&mut st, &self.tx, bytes)
    }

    /// Abandon the response if it stalled. Returns whether it no longer takes lines.
    pub fn check_stall(&self) -> bool {
        let st = lock(&self.shared.state);
        if self.shared.stalled(&st) {
            self.shared.abandon(st, Abandoned::Stalled);
            return true;
        }
        st.rx.is_none()
    }

    /// Resolves when the response no longer takes lines: its client went away (the body was
    /// dropped) or it was abandoned.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    /// After the last line: the sender is dropped at once (the body ends when its connection
    /// has taken what is left), and the response is watched, every `every`, until the
    /// connection has taken everything or the client is gone; if it stalls first, it is
    /// abandoned.
    pub async fn finish(self, every: Duration) {
        let shared = self.shared.clone();
        drop(self);
        loop {
            {
                let st = lock(&shared.state);
                if st.unread == 0 || st.rx.is_none() {
                    return;
                }
                if shared.stalled(&st) {
                    shared.abandon(st, Abandoned::Stalled);
                    return;
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}

/// The connection's side: takes lines as the client reads; after an abandonment, ends the body
/// with an error (the connection is closed rather than the answer cut short silently).
struct BodyStream {
    shared: Arc<Shared>,
    ended: bool,
}

impl futures::Stream for BodyStream {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let mut st = lock(&this.shared.state);
        let Some(rx) = st.rx.as_mut() else {
            this.ended = true;
            return Poll::Ready(Some(Err(std::io::Error::other(
                "the client read nothing of this response for too long, or it held too much unread; abandoned",
            ))));
        };
        match rx.poll_recv(cx) {
            Poll::Ready(Some(bytes)) => {
                st.unread -= bytes.len();
                st.since = Instant::now();
                this.shared.tenant.unread.fetch_sub(bytes.len(), Ordering::SeqCst);
                Poll::Ready(Some(Ok(bytes)))
            }
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for BodyStream {
    /// The connection is done with the response (the client went away, or the answer ended):
    /// what it did not take is no longer the tenant's, and the run's task sees the client gone.
    fn drop(&mut self) {
        self.shared.close(lock(&self.shared.state));
    }
}

/// A poisoned lock only means a panic elsewhere while it was held; the counts stay usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn bodies(budget: usize, stall: Duration) -> Bodies {
        let abandoned = IntCounterVec::new(prometheus::Opts::new("abandoned", "test"), &["why"]).unwrap();
        Bodies::new(budget, stall, abandoned)
    }

    fn line(n: usize) -> Bytes {
        Bytes::from(vec![b'x'; n])
    }

    #[tokio::test]
    async fn a_tenants_unread_lines_are_bounded_and_the_one_that_would_pass_abandons_its_response() {
        let b = bodies(1000, Duration::from_secs(60));
        let (stalled, _unread_body) = b.channel("t");
        assert!(stalled.send(line(600)));
        assert!(stalled.send(line(400)));
        assert_eq!(b.unread("t"), 1000);
        // Another response of the same tenant finds no room: it is abandoned, its client gone.
        let (other, body) = b.channel("t");
        assert!(!other.send(line(1)));
        tokio::time::timeout(Duration::from_secs(1), other.closed()).await.expect("abandoned: closed");
        assert_eq!(b.abandoned.with_label_values(&["over_budget"]).get(), 1);
        let mut stream = body.into_data_stream();
        assert!(stream.next().await.is_some_and(|r| r.is_err()), "an abandoned body ends with an error");
        // Another tenant is not touched.
        let (theirs, _body) = b.channel("u");
        assert!(theirs.send(line(1000)));
        assert_eq!((b.unread("t"), b.unread("u")), (1000, 1000));
    }

    #[tokio::test]
    async fn a_line_larger_than_the_budget_goes_when_it_is_alone() {
        let b = bodies(100, Duration::from_secs(60));
        let (tx, body) = b.channel("t");
        assert!(tx.send_paced(line(5000)).await);
        drop(tx);
        assert_eq!(axum::body::to_bytes(body, usize::MAX).await.expect("body").len(), 5000);
        assert_eq!(b.unread("t"), 0);
    }

    #[tokio::test]
    async fn a_closing_line_waits_for_the_client_to_read_and_then_goes() {
        let b = bodies(1000, Duration::from_secs(60));
        let (tx, body) = b.channel("t");
        assert!(tx.send(line(900)));
        let paced = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send_paced(line(500)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!paced.is_finished(), "the closing line did not wait for room");
        assert_eq!(b.unread("t"), 900);
        let mut stream = body.into_data_stream();
        assert_eq!(stream.next().await.expect("a line").expect("ok").len(), 900);
        assert!(paced.await.unwrap());
        assert_eq!(stream.next().await.expect("a line").expect("ok").len(), 500);
        assert_eq!(b.unread("t"), 0);
    }

    #[tokio::test]
    async fn only_a_few_of_a_tenants_answers_wait_for_room_and_the_next_is_abandoned() {
        let b = bodies(1000, Duration::from_secs(60));
        let (full, _full_body) = b.channel("t");
        assert!(full.send(line(1000)));
        let mut waiting = Vec::new();
        for _ in 0..MAX_WAITING {
            let (tx, body) = b.channel("t");
            let task = {
                let tx = tx.clone();
                tokio::spawn(async move { tx.send_paced(line(10)).await })
            };
            waiting.push((tx, body, task));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(waiting.iter().all(|(_, _, task)| !task.is_finished()), "an answer did not wait for room");
        let (next, _next_body) = b.channel("t");
        assert!(!next.send_paced(line(10)).await, "one answer more than MAX_WAITING waited too");
        assert_eq!(b.abandoned.with_label_values(&["over_budget"]).get(), 1);
        // Room again: the waiting ones go, and their places are given back.
        drop(_full_body);
        for (_, _, task) in waiting.drain(..) {
            assert!(task.await.unwrap());
        }
        let t = lock(&b.tenants).get("t").cloned().unwrap();
        assert_eq!(t.waiting.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_client_waiting_for_a_line_gets_an_error_when_its_answer_is_abandoned() {
        let b = bodies(1000, Duration::from_secs(60));
        let (full, _full_body) = b.channel("t");
        assert!(full.send(line(1000)));
        let (tx, body) = b.channel("t");
        let mut stream = body.into_data_stream();
        let reader = tokio::spawn(async move { stream.next().await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!reader.is_finished(), "the reader did not wait for a line");
        assert!(!tx.send(line(10)), "a line past the budget was queued");
        let got = tokio::time::timeout(Duration::from_secs(1), reader).await.expect("the waiting client was never told").unwrap();
        assert!(got.is_some_and(|r| r.is_err()), "an abandoned answer must end with an error");
    }

    #[tokio::test]
    async fn a_long_line_is_queued_in_pieces_so_what_is_unread_stays_counted() {
        let b = bodies(1 << 30, Duration::from_secs(60));
        let (tx, body) = b.channel("t");
        assert!(tx.send(line(3 * PIECE + 1)));
        let mut stream = body.into_data_stream();
        let first = stream.next().await.expect("a piece").expect("ok");
        assert_eq!(first.len(), PIECE);
        assert_eq!(b.unread("t"), 2 * PIECE + 1, "a taken piece leaves the count, the rest stays");
    }

    #[tokio::test]
    async fn a_finished_answer_ends_as_soon_as_its_client_has_read_it() {
        let b = bodies(1 << 20, Duration::from_secs(60));
        let (tx, body) = b.channel("t");
        assert!(tx.send_paced(line(10)).await);
        let watch = tokio::spawn(tx.finish(Duration::from_millis(50)));
        let read = tokio::time::timeout(Duration::from_secs(1), axum::body::to_bytes(body, usize::MAX)).await;
        assert_eq!(read.expect("the body did not end with its last line").expect("body").len(), 10);
        tokio::time::timeout(Duration::from_secs(5), watch).await.expect("the watch did not end").unwrap();
    }

    #[tokio::test]
    async fn a_response_its_client_does_not_read_is_abandoned_after_the_stall_and_frees_its_bytes() {
        let b = bodies(1 << 20, Duration::from_millis(200));
        let (tx, _body) = b.channel("t");
        assert!(tx.send(line(1000)));
        assert!(!tx.check_stall(), "abandoned before the stall time");
        tokio::time::timeout(Duration::from_secs(5), tx.clone().finish(Duration::from_millis(50))).await.expect("finish returns once stalled");
        assert_eq!(b.unread("t"), 0);
        assert_eq!(b.abandoned.with_label_values(&["stalled"]).get(), 1);
        assert!(!tx.send(line(1)), "an abandoned response took a line");
    }

    #[tokio::test]
    async fn a_client_that_goes_away_frees_its_bytes_and_is_seen_gone() {
        let b = bodies(1 << 20, Duration::from_secs(60));
        let (tx, body) = b.channel("t");
        assert!(tx.send(line(1000)));
        drop(body);
        tokio::time::timeout(Duration::from_secs(1), tx.closed()).await.expect("closed");
        assert_eq!(b.unread("t"), 0);
        assert!(!tx.send(line(1)));
        assert_eq!(b.abandoned.with_label_values(&["over_budget"]).get() + b.abandoned.with_label_values(&["stalled"]).get(), 0);
    }
}
