//! Tenant isolation end to end: two tenants created as an operator creates them (own broker
//! user, own database role), and everything the second could try to learn of the first through
//! Postgres, the object store and the queue. Also the quotas and the identity the broker vouches for.

use std::time::Duration;

use sandcell_client::Client;
use sandcell_core::tenants::Quotas;
use sandcell_protocol::{ErrorCode, JobResult, JobStatus, LimitHit, SessionRequest};
use sandcell_tests::*;
use sqlx::{Connection, Row};

/// A job of `t` that writes a file and draws a figure, in a new session.
async fn busy_tenant(t: &TestTenant) -> (sandcell_client::Client, sandcell_protocol::JobResult) {
    let c = t.client().await;
    let code = "open('secret.txt', 'w').write('the secret of ' + 'A')\n\
                import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n'value of A'";
    // Idle while other tests' jobs hold the worker's slots: a keep-alive no slow run outlasts.
    let r = run(&c, &open_session(&t.name, code, Some(300))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.tenant, t.name);
    assert_eq!(r.artifacts.len(), 2, "the file and the figure: {r:?}");
    (c, r)
}

#[tokio::test]
async fn a_tenant_submits_as_its_broker_user_and_reads_its_results_through_its_own_role() {
    let a = TestTenant::create(None).await;
    let (c, r) = busy_tenant(&a).await;
    assert_eq!(value(&r).as_deref(), Some("'value of A'"), "{r:?}");
    // The session is readable by its owner through the owner's role.
    let s = c.session(&a.name, &session_id(&r)).await.expect("reading the session").expect("own session visible");
    assert_eq!(s.tenant, a.name);
    // And the notification channel works through the role (wait used it).
    let next = run(&c, &in_session(&a.name, &session_id(&r), "open('secret.txt').read()")).await;
    assert_eq!(value(&next).as_deref(), Some("'the secret of A'"), "{next:?}");
}

#[tokio::test]
async fn a_second_tenant_reads_nothing_of_the_first_through_postgres() {
    let a = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let (_, ra) = busy_tenant(&a).await;
    let b_client = b.client().await;
    let rb = run(&b_client, &python(&b.name, "print('b')")).await;
    assert_eq!(rb.status, JobStatus::Succeeded, "{rb:?}");

    let db = b.db().await;
    // Every table and view a tenant may read shows only its own rows, even when asked for A's.
    for (sql, own) in [
        ("SELECT count(*) FROM jobs", 1i64),
        ("SELECT count(*) FROM job_results", 1),
        ("SELECT count(*) FROM sessions", 0),
        ("SELECT count(*) FROM session_documents", 0),
        ("SELECT count(*) FROM artifacts", 0),
        ("SELECT count(*) FROM tenants", 1),
    ] {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(&db).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        assert_eq!(n, own, "{sql} as tenant B");
    }
    let job_a: Option<String> = sqlx::query_scalar("SELECT job_id FROM jobs WHERE tenant = $1").bind(&a.name).fetch_optional(&db).await.unwrap();
    assert_eq!(job_a, None, "B cannot select A's job by naming A");
    let sess_a: i64 = sqlx::query_scalar("SELECT count(*) FROM sessions WHERE session_id = $1").bind(session_id(&ra)).fetch_one(&db).await.unwrap();
    assert_eq!(sess_a, 0, "B cannot select A's session by its id");
    assert_eq!(b_client.result(&a.name, &ra.job_id).await.unwrap(), None);
    assert_eq!(b_client.session(&a.name, &session_id(&ra)).await.unwrap(), None);

    // The operator's tables are closed to tenants altogether.
    for table in ["intake_rejections", "workers", "_sqlx_migrations"] {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT * FROM {table}"))).fetch_all(&db).await.expect_err(table);
        assert!(err.to_string().contains("permission denied"), "{table}: {err}");
    }
    // No writes either.
    let err = sqlx::query("UPDATE jobs SET execution = '{}'").execute(&db).await.expect_err("update");
    assert!(err.to_string().contains("permission denied"), "{err}");

    // B's row does not reveal A's notification channel; listening on B's own channel, or on the
    // old shared channel, B hears nothing of A's jobs.
    let channels: Vec<String> = sqlx::query("SELECT notify_channel FROM tenants").fetch_all(&db).await.unwrap().iter().map(|r| r.get(0)).collect();
    let service = service_db().await;
    let a_channel: String = sqlx::query_scalar("SELECT notify_channel FROM tenants WHERE tenant = $1").bind(&a.name).fetch_one(&service).await.unwrap();
    assert!(!channels.contains(&a_channel));
    let mut listener = sqlx::postgres::PgListener::connect(&b.creds.database_url).await.unwrap();
    listener.listen_all(channels.iter().map(String::as_str).chain(["sandcell_jobs"])).await.unwrap();
    let a_client = a.client().await;
    let again = run(&a_client, &in_session(&a.name, &session_id(&ra), "1 + 1")).await;
    assert_eq!(again.status, JobStatus::Succeeded, "{again:?}");
    let heard = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await;
    assert!(heard.is_err(), "B heard a notification: {heard:?}");
}

#[tokio::test]
async fn a_second_tenant_cannot_fetch_the_firsts_artifacts_from_the_store() {
    let a = TestTenant::create(None).await;
    let (c, r) = busy_tenant(&a).await;
    let file = r.artifacts.iter().find(|x| x.path == "secret.txt").expect("secret.txt stored");
    assert!(file.s3_key.starts_with(&format!("{}/", a.name)), "object keys carry the tenant prefix: {}", file.s3_key);
    let url = c.artifact_url(&a.name, &r.job_id, "secret.txt").await.expect("own artifact URL");
    let (status, body) = http_get(&url).await.expect("GET presigned");
    assert_eq!((status, body.as_slice()), (200, b"the secret of A".as_slice()));

    // Without a signature: refused.
    let refused = |(status, body): (u16, Vec<u8>)| (400..500).contains(&status) && !body.windows(15).any(|w| w == b"the secret of A");
    let bare = url.split('?').next().unwrap().to_string();
    assert!(refused(http_get(&bare).await.unwrap()), "an unsigned GET is refused");
    // A signature is for one key: pointing it at the figure fails.
    let figure = r.artifacts.iter().find(|x| x.path != "secret.txt").unwrap();
    let forged = url.replacen(&file.s3_key, &figure.s3_key, 1);
    assert_ne!(forged, url);
    assert!(refused(http_get(&forged).await.unwrap()), "a signature does not open another key");
    // A tampered expiry fails too.
    let stretched = url.replacen("X-Amz-Expires=", "X-Amz-Expires=9", 1);
    assert!(refused(http_get(&stretched).await.unwrap()), "a stretched expiry is refused");
}

#[tokio::test]
async fn the_broker_vouches_for_the_tenant_and_a_claim_to_another_is_refused_and_recorded() {
    let a = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let bc = b.client().await;

    // B's body names A: refused, recorded under B, nothing under A.
    let sub = python(&a.name, "print('pretending')");
    bc.submit(&sub).await.expect("publish");
    let r = bc.wait(&b.name, &sub.job_id, JOB_WAIT).await.expect("refusal recorded under B");
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(r.reason.as_ref().map(|x| x.code), Some(ErrorCode::TenantMismatch), "{r:?}");
    let service = service_db().await;
    let under_a: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1").bind(&a.name).fetch_one(&service).await.unwrap();
    assert_eq!(under_a, 0, "nothing was recorded or run for A");

    // B cannot claim to be A on the wire: the broker closes the channel.
    let body = serde_json::to_vec(&python(&a.name, "print(1)")).unwrap();
    let err = bc.submit_raw_as(&body, Some("forged"), Some(&a.name)).await;
    assert!(err.is_err(), "the broker accepted a forged user_id");

    // Without user_id: recorded for operators, dead-lettered, run for nobody.
    let c2 = b.client().await;
    let anon = python(&b.name, "print('anonymous')");
    let message_id = unique("anon");
    c2.submit_raw_as(&serde_json::to_vec(&anon).unwrap(), Some(&message_id), None).await.expect("publish without user_id");
    let code = eventually(Duration::from_secs(20), || {
        let (service, message_id) = (service.clone(), message_id.clone());
        async move {
            sqlx::query_scalar::<_, String>("SELECT code FROM intake_rejections WHERE message_id = $1")
                .bind(&message_id)
                .fetch_optional(&service)
                .await
                .ok()
                .flatten()
        }
    })
    .await;
    assert_eq!(code.as_deref(), Some("unauthenticated"));
    assert_eq!(c2.result(&b.name, &anon.job_id).await.unwrap(), None);
}

