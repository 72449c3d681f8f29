//! Sessions: a kernel that keeps variables, imports and files across jobs, owned by one
//! worker, ended by its keep-alive, by `close`, or never crossed by another tenant.

use std::time::Duration;

use sandcell_core::store::ArtifactStore;
use sandcell_protocol::{ArtifactKind, ErrorCode, JobStatus, Language, Output, SessionRequest, SessionState};
use sandcell_tests::*;

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

fn reason_code(r: &sandcell_protocol::JobResult) -> Option<ErrorCode> {
    r.reason.as_ref().map(|x| x.code)
}

#[tokio::test]
async fn a_variable_set_in_one_job_is_seen_by_the_next() {
    let c = client().await;
    let t = tenant();
    let first = run(&c, &open_session(&t, "x = 41", None)).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let session = first.session.clone().expect("a new session's id comes back in the result");
    assert_eq!(session.state, SessionState::Active);
    assert_eq!(session.keep_alive_s, 300, "default keep-alive");
    assert!(session.expires_at.is_some());
    let second = run(&c, &in_session(&t, &session.id, "x + 1")).await;
    assert_eq!(second.status, JobStatus::Succeeded, "{second:?}");
    assert_eq!(value(&second).as_deref(), Some("42"), "{second:?}");
    assert_eq!(second.worker_id, first.worker_id, "a session's jobs run on the worker that holds it");
    assert!(!second.execution.kernel_restarted, "{second:?}");
}

#[tokio::test]
async fn an_uploaded_csv_is_loaded_in_one_cell_and_grouped_in_the_next() {
    let c = client().await;
    let t = tenant();
    let csv = "category,amount\nfood,12.50\nrent,800\nfood,7.25\nfun,30\nrent,200\n";
    let mut open = open_session(&t, "import pandas as pd\ndf = pd.read_csv('tx.csv')\nlen(df)", None);
    open.files.push(input("tx.csv", csv.as_bytes()));
    let first = run(&c, &open).await;
    assert_eq!(value(&first).as_deref(), Some("5"), "{first:?}");
    let id = session_id(&first);
    let r = run(&c, &in_session(&t, &id, "df.groupby('category')['amount'].sum().to_frame()")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let Some(Output::ExecuteResult { data, .. }) = r.execution.outputs.first() else { panic!("no execute_result: {r:?}") };
    let plain = &data["text/plain"];
    for (cat, sum) in [("food", "19.75"), ("fun", "30.00"), ("rent", "1000.00")] {
        assert!(plain.lines().any(|l| l.contains(cat) && l.contains(sum)), "{cat} {sum} missing in {plain}");
    }
    let html = data.get("text/html").expect("a DataFrame also renders as text/html");
    assert!(html.contains("<table") && html.contains("1000.00"), "{html}");
}

#[tokio::test]
async fn a_bar_chart_without_savefig_comes_back_as_a_png() {
    let c = client().await;
    let t = tenant();
    let first = run(&c, &open_session(&t, "import matplotlib.pyplot as plt\nyears = [2024, 2025, 2026]", None)).await;
    let id = session_id(&first);
    let r = run(&c, &in_session(&t, &id, "plt.bar([str(y) for y in years], [1.0, 1.3, 1.7])")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let path = displayed_png(&r).expect("display_data with image/png");
    let a = r.artifacts.iter().find(|a| a.path == path).expect("artifact for the figure");
    assert_eq!(a.kind, ArtifactKind::Display);
    let (status, body) = http_get(a.download_url.as_deref().unwrap()).await.unwrap();
    assert_eq!(status, 200);
    assert!(body.starts_with(PNG_MAGIC), "not a PNG");
}

#[tokio::test]
async fn an_exception_keeps_the_sessions_earlier_variables() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "total = 7", None)).await);
    let err = run(&c, &in_session(&t, &id, "1/0")).await;
    assert_eq!(err.status, JobStatus::Failed, "{err:?}");
    let e = err.execution.error.expect("error");
    assert_eq!(e.ename, "ZeroDivisionError");
    assert!(e.traceback.iter().any(|l| l.contains("ZeroDivisionError")), "{:?}", e.traceback);
    let next = run(&c, &in_session(&t, &id, "total * 6")).await;
    assert_eq!(value(&next).as_deref(), Some("42"), "{next:?}");
}

