//! One task that writes what many handlers hand it, in batches: whatever is waiting when it is
//! free, up to a bound, as one write. The more are waiting, the larger the batch.
//!
//! Why: a write of its own is a transaction, a commit (a WAL flush) and often a notification,
//! and a tenant's writes under its row lock wait for each other's commit. A flood of small
//! writes (refusals, upload grants) left the intake's partitions at a few hundred a second while
//! every other tenant's submission waited behind it. The intake's refusal writer
//! ([`crate::refusals`]) and its upload grant writer ([`crate::uploads::Grants`]) are each one,
//! and each retries a batch Postgres chose to break a deadlock through
//! [`once_more_if_deadlocked`].

use std::future::Future;
use std::panic::AssertUnwindSafe;

use anyhow::{anyhow, Result};
use futures::FutureExt;
use prometheus::Histogram;
use tokio::sync::{mpsc, oneshot};

/// An item waiting to be written, and where to send its answer.
struct Waiting<T, A> {
    item: T,
    answer: oneshot::Sender<Result<A, String>>,
}

/// A writer's handle, cheap to clone: the writer ends once every handle is dropped.
pub struct Batcher<T, A> {
    waiting: mpsc::Sender<Waiting<T, A>>,
    what: &'static str,
}

impl<T, A> Clone for Batcher<T, A> {
    fn clone(&self) -> Self {
        Batcher { waiting: self.waiting.clone(), what: self.what }
    }
}

impl<T: Send + 'static, A: Send + 'static> Batcher<T, A> {
    /// Start a writer of batches of at most `max` items (`what` they are, for its errors and
    /// logs), each written by `write`, which answers every item of its batch in order; each
    /// batch's size goes to `sizes`.
    pub fn start<W, F>(what: &'static str, max: usize, sizes: Histogram, write: W) -> Batcher<T, A>
    where
        W: FnMut(Vec<T>) -> F + Send + 'static,
        F: Future<Output = Result<Vec<A>>> + Send + 'static,
    {
        let (waiting, rx) = mpsc::channel(4 * max);
        tokio::spawn(run(what, max, sizes, write, rx));
        Batcher { waiting, what }
    }

    /// Hand `item` to the writer and wait for its answer, or why its batch failed (each item of
    /// a failed batch gets the batch's error).
    pub async fn write(&self, item: T) -> Result<A> {
        let (answer, answered) = oneshot::channel();
        self.waiting.send(Waiting { item, answer }).await.map_err(|_| anyhow!("the writer of {} has stopped", self.what))?;
        match answered.await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(anyhow!("writing a batch of {}: {e}", self.what)),
            Err(_) => Err(anyhow!("the writer of {} stopped before it answered", self.what)),
        }
    }
}

