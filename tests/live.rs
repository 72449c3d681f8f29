//! Live output end to end: a tenant subscribed to its job hears its output while it runs, in
//! order, within the result's caps, and nothing of another tenant's jobs — the broker itself
//! refuses the bindings and publishes that would let it.

use std::time::{Duration, Instant};

use base64::Engine as _;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use sandcell_client::LiveOutput;
use sandcell_protocol::{EventBody, JobEvent, JobStatus};
use sandcell_tests::*;

/// Every event of a job up to its `end`, with when each arrived.
async fn events_until_end(live: &mut LiveOutput) -> Vec<(Instant, JobEvent)> {
    let mut got = Vec::new();
    loop {
        let event = tokio::time::timeout(JOB_WAIT, live.next()).await.expect("no end event within the job wait").expect("the subscription ended");
        let end = matches!(event.body, EventBody::End { .. });
        got.push((Instant::now(), event));
        if end {
            return got;
        }
    }
}

fn stream(events: &[(Instant, JobEvent)], stdout: bool) -> String {
    events
        .iter()
        .filter_map(|(_, e)| match (&e.body, stdout) {
            (EventBody::Stdout { text }, true) | (EventBody::Stderr { text }, false) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn assert_numbered_from_zero(events: &[(Instant, JobEvent)]) {
    let seqs: Vec<u64> = events.iter().map(|(_, e)| e.seq).collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>(), "seq counts from 0 without gaps or repeats");
    assert!(events.iter().all(|(_, e)| e.attempt == 1), "one attempt");
}

#[tokio::test]
async fn output_printed_before_a_pause_arrives_long_before_the_job_ends_in_order_and_once() {
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let sub = python(&t.name, "import sys, time\nprint('a', flush=True)\nprint('warn', file=sys.stderr, flush=True)\ntime.sleep(5)\nprint('b')");
    let mut live = c.live(&t.name, Some(&sub.job_id)).await.expect("a tenant subscribes to its own job");
    c.submit(&sub).await.expect("submit");
    let events = events_until_end(&mut live).await;
    let r = c.wait(&t.name, &sub.job_id, JOB_WAIT).await.expect("result");
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");

    assert_numbered_from_zero(&events);
    assert!(events.iter().all(|(_, e)| e.tenant == t.name && e.job_id == sub.job_id));
    // The first stdout event is 'a'. (stdout and stderr are two pipes: chunks written to each
    // in the same instant may be framed in either order, as under gVisor in CI.)
    let (first_at, first) = events.iter().find(|(_, e)| matches!(e.body, EventBody::Stdout { .. })).expect("a stdout event");
    assert_eq!(first.body, EventBody::Stdout { text: "a\n".into() });
    let (end_at, end) = events.last().expect("events");
    assert_eq!(end.body, EventBody::End { status: JobStatus::Succeeded });
    let early = end_at.duration_since(*first_at);
    assert!(early >= Duration::from_secs(3), "'a' came only {early:?} before the end");
    // The events hold what the result holds, each text once.
    assert_eq!(stream(&events, true), r.execution.stdout, "{r:?}");
    assert_eq!(stream(&events, true), "a\nb\n");
    assert_eq!(stream(&events, false), r.execution.stderr, "{r:?}");
}

#[tokio::test]
async fn a_chart_a_value_and_an_error_arrive_as_events() {
    let t = TestTenant::create(None).await;
    let c = t.client().await;
    let code = "import matplotlib.pyplot as plt\nfrom IPython.display import display\n\
                plt.bar(['2025', '2026'], [1, 2]); plt.show()\ndisplay(6 * 7)\n1 / 0";
    let sub = python(&t.name, code);
    let mut live = c.live(&t.name, Some(&sub.job_id)).await.expect("subscribe");
    c.submit(&sub).await.expect("submit");
    let events = events_until_end(&mut live).await;
    assert_numbered_from_zero(&events);
    let kinds: Vec<&str> = events
        .iter()
        .map(|(_, e)| match &e.body {
            EventBody::Output { output_type, .. } => output_type.as_str(),
            EventBody::Error { .. } => "error",
            EventBody::End { .. } => "end",
            EventBody::Stdout { .. } => "stdout",
            EventBody::Stderr { .. } => "stderr",
        })
        .collect();
    // The value displayed before the error comes before it; figures are collected when the cell
    // ends (as in the result), so the chart may come after it; `end` is last.
    let mut sorted = kinds.clone();
    sorted.sort();
    assert_eq!(sorted, ["display_data", "display_data", "end", "error"], "{events:?}");
    assert_eq!(kinds.last(), Some(&"end"));
    let position = |pred: &dyn Fn(&EventBody) -> bool| events.iter().position(|(_, e)| pred(&e.body)).expect("event present");
    let value = position(&|b| matches!(b, EventBody::Output { data, .. } if data.get("text/plain").map(String::as_str) == Some("42")));
    let error = position(&|b| matches!(b, EventBody::Error { .. }));
    assert!(value < error, "{kinds:?}");
    let chart = position(&|b| matches!(b, EventBody::Output { data, .. } if data.contains_key("image/png")));
    let EventBody::Output { data, .. } = &events[chart].1.body else { unreachable!() };
    let png = base64::engine::general_purpose::STANDARD.decode(&data["image/png"]).expect("the chart is base64");
    assert!(png.starts_with(b"\x89PNG"), "the chart is a PNG");
    let EventBody::Error { ename, traceback, .. } = &events[error].1.body else { unreachable!() };
    assert_eq!(ename, "ZeroDivisionError");
    assert!(traceback.iter().any(|l| l.contains("1 / 0")), "{traceback:?}");
    assert_eq!(events.last().map(|(_, e)| &e.body), Some(&EventBody::End { status: JobStatus::Failed }));
}

#[tokio::test]
async fn output_the_result_drops_at_its_stdout_limit_is_in_no_event() {
    let c = client().await;
    let t = tenant();
    let sub = python(&t, "for i in range(40):\n    print('x' * 65536, flush=True)");
    let mut live = c.live(&t, Some(&sub.job_id)).await.expect("subscribe");
    c.submit(&sub).await.expect("submit");
    let events = events_until_end(&mut live).await;
    let r = c.wait(&t, &sub.job_id, JOB_WAIT).await.expect("result");
    assert!(r.execution.stdout_truncated, "the job printed beyond its limit");
    assert_numbered_from_zero(&events);
    let streamed = stream(&events, true);
    assert_eq!(streamed.len(), r.execution.stdout.len(), "{r:?}");
    assert_eq!(streamed, r.execution.stdout, "{r:?}");
}

#[tokio::test]
async fn a_tenant_hears_nothing_of_another_tenants_jobs_and_cannot_publish_events() {
    let a = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let conn = lapin::Connection::connect(&b.creds.amqp_url, lapin::ConnectionProperties::default()).await.expect("B connects");
    let own_queue = |n: &str| format!("sandcell.live.{}.{n}", b.name);
    // Not a server-named queue: that name space (amq.gen-…) is every user's.
    let ch = conn.create_channel().await.expect("channel");
    let server_named = ch.queue_declare("".into(), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default()).await;
    assert!(server_named.is_err(), "B declared a server-named queue");
    // Each binding wider than its own tenant is refused by the broker (the channel closes).
    for (i, key) in ["#", "*.*", &format!("{}.#", a.name), &format!("{}.some-job", a.name), "sandcell.#"].into_iter().enumerate() {
        let ch = conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(own_queue(&format!("k{i}")).as_str().into(), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default())
            .await
            .expect("B declares a queue in its own namespace");
        let bound = ch.queue_bind(q.name().clone(), "sandcell.events".into(), key.into(), QueueBindOptions::default(), FieldTable::default()).await;
        let err = bound.expect_err(&format!("B bound {key:?}"));
        assert!(format!("{err}").contains("ACCESS_REFUSED") || format!("{err:?}").contains("AccessRefused"), "{key}: {err:?}");
    }
    // Nor declare a queue in A's namespace.
    let ch = conn.create_channel().await.expect("channel");
    let declared = ch
        .queue_declare(
            format!("sandcell.live.{}.x", a.name).as_str().into(),
            QueueDeclareOptions { exclusive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await;
    assert!(declared.is_err(), "B declared a queue in A's namespace");
    // Nor bind its queue to any other exchange (the intake fanout would copy every tenant's
    // submissions to it).
    for exchange in ["sandcell.intake", "sandcell.dlx", "amq.topic", "amq.fanout"] {
        let ch = conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(own_queue(exchange).as_str().into(), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default())
            .await
            .expect("queue");
        let bound =
            ch.queue_bind(q.name().clone(), exchange.into(), format!("{}.x", b.name).as_str().into(), QueueBindOptions::default(), FieldTable::default()).await;
        assert!(bound.is_err(), "B bound a queue to {exchange}");
    }
    // Nor may it publish an event (for A's subscribers to hear).
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
    let forged = serde_json::json!({"tenant": a.name, "job_id": "x", "attempt": 1, "seq": 0, "type": "stdout", "text": "forged"});
    let published = tokio::time::timeout(Duration::from_secs(10), async {
        ch.basic_publish(
            "sandcell.events".into(),
            format!("{}.x", a.name).as_str().into(),
            BasicPublishOptions::default(),
            forged.to_string().as_bytes(),
            Default::default(),
        )
        .await?
        .await
    })
    .await
    .expect("the broker answers a publish within 10 s");
    assert!(published.is_err(), "B published to the events exchange: {published:?}");

    // What it may bind — its own keys — carries nothing of A's job, while A hears it.
    let b_client = b.client().await;
    let mut b_live = b_client.live(&b.name, None).await.expect("B subscribes to its own jobs");
    let a_client = a.client().await;
    let sub = python(&a.name, "print('secret of A')");
    let mut a_live = a_client.live(&a.name, Some(&sub.job_id)).await.expect("A subscribes");
    a_client.submit(&sub).await.expect("submit");
    let a_events = events_until_end(&mut a_live).await;
    assert_eq!(stream(&a_events, true), "secret of A\n");
    let heard = tokio::time::timeout(Duration::from_secs(1), b_live.next()).await;
    assert!(heard.is_err(), "B heard {heard:?}");
}

#[tokio::test]
async fn events_a_tenant_routes_into_the_intake_become_no_job_and_no_rejection() {
    // RabbitMQ lets a user that may publish to sandcell.intake and read sandcell.events bind the
    // one into the other; the scheduler takes only what was published to the intake itself.
    let b = TestTenant::create(None).await;
    let conn = lapin::Connection::connect(&b.creds.amqp_url, lapin::ConnectionProperties::default()).await.expect("B connects");
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_bind("sandcell.intake".into(), "sandcell.events".into(), format!("{}.#", b.name).as_str().into(), Default::default(), FieldTable::default())
        .await
        .expect("the broker allows the binding (it cannot tell it from a publish)");
    let db = service_db().await;
    let count = || async { sqlx::query_scalar::<_, i64>("SELECT count(*) FROM intake_rejections").fetch_one(&db).await.expect("count") };
    let rejections_before = count().await;
    let stray_before = scheduler_metric("sandcell_submissions_total{outcome=\"not_published_to_intake\"}").await.unwrap_or(0.0);
    let c = b.client().await;
    let r = run(&c, &python(&b.name, "print('routed into the intake')")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let dropped = eventually(Duration::from_secs(10), || async {
        let n = scheduler_metric("sandcell_submissions_total{outcome=\"not_published_to_intake\"}").await.unwrap_or(0.0);
        (n >= stray_before + 2.0).then_some(n) // the stdout and end events, at least
    })
    .await;
    assert!(dropped.is_some(), "the scheduler did not drop the routed events");
    assert_eq!(count().await, rejections_before, "a routed event became an intake rejection");
    ch.exchange_unbind("sandcell.intake".into(), "sandcell.events".into(), format!("{}.#", b.name).as_str().into(), Default::default(), FieldTable::default())
        .await
        .expect("unbind");
}

/// A broker connection of tenant `t`, and what its close said when the broker closed it.
async fn tenant_connection(t: &TestTenant) -> (lapin::Connection, std::sync::Arc<std::sync::Mutex<Option<String>>>) {
    let conn = lapin::Connection::connect(&t.creds.amqp_url, lapin::ConnectionProperties::default()).await.expect("the tenant connects");
    let closed = std::sync::Arc::new(std::sync::Mutex::new(None));
    let on_close = closed.clone();
    let mut events = conn.events_listener();
    tokio::spawn(async move {
        use futures::StreamExt as _;
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(e) = event {
                if let Ok(mut c) = on_close.lock() {
                    c.get_or_insert(format!("{e}"));
                }
            }
        }
    });
    (conn, closed)
}

/// Waits (up to 30 s: a few of the scheduler's `SANDCELL_LIVE_OUTPUT_CHECK_S`) for the broker to
/// close a connection, and returns what its close said.
async fn closed_by_the_broker(closed: &std::sync::Arc<std::sync::Mutex<Option<String>>>) -> String {
    eventually(Duration::from_secs(30), || async { closed.lock().ok().and_then(|c| c.clone()) })
        .await
        .expect("the tenant's connection was not closed within 30 s")
}

/// The broker's management API, as the operator.
fn management() -> sandcell_core::management::Management {
    let settings = sandcell_admin::AdminSettings::from_env().expect("admin settings from the environment");
    sandcell_core::management::Management::new(&settings.management_url, &settings.amqp_url, Duration::from_secs(10)).expect("a management client")
}

/// Whether the queue `name` exists (asked as the operator: the tenant may be barred from
/// connecting while its queues are deleted).
async fn live_queue_exists(name: &str) -> bool {
    let path = format!("queues/{{vhost}}/{}", sandcell_core::management::encode_component(name));
    management().get::<serde_json::Value>(&path).await.expect("asking the management API for a queue").is_some()
}

/// How many bindings of `sandcell.events` to an exchange carry `tenant`'s keys (through the
/// management API, as the operator).
async fn bindings_to_exchanges(tenant: &str) -> usize {
    let bindings: Vec<serde_json::Value> = management()
        .get("exchanges/{vhost}/sandcell.events/bindings/source?columns=destination_type,routing_key")
        .await
        .expect("listing the events exchange's bindings")
        .expect("the events exchange");
    let prefix = format!("{tenant}.");
    bindings.iter().filter(|b| b["destination_type"] == "exchange" && b["routing_key"].as_str().is_some_and(|k| k.starts_with(&prefix))).count()
}

/// A bystander's live output still arrives: a job of `b` heard from start to end.
async fn still_hears_its_own_jobs(b: &TestTenant, b_client: &sandcell_client::Client, b_live: &mut LiveOutput) {
    let sub = python(&b.name, "print('still here')");
    b_client.submit(&sub).await.expect("submit");
    let events = events_until_end(b_live).await;
    assert_eq!(stream(&events, true), "still here\n");
}

#[tokio::test]
async fn a_tenant_declaring_more_live_queues_than_its_limit_loses_them_and_its_connections_while_another_tenant_keeps_its_own() {
    let limit = sandcell_core::broker::DEFAULT_TENANT_MAX_LIVE_QUEUES as usize;
    let flooder = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let b_client = b.client().await;
    let mut b_live = b_client.live(&b.name, None).await.expect("B subscribes to its own jobs");
    let enforced_before = scheduler_metric("sandcell_live_output_enforced_total{limit=\"queues\"}").await.unwrap_or(0.0);

    // Non-exclusive queues: they would outlive the connection (an hour, the operator policy).
    let (conn, closed) = tenant_connection(&flooder).await;
    let ch = conn.create_channel().await.expect("channel");
    let names: Vec<String> = (0..limit + 8).map(|i| format!("sandcell.live.{}.flood-{i}", flooder.name)).collect();
    for name in &names {
        if ch.queue_declare(name.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.is_err() {
            break; // the watch closed the connection already
        }
    }
    let reason = closed_by_the_broker(&closed).await;
    assert!(reason.contains("CONNECTION_FORCED") && reason.contains("live-output queues, more than its 64"), "the close says why: {reason}");
    // Its queues go too (after its connections), the first and the last declared alike.
    let gone =
        eventually(Duration::from_secs(30), || async { (!live_queue_exists(&names[0]).await && !live_queue_exists(&names[limit]).await).then_some(()) }).await;
    assert!(gone.is_some(), "the flooder's queues are still there");
    let counted = eventually(Duration::from_secs(10), || async {
        let enforced = scheduler_metric("sandcell_live_output_enforced_total{limit=\"queues\"}").await?;
        (enforced > enforced_before).then_some(enforced)
    })
    .await;
    assert!(counted.is_some(), "the hold was not counted (from {enforced_before})");

    // The bystander's subscription never noticed; the flooder may subscribe again, within its limit.
    still_hears_its_own_jobs(&b, &b_client, &mut b_live).await;
    let f_client = flooder.client().await;
    let mut f_live = f_client.live(&flooder.name, None).await.expect("the flooder subscribes again");
    still_hears_its_own_jobs(&flooder, &f_client, &mut f_live).await;
}

#[tokio::test]
async fn a_tenant_binding_more_live_keys_than_its_limit_loses_its_queue_and_connections_while_another_tenant_keeps_its_own() {
    let limit = sandcell_core::broker::DEFAULT_TENANT_MAX_LIVE_BINDINGS as usize;
    let flooder = TestTenant::create(None).await;
    let b = TestTenant::create(None).await;
    let b_client = b.client().await;
    let mut b_live = b_client.live(&b.name, None).await.expect("B subscribes to its own jobs");

    // One queue, each binding a routing key of its own (a job id it may watch), non-exclusive;
    // and the events exchange bound into the intake (which the broker cannot refuse it), keys
    // that would stay bound, durable, after its connections.
    let (conn, closed) = tenant_connection(&flooder).await;
    let ch = conn.create_channel().await.expect("channel");
    const TO_INTAKE: usize = 64;
    for i in 0..TO_INTAKE {
        let key = format!("{}.intake-{i}", flooder.name);
        ch.exchange_bind("sandcell.intake".into(), "sandcell.events".into(), key.as_str().into(), Default::default(), FieldTable::default())
            .await
            .expect("the flooder binds the events exchange into the intake");
    }
    assert_eq!(bindings_to_exchanges(&flooder.name).await, TO_INTAKE);
    let queue = format!("sandcell.live.{}.bindings", flooder.name);
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.expect("the flooder declares a queue");
    for i in 0..limit + 64 - TO_INTAKE {
        let key = format!("{}.job-{i}", flooder.name);
        if ch
            .queue_bind(queue.as_str().into(), "sandcell.events".into(), key.as_str().into(), QueueBindOptions::default(), FieldTable::default())
            .await
            .is_err()
        {
            break;
        }
    }
    let reason = closed_by_the_broker(&closed).await;
    assert!(reason.contains("live-output bindings, more than its 4096"), "the close says why: {reason}");
    let gone =
        eventually(Duration::from_secs(30), || async { (!live_queue_exists(&queue).await && bindings_to_exchanges(&flooder.name).await == 0).then_some(()) })
            .await;
    assert!(gone.is_some(), "the flooder's queue (and its bindings) or its bindings into the intake are still there");
    still_hears_its_own_jobs(&b, &b_client, &mut b_live).await;
}
