//! The fleet: several schedulers and workers at once (`deploy/local/test.sh` starts 2 schedulers,
//! `scheduler` and `scheduler-2`, and 3 workers for this suite, with `SANDCELL_SCHEDULERS=2
//! SANDCELL_WORKERS=3`). What it proves: the schedulers share the intake's partitions; one
//! session's jobs run in the order they were published, each once, while a scheduler is killed
//! and restarted and another stops gracefully; a burst of new sessions spreads over the workers;
//! a new session goes to the worker with the most room, and a full worker is offered none; the
//! sessions of a worker that is killed, or drained, continue on the others.
//! The tests restart instances: test.sh runs them one at a time (`--test-threads=1`).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use sandcell_core::tenants::Quotas;
use sandcell_protocol::JobStatus;
use sandcell_tests::*;

const SCHEDULERS: [(&str, &str); 2] = [("scheduler", "127.0.0.1:9464"), ("scheduler-2", "127.0.0.1:9474")];
const PARTITIONS: f64 = sandcell_core::broker::DEFAULT_INTAKE_PARTITIONS as f64;

/// Partitions each scheduler holds now (None: its metrics do not answer).
async fn partitions_held() -> Vec<Option<f64>> {
    let mut held = Vec::new();
    for (_, addr) in SCHEDULERS {
        held.push(metric_at(addr, "sandcell_intake_partitions_held").await);
    }
    held
}

/// Wait until both schedulers hold partitions and together hold every one, exactly once.
async fn partitions_shared_by_both(within: Duration) -> Vec<Option<f64>> {
    let shared = eventually(within, || async {
        let held = partitions_held().await;
        let both = held.iter().all(|h| h.is_some_and(|n| n > 0.0));
        (both && held.iter().flatten().sum::<f64>() == PARTITIONS).then_some(held)
    })
    .await;
    match shared {
        Some(held) => held,
        None => panic!("the schedulers did not share the {PARTITIONS} partitions: {:?}", partitions_held().await),
    }
}

