//! Shared helpers for the end-to-end tests.
//!
//! The tests talk to the real local stack: RabbitMQ, Postgres, Garage and Docker brought up by
//! `deploy/local/up.sh`, with a scheduler and a worker running (started by
//! `deploy/local/test.sh`). Connection settings come from the environment that script exports
//! from `/var/lib/sandcell/sandcell.env`.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use sandcell_client::Client;
use sandcell_protocol::{InputFile, JobResult, Language, SessionRequest, Submission};

/// Longest a test waits for one job.
pub const JOB_WAIT: Duration = Duration::from_secs(120);

/// A client connected to the local stack.
pub async fn client() -> Client {
    match Client::from_env().await {
        Ok(c) => c,
        Err(e) => panic!("cannot reach the local stack ({e:#}); run the tests through deploy/local/test.sh"),
    }
}

/// A job id no other test run uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4())
}

/// A tenant name unique to this test.
pub fn tenant() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A Python submission with defaults.
pub fn python(tenant: &str, code: &str) -> Submission {
    Submission::new(tenant, unique("py"), Language::Python, code)
}

/// A Python submission that opens a session with the given keep-alive.
pub fn open_session(tenant: &str, code: &str, keep_alive_s: Option<u64>) -> Submission {
    let mut sub = python(tenant, code);
    sub.session = Some(SessionRequest { new: true, keep_alive_s, ..Default::default() });
    sub
}

/// A Python submission that runs in an existing session.
pub fn in_session(tenant: &str, session_id: &str, code: &str) -> Submission {
    let mut sub = python(tenant, code);
    sub.session = Some(SessionRequest { id: Some(session_id.to_string()), ..Default::default() });
    sub
}

/// A job that closes a session.
pub fn close_session(tenant: &str, session_id: &str) -> Submission {
    let mut sub = Submission::new(tenant, unique("close"), Language::Python, "");
    sub.session = Some(SessionRequest { id: Some(session_id.to_string()), close: true, ..Default::default() });
    sub
}

/// The id of the session a result ran in (panics if none).
pub fn session_id(r: &JobResult) -> String {
    r.session.as_ref().unwrap_or_else(|| panic!("result has no session: {r:?}")).id.clone()
}

/// The `text/plain` of a result's execute_result, if any.
pub fn value(r: &JobResult) -> Option<String> {
    r.execution.outputs.iter().find_map(|o| match o {
        sandcell_protocol::Output::ExecuteResult { data, .. } => data.get("text/plain").cloned(),
        _ => None,
    })
}

/// The container that ran a job, as the worker recorded it.
pub async fn container_of(tenant: &str, job_id: &str) -> Option<String> {
    let url = std::env::var("SANDCELL_DATABASE_URL").ok()?;
    let pool = sqlx::PgPool::connect(&url).await.ok()?;
    sqlx::query_scalar("SELECT container_id FROM jobs WHERE tenant = $1 AND job_id = $2")
        .bind(tenant)
        .bind(job_id)
        .fetch_optional(&pool)
        .await
        .ok()
        .flatten()
        .flatten()
}

/// A container's CPU scheduling, as the host's cgroup says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuClass {
    /// In the idle class (`cpu.idle` 1): it runs only on CPU nothing else wants.
    pub idle: bool,
    /// At the weight every container gets by default (cgroup v1 `cpu.shares` 1024, v2 `cpu.weight` 100).
    pub full_weight: bool,
}

/// Whether this host's containers can be put in the idle CPU class (`cpu.idle`, Linux 5.15+): the
/// worker leaves a background start at a low weight only where they cannot.
pub fn host_has_cpu_idle_class() -> bool {
    let root = std::path::PathBuf::from(std::env::var("SANDCELL_CGROUP_ROOT").unwrap_or_else(|_| "/sys/fs/cgroup".into()));
    [root.join("cpu/docker/cpu.idle"), root.join("docker/cpu.idle"), root.join("system.slice/cpu.idle")].iter().any(|f| f.is_file())
}

