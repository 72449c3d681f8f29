"""Pod fidelity: the scheduler and worker pods of deploy/kubernetes, run on the local Docker as
their manifests describe, against the local stack (deploy/local/up.sh).

What it proves (exit status 0 only if every step holds):
  1. the scheduler pod and the worker pod (init container, engine sidecar, worker) start from the
     images deploy/images/build.sh built, and their probes pass as the manifests define them;
  2. a one-off job and a session job succeed through the worker pod (its worker id in the
     result), a chart comes back as a PNG (the store is reached from the pod);
  3. SIGTERM to the worker container, with a session job in flight, drains as ARCHITECTURE.md
     ("Sessions that move") says: the job in flight finishes and succeeds, the worker exits 0
     within terminationGracePeriodSeconds, and the session's next job runs on another worker with
     its variables (`execution.moved.cause == "drained"`); then the engine sidecar stops (as the
     kubelet stops sidecars after the main containers) with status 0.

How a pod spec becomes `docker run` (strict: a field this script does not translate fails the
check, so the manifests cannot grow something this test does not prove):
  - image, command, args, env (values and metadata.name), envFrom (the ConfigMap of config.yaml;
    the Secret's keys), volumeMounts, securityContext (runAsUser/Group, supplementalGroups,
    readOnlyRootFilesystem, allowPrivilegeEscalation, capabilities, privileged, seccomp),
    resources.limits (memory, cpu), probes (exec, httpGet, tcpSocket with their period and
    failure threshold), initContainers in order, a sidecar (restartPolicy: Always) kept running
    and waited for by its startupProbe, terminationGracePeriodSeconds;
  - emptyDir volumes become Docker volumes of mode 0777, as the kubelet makes them (medium: Memory
    a tmpfs of the sizeLimit);
  - scheduling-only fields (replicas, topologySpreadConstraints, requests) are not translated.
Where the local machine differs from a node, and what is done instead (printed when it applies):
  - the pod's network: the local stack listens on 127.0.0.1, so the pod shares the host's
    network namespace (one network namespace for all its containers, as in a pod);
  - service addresses and credentials: the Secret's values, and the ConfigMap's values naming
    the cluster's services (SANDCELL_S3_ENDPOINT), are the local stack's from the environment;
  - `privileged: true`: Docker's --privileged grants every capability the kernel knows, and this
    machine's own bounding set may lack some (CAP_SYS_RESOURCE here), which runc then refuses. The
    container gets instead what privileged gives, capability by capability, less those the host
    itself does not have: every other capability, all devices, no seccomp or AppArmor profile,
    unmasked /proc and /sys, host device nodes not mounted; the engine remounts /sys and its
    cgroups read-write (its entrypoint).

Usage: pod.py [--keep]   (env: the local stack's settings; SANDCELL_ADMIN_BIN; SANDCELL_WORKER_BIN)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml

from sandcell import Client, Settings

HERE = Path(__file__).resolve().parent
MANIFESTS = HERE.parent
REPO = MANIFESTS.parents[1]
# Every container and volume this script creates carries this prefix (and is removed at the end).
PREFIX = "sandcell-podtest-"

POD_FIELDS = {
    "terminationGracePeriodSeconds", "automountServiceAccountToken", "enableServiceLinks",
    "securityContext", "topologySpreadConstraints", "initContainers", "containers", "volumes",
}
CONTAINER_FIELDS = {
    "name", "image", "imagePullPolicy", "restartPolicy", "command", "args", "env", "envFrom",
    "ports", "startupProbe", "livenessProbe", "readinessProbe", "resources", "volumeMounts",
    "securityContext",
}
SECURITY_FIELDS = {
    "runAsNonRoot", "runAsUser", "runAsGroup", "supplementalGroups", "seccompProfile",
    "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities", "privileged",
}
# The keys translated inside each part of a container (any other key fails the check).
PROBE_FIELDS = {"exec", "httpGet", "tcpSocket", "periodSeconds", "failureThreshold", "timeoutSeconds",
                "initialDelaySeconds", "successThreshold"}
HANDLER_FIELDS = {"exec": {"command"}, "httpGet": {"path", "port"}, "tcpSocket": {"port"}}
MOUNT_FIELDS = {"name", "mountPath", "readOnly"}
LIMIT_FIELDS = {"memory", "cpu"}
EMPTYDIR_FIELDS = {"medium", "sizeLimit"}
# ConfigMap keys whose manifest value names a cluster service: the local stack's value is used.
SERVICE_KEYS = {"SANDCELL_S3_ENDPOINT", "SANDCELL_RABBITMQ_MANAGEMENT_URL"}


def log(msg: str) -> None:
    print(f"pod: {msg}", flush=True)


class Failed(Exception):
    """A step of the check did not hold."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)
    log(f"ok: {what}")


