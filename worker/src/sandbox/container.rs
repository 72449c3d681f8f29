//! Container limits and hardening: the one place that turns [`ExecutionLimits`] into a Docker
//! container configuration. Every sandbox sandcell starts is built here.
//!
//! What every sandbox gets, whatever the job asks:
//! - memory limit with swap disabled (`memory_swap == memory`), CPU quota, pids limit;
//! - `network_mode: none` and networking disabled — unless the operator granted the tenant
//!   egress (`SANDCELL_EGRESS_TENANTS`), in which case the operator's network instead;
//! - the driver as root holding only `CAP_SETUID` and `CAP_SETGID` (`cap_drop: ALL`), so that it
//!   can run user code in a kernel process as uid/gid 1000 with no capabilities at all, which
//!   can neither trace, signal nor read the driver; `no-new-privileges`; a seccomp profile
//!   that is Docker's default without `io_uring` ([`SECCOMP_PROFILE`]);
//! - read-only root filesystem; writable, size-capped tmpfs at `/home/user` (the workspace)
//!   and `/tmp`, both `nosuid,nodev`;
//! - Docker's init (tini) as PID 1, so orphaned processes are reaped;
//! - no logging driver (output reaches the worker over the attach stream only, so a job printing
//!   gigabytes cannot fill the host's disk), private IPC, no devices, no host mounts.

use std::collections::HashMap;

use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig, ResourcesUlimits};
use sandcell_protocol::ExecutionLimits;

/// The seccomp profile of every sandbox: Docker 20.10.24's default profile
/// (`profiles/seccomp/default.json` in moby at `v20.10.24`, the engine `deploy/local/up.sh`
/// installs) with `io_uring_setup`, `io_uring_enter` and `io_uring_register` taken out of its
/// allow list, as Docker itself did from version 25 on. io_uring is a second way into most of
/// the kernel's I/O paths, and the one most kernel exploits of recent years went through; no
/// library the sandbox ships needs it. And a one-off sandbox is reused for the tenant's next
/// job only once nothing of the last job can act (docs/security.md): a job's asynchronous I/O,
/// which can still complete after the process that queued it is gone, would be one more thing
/// to vouch for. Under runc the refused calls fail with `EPERM` (the profile's default errno).
/// gVisor applies no OCI seccomp profile unless runsc runs with `--oci-seccomp` (the local
/// stack's does not): there the calls reach gVisor's own io_uring in its user-space kernel
/// (the gVisor installed here, 20221219, implements it; later ones refuse it unless runsc runs
/// with `--iouring`), never the host's, and one-off sandboxes are not reused by default. An
/// engine newer than 20.10 applies this profile in place of its own default: refresh it from
/// moby's `default.json` (minus io_uring) with the engine (docs/operations.md).
pub const SECCOMP_PROFILE: &str = include_str!("seccomp.json");
/// The workspace inside every sandbox.
pub const WORKSPACE: &str = "/home/user";
/// Label naming the worker that owns a container (for the start-up sweep).
pub const LABEL_WORKER: &str = "sandcell.worker";
/// Label with the job's tenant.
pub const LABEL_TENANT: &str = "sandcell.tenant";
/// Label with the job id.
pub const LABEL_JOB: &str = "sandcell.job";
/// The user the driver starts as (root without capabilities but [`DRIVER_CAPS`]); the kernel it
/// starts, and so all user code, runs as uid/gid 1000.
pub const SANDBOX_USER: &str = "0:0";
/// The only capabilities a sandbox keeps: the driver's, to start its kernel as uid/gid 1000.
/// The kernel loses them when it changes uid.
pub const DRIVER_CAPS: [&str; 2] = ["SETUID", "SETGID"];
/// Size of `/tmp` in the sandbox (interpreter caches live there, not in the workspace).
const TMP_MB: u64 = 64;

/// Label marking a warm-pool container (not yet given to any tenant).
pub const LABEL_POOL: &str = "sandcell.pool";
/// Label with the session id a container was started for.
pub const LABEL_SESSION: &str = "sandcell.session";

