//! Intake: idempotency and bad messages. Every bad input gets a recorded, documented error and
//! the scheduler and worker keep serving the next valid job.

use std::time::Duration;

use sandcell_protocol::{ErrorCode, JobStatus};
use sandcell_tests::*;
use sqlx::Row;

#[tokio::test]
async fn the_same_job_id_submitted_twice_runs_once() {
    let c = client().await;
    // The output differs on every run, so a second run would be visible.
    let sub = python(&tenant(), "import uuid\nprint(uuid.uuid4())");
    c.submit(&sub).await.unwrap();
    c.submit(&sub).await.unwrap();
    let first = c.wait(&sub.tenant, &sub.job_id, JOB_WAIT).await.unwrap();
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    // A late retry after completion.
    c.submit(&sub).await.unwrap();
    // Give the scheduler and workers time to (wrongly) run it again.
    let marker = run(&c, &python(&sub.tenant, "print('after')")).await;
    assert_eq!(marker.status, JobStatus::Succeeded, "{marker:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again = c.result(&sub.tenant, &sub.job_id).await.unwrap().unwrap();
    assert_eq!(again.attempts, 1);
    assert_eq!(again.execution.stdout, first.execution.stdout);
    assert_eq!(again.timings, first.timings);
}

#[tokio::test]
async fn malformed_json_is_recorded_and_dead_lettered() {
    let c = client().await;
    let message_id = unique("garbage");
    c.submit_raw(b"{\"job_id\": \"x\", oops", Some(&message_id)).await.unwrap();
    let url = std::env::var("SANDCELL_DATABASE_URL").unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let code = eventually(Duration::from_secs(30), || {
        let pool = pool.clone();
        let id = message_id.clone();
        async move {
            sqlx::query("SELECT code FROM intake_rejections WHERE message_id = $1")
                .bind(id)
                .fetch_optional(&pool)
                .await
                .unwrap()
                .map(|r| r.get::<String, _>("code"))
        }
    })
    .await;
    assert_eq!(code.as_deref(), Some("malformed_json"));
    let next = run(&c, &python(&tenant(), "print('still serving')")).await;
    assert_eq!(next.execution.stdout, "still serving\n", "{next:?}");
}

async fn rejected_with(body: serde_json::Value) -> sandcell_protocol::JobResult {
    let c = client().await;
    let (tenant, job_id) = (body["tenant"].as_str().unwrap().to_string(), body["job_id"].as_str().unwrap().to_string());
    c.submit_raw(body.to_string().as_bytes(), Some(&job_id)).await.unwrap();
    let r = c.wait(&tenant, &job_id, JOB_WAIT).await.unwrap();
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert!(r.limits.is_none() && r.worker_id.is_none(), "a rejected job never runs");
    r
}

fn body() -> serde_json::Value {
    serde_json::json!({"job_id": unique("bad"), "tenant": tenant(), "language": "python", "code": "print(1)"})
}

/// One of the intake's batch writers (`scheduler::batches`), as its histogram in the scheduler's
/// metrics counts it.
#[derive(Debug, Clone, Copy)]
enum BatchWriter {
    Refusals,
    Grants,
    UploadRefusals,
    Unattributable,
}

impl BatchWriter {
    /// What it has written so far, and in how many transactions.
    async fn figures(self) -> (f64, f64) {
        let name = match self {
            BatchWriter::Refusals => "sandcell_intake_refusal_batch_size",
            BatchWriter::Grants => "sandcell_intake_upload_grant_batch_size",
            BatchWriter::UploadRefusals => "sandcell_intake_upload_refusal_batch_size",
            BatchWriter::Unattributable => "sandcell_intake_unattributable_batch_size",
        };
        let sum = scheduler_metric(&format!("{name}_sum")).await.expect("the scheduler's metrics");
        let count = scheduler_metric(&format!("{name}_count")).await.expect("the scheduler's metrics");
        (sum, count)
    }

    /// Since its figures were `before`, it wrote at least `flood` items, at least two to a
    /// transaction on average.
    async fn wrote_in_batches_since(self, before: (f64, f64), flood: usize) {
        let (sum, count) = self.figures().await;
        let (items, transactions) = (sum - before.0, count - before.1);
        eprintln!("a flood of {flood}: {self:?} wrote {items} in {transactions} transactions");
        assert!(items >= flood as f64, "only {items} of the flood's {flood} went through the writer of {self:?}");
        assert!(transactions <= items / 2.0, "{transactions} transactions for {items} of {self:?}: not written in batches");
    }
}

/// A tenant's flood of invalid submissions is refused without a judgment under its lock or a
/// place at its gate, the refusals written many to a transaction (`scheduler::refusals`): before,
/// one transaction each, 3,000 published in 0.5-0.7 s to one partition held another tenant's job
/// there up 6.2-7.6 s; 1.2-1.3 s now. Every one is still answered with its own reason.
#[tokio::test]
async fn a_tenants_flood_of_invalid_submissions_is_answered_every_one_with_its_refusals_written_in_batches() {
    use futures::StreamExt as _;
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let pool = service_db().await;
    let before = BatchWriter::Refusals.figures().await;
    const FLOOD: usize = 400;
    let ids: Vec<String> = (0..FLOOD).map(|_| unique("bad")).collect();
    let bodies: Vec<Vec<u8>> =
        ids.iter().map(|id| serde_json::json!({"tenant": t.name, "job_id": id, "language": "cobol", "code": "1"}).to_string().into_bytes()).collect();
    futures::stream::iter(ids.iter().zip(&bodies))
        .map(|(id, b)| c.submit_raw(b, Some(id)))
        .buffer_unordered(32)
        .for_each(|r| async { r.expect("publish") })
        .await;
    let answers = answers_of(&pool, &t.name, &ids, Duration::from_secs(60)).await.expect("every submission of the flood answered");
    for a in &answers {
        assert_eq!((a.status.as_str(), a.code.as_deref()), ("rejected", Some("unknown_language")), "{a:?}");
    }
    BatchWriter::Refusals.wrote_in_batches_since(before, FLOOD).await;
}

/// A tenant's flood of messages that name no job (not JSON) is recorded for operators in
/// `intake_rejections` many to a transaction, without a place at the tenant's gate
/// (`scheduler::refusals::IntakeRejections`): before, one statement each, 4 at a time, 3,000 of
/// them held another tenant's job published behind them up 3.2-4.0 s; 0.44-1.02 s now. Every
/// one is still recorded, with its reason and the start of its body, and dead-lettered.
#[tokio::test]
async fn a_tenants_flood_of_unreadable_messages_is_recorded_every_one_in_batches_and_dead_lettered() {
    use futures::StreamExt as _;
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let pool = service_db().await;
    let dead_lettered = || async { scheduler_metric("sandcell_submissions_total{outcome=\"dead_lettered\"}").await.expect("the scheduler's metrics") };
    let (before, dead_before) = (BatchWriter::Unattributable.figures().await, dead_lettered().await);
    const FLOOD: usize = 400;
    let prefix = unique("unreadable");
    let ids: Vec<String> = (0..FLOOD).map(|i| format!("{prefix}-{i}")).collect();
    let bodies: Vec<Vec<u8>> = ids.iter().map(|id| format!("not json {id}").into_bytes()).collect();
    futures::stream::iter(ids.iter().zip(&bodies))
        .map(|(id, b)| c.submit_raw(b, Some(id)))
        .buffer_unordered(32)
        .for_each(|r| async { r.expect("publish") })
        .await;
    let rows = eventually(Duration::from_secs(60), || async {
        let rows: Vec<(String, String, String, i32)> =
            sqlx::query_as("SELECT message_id, code, body_prefix, body_bytes FROM intake_rejections WHERE publisher = $1 AND message_id LIKE $2 || '-%'")
                .bind(&t.name)
                .bind(&prefix)
                .fetch_all(&pool)
                .await
                .ok()?;
        (rows.len() >= FLOOD).then_some(rows)
    })
    .await
    .expect("every message of the flood recorded");
    assert_eq!(rows.len(), FLOOD, "each message recorded once");
    for (id, code, body, bytes) in &rows {
        assert_eq!(code, "malformed_json", "{id}");
        assert_eq!((body.as_str(), *bytes as usize), (format!("not json {id}").as_str(), format!("not json {id}").len()), "{id}");
    }
    BatchWriter::Unattributable.wrote_in_batches_since(before, FLOOD).await;
    let dead = dead_lettered().await - dead_before;
    assert!(dead >= FLOOD as f64, "{dead} dead-lettered of the flood's {FLOOD}");
}

/// A batch of intake rejections of several publishers (one with none) keeps each publisher's
/// newest `KEPT_INTAKE_REJECTIONS` and no fewer: the batch's own rows count among them, and
/// trimming one publisher's group touches no other's.
#[tokio::test]
async fn a_batch_of_intake_rejections_keeps_each_publishers_newest_and_only_those() {
    use sandcell_core::jobs::{IntakeRejection, JobStore, KEPT_INTAKE_REJECTIONS};
    let db = service_db().await;
    let store = JobStore::new(db.clone());
    let (busy, quiet) = (unique("busy"), unique("quiet"));
    let kept = KEPT_INTAKE_REJECTIONS as usize;
    let reason = sandcell_protocol::Reason::new(ErrorCode::MalformedJson, "not JSON");
    let of = |publisher: Option<&str>, id: String| IntakeRejection::new(Some(&id), publisher, &reason, id.as_bytes());
    let first: Vec<IntakeRejection> = (0..kept - 10).map(|i| of(Some(&busy), format!("{busy}-{i}"))).collect();
    store.record_intake_rejections(&first).await.expect("the first batch");
    // 40 more of `busy`: its 30 oldest go; `quiet` and the group without a publisher lose none.
    let mut second: Vec<IntakeRejection> = (kept - 10..kept + 30).map(|i| of(Some(&busy), format!("{busy}-{i}"))).collect();
    second.push(of(Some(&quiet), format!("{quiet}-0")));
    second.push(of(None, format!("{quiet}-anonymous")));
    store.record_intake_rejections(&second).await.expect("the second batch");
    let ids = |publisher: String| {
        let db = db.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT message_id FROM intake_rejections WHERE publisher = $1 ORDER BY id")
                .bind(publisher)
                .fetch_all(&db)
                .await
                .expect("reading intake rejections")
        }
    };
    let busy_ids = ids(busy.clone()).await;
    assert_eq!(busy_ids.len(), kept, "the busy publisher keeps its newest {kept}");
    assert_eq!(busy_ids.first().map(String::as_str), Some(format!("{busy}-30").as_str()), "its oldest 30 went");
    assert_eq!(busy_ids.last().map(String::as_str), Some(format!("{busy}-{}", kept + 29).as_str()));
    assert_eq!(ids(quiet.clone()).await, vec![format!("{quiet}-0")]);
    let anonymous: i64 = sqlx::query_scalar("SELECT count(*) FROM intake_rejections WHERE publisher IS NULL AND message_id = $1")
        .bind(format!("{quiet}-anonymous"))
        .fetch_one(&db)
        .await
        .expect("counting");
    assert_eq!(anonymous, 1, "a message without a publisher is kept in its own group");
}

