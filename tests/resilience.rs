//! Reliability: scheduler and worker survive a broker restart and a database restart and keep
//! serving. These tests restart shared services, so they live in their own test binary (cargo
//! runs test binaries one after another) and run one at a time within it.

use std::process::Command;
use std::time::Duration;

use sandcell_protocol::JobStatus;
use sandcell_tests::*;
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

fn sh(cmd: &str) {
    let status = Command::new("bash").arg("-c").arg(cmd).status().expect("bash");
    assert!(status.success(), "{cmd} failed");
}

async fn healthy(addr: &str) -> bool {
    matches!(http_get(&format!("http://{addr}/healthz")).await, Ok((200, _)))
}

async fn both_healthy_again() {
    let ok = eventually(Duration::from_secs(90), || async {
        (healthy("127.0.0.1:9464").await && healthy("127.0.0.1:9465").await).then_some(())
    })
    .await;
    assert!(ok.is_some(), "scheduler and worker did not report healthy again");
}

#[tokio::test]
async fn jobs_run_after_a_broker_restart() {
    let _serial = SERIAL.lock().await;
    sh("rabbitmqctl -q stop_app && rabbitmqctl -q start_app && rabbitmqctl -q await_startup");
    both_healthy_again().await;
    let c = client().await;
    let r = run(&c, &python(&tenant(), "print('after broker restart')")).await;
    assert_eq!(r.status, JobStatus::Succeeded);
    assert_eq!(r.stdout, "after broker restart\n");
}

#[tokio::test]
async fn jobs_run_after_a_database_restart() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    sh("pg_ctlcluster 15 main restart");
    both_healthy_again().await;
    // The client's own pool reconnects too.
    let r = run(&c, &python(&tenant(), "print('after database restart')")).await;
    assert_eq!(r.status, JobStatus::Succeeded);
    assert_eq!(r.stdout, "after database restart\n");
}
