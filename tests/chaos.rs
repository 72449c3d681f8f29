//! Chaos: a few hundred mixed one-off and session jobs flow while a sandbox is killed mid-cell,
//! the worker and the scheduler are SIGKILLed (and started again, as their supervisor would),
//! and RabbitMQ and Postgres are restarted. Afterwards: no job is lost (every submission has a
//! row), none is stuck (every job is terminal), a job ran twice only if it was running on the
//! worker when it was killed, and every session's jobs ran in order, each once.
//!
//! A test binary of its own (cargo runs test binaries one after another), since it kills the
//! services every other test needs. The binaries it restarts are those `deploy/local/test.sh`
//! started (pid files in `$SANDCELL_RUN_DIR`, logs appended to the same files).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use sandcell_protocol::{JobResult, JobStatus, Submission};
use sandcell_tests::*;

/// Job ids running now, read from Postgres (retried: the database may be restarting).
async fn running_now() -> HashSet<String> {
    let got = eventually(Duration::from_secs(60), || async {
        let pool = sqlx::PgPool::connect(&std::env::var("SANDCELL_DATABASE_URL").ok()?).await.ok()?;
        let ids: Vec<String> = sqlx::query_scalar("SELECT job_id FROM jobs WHERE status = 'running'").fetch_all(&pool).await.ok()?;
        Some(ids.into_iter().collect::<HashSet<_>>())
    })
    .await;
    got.expect("reading running jobs")
}

/// Submit, retrying while the broker restarts (a duplicate submission is harmless: the job id
/// is the idempotency key).
async fn submit(c: &mut sandcell_client::Client, sub: &Submission) {
    for _ in 0..120 {
        if c.submit(sub).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(fresh) = sandcell_client::Client::from_env().await {
            *c = fresh;
        }
    }
    panic!("could not submit {}", sub.job_id);
}

