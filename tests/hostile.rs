//! Hostile input that once harmed other tenants: text Postgres cannot store, bodies the intake
//! could not record, names that collided, frames that grew the worker, jobs that got stuck.
//! Each case proves its own clear, recorded outcome and that another tenant's job, running at
//! the same time, is not touched (it runs once and succeeds).

use std::time::Duration;

use sandcell_protocol::{ErrorCode, JobResult, JobStatus};
use sandcell_tests::*;
use sqlx::Row;

/// Held by the tests that measure or grow the worker's memory, so that one's growth is not
/// read as another's (tests of a binary run at once).
static MEMORY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Held by the tests that keep every slot of the worker busy, or wait for another tenant's job
/// within a deadline, so that one's slow cells do not hold up the other's.
static SLOTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A job of another tenant, started before the hostile one and still running while it ends.
struct Bystander {
    tenant: String,
    job_id: String,
}

impl Bystander {
    async fn start(c: &sandcell_client::Client) -> Bystander {
        let sub = python(&tenant(), "import time\ntime.sleep(3)\nprint('bystander done')");
        c.submit(&sub).await.expect("submit");
        Bystander { tenant: sub.tenant, job_id: sub.job_id }
    }

    /// It ran exactly once and succeeded.
    async fn assert_unharmed(&self, c: &sandcell_client::Client) {
        let r = c.wait(&self.tenant, &self.job_id, JOB_WAIT).await.expect("bystander result");
        assert_eq!(
            (r.status, r.execution.stdout.as_str(), r.attempts),
            (JobStatus::Succeeded, "bystander done\n", 1),
            "the other tenant's job was harmed: {r:?}"
        );
    }
}

fn code_of(r: &JobResult) -> Option<ErrorCode> {
    r.reason.as_ref().map(|x| x.code)
}

const NUL_EVERYWHERE: &str = r#"
import sys
from IPython.display import display, HTML
print('out\x00put')
print('err\x00', file=sys.stderr)
display(HTML('<b>\x00\x01\x1b</b>'))
display({'text/plain': 'p\x00', 'application/json': {'k\x00': ['v\x00']}}, raw=True)
class X:
    def __repr__(self):
        return 'r\x00\ud800'
display(X())
raise ValueError('bad\x00value \ud800')
"#;

#[tokio::test]
async fn nul_and_control_characters_in_every_output_kind_are_stored() {
    let c = client().await;
    let by = Bystander::start(&c).await;
    let t = tenant();
    let r = run(&c, &python(&t, NUL_EVERYWHERE)).await;
    assert_eq!(r.status, JobStatus::Failed, "{r:?}");
    assert_eq!(code_of(&r), None, "the job's own exception, not an infrastructure failure: {r:?}");
    assert_eq!(r.attempts, 1, "run once, never again: {r:?}");
    assert_eq!(r.execution.stdout, "out\u{FFFD}put\n", "{r:?}");
    assert_eq!(r.execution.stderr, "err\u{FFFD}\n", "{r:?}");
    let err = r.execution.error.as_ref().expect("the exception");
    assert_eq!(err.ename, "ValueError");
    assert!(err.evalue.contains("bad\u{FFFD}value"), "{err:?}");
    // Every display output is there: NUL became U+FFFD in text, and JSON data keeps its own
    // escaped form (`\u0000` as six characters).
    let dump = serde_json::to_string(&r.execution.outputs).unwrap();
    assert_eq!(r.execution.outputs.len(), 3, "{dump}");
    assert!(dump.contains("<b>\u{FFFD}") && dump.contains("p\u{FFFD}") && dump.contains("r\u{FFFD}"), "{dump}");

    // In a session the job ends too (it used to stay `running`), and the session goes on.
    let open = run(&c, &open_session(&t, "kept = 7", Some(60))).await;
    let sid = session_id(&open);
    let r = run(&c, &in_session(&t, &sid, NUL_EVERYWHERE)).await;
    assert_eq!((r.status, r.attempts), (JobStatus::Failed, 1), "{r:?}");
    let r = run(&c, &in_session(&t, &sid, "kept * 6")).await;
    assert_eq!(value(&r).as_deref(), Some("42"), "{r:?}");
    by.assert_unharmed(&c).await;
}

/// The rows a body left: the job row under `(tenant, job_id)` if any, and the
/// `intake_rejections` rows carrying `message_id`.
async fn outcomes(pool: &sqlx::PgPool, tenant: &str, job_id: &str, message_id: &str) -> (Option<(String, Option<String>)>, i64) {
    let job = sqlx::query("SELECT status, reason->>'code' AS code FROM jobs WHERE tenant = $1 AND job_id = $2")
        .bind(tenant)
        .bind(job_id)
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|r| (r.get::<String, _>("status"), r.get::<Option<String>, _>("code")));
    let rejections: i64 = sqlx::query_scalar("SELECT count(*) FROM intake_rejections WHERE message_id = $1")
        .bind(sandcell_protocol::storable::text(message_id).as_ref())
        .fetch_one(pool)
        .await
        .unwrap();
    (job, rejections)
}