#[tokio::test]
async fn a_timed_out_cell_is_interrupted_and_the_session_keeps_its_state() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "x = 'still here'", None)).await);
    let mut spin = in_session(&t, &id, "while True: pass");
    spin.timeout_ms = Some(1000);
    let r = run(&c, &spin).await;
    assert_eq!(r.status, JobStatus::TimedOut, "{r:?}");
    assert!(!r.execution.kernel_restarted, "an interruptible cell must not cost the kernel: {r:?}");
    assert_eq!(r.execution.error.as_ref().map(|e| e.ename.as_str()), Some("KeyboardInterrupt"), "{r:?}");
    let next = run(&c, &in_session(&t, &id, "x")).await;
    assert_eq!(value(&next).as_deref(), Some("'still here'"), "{next:?}");
}

#[tokio::test]
async fn a_kernel_that_exits_is_restarted_and_the_session_goes_on() {
    let c = client().await;
    let t = tenant();
    let first = run(&c, &open_session(&t, "x = 1", None)).await;
    let id = session_id(&first);
    let old = container_of(&t, &first.job_id).await.expect("container recorded");
    let r = run(&c, &in_session(&t, &id, "import os; os._exit(1)")).await;
    assert!(r.execution.kernel_restarted, "{r:?}");
    assert_eq!(reason_code(&r), Some(ErrorCode::KernelRestarted));
    assert_ne!(r.status, JobStatus::Succeeded, "{r:?}");
    // The new kernel runs the next cell; the old state is gone, as the result said.
    let next = run(&c, &in_session(&t, &id, "'x' in dir()")).await;
    assert_eq!(next.status, JobStatus::Succeeded, "{next:?}");
    assert_eq!(value(&next).as_deref(), Some("False"), "{next:?}");
    assert!(!container_exists(&old).await, "the dead kernel's container is removed");
}

#[tokio::test]
async fn an_out_of_memory_kernel_is_reported_and_restarted() {
    let c = client().await;
    let t = tenant();
    let mut open = open_session(&t, "y = 2", None);
    open.memory_mb = Some(256);
    let id = session_id(&run(&c, &open).await);
    let r = run(&c, &in_session(&t, &id, "b = bytearray(1024 * 1024 * 1024)")).await;
    assert_oom_killed(&r);
    assert!(r.execution.kernel_restarted, "{r:?}");
    let next = run(&c, &in_session(&t, &id, "1 + 1")).await;
    assert_eq!(value(&next).as_deref(), Some("2"), "{next:?}");
}

#[tokio::test]
async fn a_session_expires_after_its_keep_alive_and_later_jobs_are_refused() {
    let c = client().await;
    let t = tenant();
    let first = run(&c, &open_session(&t, "x = 1", Some(2))).await;
    let id = session_id(&first);
    assert_eq!(first.session.as_ref().unwrap().keep_alive_s, 2);
    let container = container_of(&t, &first.job_id).await.expect("container recorded");
    let expired = eventually(Duration::from_secs(20), || async {
        let s = c.session(&t, &id).await.ok().flatten()?;
        (s.state == SessionState::Expired).then_some(s)
    })
    .await
    .expect("session expires");
    assert!(expired.ended_at.is_some() && expired.expires_at.is_none());
    let gone = eventually(Duration::from_secs(30), || async { (!container_exists(&container).await).then_some(()) }).await;
    assert!(gone.is_some(), "the expired session's container is destroyed");
    let late = run(&c, &in_session(&t, &id, "x")).await;
    assert_eq!(late.status, JobStatus::Rejected, "{late:?}");
    assert_eq!(reason_code(&late), Some(ErrorCode::SessionExpired), "{late:?}");
}