#[tokio::test]
async fn a_tenants_broker_user_can_only_publish_to_the_intake_exchange() {
    let b = TestTenant::create(None).await;
    let conn = sandcell_core::broker::connect(&b.creds.amqp_url, "tenant-probe").await.expect("tenant connects");
    // Straight to the workers' queue: access refused.
    let ch = sandcell_core::broker::publisher_channel(&conn).await.unwrap();
    let job = serde_json::to_vec(&python(&b.name, "print(1)")).unwrap();
    let r = sandcell_core::broker::publish_confirmed(&ch, sandcell_core::broker::JOBS_QUEUE, &job, Default::default()).await;
    assert!(r.is_err(), "a tenant published to sandcell.jobs");
    // Reading any queue: access refused.
    for queue in [sandcell_core::broker::submissions_queue(0).as_str(), sandcell_core::broker::JOBS_QUEUE, sandcell_core::broker::NEW_SESSIONS_QUEUE] {
        let ch = conn.create_channel().await.unwrap();
        let r = ch.basic_consume(queue.into(), "probe".into(), Default::default(), Default::default()).await;
        assert!(r.is_err(), "a tenant consumed {queue}");
    }
    // Declaring anything: access refused.
    let ch = conn.create_channel().await.unwrap();
    assert!(ch.queue_declare("probe".into(), Default::default(), Default::default()).await.is_err());
}

#[tokio::test]
async fn a_tenant_naming_another_tenants_session_or_job_id_gets_nothing_of_it() {
    let a = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let (ac, ra) = busy_tenant(&a).await;
    let bc = b.client().await;

    // A's session id in B's job: unknown to B, exactly like a session that never existed.
    let rb = run(&bc, &in_session(&b.name, &session_id(&ra), "open('secret.txt').read()")).await;
    assert_eq!(rb.status, JobStatus::Rejected, "{rb:?}");
    assert_eq!(rb.reason.as_ref().map(|x| x.code), Some(ErrorCode::SessionNotFound), "{rb:?}");
    let unknown = "ses_00000000000000000000000000000000";
    let never = run(&bc, &in_session(&b.name, unknown, "1")).await;
    assert_eq!(never.reason.as_ref().map(|x| x.code), Some(ErrorCode::SessionNotFound), "{never:?}");
    let told = |r: &sandcell_protocol::JobResult, id: &str| r.reason.as_ref().unwrap().message.replace(id, "<id>");
    assert_eq!(told(&rb, &session_id(&ra)), told(&never, unknown), "A's session is indistinguishable from none");

    // A's job id in B's submission: a separate job of B's; A's result is untouched.
    let mut sub = python(&b.name, "print('b owns this id too')");
    sub.job_id = ra.job_id.clone();
    let rb = run(&bc, &sub).await;
    assert_eq!((rb.status, rb.execution.stdout.as_str()), (JobStatus::Succeeded, "b owns this id too\n"), "{rb:?}");
    let ra2 = ac.result(&a.name, &ra.job_id).await.unwrap().expect("A's job");
    assert_eq!(ra2.execution.outputs, ra.execution.outputs);
    assert_eq!(ra2.artifacts.len(), 2, "{ra2:?}");
}

#[tokio::test]
async fn jobs_and_sessions_over_quota_are_refused_with_quota_exceeded() {
    let t = TestTenant::create(Some(Quotas { max_sessions: 1, max_queued_jobs: 2, ..Quotas::default() })).await;
    let c = t.client().await;
    // The session outlives the slow jobs below however long they wait for a slot (a keep-alive
    // of 30 s once expired under a loaded CI run, and its close was refused).
    let first = run(&c, &open_session(&t.name, "x = 1", Some(300))).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let second = run(&c, &open_session(&t.name, "x = 2", Some(30))).await;
    assert_eq!(second.status, JobStatus::Rejected, "{second:?}");
    let reason = second.reason.expect("reason");
    assert_eq!(reason.code, ErrorCode::QuotaExceeded);
    assert!(reason.message.contains("sessions"), "{}", reason.message);

    // Three slow jobs at once with a quota of two queued: exactly one is refused.
    let subs: Vec<_> = (0..3).map(|_| python(&t.name, "import time; time.sleep(4)")).collect();
    for s in &subs {
        c.submit(s).await.expect("submit");
    }
    let mut statuses = Vec::new();
    for s in &subs {
        let r = c.wait(&t.name, &s.job_id, JOB_WAIT).await.expect("result");
        if r.status == JobStatus::Rejected {
            assert_eq!(r.reason.as_ref().map(|x| x.code), Some(ErrorCode::QuotaExceeded), "{r:?}");
            assert!(r.reason.as_ref().unwrap().message.contains("queued"), "{r:?}");
        }
        statuses.push(r.status);
    }
    assert_eq!(statuses.iter().filter(|s| **s == JobStatus::Rejected).count(), 1, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == JobStatus::Succeeded).count(), 2, "{statuses:?}");
    // Closing the session frees the slot.
    let mut close = in_session(&t.name, &session_id(&first), "");
    close.session = Some(SessionRequest { id: Some(session_id(&first)), close: true, ..Default::default() });
    let closed = run(&c, &close).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{closed:?}");
    let third = run(&c, &open_session(&t.name, "x = 3", Some(30))).await;
    assert_eq!(third.status, JobStatus::Succeeded, "{third:?}");
}

#[tokio::test]
async fn artifact_bytes_over_quota_are_skipped_then_refused() {
    let t = TestTenant::create(Some(Quotas { max_artifact_bytes: 1000, ..Quotas::default() })).await;
    let c = t.client().await;
    // Two files of 600 bytes: the first fits, the second is skipped and reported.
    let r = run(&c, &python(&t.name, "open('a.txt', 'w').write('a' * 600)\nopen('b.txt', 'w').write('b' * 600)")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.artifacts.iter().map(|a| a.path.as_str()).collect::<Vec<_>>(), ["a.txt"], "{r:?}");
    assert_eq!(r.execution.skipped_files.len(), 1, "{r:?}");
    assert_eq!((r.execution.skipped_files[0].path.as_str(), r.execution.skipped_files[0].reason.as_str()), ("b.txt", "quota_exceeded"), "{r:?}");
    assert!(r.execution.limits_hit.contains(&LimitHit::Artifacts), "{r:?}");
    // 400 bytes left: exactly that fits.
    let r = run(&c, &python(&t.name, "open('c.txt', 'w').write('c' * 400)")).await;
    assert_eq!(r.artifacts.len(), 1, "{r:?}");
    // Now at the quota: the next job is refused before it runs.
    let r = run(&c, &python(&t.name, "print('never runs')")).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(r.reason.as_ref().map(|x| x.code), Some(ErrorCode::QuotaExceeded), "{r:?}");
    assert!(r.reason.as_ref().is_some_and(|x| x.message.contains("artifacts")), "{r:?}");
}

#[tokio::test]
async fn a_tenants_jobs_committing_at_once_store_no_more_than_its_quota() {
    // Room for three of four 1 MB files. The four jobs run side by side and write their file at
    // the same instant, so their commits overlap: each reserves its bytes under the tenant's
    // lock before it uploads, and exactly one is refused.
    const FILE: i64 = 1_000_000;
    let t = TestTenant::create(Some(Quotas { max_artifact_bytes: 3 * FILE as u64, ..Quotas::default() })).await;
    let c = t.client().await;
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64() + 10.0;
    let subs: Vec<_> =
        (0..4).map(|i| python(&t.name, &format!("import time\ntime.sleep(max(0, {at} - time.time()))\nopen('f{i}.bin', 'wb').write(b'x' * {FILE})"))).collect();
    for s in &subs {
        c.submit(s).await.unwrap();
    }
    let mut stored = 0i64;
    let mut refused = 0;
    for s in &subs {
        let r = c.wait(&s.tenant, &s.job_id, JOB_WAIT).await.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        stored += r.artifacts.iter().map(|a| a.size_bytes).sum::<i64>();
        refused += r.execution.skipped_files.iter().filter(|f| f.reason == "quota_exceeded").count();
    }
    assert_eq!((stored, refused), (3 * FILE, 1), "stored {stored} bytes against a quota of {}", 3 * FILE);
}