#[tokio::test]
async fn every_hostile_body_gets_exactly_one_recorded_outcome() {
    let c = client().await;
    let by = Bystander::start(&c).await;
    let pool = service_db().await;
    let t = tenant();
    let id = |n: &str| unique(n);
    // (what, body, message id, the job id it names, expected job row code or None = intake_rejections)
    type Case<'a> = (&'a str, Vec<u8>, String, String, Option<&'a str>);
    let nul_lang = id("nul-lang");
    let nul_field = id("nul-field");
    let dup = id("dup");
    let big = id("big");
    let big_body = format!(r#"{{"tenant":"{t}","job_id":"{big}","language":"python","code":"{}"}}"#, "x".repeat((16 << 20) + 1024));
    let cases: Vec<Case> = vec![
        (
            "NUL in a value",
            format!(r#"{{"tenant":"{t}","job_id":"{nul_lang}","language":"py\u0000thon","code":"1"}}"#).into_bytes(),
            id("m"),
            nul_lang.clone(),
            Some("unknown_language"),
        ),
        (
            "NUL in a field name",
            format!(r#"{{"tenant":"{t}","job_id":"{nul_field}","language":"python","code":"1","x\u0000y":1}}"#).into_bytes(),
            id("m"),
            nul_field.clone(),
            Some("unknown_field"),
        ),
        (
            "a repeated key",
            format!(r#"{{"tenant":"{t}","job_id":"{dup}","language":"python","code":"1","code":"2"}}"#).into_bytes(),
            id("m"),
            dup.clone(),
            None,
        ),
        ("invalid UTF-8", b"\xff\xfe{\"job_id\": 1}".to_vec(), id("m"), id("none"), None),
        ("NUL in the message id", b"not json".to_vec(), format!("{}\0x", id("m")), id("none"), None),
        ("a body over the protocol's size", big_body.into_bytes(), id("m"), big.clone(), Some("oversize_message")),
    ];
    for (what, body, message_id, _, _) in &cases {
        c.submit_raw(body, Some(message_id)).await.unwrap_or_else(|e| panic!("{what}: the broker refused it: {e}"));
    }
    for (what, _, message_id, job_id, expected) in &cases {
        let seen = eventually(Duration::from_secs(30), || async {
            let (job, rejections) = outcomes(&pool, &t, job_id, message_id).await;
            (job.is_some() || rejections > 0).then_some((job, rejections))
        })
        .await;
        let (job, rejections) = seen.unwrap_or_else(|| panic!("{what}: no recorded outcome"));
        match expected {
            Some(code) => assert_eq!((job, rejections), (Some(("rejected".to_string(), Some(code.to_string()))), 0), "{what}"),
            None => assert_eq!((job, rejections), (None, 1), "{what}: one intake_rejections row"),
        }
    }
    // Recorded on the first delivery: a redelivery loop would have added rows by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (what, _, message_id, job_id, expected) in &cases {
        if expected.is_none() {
            assert_eq!(outcomes(&pool, &t, job_id, message_id).await.1, 1, "{what}: recorded once");
        }
    }
    by.assert_unharmed(&c).await;
}

#[tokio::test]
async fn names_that_cannot_be_told_apart_are_skipped_and_figures_never_overwrite_files() {
    let c = client().await;
    let code = r#"
import os
import matplotlib.pyplot as plt
open(b'a\xff', 'wb').write(b'one')
open(b'a\xfe', 'wb').write(b'two')
os.makedirs('_display', exist_ok=True)
open('_display/1.png', 'wb').write(b'mine')
plt.plot([1, 2, 3])
"#;
    let r = run(&c, &python(&tenant(), code)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let skipped: Vec<_> = r.execution.skipped_files.iter().map(|s| (s.path.as_str(), s.reason.as_str())).collect();
    assert_eq!(skipped, [("a\u{FFFD}", "invalid_name"), ("a\u{FFFD}", "invalid_name")], "{r:?}");
    let file = r.artifacts.iter().find(|a| a.path == "_display/1.png").expect("the job's own file");
    assert_eq!(file.size_bytes, 4, "the job's file keeps its own bytes: {r:?}");
    let figure = displayed_png(&r).expect("the figure");
    assert_ne!(figure, "_display/1.png", "{r:?}");
    let fig = r.artifacts.iter().find(|a| a.path == figure).expect("figure artifact");
    assert!(fig.size_bytes > 1000, "{fig:?}");
}

#[tokio::test]
async fn figures_count_against_the_tenants_stored_bytes() {
    let quotas = sandcell_core::tenants::Quotas { max_artifact_bytes: 1000, ..Default::default() };
    let tenant = TestTenant::create(Some(quotas)).await;
    let c = tenant.client().await;
    let r = run(&c, &python(&tenant.name, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert!(displayed_png(&r).is_none(), "a figure beyond the quota is not stored: {r:?}");
    let skipped: Vec<_> = r.execution.skipped_files.iter().map(|s| (s.path.as_str(), s.reason.as_str())).collect();
    assert_eq!(skipped, [("_display/1.png", "quota_exceeded")], "{r:?}");
    let stored: i64 = sqlx::query_scalar("SELECT COALESCE(sum(size_bytes), 0)::bigint FROM artifacts WHERE tenant = $1")
        .bind(&tenant.name)
        .fetch_one(&service_db().await)
        .await
        .unwrap();
    assert_eq!(stored, 0);
}

#[tokio::test]
async fn a_forged_giant_frame_fails_its_job_without_growing_the_worker() {
    let _memory = MEMORY.lock().await;
    let c = client().await;
    let by = Bystander::start(&c).await;
    let t = tenant();
    // The code finds the only channel it can reach, its kernel's to the driver, announces a
    // 600 MB frame and streams bytes. The driver reads none of it: it ends the kernel and says so.
    // (Were the driver itself subverted, the worker would still refuse such a frame unbuffered:
    // unit `frames::an_oversize_length_prefix_is_refused_before_buffering`.)
    // (The kernel freezes its start-up objects for the garbage collector, which hides them from
    // gc.get_objects; hostile code simply unfreezes them.)
    let code = r#"
import gc, os, struct
gc.unfreeze()
ch = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
os.write(ch.out_fd, struct.pack('>I', 600 << 20))
chunk = b'x' * (1 << 20)
for _ in range(600):
    os.write(ch.out_fd, chunk)
"#;
    let before = worker_rss_kb();
    let mut sub = python(&t, code);
    // Far less than the frame (600 MB); under gVisor a 128 MB sandbox sometimes cannot even hold
    // the preloaded libraries (`sandbox_unavailable`, seen once in CI).
    sub.memory_mb = Some(256);
    let r = run(&c, &sub).await;
    let after = worker_rss_kb();
    assert_eq!(code_of(&r), Some(ErrorCode::DriverProtocol), "{r:?}");
    assert!(r.reason.as_ref().is_some_and(|x| x.message.contains("frame too large")), "{r:?}");
    if let (Some(before), Some(after)) = (before, after) {
        eprintln!("worker RSS before {before} kB, after {after} kB");
        assert!(after < before + 100 * 1024, "the worker grew from {before} kB to {after} kB");
    }
    assert_worker_serves(&c, &t, &r.worker_id).await;
    by.assert_unharmed(&c).await;
}

#[tokio::test]
async fn a_job_stuck_in_queued_is_ended_and_its_quota_released() {
    let pool = service_db().await;
    let t = tenant();
    let (job_id, session) = (unique("stuck"), format!("ses_{}", uuid::Uuid::new_v4().simple()));
    // What a lost message leaves behind: a job that never reached a worker, two hours ago,
    // and the session it was to open.
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 20, 1000, 1000000)")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO sessions (session_id, tenant, state, keep_alive_s, created_by_job, created_at) VALUES ($1, $2, 'starting', 60, $3, now() - interval '2 hours')")
        .bind(&session)
        .bind(&t)
        .bind(&job_id)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO jobs (tenant, job_id, status, language, session_id, execution, queued_at)
         VALUES ($1, $2, 'queued', 'python', $3, $4, now() - interval '2 hours')",
    )
    .bind(&t)
    .bind(&job_id)
    .bind(&session)
    .bind(serde_json::to_value(sandcell_protocol::Execution::default()).unwrap())
    .execute(&pool)
    .await
    .unwrap();
    let c = client().await;
    let r = eventually(Duration::from_secs(30), || async { c.result(&t, &job_id).await.ok().flatten().filter(|r| r.status != JobStatus::Queued) }).await;
    let r = r.expect("the stuck job was ended");
    assert_eq!((r.status, code_of(&r)), (JobStatus::Rejected, Some(ErrorCode::Stuck)), "{r:?}");
    let state: String = sqlx::query_scalar("SELECT state FROM sessions WHERE session_id = $1").bind(&session).fetch_one(&pool).await.unwrap();
    assert_eq!(state, "failed");
    // Nothing of the tenant's counts against its quotas any more.
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1 AND status IN ('queued', 'running')").bind(&t).fetch_one(&pool).await.unwrap();
    assert_eq!(live, 0);
}

#[tokio::test]
async fn a_job_running_far_past_its_time_limit_on_a_live_worker_is_ended_stuck() {
    let pool = service_db().await;
    let t = tenant();
    let job_id = unique("overdue");
    // What a worker that lost track of a job leaves behind (a claim whose answer was lost, a
    // commit that gave up) while it keeps beating: a job `running` on it, claimed an hour ago
    // with a 30 s limit. No silence will ever end it.
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 20, 1000, 1000000)")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    let worker: String = sqlx::query_scalar("SELECT worker_id FROM workers ORDER BY last_seen_at DESC LIMIT 1").fetch_one(&pool).await.unwrap();
    // The limits every job gets by default (30 s), copied from a job the stack just ran.
    let c = client().await;
    let model = run(&c, &python(&t, "1")).await;
    let limits = serde_json::to_value(model.limits.expect("the limits of a finished job")).unwrap();
    sqlx::query(
        "INSERT INTO jobs (tenant, job_id, status, language, limits, execution, queued_at, started_at, worker_id)
         VALUES ($1, $2, 'running', 'python', $5, $3, now() - interval '1 hour', now() - interval '1 hour', $4)",
    )
    .bind(&t)
    .bind(&job_id)
    .bind(serde_json::to_value(sandcell_protocol::Execution::default()).unwrap())
    .bind(&worker)
    .bind(&limits)
    .execute(&pool)
    .await
    .unwrap();
    let r = eventually(Duration::from_secs(30), || async { c.result(&t, &job_id).await.ok().flatten().filter(|r| r.status != JobStatus::Running) }).await;
    let r = r.expect("the overdue job was ended");
    assert_eq!((r.status, code_of(&r)), (JobStatus::InfrastructureError, Some(ErrorCode::Stuck)), "{r:?}");
    // A job that is merely long is left alone: this one's limit is far off.
    let long = python(&t, "import time\ntime.sleep(4)\nprint('done')");
    let r = run(&c, &long).await;
    assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, "done\n"), "{r:?}");
}