/// `container_id`'s [`CpuClass`]; `None` where its cgroup is not found on this host.
pub fn cpu_class(container_id: &str) -> Option<CpuClass> {
    let root = std::path::PathBuf::from(std::env::var("SANDCELL_CGROUP_ROOT").unwrap_or_else(|_| "/sys/fs/cgroup".into()));
    let candidates = [
        (root.join("cpu").join("docker").join(container_id), "cpu.shares", 1024),
        (root.join("docker").join(container_id), "cpu.weight", 100),
        (root.join("system.slice").join(format!("docker-{container_id}.scope")), "cpu.weight", 100),
    ];
    let (dir, weight, default) = candidates.into_iter().find(|(d, w, _)| d.join(w).is_file())?;
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok().and_then(|s| s.trim().parse::<u64>().ok());
    Some(CpuClass { idle: read("cpu.idle")? == 1, full_weight: read(weight)? == default })
}

/// The ids of the running containers labelled `label` (`key=value`).
pub async fn containers_labelled(label: &str) -> std::collections::HashSet<String> {
    let docker = bollard::Docker::connect_with_defaults().expect("docker").negotiate_version().await.expect("docker version");
    let filters = std::collections::HashMap::from([("label".to_string(), vec![label.to_string()])]);
    let list = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions { filters: Some(filters), ..Default::default() }))
        .await
        .expect("list containers");
    list.into_iter().filter_map(|c| c.id).collect()
}

/// Whether a container with this id still exists (running or not).
pub async fn container_exists(id: &str) -> bool {
    let Ok(docker) = bollard::Docker::connect_with_defaults() else { return true };
    let Ok(docker) = docker.negotiate_version().await else { return true };
    match docker.inspect_container(id, None::<bollard::query_parameters::InspectContainerOptions>).await {
        Ok(_) => true,
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => false,
        Err(_) => true,
    }
}

/// An inline input file.
pub fn input(path: &str, bytes: &[u8]) -> InputFile {
    InputFile::inline(path, bytes)
}

/// A session's backlog of `count` jobs, each carrying 4 MiB of its own incompressible input
/// file, adding one to the session's `n` (opened at 0) and printing it with the file's SHA-256.
/// Returned with the stdout each job must print, in order: a job that ran out of order, twice,
/// or on a damaged file prints something else.
pub fn hashed_input_backlog(tenant: &str, session_id: &str, count: usize) -> (Vec<Submission>, Vec<String>) {
    let mut subs = Vec::with_capacity(count);
    let mut expected = Vec::with_capacity(count);
    for i in 0..count {
        let bytes: Vec<u8> = (0..4u32 << 20).map(|k| (k.wrapping_mul(2_654_435_761).wrapping_add(i as u32 * 7919) >> 13) as u8).collect();
        let digest = <sha2::Sha256 as sha2::Digest>::digest(&bytes);
        expected.push(format!("{} {digest:x}\n", i + 1));
        let mut sub = in_session(tenant, session_id, &format!("import hashlib\nn += 1\nprint(n, hashlib.sha256(open('in_{i}.bin', 'rb').read()).hexdigest())"));
        sub.files = vec![input(&format!("in_{i}.bin"), &bytes)];
        subs.push(sub);
    }
    (subs, expected)
}

/// Submit and wait for the terminal result.
pub async fn run(client: &Client, sub: &Submission) -> JobResult {
    client.submit(sub).await.expect("submit");
    client.wait(&sub.tenant, &sub.job_id, JOB_WAIT).await.expect("job result")
}

/// The artifact path of the first `display_data` PNG in a result (a captured figure).
pub fn displayed_png(r: &JobResult) -> Option<String> {
    r.execution.outputs.iter().find_map(|o| match o {
        sandcell_protocol::Output::DisplayData { artifacts, .. } => artifacts.get("image/png").cloned(),
        _ => None,
    })
}

/// A plain HTTP/1.1 GET (the store is on loopback, without TLS). Returns status and body.
pub async fn http_get(url: &str) -> Result<(u16, Vec<u8>)> {
    http_get_with(url, "").await
}

