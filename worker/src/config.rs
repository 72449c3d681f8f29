//! The worker's configuration: every setting read from the environment, with its default.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use sandcell_core::config::{self, Services};
use sandcell_protocol::LimitPolicy;

use crate::kernel::KernelSettings;
use crate::sandbox;

/// Worker settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Broker, database, object store.
    pub services: Services,
    /// Operator's limit policy; limits carried by jobs are capped by its maximums.
    pub policy: LimitPolicy,
    /// `SANDCELL_WORKER_ID`, default the host name: names this worker's queue and labels its
    /// containers. 1–64 of `[A-Za-z0-9._-]`.
    pub worker_id: String,
    /// `SANDCELL_WORKER_SLOTS`, default 4: cells running at once (and the shared-queue prefetch).
    pub slots: u16,
    /// `SANDCELL_WORKER_MAX_SESSIONS`, default 32: sessions held at once.
    pub max_sessions: u16,
    /// `SANDCELL_SESSION_PREFETCH`, default 256: unacked jobs taken from the worker's own queue.
    pub session_prefetch: u16,
    /// `SANDCELL_WORKER_HELD_INPUT_BYTES`, default 64 MiB: the code and inline input files of
    /// jobs waiting in this worker's session mailboxes, all together; a waiting job beyond it
    /// leaves them in Postgres until its turn (`registry::Inputs`).
    pub held_input_bytes: u64,
    /// `SANDCELL_WORKER_FETCH_BYTES`, default 256 MiB: what the uploads (`s3_key` input files)
    /// fetched for this worker's jobs may hold of its memory, all together
    /// (`inputs::FetchBudget`).
    pub fetch_bytes: u64,
    /// `SANDCELL_WARM_POOL`, default 2: started kernels kept ready.
    pub warm_pool: usize,
    /// `SANDCELL_WARM_POOL_PREPARED`, default true where one-off sandboxes are reused
    /// (`SANDCELL_ONEOFF_REUSE_JOBS` > 1): warm kernels make their preparation for forked jobs in
    /// their start, so a one-off job that takes one does not pay it in its tenant's burst.
    pub warm_pool_prepared: bool,
    /// When one-off sandboxes bound to a tenant are recycled (`SANDCELL_ONEOFF_REUSE_JOBS`,
    /// `SANDCELL_ONEOFF_REUSE_S`, `SANDCELL_ONEOFF_IDLE_S`, `SANDCELL_ONEOFF_IDLE_MAX`).
    pub reuse: crate::bound::ReuseSettings,
    /// Kernel settings (`SANDCELL_SANDBOX_IMAGE` required, `SANDCELL_DOCKER_RUNTIME`,
    /// `SANDCELL_SANDBOX_START_TIMEOUT_MS`, `SANDCELL_PRELOAD`, `SANDCELL_INTERRUPT_GRACE_MS`).
    pub kernel: KernelSettings,
    /// `SANDCELL_MAX_ATTEMPTS`, default 3: claims of one job before it is failed.
    pub max_attempts: i32,
    /// `SANDCELL_MAX_UPLOAD_FILE_BYTES`, default 100 MiB: largest input file by `s3_key`.
    pub max_upload_bytes: u64,
    /// `SANDCELL_EGRESS_TENANTS`, default empty: tenants whose sandboxes get a network.
    pub egress_tenants: HashSet<String>,
    /// `SANDCELL_EGRESS_NETWORK`, default none: the Docker network those sandboxes join; a
    /// `{tenant}` in it is replaced by the tenant, so that each tenant's sandboxes have a network
    /// of their own (sandboxes of two tenants on one network could reach each other).
    pub egress_network: Option<String>,
    /// `SANDCELL_EGRESS_PROXY`, default none: the filtering proxy those sandboxes are given as
    /// `HTTP_PROXY`/`HTTPS_PROXY` (e.g. `http://sandcell-egress-proxy:8888`).
    pub egress_proxy: Option<String>,
    /// `SANDCELL_HEARTBEAT_S`, default 5: how often the worker tells Postgres it is alive.
    pub heartbeat: Duration,
    /// `SANDCELL_DRAIN_GRACE_S`, default 30: on SIGTERM or SIGINT, how long the worker, having
    /// stopped taking jobs, lets the jobs it holds finish before it stops anyway.
    pub drain_grace: Duration,
    /// `SANDCELL_WORKER_DEAD_AFTER_S`, default 30: a redelivered job still `running` on another
    /// worker is taken over only when that worker has been silent this long.
    pub worker_dead_after: Duration,
    /// `SANDCELL_SESSION_START_WAIT_S`, default 60: how long a job opening a session waits for
    /// room on a full worker (after being offered to the others) before `capacity`.
    pub session_start_wait: Duration,
    /// `SANDCELL_SANDBOX_START_TRIES`, default 3: fresh sandboxes tried before
    /// `sandbox_unavailable` is final.
    pub sandbox_start_tries: u32,
    /// `SANDCELL_WORKER_METRICS_ADDR`, default `127.0.0.1:9465`.
    pub metrics_addr: SocketAddr,
}