/// A tenant's flood of upload requests is granted through the intake's grant writer, many to a
/// transaction (`scheduler::uploads::Grants`): before, one transaction each under the tenant's
/// lock, 3,000 granted requests held another tenant's job published behind them up 3.9-6.5 s;
/// 0.2-0.4 s now. Every request still gets its own grant, for its own keys.
#[tokio::test]
async fn a_tenants_flood_of_upload_requests_is_granted_every_one_with_its_grants_written_in_batches() {
    use futures::StreamExt as _;
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let pool = service_db().await;
    let before = BatchWriter::Grants.figures().await;
    const FLOOD: usize = 400;
    let requests: Vec<UploadRequest> = (0..FLOOD)
        .map(|_| UploadRequest { tenant: t.name.clone(), upload_id: unique("up"), files: vec![UploadFile { path: "data/a.csv".into(), size_bytes: 10 }] })
        .collect();
    futures::stream::iter(&requests).map(|r| c.request_upload(r)).buffer_unordered(32).for_each(|r| async { r.expect("publish") }).await;
    let ids: Vec<&str> = requests.iter().map(|r| r.upload_id.as_str()).collect();
    let answered = eventually(Duration::from_secs(60), || async {
        let rows: Vec<(String, serde_json::Value)> = sqlx::query_as("SELECT upload_id, grant_doc FROM uploads WHERE tenant = $1 AND upload_id = ANY($2)")
            .bind(&t.name)
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .ok()?;
        (rows.len() == FLOOD).then_some(rows)
    })
    .await
    .expect("every upload request of the flood answered");
    for (id, doc) in &answered {
        let grant: sandcell_protocol::upload::UploadGrant = serde_json::from_value(doc.clone()).expect("a grant");
        assert_eq!(grant.status, "ready", "{grant:?}");
        let keys: Vec<&str> = grant.files.iter().map(|f| f.s3_key.as_str()).collect();
        assert_eq!(keys, [format!("{}/_uploads/{id}/data/a.csv", t.name)], "{grant:?}");
    }
    let (kept, summed) = uploadable_bytes(&pool, &t.name).await;
    assert_eq!((kept, summed), (10 * FLOOD as i64, 10 * FLOOD as i64), "the flood's bytes, counted once each");
    BatchWriter::Grants.wrote_in_batches_since(before, FLOOD).await;
}

/// A tenant's flood of upload requests the intake refuses (half invalid, half past its
/// stored-bytes quota) is answered every one, each with its own reason, the refusals recorded
/// many to a transaction (`scheduler::uploads::UploadRefusals`): before, one transaction each
/// with a place at the tenant's gate, 3,000 past the quota held another tenant's job published
/// behind them 2.1 s.
#[tokio::test]
async fn a_tenants_flood_of_refused_upload_requests_is_answered_every_one_with_its_refusals_written_in_batches() {
    use futures::StreamExt as _;
    use sandcell_protocol::upload::{UploadFile, UploadRequest};
    let t = TestTenant::create(Some(sandcell_core::tenants::Quotas { max_artifact_bytes: 100, ..Default::default() })).await;
    let c = t.client().await;
    let pool = service_db().await;
    let before = BatchWriter::UploadRefusals.figures().await;
    const FLOOD: usize = 400;
    let requests: Vec<UploadRequest> = (0..FLOOD)
        .map(|i| {
            let (path, size_bytes) = if i % 2 == 0 { ("../escape.csv", 1) } else { ("data/big.csv", 1_000) };
            UploadRequest { tenant: t.name.clone(), upload_id: unique("up"), files: vec![UploadFile { path: path.into(), size_bytes }] }
        })
        .collect();
    futures::stream::iter(&requests).map(|r| c.request_upload(r)).buffer_unordered(32).for_each(|r| async { r.expect("publish") }).await;
    let ids: Vec<&str> = requests.iter().map(|r| r.upload_id.as_str()).collect();
    let answered: std::collections::HashMap<String, serde_json::Value> = eventually(Duration::from_secs(60), || async {
        let rows: Vec<(String, serde_json::Value)> = sqlx::query_as("SELECT upload_id, grant_doc FROM uploads WHERE tenant = $1 AND upload_id = ANY($2)")
            .bind(&t.name)
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .ok()?;
        (rows.len() == FLOOD).then_some(rows.into_iter().collect())
    })
    .await
    .expect("every upload request of the flood answered");
    for (i, r) in requests.iter().enumerate() {
        let grant: sandcell_protocol::upload::UploadGrant = serde_json::from_value(answered[&r.upload_id].clone()).expect("an answer");
        let code = grant.reason.as_ref().map(|r| r.code);
        assert_eq!(grant.status, "rejected", "{grant:?}");
        assert!(grant.files.is_empty(), "a refusal lets its tenant put nothing: {grant:?}");
        if i % 2 == 0 {
            assert_eq!(code, Some(ErrorCode::InvalidFilePath), "{grant:?}");
        } else {
            assert_eq!(code, Some(ErrorCode::QuotaExceeded), "{grant:?}");
        }
    }
    assert_eq!(uploadable_bytes(&pool, &t.name).await, (0, 0), "a refusal counts no bytes");
    BatchWriter::UploadRefusals.wrote_in_batches_since(before, FLOOD).await;
}