#[tokio::test]
async fn twenty_sessions_keep_their_order_over_two_schedulers_while_one_is_killed_and_another_stops() {
    let _fleet = workers_healthy().await;
    // Both schedulers consume: the partitions are shared, none twice.
    let before = partitions_shared_by_both(Duration::from_secs(30)).await;
    println!("partitions held before: {before:?}");

    let t = TestTenant::create(Some(Quotas { max_sessions: 20, max_queued_jobs: 1000, max_jobs_in_flight: 20, ..Default::default() })).await;
    let mut c = t.client().await;

    // A burst of 20 new sessions, each with an empty list.
    let openings: Vec<_> = (0..20).map(|_| open_session(&t.name, "seq = []", Some(600))).collect();
    for sub in &openings {
        c.submit(sub).await.expect("submit an opening job");
    }
    let mut sessions = Vec::new();
    let mut placement: BTreeMap<String, usize> = BTreeMap::new();
    for sub in &openings {
        let r = c.wait(&t.name, &sub.job_id, JOB_WAIT).await.expect("opening result");
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        let worker = r.session.as_ref().and_then(|s| s.worker_id.clone()).unwrap_or_default();
        *placement.entry(worker).or_default() += 1;
        sessions.push(session_id(&r));
    }
    println!("20 new sessions by worker: {placement:?}");
    assert!(placement.len() >= 2, "a burst of 20 new sessions stayed on one worker of three: {placement:?}");

    // 20 rounds of one job per session, published without waiting: job i appends i and answers
    // how many the list holds. Mid-stream, scheduler-2 is SIGKILLed (its partitions' unacked
    // submissions go back to the broker) and started again; later `scheduler` is told to stop
    // (it finishes what it took and hands its partitions over) and started again.
    let mut jobs: Vec<(usize, usize, sandcell_protocol::Submission)> = Vec::new();
    for round in 1..=20 {
        for (s, id) in sessions.iter().enumerate() {
            let sub = in_session(&t.name, id, &format!("seq.append({round}); len(seq)"));
            c.submit(&sub).await.expect("submit a session job");
            jobs.push((s, round, sub));
        }
        match round {
            6 => kill_service("scheduler-2"),
            10 => start_service("scheduler-2", &[]),
            14 => terminate_service("scheduler"),
            18 => {
                assert!(
                    eventually(Duration::from_secs(30), || async { (!service_running("scheduler")).then_some(()) }).await.is_some(),
                    "scheduler did not stop on SIGTERM"
                );
                start_service("scheduler", &[]);
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        if round == 10 {
            // The client's connection is fine; the restarted scheduler takes partitions back.
            c = t.client().await;
        }
    }

    // Every job succeeded and saw exactly the jobs before it: job i of a session answers i.
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut wrong = Vec::new();
    for (s, round, sub) in &jobs {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        let r = c.wait(&t.name, &sub.job_id, left).await.unwrap_or_else(|e| panic!("session {s} job {round} has no result: {e}"));
        if r.status != JobStatus::Succeeded || value(&r).as_deref() != Some(round.to_string().as_str()) {
            wrong.push(format!("session {s} job {round}: {:?} value {:?} reason {:?} error {:?}", r.status, value(&r), r.reason, r.execution.error));
        }
    }
    assert!(wrong.is_empty(), "{} of 400 jobs ran out of order, twice or not at all:\n{}", wrong.len(), wrong.join("\n"));
    // And nothing ran after the last job of each session.
    let mut seen = HashSet::new();
    for id in &sessions {
        let r = run(&c, &in_session(&t.name, id, "seq == list(range(1, 21))")).await;
        assert_eq!(value(&r).as_deref(), Some("True"), "session {id} holds something else: {r:?}");
        seen.insert(id.clone());
    }
    assert_eq!(seen.len(), 20);

    // Both schedulers are back and share the partitions again.
    let after = partitions_shared_by_both(Duration::from_secs(30)).await;
    println!("partitions held after: {after:?}");
    for id in &sessions {
        run(&c, &close_session(&t.name, id)).await;
    }
}

const WORKERS: [(&str, &str, &str); 3] =
    [("worker", "test-worker", "127.0.0.1:9465"), ("worker-2", "test-worker-2", "127.0.0.1:9475"), ("worker-3", "test-worker-3", "127.0.0.1:9485")];

/// Put the fleet back as test.sh started it should a test fail half-way (a worker stopped, or
/// restarted with less room), so that the next test does not fail for it.
struct FleetRestoredOnFailure;

impl Drop for FleetRestoredOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // As `restart_service`, without its assertions (a panic while panicking aborts).
            let dir = std::env::var("SANDCELL_RUN_DIR").unwrap_or_else(|_| "/var/lib/sandcell/run".into());
            for (name, _, _) in WORKERS {
                let cmd =
                    format!("kill -9 $(cat {dir}/{name}.pid) 2>/dev/null; sleep 0.5; nohup bash {dir}/{name}.cmd >/dev/null 2>&1 & echo $! > {dir}/{name}.pid");
                let _ = std::process::Command::new("bash").arg("-c").arg(cmd).status();
            }
        }
    }
}

/// Wait until every worker answers /healthz (a test's first step).
async fn workers_healthy() -> FleetRestoredOnFailure {
    for (name, _, addr) in WORKERS {
        let healthy =
            eventually(Duration::from_secs(120), || async { matches!(http_get(&format!("http://{addr}/healthz")).await, Ok((200, _))).then_some(()) }).await;
        assert!(healthy.is_some(), "{name} is not healthy");
    }
    FleetRestoredOnFailure
}

/// Restart worker `i` (SIGKILL, then its launcher) with `env`, and wait until it answers /healthz.
async fn restart_worker(i: usize, env: &[(&str, &str)]) {
    let (name, _, addr) = WORKERS[i];
    restart_service(name, env);
    let healthy =
        eventually(Duration::from_secs(120), || async { matches!(http_get(&format!("http://{addr}/healthz")).await, Ok((200, _))).then_some(()) }).await;
    assert!(healthy.is_some(), "{name} did not come back");
}

/// The worker each session of `results` opened on.
fn owners(results: &[sandcell_protocol::JobResult]) -> Vec<String> {
    results.iter().map(|r| r.session.as_ref().and_then(|s| s.worker_id.clone()).unwrap_or_default()).collect()
}