#[tokio::test]
async fn every_job_extends_the_keep_alive() {
    let c = client().await;
    let t = tenant();
    // Six jobs four seconds apart: 24 seconds in all, never ten idle ones (a margin of 6 s for
    // the round trip between two jobs on a loaded machine).
    let id = session_id(&run(&c, &open_session(&t, "n = 0", Some(10))).await);
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let r = run(&c, &in_session(&t, &id, "n += 1\nn")).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    }
    let r = run(&c, &in_session(&t, &id, "n")).await;
    assert_eq!(value(&r).as_deref(), Some("6"), "{r:?}");
}

#[tokio::test]
async fn a_closed_session_refuses_later_jobs() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "x = 1", None)).await);
    let mut close = in_session(&t, &id, "");
    close.session = Some(SessionRequest { id: Some(id.clone()), close: true, ..Default::default() });
    let closed = run(&c, &close).await;
    assert_eq!(closed.status, JobStatus::Succeeded, "{closed:?}");
    assert_eq!(closed.session.as_ref().map(|s| s.state), Some(SessionState::Closed));
    let late = run(&c, &in_session(&t, &id, "x")).await;
    assert_eq!(reason_code(&late), Some(ErrorCode::SessionClosed), "{late:?}");
}

#[tokio::test]
async fn another_tenants_session_cannot_be_named() {
    let c = client().await;
    let (owner, intruder) = (tenant(), tenant());
    let id = session_id(&run(&c, &open_session(&owner, "secret = 'owner data'", None)).await);
    let r = run(&c, &in_session(&intruder, &id, "secret")).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(reason_code(&r), Some(ErrorCode::SessionNotFound), "{r:?}");
    assert!(r.session.is_none() && r.execution.stdout.is_empty() && r.execution.outputs.is_empty(), "{r:?}");
    assert!(c.session(&intruder, &id).await.unwrap().is_none(), "the intruder cannot read the session");
    // And the owner's session is untouched.
    let mine = run(&c, &in_session(&owner, &id, "secret")).await;
    assert_eq!(value(&mine).as_deref(), Some("'owner data'"), "{mine:?}");
}

#[tokio::test]
async fn an_unknown_session_is_refused() {
    let c = client().await;
    let r = run(&c, &in_session(&tenant(), &sandcell_protocol::session::new_session_id(), "1")).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(reason_code(&r), Some(ErrorCode::SessionNotFound));
}

#[tokio::test]
async fn interleaved_sessions_each_see_only_their_own_state() {
    let c = client().await;
    let t = tenant();
    let a = session_id(&run(&c, &open_session(&t, "who = 'a'", None)).await);
    let b = session_id(&run(&c, &open_session(&t, "who = 'b'", None)).await);
    let mut subs = Vec::new();
    for i in 0..6 {
        let (id, name) = if i % 2 == 0 { (&a, "a") } else { (&b, "b") };
        let sub = in_session(&t, id, &format!("seen = globals().get('seen', []) + [who]\n(who, len(seen), '{name}')"));
        c.submit(&sub).await.unwrap();
        subs.push(sub);
    }
    for sub in &subs {
        let r = c.wait(&sub.tenant, &sub.job_id, JOB_WAIT).await.unwrap();
        let v = value(&r).unwrap_or_default();
        let expected = sub.code.rsplit_once(", '").map(|(_, n)| n.trim_end_matches("')").to_string()).unwrap();
        assert!(v.starts_with(&format!("('{expected}', ")), "a job of session {expected} saw {v}");
    }
    let last_a = run(&c, &in_session(&t, &a, "seen")).await;
    assert_eq!(value(&last_a).as_deref(), Some("['a', 'a', 'a']"), "{last_a:?}");
}