#[tokio::test]
async fn a_sandbox_that_dies_while_starting_is_replaced_before_the_job_fails() {
    let c = client().await;
    let retries_before = worker_metric("sandcell_worker_sandbox_start_retries_total").await.unwrap_or(0.0);
    // 64 MB cannot hold the preloaded numpy, pandas and matplotlib: every sandbox dies while it
    // starts. It is tried three times, and the job ends with the worker's own error.
    let mut sub = python(&tenant(), "print('never')");
    sub.memory_mb = Some(64);
    let r = run(&c, &sub).await;
    assert_eq!((r.status, code_of(&r)), (JobStatus::InfrastructureError, Some(ErrorCode::SandboxUnavailable)), "{r:?}");
    assert!(r.reason.as_ref().is_some_and(|x| x.message.contains("failed to start 3 times")), "{r:?}");
    let retries = worker_metric("sandcell_worker_sandbox_start_retries_total").await.unwrap_or(0.0) - retries_before;
    assert!(retries >= 2.0, "replaced {retries} times");
    assert_worker_serves(&c, &r.tenant, &r.worker_id).await;
}

#[tokio::test]
async fn a_job_cannot_reach_the_socket_its_driver_speaks_on() {
    let c = client().await;
    let code = "import os, socket\n\
                try:\n    print('listed', os.listdir('/run/sandcell'))\nexcept OSError as e:\n    print('listdir refused')\n\
                s = socket.socket(socket.AF_UNIX)\n\
                try:\n    s.connect('/run/sandcell/worker.sock')\n    print('connected')\nexcept OSError as e:\n    print('connect refused')\n\
                print('SANDCELL_CHANNEL' in os.environ)";
    let t = tenant();
    let opened = run(&c, &open_session(&t, code, None)).await;
    let one_off = run(&c, &python(&t, code)).await;
    for r in [opened, one_off] {
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        assert_eq!(r.execution.stdout, "listdir refused\nconnect refused\nFalse\n", "{r:?}");
    }
}

