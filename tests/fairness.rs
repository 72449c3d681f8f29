//! Fair share: one tenant's backlog does not delay another tenant's job by more than about one
//! job's run time. A test binary of its own, so that no other test's jobs share the worker while
//! it measures.

use std::time::Duration;

use sandcell_protocol::JobStatus;
use sandcell_tests::*;

/// The run time of one flood job.
const FLOOD_JOB_S: u64 = 4;

#[tokio::test]
async fn a_tenants_flood_does_not_delay_another_tenants_job() {
    let c = client().await;
    let pool = service_db().await;
    // 16 four-second jobs of one tenant: four times the worker's slots (and the tenant's
    // default max_jobs_in_flight).
    let flooder = tenant();
    let flood: Vec<_> = (0..16).map(|i| python(&flooder, &format!("import time\ntime.sleep({FLOOD_JOB_S})\nprint({i})"))).collect();
    for s in &flood {
        c.submit(s).await.unwrap();
    }
    let busy = eventually(Duration::from_secs(60), || async {
        let running: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1 AND status = 'running'").bind(&flooder).fetch_one(&pool).await.ok()?;
        (running >= 4).then_some(())
    })
    .await;
    assert!(busy.is_some(), "the flood never filled the worker");
    let other = python(&tenant(), "6 * 7");
    c.submit(&other).await.unwrap();
    // Held, not queued on the broker: the flooder never has more than its quota out.
    let out: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1 AND status IN ('queued', 'running') AND held_job IS NULL")
        .bind(&flooder)
        .fetch_one(&pool)
        .await;
    let other = c.wait(&other.tenant, &other.job_id, JOB_WAIT).await.unwrap();
    assert_eq!(value(&other).as_deref(), Some("42"), "{other:?}");
    let waited = (other.timings.started_at.expect("started") - other.timings.queued_at).to_std().unwrap_or_default();
    eprintln!("another tenant's 6*7 waited {waited:?} behind a flood of 16 x {FLOOD_JOB_S} s jobs");
    let out = out.expect("counting the flooder's jobs out");
    assert!(out <= 4, "{out} of the flooder's jobs are out at once");

    // The flood itself completes, every job once, four side by side, in the order it was
    // recorded: `queued_at` is read under the tenant's row lock, so it is the order of admission
    // (the intake handles one tenant's one-off submissions concurrently, so that is close to,
    // not exactly, the order they were sent). Jobs that left together may start in either order.
    let mut timings = Vec::new();
    // "One job's run time": what a flood job took from its claim to its result, its container's
    // start included (slower on a loaded machine).
    let mut longest = Duration::ZERO;
    for (i, s) in flood.iter().enumerate() {
        let r = c.wait(&s.tenant, &s.job_id, JOB_WAIT).await.unwrap();
        assert_eq!((r.status, r.execution.stdout.clone(), r.attempts), (JobStatus::Succeeded, format!("{i}\n"), 1), "{r:?}");
        let (started, finished) = (r.timings.started_at.expect("started"), r.timings.finished_at.expect("finished"));
        longest = longest.max((finished - started).to_std().unwrap_or_default());
        timings.push((r.timings.queued_at, started));
    }
    eprintln!("longest flood job: {longest:?}");
    assert!(waited < longest + Duration::from_millis(1500), "waited {waited:?}: more than one job's run time ({longest:?})");
    timings.sort();
    for (i, w) in timings.windows(5).enumerate() {
        assert!(w[0].1 <= w[4].1, "the job recorded {i}th started after the one recorded {}th: {timings:?}", i + 4);
    }
}