/// The grants of one batch are judged one after another against their tenants' quotas (a grant
/// sees the bytes of those before it in the batch), a tenant with no row is registered, the
/// answers come back in the order asked, whatever order the batch takes the tenants' locks in,
/// a refusal is left to the caller to record, and a batch of the grant writer passes over a
/// tenant whose row is held and gives up waiting for any other row after its lock timeout.
#[tokio::test]
async fn grants_of_one_batch_are_judged_in_turn_against_their_tenants_quotas_and_answered_in_the_order_asked() {
    use sandcell_core::uploads::{grant_many, GrantAsk, Granted};
    use sandcell_protocol::upload::UploadGrant;
    let db = service_db().await;
    let (t, newcomer) = (tenant(), tenant());
    let quotas = sandcell_core::tenants::Quotas { max_artifact_bytes: 1000, ..Default::default() };
    sandcell_core::tenants::TenantStore::new(db.clone()).set_quotas(&t, &quotas).await.expect("tenant");
    let until = chrono::Utc::now() + chrono::Duration::hours(1);
    let ask = |tenant: &str, id: &str, bytes: u64| GrantAsk {
        grant: UploadGrant { tenant: tenant.into(), upload_id: id.into(), status: "ready".into(), reason: None, files: vec![], expires_at: None },
        bytes,
        objects_expire_at: until,
    };
    // Taken as (tenant, id): t's up-a (300), up-m (200), then up-z (600) finds 500 of 1000 used.
    let asks = [ask(&t, "up-z", 600), ask(&newcomer, "up-a", 10), ask(&t, "up-a", 300), ask(&t, "up-m", 200)];
    let answers = grant_many(&db, &asks, &quotas, false).await.expect("a batch of grants");
    let got: Vec<(&str, &str, &str, bool)> = answers
        .iter()
        .map(|a| match a {
            Granted::Answered(r) => (r.grant.tenant.as_str(), r.grant.upload_id.as_str(), r.grant.status.as_str(), r.inserted),
            Granted::Refused(g) => (g.tenant.as_str(), g.upload_id.as_str(), "refused", false),
            Granted::Busy => ("", "", "busy", false),
        })
        .collect();
    assert_eq!(
        got,
        [
            (t.as_str(), "up-z", "refused", false),
            (newcomer.as_str(), "up-a", "ready", true),
            (t.as_str(), "up-a", "ready", true),
            (t.as_str(), "up-m", "ready", true)
        ],
        "{answers:?}"
    );
    let Granted::Refused(refused) = &answers[0] else { unreachable!() };
    assert_eq!(refused.reason.as_ref().map(|r| r.code), Some(ErrorCode::QuotaExceeded), "{refused:?}");
    assert!(refused.reason.as_ref().is_some_and(|r| r.message.contains("500 bytes")), "the refusal quotes what the batch had granted: {refused:?}");
    let written: Option<String> =
        sqlx::query_scalar("SELECT upload_id FROM uploads WHERE tenant = $1 AND upload_id = 'up-z'").bind(&t).fetch_optional(&db).await.expect("reading");
    assert_eq!(written, None, "a batch wrote a refusal: its caller records it");
    assert_eq!(uploadable_bytes(&db, &t).await, (500, 500));
    assert_eq!(uploadable_bytes(&db, &newcomer).await, (10, 10));
    // The same batch again, waiting: every first answer stands, nothing counted twice.
    let again = grant_many(&db, &asks, &quotas, true).await.expect("the batch again");
    for (a, b) in again.iter().zip(&answers).skip(1) {
        match (a, b) {
            (Granted::Answered(a), Granted::Answered(b)) => assert!(!a.inserted && a.grant == b.grant, "{a:?} {b:?}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(&again[0], Granted::Refused(_)), "{again:?}");
    assert_eq!(uploadable_bytes(&db, &t).await, (500, 500));

    // A batch that does not wait for locks passes over a tenant whose row another transaction
    // holds, writing nothing of its grant, and grants the others.
    let mut holder = db.begin().await.expect("beginning the lock's transaction");
    sqlx::query("SELECT 1 FROM tenants WHERE tenant = $1 FOR UPDATE").bind(&t).execute(&mut *holder).await.expect("locking the tenant's row");
    let passed = tokio::time::timeout(Duration::from_secs(10), grant_many(&db, &[ask(&t, "up-held", 1), ask(&newcomer, "up-b", 1)], &quotas, false))
        .await
        .expect("the batch waited for a held tenant's row")
        .expect("a batch past a held row");
    holder.rollback().await.expect("letting the lock go");
    assert!(matches!(passed[0], Granted::Busy), "{passed:?}");
    assert!(matches!(&passed[1], Granted::Answered(r) if r.grant.status == "ready"), "{passed:?}");
    let written: Option<String> =
        sqlx::query_scalar("SELECT upload_id FROM uploads WHERE tenant = $1 AND upload_id = 'up-held'").bind(&t).fetch_optional(&db).await.expect("reading");
    assert_eq!(written, None, "a grant passed over was written");

    // A batch waiting for another row (here an insert of the same upload id, uncommitted) gives
    // up after its lock timeout instead of holding every tenant's grants up.
    let mut inserting = db.begin().await.expect("beginning the insert's transaction");
    sqlx::query("INSERT INTO uploads (tenant, upload_id, grant_doc) VALUES ($1, 'up-racing', '{}')")
        .bind(&newcomer)
        .execute(&mut *inserting)
        .await
        .expect("inserting");
    let gave_up = tokio::time::timeout(Duration::from_secs(10), grant_many(&db, &[ask(&newcomer, "up-racing", 1)], &quotas, false))
        .await
        .expect("the batch waited past its lock timeout");
    inserting.rollback().await.expect("rolling the insert back");
    assert!(gave_up.is_err(), "{gave_up:?}");
}

#[tokio::test]
async fn a_missing_field_is_rejected_with_missing_field() {
    let mut b = body();
    b.as_object_mut().unwrap().remove("code");
    let r = rejected_with(b).await;
    let reason = r.reason.unwrap();
    assert_eq!(reason.code, ErrorCode::MissingField);
    assert!(reason.message.contains("code"), "{}", reason.message);
}

#[tokio::test]
async fn a_wrong_type_is_rejected_with_wrong_type() {
    let mut b = body();
    b["timeout_ms"] = serde_json::json!("5000");
    assert_eq!(rejected_with(b).await.reason.unwrap().code, ErrorCode::WrongType);
}

#[tokio::test]
async fn an_unknown_language_is_rejected() {
    let mut b = body();
    b["language"] = serde_json::json!("cobol");
    assert_eq!(rejected_with(b).await.reason.unwrap().code, ErrorCode::UnknownLanguage);
}

#[tokio::test]
async fn hostile_input_file_names_are_rejected() {
    for path in ["../../etc/passwd", "/etc/passwd", "a\u{0}b"] {
        let mut b = body();
        b["files"] = serde_json::json!([{"path": path, "content_b64": "aGk="}]);
        assert_eq!(rejected_with(b).await.reason.unwrap().code, ErrorCode::InvalidFilePath, "{path:?}");
    }
}

#[tokio::test]
async fn oversize_code_is_rejected() {
    let mut b = body();
    b["code"] = serde_json::json!(format!("# {}\nprint(1)", "x".repeat(1 << 20)));
    assert_eq!(rejected_with(b).await.reason.unwrap().code, ErrorCode::OversizeCode);
}

#[tokio::test]
async fn bad_messages_do_not_stop_the_service() {
    let c = client().await;
    for raw in [&b"\xff\xfe not even utf-8"[..], b"[]", b"{}", b"null"] {
        c.submit_raw(raw, None).await.unwrap();
    }
    let mut missing = body();
    missing.as_object_mut().unwrap().remove("language");
    c.submit_raw(missing.to_string().as_bytes(), None).await.unwrap();
    let r = run(&c, &python(&tenant(), "print(2 + 2)")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.execution.stdout, "4\n", "{r:?}");
}

/// One submission per validation error the table in docs/protocol.md §4 lists as `rejected`
/// (the ones needing a session, a tenant or a quota are proven in sessions.rs and tenants.rs).
#[tokio::test]
async fn every_validation_error_is_rejected_with_its_documented_code() {
    use serde_json::json;
    let big = "A".repeat(12 << 20); // base64 text decoding to 9 MiB
    type Mutate = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(ErrorCode, Mutate)> = vec![
        (ErrorCode::UnknownField, Box::new(|b| b["timout_ms"] = json!(5000))),
        (ErrorCode::WrongType, Box::new(|b| b["files"] = json!({"path": "a"}))),
        (ErrorCode::MissingField, Box::new(|b| drop(b.as_object_mut().unwrap().remove("language")))),
        (ErrorCode::UnknownLanguage, Box::new(|b| b["language"] = json!("javascript"))),
        (ErrorCode::InvalidValue, Box::new(|b| b["code"] = json!("   "))),
        (ErrorCode::InvalidValue, Box::new(|b| b["session"] = json!({"new": true, "id": "ses_00000000000000000000000000000000"}))),
        (ErrorCode::OversizeCode, Box::new(|b| b["code"] = json!("#".repeat((1 << 20) + 1)))),
        (ErrorCode::OversizeFile, Box::new(move |b| b["files"] = json!([{"path": "big.bin", "content_b64": big.clone()}]))),
        (ErrorCode::TooManyFiles, Box::new(|b| b["files"] = json!((0..33).map(|i| json!({"path": format!("f{i}"), "content_b64": ""})).collect::<Vec<_>>()))),
        (ErrorCode::InvalidFilePath, Box::new(|b| b["files"] = json!([{"path": "x".repeat(300), "content_b64": ""}]))),
        (ErrorCode::InvalidFilePath, Box::new(|b| b["files"] = json!([{"path": "a/../../b", "content_b64": ""}]))),
        (ErrorCode::InvalidFilePath, Box::new(|b| b["get_files"] = json!(["/etc/shadow"]))),
        (ErrorCode::InvalidFilePath, Box::new(|b| b["files"] = json!([{"path": "in.csv", "s3_key": "someone-else/_uploads/in.csv"}]))),
        (ErrorCode::DuplicateFilePath, Box::new(|b| b["files"] = json!([{"path": "a", "content_b64": ""}, {"path": "a", "content_b64": ""}]))),
        (ErrorCode::InvalidBase64, Box::new(|b| b["files"] = json!([{"path": "a", "content_b64": "not base64!"}]))),
    ];
    for (expected, mutate) in cases {
        let mut b = body();
        mutate(&mut b);
        let r = rejected_with(b).await;
        let reason = r.reason.expect("reason");
        assert_eq!(reason.code, expected, "{}", reason.message);
        assert!(!reason.message.is_empty());
    }
}

#[tokio::test]
async fn an_oversize_message_is_rejected_when_its_ids_are_readable() {
    let c = client().await;
    let mut b = body();
    // Over the protocol's 16 MiB, under the broker's limit (16 MiB + 1 MiB for the envelope).
    b["code"] = serde_json::json!(format!("print(1)\n#{}", "x".repeat((16 << 20) + 4096)));
    let (tenant, job_id) = (b["tenant"].as_str().unwrap().to_string(), b["job_id"].as_str().unwrap().to_string());
    c.submit_raw(b.to_string().as_bytes(), Some(&job_id)).await.unwrap();
    let r = c.wait(&tenant, &job_id, JOB_WAIT).await.unwrap();
    assert_eq!((r.status, r.reason.as_ref().map(|x| x.code)), (JobStatus::Rejected, Some(ErrorCode::OversizeMessage)), "{r:?}");
}

#[tokio::test]
async fn the_broker_refuses_a_message_over_its_limit_before_it_reaches_the_scheduler() {
    let c = client().await;
    let mut b = body();
    b["code"] = serde_json::json!("x".repeat(18 << 20));
    let err = c.submit_raw(b.to_string().as_bytes(), None).await.expect_err("the broker takes no 18 MiB message");
    assert!(format!("{err:#}").contains("larger than configured max size"), "{err:#}");
    // The client reconnects; the service goes on.
    let c = client().await;
    let next = run(&c, &python(&tenant(), "print('still serving')")).await;
    assert_eq!(next.execution.stdout, "still serving\n", "{next:?}");
}

/// The scheduler's record checks an id under the tenant's lock, but a refusal is recorded
/// without it: a row written under the same id while a submission is being recorded makes the
/// record a duplicate, and the session that submission would have opened is not left behind.
#[tokio::test]
async fn a_job_id_taken_while_its_submission_is_recorded_is_a_duplicate_and_opens_no_session() {
    use sandcell_core::jobs::{JobSessionRecord, JobStore, Recorded};
    let db = service_db().await;
    let t = tenant();
    let sub = open_session(&t, "1+1", None);
    let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
    // The other writer holds its row uncommitted: the record cannot see it yet, and its insert
    // waits for that transaction.
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 10, 10, 1000000)")
        .bind(&t)
        .execute(&db)
        .await
        .expect("tenant");
    let mut other = db.begin().await.expect("begin");
    let other_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *other).await.expect("pid");
    sqlx::query("INSERT INTO jobs (tenant, job_id, status, execution, finished_at) VALUES ($1, $2, 'rejected', '{}', now())")
        .bind(&t)
        .bind(&sub.job_id)
        .execute(&mut *other)
        .await
        .expect("the other writer's row");
    let session = unique("s");
    let record = {
        let (store, sub, session) = (JobStore::new(db.clone()), sub.clone(), session.clone());
        tokio::spawn(async move { store.record_queued(&sub, &limits, "digest", Some(JobSessionRecord::Open(&session, 60)), Some(b"job")).await })
    };
    // Commit once the record waits for it (a lock the other transaction holds).
    let waiting = eventually(Duration::from_secs(10), || {
        let db = db.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))").bind(other_pid).fetch_one(&db).await.ok()?;
            (n > 0).then_some(())
        }
    })
    .await;
    assert!(waiting.is_some(), "the record never waited for the other writer");
    other.commit().await.expect("commit");
    let recorded = record.await.expect("task").expect("recorded");
    assert!(matches!(recorded, Recorded::Duplicate { status: JobStatus::Rejected, same_payload: false, .. }), "{recorded:?}");
    let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM sessions WHERE session_id = $1").bind(&session).fetch_one(&db).await.expect("count");
    assert_eq!(sessions, 0, "the session of a duplicate was left behind");
}

