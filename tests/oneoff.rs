//! One-off jobs in sandboxes reused for their tenant (`worker/src/bound.rs`): a tenant's
//! consecutive one-off jobs share a sandbox, each in a process forked for it, and nothing one
//! job leaves reaches the next; two tenants never share one; limits still fire per job.
//! Under gVisor reuse is off by default (ARCHITECTURE.md): there every one-off job must get a
//! sandbox of its own, and the same tests check that nothing crosses either way.

use std::collections::HashSet;

use sandcell_client::Client;
use sandcell_protocol::{JobStatus, LimitHit, Submission};
use sandcell_tests::*;

/// A hostile job: it tries to leave something behind everywhere it can.
const LEAVE_TRACES: &str = r#"
import builtins, ctypes, json, os, subprocess, sys, threading, time
open('left_in_workspace.txt', 'w').write('x')
os.makedirs('locked/deeper', exist_ok=True)
open('locked/deeper/f', 'w').write('x')
os.chmod('locked/deeper', 0o500)
os.chmod('locked', 0o000)
open('/tmp/left_in_tmp', 'w').write('x')
if os.path.isdir('/dev/shm'):
    open('/dev/shm/left_in_shm', 'w').write('x')
libc = ctypes.CDLL(None, use_errno=True)
shm_id = libc.shmget(0x5ca11, 4096, 0o1600)
subprocess.Popen(['sleep', '300'], start_new_session=True)
threading.Thread(target=lambda: time.sleep(300)).start()
json.dumps = None
builtins.input = lambda *a: 'patched'
builtins.sandcell_left = True
os.environ['SANDCELL_LEFT'] = '1'
sys.path.append('/left/in/sys/path')
left_variable = 1
print('left', shm_id >= 0)
"#;

/// The next job: what it finds (as JSON on stdout).
const FIND_TRACES: &str = r#"
import builtins, ctypes, json, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def comm(pid):
    try:
        return open('/proc/%s/comm' % pid).read().strip()
    except OSError:
        return None
ps = [comm(p) for p in os.listdir('/proc') if p.isdigit()]
found = {
    'workspace': sorted(n for n in os.listdir('.') if n != '.local'),
    'tmp': sorted(n for n in os.listdir('/tmp') if n not in ('.mpl', '.ipython')),
    'shm': sorted(os.listdir('/dev/shm')) if os.path.isdir('/dev/shm') else [],
    'ipc_segment': libc.shmget(0x5ca11, 4096, 0o600) >= 0,
    'json_dumps_broken': json.dumps is None,
    'builtins_patched': builtins.input.__name__ == '<lambda>' or hasattr(builtins, 'sandcell_left'),
    'env': 'SANDCELL_LEFT' in os.environ,
    'sys_path': '/left/in/sys/path' in sys.path,
    'variable': 'left_variable' in globals(),
    'sleep_running': 'sleep' in ps,
}
print(json.dumps(found, sort_keys=True))
"#;

const NOTHING_FOUND: &str = r#"{"builtins_patched": false, "env": false, "ipc_segment": false, "json_dumps_broken": false, "shm": [], "sleep_running": false, "sys_path": false, "tmp": [], "variable": false, "workspace": []}"#;

fn bash(tenant: &str, code: &str) -> Submission {
    Submission::new(tenant, unique("job"), sandcell_protocol::Language::Bash, code)
}

async fn container(sub: &Submission) -> String {
    container_of(&sub.tenant, &sub.job_id).await.expect("the worker records the job's container")
}