/// [`http_get`] with extra header lines (each ending in `\r\n`).
async fn http_get_with(url: &str, headers: &str) -> Result<(u16, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").context("only http:// URLs")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let mut stream = tokio::net::TcpStream::connect(host).await.with_context(|| format!("connecting to {host}"))?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no header end")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1).context("no status")?.parse()?;
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body)?;
    }
    Ok((status, body))
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").context("bad chunk")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol])?.split(';').next().unwrap_or("").trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        let start = eol + 2;
        if b.len() < start + size {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&b[start..start + size]);
        b = &b[start + size + 2..];
    }
}

/// A queue as RabbitMQ's management API describes it (`/api/queues/<vhost>/<name>`), asked as
/// the operator's broker user of `SANDCELL_AMQP_URL` (its figures are the broker's statistics,
/// refreshed every 5 s).
pub async fn broker_queue(name: &str) -> Result<serde_json::Value> {
    use base64::Engine as _;
    let amqp = std::env::var("SANDCELL_AMQP_URL").context("SANDCELL_AMQP_URL")?;
    let url = lapin::uri::AMQPUri::from_str(&amqp).map_err(|e| anyhow::anyhow!("SANDCELL_AMQP_URL: {e}"))?;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", url.authority.userinfo.username, url.authority.userinfo.password));
    let management = std::env::var("SANDCELL_RABBITMQ_MANAGEMENT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into());
    let vhost = url.vhost.replace('/', "%2F");
    let (status, body) = http_get_with(&format!("{management}/api/queues/{vhost}/{name}"), &format!("Authorization: Basic {auth}\r\n")).await?;
    if status != 200 {
        bail!("the management API answered {status} for queue {name}");
    }
    serde_json::from_slice(&body).context("decoding the management API's answer")
}

/// Poll `f` until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Submit `subs` and wait up to 30 s until `tenant` has exactly that many jobs queued or
/// running: they hold its `max_queued_jobs` quota (the tenant must have no other).
pub async fn hold_quota_with(client: &Client, pool: &sqlx::PgPool, tenant: &str, subs: &[Submission]) {
    for s in subs {
        client.submit(s).await.expect("submit");
    }
    let recorded = eventually(Duration::from_secs(30), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1 AND status IN ('queued', 'running')").bind(tenant).fetch_one(pool).await.ok()?;
        (n == subs.len() as i64).then_some(())
    })
    .await;
    assert!(recorded.is_some(), "the {} jobs holding the quota were not recorded", subs.len());
}

/// One recorded answer to a submission: its status and, when refused or failed, its reason's
/// code and message.
#[derive(Debug)]
pub struct Answer {
    /// `rejected`, `queued`, `succeeded`, …
    pub status: String,
    /// The reason's code (`quota_exceeded`, `unknown_language`, …), if any.
    pub code: Option<String>,
    /// The reason's message, if any.
    pub message: Option<String>,
}

/// Wait up to `limit` until every one of `job_ids` of `tenant` has a row in `jobs`, and return
/// their answers (in no particular order); `None` if some are still missing then.
pub async fn answers_of(pool: &sqlx::PgPool, tenant: &str, job_ids: &[String], limit: Duration) -> Option<Vec<Answer>> {
    use sqlx::Row;
    eventually(limit, || async {
        let rows = sqlx::query("SELECT status, reason->>'code' AS code, reason->>'message' AS message FROM jobs WHERE tenant = $1 AND job_id = ANY($2)")
            .bind(tenant)
            .bind(job_ids)
            .fetch_all(pool)
            .await
            .ok()?;
        (rows.len() == job_ids.len()).then(|| rows.iter().map(|r| Answer { status: r.get("status"), code: r.get("code"), message: r.get("message") }).collect())
    })
    .await
}

/// A tenant created the way an operator creates one (`sandcell-admin tenant create`): its own
/// broker user and database role, with the given quotas (defaults when `None`).
pub struct TestTenant {
    /// Its name.
    pub name: String,
    /// Its connection URLs.
    pub creds: sandcell_admin::TenantCredentials,
}

impl TestTenant {
    /// Create a fresh tenant.
    pub async fn create(quotas: Option<sandcell_core::tenants::Quotas>) -> TestTenant {
        let settings = sandcell_admin::AdminSettings::from_env().expect("admin settings from the environment");
        let admin = sandcell_admin::Admin::connect(settings).await.expect("connecting as operator");
        let name = tenant();
        let creds = admin.create_tenant(&name, &quotas.unwrap_or_default()).await.expect("creating tenant");
        TestTenant { name, creds }
    }