/// Write what is waiting, batch after batch, until every handle is gone.
async fn run<T, A, W, F>(what: &'static str, max: usize, sizes: Histogram, mut write: W, mut rx: mpsc::Receiver<Waiting<T, A>>)
where
    W: FnMut(Vec<T>) -> F,
    F: Future<Output = Result<Vec<A>>>,
{
    let mut batch = Vec::with_capacity(max);
    while rx.recv_many(&mut batch, max).await > 0 {
        sizes.observe(batch.len() as f64);
        let (items, answers): (Vec<T>, Vec<_>) = batch.drain(..).map(|w| (w.item, w.answer)).unzip();
        let n = items.len();
        // A write that panics fails its batch, not the writer: every later item would otherwise
        // find the writer gone.
        let written = AssertUnwindSafe(async { write(items).await }).catch_unwind().await.unwrap_or_else(|panic| {
            let why = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
            tracing::error!(what, items = n, panic = %why, "writing a batch panicked; each of its items is failed and the writer goes on");
            Err(anyhow!("writing the batch panicked: {why}"))
        });
        match written {
            Ok(written) if written.len() == n => {
                for (answer, a) in answers.into_iter().zip(written) {
                    let _ = answer.send(Ok(a));
                }
            }
            Ok(written) => {
                let e = format!("{} answers for {n} {what}", written.len());
                tracing::error!(error = %e, what, "a batch was answered wrongly; each of its items is failed");
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
            Err(e) => {
                let e = format!("{e:#}");
                tracing::warn!(error = %e, what, items = n, "a batch could not be written; each of its items is told so");
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Run `write` once more if Postgres ended its transaction to break a deadlock or a
/// serialization conflict (a batch's rows can cross another transaction's, a sweep's say, in
/// either order): the batch's writers retry here rather than fail every item of the batch.
pub async fn once_more_if_deadlocked<A, W, F>(mut write: W) -> Result<A>
where
    W: FnMut() -> F,
    F: Future<Output = Result<A>>,
{
    match write().await {
        Err(e) if deadlocked(&e) => {
            tracing::info!(error = %format!("{e:#}"), "a batch's transaction was chosen to break a deadlock; written once more");
            write().await
        }
        done => done,
    }
}

/// Whether Postgres ended the transaction to break a deadlock (`40P01`) or a serialization
/// conflict (`40001`).
fn deadlocked(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()).and_then(|d| d.code()).is_some_and(|code| code == "40P01" || code == "40001")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes() -> Histogram {
        Histogram::with_opts(prometheus::HistogramOpts::new("test_batch_size", "test")).expect("histogram")
    }

    #[tokio::test]
    async fn items_waiting_together_are_written_in_one_batch_and_each_gets_its_own_answer() {
        let (calls, mut seen) = mpsc::unbounded_channel();
        let batcher: Batcher<u32, u32> = Batcher::start("numbers", 8, sizes(), move |items: Vec<u32>| {
            let calls = calls.clone();
            async move {
                let _ = calls.send(items.len());
                Ok(items.into_iter().map(|i| i * 10).collect())
            }
        });
        let answers = futures::future::join_all((1..=5).map(|i| {
            let b = batcher.clone();
            async move { b.write(i).await.expect("answered") }
        }))
        .await;
        assert_eq!(answers, [10, 20, 30, 40, 50]);
        let mut batches = Vec::new();
        while let Ok(n) = seen.try_recv() {
            batches.push(n);
        }
        assert_eq!(batches.iter().sum::<usize>(), 5, "{batches:?}");
        assert!(batches.len() < 5, "five items waiting at once were written one by one: {batches:?}");
    }

    #[tokio::test]
    async fn a_failed_batch_fails_each_of_its_items_and_the_writer_goes_on() {
        let batcher: Batcher<u32, u32> = Batcher::start("numbers", 8, sizes(), |items: Vec<u32>| async move {
            if items.contains(&0) {
                Err(anyhow!("zero"))
            } else {
                Ok(items)
            }
        });
        let failed = batcher.write(0).await.expect_err("a failed batch answered");
        assert!(format!("{failed:#}").contains("zero"), "{failed:#}");
        assert_eq!(batcher.write(7).await.expect("the next batch"), 7);
    }

    #[tokio::test]
    async fn a_write_that_panics_fails_its_batch_and_the_writer_goes_on() {
        let batcher: Batcher<u32, u32> = Batcher::start("numbers", 8, sizes(), |items: Vec<u32>| async move {
            assert!(!items.contains(&0), "zero");
            Ok(items)
        });
        let failed = batcher.write(0).await.expect_err("a panicked batch answered");
        assert!(format!("{failed:#}").contains("panicked"), "{failed:#}");
        assert_eq!(batcher.write(7).await.expect("the next batch"), 7);
    }

    #[tokio::test]
    async fn a_batch_answered_with_too_few_answers_fails_its_items() {
        let batcher: Batcher<u32, u32> = Batcher::start("numbers", 8, sizes(), |_items: Vec<u32>| async move { Ok(Vec::new()) });
        assert!(batcher.write(1).await.is_err());
    }

    #[tokio::test]
    async fn an_error_other_than_a_deadlock_is_not_written_again() {
        let mut calls = 0;
        let r: Result<()> = once_more_if_deadlocked(|| {
            calls += 1;
            async { Err(anyhow!("a constraint")) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }

    /// A database error with a SQLSTATE, as Postgres sends one.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error with code {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "coded"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    #[tokio::test]
    async fn a_batch_chosen_to_break_a_deadlock_is_written_once_more_and_only_once() {
        for code in ["40P01", "40001"] {
            let mut calls = 0;
            let r: Result<u32> = once_more_if_deadlocked(|| {
                calls += 1;
                let first = calls == 1;
                async move {
                    if first {
                        Err(anyhow::Error::new(sqlx::Error::Database(Box::new(Coded(code)))).context("writing the batch"))
                    } else {
                        Ok(7)
                    }
                }
            })
            .await;
            assert_eq!(r.expect("written the second time"), 7, "{code}");
            assert_eq!(calls, 2, "{code}");
        }
        let mut calls = 0;
        let r: Result<u32> = once_more_if_deadlocked(|| {
            calls += 1;
            async { Err(anyhow::Error::new(sqlx::Error::Database(Box::new(Coded("40P01"))))) }
        })
        .await;
        assert!(r.is_err(), "a second deadlock is the batch's error");
        assert_eq!(calls, 2, "written a third time");
    }
}