#[tokio::test]
async fn a_tenants_next_one_off_job_reuses_the_sandbox_and_finds_nothing_the_last_one_left() {
    let c = client().await;
    let t = tenant();
    let leave = python(&t, LEAVE_TRACES);
    let r = run(&c, &leave).await;
    assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, "left True\n"), "{r:?}");
    assert_eq!(r.execution.processes_killed, 1, "the background sleep is killed when the job ends: {r:?}");
    let find = python(&t, FIND_TRACES);
    let r = run(&c, &find).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.execution.stdout.trim(), NOTHING_FOUND, "{r:?}");
    // The point: the same sandbox ran both (under runc; under gVisor each had its own).
    assert_eq!(container(&leave).await == container(&find).await, !under_gvisor(), "one-off sandbox reuse as configured for the runtime");
    // Each one-off job is the first cell of a pristine interpreter.
    assert_eq!(r.execution.outputs.len(), 0, "{r:?}");
    let r = run(&c, &python(&t, "get_ipython().execution_count")).await;
    assert_eq!(value(&r).as_deref(), Some("1"), "{r:?}");
}

#[tokio::test]
async fn a_bash_job_leaves_neither_files_nor_processes_for_the_next() {
    let c = client().await;
    let t = tenant();
    let leave = bash(&t, "echo x > left.txt; echo y > /tmp/left; (sleep 300 &); export LEFT=1; echo ok");
    let r = run(&c, &leave).await;
    assert_eq!((r.status, r.execution.stdout.as_str()), (JobStatus::Succeeded, "ok\n"), "{r:?}");
    // Counted with shell globs, not `ls`: under gVisor `ls -A /tmp` was seen to fail with
    // EINVAL and end the sandbox (exit status 2). The background sleep is looked for by the
    // python test above.
    let find = bash(
        &t,
        "shopt -s dotglob nullglob; count() { n=0; for f in \"$1\"/*; do case ${f##*/} in .local|.mpl|.ipython) ;; *) n=$((n+1));; esac; done; echo $n; }; \
         count .; count /tmp; echo \"${LEFT:-unset}\"",
    );
    let r = run(&c, &find).await;
    assert_eq!(r.execution.stdout, "0\n0\nunset\n", "{r:?}");
    assert_eq!(container(&leave).await == container(&find).await, !under_gvisor());
}

/// A hostile job that leaves state with no process behind it: on the directories that outlive
/// it (extended attributes, a default ACL that would make every later file unreadable, a
/// time), on the output pipe it shares with the kernel (non-blocking: a later job's large
/// output would fail), and in the sandbox's network namespace (a loopback connection in
/// TIME_WAIT, its ports the job's choice).
const LEAVE_STATE: &str = r#"
import fcntl, os, socket, struct
acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, 0, 0xffffffff) for tag in (1, 4, 0x20))
for d in ('.', '/tmp'):
    for name, value in (('user.left', b'from the last job'), ('system.posix_acl_default', acl)):
        try:
            os.setxattr(d, name, value)
        except OSError:
            pass  # gVisor's tmpfs takes neither
    os.utime(d, (1000000000, 1000000000))
srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
cli.close(); conn.close(); srv.close()
fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_NONBLOCK)
"#;

/// The next job: what it finds of that state, then a large output.
const FIND_STATE: &str = r#"
import fcntl, json, os, stat
def xattrs(d):
    try:
        return os.listxattr(d)
    except OSError:
        return []  # a file system without them
times = [os.stat(d).st_mtime > 1000000000 for d in ('.', '/tmp')]
open('/tmp/made', 'w').write('x')
time_wait = [l for f in ('/proc/net/tcp', '/proc/net/tcp6') if os.path.exists(f) for l in open(f).readlines()[1:] if l.split()[3] == '06']
print(json.dumps({'xattrs': xattrs('.') + xattrs('/tmp'), 'times_now': times,
                  'tmp_file_mode': oct(stat.S_IMODE(os.stat('/tmp/made').st_mode)), 'time_wait': len(time_wait),
                  'nonblocking': bool(fcntl.fcntl(1, fcntl.F_GETFL) & os.O_NONBLOCK)}, sort_keys=True))
print('x' * 200000)
"#;