#[tokio::test]
async fn a_deleted_tenant_can_neither_connect_nor_have_jobs_admitted_and_is_listed_without_a_login() {
    let bin = std::env::var("SANDCELL_ADMIN_BIN").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/debug/sandcell-admin").to_string());
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let first = run(&c, &python(&t.name, "1")).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let out = std::process::Command::new(&bin).args(["tenant", "delete", &t.name]).output().expect("running sandcell-admin");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(sandcell_core::broker::connect(&t.creds.amqp_url, "deleted-tenant").await.is_err(), "the broker still lets it in");
    assert!(sqlx::PgPool::connect(&t.creds.database_url).await.is_err(), "Postgres still lets it in");
    // Not even a trusted backend gets a job of it admitted.
    let r = run(&client().await, &python(&t.name, "1")).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(r.reason.as_ref().map(|x| x.code), Some(ErrorCode::QuotaExceeded), "{r:?}");
    let list = std::process::Command::new(&bin).args(["tenant", "list"]).output().expect("running sandcell-admin");
    let text = String::from_utf8_lossy(&list.stdout);
    let at = text.find(&format!("tenant {}:", t.name)).unwrap_or_else(|| panic!("{} not listed: {text}", t.name));
    assert!(text[at..].lines().nth(1).is_some_and(|l| l.contains("no database login")), "{text}");
    // Deleting again, or a tenant that never was, says so.
    let again = std::process::Command::new(&bin).args(["tenant", "delete", &tenant()]).output().expect("running sandcell-admin");
    assert!(!again.status.success());
}

#[tokio::test]
async fn the_admin_command_creates_a_tenant_that_can_run_a_job() {
    let bin = std::env::var("SANDCELL_ADMIN_BIN").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/debug/sandcell-admin").to_string());
    let name = tenant();
    let out =
        std::process::Command::new(&bin).args(["tenant", "create", &name, "--max-sessions", "3"]).output().unwrap_or_else(|e| panic!("running {bin}: {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let get = |k: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("no {k} in {text}")).to_string();
    assert_eq!(get("SANDCELL_TENANT"), name);
    let c = sandcell_client::Client::connect(&get("SANDCELL_AMQP_URL"), &get("SANDCELL_DATABASE_URL")).await.expect("connect as the new tenant");
    let r = run(&c, &python(&name, "print(sum(range(10)))")).await;
    assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, "45\n"), "{r:?}");
    let show = std::process::Command::new(&bin).args(["tenant", "show", &name]).output().unwrap();
    assert!(String::from_utf8_lossy(&show.stdout).contains("max_sessions=3"));
}

#[tokio::test]
async fn a_tenant_cannot_take_over_a_broker_user_that_is_not_a_tenants() {
    let bin = std::env::var("SANDCELL_ADMIN_BIN").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/debug/sandcell-admin").to_string());
    let name = tenant();
    let added = std::process::Command::new("rabbitmqctl").args(["-q", "add_user", &name, "operators-own-password"]).status().expect("rabbitmqctl");
    assert!(added.success());
    let out = std::process::Command::new(&bin).args(["tenant", "create", &name]).output().expect("running sandcell-admin");
    let _ = std::process::Command::new("rabbitmqctl").args(["-q", "delete_user", &name]).status();
    assert!(!out.status.success(), "sandcell-admin replaced a non-tenant broker user");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a sandcell tenant"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A listener on `t`'s notification channel, as the tenant's own database role.
async fn listening_on_channel(t: &TestTenant) -> sqlx::postgres::PgListener {
    let db = t.db().await;
    let channel: String = sqlx::query_scalar("SELECT notify_channel FROM tenants WHERE tenant = $1").bind(&t.name).fetch_one(&db).await.expect("channel");
    let mut listener = sqlx::postgres::PgListener::connect(&t.creds.database_url).await.expect("listener");
    listener.listen(&channel).await.expect("LISTEN");
    listener
}

/// Clients wait for results: a job's notification on its tenant's channel comes once, when its
/// status is final, and none while it is recorded (`queued`) or claimed (`running`), whose
/// notifying commits Postgres would serialise with every other job's.
#[tokio::test]
async fn a_job_is_notified_once_when_its_status_is_final_and_not_while_queued_or_running() {
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let mut listener = listening_on_channel(&t).await;
    let ok = python(&t.name, "1+1");
    let failed = python(&t.name, "1/0");
    for sub in [&ok, &failed] {
        run(&c, sub).await;
    }
    // Every commit of both jobs is over: what they notified is on its way or here.
    let mut seen: Vec<(String, String)> = Vec::new();
    while let Ok(Ok(n)) = tokio::time::timeout(std::time::Duration::from_secs(2), listener.recv()).await {
        let v: serde_json::Value = serde_json::from_str(n.payload()).expect("JSON payload");
        seen.push((v["job_id"].as_str().unwrap_or_default().to_string(), v["status"].as_str().unwrap_or_default().to_string()));
    }
    assert_eq!(seen, [(ok.job_id.clone(), "succeeded".to_string()), (failed.job_id.clone(), "failed".to_string())]);
}

/// A client that was listening needs no read after a job's final notification when the record
/// fits one: the notification carries exactly what `job_results` holds for the job once its
/// result is committed (its artifacts, inserted after the job's row, and its session among it).
/// A record too large for a notification (which must be shorter than 8,000 bytes) is announced
/// without it, and the row is read as before.
#[tokio::test]
async fn a_final_notification_carries_the_committed_record_unless_it_does_not_fit() {
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let mut listener = listening_on_channel(&t).await;
    let opening = run(&c, &open_session(&t.name, "x = 41", None)).await;
    let session = opening.session.as_ref().expect("a session").id.clone();
    let with_file = in_session(&t.name, &session, "open('/home/user/report.txt', 'w').write('numbers'); x + 1");
    let large = python(&t.name, "print('y' * 20000)");
    for sub in [&with_file, &large] {
        run(&c, sub).await;
    }
    let mut notes = std::collections::HashMap::new();
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await {
        assert!(n.payload().len() < 8000, "a notification of {} bytes", n.payload().len());
        let note = sandcell_client::JobNotification::parse(n.payload()).expect("a notification this client reads").expect("a job's");
        notes.insert(note.job_id.clone(), note);
    }
    for (sub, carried) in [(&opening.job_id, true), (&with_file.job_id, true), (&large.job_id, false)] {
        let note = notes.get(sub.as_str()).unwrap_or_else(|| panic!("no notification for {sub}"));
        let row = c.result(&t.name, sub).await.expect("read").expect("a row");
        assert_eq!(note.status, row.status);
        match (&note.result, carried) {
            // The session in a record is the session as it is now (later jobs move its activity).
            (Some(r), true) => {
                let (mut r, mut row) = (r.clone(), row.clone());
                assert_eq!(r.session.take().map(|s| s.id), row.session.take().map(|s| s.id));
                assert_eq!(r, row, "the notification's record is not the row's");
            }
            (None, false) => assert!(row.execution.stdout.len() > 8000),
            (r, _) => panic!("{sub}: carried a record: {}, expected {carried}", r.is_some()),
        }
    }
    let with_file = notes[&with_file.job_id].result.as_ref().expect("carried");
    assert_eq!(with_file.artifacts.iter().map(|a| a.path.as_str()).collect::<Vec<_>>(), ["report.txt"], "artifacts inserted after the job's row");
    assert_eq!(with_file.session.as_ref().map(|s| s.id.as_str()), Some(session.as_str()));
}

/// A client's waits share one listener per tenant. Each wait connected a listener of its own
/// before, even for a job that had finished: ten waits in flight held ten database connections
/// of the tenant's role besides the client's pool (and paid ten logins). Now they are served by
/// one: each wait, two of them for the same job among them, gets its own job's result, and a
/// wait that timed out leaves no watch behind.
#[tokio::test]
async fn a_clients_waits_share_one_listener_per_tenant_and_a_wait_given_up_leaves_nothing_behind() {
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let db = service_db().await;
    let role: String = sqlx::query_scalar("SELECT db_role FROM tenants WHERE tenant = $1").bind(&t.name).fetch_one(&db).await.unwrap();
    let subs: Vec<_> = (0..10).map(|i| python(&t.name, &format!("import time; time.sleep(1.5); print({i} * 7)"))).collect();
    for sub in &subs {
        c.submit(sub).await.expect("submitting");
    }
    let mut waited: Vec<&sandcell_protocol::Submission> = subs.iter().collect();
    waited.push(&subs[0]);
    let waits = futures::future::join_all(waited.iter().map(|s| c.wait(&t.name, &s.job_id, Duration::from_secs(120))));
    let backends = async {
        let mut most = 0i64;
        for _ in 0..20 {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = $1").bind(&role).fetch_one(&db).await.unwrap();
            most = most.max(n);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        most
    };
    let (results, most) = tokio::join!(waits, backends);
    for (sub, r) in waited.iter().zip(results) {
        let r = r.unwrap_or_else(|e| panic!("waiting for {}: {e}", sub.job_id));
        assert_eq!(r.job_id, sub.job_id);
        let i: usize = subs.iter().position(|s| s.job_id == sub.job_id).unwrap();
        assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, format!("{}\n", i * 7).as_str()), "{r:?}");
    }
    assert!(most <= 5, "{most} connections of the tenant's role served 11 waits (the client's pool holds at most 4)");
    assert_eq!(c.shared_watches().await, (1, 0), "one listener, and nothing watched once every wait returned");
    let gone = c.wait(&t.name, &unique("never-submitted"), Duration::from_millis(1500)).await;
    assert!(matches!(gone, Err(sandcell_client::ClientError::Timeout(..))), "{gone:?}");
    assert_eq!(c.shared_watches().await, (1, 0), "a wait that timed out left its watch behind");
}

