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

#[tokio::test]
async fn a_starting_worker_removes_containers_left_by_its_previous_run() {
    let _serial = SERIAL.lock().await;
    let bin = std::env::var("SANDCELL_WORKER_BIN").expect("SANDCELL_WORKER_BIN (set by deploy/local/test.sh)");
    let image = std::env::var("SANDCELL_SANDBOX_IMAGE").unwrap();
    let worker_id = unique("crashed-worker");
    let docker = bollard::Docker::connect_with_defaults().unwrap().negotiate_version().await.unwrap();
    let labels = std::collections::HashMap::from([("sandcell.worker".to_string(), worker_id.clone())]);
    let mut leftovers = Vec::new();
    for _ in 0..2 {
        let body = bollard::models::ContainerCreateBody {
            image: Some(image.clone()),
            cmd: Some(vec!["sleep".into(), "1000".into()]),
            labels: Some(labels.clone()),
            host_config: Some(bollard::models::HostConfig { network_mode: Some("none".into()), ..Default::default() }),
            ..Default::default()
        };
        leftovers.push(docker.create_container(None::<bollard::query_parameters::CreateContainerOptions>, body).await.unwrap().id);
    }
    // The new run starts warm-pool containers with the same label; only the old ones must go.
    let count = || async {
        let mut n = 0;
        for id in &leftovers {
            n += usize::from(container_exists(id).await);
        }
        n
    };
    assert_eq!(count().await, 2);
    let mut child = tokio::process::Command::new(bin)
        .env("SANDCELL_WORKER_ID", &worker_id)
        .env("SANDCELL_WORKER_SLOTS", "1")
        .env("SANDCELL_WORKER_METRICS_ADDR", "127.0.0.1:0")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let gone = eventually(Duration::from_secs(30), || async { (count().await == 0).then_some(()) }).await;
    child.kill().await.ok();
    assert!(gone.is_some(), "leftover containers were not removed");
}