/// The intake dead-letters whole every message it cannot attribute, and nothing consumes
/// `sandcell.dead`: a tenant publishing such messages at the broker's largest size would grow it
/// until the broker's disk alarm blocked every publisher. The queue keeps the newest 256 MiB
/// (the operator policy set where tenants are made): a flood past that leaves it within its
/// bound, every message is still recorded, and another tenant's job runs as if nothing happened.
#[tokio::test]
async fn a_tenants_flood_of_undecodable_messages_keeps_the_dead_letters_within_their_bound() {
    const BODY_BYTES: u64 = 16 << 20;
    let flooder = TestTenant::create(None).await;
    let fc = flooder.client().await;
    let c = client().await;
    let by = Bystander::start(&c).await;
    // Making a tenant sets the policy; the broker's statistics show it within 5 s.
    let bound = eventually(Duration::from_secs(60), || async {
        let q = broker_queue(sandcell_core::broker::DEAD_LETTER_QUEUE).await.ok()?;
        q["effective_policy_definition"]["max-length-bytes"].as_u64().filter(|b| *b == sandcell_core::broker::DEAD_LETTER_MAX_BYTES)
    })
    .await;
    assert!(bound.is_some(), "sandcell.dead is not held to its bound");
    // Past the bound by two messages, even with the queue empty before.
    let n = sandcell_core::broker::DEAD_LETTER_MAX_BYTES / BODY_BYTES + 2;
    let body = vec![b'x'; BODY_BYTES as usize];
    let prefix = unique("flood");
    for i in 0..n {
        fc.submit_raw(&body, Some(&format!("{prefix}-{i}"))).await.expect("publishing a message the intake cannot read");
    }
    let pool = service_db().await;
    let recorded = eventually(Duration::from_secs(120), || async {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM intake_rejections WHERE message_id LIKE $1 AND publisher = $2 AND code = 'malformed_json'")
            .bind(format!("{prefix}-%"))
            .bind(&flooder.name)
            .fetch_one(&pool)
            .await
            .ok()?;
        (count == n as i64).then_some(count)
    })
    .await;
    assert_eq!(recorded, Some(n as i64), "every message of the flood is recorded");
    // The intake dead-letters after it records; the broker's statistics are refreshed every 5 s
    // (later on a loaded machine): none read from now on predates the flood. Within the bound,
    // and holding the flood's newest messages; a figure over the bound fails at once.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let bound = sandcell_core::broker::DEAD_LETTER_MAX_BYTES;
    let last = std::sync::atomic::AtomicU64::new(0);
    let settled = eventually(Duration::from_secs(60), || async {
        let dead = broker_queue(sandcell_core::broker::DEAD_LETTER_QUEUE).await.ok()?;
        let b = dead["message_bytes"].as_u64()?;
        last.store(b, std::sync::atomic::Ordering::Relaxed);
        assert!(b <= bound, "{b} bytes of dead letters after {n} messages of {BODY_BYTES}: over the bound of {bound}");
        (b >= bound - 2 * BODY_BYTES).then_some(b)
    })
    .await;
    let bytes = last.load(std::sync::atomic::Ordering::Relaxed);
    assert!(settled.is_some(), "{bytes} bytes of dead letters after {n} messages of {BODY_BYTES}");
    by.assert_unharmed(&c).await;
}

/// Each message the intake cannot attribute is recorded for operators in `intake_rejections`,
/// the newest `KEPT_INTAKE_REJECTIONS` of each publisher: a tenant publishing such messages
/// without end cannot grow the table without bound.
#[tokio::test]
async fn a_tenants_unreadable_messages_are_recorded_up_to_the_newest_thousand() {
    let kept = sandcell_core::jobs::KEPT_INTAKE_REJECTIONS;
    let flooder = TestTenant::create(None).await;
    let fc = flooder.client().await;
    let prefix = unique("unreadable");
    let sent = kept + 500;
    for i in 0..sent {
        fc.submit_raw(b"not json", Some(&format!("{prefix}-{i}"))).await.expect("publishing a message the intake cannot read");
    }
    let pool = service_db().await;
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM intake_rejections WHERE publisher = $1")
            .bind(&flooder.name)
            .fetch_one(&pool)
            .await
            .expect("counting")
    };
    let last = format!("{prefix}-{}", sent - 1);
    let recorded = eventually(Duration::from_secs(120), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM intake_rejections WHERE message_id = $1").bind(&last).fetch_one(&pool).await.ok()?;
        (n == 1 && count().await >= kept).then_some(())
    })
    .await;
    assert!(recorded.is_some(), "the flood's last message was not recorded");
    // Whatever is still being handled lands too; then the publisher has about `kept` rows, not
    // `sent` (messages handled at once may each keep a row another removes: a few more).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = count().await;
    assert!((kept..kept + 100).contains(&n), "{n} intake rejections of one publisher after {sent} messages");
}

/// A refusal quotes what was wrong (a path, a tenant's name); a tenant sending a value of
/// megabytes must not have it stored whole in every refusal: a job's reason and an upload's are
/// cut to 4 KiB.
#[tokio::test]
async fn a_refusal_quoting_a_huge_value_is_stored_cut() {
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let max = sandcell_protocol::MAX_REASON_MESSAGE_BYTES;
    let huge = "p".repeat(4 << 20);
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let mut sub = python(&t.name, "print('never runs')");
    sub.files.push(input(&huge, b"x"));
    let r = run(&c, &sub).await;
    assert_eq!(code_of(&r), Some(ErrorCode::InvalidFilePath), "{:?}", r.reason.as_ref().map(|x| x.message.len()));
    let message = r.reason.map(|x| x.message).unwrap_or_default();
    assert!(message.len() <= max && message.ends_with(" bytes cut)"), "a job's reason of {} bytes", message.len());
    let req = UploadRequest { tenant: t.name.clone(), upload_id: unique("up"), files: vec![UploadFile { path: huge.clone(), size_bytes: 1 }] };
    c.request_upload(&req).await.expect("requesting an upload");
    let grant = eventually(Duration::from_secs(60), || async { c.upload_grant(&t.name, &req.upload_id).await.ok().flatten() }).await.expect("an answer");
    let reason = grant.reason.expect("a refusal");
    assert_eq!(reason.code, ErrorCode::InvalidFilePath);
    assert!(reason.message.len() <= max, "an upload's reason of {} bytes", reason.message.len());
}