/// What a tenant may put through its upload grants counts against its stored-bytes quota, with
/// its artifacts, until its time is over; then the sweeper removes the objects and the room is
/// the tenant's again. (Neither counted nor removed, uploads let one tenant fill the object
/// store every tenant shares.)
#[tokio::test]
async fn uploads_count_against_the_stored_bytes_quota_until_the_sweeper_removes_them() {
    use sandcell_core::store::{ArtifactStore, Fetched};
    use sandcell_protocol::upload::{UploadFile, UploadGrant, UploadRequest};
    let t = TestTenant::create(Some(Quotas { max_artifact_bytes: 1000, ..Quotas::default() })).await;
    let c = t.client().await;
    let ask = |bytes: u64| UploadRequest {
        tenant: t.name.clone(),
        upload_id: unique("up"),
        files: vec![UploadFile { path: "data/a.csv".into(), size_bytes: bytes }],
    };
    let answer = |req: UploadRequest| {
        let c = &c;
        async move {
            c.request_upload(&req).await.expect("requesting an upload");
            let grant: Option<UploadGrant> =
                eventually(Duration::from_secs(30), || async { c.upload_grant(&req.tenant, &req.upload_id).await.ok().flatten() }).await;
            grant.expect("an answer to the upload request")
        }
    };
    let first = answer(ask(600)).await;
    assert_eq!(first.status, "ready", "{first:?}");
    // The tenant puts its 600 bytes through the URL, as a client does.
    let file = std::env::temp_dir().join(unique("upload"));
    std::fs::write(&file, [b'u'; 600]).expect("writing the file to upload");
    let status = sh(&format!("curl -sS -o /dev/null -w '%{{http_code}}' -T '{}' '{}'", file.display(), first.files[0].put_url));
    let _ = std::fs::remove_file(&file);
    assert_eq!(status, "200", "the PUT through the grant's URL");
    // 600 of its 1000 bytes are spoken for: another upload of 600 is refused, and a job's
    // artifact of 500 bytes is skipped.
    let second = answer(ask(600)).await;
    assert_eq!((second.status.as_str(), second.reason.as_ref().map(|r| r.code)), ("rejected", Some(ErrorCode::QuotaExceeded)), "{second:?}");
    assert!(second.files.is_empty(), "a refused upload gets no URL");
    let r = run(&c, &python(&t.name, "open('b.txt', 'w').write('b' * 500)")).await;
    assert_eq!(r.execution.skipped_files.iter().map(|f| (f.path.as_str(), f.reason.as_str())).collect::<Vec<_>>(), [("b.txt", "quota_exceeded")], "{r:?}");
    // Its time over (brought forward here), the sweeper removes the object, and the room is back.
    let db = service_db().await;
    sqlx::query("UPDATE uploads SET objects_expire_at = now() WHERE tenant = $1 AND upload_id = $2")
        .bind(&t.name)
        .bind(&first.upload_id)
        .execute(&db)
        .await
        .expect("bringing the upload's time forward");
    let removed = eventually(Duration::from_secs(120), || async {
        let at: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar("SELECT objects_removed_at FROM uploads WHERE tenant = $1 AND upload_id = $2")
            .bind(&t.name)
            .bind(&first.upload_id)
            .fetch_one(&db)
            .await
            .ok()?;
        at
    })
    .await;
    assert!(removed.is_some(), "the sweeper did not remove the expired upload");
    let store = ArtifactStore::new(&sandcell_core::config::Services::from_env().expect("services").s3);
    let left = store.get_limited(&first.files[0].s3_key, 10_000).await.expect("asking the store");
    assert!(matches!(left, Fetched::Missing), "the uploaded object is still in the store");
    let third = answer(ask(600)).await;
    assert_eq!(third.status, "ready", "{third:?}");
}

/// An expired upload whose object the store refuses to delete is tried again later, behind the
/// others: it does not hold up every later grant's removal.
#[tokio::test]
async fn an_upload_the_store_will_not_delete_is_postponed_and_others_are_removed() {
    let db = service_db().await;
    let t = tenant();
    let grant = |id: &str, key: &str| serde_json::json!({"tenant": t, "upload_id": id, "status": "ready", "files": [{"path": "a", "s3_key": key, "put_url": "http://x/", "size_bytes": 1}]});
    let (stuck, fine) = (unique("up-stuck"), unique("up-fine"));
    // A key that cannot be deleted (an empty one: the S3 client refuses to build the request).
    let bad_key = String::new();
    for (id, key, hours_ago) in [(&stuck, bad_key.clone(), 2.0f64), (&fine, format!("{t}/_uploads/{fine}/a"), 1.0)] {
        sqlx::query("INSERT INTO uploads (tenant, upload_id, grant_doc, granted_bytes, objects_expire_at) VALUES ($1, $2, $3, 1, now() - make_interval(hours => 0) - $4 * interval '1 hour')")
            .bind(&t)
            .bind(id)
            .bind(grant(id, &key))
            .bind(hours_ago)
            .execute(&db)
            .await
            .expect("recording an expired upload");
    }
    let state = |id: String| {
        let db = db.clone();
        let t = t.clone();
        async move {
            sqlx::query_as::<_, (Option<chrono::DateTime<chrono::Utc>>, chrono::DateTime<chrono::Utc>)>(
                "SELECT objects_removed_at, objects_expire_at FROM uploads WHERE tenant = $1 AND upload_id = $2",
            )
            .bind(&t)
            .bind(&id)
            .fetch_one(&db)
            .await
            .expect("the upload's row")
        }
    };
    // The sweeper runs every second here, but a loaded CI run once held its ticks up for 30 s.
    let removed = eventually(Duration::from_secs(120), || async { state(fine.clone()).await.0 }).await;
    assert!(removed.is_some(), "the later upload was not removed");
    let (stuck_removed, stuck_until) = state(stuck.clone()).await;
    assert!(stuck_removed.is_none() && stuck_until > chrono::Utc::now(), "the upload the store refused: removed {stuck_removed:?}, next try {stuck_until}");
}

/// The bytes of a tenant's job rows, upload answers and gateway sandboxes, as the count keeps them and as the rows
/// are now.
async fn kept_bytes(pool: &sqlx::PgPool, tenant: &str) -> (i64, i64) {
    let counted: i64 =
        sqlx::query_scalar("SELECT COALESCE(sum(kept_bytes), 0)::bigint FROM tenant_job_counts WHERE tenant = $1").bind(tenant).fetch_one(pool).await.unwrap();
    let rows: i64 = sqlx::query_scalar(
        "SELECT (COALESCE((SELECT sum(sandcell_job_kept_bytes(execution, reason, routed, held_job)) FROM jobs WHERE tenant = $1), 0)
               + COALESCE((SELECT sum(pg_column_size(grant_doc)) FROM uploads WHERE tenant = $1), 0)
               + COALESCE((SELECT sum(pg_column_size(metadata) + pg_column_size(env)) FROM gateway_sandboxes WHERE tenant = $1), 0))::bigint",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
    .unwrap();
    (counted, rows)
}

/// Run a one-off job of `tenant` printing `raw` random bytes as base64 (4/3 as many characters,
/// which Postgres cannot compress away) and require it to succeed: how these tests put a
/// tenant's kept result bytes where they want them.
async fn print_incompressible(c: &Client, tenant: &str, raw: usize) -> JobResult {
    let r = run(c, &python(tenant, &format!("import base64, os\nprint(base64.b64encode(os.urandom({raw})).decode())"))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.reason);
    r
}

