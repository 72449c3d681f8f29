//! Artifacts: files written by the code land in S3 with a presigned URL and an expiry that the
//! sweeper enforces.

use std::time::Duration;

use sandcell_client::ClientError;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::{ArtifactKind, ArtifactState, JobStatus};
use sandcell_tests::*;

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

#[tokio::test]
async fn a_saved_matplotlib_chart_is_a_downloadable_png_artifact() {
    let c = client().await;
    let code = "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n\
                plt.bar(['a', 'b', 'c'], [3, 1, 2])\nplt.savefig('/home/user/chart.png')\nprint('saved')";
    let r = run(&c, &python(&tenant(), code)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let a = r.artifacts.iter().find(|a| a.path == "chart.png").expect("chart.png artifact");
    assert_eq!(a.kind, ArtifactKind::File);
    assert_eq!(a.content_type, "image/png");
    assert_eq!(a.state, ArtifactState::Available);
    assert_eq!(a.s3_key, format!("{}/{}/chart.png", r.tenant, r.job_id));
    assert!(a.expires_at > chrono::Utc::now() + chrono::Duration::hours(1));
    let (status, body) = http_get(a.download_url.as_deref().unwrap()).await.unwrap();
    assert_eq!(status, 200);
    assert!(body.starts_with(PNG_MAGIC), "not a PNG");
    assert_eq!(body.len() as i64, a.size_bytes);
    use sha2::Digest;
    assert_eq!(hex::encode(sha2::Sha256::digest(&body)), a.sha256);
}

#[tokio::test]
async fn an_open_figure_is_captured_without_savefig() {
    let c = client().await;
    let r = run(&c, &python(&tenant(), "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let path = displayed_png(&r).expect("a display_data with image/png");
    let a = r.artifacts.iter().find(|a| a.path == path).unwrap();
    assert_eq!(a.kind, ArtifactKind::Display);
    let (status, body) = http_get(a.download_url.as_deref().unwrap()).await.unwrap();
    assert_eq!(status, 200);
    assert!(body.starts_with(PNG_MAGIC));
}

#[tokio::test]
async fn an_expired_artifact_is_deleted_and_reported_as_expired() {
    let c = client().await;
    let mut sub = python(&tenant(), "open('/home/user/report.txt', 'w').write('quarterly numbers')");
    sub.artifact_ttl_s = Some(2);
    let r = run(&c, &sub).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let a = r.artifacts.iter().find(|a| a.path == "report.txt").expect("artifact").clone();
    let url = a.download_url.clone().unwrap();
    let (status, body) = http_get(&url).await.unwrap();
    assert_eq!((status, body.as_slice()), (200, &b"quarterly numbers"[..]));

    let expired = eventually(Duration::from_secs(30), || async {
        let r = c.result(&sub.tenant, &sub.job_id).await.unwrap().unwrap();
        r.artifacts.into_iter().find(|x| x.path == "report.txt" && x.state == ArtifactState::Expired)
    })
    .await
    .expect("the sweeper marks the artifact expired");
    assert!(expired.download_url.is_none());
    match c.artifact_url(&sub.tenant, &sub.job_id, "report.txt").await {
        Err(ClientError::ArtifactExpired(p)) => assert_eq!(p, "report.txt"),
        other => panic!("expected artifact_expired, got {other:?}"),
    }
    let store = ArtifactStore::new(&sandcell_core::config::Services::from_env().unwrap().s3);
    assert!(!store.exists(&a.s3_key).await.unwrap(), "object must be deleted from the store");
    let (status, _) = http_get(&url).await.unwrap();
    assert_ne!(status, 200, "the old URL no longer downloads");
}

/// A store that accepts connections and never answers (hung, or a black-holed address behind a
/// proxy) fails a request after `SANDCELL_S3_ATTEMPT_TIMEOUT_S` a try, instead of holding it (and
/// the scheduler's sweep or the worker's commit waiting on it) for ever: the SDK sets no such
/// limit of its own.
#[tokio::test]
async fn a_store_that_never_answers_fails_a_request_within_its_attempt_timeouts() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a listener");
    let addr = listener.local_addr().expect("its address");
    // Accept, then hold every connection open without a byte.
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let mut settings = sandcell_core::config::Services::from_env().expect("services").s3;
    settings.endpoint = format!("http://{addr}");
    settings.attempt_timeout = Duration::from_secs(1);
    let store = sandcell_core::store::ArtifactStore::new(&settings);
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(60), store.delete("a/b")).await;
    held.abort();
    let outcome = outcome.unwrap_or_else(|_| panic!("the request to a silent store was still waiting after 60 s"));
    assert!(outcome.is_err(), "a silent store's answer cannot be a success");
    assert!(started.elapsed() < Duration::from_secs(20), "gave up after {:?}", started.elapsed());
}

/// A draining worker saves a session's variables in the store for the worker that takes the
/// session over, which deletes the object once it has used it. Before, a session that ended
/// before any worker took it over (it expired or was lost while moving), or whose snapshot
/// could not be deleted, left its object in the store for good, counted nowhere. Now the
/// scheduler's sweeper deletes the snapshot of every session that ended, and leaves a live
/// session's alone. (The sessions' rows are written here as a drain leaves them.)
#[tokio::test]
async fn the_snapshot_of_a_session_that_ended_is_deleted_and_a_live_ones_kept() {
    use sandcell_core::store::{ArtifactStore, Fetched};
    let store = ArtifactStore::new(&sandcell_core::config::Services::from_env().unwrap().s3);
    let pool = service_db().await;
    let t = tenant();
    let (ended, live) = (unique("s"), unique("s"));
    let key = |sid: &str| format!("{t}/_sessions/{sid}/variables-1.dill");
    for (sid, state) in [(&ended, "expired"), (&live, "moving")] {
        store.put(&key(sid), b"pickled variables".to_vec(), "application/octet-stream").await.expect("putting a snapshot");
        sqlx::query(
            "INSERT INTO sessions (session_id, tenant, state, keep_alive_s, created_by_job, snapshot_key, snapshot_move, ended_at)
             VALUES ($1, $2, $3, 60, 'opening', $4, 1, CASE WHEN $3 = 'expired' THEN now() END)",
        )
        .bind(sid)
        .bind(&t)
        .bind(state)
        .bind(key(sid))
        .execute(&pool)
        .await
        .unwrap();
    }
    let gone = eventually(Duration::from_secs(30), || async {
        let left: Option<String> = sqlx::query_scalar("SELECT snapshot_key FROM sessions WHERE session_id = $1").bind(&ended).fetch_one(&pool).await.ok()?;
        let object = store.get_limited(&key(&ended), 1 << 20).await.ok()?;
        (left.is_none() && matches!(object, Fetched::Missing)).then_some(())
    })
    .await;
    assert!(gone.is_some(), "the ended session's snapshot is still recorded or stored");
    let kept = store.get_limited(&key(&live), 1 << 20).await.expect("reading the store");
    assert!(matches!(kept, Fetched::Found(_)), "a moving session's snapshot was deleted");
    let still: Option<String> = sqlx::query_scalar("SELECT snapshot_key FROM sessions WHERE session_id = $1").bind(&live).fetch_one(&pool).await.unwrap();
    assert_eq!(still, Some(key(&live)));
    // Not left for the next run: the live one ends too, and the sweeper takes its snapshot.
    sqlx::query("UPDATE sessions SET state = 'lost', ended_at = now() WHERE session_id = $1").bind(&live).execute(&pool).await.unwrap();
}