#[tokio::test]
async fn jobs_submitted_without_waiting_run_in_submission_order() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "order = []", None)).await);
    let mut subs = Vec::new();
    for i in 0..20 {
        let sub = in_session(&t, &id, &format!("order.append({i})"));
        c.submit(&sub).await.unwrap();
        subs.push(sub);
    }
    for sub in &subs {
        let r = c.wait(&sub.tenant, &sub.job_id, JOB_WAIT).await.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    }
    let r = run(&c, &in_session(&t, &id, "order")).await;
    let expected = format!("{:?}", (0..20).collect::<Vec<_>>());
    assert_eq!(value(&r).as_deref(), Some(expected.as_str()), "{r:?}");
}

#[tokio::test]
async fn bash_runs_in_the_sessions_workspace() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "open('note.txt', 'w').write('from python')", None)).await);
    let mut sh = in_session(&t, &id, "cat note.txt; echo ' and bash' >> note.txt; pwd");
    sh.language = Language::Bash;
    let r = run(&c, &sh).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.execution.stdout, "from python/home/user\n", "{r:?}");
    let back = run(&c, &in_session(&t, &id, "open('note.txt').read()")).await;
    assert_eq!(value(&back).as_deref(), Some("'from python and bash\\n'"), "{back:?}");
}

#[tokio::test]
async fn files_can_be_listed_and_fetched_as_artifacts() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "import os\nos.makedirs('out', exist_ok=True)\nopen('out/report.txt', 'w').write('q3 ok')", None)).await);
    let mut get = in_session(&t, &id, "");
    get.get_files = vec!["out/report.txt".into()];
    get.list_files = true;
    let r = run(&c, &get).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let listing = r.execution.files.as_ref().expect("listing");
    let entry = listing.entries.iter().find(|e| e.path == "out/report.txt").expect("listed");
    assert_eq!(entry.size, 5);
    let a = r.artifacts.iter().find(|a| a.path == "out/report.txt").expect("fetched artifact");
    assert_eq!(a.kind, ArtifactKind::Fetched, "unchanged but asked for");
    let (status, body) = http_get(a.download_url.as_deref().unwrap()).await.unwrap();
    assert_eq!((status, body.as_slice()), (200, b"q3 ok".as_slice()));
}

#[tokio::test]
async fn a_large_file_uploaded_by_reference_lands_in_the_workspace() {
    let c = client().await;
    let t = tenant();
    let store = ArtifactStore::new(&sandcell_core::config::Services::from_env().unwrap().s3);
    let big: Vec<u8> = (0..20_000_000u32).map(|i| (i % 251) as u8).collect();
    let key = store.upload_input(&t, "big.bin", big.clone()).await.unwrap();
    let mut open = open_session(&t, "import hashlib\nhashlib.sha256(open('data/big.bin','rb').read()).hexdigest()", None);
    open.files.push(sandcell_protocol::InputFile { path: "data/big.bin".into(), content_b64: None, s3_key: Some(key) });
    let r = run(&c, &open).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    use sha2::Digest;
    assert_eq!(value(&r), Some(format!("'{}'", hex::encode(sha2::Sha256::digest(&big)))), "{r:?}");
    // A key that does not exist is the client's error, and nothing runs.
    let mut missing = python(&t, "print('ran')");
    missing.files.push(sandcell_protocol::InputFile { path: "x".into(), content_b64: None, s3_key: Some(format!("{t}/_uploads/nope")) });
    let r = run(&c, &missing).await;
    assert_eq!(r.status, JobStatus::Rejected, "{r:?}");
    assert_eq!(reason_code(&r), Some(ErrorCode::UploadFailed));
    assert!(r.execution.stdout.is_empty(), "{r:?}");
}