#[tokio::test]
async fn a_tenants_next_one_off_job_finds_no_attribute_acl_pipe_flag_or_connection_the_last_left() {
    let c = client().await;
    let t = tenant();
    let leave = python(&t, LEAVE_STATE);
    let r = run(&c, &leave).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let find = python(&t, FIND_STATE);
    let r = run(&c, &find).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let (found, rest) = r.execution.stdout.split_once('\n').expect("two lines");
    assert_eq!(found, r#"{"nonblocking": false, "time_wait": 0, "times_now": [true, true], "tmp_file_mode": "0o644", "xattrs": []}"#);
    assert_eq!(rest.trim_end().len(), 200_000, "the large output arrives whole");
    assert_eq!(container(&leave).await == container(&find).await, !under_gvisor(), "one-off sandbox reuse as configured for the runtime");
}

#[tokio::test]
async fn two_tenants_one_off_jobs_never_share_a_sandbox() {
    let c = client().await;
    let (a, b) = (tenant(), tenant());
    let mut containers = [HashSet::new(), HashSet::new()];
    for i in 0..6 {
        for (k, t) in [&a, &b].into_iter().enumerate() {
            let sub = python(t, &format!("{i} * 2"));
            let r = run(&c, &sub).await;
            assert_eq!(value(&r), Some((i * 2).to_string()), "{r:?}");
            containers[k].insert(container(&sub).await);
        }
    }
    assert!(containers[0].is_disjoint(&containers[1]), "tenants shared a sandbox: {containers:?}");
    // And the reuse the test is about happened: 6 jobs of a tenant, fewer sandboxes (under
    // gVisor, where reuse is off, one each).
    let reused = containers[0].len() < 6 && containers[1].len() < 6;
    assert_eq!(reused, !under_gvisor(), "{containers:?}");
}

#[tokio::test]
async fn limits_still_fire_per_job_and_the_tenants_next_job_runs_clean() {
    let c = client().await;
    let t = tenant();
    let warm = python(&t, "1");
    run(&c, &warm).await;

    let mut hog = python(&t, "hog = b'x' * (600 << 20)\nprint('survived')");
    hog.memory_mb = Some(192);
    let r = run(&c, &hog).await;
    assert_oom_killed(&r);
    let next = python(&t, "print('next')");
    assert_eq!(run(&c, &next).await.execution.stdout, "next\n");

    let mut slow = python(&t, "while True: pass");
    slow.timeout_ms = Some(1500);
    let r = run(&c, &slow).await;
    assert_eq!(r.status, JobStatus::TimedOut, "{r:?}");
    assert!(r.execution.limits_hit.contains(&LimitHit::Time), "{r:?}");
    let slow_container = container(&slow).await;
    assert!(!container_exists(&slow_container).await, "a sandbox killed at the deadline is not reused");
    let next = python(&t, FIND_TRACES);
    let r = run(&c, &next).await;
    assert_eq!(r.execution.stdout.trim(), NOTHING_FOUND, "{r:?}");
    assert_ne!(container(&next).await, slow_container);

    if !under_gvisor() {
        // Under runc a fork bomb is refused by the pids limit and the cell goes on; its copies are
        // killed when it ends, and the next job finds none of them.
        let mut bomb = bash(&t, "bomb() { bomb | bomb & }; bomb; sleep 2; echo done");
        bomb.timeout_ms = Some(10_000);
        let r = run(&c, &bomb).await;
        assert!(r.execution.limits_hit.contains(&LimitHit::Pids), "{r:?}");
        let after = python(&t, "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and os.path.exists('/proc/%s/comm' % p) and open('/proc/%s/comm' % p).read().strip() == 'bash'))");
        let r = run(&c, &after).await;
        assert_eq!(r.execution.stdout.trim(), "0", "no copy of the bomb runs on: {r:?}");
    }
}

#[tokio::test]
async fn a_one_off_job_takes_its_tenants_sandbox_coming_back_rather_than_wait_for_a_start_which_goes_on_in_the_background() {
    if under_gvisor() {
        return; // one-off sandboxes are not reused under gVisor by default
    }
    let c = client().await;
    let t = tenant();
    // A memory limit no warm kernel has: every sandbox of this shape is started for it.
    let shaped = |code: &str| {
        let mut sub = python(&t, code);
        sub.memory_mb = Some(640);
        sub
    };
    let first = shaped("import time\ntime.sleep(0.2)\n'first'");
    c.submit(&first).await.expect("submit");
    let db = service_db().await;
    let running = eventually(JOB_WAIT, || async {
        let status: Option<String> = sqlx::query_scalar("SELECT status FROM jobs WHERE tenant = $1 AND job_id = $2")
            .bind(&t)
            .bind(&first.job_id)
            .fetch_optional(&db)
            .await
            .ok()
            .flatten();
        (status.as_deref() == Some("running")).then_some(())
    })
    .await;
    assert!(running.is_some(), "the first job never ran");
    let docker = bollard::Docker::connect_with_defaults().expect("docker").negotiate_version().await.expect("docker version");
    let tenant_label = format!("sandcell.tenant={t}");
    let tenants_containers = || containers_labelled(&tenant_label);
    // No sandbox of the tenant waits: the second job starts one, but the first job's comes
    // back (0.2 s) long before a start (about a second) is ready.
    let second = shaped("'second'");
    let r = run(&c, &second).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("'second'")), "{r:?}");
    let first_result = c.wait(&t, &first.job_id, JOB_WAIT).await.expect("first result");
    assert_eq!(first_result.status, JobStatus::Succeeded, "{first_result:?}");
    let first_container = container(&first).await;
    assert_eq!(container(&second).await, first_container, "the second job waited for a start");
    // The start went on without it, in the idle CPU class (no job waits for it: it must not
    // slow running ones), and is back at full weight once it waits for the tenant's next job.
    let started = eventually(JOB_WAIT, || async { tenants_containers().await.into_iter().find(|id| *id != first_container) }).await;
    let started = started.expect("the start that lost did not go on for the tenant");
    if host_has_cpu_idle_class() {
        // (Lowered within milliseconds of the container's start, which the listing may precede.)
        let idle = eventually(std::time::Duration::from_secs(10), || async { cpu_class(&started).filter(|c| c.idle) }).await;
        assert!(idle.is_some(), "the start no job waits for any more competes with running jobs for CPU: {:?}", cpu_class(&started));
        let full = CpuClass { idle: false, full_weight: true };
        let back = eventually(JOB_WAIT, || async { cpu_class(&started).filter(|c| *c == full) }).await;
        assert!(back.is_some(), "the started sandbox waits for the tenant's next job in the background: {:?}", cpu_class(&started));
    } else {
        eprintln!("this host has no idle CPU class (cpu.idle): the start's class is not checked");
    }
    // It is prepared for fresh jobs before it waits (the driver's `prepare`): its kernel forks
    // the first job's process ahead of that job, so the tenant does not wait for that.
    let kernels = || async {
        let top = docker.top_processes(&started, None::<bollard::query_parameters::TopOptions>).await.ok()?;
        Some(top.processes.unwrap_or_default().iter().filter(|p| p.iter().any(|a| a.contains("--kernel"))).count())
    };
    let prepared = eventually(JOB_WAIT, || async { kernels().await.filter(|n| *n == 2) }).await;
    assert!(prepared.is_some(), "no first job's process forked ahead of it: {:?} kernel processes", kernels().await);
    let both = HashSet::from([first_container, started]);
    let (third, fourth) = (shaped("import time\ntime.sleep(0.3)"), shaped("import time\ntime.sleep(0.3)"));
    let (r3, r4) = tokio::join!(run(&c, &third), run(&c, &fourth));
    assert_eq!((r3.status, r4.status), (JobStatus::Succeeded, JobStatus::Succeeded), "{r3:?} {r4:?}");
    // (Whether they ran at once depends on the worker's other jobs: both sandboxes, or one.)
    let used = HashSet::from([container(&third).await, container(&fourth).await]);
    assert!(used.is_subset(&both), "a third sandbox was started: {used:?} beyond {both:?}");
}

