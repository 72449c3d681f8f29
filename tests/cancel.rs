//! Cancelling a job (`sandcell.cancel` on the intake): a session's running cell is interrupted
//! and the session keeps its state; a tenant cannot cancel another's job; a cancel of a job that
//! ended changes nothing.

use std::time::{Duration, Instant};

use sandcell_protocol::{JobStatus, SessionState};
use sandcell_tests::*;

/// Wait until `job_id` is running.
async fn running(c: &sandcell_client::Client, tenant: &str, job_id: &str) {
    let seen = eventually(Duration::from_secs(30), || async {
        let r = c.result(tenant, job_id).await.ok().flatten()?;
        (r.status == JobStatus::Running).then_some(())
    })
    .await;
    assert!(seen.is_some(), "job {job_id} never ran");
}

#[tokio::test]
async fn a_cancelled_cell_is_interrupted_and_the_session_keeps_its_state() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "x = 'kept'", None)).await);
    let sleeper = in_session(&t, &id, "import time\ntime.sleep(60)");
    c.submit(&sleeper).await.expect("submit");
    running(&c, &t, &sleeper.job_id).await;
    let asked = Instant::now();
    c.cancel(&t, &sleeper.job_id, &id).await.expect("cancel");
    let r = c.wait(&t, &sleeper.job_id, JOB_WAIT).await.expect("result");
    assert_eq!(r.status, JobStatus::Cancelled, "{r:?}");
    // Well before the cell's 60 s, with room for a loaded machine under gVisor.
    assert!(asked.elapsed() < Duration::from_secs(30), "cancelled after {:?}", asked.elapsed());
    assert!(!r.execution.kernel_restarted, "an interruptible cell must not cost the kernel: {r:?}");
    assert_eq!(r.execution.error.as_ref().map(|e| e.ename.as_str()), Some("KeyboardInterrupt"), "{r:?}");
    let next = run(&c, &in_session(&t, &id, "x")).await;
    assert_eq!(value(&next).as_deref(), Some("'kept'"), "{next:?}");
    let session = c.session(&t, &id).await.expect("read").expect("session");
    assert_eq!(session.state, SessionState::Active);
}

#[tokio::test]
async fn a_tenant_cannot_cancel_another_tenants_job() {
    let (a, b) = (TestTenant::create(None).await, TestTenant::create(None).await);
    let (ca, cb) = (a.client().await, b.client().await);
    let id = session_id(&run(&ca, &open_session(&a.name, "1", None)).await);
    let job = in_session(&a.name, &id, "import time\ntime.sleep(3)\n'done'");
    ca.submit(&job).await.expect("submit");
    running(&ca, &a.name, &job.job_id).await;
    // Naming A's tenant from B's broker user (refused at intake), and B's own tenant with A's
    // job id (no such job of B's).
    cb.cancel(&a.name, &job.job_id, &id).await.expect("publish");
    cb.cancel(&b.name, &job.job_id, &id).await.expect("publish");
    let r = ca.wait(&a.name, &job.job_id, JOB_WAIT).await.expect("result");
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(value(&r).as_deref(), Some("'done'"), "{r:?}");
}

#[tokio::test]
async fn a_cancel_of_a_job_that_ended_changes_nothing() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "y = 2", None)).await);
    let done = run(&c, &in_session(&t, &id, "y * 21")).await;
    assert_eq!(value(&done).as_deref(), Some("42"), "{done:?}");
    c.cancel(&t, &done.job_id, &id).await.expect("cancel");
    // The next jobs run as ever, and the ended one's result is as it was.
    for _ in 0..3 {
        let next = run(&c, &in_session(&t, &id, "y")).await;
        assert_eq!(next.status, JobStatus::Succeeded, "{next:?}");
    }
    let again = c.result(&t, &done.job_id).await.expect("read").expect("result");
    assert_eq!(again.status, JobStatus::Succeeded, "{again:?}");
    assert_eq!(value(&again).as_deref(), Some("42"), "{again:?}");
}

#[tokio::test]
async fn a_queued_job_cancelled_before_it_starts_never_runs_and_two_cancels_both_hold() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "x = 'before'", None)).await);
    let running_job = in_session(&t, &id, "import time\ntime.sleep(60)");
    c.submit(&running_job).await.expect("submit");
    running(&c, &t, &running_job.job_id).await;
    let queued = in_session(&t, &id, "x = 'ran'");
    c.submit(&queued).await.expect("submit");
    // The queued one first, then the running one: the session keeps both.
    c.cancel(&t, &queued.job_id, &id).await.expect("cancel");
    c.cancel(&t, &running_job.job_id, &id).await.expect("cancel");
    let r = c.wait(&t, &running_job.job_id, JOB_WAIT).await.expect("result");
    assert_eq!(r.status, JobStatus::Cancelled, "{r:?}");
    let q = c.wait(&t, &queued.job_id, JOB_WAIT).await.expect("result");
    assert_eq!(q.status, JobStatus::Cancelled, "{q:?}");
    assert!(!q.execution.kernel_restarted, "{q:?}");
    let next = run(&c, &in_session(&t, &id, "x")).await;
    assert_eq!(value(&next).as_deref(), Some("'before'"), "the cancelled job never ran: {next:?}");
}