#[tokio::test]
async fn a_large_html_output_is_stored_in_full_and_previewed_inline() {
    let c = client().await;
    let r = run(&c, &python(&tenant(), "from IPython.display import HTML\nHTML('<b>row</b>' * 10000)")).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let Some(Output::ExecuteResult { data, artifacts }) = r.execution.outputs.first() else { panic!("no execute_result: {r:?}") };
    assert!(data["text/html"].ends_with("[truncated by sandcell]") && data["text/html"].len() < 70_000);
    let path = artifacts.get("text/html").expect("full HTML stored as an artifact");
    let a = r.artifacts.iter().find(|a| &a.path == path).expect("artifact row");
    assert_eq!(a.content_type, "text/html");
    let (status, body) = http_get(a.download_url.as_deref().unwrap()).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, "<b>row</b>".repeat(10000).into_bytes());
}

#[tokio::test]
async fn a_job_may_give_its_session_a_new_keep_alive() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "x = 1", Some(600))).await);
    let mut shorter = in_session(&t, &id, "x");
    shorter.session = Some(SessionRequest { id: Some(id.clone()), keep_alive_s: Some(2), ..Default::default() });
    let r = run(&c, &shorter).await;
    assert_eq!(value(&r).as_deref(), Some("1"), "{r:?}");
    assert_eq!(r.session.as_ref().map(|s| s.keep_alive_s), Some(2), "the result shows the new keep-alive");
    // The worker's clock follows: the session expires two seconds later, not ten minutes.
    let expired = eventually(Duration::from_secs(20), || async {
        let s = c.session(&t, &id).await.ok().flatten()?;
        (s.state == SessionState::Expired).then_some(s)
    })
    .await;
    assert!(expired.is_some(), "the session kept its old keep-alive");
}

#[tokio::test]
async fn a_jobs_env_is_seen_by_its_code_only() {
    let c = client().await;
    let t = tenant();
    let mut open = open_session(&t, "import os", None);
    open.env = [("GREETING".to_string(), "hey".to_string())].into_iter().collect();
    let id = session_id(&run(&c, &open).await);
    let mut with_env = in_session(&t, &id, "os.environ.get('GREETING'), os.environ.get('HOME')");
    with_env.env = [("GREETING".to_string(), "hello".to_string()), ("HOME".to_string(), "/elsewhere".to_string())].into_iter().collect();
    assert_eq!(value(&run(&c, &with_env).await).as_deref(), Some("('hello', '/elsewhere')"));
    let after = run(&c, &in_session(&t, &id, "os.environ.get('GREETING'), os.environ.get('HOME')")).await;
    assert_eq!(value(&after).as_deref(), Some("(None, '/home/user')"), "{after:?}");
    let mut bash = in_session(&t, &id, "echo \"$GREETING\"");
    bash.language = Language::Bash;
    bash.env = [("GREETING".to_string(), "from bash".to_string())].into_iter().collect();
    assert_eq!(run(&c, &bash).await.execution.stdout, "from bash\n");
}

#[tokio::test]
async fn contexts_of_a_session_keep_their_own_variables_and_share_its_files() {
    let c = client().await;
    let t = tenant();
    let id = session_id(&run(&c, &open_session(&t, "z = 'default'\nopen('f.txt', 'w').write('shared')", None)).await);
    let mut other = in_session(&t, &id, "'z' in dir(), open('f.txt').read()");
    other.context = Some("ctx-a".into());
    assert_eq!(value(&run(&c, &other).await).as_deref(), Some("(False, 'shared')"));
    let mut set = in_session(&t, &id, "z = 'a'");
    set.context = Some("ctx-a".into());
    run(&c, &set).await;
    let mut read = in_session(&t, &id, "z");
    read.context = Some("ctx-a".into());
    assert_eq!(value(&run(&c, &read).await).as_deref(), Some("'a'"));
    assert_eq!(value(&run(&c, &in_session(&t, &id, "z")).await).as_deref(), Some("'default'"));
}