    /// A client that publishes as the tenant's broker user and reads through its role.
    pub async fn client(&self) -> Client {
        Client::connect(&self.creds.amqp_url, &self.creds.database_url).await.expect("tenant client connects")
    }

    /// A database pool logged in as the tenant's role: at most 4 connections, as the client
    /// library's, well within the tenant's `max_db_connections`.
    pub async fn db(&self) -> sqlx::PgPool {
        sandcell_core::pool::options(4).connect(&self.creds.database_url).await.expect("tenant role connects")
    }
}

/// A pool logged in as the service role (sees everything).
pub async fn service_db() -> sqlx::PgPool {
    let url = std::env::var("SANDCELL_DATABASE_URL").expect("SANDCELL_DATABASE_URL");
    sqlx::PgPool::connect(&url).await.expect("service role connects")
}

/// Prove the worker still serves: a one-off job on `worker_id` computes 6*7.
pub async fn assert_worker_serves(c: &Client, tenant: &str, worker_id: &Option<String>) {
    let r = run(c, &python(tenant, "print(6 * 7)")).await;
    assert_eq!(r.status, sandcell_protocol::JobStatus::Succeeded, "the next job failed: {r:?}");
    assert_eq!(r.execution.stdout, "42\n");
    assert_eq!(&r.worker_id, worker_id, "the same worker runs the next job");
}

/// Whether the worker under test runs sandboxes under gVisor (`SANDCELL_DOCKER_RUNTIME=runsc`,
/// exported by `deploy/local/test.sh` to both the worker and the tests).
pub fn under_gvisor() -> bool {
    std::env::var("SANDCELL_DOCKER_RUNTIME").is_ok_and(|r| r == "runsc")
}

/// The job ran out of memory: `oom_killed` (with `limits_hit: ["memory"]`). Under gVisor Docker
/// does not always flag the OOM kill, and the kernel's death then reads as `failed` with exit
/// code 137 (SIGKILL) — documented in docs/security.md.
pub fn assert_oom_killed(r: &JobResult) {
    if r.status == sandcell_protocol::JobStatus::OomKilled {
        assert!(r.execution.limits_hit.contains(&sandcell_protocol::LimitHit::Memory), "{r:?}");
    } else {
        assert!(under_gvisor() && r.status == sandcell_protocol::JobStatus::Failed && r.execution.exit_code == Some(137), "not an OOM kill: {r:?}");
    }
}