/// A resubmitted id is answered as the job it names even while its tenant is over a quota: the
/// quota refuses new jobs, not a retry of one already taken (the record checks the id first).
#[tokio::test]
async fn a_resubmitted_id_is_a_duplicate_even_while_its_tenant_is_over_its_quota() {
    use sandcell_core::jobs::{JobStore, Recorded};
    let db = service_db().await;
    let t = tenant();
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 10, 1, 1000000)")
        .bind(&t)
        .execute(&db)
        .await
        .expect("tenant");
    let store = JobStore::new(db.clone());
    let sub = python(&t, "1+1");
    let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
    let first = store.record_queued(&sub, &limits, "digest", None, None).await.expect("first record");
    assert!(matches!(first, Recorded::New { .. }), "{first:?}");
    // Its one queued job is the quota: a new id is refused ...
    let other = python(&t, "2+2");
    let refused = store.record_queued(&other, &limits, "other digest", None, None).await.expect("second record");
    assert!(matches!(refused, Recorded::OverQuota(_)), "{refused:?}");
    // ... and the same id, resubmitted, is the job already taken.
    let again = store.record_queued(&sub, &limits, "digest", None, None).await.expect("third record");
    assert!(matches!(again, Recorded::Duplicate { status: JobStatus::Queued, same_payload: true, .. }), "{again:?}");
}