/// What is needed to build a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Image reference, e.g. `sandcell-sandbox:1a2b3c4d5e6f`.
    pub image: String,
    /// OCI runtime: `runc` or `runsc`.
    pub runtime: String,
    /// Limits to apply.
    pub limits: ExecutionLimits,
    /// Labels identifying owner and job.
    pub labels: HashMap<String, String>,
    /// The network of a tenant the operator allowed egress; `None`: no network at all.
    pub egress: Option<Egress>,
    /// Modules the driver imports before it reports ready (`SANDCELL_PRELOAD`).
    pub preload: Vec<String>,
    /// The kernel makes its one-off preparation for forked jobs (immortal objects, huge pages)
    /// in its start, before ready (`SANDCELL_PREPARE_AT_START`), rather than after its first
    /// one-off job: the warm pool's, where one-off sandboxes are reused. Not part of the shape.
    pub prepare_at_start: bool,
}

/// Where a sandbox of a tenant granted egress may go: its tenant's network, and the filtering
/// proxy on it (docs/configuration.md, "Network egress per tenant").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Egress {
    /// The Docker network the sandbox joins.
    pub network: String,
    /// Given to the code as `HTTP_PROXY`/`HTTPS_PROXY` (and lower case), when set.
    pub proxy: Option<String>,
}

impl Egress {
    /// The egress of `tenant`: `None` unless it is one of `tenants` and a `network` is set; a
    /// `{tenant}` in `network` is replaced by the tenant.
    pub fn granted(tenants: &std::collections::HashSet<String>, network: Option<&str>, proxy: Option<&str>, tenant: &str) -> Option<Egress> {
        let network = network.filter(|_| tenants.contains(tenant))?;
        Some(Egress { network: network.replace("{tenant}", tenant), proxy: proxy.map(str::to_string) })
    }
}

impl Egress {
    /// The proxy's host name, when the proxy is named rather than given by address. The worker
    /// resolves it to the proxy container's address on the tenant's network and writes it into
    /// the sandbox's `/etc/hosts`: Docker's embedded DNS does not answer under gVisor.
    pub fn proxy_name(&self) -> Option<&str> {
        let url = self.proxy.as_deref()?;
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let host = rest.split(['/', ':']).next().filter(|h| !h.is_empty())?;
        host.parse::<std::net::IpAddr>().is_err().then_some(host)
    }
}

/// The properties fixed when a container is created. A warm container can serve a job only if
/// the job needs exactly this shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerShape {
    memory_mb: u64,
    milli_cpus: u64,
    pids: u32,
    workspace_mb: u64,
    runtime: String,
    egress: Option<Egress>,
}

impl SandboxSpec {
    /// The shape of the containers this spec creates.
    pub fn shape(&self) -> ContainerShape {
        let l = &self.limits;
        ContainerShape {
            memory_mb: l.memory_mb,
            milli_cpus: (l.cpus * 1000.0).round() as u64,
            pids: l.pids,
            workspace_mb: l.workspace_mb,
            runtime: self.runtime.clone(),
            egress: self.egress.clone(),
        }
    }
}

/// The Docker create body for `spec`.
pub fn create_body(spec: &SandboxSpec) -> ContainerCreateBody {
    let l = &spec.limits;
    let memory = (l.memory_mb as i64).saturating_mul(1024 * 1024);
    let tmpfs = HashMap::from([
        (WORKSPACE.to_string(), format!("rw,exec,nosuid,nodev,size={}m,uid=1000,gid=1000,mode=0700", l.workspace_mb)),
        ("/tmp".to_string(), format!("rw,noexec,nosuid,nodev,size={TMP_MB}m,uid=1000,gid=1000,mode=1777")),
    ]);
    let host_config = HostConfig {
        memory: Some(memory),
        memory_swap: Some(memory),
        nano_cpus: Some((l.cpus * 1e9) as i64),
        pids_limit: Some(i64::from(l.pids)),
        network_mode: Some(spec.egress.as_ref().map_or_else(|| "none".to_string(), |e| e.network.clone())),
        readonly_rootfs: Some(true),
        tmpfs: Some(tmpfs),
        cap_drop: Some(vec!["ALL".into()]),
        cap_add: Some(DRIVER_CAPS.iter().map(|c| c.to_string()).collect()),
        // Docker's API takes the profile itself, not a path (the CLI reads the file for it).
        security_opt: Some(vec!["no-new-privileges".into(), format!("seccomp={SECCOMP_PROFILE}")]),
        privileged: Some(false),
        ipc_mode: Some("private".into()),
        runtime: Some(spec.runtime.clone()),
        // tini as PID 1 reaps processes the code leaves behind and forwards signals to the driver.
        init: Some(true),
        // Make the sandbox, not a host process, the kernel's first choice under memory pressure.
        oom_score_adj: Some(500),
        ulimits: Some(vec![ResourcesUlimits { name: Some("nofile".into()), soft: Some(1024), hard: Some(1024) }]),
        log_config: Some(HostConfigLogConfig { typ: Some("none".into()), config: None }),
        sysctls: nothing_of_closed_connections(spec),
        ..Default::default()
    };
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        user: Some(SANDBOX_USER.into()),
        working_dir: Some(WORKSPACE.into()),
        cmd: Some(vec!["python3".into(), "-u".into(), "/opt/sandcell/driver.py".into()]),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        open_stdin: Some(true),
        stdin_once: Some(true),
        tty: Some(false),
        network_disabled: Some(spec.egress.is_none()),
        env: Some(env(spec)).filter(|e| !e.is_empty()),
        labels: Some(spec.labels.clone()),
        host_config: Some(host_config),
        ..Default::default()
    }
}