/// Run a shell command; panics with its stderr when it fails. Returns its stdout.
pub fn sh(cmd: &str) -> String {
    let out = std::process::Command::new("bash").arg("-c").arg(cmd).output().expect("bash");
    assert!(out.status.success(), "{cmd} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// SIGKILL the kernel of sandbox `container`, as the host's OOM killer would (it picks the
/// largest process: the kernel, with the libraries imported), leaving its driver and the
/// container alive. The kernel is the `--kernel` process whose parent is not one; its own
/// children (a fresh job's next process) are left behind, as by the OOM killer. Done from
/// inside, as the sandbox user (under gVisor the host does not see the sandbox's processes).
pub fn kill_kernel_of(container: &str) {
    const KILL_KERNEL: &str = r#"
import os, signal
parents = {}
for p in filter(str.isdigit, os.listdir('/proc')):
    try:
        if b'--kernel' in open('/proc/%s/cmdline' % p, 'rb').read().split(b'\0'):
            parents[int(p)] = int(open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[1])
    except OSError:
        pass
kernels = [p for p, parent in parents.items() if parent not in parents]
assert len(kernels) == 1, parents
os.kill(kernels[0], signal.SIGKILL)
"#;
    let out = std::process::Command::new("docker").args(["exec", "-u", "1000", container, "python3", "-c", KILL_KERNEL]).output().expect("docker exec");
    if out.status.success() {
        return;
    }
    // The worker removes a pool container whose kernel died, and may do so before this `docker
    // exec` has returned: the exec dies with its container, saying nothing (a CI run's failure).
    // A container that is gone, or going, has no kernel left either.
    let running = || {
        let state = std::process::Command::new("docker").args(["inspect", "-f", "{{.State.Running}}", container]).output().expect("docker inspect");
        state.status.success() && String::from_utf8_lossy(&state.stdout).trim() == "true"
    };
    let gone = (0..50).any(|_| {
        !running() || {
            std::thread::sleep(Duration::from_millis(200));
            false
        }
    });
    assert!(gone, "killing the kernel of {container} (exit {:?}): {}", out.status.code(), String::from_utf8_lossy(&out.stderr));
}

/// SIGKILL one of the instances `deploy/local/test.sh` started (`scheduler`, `worker`, or in a
/// fleet `scheduler-2`, `worker-3`, …) and start it again, as a supervisor would, with `env`
/// added to the test's environment. The pid file in `$SANDCELL_RUN_DIR` follows, so test.sh
/// stops the new process at the end.
pub fn restart_service(name: &str, env: &[(&str, &str)]) {
    kill_service(name);
    start_service(name, env);
}

/// Where `deploy/local/services.sh` keeps the instances' launchers and pid files.
fn run_dir() -> String {
    std::env::var("SANDCELL_RUN_DIR").unwrap_or_else(|_| "/var/lib/sandcell/run".into())
}

/// SIGKILL the instance `name` started by the test harness.
pub fn kill_service(name: &str) {
    let dir = run_dir();
    sh(&format!("kill -9 $(cat {dir}/{name}.pid); sleep 0.5"));
}

/// Send SIGTERM to the instance `name` (what Kubernetes sends to scale it in).
pub fn terminate_service(name: &str) {
    let dir = run_dir();
    sh(&format!("kill -TERM $(cat {dir}/{name}.pid)"));
}

/// Whether the instance `name` is running.
pub fn service_running(name: &str) -> bool {
    let dir = run_dir();
    std::process::Command::new("bash").arg("-c").arg(format!("kill -0 $(cat {dir}/{name}.pid) 2>/dev/null")).status().is_ok_and(|s| s.success())
}

/// Start the instance `name` again with its launcher (`$SANDCELL_RUN_DIR/<name>.cmd`, written by
/// `start_sandcell`: its own settings, then the binary, appending to its log), with `env` added.
pub fn start_service(name: &str, env: &[(&str, &str)]) {
    let dir = run_dir();
    let vars: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    sh(&format!("{vars}nohup bash {dir}/{name}.cmd >/dev/null 2>&1 & echo $! > {dir}/{name}.pid"));
}

/// Wait until the scheduler and the worker answer `/healthz` with 200 (panics after 2 min).
pub async fn both_healthy() {
    let healthy = |addr: &'static str| async move { matches!(http_get(&format!("http://{addr}/healthz")).await, Ok((200, _))) };
    let ok = eventually(Duration::from_secs(120), || async { (healthy("127.0.0.1:9464").await && healthy("127.0.0.1:9465").await).then_some(()) }).await;
    assert!(ok.is_some(), "scheduler and worker did not report healthy");
}

/// A value of the scheduler's metrics endpoint (`name` including its labels).
pub async fn scheduler_metric(name: &str) -> Option<f64> {
    metric_at("127.0.0.1:9464", name).await
}

/// A value of the metrics endpoint at `addr` (`name` including its labels).
pub async fn metric_at(addr: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(&format!("http://{addr}/metrics")).await.ok()?;
    String::from_utf8_lossy(&body).lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A value of the worker's metrics endpoint (`name` including its labels).
pub async fn worker_metric(name: &str) -> Option<f64> {
    let (_, body) = http_get("http://127.0.0.1:9465/metrics").await.ok()?;
    String::from_utf8_lossy(&body).lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The worker's resident memory, from /proc (the worker started by deploy/local/test.sh).
pub fn worker_rss_kb() -> Option<u64> {
    let out = std::process::Command::new("pgrep").args(["-f", "target/debug/sandcell-worker"]).output().ok()?;
    let pid = String::from_utf8_lossy(&out.stdout).split_whitespace().next()?.to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}