#[tokio::test]
async fn a_warm_sandbox_waits_in_the_idle_cpu_class_and_runs_its_first_job_at_full_weight() {
    if !host_has_cpu_idle_class() {
        eprintln!("this host has no idle CPU class (cpu.idle): nothing to check");
        return;
    }
    let warm = || containers_labelled("sandcell.pool=1");
    // A warm sandbox waits in the idle class: its start (the pool's refill) takes only CPU no
    // job wants. (Those the pool handed out keep its label, at full weight: some must be idle.)
    let idle = eventually(JOB_WAIT, || async { warm().await.into_iter().find(|id| cpu_class(id).is_some_and(|c| c.idle)) }).await;
    assert!(idle.is_some(), "no warm sandbox is in the idle class: {:?}", warm().await.iter().map(|id| cpu_class(id)).collect::<Vec<_>>());
    if under_gvisor() {
        return; // a one-off job's sandbox is gone after its job: nothing to look at
    }
    // A one-off job of the pool's shape takes one, at the class and weight every container
    // has, and its sandbox then waits for the tenant's next job so. (The other tests take warm
    // sandboxes too: a job that got a started one is tried again.)
    let c = client().await;
    let (r, id) = run_on_a_warm_sandbox(&c, "'taken'").await;
    assert_eq!(value(&r).as_deref(), Some("'taken'"), "{r:?}");
    let class = cpu_class(&id).expect("the job's container's cgroup");
    assert_eq!(class, CpuClass { idle: false, full_weight: true }, "the job's sandbox kept the background's class or weight");
}

