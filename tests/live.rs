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
    let sub = python(&t.name, "import sys, time\nprint('a', flush=True)\nprint('warn', file=sys.stderr, flush=True)\ntime.sleep(2)\nprint('b')");
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
    assert!(early >= Duration::from_millis(1500), "'a' came only {early:?} before the end");
    // The events hold what the result holds, each text once.
    assert_eq!(stream(&events, true), r.execution.stdout);
    assert_eq!(stream(&events, true), "a\nb\n");
    assert_eq!(stream(&events, false), r.execution.stderr);
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
    assert_eq!(streamed.len(), r.execution.stdout.len());
    assert_eq!(streamed, r.execution.stdout);
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
    assert_eq!(r.status, JobStatus::Succeeded);
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