/// A job naming an existing session is routed by its own record, in the same statement: to the
/// session's worker when it is active, parked (no owner, nothing published) while it moves or
/// while earlier jobs of it wait parked, and refused, with nothing written, when the tenant has
/// no such session (another tenant's included) or it cannot take jobs. A duplicate id is
/// answered with the route, so that its first delivery can finish the dispatch.
#[tokio::test]
async fn the_record_routes_a_session_job_to_its_worker_parks_it_while_the_session_moves_and_refuses_it_otherwise() {
    use sandcell_core::jobs::{JobSessionRecord, JobStore, Recorded};
    let db = service_db().await;
    let (t, other_tenant) = (tenant(), tenant());
    for name in [&t, &other_tenant] {
        sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 100, 100, 1000000)")
            .bind(name)
            .execute(&db)
            .await
            .expect("tenant");
    }
    let session = |owner: &str, state: &str, worker: Option<&str>| {
        let (db, owner, state, worker, id) = (db.clone(), owner.to_string(), state.to_string(), worker.map(str::to_string), unique("s"));
        async move {
            sqlx::query("INSERT INTO sessions (session_id, tenant, state, keep_alive_s, worker_id, created_by_job) VALUES ($1, $2, $3, 60, $4, 'opener')")
                .bind(&id)
                .bind(&owner)
                .bind(&state)
                .bind(&worker)
                .execute(&db)
                .await
                .expect("session");
            id
        }
    };
    let store = JobStore::new(db.clone());
    let record = |sid: String, job: sandcell_protocol::Submission| {
        let store = store.clone();
        async move {
            let mut sub = job;
            sub.session = Some(sandcell_protocol::SessionRequest { id: Some(sid.clone()), ..Default::default() });
            let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
            let recorded =
                store.record_queued(&sub, &limits, "digest", Some(JobSessionRecord::Existing { id: &sid, routed: b"routed job" }), None).await.expect("record");
            (sub.job_id, recorded)
        }
    };
    let row = |job_id: String| {
        let (db, t) = (db.clone(), t.clone());
        async move {
            sqlx::query("SELECT parked, routed_to, routed FROM jobs WHERE tenant = $1 AND job_id = $2")
                .bind(&t)
                .bind(&job_id)
                .fetch_optional(&db)
                .await
                .expect("job row")
                .map(|r| (r.get::<bool, _>("parked"), r.get::<Option<String>, _>("routed_to"), r.get::<Option<Vec<u8>>, _>("routed")))
        }
    };

    // Active on a worker: routed there, the payload kept.
    let active = session(&t, "active", Some("worker-a")).await;
    let first = python(&t, "1");
    let (job, recorded) = record(active.clone(), first.clone()).await;
    assert!(matches!(&recorded, Recorded::New { routed_to: Some(w) } if w == "worker-a"), "{recorded:?}");
    assert_eq!(row(job).await, Some((false, Some("worker-a".into()), Some(b"routed job".to_vec()))));
    // The same id again: a duplicate, still queued and routed, for its first delivery to finish.
    let (_, again) = record(active.clone(), first).await;
    assert!(matches!(&again, Recorded::Duplicate { status: JobStatus::Queued, routed_to: Some(w), .. } if w == "worker-a"), "{again:?}");

    // The stack's scheduler runs beside this test, and its dispatcher takes a session's parked
    // jobs up at once (the oldest takes a moving session over; an active session's are sent to
    // its owner). A share lock on the session's row keeps it away while the test looks: the
    // dispatcher skips a locked session (`FOR NO KEY UPDATE SKIP LOCKED`), and the record takes
    // no lock on the row.
    let hold = |sid: String| {
        let db = db.clone();
        async move {
            let mut tx = db.begin().await.expect("begin");
            sqlx::query("SELECT 1 FROM sessions WHERE session_id = $1 FOR SHARE").bind(&sid).execute(&mut *tx).await.expect("share lock");
            tx
        }
    };
    // Moving: parked, with no owner.
    let moving = session(&t, "moving", None).await;
    let held = hold(moving.clone()).await;
    let (job, recorded) = record(moving.clone(), python(&t, "2")).await;
    assert!(matches!(recorded, Recorded::Parked), "{recorded:?}");
    assert_eq!(row(job).await, Some((true, None, Some(b"routed job".to_vec()))));
    held.rollback().await.expect("rollback");
    // Active on a new worker while a job the move parked still waits: the next one waits behind it.
    let moved = session(&t, "active", Some("worker-b")).await;
    let held = hold(moved.clone()).await;
    sqlx::query("INSERT INTO jobs (tenant, job_id, status, execution, session_id, parked, routed) VALUES ($1, $2, 'queued', '{}', $3, true, $4)")
        .bind(&t)
        .bind(unique("parked-by-the-move"))
        .bind(&moved)
        .bind(b"routed job".as_slice())
        .execute(&db)
        .await
        .expect("a job the move parked");
    let (job, recorded) = record(moved.clone(), python(&t, "3")).await;
    assert!(matches!(recorded, Recorded::Parked), "{recorded:?}");
    assert_eq!(row(job).await, Some((true, None, Some(b"routed job".to_vec()))));
    held.rollback().await.expect("rollback");

    // Refused, nothing written: no such session, another tenant's, one that cannot take jobs.
    let others = session(&other_tenant, "active", Some("worker-a")).await;
    let cases = [
        (unique("s"), ErrorCode::SessionNotFound),
        (others, ErrorCode::SessionNotFound),
        (session(&t, "closed", None).await, ErrorCode::SessionClosed),
        (session(&t, "expired", None).await, ErrorCode::SessionExpired),
        (session(&t, "starting", None).await, ErrorCode::SessionNotReady),
        (session(&t, "lost", None).await, ErrorCode::SessionLost),
        (session(&t, "active", None).await, ErrorCode::SessionLost),
    ];
    for (sid, code) in cases {
        let (job, recorded) = record(sid.clone(), python(&t, "4")).await;
        match &recorded {
            Recorded::SessionRefused(reason) => assert_eq!(reason.code, code, "session {sid}: {reason:?}"),
            other => panic!("session {sid}: expected a refusal with {code:?}, got {other:?}"),
        }
        assert_eq!(row(job).await, None, "a refused job of session {sid} was written");
    }
    end_what_was_written_by_hand(&db, &[&t, &other_tenant]).await;
}

/// End the sessions and jobs a test wrote by hand for `tenants`: sessions closed, unfinished jobs
/// cancelled. The stack's scheduler runs beside the tests and acts on what they leave: a session
/// left active on a worker that never existed keeps its parked jobs, which the dispatcher then
/// tries to publish to that worker's missing queue on every tick, for as long as the database
/// lives (on a stack's shared database: until someone deletes it).
async fn end_what_was_written_by_hand(db: &sqlx::PgPool, tenants: &[&str]) {
    let tenants: Vec<String> = tenants.iter().map(|t| t.to_string()).collect();
    sqlx::query("UPDATE jobs SET status = 'cancelled', finished_at = now() WHERE tenant = ANY($1) AND status IN ('queued', 'running')")
        .bind(&tenants)
        .execute(db)
        .await
        .expect("ending the test's jobs");
    sqlx::query("UPDATE sessions SET state = 'closed', ended_at = now() WHERE tenant = ANY($1) AND state IN ('starting', 'active', 'moving')")
        .bind(&tenants)
        .execute(db)
        .await
        .expect("ending the test's sessions");
}

/// The figures the record reads instead of counting (`tenant_job_counts`, migration 0015), and
/// the same figures counted from the job rows; they must be equal after every step.
async fn job_figures(db: &sqlx::PgPool, t: &str) -> ((i64, i64, i64), (i64, i64, i64)) {
    let kept = sqlx::query(
        "SELECT COALESCE(sum(unfinished), 0)::bigint AS a, COALESCE(sum(shared_out), 0)::bigint AS b, COALESCE(sum(shared_held), 0)::bigint AS c
         FROM tenant_job_counts WHERE tenant = $1",
    )
    .bind(t)
    .fetch_one(db)
    .await
    .expect("kept figures");
    let counted = sqlx::query(
        "SELECT count(*) AS a, count(*) FILTER (WHERE shared AND held_job IS NULL) AS b, count(*) FILTER (WHERE shared AND held_job IS NOT NULL) AS c
         FROM jobs WHERE tenant = $1 AND status IN ('queued', 'running')",
    )
    .bind(t)
    .fetch_one(db)
    .await
    .expect("counted figures");
    let row = |r: &sqlx::postgres::PgRow| (r.get::<i64, _>("a"), r.get::<i64, _>("b"), r.get::<i64, _>("c"));
    (row(&kept), row(&counted))
}