/// Run `code` as a new tenant's one-off job until one takes a sandbox of the warm pool (the
/// other tests take them too; a job that got a started one is tried again), each try once the
/// pool holds a ready one (its refills wait for a lull in the worker's slots, which the other
/// tests' jobs may fill for a while). Returns the job's result and its container.
async fn run_on_a_warm_sandbox(c: &sandcell_client::Client, code: &str) -> (sandcell_protocol::JobResult, String) {
    let docker = bollard::Docker::connect_with_defaults().expect("docker").negotiate_version().await.expect("docker version");
    for _ in 0..10 {
        let ready = eventually(JOB_WAIT, || async { worker_metric("sandcell_warm_pool_size").await.filter(|n| *n >= 1.0) }).await;
        assert!(ready.is_some(), "the warm pool held no ready sandbox within {JOB_WAIT:?}");
        let job = python(&tenant(), code);
        let r = run(c, &job).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
        let id = container(&job).await;
        let labels =
            docker.inspect_container(&id, None::<bollard::query_parameters::InspectContainerOptions>).await.expect("inspect").config.and_then(|c| c.labels);
        if labels.is_some_and(|l| l.get("sandcell.pool").is_some_and(|v| v == "1")) {
            return (r, id);
        }
    }
    panic!("no job took a warm sandbox in ten tries");
}

#[tokio::test]
async fn a_one_off_job_that_takes_a_warm_sandbox_finds_it_prepared_for_forked_jobs_already() {
    if under_gvisor() {
        return; // one-off sandboxes are not reused under gVisor by default: the pool is not prepared
    }
    // The warm pool's kernels make their one-off preparation (immortal objects, huge pages) in
    // their start: the first job forked from one already finds the preloaded objects immortal,
    // where it used to run before that preparation (made after its job, in its tenant's burst).
    let c = client().await;
    let probe = "import sys, numpy\nmine = object()\n[sys.getrefcount(o) >= 2**32 - 1 for o in (numpy.add, mine)]";
    let (r, _) = run_on_a_warm_sandbox(&c, probe).await;
    assert_eq!(value(&r).as_deref(), Some("[True, False]"), "the warm sandbox's first job ran before its preparation: {r:?}");
}