/// Whether `id` can name a worker (and its queue).
pub fn is_valid_worker_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Config {
    /// Read the configuration from the environment.
    pub fn from_env() -> Result<Self> {
        let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
        let default_id = if is_valid_worker_id(&host) { host } else { "worker-1".to_string() };
        let worker_id = config::var_or("SANDCELL_WORKER_ID", &default_id);
        anyhow::ensure!(is_valid_worker_id(&worker_id), "SANDCELL_WORKER_ID must be 1-64 characters of [A-Za-z0-9._-]");
        let policy = config::limit_policy_from_env()?;
        let list = |name: &str, default: &str| -> Vec<String> {
            config::var_or(name, default).split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
        };
        let egress_tenants: HashSet<String> = list("SANDCELL_EGRESS_TENANTS", "").into_iter().collect();
        let egress_network = Some(config::var_or("SANDCELL_EGRESS_NETWORK", "")).filter(|s| !s.is_empty());
        let egress_proxy = Some(config::var_or("SANDCELL_EGRESS_PROXY", "")).filter(|s| !s.is_empty());
        anyhow::ensure!(egress_tenants.is_empty() || egress_network.is_some(), "SANDCELL_EGRESS_TENANTS needs SANDCELL_EGRESS_NETWORK");
        let runtime = config::var_or("SANDCELL_DOCKER_RUNTIME", "runc");
        let reuse = crate::bound::ReuseSettings {
            // Off under gVisor by default: see ARCHITECTURE.md (one-off jobs).
            max_jobs: config::parse_or("SANDCELL_ONEOFF_REUSE_JOBS", if runtime == "runsc" { 1u32 } else { 1000u32 })?.max(1),
            max_age: Duration::from_secs_f64(config::parse_or("SANDCELL_ONEOFF_REUSE_S", 600.0f64)?.max(0.0)),
            max_idle: Duration::from_secs_f64(config::parse_or("SANDCELL_ONEOFF_IDLE_S", 60.0f64)?.max(0.0)),
            max_waiting: config::parse_or("SANDCELL_ONEOFF_IDLE_MAX", 8usize)?,
        };
        Ok(Config {
            services: Services::from_env()?,
            worker_id,
            slots: config::parse_or("SANDCELL_WORKER_SLOTS", 4u16)?.max(1),
            max_sessions: config::parse_or("SANDCELL_WORKER_MAX_SESSIONS", 32u16)?.max(1),
            session_prefetch: config::parse_or("SANDCELL_SESSION_PREFETCH", 256u16)?.max(1),
            held_input_bytes: config::parse_or("SANDCELL_WORKER_HELD_INPUT_BYTES", 64u64 << 20)?,
            fetch_bytes: config::parse_or("SANDCELL_WORKER_FETCH_BYTES", 256u64 << 20)?,
            warm_pool: config::parse_or("SANDCELL_WARM_POOL", 2usize)?,
            warm_pool_prepared: config::parse_or("SANDCELL_WARM_POOL_PREPARED", reuse.max_jobs > 1)?,
            reuse,
            kernel: KernelSettings {
                image: config::var_required("SANDCELL_SANDBOX_IMAGE")?,
                runtime: runtime.clone(),
                start_timeout: Duration::from_millis(config::parse_or("SANDCELL_SANDBOX_START_TIMEOUT_MS", 30_000u64)?),
                preload: list("SANDCELL_PRELOAD", "numpy,pandas,matplotlib.pyplot"),
                interrupt_grace: Duration::from_millis(config::parse_or("SANDCELL_INTERRUPT_GRACE_MS", 3_000u64)?),
                max_frame: sandbox::frames::MAX_FRAME_BYTES,
                cgroup_root: config::var_or("SANDCELL_CGROUP_ROOT", "/sys/fs/cgroup").into(),
                channel_dir: config::var_or_off("SANDCELL_CHANNEL_DIR", "/var/lib/sandcell/channels").map(Into::into),
                channels: None,
            },
            max_attempts: config::parse_or("SANDCELL_MAX_ATTEMPTS", 3i32)?.max(1),
            max_upload_bytes: config::parse_or("SANDCELL_MAX_UPLOAD_FILE_BYTES", 100u64 << 20)?,
            egress_tenants,
            egress_network,
            egress_proxy,
            heartbeat: Duration::from_secs_f64(config::parse_or("SANDCELL_HEARTBEAT_S", 5.0f64)?.max(0.1)),
            drain_grace: Duration::from_secs_f64(config::parse_or("SANDCELL_DRAIN_GRACE_S", 30.0f64)?.max(0.0)),
            worker_dead_after: Duration::from_secs_f64(config::parse_or("SANDCELL_WORKER_DEAD_AFTER_S", 30.0f64)?.max(1.0)),
            session_start_wait: Duration::from_secs_f64(config::parse_or("SANDCELL_SESSION_START_WAIT_S", 60.0f64)?.max(0.0)),
            sandbox_start_tries: config::parse_or("SANDCELL_SANDBOX_START_TRIES", 3u32)?.max(1),
            metrics_addr: config::parse_or("SANDCELL_WORKER_METRICS_ADDR", SocketAddr::from(([127, 0, 0, 1], 9465)))?,
            policy,
        })
    }

    /// How many of one session's jobs this worker holds on unacked messages of its queue (the
    /// session's window): `SANDCELL_SESSION_PREFETCH / (SANDCELL_WORKER_MAX_SESSIONS + 1)`, at
    /// least 1 (7 by default). The sessions held then take at most `max_sessions × window` of
    /// the prefetch, so a job of any other session is delivered at once; a session's later jobs
    /// are acked on arrival and held as read back from Postgres (`registry::WindowPlace`).
    pub fn session_window(&self) -> usize {
        session_window(self.session_prefetch, self.max_sessions)
    }

    /// The network and proxy of `tenant`'s sandboxes: `None` (no network at all) unless the
    /// operator granted the tenant egress.
    pub fn egress_for(&self, tenant: &str) -> Option<sandbox::container::Egress> {
        sandbox::container::Egress::granted(&self.egress_tenants, self.egress_network.as_deref(), self.egress_proxy.as_deref(), tenant)
    }
}

/// [`Config::session_window`] of a prefetch and a number of sessions.
fn session_window(prefetch: u16, max_sessions: u16) -> usize {
    (usize::from(prefetch) / (usize::from(max_sessions) + 1)).max(1)
}

#[cfg(test)]
mod window_tests {
    use super::session_window;

    #[test]
    fn the_sessions_windows_together_leave_room_in_the_prefetch_for_another_sessions_job() {
        assert_eq!(session_window(256, 32), 7, "the defaults");
        for (prefetch, sessions) in [(256u16, 32u16), (256, 1), (1000, 7), (64, 63), (65535, 1000)] {
            let window = session_window(prefetch, sessions);
            assert!(window >= 1);
            assert!(usize::from(sessions) * window < usize::from(prefetch), "{sessions} sessions × {window} fill a prefetch of {prefetch}");
        }
        assert_eq!(session_window(8, 32), 1, "a prefetch below the sessions still lets each session a job");
    }
}