/// A sandbox without a network keeps nothing of a closed TCP connection: the sandbox's network
/// namespace outlives each one-off job it runs, and what it kept of the loopback connections a
/// job closed was readable by the next, with addresses and ports of the job's choosing
/// (red-teamed: messages passed both ways) — connections in TIME_WAIT, listed in
/// `/proc/net/tcp` for 60 s, and the per-destination metrics the kernel saves at a close, kept
/// for an hour and dumped to anyone over netlink. On the loopback neither serves anything. Only
/// under runc: gVisor's network stack is its own, and one-off sandboxes are not reused there by
/// default. A sandbox with a network keeps the defaults (they serve its real connections).
fn nothing_of_closed_connections(spec: &SandboxSpec) -> Option<HashMap<String, String>> {
    (spec.egress.is_none() && spec.runtime == "runc")
        .then(|| HashMap::from([("net.ipv4.tcp_max_tw_buckets".to_string(), "0".to_string()), ("net.ipv4.tcp_no_metrics_save".to_string(), "1".to_string())]))
}

/// The environment the worker gives a sandbox: the modules to preload, and a granted tenant's
/// proxy.
fn env(spec: &SandboxSpec) -> Vec<String> {
    let mut env = Vec::new();
    if !spec.preload.is_empty() {
        env.push(format!("SANDCELL_PRELOAD={}", spec.preload.join(",")));
    }
    if spec.prepare_at_start {
        env.push("SANDCELL_PREPARE_AT_START=1".to_string());
    }
    if let Some(proxy) = spec.egress.as_ref().and_then(|e| e.proxy.as_ref()) {
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.push(format!("{name}={proxy}"));
        }
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            image: "img".into(),
            runtime: "runc".into(),
            limits: sandcell_protocol::LimitPolicy::default().default,
            labels: HashMap::new(),
            egress: None,
            preload: Vec::new(),
            prepare_at_start: false,
        }
    }

    #[test]
    fn only_a_spec_that_asks_for_it_tells_its_kernel_to_prepare_at_start() {
        let flag = "SANDCELL_PREPARE_AT_START=1".to_string();
        assert!(!env(&spec()).contains(&flag));
        let warm = SandboxSpec { prepare_at_start: true, ..spec() };
        assert!(env(&warm).contains(&flag));
        assert_eq!(warm.shape(), spec().shape(), "not part of the shape: a job of the pool's shape takes a warm kernel");
    }

    #[test]
    fn egress_is_granted_per_tenant_on_a_network_of_its_own() {
        let tenants = std::collections::HashSet::from(["a".to_string(), "b".to_string()]);
        let (net, proxy) = (Some("sandcell-egress-{tenant}"), Some("http://sandcell-egress-proxy:8888"));
        let a = Egress::granted(&tenants, net, proxy, "a").expect("granted");
        assert_eq!((a.network.as_str(), a.proxy.as_deref()), ("sandcell-egress-a", proxy));
        assert_eq!(Egress::granted(&tenants, net, proxy, "b").map(|e| e.network), Some("sandcell-egress-b".into()));
        assert!(Egress::granted(&tenants, net, proxy, "c").is_none(), "not granted: no network at all");
        assert!(Egress::granted(&tenants, None, proxy, "a").is_none(), "no network configured");
    }

    #[test]
    fn a_named_proxy_is_resolved_an_address_is_not() {
        let e = |p: &str| Egress { network: "n".into(), proxy: Some(p.into()) };
        assert_eq!(e("http://sandcell-egress-proxy:8888").proxy_name(), Some("sandcell-egress-proxy"));
        assert_eq!(e("http://proxy/").proxy_name(), Some("proxy"));
        assert_eq!(e("http://10.0.0.2:8888").proxy_name(), None);
        assert_eq!(Egress { network: "n".into(), proxy: None }.proxy_name(), None);
    }

    #[test]
    fn a_sandbox_without_a_network_under_runc_keeps_nothing_of_closed_connections() {
        let sysctls = |s: &SandboxSpec| create_body(s).host_config.and_then(|h| h.sysctls);
        let none = sysctls(&spec());
        assert_eq!(none.as_ref().and_then(|m| m.get("net.ipv4.tcp_max_tw_buckets")).map(String::as_str), Some("0"));
        assert_eq!(none.as_ref().and_then(|m| m.get("net.ipv4.tcp_no_metrics_save")).map(String::as_str), Some("1"));
        let mut egress = spec();
        egress.egress = Some(Egress { network: "sandcell-egress-a".into(), proxy: None });
        assert_eq!(sysctls(&egress), None, "a real network keeps TIME_WAIT");
        let mut gvisor = spec();
        gvisor.runtime = "runsc".into();
        assert_eq!(sysctls(&gvisor), None, "gVisor's network stack is its own");
    }

    #[test]
    fn egress_is_only_the_operators_network_when_granted() {
        let mut s = spec();
        s.egress = Some(Egress { network: "sandcell-egress-a".into(), proxy: Some("http://proxy:8888".into()) });
        let body = create_body(&s);
        assert_eq!(body.host_config.unwrap().network_mode.as_deref(), Some("sandcell-egress-a"));
        assert_eq!(body.network_disabled, Some(false));
        let env = body.env.unwrap_or_default();
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            assert!(env.contains(&format!("{name}=http://proxy:8888")), "{env:?}");
        }
        assert_ne!(spec().shape(), s.shape(), "a granted network never reuses a no-network warm container");
    }

    #[test]
    fn every_sandbox_is_locked_down() {
        let body = create_body(&spec());
        let hc = body.host_config.unwrap();
        assert_eq!(hc.network_mode.as_deref(), Some("none"));
        assert_eq!(hc.readonly_rootfs, Some(true));
        assert_eq!(hc.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(hc.cap_add, Some(vec!["SETUID".to_string(), "SETGID".to_string()]), "the driver's two, nothing else");
        assert_eq!(hc.security_opt, Some(vec!["no-new-privileges".to_string(), format!("seccomp={SECCOMP_PROFILE}")]));
        assert_eq!(hc.memory, hc.memory_swap, "swap must be disabled");
        assert!(hc.binds.is_none() && hc.mounts.is_none() && hc.devices.is_none(), "no host path or device");
        assert_eq!(body.user.as_deref(), Some("0:0"));
        assert_eq!(body.network_disabled, Some(true));
    }

    #[test]
    fn the_seccomp_profile_refuses_io_uring_and_allows_what_docker_allows() {
        let profile: serde_json::Value = serde_json::from_str(SECCOMP_PROFILE).unwrap();
        assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO", "what is not listed is refused");
        let allowed: Vec<&str> = profile["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|rule| rule["action"] == "SCMP_ACT_ALLOW")
            .flat_map(|rule| rule["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()))
            .collect();
        for name in ["io_uring_setup", "io_uring_enter", "io_uring_register"] {
            assert!(!allowed.contains(&name), "{name} is allowed");
        }
        // Docker's default list otherwise: what the interpreter, its libraries and the driver use.
        for name in ["read", "write", "clone", "execve", "mmap", "madvise", "pidfd_open", "kill", "setresuid", "prlimit64", "shmget"] {
            assert!(allowed.contains(&name), "{name} is refused");
        }
        assert!(allowed.len() > 300, "{} calls allowed", allowed.len());
    }

    #[test]
    fn limits_are_translated_to_docker_units() {
        let mut s = spec();
        s.limits.memory_mb = 256;
        s.limits.cpus = 0.5;
        s.limits.pids = 64;
        s.limits.workspace_mb = 32;
        let hc = create_body(&s).host_config.unwrap();
        assert_eq!(hc.memory, Some(256 * 1024 * 1024));
        assert_eq!(hc.nano_cpus, Some(500_000_000));
        assert_eq!(hc.pids_limit, Some(64));
        assert!(hc.tmpfs.unwrap()[WORKSPACE].contains("size=32m"));
    }
}