def docker(*args: str, check_rc: bool = True, timeout: float = 600) -> str:
    p = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check_rc and p.returncode != 0:
        raise Failed(f"docker {' '.join(args[:3])}…: {p.stderr.strip()}")
    return p.stdout.strip()


def load(name: str) -> List[Dict[str, Any]]:
    with open(MANIFESTS / name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(docs: List[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    if len(found) != 1:
        raise Failed(f"expected one {kind}, found {len(found)}")
    return found[0]


def host_bounding_caps() -> set:
    """The capabilities this machine's own processes may hold (CapBnd of this process), by
    Linux's numbering of capabilities."""
    with open("/proc/self/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    return {n for i, n in enumerate(CAP_NAMES) if mask >> i & 1}


CAP_NAMES = [
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
]


def quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for u, m in units.items():
        if q.endswith(u):
            return int(float(q[: -len(u)]) * m)
    return int(q)


def cpu_cores(q: str) -> float:
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def http_ok(url: str, timeout: float) -> bool:
    """A GET of url answers 2xx or 3xx within timeout (an HTTP probe's rule)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 400
    except OSError:
        return False


def only(obj: Dict[str, Any], allowed: set, where: str) -> None:
    """Fail on a key of obj this check does not translate."""
    unknown = set(obj) - allowed
    if unknown:
        raise Failed(f"{where}: fields this check does not translate: {sorted(unknown)}")


class Pod:
    """One pod of a Deployment's template, run on the local Docker."""

    def __init__(self, deployment: Dict[str, Any], name: str, env_from: Dict[str, Dict[str, str]]) -> None:
        self.name = name
        self.spec = deployment["spec"]["template"]["spec"]
        unknown = set(self.spec) - POD_FIELDS
        if unknown:
            raise Failed(f"{name}: pod fields this check does not translate: {sorted(unknown)}")
        self.grace = int(self.spec.get("terminationGracePeriodSeconds", 30))
        self.env_from = env_from
        self.pod_security = self.spec.get("securityContext", {})
        self.volumes: Dict[str, str] = {}
        self.running: List[str] = []

    def container_name(self, c: Dict[str, Any]) -> str:
        return f"{PREFIX}{self.name}-{c['name']}"

    def make_volumes(self) -> None:
        for v in self.spec.get("volumes", []):
            if set(v) != {"name", "emptyDir"}:
                raise Failed(f"{self.name}: volume {v['name']}: only emptyDir is translated")
            vol = f"{PREFIX}{self.name}-{v['name']}"
            ed = v["emptyDir"] or {}
            only(ed, EMPTYDIR_FIELDS, f"{self.name}: volume {v['name']}")
            if ed.get("sizeLimit") and ed.get("medium") != "Memory":
                # The kubelet evicts a pod past it; a local Docker volume has no size.
                log(f"{self.name}: volume {v['name']}: sizeLimit {ed['sizeLimit']} not enforced here")
            if ed.get("medium") == "Memory":
                size = quantity_bytes(ed.get("sizeLimit", "64Mi"))
                docker("volume", "create", "--driver", "local", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                       "--opt", f"o=size={size},mode=0777", vol)
            else:
                docker("volume", "create", vol)
                # The kubelet makes an emptyDir world-writable; so is this one.
                os.chmod(docker("volume", "inspect", "--format", "{{.Mountpoint}}", vol), 0o777)
            self.volumes[v["name"]] = vol

    def env(self, c: Dict[str, Any]) -> Dict[str, str]:
        out: Dict[str, str] = {}
        for src in c.get("envFrom", []):
            (_, ref), = src.items()
            out.update(self.env_from[ref["name"]])
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = str(e["value"])
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                out[e["name"]] = self.name
            else:
                raise Failed(f"{self.name}: env {e['name']}: only value and metadata.name are translated")
        return out

    def run_args(self, c: Dict[str, Any]) -> List[str]:
        unknown = set(c) - CONTAINER_FIELDS
        if unknown:
            raise Failed(f"{self.name}/{c['name']}: container fields this check does not translate: {sorted(unknown)}")
        where = f"{self.name}/{c['name']}"
        own = c.get("securityContext", {})
        sec = {**{k: v for k, v in self.pod_security.items() if k != "supplementalGroups"}, **own}
        only(sec, SECURITY_FIELDS, f"{where} securityContext")
        args = ["run", "--detach", "--name", self.container_name(c), "--network", "host",
                "--label", f"sandcell.podtest={self.name}"]
        for g in self.pod_security.get("supplementalGroups", []):
            args += ["--group-add", str(g)]
        if sec.get("privileged"):
            # Privileged means all of it: a container that is privileged and also sets a user or
            # capabilities is a case this check does not translate. (The kubelet runs a
            # privileged container without a seccomp profile, whatever the pod's default.)
            only(own, {"privileged"}, f"{where} securityContext (privileged)")
            if {"runAsUser", "runAsGroup", "runAsNonRoot"} & set(sec):
                raise Failed(f"{where}: a privileged container with a user from the pod is not translated")
            missing = set(CAP_NAMES) - host_bounding_caps()
            args += ["--cap-add", "ALL", "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
                     "--security-opt", "systempaths=unconfined", "--device-cgroup-rule", "a *:* rwm",
                     "--cgroupns", "private"]
            for cap in sorted(missing):
                args += ["--cap-drop", cap]
            if missing:
                log(f"{c['name']}: privileged, less what this machine lacks itself: {sorted(missing)}")
        else:
            if "runAsUser" in sec:
                args += ["--user", f"{sec['runAsUser']}:{sec.get('runAsGroup', sec['runAsUser'])}"]
            elif sec.get("runAsNonRoot"):
                raise Failed(f"{self.name}/{c['name']}: runAsNonRoot without runAsUser")
            if sec.get("readOnlyRootFilesystem"):
                args.append("--read-only")
            if sec.get("allowPrivilegeEscalation") is False:
                args += ["--security-opt", "no-new-privileges"]
            caps = sec.get("capabilities", {})
            for cap in caps.get("drop", []):
                args += ["--cap-drop", cap]
            for cap in caps.get("add", []):
                args += ["--cap-add", cap]
            profile = sec.get("seccompProfile", {}).get("type", "RuntimeDefault")
            if profile != "RuntimeDefault":
                raise Failed(f"{self.name}/{c['name']}: seccomp profile {profile} not translated")
        limits = c.get("resources", {}).get("limits", {})
        only(limits, LIMIT_FIELDS, f"{where} resources.limits")
        if "memory" in limits:
            args += ["--memory", str(quantity_bytes(limits["memory"]))]
        if "cpu" in limits:
            args += ["--cpus", str(cpu_cores(limits["cpu"]))]
        for m in c.get("volumeMounts", []):
            only(m, MOUNT_FIELDS, f"{where} volumeMounts")
            spec = f"{self.volumes[m['name']]}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")
            args += ["--volume", spec]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                only(c[kind], PROBE_FIELDS, f"{where} {kind}")
                if c[kind].get("successThreshold", 1) != 1:
                    raise Failed(f"{where} {kind}: successThreshold other than 1 is not translated")
                for handler, fields in HANDLER_FIELDS.items():
                    if handler in c[kind]:
                        only(c[kind][handler], fields, f"{where} {kind}.{handler}")
        for k, v in sorted(self.env(c).items()):
            args += ["--env", f"{k}={v}"]
        command = c.get("command", [])
        if command:
            args += ["--entrypoint", command[0]]
        args.append(c["image"])
        args += command[1:] + c.get("args", [])
        return args

    def probe(self, c: Dict[str, Any], kind: str) -> Callable[[], bool]:
        p = c[kind]
        ports = {port["name"]: port["containerPort"] for port in c.get("ports", [])}
        name = self.container_name(c)
        if "exec" in p:
            cmd = p["exec"]["command"]
            # The kubelet's timeout, plus a second for `docker exec` itself; a probe past it
            # fails this attempt, as it would there.
            limit = p.get("timeoutSeconds", 1) + 1

            def run_exec() -> bool:
                try:
                    return subprocess.run(["docker", "exec", name, *cmd], capture_output=True, timeout=limit).returncode == 0
                except subprocess.TimeoutExpired:
                    return False
            return run_exec
        if "httpGet" in p:
            port = ports.get(p["httpGet"]["port"], p["httpGet"]["port"])
            url = f"http://127.0.0.1:{port}{p['httpGet']['path']}"

            return lambda: http_ok(url, p.get("timeoutSeconds", 1))
        if "tcpSocket" in p:
            port = ports.get(p["tcpSocket"]["port"], p["tcpSocket"]["port"])

            def tcp() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", int(port)), timeout=p.get("timeoutSeconds", 1)).close()
                    return True
                except OSError:
                    return False
            return tcp
        raise Failed(f"{self.name}/{c['name']}: {kind} handler not translated")

    def wait_probe(self, c: Dict[str, Any], kind: str) -> float:
        """Poll a probe as the kubelet would (period × failure threshold); seconds it took."""
        p = c[kind]
        ok = self.probe(c, kind)
        period = p.get("periodSeconds", 10)
        attempts = p.get("failureThreshold", 3)
        start = time.monotonic()
        time.sleep(p.get("initialDelaySeconds", 0))
        # A readiness probe keeps running in a pod: allow it as long as a startup would take.
        if kind == "readinessProbe":
            attempts = max(attempts, 60 // period + 1)
        for _ in range(attempts):
            if ok():
                return time.monotonic() - start
            state = docker("inspect", "--format", "{{.State.Status}}", self.container_name(c), check_rc=False)
            if state != "running":
                raise Failed(f"{self.name}/{c['name']} is {state} while waiting for its {kind}:\n"
                             + docker("logs", "--tail", "40", self.container_name(c), check_rc=False))
            time.sleep(period)
        raise Failed(f"{self.name}/{c['name']}: {kind} did not pass in {attempts} × {period} s:\n"
                     + subprocess.run(["docker", "logs", "--tail", "40", self.container_name(c)],
                                      capture_output=True, text=True).stderr)

    def start(self) -> None:
        self.make_volumes()
        for c in self.spec.get("initContainers", []):
            if c.get("restartPolicy") == "Always":
                docker(*self.run_args(c))
                self.running.append(self.container_name(c))
                took = self.wait_probe(c, "startupProbe") if "startupProbe" in c else 0.0
                log(f"{self.name}: sidecar {c['name']} started ({took:.1f} s to its startup probe)")
            else:
                docker(*self.run_args(c))
                code = docker("wait", self.container_name(c), timeout=600)
                if code != "0":
                    raise Failed(f"{self.name}: init container {c['name']} exited {code}:\n"
                                 + docker("logs", self.container_name(c), check_rc=False))
                log(f"{self.name}: init container {c['name']} completed")
        for c in self.spec["containers"]:
            docker(*self.run_args(c))
            self.running.append(self.container_name(c))
        for c in self.spec["containers"]:
            for kind in ("startupProbe", "readinessProbe"):
                if kind in c:
                    took = self.wait_probe(c, kind)
                    log(f"{self.name}: {c['name']} passed its {kind} ({took:.1f} s)")
        self.liveness()

    def container(self, name: str) -> Dict[str, Any]:
        return next(c for c in self.spec["containers"] + self.spec.get("initContainers", []) if c["name"] == name)

    def liveness(self) -> None:
        """Every container's liveness probe passes now."""
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            if "livenessProbe" in c and self.container_name(c) in self.running:
                check(self.probe(c, "livenessProbe")(), f"{self.name}/{c['name']} answers its liveness probe")

    def terminate(self, c: Dict[str, Any], grace: float) -> tuple:
        """SIGTERM as the kubelet sends it; (exit code, seconds), or (None, grace) if it outlived grace."""
        name = self.container_name(c)
        start = time.monotonic()
        docker("kill", "--signal", "TERM", name)
        try:
            code = docker("wait", name, timeout=grace)
        except subprocess.TimeoutExpired:
            docker("kill", name, check_rc=False)
            return None, grace
        return int(code), time.monotonic() - start

    def remove(self) -> None:
        remove_containers_and_volumes(f"label=sandcell.podtest={self.name}", f"{PREFIX}{self.name}-")


def peak_memory(container: str) -> Optional[int]:
    """The container's highest memory use so far (its cgroup's peak, v1 or v2), in bytes."""
    cid = docker("inspect", "--format", "{{.Id}}", container)
    for path in (f"/sys/fs/cgroup/memory/docker/{cid}/memory.max_usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.peak"):
        try:
            return int(Path(path).read_text())
        except OSError:
            continue
    return None


def report_resources(pod: "Pod") -> None:
    """What each running container of the pod used at its peak, against its limit: the figures
    its requests and limits are sized from (printed, not checked: the kernel enforces a limit)."""
    for c in pod.spec.get("initContainers", []) + pod.spec["containers"]:
        name = pod.container_name(c)
        if name not in pod.running:
            continue
        peak = peak_memory(name)
        limit = c.get("resources", {}).get("limits", {}).get("memory")
        if peak is None:
            log(f"{pod.name}/{c['name']}: peak memory not readable here")
        else:
            log(f"{pod.name}/{c['name']}: peak memory {peak / 2**20:.0f} MiB (limit {limit})")


def check_not_oom_killed(pod: "Pod") -> None:
    """No container of the pod was killed by the OOM killer at its limit."""
    for name in pod.running:
        killed = docker("inspect", "--format", "{{.State.OOMKilled}}", name, check_rc=False)
        check(killed == "false", f"{name} was not OOM-killed")


def remove_containers_and_volumes(label_filter: str, volume_prefix: str) -> int:
    """Remove the containers matching label_filter, then the volumes named volume_prefix…;
    the number of containers removed."""
    ids = docker("ps", "-aq", "--filter", label_filter, check_rc=False).split()
    if ids:
        docker("rm", "-f", *ids, check_rc=False)
    vols = docker("volume", "ls", "-q", "--filter", f"name={volume_prefix}", check_rc=False).split()
    if vols:
        docker("volume", "rm", "-f", *vols, check_rc=False)
    return len(ids)


def remove_leftovers() -> None:
    """Containers and volumes a crashed earlier run left (by label and by name prefix)."""
    n = remove_containers_and_volumes("label=sandcell.podtest", PREFIX)
    if n:
        log(f"removed {n} container(s) an earlier run left")


def env_sources() -> Dict[str, Dict[str, str]]:
    config = one(load("config.yaml"), "ConfigMap")
    secret = one(load("secret.yaml"), "Secret")
    data = dict(config["data"])
    for k in SERVICE_KEYS:
        if k in os.environ:
            log(f"config {k}: the local stack's {os.environ[k]} (manifest: {data[k]})")
            data[k] = os.environ[k]
    secrets = {}
    for k in secret["stringData"]:
        if k == "RABBITMQ_MANAGEMENT_URL":
            # Read by KEDA, not by sandcell: the template's value stays.
            secrets[k] = secret["stringData"][k]
            continue
        if k not in os.environ:
            raise Failed(f"the Secret's {k} has no value in the local stack's environment")
        secrets[k] = os.environ[k]
    return {config["metadata"]["name"]: data, secret["metadata"]["name"]: secrets}


def create_tenant() -> Settings:
    admin = os.environ.get("SANDCELL_ADMIN_BIN", str(REPO / "target" / "debug" / "sandcell-admin"))
    name = "pod" + uuid.uuid4().hex[:10]
    out = subprocess.run([admin, "tenant", "create", name], capture_output=True, text=True, check=True).stdout
    return Settings.from_env(dict(line.split("=", 1) for line in out.splitlines() if "=" in line))


def text_of(result: Dict[str, Any]) -> Optional[str]:
    """The last expression's value, as text."""
    for o in result.get("outputs") or []:
        if o.get("type") == "execute_result":
            return o.get("data", {}).get("text/plain")
    return None


def png_from_store(result: Dict[str, Any]) -> bool:
    """A figure of the result, downloaded from the object store, is a PNG."""
    for a in result.get("artifacts") or []:
        if a.get("content_type") == "image/png" and a.get("download_url"):
            with urllib.request.urlopen(a["download_url"], timeout=10) as r:
                return r.read(8) == b"\x89PNG\r\n\x1a\n"
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the containers and volumes (debugging)")
    opts = ap.parse_args()

    try:
        remove_leftovers()
        sources = env_sources()
        sched = Pod(one(load("scheduler.yaml"), "Deployment"), "sandcell-scheduler-podtest", sources)
        pod = Pod(one(load("worker.yaml"), "Deployment"), "sandcell-worker-podtest", sources)
    except Failed as e:
        print(f"pod: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    successor: Optional[subprocess.Popen] = None
    try:
        sched.start()
        pod.start()
        engine = pod.container("engine")
        runtimes = docker("exec", pod.container_name(engine), "docker", "-H",
                          "unix:///run/sandcell-engine/docker.sock", "info", "--format", "{{json .Runtimes}}")
        registered = sorted(json.loads(runtimes))
        if "runsc" in os.environ.get("SANDCELL_DOCKER_RUNTIMES", "").split(","):
            # gVisor works on this machine (the stack registered it): the engine must keep it.
            check("runsc" in registered, f"the engine registered gVisor, as it works here: {registered}")
        else:
            log(f"the engine's runtimes: {registered}")

        settings = create_tenant()
        with Client(settings) as client:
            r = client.wait(client.submit(client.job("sum(range(10))")), timeout=120)
            check(r["status"] == "succeeded" and text_of(r) == "45" and r["worker_id"] == pod.name,
                  f"a one-off job succeeds on the pod's worker ({r['status']}, {text_of(r)!r}, {r.get('worker_id')})")

            chart = "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [3, 5])\nplt.show()\nx = 6 * 7\nx"
            r = client.wait(client.submit(client.job(chart, session={"new": True, "keep_alive_s": 600})), timeout=120)
            check(r["status"] == "succeeded" and text_of(r) == "42" and r["worker_id"] == pod.name,
                  f"a session opens on the pod's worker ({r['status']}, {text_of(r)!r}, {r.get('worker_id')})")
            check(png_from_store(r), "the session's chart is a PNG in the object store")
            session = r["session"]["id"]
            report_resources(pod)
            pod.liveness()

            # The next worker (a rolling update's new pod, here a worker on the host): up before the drain.
            worker_bin = os.environ.get("SANDCELL_WORKER_BIN", str(REPO / "target" / "debug" / "sandcell-worker"))
            env = {**os.environ, "SANDCELL_WORKER_ID": "sandcell-worker-podtest-successor",
                   "SANDCELL_WORKER_METRICS_ADDR": "127.0.0.1:9475"}
            log_path = REPO / "target" / "test-logs" / "podtest-successor.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            successor = subprocess.Popen([worker_bin], env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            for _ in range(300):
                if http_ok("http://127.0.0.1:9475/healthz", 1):
                    break
                if successor.poll() is not None:
                    raise Failed(f"the successor worker exited; see {log_path}")
                time.sleep(0.2)
            else:
                raise Failed(f"the successor worker did not become healthy; see {log_path}")

            in_flight = client.submit(client.job("import time\ntime.sleep(8)\nx + 1", session={"id": session}))
            for _ in range(200):
                seen = client.result(in_flight)
                if seen and (seen.get("timings") or {}).get("started_at"):
                    break
                time.sleep(0.1)
            else:
                raise Failed("the job to drain never started")
            # The kubelet's clock for the whole pod: the sidecar gets what is left of the grace.
            pod_deadline = time.monotonic() + pod.grace
            code, took = pod.terminate(pod.container("worker"), pod.grace)
            check(code == 0, f"SIGTERM: the pod's worker drained and exited {code} in {took:.1f} s (grace {pod.grace} s)")
            r = client.wait(in_flight, timeout=60)
            check(r["status"] == "succeeded" and text_of(r) == "43" and r["worker_id"] == pod.name,
                  f"the job in flight at SIGTERM finished on the pod ({r['status']}, {text_of(r)!r})")
            r = client.wait(client.submit(client.job("x", session={"id": session})), timeout=120)
            moved = r.get("moved") or {}
            check(r["status"] == "succeeded" and text_of(r) == "42" and r["worker_id"] != pod.name
                  and moved.get("cause") == "drained",
                  f"the session's next job ran on {r.get('worker_id')} with its variables, moved: {moved.get('cause')}")
            client.wait(client.submit(client.job("", session={"id": session, "close": True})), timeout=60)

        report_resources(sched)
        check_not_oom_killed(pod)
        check_not_oom_killed(sched)
        code, took = pod.terminate(engine, max(pod_deadline - time.monotonic(), 1.0))
        check(code == 0, f"the engine sidecar stopped after the worker: exit {code} in {took:.1f} s")
        code, took = sched.terminate(sched.container("scheduler"), sched.grace)
        check(code == 0, f"SIGTERM: the scheduler pod exited {code} in {took:.1f} s (grace {sched.grace} s)")
        log("every step held")
        return 0
    except (Failed, Exception) as e:
        print(f"pod: FAILED: {e!r}" if not isinstance(e, Failed) else f"pod: FAILED: {e}", file=sys.stderr, flush=True)
        for c in pod.running + sched.running:
            print(f"--- docker logs {c} (last 30 lines)", file=sys.stderr)
            subprocess.run(["docker", "logs", "--tail", "30", c], stdout=sys.stderr, stderr=sys.stderr)
        return 1
    finally:
        if successor is not None:
            successor.terminate()
            try:
                successor.wait(60)
            except subprocess.TimeoutExpired:
                successor.kill()
        if not opts.keep:
            pod.remove()
            sched.remove()


if __name__ == "__main__":
    sys.exit(main())