#[tokio::test]
async fn a_tenants_unfinished_job_figures_follow_every_way_a_job_is_recorded_held_released_and_ended_and_its_quota_uses_them() {
    use sandcell_core::jobs::{Finished, JobStore, Recorded};
    let db = service_db().await;
    let t = tenant();
    // Three jobs queued at most, one shared job in flight.
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes, max_jobs_in_flight) VALUES ($1, 10, 3, 1000000, 1)")
        .bind(&t)
        .execute(&db)
        .await
        .expect("tenant");
    let store = JobStore::new(db.clone());
    let record = |sub: sandcell_protocol::Submission| {
        let store = store.clone();
        async move {
            let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
            let recorded = store.record_queued(&sub, &limits, "digest", None, Some(b"payload")).await.expect("record");
            (sub.job_id, recorded)
        }
    };
    let figures = |expected: (i64, i64, i64), step: &str| {
        let (db, t, step) = (db.clone(), t.clone(), step.to_string());
        async move {
            let (kept, counted) = job_figures(&db, &t).await;
            assert_eq!(kept, counted, "after {step}: the kept figures drifted from the job rows");
            assert_eq!(kept, expected, "after {step}: (unfinished, shared out, shared held)");
        }
    };
    figures((0, 0, 0), "nothing").await;

    // The first shared job goes out, the next two are held behind it, the fourth is over quota.
    let (first, r) = record(python(&t, "1")).await;
    assert!(matches!(r, Recorded::New { .. }), "{r:?}");
    let (second, r) = record(python(&t, "2")).await;
    assert!(matches!(r, Recorded::Held), "{r:?}");
    let (_third, r) = record(python(&t, "3")).await;
    assert!(matches!(r, Recorded::Held), "{r:?}");
    figures((3, 1, 2), "three recorded").await;
    let (_, r) = record(python(&t, "4")).await;
    match r {
        Recorded::OverQuota(reason) => assert_eq!(reason.code, ErrorCode::QuotaExceeded, "{reason:?}"),
        other => panic!("a fourth job of a tenant allowed three queued: {other:?}"),
    }
    figures((3, 1, 2), "a refusal over quota").await;

    // The stack's scheduler runs beside this test, and its dispatcher publishes a tenant's held
    // jobs whenever the tenant has room: so that it never does here, a shared job stays out
    // while any is held, and the release is the dispatcher's own statement, made here. The job
    // out is claimed by a worker that keeps beating, or the stack's sweeper would end it
    // `worker_lost` (and so make room) once the worker looked silent.
    let worker = unique("beating-worker");
    let sessions = sandcell_core::sessions::SessionStore::new(db.clone());
    // No room (slots 0): no session is ever placed on it.
    sessions.heartbeat(&worker, 0, 0).await.expect("heartbeat");
    let beating = {
        let worker = worker.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                sessions.heartbeat(&worker, 0, 0).await.expect("heartbeat");
            }
        })
    };
    store.claim(&t, &first, &worker, sandcell_core::jobs::Arrival::default(), Duration::from_secs(30), false).await.expect("claim").expect("claimable");
    figures((3, 1, 2), "a claim").await;
    sqlx::query("UPDATE jobs SET held_job = NULL, dispatched_at = now() WHERE tenant = $1 AND job_id = $2")
        .bind(&t)
        .bind(&second)
        .execute(&db)
        .await
        .expect("release");
    figures((3, 2, 1), "a held job released").await;
    // Finished: its place in the quota is free again.
    let fin = Finished::bare(JobStatus::Failed, sandcell_protocol::Reason::new(ErrorCode::StorageFailed, "done"), None, None);
    assert!(store.finish(&t, &first, &fin).await.expect("finish"));
    figures((2, 1, 1), "a finish").await;
    let (_fifth, r) = record(python(&t, "5")).await;
    assert!(matches!(r, Recorded::Held), "a job behind held ones is held too: {r:?}");
    figures((3, 1, 2), "a job admitted in the freed place").await;

    // Failures end the held ones, a refusal the one out.
    let held: Vec<String> =
        sqlx::query_scalar("SELECT job_id FROM jobs WHERE tenant = $1 AND held_job IS NOT NULL").bind(&t).fetch_all(&db).await.expect("held jobs");
    assert_eq!(held.len(), 2);
    for job_id in &held {
        assert!(store.fail(&t, job_id, JobStatus::InfrastructureError, &sandcell_protocol::Reason::new(ErrorCode::DriverProtocol, "x")).await.expect("fail"));
    }
    figures((1, 1, 0), "held jobs failed").await;
    assert!(store.refuse(&t, &second, &sandcell_protocol::Reason::new(ErrorCode::SessionLost, "gone")).await.expect("refuse"));
    figures((0, 0, 0), "every job ended").await;
    // A job row removed while unfinished takes its figures with it.
    let (gone, _) = record(python(&t, "6")).await;
    figures((1, 1, 0), "one more").await;
    sqlx::query("DELETE FROM jobs WHERE tenant = $1 AND job_id = $2").bind(&t).bind(&gone).execute(&db).await.expect("delete");
    figures((0, 0, 0), "a deleted job").await;
    beating.abort();
}