#[tokio::test]
async fn a_new_session_goes_to_the_worker_with_most_room_and_a_full_worker_is_offered_none() {
    let _fleet = workers_healthy().await;
    // Room for 32 sessions on the first worker (the default), 3 on the second, 1 on the third.
    restart_worker(1, &[("SANDCELL_WORKER_MAX_SESSIONS", "3")]).await;
    restart_worker(2, &[("SANDCELL_WORKER_MAX_SESSIONS", "1")]).await;
    let t = TestTenant::create(Some(Quotas { max_sessions: 20, max_queued_jobs: 1000, max_jobs_in_flight: 20, ..Default::default() })).await;
    let c = t.client().await;
    // Allow the restarted workers' consumers to register.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // One at a time, new sessions go to the worker with the most room. A worker re-subscribes
    // within 100 ms of a change of its room (briefly absent from the consumers while it does):
    // each session is opened once the last one's change has settled.
    let mut results = Vec::new();
    for _ in 0..4 {
        results.push(run(&c, &open_session(&t.name, "1", Some(120))).await);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let first = owners(&results);
    assert!(first.iter().all(|w| w == WORKERS[0].1), "sessions opened one by one did not all go to the worker with most room: {first:?}");

    // A burst of 12: the small workers take at most their room, and none is offered a session it
    // has no room for (nothing is returned to the queue), so none waits on a full worker.
    let returned_before: Vec<f64> = futures::future::join_all(
        WORKERS.iter().map(|(_, _, addr)| async move { metric_at(addr, "sandcell_worker_opening_jobs_returned_total").await.unwrap_or(0.0) }),
    )
    .await;
    let burst: Vec<_> = (0..12).map(|_| open_session(&t.name, "1", Some(120))).collect();
    for sub in &burst {
        c.submit(sub).await.expect("submit an opening job");
    }
    let mut burst_results = Vec::new();
    for sub in &burst {
        let r = c.wait(&t.name, &sub.job_id, JOB_WAIT).await.expect("opening result");
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        burst_results.push(r);
    }
    let placed = owners(&burst_results);
    let on = |w: &str| placed.iter().filter(|p| p.as_str() == w).count();
    println!("burst of 12 new sessions: {} / {} / {}", on(WORKERS[0].1), on(WORKERS[1].1), on(WORKERS[2].1));
    assert!(on(WORKERS[1].1) <= 3 && on(WORKERS[2].1) <= 1, "a worker held more sessions than its room: {placed:?}");
    for (i, (_, _, addr)) in WORKERS.iter().enumerate() {
        let returned = metric_at(addr, "sandcell_worker_opening_jobs_returned_total").await.unwrap_or(0.0) - returned_before[i];
        // A worker stops consuming once its room is gone, but jobs the broker had already sent
        // on may still arrive (1 or 2 in some CI runs): they go back to the queue at once. What
        // holds is the bound: never more than the worker's room (its prefetch window).
        let room = [32.0, 3.0, 1.0][i];
        println!("worker {} returned {returned} opening jobs", WORKERS[i].1);
        assert!(returned <= room, "worker {} was offered {returned} opening jobs it had no room for", WORKERS[i].1);
    }

    for r in results.iter().chain(&burst_results) {
        run(&c, &close_session(&t.name, &session_id(r))).await;
    }
    // The fleet as it was.
    restart_worker(1, &[]).await;
    restart_worker(2, &[]).await;
}

/// Five sessions, all on the first worker (the others have room for one session while they
/// open, then get their room back), each with a variable, a file its code wrote and an input
/// file. Returns the tenant, a client and the session ids.
async fn five_sessions_on_the_first_worker() -> (TestTenant, sandcell_client::Client, Vec<String>) {
    restart_worker(1, &[("SANDCELL_WORKER_MAX_SESSIONS", "1")]).await;
    restart_worker(2, &[("SANDCELL_WORKER_MAX_SESSIONS", "1")]).await;
    let t = TestTenant::create(Some(Quotas { max_sessions: 20, max_queued_jobs: 1000, max_jobs_in_flight: 20, ..Default::default() })).await;
    let c = t.client().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut sessions = Vec::new();
    for k in 0..5 {
        let code = format!(
            "x = {k}\nopen('notes.txt', 'w').write('session {k}')\nimport pandas as pd\ndf = pd.DataFrame({{'v': [1, 2, {k}]}})\nd = {{'k': {k}}}\n\
             def f(n):\n    return n * 10 + {k}\ngen = (i for i in range(3))"
        );
        let r = run(&c, &open_session(&t.name, &code, Some(600))).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        assert_eq!(owners(std::slice::from_ref(&r)), vec![WORKERS[0].1.to_string()], "session {k} did not open on the first worker");
        let id = session_id(&r);
        let mut with_input = in_session(&t.name, &id, "len(open('data.csv').read())");
        with_input.files = vec![input("data.csv", format!("k,v\n{k},1\n").as_bytes())];
        let r = run(&c, &with_input).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        sessions.push(id);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The other workers get their room back (they hold none of these sessions).
    restart_worker(1, &[]).await;
    restart_worker(2, &[]).await;
    (t, c, sessions)
}

/// After the first worker went away: each session's next two jobs (published without waiting,
/// while its worker is gone) run elsewhere, in order, the first with the session's files and
/// `moved` saying what came along; `cause` is why it moved. After a drain the variables came
/// too (the DataFrame, the dict, the function; not the generator); after a kill, none did.
async fn each_session_continues_elsewhere(t: &TestTenant, c: &sandcell_client::Client, sessions: &[String], cause: sandcell_protocol::MoveCause) {
    let drained = cause == sandcell_protocol::MoveCause::Drained;
    let mut next = Vec::new();
    for id in sessions {
        let code = if drained {
            "print(open('notes.txt').read(), open('data.csv').read().split()[1], x, int(df.v.sum()), d['k'], f(2), 'gen' in globals())"
        } else {
            "print(open('notes.txt').read(), open('data.csv').read().split()[1], 'x' in globals())"
        };
        let first = in_session(&t.name, id, code);
        let second = in_session(&t.name, id, "y = 'after the move'\ny");
        c.submit(&first).await.expect("submit");
        c.submit(&second).await.expect("submit");
        next.push((first, second));
    }
    for (k, (first, second)) in next.iter().enumerate() {
        let a = c.wait(&t.name, &first.job_id, Duration::from_secs(180)).await.expect("first job after the move");
        assert_eq!(a.status, JobStatus::Succeeded, "session {k}: {a:?}");
        let holder = owners(std::slice::from_ref(&a)).remove(0);
        assert_ne!(holder, WORKERS[0].1, "session {k} still ran on the worker that went away");
        // The files came back (the one its code wrote and the input); the variables after a
        // drain only, but for the generator.
        let expected = if drained { format!("session {k} {k},1 {k} {} {k} {} False\n", 3 + k, 20 + k) } else { format!("session {k} {k},1 False\n") };
        assert_eq!(a.execution.stdout, expected, "session {k}: {a:?}");
        let moved = a.execution.moved.as_ref().unwrap_or_else(|| panic!("session {k}: the result does not say the session moved: {a:?}"));
        assert_eq!((moved.from_worker.as_str(), moved.cause), (WORKERS[0].1, cause), "session {k}: {moved:?}");
        let lost = if drained { vec!["gen".to_string()] } else { vec!["*".to_string()] };
        assert_eq!((moved.variables_restored, &moved.variables_lost), (drained, &lost), "session {k}: {moved:?}");
        assert!(moved.files_restored >= 2 && moved.files_missing.is_empty(), "session {k}: {moved:?}");
        let b = c.wait(&t.name, &second.job_id, Duration::from_secs(60)).await.expect("second job after the move");
        assert_eq!((b.status, value(&b).as_deref()), (JobStatus::Succeeded, Some("'after the move'")), "session {k}: {b:?}");
        assert_eq!(owners(std::slice::from_ref(&b)).remove(0), holder, "session {k}: its second job ran on another worker than its first");
        assert!(b.execution.moved.is_none(), "session {k}: only the first job here reports the move: {b:?}");
        run(c, &close_session(&t.name, &sessions[k])).await;
    }
}

#[tokio::test]
async fn a_killed_workers_sessions_continue_on_other_workers_with_their_files_and_say_their_variables_were_lost() {
    let _fleet = workers_healthy().await;
    let (t, c, sessions) = five_sessions_on_the_first_worker().await;
    kill_service(WORKERS[0].0);
    // Its sessions move once the sweeper finds it silent (SANDCELL_WORKER_DEAD_AFTER_S).
    each_session_continues_elsewhere(&t, &c, &sessions, sandcell_protocol::MoveCause::WorkerLost).await;
    let db = service_db().await;
    let moved: i64 = sqlx::query_scalar("SELECT count(*) FROM sessions WHERE session_id = ANY($1) AND moves = 1").bind(&sessions).fetch_one(&db).await.unwrap();
    assert_eq!(moved, 5);
    restart_worker(0, &[]).await;
}

#[tokio::test]
async fn a_drained_workers_sessions_continue_on_other_workers_with_their_files_and_serializable_variables() {
    let _fleet = workers_healthy().await;
    let (t, c, sessions) = five_sessions_on_the_first_worker().await;
    terminate_service(WORKERS[0].0);
    assert!(
        eventually(Duration::from_secs(60), || async { (!service_running(WORKERS[0].0)).then_some(()) }).await.is_some(),
        "the worker did not stop on SIGTERM"
    );
    each_session_continues_elsewhere(&t, &c, &sessions, sandcell_protocol::MoveCause::Drained).await;
    restart_worker(0, &[]).await;
}

#[tokio::test]
async fn a_one_off_job_whose_worker_was_killed_ends_worker_lost_rather_than_running_forever() {
    let _fleet = workers_healthy().await;
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let sub = python(&t.name, "import time\ntime.sleep(300)\nprint('not reached')");
    c.submit(&sub).await.expect("submit");
    // The worker running it, from the job's row.
    let db = service_db().await;
    let holder = eventually(Duration::from_secs(60), || async {
        let row: Option<(String, Option<String>)> = sqlx::query_as("SELECT status, worker_id FROM jobs WHERE tenant = $1 AND job_id = $2")
            .bind(&t.name)
            .bind(&sub.job_id)
            .fetch_optional(&db)
            .await
            .ok()?;
        match row {
            Some((status, Some(w))) if status == "running" => Some(w),
            _ => None,
        }
    })
    .await
    .expect("the job running on some worker");
    let i = WORKERS.iter().position(|w| w.1 == holder).expect("a worker of the fleet");
    kill_service(WORKERS[i].0);
    // The broker hands its message to another worker at once, while the dead worker's heartbeat
    // is still fresh: that copy is dropped (the job may be running), and the sweeper ends the
    // job once the worker has been silent for SANDCELL_WORKER_DEAD_AFTER_S (12 s here).
    let killed = Instant::now();
    let r = c.wait(&t.name, &sub.job_id, Duration::from_secs(90)).await.expect("a result, not a job running forever");
    println!("ended {:?} after the kill: {:?} {:?}", killed.elapsed(), r.status, r.reason.as_ref().map(|x| x.code));
    assert_eq!(
        (r.status, r.reason.as_ref().map(|x| x.code), r.attempts),
        (JobStatus::InfrastructureError, Some(sandcell_protocol::ErrorCode::WorkerLost), 1),
        "{r:?}"
    );
    restart_worker(i, &[]).await;
}

#[tokio::test]
async fn a_database_outage_longer_than_a_workers_silence_ends_no_job_and_moves_no_session() {
    let _fleet = workers_healthy().await;
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let opened = run(&c, &open_session(&t.name, "kept = 42", Some(600))).await;
    assert_eq!(opened.status, JobStatus::Succeeded, "{opened:?}");
    let session = session_id(&opened);
    let mut long = python(&t.name, "import time\ntime.sleep(28)\nprint('outlived the outage')");
    long.timeout_ms = Some(60_000);
    c.submit(&long).await.expect("submit");
    let db = service_db().await;
    let running = eventually(Duration::from_secs(60), || async {
        let s: Option<String> =
            sqlx::query_scalar("SELECT status FROM jobs WHERE tenant = $1 AND job_id = $2").bind(&t.name).bind(&long.job_id).fetch_optional(&db).await.ok()?;
        (s.as_deref() == Some("running")).then_some(())
    })
    .await;
    assert!(running.is_some(), "the long job did not start");
    drop(db);
    // Longer than SANDCELL_WORKER_DEAD_AFTER_S (12 s here): every heartbeat is old when the
    // database comes back, though no worker died.
    let stopped = std::process::Command::new("pg_ctlcluster").args(["15", "main", "stop"]).status().expect("pg_ctlcluster");
    assert!(stopped.success());
    tokio::time::sleep(Duration::from_secs(16)).await;
    let started = std::process::Command::new("pg_ctlcluster").args(["15", "main", "start"]).status().expect("pg_ctlcluster");
    assert!(started.success());
    let r = c.wait(&t.name, &long.job_id, Duration::from_secs(180)).await.expect("the long job's result");
    assert_eq!((r.status, r.execution.stdout.as_str(), r.attempts), (JobStatus::Succeeded, "outlived the outage\n", 1), "{r:?}");
    // The session stayed where it was, its variables with it.
    let next = run(&c, &in_session(&t.name, &session, "kept")).await;
    assert_eq!((next.status, value(&next).as_deref()), (JobStatus::Succeeded, Some("42")), "{next:?}");
    assert!(next.execution.moved.is_none(), "the session moved: {next:?}");
}