/// Before, the bytes a tenant's results took in Postgres had no bound of their own: a tenant
/// whose jobs printed their megabyte each filled the database all tenants share. Now they count
/// against `max_result_bytes`: past it new jobs are refused `quota_exceeded` with the figures,
/// until the retention deletes old results. The count follows every change of a job's rows
/// (record, claim, commit, a session's kept jobs, a refusal, a deletion) exactly.
#[tokio::test]
async fn kept_results_count_against_the_result_bytes_quota_until_the_retention_deletes_them() {
    let t = TestTenant::create(Some(Quotas { max_result_bytes: 600_000, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    // Jobs of every kind: a session's (its execution jobs kept while it lives), a refusal, a
    // one-off job printing 700 kB that cannot be compressed away.
    let opened = run(&c, &open_session(&t.name, "n = 1", Some(600))).await;
    let sid = session_id(&opened);
    let mut with_input = in_session(&t.name, &sid, "n += 1");
    with_input.files = vec![input("in.bin", &[7u8; 50_000])];
    let stored = run(&c, &with_input).await;
    assert_eq!(stored.status, JobStatus::Succeeded, "{stored:?}");
    let refused = run(&c, &in_session(&t.name, "no-such-session", "n")).await;
    assert_eq!(refused.status, JobStatus::Rejected, "{refused:?}");
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows");
    assert!(counted < 600_000, "{counted}");
    let big = print_incompressible(&c, &t.name, 525_000).await;
    assert_eq!(big.execution.stdout.len(), 700_001, "{big:?}");
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows");
    assert!(counted > 600_000, "{counted}");

    // Over the quota: refused with the figures, one-off and in-session alike.
    for sub in [python(&t.name, "print(1)"), in_session(&t.name, &sid, "n")] {
        let r = run(&c, &sub).await;
        let reason = r.reason.as_ref().unwrap_or_else(|| panic!("no reason: {r:?}"));
        assert_eq!((r.status, reason.code), (JobStatus::Rejected, ErrorCode::QuotaExceeded), "{r:?}");
        // (Each refusal is a row too: the figure grows by its size.)
        assert!(reason.message.contains("bytes of job results and upload answers in the database; its quota is 600000"), "{}", reason.message);
    }
    // The retention deletes the big result (aged here): there is room again.
    sqlx::query("UPDATE jobs SET finished_at = now() - interval '31 days' WHERE tenant = $1 AND job_id = $2")
        .bind(&t.name)
        .bind(&big.job_id)
        .execute(&pool)
        .await
        .unwrap();
    let room = eventually(Duration::from_secs(30), || async {
        let (counted, rows) = kept_bytes(&pool, &t.name).await;
        (counted == rows && counted < 600_000).then_some(())
    })
    .await;
    assert!(room.is_some(), "the count after the deletion: {:?}", kept_bytes(&pool, &t.name).await);
    let again = run(&c, &in_session(&t.name, &sid, "n += 1\nprint(n)")).await;
    assert_eq!((again.status, again.execution.stdout.as_str()), (JobStatus::Succeeded, "3\n"), "{again:?}");
    // A session's end drops the execution jobs it kept: the count follows.
    let closed = run(&c, &close_session(&t.name, &sid)).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{closed:?}");
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows after the session ended");
}

/// Before, a tenant over a quota on stored bytes could not close its sessions: the close was
/// refused `quota_exceeded` like any job, so each session kept its sandbox, a place in
/// `max_sessions` and its kept execution jobs (the bytes that quota counts) until its keep-alive
/// ran out, up to an hour. Now a job that does nothing but close a session passes the quotas on
/// stored bytes (migration 0024); one that also runs code is refused as before, and so is a new
/// session.
#[tokio::test]
async fn a_tenant_over_its_result_bytes_quota_may_still_close_its_sessions() {
    let t = TestTenant::create(Some(Quotas { max_result_bytes: 600_000, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let opened = run(&c, &open_session(&t.name, "n = 1", Some(600))).await;
    let sid = session_id(&opened);
    let container = container_of(&t.name, &opened.job_id).await.expect("the session's container");
    print_incompressible(&c, &t.name, 525_000).await;
    assert!(kept_bytes(&pool, &t.name).await.0 > 600_000);

    let mut close_with_code = close_session(&t.name, &sid);
    close_with_code.code = "print(n)".into();
    for refused in [close_with_code, open_session(&t.name, "m = 1", None)] {
        let r = run(&c, &refused).await;
        let reason = r.reason.as_ref().unwrap_or_else(|| panic!("no reason: {r:?}"));
        assert_eq!((r.status, reason.code), (JobStatus::Rejected, ErrorCode::QuotaExceeded), "{r:?}");
        assert!(reason.message.contains("a job that only closes a session is still accepted"), "{}", reason.message);
    }

    let closed = run(&c, &close_session(&t.name, &sid)).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{:?}", closed.reason);
    let state: String = sqlx::query_scalar("SELECT state FROM sessions WHERE session_id = $1").bind(&sid).fetch_one(&pool).await.unwrap();
    assert_eq!(state, "closed");
    let gone = eventually(Duration::from_secs(30), || async { (!container_exists(&container).await).then_some(()) }).await;
    assert!(gone.is_some(), "the closed session's container {container} is still there");
    // A closed session takes no more closes: refused for what it is, not for the quota.
    let again = run(&c, &close_session(&t.name, &sid)).await;
    assert_eq!((again.status, again.reason.as_ref().map(|r| r.code)), (JobStatus::Rejected, Some(ErrorCode::SessionClosed)), "{again:?}");
}

/// Held by each test that counts the scheduler's refusals from memory, a figure every tenant's
/// refusals add to: run side by side, each would count the other's flood.
static COUNTS_REFUSALS_FROM_MEMORY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A tenant found at a quota is refused again from the intake's memory of that look for a moment
/// (`SANDCELL_INTAKE_QUOTA_MEMORY_MS`, `scheduler::quota_memory`), not judged under its lock
/// submission after submission, and written in batches: before, its flood past the quota was
/// judged one submission at a time and held up every tenant's submissions behind it in the
/// intake's partitions (3,000 published in 0.7-0.9 s delayed another tenant's `6*7` by 9.1-9.5 s;
/// 1.0-1.6 s now). Every submission of the flood is still answered, with the quota's figures,
/// and once its jobs end the tenant is admitted.
#[tokio::test]
async fn a_tenants_flood_past_its_quota_is_refused_from_the_intakes_memory_and_every_submission_is_answered() {
    use futures::StreamExt as _;
    let _alone = COUNTS_REFUSALS_FROM_MEMORY.lock().await;
    let t = TestTenant::create(Some(Quotas { max_queued_jobs: 2, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let before = refused_from_memory().await;
    // Two slow jobs hold the quota while the flood arrives.
    let slow: Vec<_> = (0..2).map(|_| python(&t.name, "import time; time.sleep(15)")).collect();
    hold_quota_with(&c, &pool, &t.name, &slow).await;

    const FLOOD: usize = 400;
    let flood: Vec<_> = (0..FLOOD).map(|_| python(&t.name, "print(1)")).collect();
    futures::stream::iter(&flood).map(|s| c.submit(s)).buffer_unordered(32).for_each(|r| async { r.expect("submit") }).await;
    let ids: Vec<String> = flood.iter().map(|s| s.job_id.clone()).collect();
    let answered = answers_of(&pool, &t.name, &ids, Duration::from_secs(60)).await.expect("every submission of the flood answered");
    for a in &answered {
        assert_eq!((a.status.as_str(), a.code.as_deref()), ("rejected", Some("quota_exceeded")), "{a:?}");
        assert!(a.message.as_deref().is_some_and(|m| m.contains("its quota is 2")), "{a:?}");
    }
    mostly_refused_from_memory(before, FLOOD, "submissions past the quota").await;

    // The memory lapses: once the slow jobs end, the tenant's next job is judged and admitted.
    for s in &slow {
        let r = c.wait(&t.name, &s.job_id, JOB_WAIT).await.expect("result");
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    }
    let next = run(&c, &python(&t.name, "6 * 7")).await;
    assert_eq!(value(&next).as_deref(), Some("42"), "{next:?}");
}

/// The scheduler's count of refusals made from its quota memory.
async fn refused_from_memory() -> f64 {
    scheduler_metric("sandcell_intake_refused_from_memory_total").await.expect("the scheduler's metrics")
}

/// At least three quarters of a flood of `flood` (`what` it was) were refused from the intake's
/// memory since the count was `before`, not each with a look under the tenant's lock.
async fn mostly_refused_from_memory(before: f64, flood: usize, what: &str) {
    let from_memory = refused_from_memory().await - before;
    eprintln!("{flood} {what}: {from_memory} refused from the intake's memory");
    assert!(from_memory >= (flood * 3 / 4) as f64, "only {from_memory} of {flood} refusals were made without a look under the tenant's lock");
}

/// Before, every refusal was a row kept for the retention (30 days), even past the tenant's
/// `max_result_bytes`: a tenant over that quota, submitting without end, grew the database all
/// tenants share at the intake's rate. Now, while a tenant is over it, only its newest
/// `KEPT_REFUSALS_OVER_QUOTA` refusals are kept (each submission is still answered, and the
/// newest answers stay readable); another tenant's refusals are not touched.
#[tokio::test]
async fn a_tenant_over_its_result_bytes_quota_keeps_only_its_newest_refusals() {
    let kept = sandcell_core::tenants::KEPT_REFUSALS_OVER_QUOTA;
    let t = TestTenant::create(Some(Quotas { max_result_bytes: 100_000, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let other = TestTenant::create(None).await;
    let oc = other.client().await;
    let theirs = run(&oc, &in_session(&other.name, "no-such-session", "n")).await;
    assert_eq!(theirs.status, JobStatus::Rejected, "{theirs:?}");
    print_incompressible(&c, &t.name, 100_000).await;

    let sent = usize::try_from(kept).unwrap() + 500;
    let subs: Vec<_> = (0..sent).map(|_| python(&t.name, "print(1)")).collect();
    let started = std::time::Instant::now();
    for s in &subs {
        c.submit(s).await.expect("submit");
    }
    let last = c.wait(&t.name, &subs[sent - 1].job_id, JOB_WAIT).await.expect("the last submission's answer");
    assert_eq!((last.status, last.reason.as_ref().map(|r| r.code)), (JobStatus::Rejected, Some(ErrorCode::QuotaExceeded)), "{last:?}");
    let answered = started.elapsed();
    // Whatever is still being handled lands too (as in the intake rejections' test).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refusals: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1 AND status = 'rejected'").bind(&t.name).fetch_one(&pool).await.unwrap();
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    eprintln!("{sent} submissions over the quota answered in {answered:?}; {refusals} refusals kept, the tenant's rows {rows} bytes");
    assert!((kept..kept + 100).contains(&refusals), "{refusals} refusals kept of {sent} submissions over the quota");
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows");
    let newest = c.result(&t.name, &last.job_id).await.unwrap();
    assert!(newest.is_some_and(|r| r.status == JobStatus::Rejected), "the newest refusal is no longer readable");
    assert!(oc.result(&other.name, &theirs.job_id).await.unwrap().is_some(), "another tenant's refusal was deleted");
}

/// Before, a tenant's upload answers had no bound but the stored-bytes quota on what their files
/// may hold, which a tenant declaring one byte a file never reaches: each `ready` answer (a
/// presigned URL for each of up to 32 files) was a row of kilobytes kept for 30 days, added at
/// the intake's rate. Now upload answers count in `max_result_bytes` like job rows: past it an
/// upload request is refused `quota_exceeded` with the figures, and while the tenant is over it
/// only its newest `KEPT_REFUSALS_OVER_QUOTA` refused answers are kept.
#[tokio::test]
async fn a_tenants_upload_answers_count_against_its_result_bytes_quota() {
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let kept = sandcell_core::tenants::KEPT_REFUSALS_OVER_QUOTA;
    let t = TestTenant::create(Some(Quotas { max_result_bytes: 100_000, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let request = || UploadRequest {
        tenant: t.name.clone(),
        upload_id: unique("up"),
        files: (0..32).map(|k| UploadFile { path: format!("f{k}.csv"), size_bytes: 1 }).collect(),
    };
    let answer = |req: UploadRequest| {
        let c = &c;
        async move {
            c.request_upload(&req).await.expect("requesting an upload");
            eventually(Duration::from_secs(30), || async { c.upload_grant(&req.tenant, &req.upload_id).await.ok().flatten() }).await.expect("an answer")
        }
    };
    let mut granted = 0;
    let mut refusal = None;
    for _ in 0..200 {
        let g = answer(request()).await;
        if g.status == "ready" {
            granted += 1;
        } else {
            refusal = Some(g);
            break;
        }
    }
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    eprintln!("{granted} upload answers of 32 files granted before the refusal; the tenant's rows {rows} bytes");
    let reason = refusal.and_then(|g| g.reason).unwrap_or_else(|| panic!("{granted} upload answers granted, none refused; the tenant keeps {rows} bytes"));
    assert_eq!(reason.code, ErrorCode::QuotaExceeded, "{reason:?}");
    assert!(reason.message.contains("bytes of job results and upload answers in the database; its quota is 100000"), "{}", reason.message);
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows");

    // Refused without end: only the newest refusals stay.
    let sent = usize::try_from(kept).unwrap() + 300;
    let reqs: Vec<_> = (0..sent).map(|_| request()).collect();
    for r in &reqs {
        c.request_upload(r).await.expect("requesting an upload");
    }
    let last = &reqs[sent - 1];
    let answered = eventually(Duration::from_secs(120), || async { c.upload_grant(&t.name, &last.upload_id).await.ok().flatten() }).await;
    assert_eq!(answered.map(|g| g.status), Some("rejected".to_string()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM uploads WHERE tenant = $1 AND grant_doc->>'status' = 'rejected'")
        .bind(&t.name)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!((kept..kept + 100).contains(&refused), "{refused} refused upload answers kept of {} requests over the quota", sent + 1);
    let (counted, rows) = kept_bytes(&pool, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows after the deletions");
}

/// Upload refusals written in one batch (`uploads::record_many`) were all stamped with their
/// transaction's start, and the newest `KEPT_REFUSALS_OVER_QUOTA` that a tenant over its
/// result-bytes quota keeps are counted by that stamp: a batch across the cutoff kept all of its
/// rows, up to 255 more than that (here 210 more). Each row is now stamped with the moment of its
/// insert: exactly the newest are kept, the oldest forgotten, whatever the batches.
#[tokio::test]
async fn upload_refusals_written_in_one_batch_past_the_result_bytes_quota_keep_exactly_the_newest() {
    use sandcell_protocol::upload::UploadGrant;
    let kept = usize::try_from(sandcell_core::tenants::KEPT_REFUSALS_OVER_QUOTA).unwrap();
    let t = TestTenant::create(Some(Quotas { max_result_bytes: 1, ..Quotas::default() })).await;
    let db = service_db().await;
    let refusal = |i: usize| {
        UploadGrant::rejected(&t.name, &format!("up-{i:05}"), sandcell_protocol::Reason::new(ErrorCode::QuotaExceeded, "over the result bytes quota"))
    };
    let under: Vec<_> = (0..kept - 10).map(refusal).collect();
    let across: Vec<_> = (kept - 10..kept + 200).map(refusal).collect();
    for batch in [under, across] {
        let recorded = sandcell_core::uploads::record_many(&db, &batch, false).await.expect("a batch of refusals");
        assert!(recorded.iter().all(|r| r.inserted), "every refusal of the batch is new");
    }
    let ids: Vec<String> = sqlx::query_scalar("SELECT upload_id FROM uploads WHERE tenant = $1 AND grant_doc->>'status' = 'rejected' ORDER BY upload_id")
        .bind(&t.name)
        .fetch_all(&db)
        .await
        .unwrap();
    assert_eq!(ids.len(), kept, "refused upload answers kept of {} over the quota", kept + 200);
    assert_eq!(ids.first().map(String::as_str), Some("up-00200"), "the oldest are the ones forgotten");
    assert_eq!(ids.last().map(String::as_str), Some(format!("up-{:05}", kept + 199).as_str()));
    let (counted, rows) = kept_bytes(&db, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows after the deletions");
}

/// A batch of upload refusals serves every tenant, and each refusal it inserts updates a shard
/// of its tenant's kept bytes (`tenant_job_counts`), which another transaction may hold: it
/// waits at most `BATCH_LOCK_TIMEOUT_MS` for it and fails, writing nothing, for the intake to
/// record each of its refusals on its own; one recorded on its own waits its turn.
#[tokio::test]
async fn a_batch_of_upload_refusals_waits_at_most_its_lock_timeout_for_a_held_count_and_writes_nothing() {
    use sandcell_protocol::upload::UploadGrant;
    let t = TestTenant::create(None).await;
    let db = service_db().await;
    // Every shard's row of the tenant's counts, held by another transaction.
    sqlx::query("INSERT INTO tenant_job_counts (tenant, shard) SELECT $1, s FROM generate_series(0, 15) s ON CONFLICT DO NOTHING")
        .bind(&t.name)
        .execute(&db)
        .await
        .unwrap();
    let mut holder = db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tenant_job_counts WHERE tenant = $1 FOR UPDATE").bind(&t.name).execute(&mut *holder).await.unwrap();
    let refusal = |id: &str| UploadGrant::rejected(&t.name, id, sandcell_protocol::Reason::new(ErrorCode::InvalidValue, "a bad path"));
    let started = std::time::Instant::now();
    let batch = tokio::time::timeout(Duration::from_secs(10), sandcell_core::uploads::record_many(&db, &[refusal("up-1"), refusal("up-2")], false))
        .await
        .expect("the batch waited for the held count past its lock timeout");
    let waited = started.elapsed();
    let e = batch.expect_err("a batch recorded while its tenant's counts were held");
    assert!(format!("{e:#}").contains("lock timeout"), "{e:#}");
    assert!(waited >= Duration::from_millis(u64::from(sandcell_core::uploads::BATCH_LOCK_TIMEOUT_MS)), "failed after {waited:?}, before its lock timeout");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM uploads WHERE tenant = $1").bind(&t.name).fetch_one(&db).await.unwrap();
    assert_eq!(written, 0, "a failed batch wrote some of its refusals");
    // On its own, a refusal waits for the count and is recorded once it is free.
    let alone = tokio::spawn({
        let (db, r) = (db.clone(), refusal("up-1"));
        async move { sandcell_core::uploads::record(&db, &r).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!alone.is_finished(), "a refusal recorded on its own did not wait for its tenant's counts");
    holder.rollback().await.unwrap();
    let recorded = alone.await.unwrap().expect("the refusal recorded once the counts were free");
    assert!(recorded.inserted);
    let (counted, rows) = kept_bytes(&db, &t.name).await;
    assert_eq!(counted, rows, "the count of kept bytes drifted from the rows");
}

/// Before, the intake handled every message it had prefetched at once (32 a partition, 8
/// partitions), and each handler held one of the scheduler's 8 database connections while it
/// waited for its tenant's row lock. A tenant whose lock was busy (here held by the test, as a
/// flood of its own upload grants held it for 30 s in a CI run) took every connection: other
/// tenants' jobs were not even recorded until it let go, and the sweeper's ping failed. Now a
/// tenant's handlers hold at most `SANDCELL_INTAKE_TENANT_CONCURRENCY` (4) of them; the rest
/// wait their turn without one, and nothing of theirs is lost.
#[tokio::test]
async fn a_tenant_whose_row_lock_is_held_waits_on_half_the_schedulers_connections_and_another_tenants_job_runs() {
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let a = TestTenant::create(None).await;
    let ac = a.client().await;
    let db = service_db().await;
    let mut holder = db.begin().await.expect("beginning the lock's transaction");
    sqlx::query("SELECT 1 FROM tenants WHERE tenant = $1 FOR UPDATE").bind(&a.name).execute(&mut *holder).await.expect("locking the tenant's row");
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.expect("the holder's pid");
    // Every backend waiting for the lock, directly or behind another waiter (a row lock's
    // later waiters queue on the first one's tuple lock).
    let waiting = || {
        let db = db.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "WITH RECURSIVE blocked(pid) AS (
                     SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))
                     UNION SELECT a.pid FROM pg_stat_activity a, blocked b WHERE b.pid = ANY(pg_blocking_pids(a.pid)))
                 SELECT count(*) FROM blocked",
            )
            .bind(holder_pid)
            .fetch_one(&db)
            .await
            .expect("counting the lock's waiters")
        }
    };
    let uploads: Vec<_> = (0..40)
        .map(|_| UploadRequest { tenant: a.name.clone(), upload_id: unique("up"), files: vec![UploadFile { path: "a.csv".into(), size_bytes: 1 }] })
        .collect();
    let jobs: Vec<_> = (0..40).map(|_| python(&a.name, "6 * 7")).collect();
    for (u, j) in uploads.iter().zip(&jobs) {
        ac.request_upload(u).await.expect("requesting an upload");
        ac.submit(j).await.expect("submitting");
    }
    let places: i64 = std::env::var("SANDCELL_INTAKE_TENANT_CONCURRENCY").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let reached = eventually(Duration::from_secs(60), || async { Some(waiting().await).filter(|n| *n >= places) }).await;
    assert!(reached.is_some(), "the tenant's messages never reached its lock: {} waiting", waiting().await);

    // Another tenant's job is recorded, run and answered while the first tenant's lock is held.
    let c = client().await;
    let r = run(&c, &python(&tenant(), "6 * 7")).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("42")), "{r:?}");
    assert_eq!(waiting().await, places, "connections of the scheduler waiting for one tenant's row lock");

    holder.rollback().await.expect("letting the lock go");
    for j in &jobs {
        let r = ac.wait(&a.name, &j.job_id, JOB_WAIT).await.expect("the locked tenant's job result");
        assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("42")), "{r:?}");
    }
    for u in &uploads {
        let g = eventually(Duration::from_secs(60), || async { ac.upload_grant(&a.name, &u.upload_id).await.ok().flatten() }).await;
        assert_eq!(g.map(|g| g.status).as_deref(), Some("ready"), "the locked tenant's upload {}", u.upload_id);
    }
}

/// Built-in functions PUBLIC may execute let one tenant's login harm every other: ~12,000
/// advisory locks from one connection filled Postgres' shared lock table (every new connection
/// then failed, `out of shared memory`, the services' too), one lock of the schedulers'
/// presence class made the scheduler give up half the intake's partitions, and large objects
/// filled Postgres' disk outside every quota. `deploy/postgres/lockdown.sql`, applied by the
/// stack's scripts, takes them from tenants; sandcell's own role keeps its advisory locks.
#[tokio::test]
async fn a_tenants_login_cannot_take_advisory_locks_or_create_large_objects() {
    let t = TestTenant::create(None).await;
    let db = t.db().await;
    for sql in [
        "SELECT pg_advisory_lock(1)",
        "SELECT pg_try_advisory_lock(1396899842, 1)",
        "SELECT pg_advisory_lock_shared(1, 2)",
        "SELECT pg_try_advisory_xact_lock(7)",
        "SELECT count(pg_try_advisory_lock(i)) FROM generate_series(1, 1000) i",
        "SELECT lo_from_bytea(0, '\\x00'::bytea)",
        "SELECT lo_creat(-1)",
        "SELECT lo_create(0)",
        "SELECT pg_get_object_address('type', '{int4}', '{}')",
    ] {
        let err = sqlx::query(sql).execute(&db).await.expect_err(sql);
        assert!(err.to_string().contains("permission denied for function"), "{sql}: {err}");
    }
    // Temporary files are bounded per session (256 MB), and a tenant cannot lift the bound.
    let err = sqlx::query("SET temp_file_limit = -1").execute(&db).await.expect_err("lifting the bound");
    assert!(err.to_string().contains("permission denied to set parameter"), "{err}");
    let mut conn = sqlx::PgConnection::connect(&t.creds.database_url).await.expect("tenant connects");
    sqlx::query("SET work_mem = '1MB'").execute(&mut conn).await.expect("work_mem");
    let sort = "SELECT count(*) FROM (SELECT g, repeat(md5(g::text), 30) r FROM generate_series(1, 1000000) g ORDER BY r) s";
    let err = sqlx::query(sort).execute(&mut conn).await.expect_err("a sort spilling ~1 GB");
    assert!(err.to_string().contains("temp_file_limit"), "{err}");
    let service = service_db().await;
    let missing = sandcell_core::tenants::lockdown_missing(&service).await.expect("the scheduler's check");
    assert!(missing.is_empty(), "the lockdown is missing {missing:?}");
    // The service role keeps the locks the schedulers share the intake with.
    let (got, freed): (bool, bool) =
        sqlx::query_as("SELECT pg_try_advisory_lock(424242), pg_advisory_unlock(424242)").fetch_one(&service).await.expect("service lock");
    assert!(got && freed);
    // And the intake still runs.
    let c = t.client().await;
    let r = run(&c, &python(&t.name, "6 * 7")).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("42")), "{r:?}");
}

/// A tenant's login could open connections until Postgres' `max_connections` were all taken,
/// and then no service could open one. Its role's connection limit is its `max_db_connections`
/// quota, set when the role is made and whenever the quota changes.
#[tokio::test]
async fn a_tenants_login_holds_at_most_its_quota_of_database_connections() {
    let t = TestTenant::create(Some(Quotas { max_db_connections: 3, ..Quotas::default() })).await;
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(sqlx::PgConnection::connect(&t.creds.database_url).await.unwrap_or_else(|e| panic!("connection {i} within the quota: {e}")));
    }
    let err = sqlx::PgConnection::connect(&t.creds.database_url).await.expect_err("a fourth connection");
    assert!(err.to_string().contains("too many connections for role"), "{err}");
    // The service role still connects.
    let service = service_db().await;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&service).await.expect("service connects");
    assert_eq!(one, 1);

    // The operator raises the quota: the role's limit follows.
    let admin = sandcell_admin::Admin::connect(sandcell_admin::AdminSettings::from_env().expect("admin settings")).await.expect("operator");
    admin.set_quotas(&t.name, &Quotas { max_db_connections: 5, ..Quotas::default() }).await.expect("raising the quota");
    for i in 3..5 {
        held.push(sqlx::PgConnection::connect(&t.creds.database_url).await.unwrap_or_else(|e| panic!("connection {i} within the raised quota: {e}")));
    }
    let err = sqlx::PgConnection::connect(&t.creds.database_url).await.expect_err("a sixth connection");
    assert!(err.to_string().contains("too many connections for role"), "{err}");
    let limit: i32 = sqlx::query_scalar("SELECT r.rolconnlimit FROM pg_roles r JOIN tenants t ON t.db_role = r.rolname WHERE t.tenant = $1")
        .bind(&t.name)
        .fetch_one(&service)
        .await
        .expect("the role's limit");
    assert_eq!(limit, 5);
}

/// A tenant's login could keep a transaction (or one statement) open, or stop reading its
/// connection, for as long as it liked; meanwhile Postgres could not trim its notification
/// queue past that session, and every job's commit writes to that queue. Two connections of one
/// tenant, one listening in an open transaction and one notifying, filled it (8 GB) in 44 s, and
/// from then on every commit failed (`too many notifications in the NOTIFY queue`), every
/// tenant's. Postgres' timeouts cannot be imposed (any session may `SET` them), so the scheduler
/// ends a tenant's session whose transaction has been open for `SANDCELL_TENANT_DB_HOLD_S` (10 s
/// here), one statement or many: a first version judged a session's last statement, and a
/// transaction sending `SELECT 1` every few seconds held the queue for as long as it liked.
/// Sessions that only listen, or come and go, stay.
#[tokio::test]
async fn a_tenants_database_session_holding_a_transaction_or_a_statement_open_is_ended_and_others_stay() {
    let t = TestTenant::create(None).await;
    let url = &t.creds.database_url;
    // Holding the notification queue: listening inside a transaction kept open with a statement
    // every 2 s, after a flood.
    let mut holder = sqlx::PgConnection::connect(url).await.expect("tenant connects");
    sqlx::query("LISTEN sandcell_test_held").execute(&mut holder).await.expect("LISTEN");
    sqlx::query("BEGIN").execute(&mut holder).await.expect("BEGIN");
    sqlx::query("SELECT 1").execute(&mut holder).await.expect("in the transaction");
    let kept_busy = tokio::spawn(async move {
        let started = std::time::Instant::now();
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            if let Err(e) = sqlx::query("SELECT 1").execute(&mut holder).await {
                return (e, started.elapsed());
            }
            assert!(started.elapsed() < Duration::from_secs(120), "the transaction kept busy was never ended");
        }
    });
    let mut flooder = sqlx::PgConnection::connect(url).await.expect("tenant connects");
    sqlx::query("SELECT count(pg_notify('sandcell_test_flood', i::text || repeat('a', 7900))) FROM generate_series(1, 20000) i")
        .execute(&mut flooder)
        .await
        .expect("notifying");
    let service = service_db().await;
    let usage = || async { sqlx::query_scalar::<_, f64>("SELECT pg_notification_queue_usage()").fetch_one(&service).await.expect("queue usage") };
    let held = usage().await;
    assert!(held > 0.01, "the flood waits in the queue for the holder: {held}");
    // One statement for ten minutes.
    let long = tokio::spawn({
        let url = url.clone();
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("tenant connects");
            let started = std::time::Instant::now();
            let r = sqlx::query("SELECT pg_sleep(600)").execute(&mut conn).await;
            (r.map(|_| ()), started.elapsed())
        }
    });
    // A listener between its notifications, and a pool used now and then, are not holding.
    let mut listener = sqlx::postgres::PgListener::connect(url).await.expect("tenant listener");
    listener.listen("sandcell_test_idle").await.expect("LISTEN");
    let db = t.db().await;

    let (r, took) = tokio::time::timeout(Duration::from_secs(60), long).await.expect("the long statement was ended").expect("task");
    let err = r.expect_err("the long statement cannot finish");
    assert!(err.to_string().contains("terminat"), "{err}");
    assert!(took < Duration::from_secs(40), "ended after {took:?}");
    let (err, took) = tokio::time::timeout(Duration::from_secs(60), kept_busy).await.expect("the busy transaction was ended").expect("task");
    assert!(!err.to_string().is_empty());
    assert!(took < Duration::from_secs(40), "ended after {took:?}");
    // With the holder gone the queue is trimmed as it is read (a notification moves its tail).
    let drained = eventually(Duration::from_secs(30), || async {
        sqlx::query("SELECT pg_notify('sandcell_test_tick', '')").execute(&service).await.expect("notify");
        Some(usage().await).filter(|u| *u < held / 2.0)
    })
    .await;
    assert!(drained.is_some(), "the queue stayed at {} (was {held})", usage().await);

    // The others are as they were.
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut flooder).await.expect("the flooder, idle, stays");
    assert_eq!(one, 1);
    sqlx::query("SELECT pg_notify('sandcell_test_idle', 'still here')").execute(&service).await.expect("notify");
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.expect("the listener hears").expect("a notification");
    assert_eq!(n.payload(), "still here");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&db).await.expect("the pool reads");
    assert_eq!(jobs, 0);
    let ended = scheduler_metric("sandcell_tenant_db_sessions_ended_total").await;
    assert!(ended.is_some_and(|n| n >= 2.0), "the scheduler counted {ended:?}");
}

/// Another way a tenant's session held the notification queue: it listens and stops reading
/// its connection. Postgres then waits to write to it inside the transaction in which it reads
/// the queue (and cannot trim the queue past what it has not sent), so the scheduler ends it
/// as any transaction open for `SANDCELL_TENANT_DB_HOLD_S`.
#[tokio::test]
async fn a_tenants_listener_that_stops_reading_its_connection_is_ended() {
    let t = TestTenant::create(None).await;
    let mut deaf = sqlx::PgConnection::connect(&t.creds.database_url).await.expect("tenant connects");
    sqlx::query("LISTEN sandcell_test_deaf").execute(&mut deaf).await.expect("LISTEN");
    // Nothing reads `deaf` from here on: what is sent to it fills the socket's buffers.
    let service = service_db().await;
    let own = t.db().await;
    sqlx::query("SELECT count(pg_notify('sandcell_test_deaf', i::text || repeat('a', 7900))) FROM generate_series(1, 2000) i")
        .execute(&service)
        .await
        .expect("notifying");
    let blocked = eventually(Duration::from_secs(10), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = current_user AND wait_event = 'ClientWrite'")
            .fetch_one(&own)
            .await
            .expect("own sessions");
        (n > 0).then_some(())
    })
    .await;
    assert!(blocked.is_some(), "the listener's backend never blocked writing to it");
    let ended = eventually(Duration::from_secs(60), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = current_user AND wait_event = 'ClientWrite'")
            .fetch_one(&own)
            .await
            .expect("own sessions");
        (n == 0).then_some(())
    })
    .await;
    assert!(ended.is_some(), "the listener that does not read is still there");
    let err = sqlx::query("SELECT 1").execute(&mut deaf).await.expect_err("its session was ended");
    assert!(!err.to_string().is_empty());
    let counted = scheduler_metric("sandcell_tenant_db_sessions_ended_total").await;
    assert!(counted.is_some_and(|n| n >= 1.0), "counted {counted:?}");
}

/// A flood into one of the tenant's sessions lands in one intake partition, where every other
/// tenant's submission routed there waits behind it. Judged in the session's lane, one look and
/// one write after another, 3,000 such jobs past the quota held another tenant's `6*7` 8.1-8.2 s
/// (release build); refused from the intake's memory outside the lane and written in batches,
/// 0.8-0.9 s. The refusals never reorder the session: its admitted jobs still run in the order
/// published, and none of the flood runs.
#[tokio::test]
async fn a_flood_into_one_session_past_the_quota_is_refused_from_memory_and_the_session_keeps_its_order() {
    use futures::StreamExt as _;
    let _alone = COUNTS_REFUSALS_FROM_MEMORY.lock().await;
    let t = TestTenant::create(Some(Quotas { max_queued_jobs: 2, ..Quotas::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let sid = session_id(&run(&c, &open_session(&t.name, "x = 0", None)).await);
    let before = refused_from_memory().await;
    // Two jobs of the session hold the quota while the flood arrives: one running, one queued
    // behind it.
    let held = [in_session(&t.name, &sid, "import time; time.sleep(8); x = 1"), in_session(&t.name, &sid, "x = x + 1")];
    hold_quota_with(&c, &pool, &t.name, &held).await;

    const FLOOD: usize = 400;
    let flood: Vec<_> = (0..FLOOD).map(|_| in_session(&t.name, &sid, "x = -1")).collect();
    futures::stream::iter(&flood).map(|s| c.submit(s)).buffer_unordered(32).for_each(|r| async { r.expect("submit") }).await;
    let ids: Vec<String> = flood.iter().map(|s| s.job_id.clone()).collect();
    let answered = answers_of(&pool, &t.name, &ids, Duration::from_secs(60)).await.expect("every submission of the flood answered");
    for a in &answered {
        assert_eq!((a.status.as_str(), a.code.as_deref()), ("rejected", Some("quota_exceeded")), "{a:?}");
    }
    mostly_refused_from_memory(before, FLOOD, "jobs into one session past the quota").await;

    // The session's admitted jobs ran in order, and none of the flood ran.
    for s in &held {
        let r = c.wait(&t.name, &s.job_id, JOB_WAIT).await.expect("result");
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    }
    let next = run(&c, &in_session(&t.name, &sid, "x")).await;
    assert_eq!(value(&next).as_deref(), Some("2"), "{next:?}");
}