/// A figure of tenant `t` that triggers keep (`kept`, a query of `$1`), and the same figure
/// summed from its rows (`summed`).
async fn kept_and_summed(db: &sqlx::PgPool, t: &str, kept: &str, summed: &str) -> (i64, i64) {
    let mut figures = [0i64; 2];
    for (figure, sql) in figures.iter_mut().zip([kept, summed]) {
        *figure = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(t).fetch_one(db).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    (figures[0], figures[1])
}

/// The stored bytes the record and the reservation read instead of summing a tenant's artifacts
/// (`tenant_artifact_bytes`, migration 0018), and the same bytes summed from the artifact rows.
async fn stored_bytes(db: &sqlx::PgPool, t: &str) -> (i64, i64) {
    kept_and_summed(
        db,
        t,
        "SELECT COALESCE(sum(bytes), 0)::bigint FROM tenant_artifact_bytes WHERE tenant = $1",
        "SELECT COALESCE(sum(size_bytes), 0)::bigint FROM artifacts WHERE tenant = $1 AND state = 'available'",
    )
    .await
}

#[tokio::test]
async fn a_tenants_stored_bytes_follow_every_result_expiry_and_deletion_and_its_quota_and_reservations_use_them() {
    use sandcell_core::jobs::{Finished, JobStore, NewArtifact, Recorded};
    use sandcell_core::tenants::{Quotas, TenantStore};
    let db = service_db().await;
    let t = tenant();
    let tenants = TenantStore::new(db.clone());
    tenants.set_quotas(&t, &Quotas { max_sessions: 10, max_queued_jobs: 10, max_artifact_bytes: 1000, ..Quotas::default() }).await.expect("tenant");
    let store = JobStore::new(db.clone());
    // A recorded job made `running`, as a worker's claim leaves it.
    let running = |job_id: String| {
        let (db, t) = (db.clone(), t.clone());
        async move {
            sqlx::query("UPDATE jobs SET status = 'running' WHERE tenant = $1 AND job_id = $2").bind(&t).bind(&job_id).execute(&db).await.expect("running");
        }
    };
    let record = |sub: sandcell_protocol::Submission| {
        let store = store.clone();
        async move {
            let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
            let recorded = store.record_queued(&sub, &limits, "digest", None, None).await.expect("record");
            (sub.job_id, recorded)
        }
    };
    // A running job's result, storing `sizes`.
    let finish_with = |job_id: String, sizes: Vec<i64>| {
        let (store, t) = (store.clone(), t.clone());
        async move {
            let mut fin = Finished::bare(JobStatus::Succeeded, sandcell_protocol::Reason::new(ErrorCode::StorageFailed, "unused"), None, None);
            fin.reason = None;
            fin.artifacts = sizes
                .iter()
                .enumerate()
                .map(|(i, size)| NewArtifact {
                    path: format!("f{i}.bin"),
                    kind: sandcell_protocol::ArtifactKind::File,
                    size_bytes: *size,
                    content_type: "application/octet-stream".into(),
                    sha256: "0".repeat(64),
                    s3_key: format!("{t}/{job_id}/f{i}.bin"),
                    expires_at: chrono::Utc::now() + chrono::Duration::hours(1),
                    download_url: "http://127.0.0.1/unused".into(),
                })
                .collect();
            assert!(store.finish(&t, &job_id, &fin).await.expect("finish"), "the result of {job_id} was not taken");
        }
    };
    let bytes = |expected: i64, step: &str| {
        let (db, t, step) = (db.clone(), t.clone(), step.to_string());
        async move {
            let (kept, summed) = stored_bytes(&db, &t).await;
            assert_eq!(kept, summed, "after {step}: the kept bytes drifted from the artifact rows");
            assert_eq!(kept, expected, "after {step}: stored bytes");
        }
    };
    bytes(0, "nothing").await;

    // A job stores two files; the reservation of the next sees them.
    let (first, r) = record(python(&t, "1")).await;
    assert!(matches!(r, Recorded::New { .. }), "{r:?}");
    running(first.clone()).await;
    assert_eq!(tenants.reserve_artifact_bytes(&t, &first, 700).await.expect("reserve"), 700);
    finish_with(first.clone(), vec![400, 300]).await;
    bytes(700, "a result with two files").await;
    let (second, r) = record(python(&t, "2")).await;
    assert!(matches!(r, Recorded::New { .. }), "{r:?}");
    running(second.clone()).await;
    assert_eq!(tenants.reserve_artifact_bytes(&t, &second, 600).await.expect("reserve"), 300, "700 of 1000 bytes were stored");
    finish_with(second.clone(), vec![300]).await;
    bytes(1000, "a result with the last 300 bytes").await;

    // At the quota: a submission is refused before it runs.
    let (_, r) = record(python(&t, "3")).await;
    match r {
        Recorded::OverQuota(reason) => {
            assert_eq!(reason.code, ErrorCode::QuotaExceeded, "{reason:?}");
            assert!(reason.message.contains("artifact"), "{reason:?}");
        }
        other => panic!("a job of a tenant at its stored-bytes quota was admitted: {other:?}"),
    }

    // The sweeper expires the 400-byte file: room again.
    let id: i64 = sqlx::query_scalar("SELECT id FROM artifacts WHERE tenant = $1 AND job_id = $2 AND size_bytes = 400")
        .bind(&t)
        .bind(&first)
        .fetch_one(&db)
        .await
        .expect("the 400-byte file");
    assert_eq!(store.mark_artifacts_expired(&[id]).await.expect("expire"), 1);
    bytes(600, "an expiry").await;
    let (fourth, r) = record(python(&t, "4")).await;
    assert!(matches!(r, Recorded::New { .. }), "room after an expiry: {r:?}");
    running(fourth.clone()).await;
    assert_eq!(tenants.reserve_artifact_bytes(&t, &fourth, 1000).await.expect("reserve"), 400);

    // A job's row removed takes its files with it (by cascade).
    sqlx::query("DELETE FROM jobs WHERE tenant = $1 AND job_id = $2").bind(&t).bind(&second).execute(&db).await.expect("delete");
    bytes(300, "a deleted job").await;
    // An expired file deleted changes nothing.
    sqlx::query("DELETE FROM jobs WHERE tenant = $1 AND job_id = $2").bind(&t).bind(&first).execute(&db).await.expect("delete");
    bytes(0, "the first job deleted").await;

    // The quota and the reservation read the kept bytes, not the artifact rows: kept bytes of
    // no artifact (written here by hand) fill the quota as stored ones would.
    sqlx::query("INSERT INTO tenant_artifact_bytes (tenant, shard, bytes) VALUES ($1, 99, 1000)").bind(&t).execute(&db).await.expect("kept bytes");
    let (_, r) = record(python(&t, "5")).await;
    assert!(matches!(r, Recorded::OverQuota(_)), "the record did not read the kept bytes: {r:?}");
    assert_eq!(tenants.reserve_artifact_bytes(&t, &fourth, 1000).await.expect("reserve"), 0, "the reservation did not read the kept bytes");
}

/// The uploadable bytes the grant and the reservation read instead of summing a tenant's live
/// grants (`tenant_upload_bytes`, migration 0030), and the same bytes summed from the grants.
async fn uploadable_bytes(db: &sqlx::PgPool, t: &str) -> (i64, i64) {
    kept_and_summed(
        db,
        t,
        "SELECT COALESCE(sum(bytes), 0)::bigint FROM tenant_upload_bytes WHERE tenant = $1",
        "SELECT COALESCE(sum(granted_bytes), 0)::bigint FROM uploads WHERE tenant = $1 AND objects_expire_at IS NOT NULL AND objects_removed_at IS NULL",
    )
    .await
}

#[tokio::test]
async fn a_tenants_uploadable_bytes_follow_every_grant_removal_and_deletion_and_its_quota_and_reservations_use_them() {
    use sandcell_core::jobs::{JobStore, Recorded};
    use sandcell_core::tenants::{Quotas, TenantStore};
    use sandcell_core::uploads;
    use sandcell_protocol::upload::{UploadGrant, UploadTarget};
    let db = service_db().await;
    let t = tenant();
    let quotas = Quotas { max_sessions: 10, max_queued_jobs: 10, max_artifact_bytes: 1000, ..Quotas::default() };
    let tenants = TenantStore::new(db.clone());
    tenants.set_quotas(&t, &quotas).await.expect("tenant");
    let expires = chrono::Utc::now() + chrono::Duration::hours(1);
    // A grant of one file of `bytes`, as the scheduler asks for it.
    let ask = |upload_id: &str, bytes: u64| {
        let (db, t, upload_id) = (db.clone(), t.clone(), upload_id.to_string());
        async move {
            let files = vec![UploadTarget {
                path: "a.csv".into(),
                s3_key: format!("{t}/_uploads/{upload_id}/a.csv"),
                put_url: "http://127.0.0.1/unused".into(),
                size_bytes: bytes,
            }];
            let grant = UploadGrant { tenant: t.clone(), upload_id, status: "ready".into(), reason: None, files, expires_at: Some(expires) };
            uploads::grant(&db, &grant, bytes, expires, &quotas).await.expect("grant").grant
        }
    };
    let bytes = |expected: i64, step: &str| {
        let (db, t, step) = (db.clone(), t.clone(), step.to_string());
        async move {
            let (kept, summed) = uploadable_bytes(&db, &t).await;
            assert_eq!(kept, summed, "after {step}: the kept uploadable bytes drifted from the grants");
            assert_eq!(kept, expected, "after {step}: uploadable bytes");
        }
    };
    bytes(0, "nothing").await;

    let first = ask("up-1", 600).await;
    assert_eq!(first.status, "ready", "{first:?}");
    bytes(600, "a grant").await;
    let again = ask("up-1", 600).await;
    assert_eq!(again.status, "ready", "the same request keeps its answer: {again:?}");
    bytes(600, "the same request asked again").await;
    let refused = ask("up-2", 600).await;
    assert_eq!((refused.status.as_str(), refused.reason.as_ref().map(|r| r.code)), ("rejected", Some(ErrorCode::QuotaExceeded)), "{refused:?}");
    bytes(600, "a refusal").await;
    let second = ask("up-3", 300).await;
    assert_eq!(second.status, "ready", "{second:?}");
    bytes(900, "a second grant").await;

    // A running job's reservation sees the grants.
    let store = JobStore::new(db.clone());
    let sub = python(&t, "1");
    let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
    let r = store.record_queued(&sub, &limits, "digest", None, None).await.expect("record");
    assert!(matches!(r, Recorded::New { .. }), "{r:?}");
    sqlx::query("UPDATE jobs SET status = 'running' WHERE tenant = $1 AND job_id = $2").bind(&t).bind(&sub.job_id).execute(&db).await.expect("running");
    assert_eq!(tenants.reserve_artifact_bytes(&t, &sub.job_id, 500).await.expect("reserve"), 100, "900 of 1000 bytes were granted");

    // A removal postponed changes nothing; a removal done frees the grant's bytes.
    uploads::postpone(&db, &t, "up-1", Duration::from_secs(3600)).await.expect("postpone");
    bytes(900, "a postponed removal").await;
    assert!(uploads::mark_removed(&db, &t, "up-1").await.expect("removed"));
    bytes(300, "a removal").await;
    // A row deleted (by the retention) with its objects still there frees its bytes; a removed
    // one deleted changes nothing.
    sqlx::query("DELETE FROM uploads WHERE tenant = $1 AND upload_id = ANY($2)").bind(&t).bind(&["up-1", "up-3"][..]).execute(&db).await.expect("delete");
    bytes(0, "the grants deleted").await;

    // The grant and the reservation read the kept bytes, not the grants: kept bytes of no grant
    // (written here by hand) fill the quota as granted ones would.
    sqlx::query("INSERT INTO tenant_upload_bytes (tenant, shard, bytes) VALUES ($1, 99, 1000)").bind(&t).execute(&db).await.expect("kept bytes");
    let refused = ask("up-4", 1).await;
    assert_eq!(refused.status, "rejected", "the grant did not read the kept bytes: {refused:?}");
    assert_eq!(tenants.reserve_artifact_bytes(&t, &sub.job_id, 1000).await.expect("reserve"), 0, "the reservation did not read the kept bytes");
}

/// A claim tried again in place after its first try failed (whose answer may have been lost
/// after the claim was committed) takes the job back from its own worker, and from no other; a
/// fresh claim never takes a running job.
#[tokio::test]
async fn a_claim_tried_again_takes_back_its_own_workers_running_job_and_no_other_workers() {
    use sandcell_core::jobs::{Arrival, JobStore};
    let db = service_db().await;
    let store = JobStore::new(db.clone());
    let t = tenant();
    let sub = python(&t, "1");
    let limits = sandcell_protocol::LimitPolicy::default().resolve(&sub.resource_request());
    store.record_queued(&sub, &limits, "digest", None, Some(b"payload")).await.expect("record");
    // Both workers beat, so that neither looks dead to the stack's sweeper meanwhile.
    let sessions = sandcell_core::sessions::SessionStore::new(db.clone());
    let (mine, other) = (unique("claiming-worker"), unique("other-worker"));
    for w in [&mine, &other] {
        sessions.heartbeat(w, 0, 0).await.expect("heartbeat");
    }
    let claim = |worker: String, again: bool| {
        let (store, t, job_id) = (store.clone(), t.clone(), sub.job_id.clone());
        async move { store.claim(&t, &job_id, &worker, Arrival::default(), Duration::from_secs(600), again).await.expect("claim").map(|c| c.attempt) }
    };
    assert_eq!(claim(mine.clone(), false).await, Some(1), "the first claim");
    assert_eq!(claim(mine.clone(), false).await, None, "a fresh claim took a running job");
    assert_eq!(claim(other.clone(), true).await, None, "a claim tried again took another worker's running job");
    // The same claim taken back: not another attempt.
    assert_eq!(claim(mine.clone(), true).await, Some(1), "a claim tried again did not take back its own worker's");
}

/// Taking a moving session over may be tried again, as a bind may: a try whose answer was lost
/// (the session taken, the reply not received) is answered the same by the same job, worker and
/// container, and nobody else takes it: not another worker, and not the same worker with
/// another container (a second kernel would not hold the session). Before, the second try found
/// the session active and refused the job, and the session was lost.
#[tokio::test]
async fn taking_a_session_over_may_be_tried_again_by_the_same_job_worker_and_container_and_by_no_one_else() {
    let db = service_db().await;
    let sessions = sandcell_core::sessions::SessionStore::new(db.clone());
    let (t, sid, gone, mine, other) = (tenant(), unique("s"), unique("gone-worker"), unique("adopting-worker"), unique("other-worker"));
    sqlx::query("INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes) VALUES ($1, 100, 100, 1000000)")
        .bind(&t)
        .execute(&db)
        .await
        .expect("tenant");
    sqlx::query("INSERT INTO sessions (session_id, tenant, state, keep_alive_s, worker_id, container_id, created_by_job) VALUES ($1, $2, 'active', 600, $3, 'c0', 'opener')")
        .bind(&sid)
        .bind(&t)
        .bind(&gone)
        .execute(&db)
        .await
        .expect("session");
    let moved = sessions.orphan_worker(&gone, sandcell_protocol::MoveCause::WorkerLost, "the test says so").await.expect("orphan");
    assert_eq!(moved, 1);
    sqlx::query("UPDATE sessions SET adopting_job = 'adopter' WHERE session_id = $1").bind(&sid).execute(&db).await.expect("adopting job");
    let adopt = |worker: String, container: &'static str| {
        let (sessions, sid) = (sessions.clone(), sid.clone());
        async move { sessions.adopt(&sid, "adopter", &worker, container).await.expect("adopt").map(|a| a.from_worker) }
    };
    assert_eq!(adopt(mine.clone(), "c1").await.as_deref(), Some(gone.as_str()), "the first try");
    assert_eq!(adopt(mine.clone(), "c1").await.as_deref(), Some(gone.as_str()), "the same try again");
    assert_eq!(adopt(other.clone(), "c1").await, None, "another worker took a session taken over");
    assert_eq!(adopt(mine.clone(), "c2").await, None, "another container of the same worker took it");
    let (state, worker, container): (String, String, String) =
        sqlx::query_as("SELECT state, worker_id, container_id FROM sessions WHERE session_id = $1").bind(&sid).fetch_one(&db).await.expect("session row");
    assert_eq!((state.as_str(), worker.as_str(), container.as_str()), ("active", mine.as_str(), "c1"));
    end_what_was_written_by_hand(&db, &[&t]).await;
}