/// A job displaying 64 outputs, each with every kept text type at just under 64 KiB: before,
/// each part was kept inline whole and the result Postgres kept was 20.8 MB of text (so a
/// tenant could fill the database shared by all with a few thousand such jobs). Now the text
/// kept inline over all its rich outputs is within the job's `stdout_bytes`, the rest is stored
/// in full while the artifact limits allow (or named as skipped), and the result stays small.
#[tokio::test]
async fn a_job_displaying_many_large_outputs_keeps_its_result_within_its_output_limit() {
    let _memory = MEMORY.lock().await;
    let c = client().await;
    let by = Bystander::start(&c).await;
    let t = tenant();
    let code = r#"
import random, string
from IPython.display import display
for i in range(64):
    # Random text, so that the figure below is not Postgres' compression.
    big = ''.join(random.choices(string.ascii_letters, k=65000))
    display({'text/plain': big, 'text/html': big, 'text/markdown': big, 'image/svg+xml': big,
             'application/json': {'k': big}}, raw=True)
print('done')
"#;
    let r = run(&c, &python(&t, code)).await;
    assert_eq!((r.status, r.execution.stdout.as_str(), r.execution.outputs.len()), (JobStatus::Succeeded, "done\n", 64), "{:?}", r.reason);
    let limit = sandcell_protocol::LimitPolicy::default().default.stdout_bytes as usize;
    let texts = || {
        r.execution.outputs.iter().flat_map(|o| match o {
            sandcell_protocol::Output::ExecuteResult { data, .. } | sandcell_protocol::Output::DisplayData { data, .. } => data.values(),
        })
    };
    let inline: usize = texts().map(String::len).sum();
    let markers = texts().filter(|s| s.ends_with("[truncated by sandcell]")).count();
    assert!(inline <= limit + markers * 32, "{inline} bytes of output text kept inline, over the job's {limit}");
    assert!(markers > 0 && (!r.artifacts.is_empty() || !r.execution.skipped_files.is_empty()), "what was cut was neither stored nor named");
    let pool = service_db().await;
    let stored: i64 = sqlx::query_scalar("SELECT octet_length(execution::text)::bigint FROM jobs WHERE tenant = $1 AND job_id = $2")
        .bind(&t)
        .bind(&r.job_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    eprintln!("result document: {stored} bytes; inline output text {inline} bytes, {markers} parts cut, {} stored", r.artifacts.len());
    assert!((stored as usize) < 2 * limit, "the result Postgres keeps is {stored} bytes");
    assert_worker_serves(&c, &t, &r.worker_id).await;
    by.assert_unharmed(&c).await;
}

/// Before, every result, refusal and upload answer stayed in Postgres for ever: the database
/// all tenants share grew with each tenant's history. Now the sweeper deletes them
/// `SANDCELL_RESULT_RETENTION_S` (30 days here, as by default) after they ended: aged here by
/// 31 days, a one-off result, a refusal and a refused upload request are deleted, and the job id
/// may be used again; a result whose stored file is still available, and the jobs of a session
/// still open, are kept, until the session ends. An ended session's own row (and the gateway's
/// rows for it) stayed for ever: now it goes after its jobs.
#[tokio::test]
async fn results_past_their_retention_are_deleted_unless_a_live_session_or_a_stored_file_needs_them() {
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let c = client().await;
    let pool = service_db().await;
    let t = tenant();
    let one_off = run(&c, &python(&t, "print('first')")).await;
    let with_file = run(&c, &python(&t, "open('kept.txt', 'w').write('kept')")).await;
    assert_eq!((one_off.status, with_file.status, with_file.artifacts.len()), (JobStatus::Succeeded, JobStatus::Succeeded, 1), "{with_file:?}");
    let opened = run(&c, &open_session(&t, "n = 1", Some(600))).await;
    let sid = session_id(&opened);
    let in_it = run(&c, &in_session(&t, &sid, "n += 1")).await;
    let refused = run(&c, &in_session(&t, "no-such-session", "n")).await;
    assert_eq!((in_it.status, refused.status), (JobStatus::Succeeded, JobStatus::Rejected), "{refused:?}");
    let file = || UploadFile { path: "a.csv".into(), size_bytes: 10 };
    let upload = UploadRequest { tenant: t.clone(), upload_id: unique("up"), files: vec![file(), file()] };
    c.request_upload(&upload).await.expect("requesting an upload");
    let answer = eventually(Duration::from_secs(30), || async { c.upload_grant(&t, &upload.upload_id).await.ok().flatten() }).await;
    assert_eq!(answer.map(|g| g.status), Some("rejected".to_string()), "duplicate paths are refused");

    let jobs_of = |ids: Vec<String>| {
        let (pool, t) = (pool.clone(), t.clone());
        async move {
            sqlx::query_scalar::<_, String>("SELECT job_id FROM jobs WHERE tenant = $1 AND job_id = ANY($2) ORDER BY job_id")
                .bind(&t)
                .bind(&ids)
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    let all = vec![one_off.job_id.clone(), with_file.job_id.clone(), opened.job_id.clone(), in_it.job_id.clone(), refused.job_id.clone()];
    let mut kept = vec![with_file.job_id.clone(), opened.job_id.clone(), in_it.job_id.clone()];
    kept.sort();
    sqlx::query("UPDATE jobs SET finished_at = finished_at - interval '31 days' WHERE tenant = $1").bind(&t).execute(&pool).await.unwrap();
    sqlx::query("UPDATE uploads SET created_at = created_at - interval '31 days' WHERE tenant = $1").bind(&t).execute(&pool).await.unwrap();
    let swept = eventually(Duration::from_secs(30), || async {
        let left = jobs_of(all.clone()).await;
        let uploads: i64 = sqlx::query_scalar("SELECT count(*) FROM uploads WHERE tenant = $1").bind(&t).fetch_one(&pool).await.ok()?;
        (left == kept && uploads == 0).then_some(())
    })
    .await;
    assert!(swept.is_some(), "left after the sweep: {:?} (expected {kept:?})", jobs_of(all.clone()).await);
    assert!(c.result(&t, &one_off.job_id).await.unwrap().is_none(), "a deleted result is unknown");
    // The kept result is whole, its file still listed.
    let again = c.result(&t, &with_file.job_id).await.unwrap().expect("the result with a stored file");
    assert_eq!(again.artifacts.len(), 1, "{again:?}");

    // The id of a deleted job is a new job's.
    let mut reused = python(&t, "print('second')");
    reused.job_id = one_off.job_id.clone();
    let r = run(&c, &reused).await;
    assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, "second\n"), "{r:?}");

    // Once the session ends, its jobs go too (aged again: the close is one of them), then the
    // session's own row, and the rows the E2B gateway keeps for a sandbox (written here as the
    // gateway writes them, for this session).
    sqlx::query("INSERT INTO gateway_sandboxes (session_id, tenant, template_id, cpu_count, memory_mb, disk_mb) VALUES ($1, $2, 'base', 1, 512, 1024)")
        .bind(&sid)
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO gateway_contexts (session_id, context_id, namespace, language, cwd) VALUES ($1, 'ctx', 'ns', 'python', '/home/user')")
        .bind(&sid)
        .execute(&pool)
        .await
        .unwrap();
    let closed = run(&c, &close_session(&t, &sid)).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{closed:?}");
    let rows_of_session = || {
        let (pool, sid) = (pool.clone(), sid.clone());
        async move {
            sqlx::query_as::<_, (i64, i64, i64, i64)>(
                "SELECT (SELECT count(*) FROM jobs WHERE session_id = $1), (SELECT count(*) FROM sessions WHERE session_id = $1),
                        (SELECT count(*) FROM gateway_sandboxes WHERE session_id = $1), (SELECT count(*) FROM gateway_contexts WHERE session_id = $1)",
            )
            .bind(&sid)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    // Ended long ago, but its jobs are not yet past their retention: the session stays with them.
    sqlx::query("UPDATE sessions SET ended_at = now() - interval '31 days' WHERE session_id = $1").bind(&sid).execute(&pool).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // (Its first jobs, aged above, may go now; the close is recent.) The retention's own pass
    // leaves it without an error: had it tried to delete the session, the jobs' foreign key
    // would have failed it.
    sandcell_core::retention::forget_sessions(&pool, Duration::from_secs(30 * 86_400), 500).await.expect("a retention pass over sessions");
    let kept = rows_of_session().await;
    assert!(kept.0 >= 1 && (kept.1, kept.2, kept.3) == (1, 1, 1), "(jobs, session, gateway sandbox, contexts) after sweeps with a job kept: {kept:?}");
    sqlx::query("UPDATE jobs SET finished_at = now() - interval '31 days' WHERE tenant = $1 AND session_id = $2")
        .bind(&t)
        .bind(&sid)
        .execute(&pool)
        .await
        .unwrap();
    let session_gone = eventually(Duration::from_secs(30), || async { (rows_of_session().await == (0, 0, 0, 0)).then_some(()) }).await;
    assert!(session_gone.is_some(), "(jobs, session, gateway sandbox, contexts) left of an ended session: {:?}", rows_of_session().await);
    // A job naming it now is refused as naming no session.
    let late = run(&c, &in_session(&t, &sid, "n")).await;
    assert_eq!((late.status, late.reason.as_ref().map(|r| r.code)), (JobStatus::Rejected, Some(ErrorCode::SessionNotFound)), "{late:?}");
}

/// Before, a worker held every session job it took from its queue (up to 256) whole in memory,
/// twice (the message, and the decoded job in the session's mailbox): one tenant's session
/// running a slow cell, fed jobs carrying 10 MiB of inline files, grew the worker until its
/// pod's memory limit killed it with every other tenant's sessions. Now waiting jobs hold their
/// inputs only within `SANDCELL_WORKER_HELD_INPUT_BYTES` (64 MiB): the others leave them in
/// Postgres and read them back when their turn comes. Each job still gets its file intact, in
/// order.
#[tokio::test]
async fn a_sessions_backlog_of_large_inputs_does_not_grow_the_worker_past_its_budget() {
    let _memory = MEMORY.lock().await;
    let c = client().await;
    let by = Bystander::start(&c).await;
    let t = tenant();
    let opened = run(&c, &open_session(&t, "n = 0", Some(600))).await;
    let sid = session_id(&opened);
    let left_before = worker_metric("sandcell_worker_inputs_left_in_postgres_total").await.unwrap_or(0.0);
    let rss_before = worker_rss_kb().expect("the worker's memory");
    const JOBS: usize = 30;
    let (subs, expected) = hashed_input_backlog(&t, &sid, JOBS);
    // A slow cell first, so that the others wait in the worker, until 15 of them arrived there
    // with their inputs left in Postgres (or two minutes passed); its memory sampled meanwhile.
    // Then the slow cell is cancelled and the others run.
    let mut first = in_session(&t, &sid, "import time\ntime.sleep(280)");
    first.timeout_ms = Some(290_000);
    c.submit(&first).await.expect("submit");
    let sampling = tokio::spawn(async move {
        let mut peak = rss_before;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            peak = peak.max(worker_rss_kb().unwrap_or(0));
            let left = worker_metric("sandcell_worker_inputs_left_in_postgres_total").await.unwrap_or(0.0) - left_before;
            if left >= 15.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        peak
    });
    for s in &subs {
        c.submit(s).await.expect("submit");
    }
    let peak = sampling.await.expect("sampling the worker's memory");
    c.cancel(&t, &first.job_id, &sid).await.expect("cancelling the slow cell");
    let slow = c.wait(&t, &first.job_id, JOB_WAIT).await.expect("the slow cell's result");
    assert_eq!(slow.status, JobStatus::Cancelled, "{slow:?}");
    for (i, s) in subs.iter().enumerate() {
        let r = c.wait(&s.tenant, &s.job_id, JOB_WAIT).await.expect("result");
        assert_eq!((r.status, r.execution.stdout.clone()), (JobStatus::Succeeded, expected[i].clone()), "job {i}: {:?}", r.reason);
    }
    let left = worker_metric("sandcell_worker_inputs_left_in_postgres_total").await.unwrap_or(0.0) - left_before;
    let grown_mb = peak.saturating_sub(rss_before) / 1024;
    eprintln!("worker RSS {rss_before} kB before, {peak} kB at most while {JOBS} jobs of 4 MiB waited; {left} left their inputs in Postgres");
    assert!(left >= 15.0, "only {left} jobs left their inputs in Postgres: the budget was not applied");
    // 30 × 4 MiB (5.3 MiB as base64) waited: before, the worker grew by ~330 MiB.
    assert!(grown_mb < 160, "the worker grew by {grown_mb} MiB while the jobs waited");
    by.assert_unharmed(&c).await;
}

/// A workspace path may be 1024 bytes; an object key (`<tenant>/<job_id>/<path>`) no longer, and
/// Garage's LMDB engine takes 479. Before, such a file failed its job's storing at its upload
/// (`storage_failed`, a Garage internal error quoting an LMDB key error) and the files uploaded
/// before it stayed in the store, recorded and counted nowhere: a tenant could fill the store
/// every tenant shares, 100 MiB a job. Now the file is skipped (`invalid_path`) before anything
/// is uploaded, and the job's other files are stored.
#[tokio::test]
async fn a_file_whose_key_the_store_would_refuse_is_skipped_and_the_other_files_are_stored() {
    let c = client().await;
    let t = tenant();
    let code = r#"
import os
open('a.bin', 'wb').write(os.urandom(100_000))
d = '/'.join(['z' * 200] * 4)
os.makedirs(d, exist_ok=True)
open(d + '/' + 'f' * 150, 'w').write('x')
"#;
    let r = run(&c, &python(&t, code)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.reason);
    let stored: Vec<&str> = r.artifacts.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(stored, vec!["a.bin"], "{r:?}");
    let skipped: Vec<(usize, &str)> = r.execution.skipped_files.iter().map(|f| (f.path.len(), f.reason.as_str())).collect();
    assert_eq!(skipped, vec![(954, "invalid_path")], "{:?}", r.execution.skipped_files);
    assert!(r.execution.limits_hit.is_empty() || r.execution.limits_hit.contains(&sandcell_protocol::LimitHit::Artifacts), "{r:?}");
}

/// A job naming one upload under many paths gets no more fetched for it than its workspace
/// holds (`limits.workspace_mb`, 256 MiB here): 14 copies of a 20 MB upload are refused
/// `upload_failed` before anything runs, saying why, and the worker — which before held every
/// copy in memory, several times over — runs the tenant's next job, whose two copies fit.
#[tokio::test]
async fn a_job_naming_one_upload_under_more_paths_than_its_workspace_holds_is_refused_before_it_runs() {
    let c = client().await;
    let t = tenant();
    let store = sandcell_core::store::ArtifactStore::new(&sandcell_core::config::Services::from_env().unwrap().s3);
    let big: Vec<u8> = (0..20_000_000u32).map(|i| (i % 251) as u8).collect();
    let key = store.upload_input(&t, "twenty.bin", big).await.unwrap();
    let named = |n: usize| -> Vec<sandcell_protocol::InputFile> {
        (0..n).map(|i| sandcell_protocol::InputFile { path: format!("copy{i}.bin"), content_b64: None, s3_key: Some(key.clone()) }).collect()
    };
    let mut greedy = python(&t, "print('ran')");
    greedy.files = named(14);
    let r = run(&c, &greedy).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(r.reason.as_ref().map(|e| e.code), Some(ErrorCode::UploadFailed), "{r:?}");
    let why = r.reason.as_ref().map(|e| e.message.clone()).unwrap_or_default();
    assert!(why.contains("limits.workspace_mb") && why.contains("copy13.bin"), "{why}");
    assert!(r.execution.stdout.is_empty(), "{r:?}");
    let mut fits = python(&t, "import os\nprint(sorted(os.path.getsize(f'copy{i}.bin') for i in range(2)))");
    fits.files = named(2);
    let r = run(&c, &fits).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.execution.stdout, "[20000000, 20000000]\n", "{r:?}");
}

/// A job's uploads are fetched before its cell and wait with it for a slot, in each session the
/// worker holds. Before, each job's fetch was bounded only by its workspace: one tenant's
/// sessions, each given a job naming a 30 MB upload under 3 paths while the worker's slots were
/// busy, made it hold all of them at once (~115 MiB as base64 a job: ten sessions, over 1 GiB;
/// in a pod, a memory limit kills the worker with every other tenant's sessions). Now what the
/// worker's jobs fetch is held within `SANDCELL_WORKER_FETCH_BYTES` (256 MiB): the jobs past it
/// wait to be fetched, and each still gets its files intact.
#[tokio::test]
async fn a_tenants_sessions_fetching_large_uploads_at_once_do_not_grow_the_worker_past_its_fetch_budget() {
    let _memory = MEMORY.lock().await;
    let _slots = SLOTS.lock().await;
    let c = client().await;
    let t = tenant();
    let store = sandcell_core::store::ArtifactStore::new(&sandcell_core::config::Services::from_env().unwrap().s3);
    let big: Vec<u8> = (0..30_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let digest = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&big));
    let key = store.upload_input(&t, "thirty.bin", big).await.unwrap();
    // Four sessions hold the slots (the stack's worker has 4) with a slow cell; ten others each
    // get a job naming the upload three times, which then waits for a slot.
    const HOLDERS: usize = 4;
    const FETCHERS: usize = 10;
    let opening: Vec<_> = (0..HOLDERS + FETCHERS).map(|_| open_session(&t, "n = 0", Some(600))).collect();
    for s in &opening {
        c.submit(s).await.expect("submit");
    }
    let mut sessions = Vec::new();
    for s in &opening {
        let r = c.wait(&t, &s.job_id, JOB_WAIT).await.expect("a session opened");
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        sessions.push(session_id(&r));
    }
    let holders: Vec<_> = sessions[..HOLDERS]
        .iter()
        .map(|sid| {
            let mut s = in_session(&t, sid, "import time\ntime.sleep(280)");
            s.timeout_ms = Some(290_000);
            s
        })
        .collect();
    for s in &holders {
        c.submit(s).await.expect("submit");
    }
    let busy = async {
        while worker_metric("sandcell_worker_busy_slots").await.unwrap_or(0.0) < HOLDERS as f64 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), busy).await.expect("the slow cells hold every slot");
    let by = Bystander::start(&c).await;
    let waits_before = worker_metric("sandcell_worker_fetch_budget_waits_total").await.unwrap_or(0.0);
    let rss_before = worker_rss_kb().expect("the worker's memory");
    let code = "import hashlib\nprint(sorted({hashlib.sha256(open(f'c{i}.bin', 'rb').read()).hexdigest() for i in range(3)}))";
    let fetchers: Vec<_> = sessions[HOLDERS..]
        .iter()
        .map(|sid| {
            let mut s = in_session(&t, sid, code);
            s.files = (0..3).map(|i| sandcell_protocol::InputFile { path: format!("c{i}.bin"), content_b64: None, s3_key: Some(key.clone()) }).collect();
            s
        })
        .collect();
    for s in &fetchers {
        c.submit(s).await.expect("submit");
    }
    // Long enough for every job to be fetched without the budget (~1 GB from the local store).
    let mut peak = rss_before;
    let sampled = std::time::Instant::now();
    while sampled.elapsed() < Duration::from_secs(25) {
        peak = peak.max(worker_rss_kb().unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waits = worker_metric("sandcell_worker_fetch_budget_waits_total").await.unwrap_or(0.0) - waits_before;
    for (s, sid) in holders.iter().zip(&sessions) {
        c.cancel(&t, &s.job_id, sid).await.expect("cancelling a slow cell");
    }
    for s in &holders {
        let r = c.wait(&t, &s.job_id, JOB_WAIT).await.expect("a slow cell's result");
        assert_eq!(r.status, JobStatus::Cancelled, "{r:?}");
    }
    for s in &fetchers {
        let r = c.wait(&t, &s.job_id, JOB_WAIT).await.expect("result");
        assert_eq!((r.status, r.execution.stdout.clone()), (JobStatus::Succeeded, format!("['{digest}']\n")), "{:?}", r.reason);
    }
    let grown_mb = peak.saturating_sub(rss_before) / 1024;
    eprintln!("worker RSS {rss_before} kB before, {peak} kB at most while {FETCHERS} jobs of 3 × 30 MB uploads waited for a slot; {waits} waited for the fetch budget");
    assert!(waits >= 1.0, "no job waited for the fetch budget: it was not applied");
    // Ten jobs of 114 MiB as base64: before, the worker grew by over 1 GiB; within the budget,
    // two are held at once.
    assert!(grown_mb < 500, "the worker grew by {grown_mb} MiB while the jobs waited");
    by.assert_unharmed(&c).await;
    for sid in &sessions {
        c.submit(&close_session(&t, sid)).await.expect("closing a session");
    }
}

/// Before, a worker's queue, shared by all its sessions, was delivered at most 256 unacked jobs
/// at a time (`SANDCELL_SESSION_PREFETCH`), and one session could take them all: a tenant's
/// session running a slow cell with 300 jobs queued behind it held every other session on the
/// worker, another tenant's included, and its own cancel of the slow cell, until that cell
/// ended (here 280 s). Now a session holds at most its window of unacked messages (7 by
/// default); its later jobs are acked as they arrive, held as read back from Postgres, and run
/// in order.
#[tokio::test]
async fn one_sessions_backlog_does_not_hold_another_tenants_session_on_the_same_worker() {
    let _slots = SLOTS.lock().await;
    let c = client().await;
    let (t, other) = (tenant(), tenant());
    let opened = run(&c, &open_session(&t, "n = 0", Some(600))).await;
    let theirs = run(&c, &open_session(&other, "m = 0", Some(600))).await;
    let (sid, other_sid) = (session_id(&opened), session_id(&theirs));
    assert_eq!(opened.worker_id, theirs.worker_id, "both sessions on the one worker of this stack");
    let acked_before = worker_metric("sandcell_worker_session_jobs_acked_on_arrival_total").await.unwrap_or(0.0);
    let mut slow = in_session(&t, &sid, "import time\ntime.sleep(280)");
    slow.timeout_ms = Some(290_000);
    c.submit(&slow).await.expect("submit");
    const BACKLOG: usize = 300;
    let backlog: Vec<_> = (0..BACKLOG).map(|_| in_session(&t, &sid, "n += 1\nn")).collect();
    for s in &backlog {
        c.submit(s).await.expect("submit");
    }
    // The worker has taken the whole backlog: all but the window's worth acked on arrival.
    let taken = eventually(Duration::from_secs(60), || async {
        let acked = worker_metric("sandcell_worker_session_jobs_acked_on_arrival_total").await.unwrap_or(0.0) - acked_before;
        (acked >= (BACKLOG - 7) as f64).then_some(acked)
    })
    .await;
    assert!(taken.is_some(), "the worker did not take the session's backlog past its window");
    // The other tenant's session is served while the slow cell still runs.
    let theirs = in_session(&other, &other_sid, "m += 1\nm");
    c.submit(&theirs).await.expect("submit");
    let served = c.wait(&other, &theirs.job_id, Duration::from_secs(60)).await;
    let served = served.expect("the other tenant's session job waited behind this tenant's backlog");
    assert_eq!((served.status, value(&served)), (JobStatus::Succeeded, Some("1".to_string())), "{served:?}");
    let still = c.result(&t, &slow.job_id).await.expect("reading the slow cell");
    assert!(still.as_ref().is_none_or(|r| r.status == JobStatus::Running), "the slow cell ended early: {still:?}");
    // The tenant's own cancel reaches its slow cell, and the backlog then runs, in order.
    c.cancel(&t, &slow.job_id, &sid).await.expect("cancelling the slow cell");
    let cancelled = c.wait(&t, &slow.job_id, JOB_WAIT).await.expect("the slow cell's result");
    assert_eq!(cancelled.status, JobStatus::Cancelled, "{cancelled:?}");
    for (i, s) in backlog.iter().enumerate() {
        let r = c.wait(&s.tenant, &s.job_id, JOB_WAIT).await.expect("result");
        assert_eq!((r.status, value(&r)), (JobStatus::Succeeded, Some((i + 1).to_string())), "job {i}: {:?}", r.reason);
    }
}