#[tokio::test]
async fn a_tenants_next_one_off_job_waits_for_the_sandbox_settling_after_the_last_rather_than_take_another() {
    if under_gvisor() {
        return; // one-off sandboxes are not reused under gVisor by default
    }
    let c = client().await;
    let t = tenant();
    // 20,000 files in /tmp: cleaning up after this job takes a while, and its result does not
    // wait for that (the driver's `done` comes before its `settled`).
    let litter = python(&t, "for i in range(20000):\n    open('/tmp/litter-%d' % i, 'w').close()\n'littered'");
    let r = run(&c, &litter).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("'littered'")), "{r:?}");
    // Submitted as soon as the result is read, while the sandbox settles: it waits for that
    // sandbox (a warm one is at hand, but would be bound to the tenant for nothing).
    let next = python(&t, "import os\nsum(n.startswith('litter-') for n in os.listdir('/tmp'))");
    let r = run(&c, &next).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("0")), "{r:?}");
    assert_eq!(container(&next).await, container(&litter).await, "the next job took another sandbox than the one settling");
}

/// The sandbox that ran a first job of `tenant` and now waits, bound to it, for the tenant's
/// next one-off job: waiting, not settling (a sandbox that dies while it settles is never kept;
/// a settle takes milliseconds). The idle sandboxes' gauge would not tell when: this binary's
/// tests run at once.
async fn a_waiting_one_off_sandbox(c: &Client, tenant: &str) -> String {
    let first = python(tenant, "1 + 1");
    let r = run(c, &first).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let waiting = container(&first).await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    waiting
}

/// Whether `container` stops running (or is removed) within 30 s.
async fn stopped(container: &str) -> bool {
    eventually(std::time::Duration::from_secs(30), || async {
        (sh(&format!("docker inspect -f '{{{{.State.Running}}}}' {container} 2>/dev/null || true")).trim() != "true").then_some(())
    })
    .await
    .is_some()
}

/// The tenant's next one-off job succeeds, in another sandbox than `waiting` (which died).
async fn the_next_job_runs_in_another_sandbox(c: &Client, tenant: &str, waiting: &str) {
    let next = python(tenant, "2 + 2");
    let r = run(c, &next).await;
    assert_eq!((r.status, value(&r).as_deref()), (JobStatus::Succeeded, Some("4")), "{r:?}");
    assert_ne!(container(&next).await, waiting, "the job ran in another sandbox");
}

#[tokio::test]
async fn a_tenants_sandbox_killed_while_it_waits_is_not_handed_the_next_job() {
    if under_gvisor() {
        return; // no reuse there: no sandbox waits for the tenant
    }
    let c = client().await;
    let t = tenant();
    let waiting = a_waiting_one_off_sandbox(&c, &t).await;
    let lost = || worker_metric("sandcell_idle_sandboxes_lost_total{pool=\"oneoff\"}");
    let lost_before = lost().await.expect("the lost sandboxes' counter");
    // Gone while it waits for the tenant's next job (an operator, the host's OOM killer).
    sh(&format!("docker kill {waiting} >/dev/null"));
    assert!(stopped(&waiting).await, "the killed sandbox still runs");
    the_next_job_runs_in_another_sandbox(&c, &t, &waiting).await;
    // Found out, by the reaper's look or at the take (other tests of this binary kill none).
    assert!(lost().await.expect("the lost sandboxes' counter") > lost_before, "the dead sandbox was found out when the job came");
}

#[tokio::test]
async fn a_tenants_sandbox_whose_kernel_was_killed_while_it_waits_is_not_handed_the_next_job() {
    if under_gvisor() {
        return; // no reuse there: no sandbox waits for the tenant
    }
    let c = client().await;
    let t = tenant();
    let waiting = a_waiting_one_off_sandbox(&c, &t).await;
    // The host's OOM killer picks the largest process, the kernel that forks each job's
    // process; the driver and the container live on.
    kill_kernel_of(&waiting);
    // The driver ends when its kernel does, and the sandbox with it.
    assert!(stopped(&waiting).await, "the sandbox whose kernel was killed still runs");
    the_next_job_runs_in_another_sandbox(&c, &t, &waiting).await;
}