/// An upload grant is recorded once. The same `(tenant, upload_id)` answered again (a retried
/// request, or the rejection of a dead-lettered copy) gets the first answer back, and is told
/// that its own was not recorded.
#[tokio::test]
async fn an_upload_grant_is_recorded_once_and_a_later_answer_is_told_it_was_not() {
    use sandcell_protocol::upload::UploadGrant;
    let db = service_db().await;
    let (t, id) = (tenant(), unique("up"));
    let grant = |status: &str, reason: Option<sandcell_protocol::Reason>| UploadGrant {
        tenant: t.clone(),
        upload_id: id.clone(),
        status: status.into(),
        reason,
        files: vec![],
        expires_at: None,
    };
    let first = grant("ready", None);
    let late = grant("rejected", Some(sandcell_protocol::Reason::new(ErrorCode::TooManyAttempts, "a late second answer")));
    let recorded = sandcell_core::uploads::record(&db, &first).await.expect("first answer");
    assert!(recorded.inserted, "the first answer is the one recorded");
    assert_eq!(recorded.grant, first);
    let again = sandcell_core::uploads::record(&db, &late).await.expect("second answer");
    assert!(!again.inserted, "a second answer is not recorded");
    assert_eq!(again.grant, first, "the first answer stands and is returned");
    let read = sandcell_core::reads::upload_grant(&db, &t, &id).await.expect("reading the grant");
    assert_eq!(read, Some(first));
}

/// Upload refusals recorded in one batch (`uploads::record_many`) are answered in the order
/// given: each that was new is recorded, one whose upload id already had an answer gets that
/// answer back, and an upload id given twice in the batch is recorded once, its later copy
/// told that its own was not.
#[tokio::test]
async fn upload_refusals_recorded_in_one_batch_keep_each_first_answer_and_come_back_in_the_order_given() {
    use sandcell_protocol::upload::UploadGrant;
    let db = service_db().await;
    let (t, other) = (tenant(), tenant());
    let refusal = |tenant: &str, id: &str, why: &str| UploadGrant::rejected(tenant, id, sandcell_protocol::Reason::new(ErrorCode::InvalidValue, why));
    let standing = refusal(&t, "up-b", "the first answer");
    assert!(sandcell_core::uploads::record(&db, &standing).await.expect("a first answer").inserted);
    let batch = [
        refusal(&t, "up-c", "new"),
        refusal(&t, "up-b", "a late second answer"),
        refusal(&other, "up-a", "another tenant's"),
        refusal(&t, "up-c", "the same id again in the batch"),
    ];
    let recorded = sandcell_core::uploads::record_many(&db, &batch, false).await.expect("a batch of refusals");
    let got: Vec<(&str, &str, &str, bool)> = recorded
        .iter()
        .map(|r| (r.grant.tenant.as_str(), r.grant.upload_id.as_str(), r.grant.reason.as_ref().map_or("", |r| r.message.as_str()), r.inserted))
        .collect();
    assert_eq!(
        got,
        [
            (t.as_str(), "up-c", "new", true),
            (t.as_str(), "up-b", "the first answer", false),
            (other.as_str(), "up-a", "another tenant's", true),
            (t.as_str(), "up-c", "new", false),
        ],
        "{recorded:?}"
    );
    for (tenant, id, message) in [(&t, "up-b", "the first answer"), (&t, "up-c", "new"), (&other, "up-a", "another tenant's")] {
        let read = sandcell_core::reads::upload_grant(&db, tenant, id).await.expect("reading the answer");
        assert_eq!(read.and_then(|g| g.reason).map(|r| r.message), Some(message.to_string()), "{tenant}/{id}");
    }
    assert!(sandcell_core::uploads::record_many(&db, &[], false).await.expect("an empty batch").is_empty());
}

/// An upload grant is recorded only within its tenant's stored-bytes quota, under the tenant's
/// lock: of two grants racing for the last room one is `ready` and the other refused
/// `quota_exceeded`, and asking again for a granted upload (with other sizes) returns the first
/// answer without counting its bytes twice.
#[tokio::test]
async fn upload_grants_racing_for_a_tenants_last_bytes_get_exactly_one_ready() {
    use sandcell_protocol::upload::UploadGrant;
    let db = service_db().await;
    let t = tenant();
    let quotas = sandcell_core::tenants::Quotas { max_artifact_bytes: 1000, ..Default::default() };
    let mut tx = db.begin().await.expect("transaction");
    sandcell_core::tenants::ensure(&mut tx, &t, &quotas).await.expect("tenant row");
    tx.commit().await.expect("commit");
    let ready = |id: &str| UploadGrant { tenant: t.clone(), upload_id: id.into(), status: "ready".into(), reason: None, files: vec![], expires_at: None };
    let until = chrono::Utc::now() + chrono::Duration::hours(1);
    let (a, b) = (unique("up-a"), unique("up-b"));
    let (ga, gb) = (ready(&a), ready(&b));
    let (ra, rb) = tokio::join!(sandcell_core::uploads::grant(&db, &ga, 600, until, &quotas), sandcell_core::uploads::grant(&db, &gb, 600, until, &quotas));
    let (ra, rb) = (ra.expect("grant a"), rb.expect("grant b"));
    let mut statuses = [ra.grant.status.as_str(), rb.grant.status.as_str()];
    statuses.sort();
    assert_eq!(statuses, ["ready", "rejected"], "{ra:?} {rb:?}");
    let (won, lost) = if ra.grant.status == "ready" { (ra, rb) } else { (rb, ra) };
    assert_eq!(lost.grant.reason.as_ref().map(|r| r.code), Some(ErrorCode::QuotaExceeded), "{lost:?}");
    // The granted upload asked again, for more: the first answer, nothing counted twice.
    let again = sandcell_core::uploads::grant(&db, &ready(&won.grant.upload_id), 900, until, &quotas).await.expect("asking again");
    assert!(!again.inserted);
    assert_eq!(again.grant, won.grant);
    // 400 bytes are left, exactly.
    let fits = sandcell_core::uploads::grant(&db, &ready(&unique("up-c")), 400, until, &quotas).await.expect("the rest");
    assert_eq!(fits.grant.status, "ready", "{fits:?}");
    let over = sandcell_core::uploads::grant(&db, &ready(&unique("up-d")), 1, until, &quotas).await.expect("one byte more");
    assert_eq!(over.grant.status, "rejected", "{over:?}");
}