/// The job's terminal result, waiting through restarts.
/// The job's terminal result, waiting until `deadline`; looked up at least once, so that once
/// the deadline passed, every later job is still judged by its own state (not reported stuck
/// because an earlier one used the time up).
async fn final_result(sub: &Submission, deadline: Instant) -> Option<JobResult> {
    loop {
        if let Ok(c) = sandcell_client::Client::from_env().await {
            if let Ok(Some(r)) = c.result(&sub.tenant, &sub.job_id).await {
                if r.status.is_terminal() {
                    return Some(r);
                }
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn jobs_survive_kills_and_restarts_none_lost_none_stuck_none_run_twice_without_a_worker_death() {
    let c = client().await;
    let tenants: Vec<String> = (0..3).map(|_| tenant()).collect();
    // Each tenant: 4 sessions of 8 jobs counting up, and 40 one-off jobs, interleaved.
    let mut sessions = Vec::new();
    for t in &tenants {
        for _ in 0..4 {
            let r = run(&c, &open_session(t, "n = 0", Some(600))).await;
            assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
            sessions.push((t.clone(), session_id(&r)));
        }
    }
    let mut plan: Vec<(Submission, Option<usize>)> = Vec::new();
    for step in 0..40 {
        for t in &tenants {
            plan.push((python(t, &format!("import time\ntime.sleep(0.{})\nprint('one-off {step}')", step % 7)), None));
        }
        if step % 5 == 0 {
            for (i, (t, s)) in sessions.iter().enumerate() {
                plan.push((in_session(t, s, "import time\ntime.sleep(0.3)\nn += 1\nprint(n)"), Some(i)));
            }
        }
    }
    let total = plan.len();

    // Submit over ~50 s while the faults happen.
    let subs: Vec<Submission> = plan.iter().map(|(s, _)| s.clone()).collect();
    let feeder = {
        let subs = subs.clone();
        tokio::spawn(async move {
            let mut c = client().await;
            for s in &subs {
                submit(&mut c, s).await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };
    let mut ran_on_killed_worker = HashSet::new();

    // A sandbox killed mid-cell: a long cell in a container of its own (a shape the warm pool
    // does not have, so the container carries the job's label), killed once its cell runs (the
    // `sleep` is in the container's process list: a sandbox killed while starting would only be
    // replaced by a fresh one).
    let mut victim = Submission::new(&tenants[0], unique("victim"), sandcell_protocol::Language::Bash, "sleep 60; echo not reached");
    victim.memory_mb = Some(512);
    c.submit(&victim).await.unwrap();
    let container = eventually(Duration::from_secs(90), || async {
        let id = sh(&format!("docker ps -q --filter label=sandcell.job={}", victim.job_id));
        let id = id.trim().to_string();
        let top = std::process::Command::new("docker").args(["top", &id]).output().ok()?;
        String::from_utf8_lossy(&top.stdout).contains("sleep 60").then_some(id)
    })
    .await
    .expect("the victim's cell running");
    sh(&format!("docker kill {container} >/dev/null"));
    // Its job ends at once, as the code's own failure: the interpreter is gone.
    let v = final_result(&victim, Instant::now() + Duration::from_secs(20)).await.expect("the victim's result");
    assert_eq!((v.status, v.reason.as_ref().map(|r| r.code), v.attempts), (JobStatus::Failed, Some(sandcell_protocol::ErrorCode::DriverProtocol), 1), "{v:?}");
    // The worker, SIGKILLed with jobs running: those still `running` once it is dead (and
    // before its next life claims anything) are exactly the jobs it was running.
    kill_service("worker");
    ran_on_killed_worker.extend(running_now().await);
    start_service("worker", &[]);
    both_healthy().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    // The scheduler, SIGKILLed mid-intake.
    restart_service("scheduler", &[]);
    both_healthy().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    sh("rabbitmqctl -q stop_app && rabbitmqctl -q start_app && rabbitmqctl -q await_startup");
    both_healthy().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    sh("pg_ctlcluster 15 main restart");
    both_healthy().await;
    feeder.await.expect("feeder");

    let deadline = Instant::now() + Duration::from_secs(240);
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let mut twice = Vec::new();
    let mut counts: Vec<Vec<(usize, String)>> = vec![Vec::new(); sessions.len()];
    let mut stuck = Vec::new();
    for (k, (sub, session)) in plan.iter().enumerate() {
        let Some(r) = final_result(sub, deadline).await else {
            stuck.push(sub.job_id.clone());
            continue;
        };
        *by_status.entry(format!("{}{}", r.status, r.reason.as_ref().map(|x| format!("/{}", x.code)).unwrap_or_default())).or_default() += 1;
        if r.attempts > 1 {
            twice.push(sub.job_id.clone());
        }
        if let (Some(i), JobStatus::Succeeded) = (session, r.status) {
            counts[*i].push((k, r.execution.stdout.trim().to_string()));
        }
        if session.is_none() && !ran_on_killed_worker.contains(&sub.job_id) && r.status != JobStatus::Failed {
            assert_eq!(r.status, JobStatus::Succeeded, "a one-off job the faults did not touch: {r:?}");
        }
    }
    eprintln!("chaos: {total} jobs; outcomes {by_status:?}; run twice: {} (all were running on the killed worker)", twice.len());
    assert!(stuck.is_empty(), "{} jobs never ended: {stuck:?}", stuck.len());
    let unexplained: Vec<_> = twice.iter().filter(|j| !ran_on_killed_worker.contains(*j)).collect();
    assert!(unexplained.is_empty(), "jobs ran twice without a worker death: {unexplained:?}");
    // A session's jobs that succeeded counted up one by one: in order, each once (a session on
    // the killed worker moves; its later jobs run in a new kernel, where `n` is gone, and fail
    // with a NameError rather than count out of order).
    for (i, seen) in counts.iter().enumerate() {
        let values: Vec<i64> = seen.iter().map(|(_, v)| v.parse().unwrap_or(-1)).collect();
        assert!(values.windows(2).all(|w| w[1] == w[0] + 1), "session {i} counted {values:?}");
    }
}
