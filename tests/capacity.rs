//! A new session at a full fleet: a full worker is not offered it, so it waits in
//! `sandcell.sessions.new` for room, and is refused with `capacity` once it waited
//! `SANDCELL_SESSION_START_WAIT_S` — never lost to the dead-letter queue, never
//! `queued`/`starting` forever; a session that ends makes room for the next.
//!
//! Likewise a session whose worker drains while no other worker can take it over: its next job
//! waits, then the session ends `lost` and the job is refused, both with `capacity`.
//!
//! A test binary of its own: it restarts the worker with room for two sessions and the scheduler
//! with a short wait (as a supervisor would), and gives them back their usual settings at the end.

use sandcell_protocol::{ErrorCode, JobStatus};
use sandcell_tests::*;

/// Puts the worker and the scheduler back as test.sh started them, whatever the test's outcome.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        restart_service("worker", &[]);
        restart_service("scheduler", &[]);
    }
}

/// The tests restart the same services: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn a_new_session_at_a_full_worker_waits_then_is_refused_with_capacity() {
    let _serial = SERIAL.lock().await;
    let _restore = Restore;
    restart_service("worker", &[("SANDCELL_WORKER_MAX_SESSIONS", "2"), ("SANDCELL_SESSION_START_WAIT_S", "15")]);
    restart_service("scheduler", &[("SANDCELL_SESSION_START_WAIT_S", "15")]);
    both_healthy().await;
    let c = client().await;
    let t = tenant();
    let mut held = Vec::new();
    for _ in 0..2 {
        let r = run(&c, &open_session(&t, "x = 1", Some(120))).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        held.push(session_id(&r));
    }

    // A third: no worker has room, so none takes it; after the wait it is refused. Its session
    // fails; nothing of it stays live.
    let third = open_session(&t, "x = 3", Some(120));
    let r = run(&c, &third).await;
    assert_eq!((r.status, r.reason.as_ref().map(|x| x.code)), (JobStatus::Rejected, Some(ErrorCode::Capacity)), "{r:?}");
    let pool = service_db().await;
    let states: Vec<String> =
        sqlx::query_scalar("SELECT state FROM sessions WHERE tenant = $1 AND session_id <> ALL($2)").bind(&t).bind(&held).fetch_all(&pool).await.unwrap();
    assert_eq!(states, ["failed"]);

    // A fourth, while a session closes: it gets the room and runs.
    let fourth = open_session(&t, "x = 4\nx", Some(120));
    c.submit(&fourth).await.unwrap();
    let mut close = in_session(&t, &held[0], "");
    if let Some(s) = close.session.as_mut() {
        s.close = true;
    }
    let closed = run(&c, &close).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{closed:?}");
    let r = c.wait(&t, &fourth.job_id, JOB_WAIT).await.unwrap();
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("4")), "{r:?}");
}

#[tokio::test]
async fn a_drained_workers_session_with_no_other_worker_to_take_it_ends_lost_with_capacity() {
    let _serial = SERIAL.lock().await;
    let _restore = Restore;
    restart_service("scheduler", &[("SANDCELL_SESSION_START_WAIT_S", "15")]);
    both_healthy().await;
    let c = client().await;
    let t = tenant();
    let r = run(&c, &open_session(&t, "x = 1", Some(120))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let id = session_id(&r);
    // The only worker drains and stops: the session moves, but nobody can take it over.
    terminate_service("worker");
    let stopped = eventually(std::time::Duration::from_secs(60), || async { (!service_running("worker")).then_some(()) }).await;
    assert!(stopped.is_some(), "the worker did not stop on SIGTERM");
    let next = in_session(&t, &id, "x");
    let r = run(&c, &next).await;
    assert_eq!((r.status, r.reason.as_ref().map(|x| x.code)), (JobStatus::Rejected, Some(ErrorCode::Capacity)), "{r:?}");
    let session = r.session.as_ref().expect("the job names its session");
    assert_eq!((session.state, session.end_reason.as_ref().map(|x| x.code)), (sandcell_protocol::SessionState::Lost, Some(ErrorCode::Capacity)), "{r:?}");
}
