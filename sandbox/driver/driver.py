"""sandcell in-container driver.

Runs inside the sandbox container as ``python3 -u /opt/sandcell/driver.py``
and executes jobs for the worker, which talks to it over the container's
attached stdin/stdout (no TTY).

Two processes
-------------
The driver is the only process that speaks to the worker.  It runs as root
(uid 0) holding only CAP_SETUID and CAP_SETGID, and never runs user code: it
starts a *kernel* (sandcell_kernel.py: IPython, bash) as the sandbox user
(uid/gid 1000, no capabilities, no supplementary groups) and talks to it over
a pair of pipes, the way a Jupyter client talks to its kernel.  Code in the
kernel can neither ptrace the driver, read its memory or fds through /proc,
nor signal it (another uid), and it holds no fd of the worker's stream.  Its
output reaches the driver through pipes and is framed by the driver (so it is
always a stream frame of the running request); its rich outputs and errors
are frames the driver checks field by field and re-stamps with the request's
id.  The driver itself decides when a request ends, which files it produced
(reading them with the sandbox user's rights, never following a symlink)
and which processes it left running (all killed, except the kernel).
Started as any other uid (outside a container, in tests), the driver runs
the kernel under its own uid and says so in ready ("kernel_isolated": false).
When the kernel exits (exit() does not: it only ends a cell), the driver
exits with status 1 after the frames already produced; when a fresh job's
process ends before its cell does, the driver exits with that process's
status (128+N for signal N); when the kernel dies between requests (killed
from outside, while the sandbox waits), the driver exits at once, with the
kernel's status (128+N for signal N), without waiting for a request.

Framing (both directions)
-------------------------
Every message is a frame: a 4-byte unsigned big-endian length N followed by
N bytes of UTF-8 JSON encoding one object with a "type" field.  Requests are
read from stdin; responses are written to the *protocol channel*, a private
duplicate of the original stdout.  Nothing but frames is ever written to the
protocol channel: fds 1 and 2 are redirected into pipes at start-up so that
all user output (Python, C code, subprocesses) is captured and re-framed.
Driver diagnostics go to a private duplicate of the original stderr.

Driver -> worker
----------------
ready           {"driver_version": 6, "python": "3.13.5", "ipython": "8.35.0",
                 "preloaded": [module names], "startup_ms": float,
                 "kernel_isolated": bool}
                sent once, before the first request is read.  preloaded:
                the SANDCELL_PRELOAD modules that imported (see below);
                startup_ms: ms from the driver module's start (the
                interpreter's own start-up not included) to ready.
stream          {"id", "name": "stdout"|"stderr", "text"}
                captured output, in order per stream; UTF-8 decoded with
                errors="replace"; capped per request by stdout_limit /
                stderr_limit (bytes), excess is dropped.
execute_result  {"id", "execution_count", "data": {mime: value}}
                value of a python cell's last expression.
display_data    {"id", "data": {mime: value}}
                IPython.display.display(...) calls and matplotlib figures
                still open at the end of a cell.
                Kept mime types: text/plain, text/html, text/markdown,
                image/png (base64 string), image/svg+xml, application/json
                (a JSON value, not a string).  A text value longer than
                4 MiB is cut (with a marker); a longer PNG or JSON value is
                dropped; a frame over 24 MiB encoded becomes a text/plain note.
error           {"id", "ename", "evalue", "traceback": [lines]}
                an exception raised by a python cell (plain text, no ANSI);
                evalue cut at 64 KiB, the traceback at 1 MiB in all.
file_error      {"id", "path", "message"}   an input file was refused.
file            {"id", "path", "size"[, "requested": true]}
                a regular file under the workspace that is new or changed,
                or (with "requested": true) an unchanged one named in
                get_files.  Its bytes follow at once, in order, as
                ceil(size / 1 MiB) file_data frames.  A get_files path that is also new/changed is
                sent once, as a changed file (no "requested").
file_data       {"id", "content_b64"}
                the next chunk (at most 1 MiB) of the file announced last.
file_skipped    {"id", "path", "reason"}
                a new/changed entry or a get_files path not sent; reason
                is one of "not_regular_file" (also: a symlink, or a path
                through a symlink or non-directory), "too_large",
                "limit_reached", "unreadable", "invalid_name" (the name is
                not UTF-8; path shows it with U+FFFD); for get_files paths also
                "not_found" and "invalid_path" (fails the input-file path
                rules).
file_list       {"id", "entries": [{"path", "size", "mtime"}], "truncated"}
                sent when the request has list_files: true.  The regular
                files under the workspace after the code ran, sorted by
                path (code point order), without the skipped tool/cache
                dirs; symlinks are neither listed nor followed.  mtime:
                seconds since the epoch, rounded to ms.  At most 1000
                entries; truncated: more files exist.
stats           {"id", "rss_kb": int, "children": int}
                answer to a stats request: the kernel's VmRSS, and how many
                live (non-zombie) processes the container has besides the
                driver, its kernel and PID 1.
done            {"id", "status": "ok"|"error"|"input_error",
                 "exit_code": int|null, "stdout_truncated", "stderr_truncated",
                 "execution_count", "duration_ms", "processes_killed",
                 "workspace_full"}
                the last frame of a request's result (of a fresh request,
                settled follows).  exit_code: python 0/1; bash
                the exit status (128+N if killed by signal N); null for
                input_error.  execution_count: the cell's IPython number
                (for bash/input_error: the last python cell's, 0 if none).
                duration_ms: time spent running the code.
                processes_killed: processes the code left running (a
                background sleep, a daemonized child) that were killed
                when it ended: after a request, only the driver, its kernel
                and PID 1 are alive.  workspace_full: the workspace or /tmp had less
                than 1% (at least 64 KiB) free after the code ran, or the
                code's exception was ENOSPC.
settled         {"id", "reusable": bool}
                after the done of a fresh request, its last frame: the job's
                process has exited and the driver cleaned up after it
                (sent apart so that the job's result waits for neither).
                reusable: the workspace, /tmp and /dev/shm were emptied, the
                job's IPC objects removed, no process of it is left and the
                kernel lives and is as it was -- the sandbox may take its
                tenant's next job.  The next request is read only after it.
prepared        {"id", "ready": bool}
                answer to prepare: the kernel made its one-off preparation
                and forked the first fresh request's process; ready: it
                answered as it was when it became ready (else the sandbox
                must not be used).
protocol_error  {"message"[, "id"]}
                a malformed/unknown request or a driver bug.  When it
                carries the id of a request, it ends that request instead
                of "done" (no further frames for that id).

Worker -> driver
----------------
execute         {"id", "language": "python"|"bash", "code",
                 "files": [{"path", "content_b64"}],
                 "timeout_ms", "stdout_limit", "stderr_limit",
                 "max_file_bytes", "max_artifact_files", "max_artifact_bytes",
                 "get_files": [path], "list_files": bool, "fresh": bool,
                 "env": {name: value}, "context": name}
                "id" is opaque and echoed as "id" on every frame of the
                request.  Only id/language/code are required.
                fresh (a one-off job in a sandbox reused for its tenant):
                the code runs in a process forked for it from the kernel,
                which has never run user code, and after the request the
                workspace and /tmp are emptied -- nothing of the job is
                left for the next (its processes are killed as after every
                request).  Otherwise the code runs in the kernel itself and
                its state persists (a session).
                get_files: at most 64 workspace-relative paths to send
                after the code ran even if unchanged, in this order, after
                the new/changed files and under the same limits (a repeated
                path is sent once).  list_files: send a file_list.  Neither
                is done for an input_error.
                env: variables the cell's code sees (python: os.environ
                during the cell, restored after it; bash: the script's
                environment).  context (python, not fresh): the namespace
                the cell runs in -- its own variables and execution count,
                made on first use; absent: the kernel's default namespace.
prepare         {"id"}
                before the first fresh request, of a kernel that ran no
                cell itself: it prepares for fresh requests now (see
                prepared) rather than after the first one's settle.
                Refused (protocol_error) once the kernel ran a cell.
stats           {"id"}
                answered with one stats frame (no done).  Like any request
                it is read only once the previous one is finished.

Frames of one execute request are either
    file_error+, done(status "input_error")        (code not run), or
    (stream | execute_result | display_data | error)*  in the order produced,
    (file | file_skipped)*  (changed files sorted by path, then get_files),
    file_list?,  done,
followed, for a fresh request, by settled.
Requests are handled one at a time; python state persists between them
unless they are fresh.
EOF on its channel (stdin, or the socket) makes the driver exit with status 0.  SIGINT interrupts a
running cell (python: KeyboardInterrupt; bash: SIGINT to its process group,
SIGKILL after 2 s) and is ignored between cells.

Environment
-----------
SANDCELL_WORKSPACE  the workspace directory (default /home/user).
SANDCELL_PRELOAD    comma-separated module names (e.g.
                    "numpy,pandas,matplotlib.pyplot") imported before ready,
                    into sys.modules only: no name is bound in the user
                    namespace.  A failed import is logged to diagnostics and
                    left out of "preloaded".  If matplotlib got imported, a
                    throwaway figure is rendered (outside pyplot) so a cell's
                    first figure costs no more than later ones.
SANDCELL_PREPARE_BUDGET_MS  longest the kernel's one-off preparation for forked
                    jobs may take (default 3000; see sandcell_kernel.py
                    PREPARE_BUDGET_MS): what is not done by then is left undone.
                    Wall-clock ms before the first standby; the kernel's CPU ms
                    when made at start.
SANDCELL_PREPARE_AT_START  "1": the kernel makes that preparation before ready
                    instead of before its first standby (the worker sets it for
                    its warm pool's sandboxes).
SANDCELL_CHANNEL    a Unix socket the worker listens on (worker/src/sandbox/
                    channel.rs): the driver connects to it before the kernel
                    exists and speaks the protocol there instead of on its
                    stdin/stdout (fewer hops than Docker's attach stream).
                    If it cannot connect (e.g. under gVisor) it logs why and
                    uses stdin/stdout, which the worker also listens to.
"""
import contextlib
import errno
import json
import os
import platform
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time

# Start of the driver script, for "startup_ms" in the ready frame.
STARTED_AT = time.monotonic()

from sandcell_capture import Capture  # noqa: E402
from sandcell_frames import (DRIVER_VERSION, MAX_KERNEL_FRAME_BYTES, MAX_REQUEST_BYTES,  # noqa: E402
                             Channel, FrameTooLarge, cap_error, cap_text, clean_mime_bundle, frame_bytes,
                             safe_str, write_all)
from sandcell_workspace import (collect_files, decode_input_files, describe_write_error,  # noqa: E402
                                empty_dir, file_listing, kept_directory_state, refresh, restore_directory, snapshot,
                                space_exhausted, write_input_file, InputFileError, WorkspaceWatch)

WORKSPACE = os.environ.get("SANDCELL_WORKSPACE", "/home/user")
# The sandbox user: the kernel and everything it starts run as this uid/gid.
SANDBOX_UID = 1000
SANDBOX_GID = 1000

DEFAULT_LIMITS = {
    "stdout_limit": 1048576,
    "stderr_limit": 1048576,
    "max_file_bytes": 52428800,
    "max_artifact_files": 100,
    "max_artifact_bytes": 104857600,
}
# An execute request's env: how many variables, and their names.
MAX_ENV_VARS = 64
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
# A context's name.
CONTEXT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# Most entries in an execute request's get_files.
MAX_GET_FILES = 64
# How often the driver checks that its kernel is alive while it waits for it.
KERNEL_POLL_S = 0.5
# Longest diagnostic the driver logs for its kernel.
MAX_KERNEL_LOG_BYTES = 4096


# --------------------------------------------------------------------------
# Rights: the driver is root; what it does in the workspace it does as the
# sandbox user.
# --------------------------------------------------------------------------


ISOLATED = os.geteuid() == 0


@contextlib.contextmanager
def sandbox_user():
    """Run the block with the sandbox user's effective uid/gid (the real and
    saved ids stay root's, so the code can still neither signal nor trace
    the driver, and the driver can switch back).  A no-op when the driver is
    not root, and inside another such block (the outer one switches back at
    its end).  Only the calling thread changes (see set_effective_ids)."""
    if not ISOLATED or os.geteuid() != 0:
        yield
        return
    try:
        set_effective_ids(SANDBOX_UID, SANDBOX_GID)
        yield
    finally:
        set_effective_ids(0, 0)  # also after a switch that failed half-way


# setresuid/setresgid by architecture, for the raw system calls (see set_effective_ids).
SETRES_SYSCALLS = {"x86_64": (117, 119), "aarch64": (147, 149)}


def set_effective_ids(uid, gid):
    """Set the calling thread's effective uid and gid (gid first going to the
    sandbox user, uid first coming back).  Linux keeps credentials per thread;
    glibc's seteuid/setegid make every thread of the process follow, by
    signalling each one and waiting for it, which cost the driver about a
    quarter of a millisecond per request.  Only the main thread does work as
    the sandbox user; the pump threads only move bytes between pipes they hold
    open, so they may stay root.  Falls back to os.setegid/os.seteuid where the
    call numbers are not known."""
    numbers = SETRES_SYSCALLS.get(platform.machine())
    libc = _libc() if numbers is not None else None
    if libc is None:
        if uid == 0:
            os.seteuid(uid)
            os.setegid(gid)
        else:
            os.setegid(gid)
            os.seteuid(uid)
        return
    import ctypes

    setresuid, setresgid = numbers
    calls = ((setresuid, uid), (setresgid, gid)) if uid == 0 else ((setresgid, gid), (setresuid, uid))
    unchanged = ctypes.c_long(-1)
    for number, value in calls:
        if libc.syscall(ctypes.c_long(number), unchanged, ctypes.c_long(value), unchanged) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "setting the effective id to %d: %s" % (value, os.strerror(err)))


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


# Memory the sandbox must have free for the next job's process to be forked while the last job's
# is still being torn down (the fork's page tables and the pages its warm-up copies: some 8 MiB
# with numpy, pandas and matplotlib preloaded), with a margin; with less, the fork waits.
STANDBY_HEADROOM = 64 << 20
# How long the first standby's ping may take (the zygote's one-off preparation comes first, and
# stops at its budget, SANDCELL_PREPARE_BUDGET_MS, 3 s by default); the worker waits 10 s for a
# settle in all (worker/src/run.rs SETTLE_WITHIN).
FIRST_STANDBY_S = 8.0

# The task flag of a thread that has begun to exit (include/linux/sched.h): it runs no code of
# its own again, not even the rest of a system call.
PF_EXITING = 0x4


def other_processes(spared=(), children_of=None, exiting=False):
    """PIDs of the live processes in the container other than the driver,
    PID 1 (tini), `spared` and the children of `children_of`.  Alive means
    able to run code: a zombie is not -- unless it has threads (a process
    whose main thread left with the exit system call, not exit_group, runs
    on in its other threads while /proc/<pid>/stat says Z; red-teamed: such
    a process outlived its job and read the next one's files and requests;
    a SIGKILL to the pid ends them all) --, nor is a process every thread
    of which has begun to exit (killed: its memory may still be being torn
    down), unless `exiting` (then only processes fully gone are not)."""
    skip = {1, os.getpid(), *spared}
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        parent, state = _process_state(name)
        if state == "gone" or (parent is not None and parent == children_of):
            continue
        if state == "alive" or exiting:
            pids.append(int(name))
    return pids


def exiting_processes():
    """PIDs of the processes that have begun to exit and are not gone yet (their memory
    may still be being torn down, their files not yet closed)."""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and _process_state(name)[1] == "exiting"]


def _stat_fields(path):
    """The fields of a /proc stat file after the process's name: read as bytes (a name may
    hold any byte but NUL: decoded as text, "\\xff" failed and hid the process from every
    scan). None once it is gone; raises ValueError when it is there but unreadable (callers
    count such a process as alive)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise ValueError("%s: %r" % (path, exc))
    if not data:
        return None  # gone between the open and the read
    fields = data.rsplit(b")", 1)[-1].split()
    if len(fields) < 18:
        raise ValueError("%s: %d fields" % (path, len(fields)))
    return fields


def _process_state(pid):
    """(parent, "alive" | "exiting" | "gone") of process `pid` (a /proc entry's name), from
    /proc; (None, "gone") once it has left /proc.  Fails closed: what cannot be read of a
    process that is there is alive."""
    try:
        fields = _stat_fields("/proc/%s/stat" % pid)
        if fields is None:
            return None, "gone"
        state, parent, flags, threads = fields[0], int(fields[1]), int(fields[6]), int(fields[17])
    except ValueError:
        return None, "alive"
    if state in (b"Z", b"X") and threads <= 1:
        return parent, "gone"  # but for its exit status: its files are closed
    if flags & PF_EXITING and not _threads_running(pid):
        return parent, "exiting"
    return parent, "alive"


def _threads_running(pid):
    """Whether a thread of process `pid` has not begun to exit.  Fails closed: a thread that
    cannot be read, or a list of threads that changed while they were read (a thread that
    cloned another and exited meanwhile), counts as running."""
    tids = _thread_ids(pid)
    if tids is None:
        return True
    if not tids:
        return False  # gone
    for tid in tids:
        try:
            fields = _stat_fields("/proc/%s/task/%s/stat" % (pid, tid))
        except ValueError:
            return True
        if fields is not None and not int(fields[6]) & PF_EXITING:
            return True
    again = _thread_ids(pid)
    return again is None or (again != tids and again != [])  # [] again: gone meanwhile


def _thread_ids(pid):
    """The sorted thread ids of process `pid`: [] once it is gone, None when they cannot be read."""
    try:
        return sorted(os.listdir("/proc/%s/task" % pid))
    except FileNotFoundError:
        return []
    except OSError:
        return None


def _state(pid):
    """The state letter of process `pid` (b"T": stopped), None once it is gone."""
    try:
        fields = _stat_fields("/proc/%s/stat" % pid)
    except ValueError:
        return None
    return None if fields is None else fields[0]


def memory_headroom():
    """Bytes the sandbox's memory cgroup may still charge (cgroup v2 or v1, as the container
    sees its own), or None where neither can be read (gVisor)."""
    for usage_file, limit_file in (("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.max"),
                                   ("/sys/fs/cgroup/memory/memory.usage_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            with open(usage_file) as f:
                usage = int(f.read())
            with open(limit_file) as f:
                limit = f.read().strip()
        except (OSError, ValueError):
            continue
        return 1 << 62 if limit == "max" else int(limit) - usage
    return None


def wait_until(done, timeout_s, interval_s=0.0005):
    """Poll `done()` every `interval_s` until it is true or `timeout_s` has
    passed; returns whether it came true.  For what no fd can signal (a
    process's state in /proc); the driver's other waits select on a pipe."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def kill_strays(existing, rounds=100, children_of=None, exiting=False):
    """Kill every process a cell left behind; returns how many were killed.
    `existing`: the processes alive before the cell (the kernel; in the
    driver's tests also other drivers' processes), which are spared, as are
    the children of `children_of`.  Repeats while processes keep appearing
    (a fork bomb forks between the scan and the kill), up to `rounds` scans;
    with `exiting`, also until those killed are gone (a SIGKILL more to a
    dying process is harmless, and one wrongly seen as dying is not spared).
    Signals are sent as the sandbox user: the driver needs no CAP_KILL, and
    can kill nothing the code could not."""
    killed = set()
    with sandbox_user():
        for _ in range(rounds):
            pids = other_processes(existing, children_of, exiting=exiting)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.002)
    return len(killed)


def children_of(pid):
    """The live processes whose parent is `pid`."""
    return [p for p in other_processes() if _parent(p) == pid]


def _parent(pid):
    try:
        fields = _stat_fields("/proc/%d/stat" % pid)
        return None if fields is None else int(fields[1])
    except ValueError:
        return None


def remove_sysv_ipc():
    """Remove the System V shared memory segments, message queues and
    semaphore sets of the container's IPC namespace (a job's are the sandbox
    user's; call as the sandbox user).  Returns whether none is left."""
    libc = _libc()
    if libc is None:
        return False
    ipc_rmid, ipc_private = 0, 0
    kinds = {
        "shm": (lambda i: libc.shmctl(i, ipc_rmid, None), lambda: libc.shmget(ipc_private, 1, 0o600)),
        "msg": (lambda i: libc.msgctl(i, ipc_rmid, None), lambda: libc.msgget(ipc_private, 0o600)),
        "sem": (lambda i: libc.semctl(i, 0, ipc_rmid), lambda: libc.semget(ipc_private, 1, 0o600)),
    }
    clean = True
    for kind, (remove, probe) in kinds.items():
        ids = sysv_ipc_ids(kind)
        if ids is None:
            # No /proc/sysvipc (gVisor): ids there are handed out in
            # increasing order, so a new object's id bounds every live one.
            newest = probe()
            if newest < 0 or newest > MAX_PROBED_IPC_ID:
                clean = False
            ids = range(max(newest, -1) + 1) if 0 <= newest <= MAX_PROBED_IPC_ID else [newest]
            for ipc_id in ids:
                remove(ipc_id)
            continue
        for ipc_id in ids:
            remove(ipc_id)
        clean = clean and not sysv_ipc_ids(kind)
    return clean


# Above this id, the namespace is not swept id by id (the sandbox is not reused).
MAX_PROBED_IPC_ID = 65536


def sysv_ipc_ids(kind):
    """The ids in /proc/sysvipc/<kind>, or None when it cannot be read."""
    try:
        with open("/proc/sysvipc/%s" % kind) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    ids = []
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1].isdigit():
            ids.append(int(fields[1]))
    return ids


_LIBC = []


def _libc():
    if not _LIBC:
        try:
            import ctypes

            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def vm_rss_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


# --------------------------------------------------------------------------
# The kernel, seen from the driver
# --------------------------------------------------------------------------


class KernelGone(Exception):
    """The kernel exited, or broke the framing (`broken`) and was ended."""

    def __init__(self, message, broken=False, exit_status=1):
        super().__init__(message)
        self.broken = broken
        # The driver's own exit status when this ends it.
        self.exit_status = exit_status


def exit_status_as(status):
    """The driver's exit status for a process of the kernel that ended with `status` (as
    subprocess and the kernel report it: -N for signal N): the same, as a shell says it
    (128+N), so the worker reads from the container what it would from that process."""
    return min(128 - status if status is not None and status < 0 else (status or 1), 255)


class KernelProcess:
    """The kernel child: started as the sandbox user, spoken to over two
    pipes; its fds 1/2 are the capture pipes."""

    def __init__(self, capture, log):
        self.log = log
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        # The control pipe: the requests whose answers vouch for a fresh job's cleanup (purge,
        # ping) go down a pipe no process of a job holds (the kernel closes it in every process
        # it forks). A job's process holds the request pipe: a process it left read a purge
        # from there and answered it itself, the kill never came, and a cloning loop of the job
        # saw the next one (red-teamed; test_fresh).
        ctl_r, self.control_w = os.pipe()
        env = dict(os.environ)
        env["HOME"] = WORKSPACE
        rights = {}
        if ISOLATED:
            rights = {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), "--kernel", str(req_r), str(rep_w), str(ctl_r)],
            stdin=subprocess.DEVNULL, stdout=capture.kernel_fds["stdout"], stderr=capture.kernel_fds["stderr"],
            pass_fds=(req_r, rep_w, ctl_r), env=env, cwd="/", **rights)
        os.close(req_r)
        os.close(rep_w)
        os.close(ctl_r)
        capture.kernel_started()
        self.pid = self.proc.pid
        self.channel = Channel(rep_r, req_w, None, max_in=MAX_KERNEL_FRAME_BYTES, discard_oversize=False)
        self.channel.log = log
        # Readable once the kernel has exited: how the driver learns of it between requests
        # without polling (None where the runtime has no pidfd_open: it polls then).
        try:
            self.exit_fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError) as exc:
            self.exit_fd = None
            log("no pidfd for the kernel (%r): its exit is polled for between requests" % (exc,))

    def send(self, frame):
        try:
            self.channel.send(frame)
        except OSError as exc:
            raise KernelGone("the kernel stopped reading: %r" % (exc,))

    def ping(self, timeout_s=2.0, standby=False):
        """Ask the kernel for a pong with a fresh nonce, dropping whatever is
        in the pipe before it.  Returns the settings the pong reports (the
        kernel's own resource limits, priority, scheduling policy and CPU
        affinity, read in-process), or None when it does not answer in time
        or the pipe's framing is broken (the kernel is then ended).
        standby: the kernel first forks the process for the next fresh run
        (it exists once the pong is read, so the next request counts it as
        there before it)."""
        pong = self.answer({"type": "ping", "standby": standby}, "pong", timeout_s)
        return None if pong is None else pong.get("settings")

    def purge(self, timeout_s=5.0):
        """After a fresh run (its process gone): have the kernel end every other
        process of its uid at once (kill(-1, SIGKILL): no process forks past
        it, so none can slip by as from a scan of /proc: a job's processes
        that fork and exit in a loop did) and reap its children.  Returns
        whether it said so in time; frames before its answer are dropped.
        Asked only now, not with the run: a job's process can read the
        kernel's requests (and would forge the answer), and what the purge
        ends would go uncounted in the job's processes_killed."""
        return self.answer({"type": "purge"}, "purged", timeout_s) is not None

    def answer(self, request, answer, timeout_s):
        """Send `request` with a fresh nonce and return the kernel's `answer`
        frame carrying it, dropping whatever is in the pipe before it; None
        when it does not come in time or the pipe's framing is broken (the
        kernel is then ended)."""
        nonce = secrets.token_hex(16)
        try:
            try:
                write_all(self.control_w, frame_bytes(dict(request, nonce=nonce)))
            except OSError as exc:
                raise KernelGone("the kernel stopped reading its control pipe: %r" % (exc,))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self.channel.in_fd], [], [], remaining)[0]:
                    self.log("the kernel did not answer a %s within %ss" % (request["type"], timeout_s))
                    return None
                frame = self.recv()
                if frame["type"] == answer and frame.get("nonce") == nonce:
                    return frame
                if frame["type"] == "log":
                    self.log("kernel: %s" % cap_text(safe_str(frame.get("message")), MAX_KERNEL_LOG_BYTES))
                elif frame["type"] == "child_exit":
                    pass  # a fresh run's process that exited before the purge came: expected
                else:
                    self.log("dropped a kernel %s frame before its %s" % (cap_text(frame["type"], 64), answer))
        except KernelGone as exc:
            self.log(safe_str(exc))
            return None

    def recv(self, watch=None):
        """The next frame: a dict with a string "type".  Raises KernelGone
        when the kernel has exited, or broke the framing (a frame too large,
        not JSON, not an object): the kernel is then killed, since nothing it
        sends later could be trusted to start at a frame boundary.  While it
        waits, the events of `watch` (a WorkspaceWatch) are read as they come."""
        while True:
            watch_fd = watch.fileno() if watch is not None else None
            fds = [self.channel.in_fd] if watch_fd is None else [self.channel.in_fd, watch_fd]
            readable, _, _ = select.select(fds, [], [], KERNEL_POLL_S)
            if self.channel.in_fd in readable:
                break
            if readable:
                watch.absorb()
            # Still waiting; the kernel may have exited while a child of it
            # holds the pipe open.
            if self.proc.poll() is not None:
                raise KernelGone("the kernel exited with status %s" % self.proc.returncode)
        try:
            payload = self.channel.recv()
        except FrameTooLarge as exc:
            self.broken("sent a %s" % exc)
        if payload is None:
            self.proc.wait()
            raise KernelGone("the kernel exited with status %s" % self.proc.returncode)
        try:
            frame = json.loads(payload)
        except ValueError:
            self.broken("sent a frame that is not JSON (%d bytes)" % len(payload))
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            self.broken("sent a frame without a type")
        return frame

    def broken(self, what):
        try:
            self.proc.kill()
        except OSError:
            pass
        raise KernelGone("the kernel %s: it was ended" % what, broken=True)

    def interrupt(self):
        # As the sandbox user (the driver has no CAP_KILL). Called from the SIGINT handler, so
        # possibly inside a sandbox_user() block of the main thread: this one is then a no-op.
        try:
            with sandbox_user():
                os.kill(self.pid, signal.SIGINT)
        except (ProcessLookupError, PermissionError) as exc:
            self.log("cannot interrupt the kernel: %r" % (exc,))


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def checked_output(frame):
    """A kernel's rich output or error, rebuilt from the fields it may have;
    None for anything else."""
    kind = frame["type"]
    if kind == "execute_result":
        return {"type": kind, "execution_count": _int(frame.get("execution_count")) or 0,
                "data": clean_mime_bundle(frame.get("data"))}
    if kind == "display_data":
        return {"type": kind, "data": clean_mime_bundle(frame.get("data"))}
    if kind == "error":
        ename = frame.get("ename")
        return cap_error({"type": kind, "ename": cap_text(ename if isinstance(ename, str) else "Error", 1024),
                          "evalue": frame.get("evalue", ""), "traceback": frame.get("traceback", [])})
    return None


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


class RequestError(Exception):
    pass


def _int_field(obj, name, default):
    value = obj.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("%s must be a non-negative integer" % name)
    return value


def parse_execute(obj):
    req_id = obj.get("id")
    if not isinstance(req_id, str):
        raise RequestError("execute: id must be a string")
    if obj.get("language") not in ("python", "bash"):
        raise RequestError("execute: language must be 'python' or 'bash'")
    if not isinstance(obj.get("code"), str):
        raise RequestError("execute: code must be a string")
    files = obj.get("files") or []
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise RequestError("execute: files must be a list of objects")
    get_files = obj.get("get_files")
    if get_files is None:
        get_files = []
    if not isinstance(get_files, list) or not all(isinstance(p, str) for p in get_files):
        raise RequestError("execute: get_files must be a list of strings")
    if len(get_files) > MAX_GET_FILES:
        raise RequestError("execute: get_files has %d entries; at most %d are allowed"
                           % (len(get_files), MAX_GET_FILES))
    list_files = obj.get("list_files")
    if list_files is None:
        list_files = False
    if not isinstance(list_files, bool):
        raise RequestError("execute: list_files must be a boolean")
    fresh = obj.get("fresh")
    if fresh is None:
        fresh = False
    if not isinstance(fresh, bool):
        raise RequestError("execute: fresh must be a boolean")
    env = obj.get("env")
    if env is None:
        env = {}
    if not isinstance(env, dict) or len(env) > MAX_ENV_VARS or not all(
            isinstance(k, str) and ENV_NAME.fullmatch(k) and isinstance(v, str) and "\0" not in v
            for k, v in env.items()):
        raise RequestError("execute: env must be at most %d variables named [A-Za-z_][A-Za-z0-9_]*, "
                           "with string values without NUL" % MAX_ENV_VARS)
    context = obj.get("context")
    if context is not None and (not isinstance(context, str) or not CONTEXT_NAME.fullmatch(context)
                                or obj["language"] != "python" or fresh):
        raise RequestError("execute: context must be 1-64 characters of [A-Za-z0-9_-], "
                           "for python code that is not fresh")
    limits = {name: _int_field(obj, name, default) for name, default in DEFAULT_LIMITS.items()}
    return {"id": req_id, "language": obj["language"], "code": obj["code"],
            "files": files, "limits": limits, "get_files": get_files, "list_files": list_files,
            "fresh": fresh, "env": env, "context": context}


class Driver:
    def __init__(self, channel, capture, kernel, prepared=False):
        self.channel = channel
        self.capture = capture
        self.kernel = kernel
        # The request the kernel is running (SIGINT is forwarded only then).
        self.running = None
        self.execution_count = 0
        self._runs = 0
        # Whether the kernel made its one-off preparation for forked jobs: in its start (a warm
        # kernel's, said in its ready), or with the first standby it was asked to fork (settle,
        # prepare), whose ping waits longer for it.
        self.kernel_prepared = prepared
        # Whether the kernel ran a cell itself (a session's): such a kernel never forks jobs.
        self.kernel_ran_cells = False
        # The workspace as the last session cell left it (workspace_before), and what follows
        # it between a session's cells.
        self.last_walk = None
        self.watch = WorkspaceWatch(WORKSPACE)
        # The directories a job can write that outlive it (emptied after a fresh job, never
        # removed: mount points), as they were before any job: see leave_nothing_behind.
        self.kept_directories = {}
        with sandbox_user():
            for path in (WORKSPACE, "/tmp"):
                try:
                    self.kept_directories[path] = kept_directory_state(path)
                except OSError as exc:
                    self.kept_directories[path] = None  # never reusable: it cannot be checked
                    self.channel.log("cannot read the state of %s: %r" % (path, exc))

    # -- frames ------------------------------------------------------------

    def send(self, req_id, frame):
        # "type" first, then "id", for readable transcripts.
        out = {"type": frame["type"], "id": req_id}
        out.update(frame)
        self.channel.send(out)

    def protocol_error(self, message, req_id=None):
        frame = {"type": "protocol_error", "message": message}
        if req_id is not None:
            frame["id"] = req_id
        try:
            self.channel.send(frame)
        except Exception as exc:
            self.channel.log("cannot report protocol error %r: %r" % (message, exc))

    # -- signals -----------------------------------------------------------

    def on_sigint(self, signum, frame):
        # Only a running cell is interrupted; between cells SIGINT is ignored.
        if self.running is not None:
            self.kernel.interrupt()

    # -- loop --------------------------------------------------------------

    def await_request(self):
        """Wait until the worker sends something.  A kernel that dies meanwhile (killed from
        outside the sandbox: the host's OOM killer, an operator) ends the driver at once, so
        the worker finds the sandbox gone while it waits idle, in its warm pool or bound to a
        tenant, instead of handing it a job that would fail for a reason not the job's."""
        exit_fd = self.kernel.exit_fd
        poll_s = None if exit_fd is not None else KERNEL_POLL_S
        while True:
            # A session's workspace watch too: what the kernel's threads do between cells is
            # read as it comes (WorkspaceWatch.absorb).
            watched = [self.channel.in_fd] + [fd for fd in (exit_fd, self.watch.fileno()) if fd is not None]
            readable = select.select(watched, [], [], poll_s)[0]
            if self.channel.in_fd in readable:
                return
            if self.watch.fileno() in readable:
                self.watch.absorb()
                if exit_fd not in readable:
                    continue
            # The pidfd is readable once the kernel has exited: it is reaped at once.
            status = self.kernel.proc.wait() if exit_fd in readable else self.kernel.proc.poll()
            if status is not None:
                raise KernelGone("the kernel exited with status %s while the sandbox waited for a job" % status,
                                 exit_status=exit_status_as(status))

    def serve(self):
        while True:
            self.await_request()
            try:
                payload = self.channel.recv()
            except ValueError as exc:
                self.protocol_error(str(exc))
                continue
            if payload is None:
                return
            req_id = None
            try:
                obj = json.loads(payload)
                if not isinstance(obj, dict):
                    raise RequestError("request must be a JSON object")
                if isinstance(obj.get("id"), str):
                    req_id = obj["id"]
                kind = obj.get("type")
                if kind == "execute":
                    self.execute(parse_execute(obj))
                elif kind == "prepare":
                    self.prepare(req_id)
                elif kind == "stats":
                    if req_id is None:
                        raise RequestError("stats: id must be a string")
                    self.send(req_id, {"type": "stats", "rss_kb": vm_rss_kb(self.kernel.pid),
                                       "children": len(other_processes({self.kernel.pid}))})
                else:
                    raise RequestError("unknown request type %r" % (kind,))
            except (RequestError, ValueError) as exc:
                self.protocol_error(safe_str(exc), req_id)
            except KernelGone:
                raise
            except Exception as exc:
                self.channel.log("internal error: %r" % (exc,))
                self.protocol_error("internal driver error: %r" % (exc,), req_id)

    # -- one request -------------------------------------------------------

    def execute(self, req):
        req_id, limits = req["id"], req["limits"]
        if req["fresh"] and not self.await_torn_down():
            # The sandbox is not fit for another job (the worker destroys it).
            self.protocol_error("the last job's processes are not gone, or stopped the kernel", req_id)
            return
        with sandbox_user():
            if not os.path.isdir(WORKSPACE):  # as makedirs(exist_ok=True) would, without its exception
                os.makedirs(WORKSPACE, exist_ok=True)
            ok = self.write_inputs(req_id, req["files"])
            before = self.workspace_before(req) if ok else None
        # Dying ones too (what an earlier cell left may still be exiting): only what this
        # request starts is killed and counted after it.
        existing = set(other_processes(exiting=True))
        existing.add(self.kernel.pid)
        # A fresh job runs in a child of the kernel: the standby forked before the request
        # (among `existing`), or one forked for it.  Once it has exited, nothing of the
        # job may be spared any more (see settle).
        spared_after = existing - set(children_of(self.kernel.pid)) if req["fresh"] else existing
        if req["fresh"]:
            # The count of a process forked for this job, whose interpreter ran no cell yet (a
            # bash job, or an input error, reports it): never the last fresh job's.
            self.execution_count = 0
        if not ok:
            self.last_walk = None  # some of the inputs may be written: the next cell walks anew
            self.send(req_id, self.done_frame("input_error", None, (False, False), 0.0, 0, False))
            if req["fresh"]:
                # No code ran: the process forked for the next job is spared, still unused.
                self.settle(req_id, None, existing)
            return

        self.capture.begin(req_id, limits["stdout_limit"], limits["stderr_limit"])
        started = time.monotonic()
        try:
            run_id, exit_code, error_errno = self.run(req_id, req["language"], req["code"], req["fresh"],
                                                      req["env"], req["context"])
            duration_ms = (time.monotonic() - started) * 1000.0
            self.capture.sync()
        finally:
            truncated = self.capture.end()

        # Nothing the cell started outlives it (and nothing changes files while
        # they are collected).  A fresh job's own process, a child of the kernel,
        # is spared here: its cell is over and it is exiting, which settle() waits
        # for after the result is sent, before it kills again.
        with sandbox_user():
            killed = kill_strays(existing, children_of=self.kernel.pid if req["fresh"] else None, exiting=True)
            full = (space_exhausted(WORKSPACE) or space_exhausted("/tmp") or error_errno == errno.ENOSPC)
            after, was, now = self.workspace_after(req, before)
            collect_files(WORKSPACE, was, now, limits, req["get_files"], lambda f: self.send(req_id, f))
        # A fresh job's workspace is emptied once it is over (settle): the next walks anew.
        self.last_walk = None if req["fresh"] else after
        if req["list_files"]:
            self.send(req_id, file_listing(after))
        status = "ok" if exit_code == 0 else "error"
        self.send(req_id, self.done_frame(status, exit_code, truncated, duration_ms, killed, full))
        if req["fresh"]:
            self.settle(req_id, run_id, spared_after)

    def workspace_before(self, req):
        """The workspace as the cell finds it, its input files written. A session's cell
        starts from the workspace as the last cell left it, its input files looked at again:
        a walk costs an lstat per entry (under gVisor, 176-226 ms a cell with 2,000 files in
        the workspace, 3-5 ms with none), and between a session's cells nothing writes there
        but the driver's inputs and the kernel's own threads (every other process of the
        last cell was killed), whose writes are then the next cell's, as they would be had
        they come during it. A session's first cell (or the first after a cell refused for
        its inputs) walks, and has the workspace watched from then on (workspace_after)."""
        kept, self.last_walk = self.last_walk, None
        if req["fresh"]:
            return snapshot(WORKSPACE)
        if kept is None:
            return self.watch.snapshot()
        paths = [f["path"] for f in req["files"]]
        self.watch.wrote(paths)
        return refresh(kept, WORKSPACE, paths)

    def workspace_after(self, req, before):
        """The workspace after the cell, and what collect_files compares: (after, was, now).
        A fresh job walks it (it began empty but for its inputs, and is emptied after). A
        session's cell brings `before` up to date from the watch's events (WorkspaceWatch),
        comparing only the entries they name; where the watch cannot vouch for what it saw, it
        walks (and watches anew)."""
        if req["fresh"]:
            after = snapshot(WORKSPACE)
            return after, before, after
        changes = self.watch.update(before)
        if changes is None:
            after = self.watch.snapshot()
            return after, before, after
        return (before,) + changes

    def prepare(self, req_id):
        """Have the kernel do its one-off preparation and fork the first job's process now,
        before any job: the worker asks it of a sandbox started for a tenant's one-off jobs
        that no job waits for, so that the preparation (immortal objects, huge pages: 0.3-0.5 s
        of CPU) is paid there, in the background, rather than by the tenant's jobs.  Answered
        with prepared; ready: the kernel answered as it was when it became ready."""
        if req_id is None:
            raise RequestError("prepare: id must be a string")
        if self.kernel_ran_cells:
            # A session's kernel holds a tenant's state: no job's process is ever forked from it.
            raise RequestError("prepare: this kernel ran cells of its own")
        settings = self.ping_forking_standby()
        ready = settings is not None and settings == self.kernel.settings_at_ready
        if not ready:
            self.channel.log("the kernel did not answer its preparation as it was: %r" % (settings,))
        self.send(req_id, {"type": "prepared", "ready": ready})

    def ping_forking_standby(self):
        """The kernel's settings from a ping that first has it fork the next job's process (None:
        no answer in time). The first such ping waits longer, unless the kernel was prepared in
        its start: before that fork the zygote makes its objects immortal and its memory huge
        pages, once (0.3-0.5 s with the default preload here; more with more libraries), which
        must not cost the sandbox its reuse. Later pings take milliseconds; their 2 s is how
        long a stopped zygote may hold up the verdict."""
        settings = self.kernel.ping(standby=True, timeout_s=2.0 if self.kernel_prepared else FIRST_STANDBY_S)
        self.kernel_prepared = True
        return settings

    def settle(self, req_id, run_id, spared):
        """After a fresh request's done: end its process (run_id; None when no
        cell ran), have the kernel end every other process of the job at once
        (purge), drop what it printed on its way out, clean up and say whether
        the sandbox may take the tenant's next job (settled).  `spared`: the
        processes alive before the request but the job's own."""
        ended = True
        if run_id is not None:
            # Only with the kernel under a uid of its own (always in a sandbox: the driver is
            # root there): started as the sandbox user on a developer's machine, the driver
            # shares the kernel's uid, and kill(-1) would end it; the kills below must do.
            if ISOLATED:
                # The purge ends the job's own process too (a job can keep it from exiting).
                ended = self.kernel.purge() and self.await_alone(spared)
            else:
                ended = self.end_job_process(run_id)
        kill_strays(spared)
        # Its last bytes are framed for no request (logged), never for the next job.
        self.capture.sync()
        reusable = self.leave_nothing_behind(spared) and ended
        self.send(req_id, {"type": "settled", "reusable": reusable})

    def end_job_process(self, run_id, timeout_s=5.0):
        """After a fresh run's cell_done: end the job's process (a child of the
        kernel; its cell is over, and a job may keep it from exiting) and wait
        for the zygote to report it gone.  Returns whether it did in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            with sandbox_user():
                for pid in children_of(self.kernel.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.channel.log("the job's process was not gone within %ss" % timeout_s)
                return False
            if not select.select([self.kernel.channel.in_fd], [], [], min(remaining, 0.05))[0]:
                continue
            frame = self.kernel.recv()
            if frame["type"] == "log":
                self.channel.log("kernel: %s" % cap_text(safe_str(frame.get("message")), MAX_KERNEL_LOG_BYTES))
            elif frame["type"] == "child_exit" and frame.get("id") == run_id:
                return True
            else:
                self.channel.log("dropped a kernel %s frame after the cell" % cap_text(frame["type"], 64))

    def await_alone(self, spared, timeout_s=2.0, gone=False):
        """After the purge no process of the job can start another: wait until
        every one killed has begun to exit (it runs no code again; its memory
        may still be being torn down), or, with `gone`, is gone.  Returns
        whether they were in time."""
        if wait_until(lambda: not other_processes(spared, exiting=gone), timeout_s):
            return True
        self.channel.log("processes of the job outlived the purge by %ss" % timeout_s)
        return False

    def await_exited(self, timeout_s=10.0):
        """Wait until no process that has begun to exit is left (their memory unmapped, their
        files closed).  Returns whether none was left in time."""
        if wait_until(lambda: not exiting_processes(), timeout_s):
            return True
        self.channel.log("processes of the last job were still exiting after %ss" % timeout_s)
        return False

    def await_torn_down(self, timeout_s=10.0):
        """Before a fresh job's inputs are written and its code runs: wait until no process
        that has begun to exit is left, then check that none of the sandbox is stopped.
        The last job's were let go once they could run no code (settle), so the next job's
        process could be forked while their memory was still being unmapped; but until a
        dying process's files are closed it still acts: once its memory is gone a process
        of the same uid may open its /proc/<pid>/fd (the dumpable check needs the memory),
        and closing a file sends the signals a job set on it (O_ASYNC, F_NOTIFY: a SIGSTOP
        to the kernel, after the ping that vouched for it).  The zygote reaps its own child
        before it reads the next run; this covers the others (what the job forked).  Returns
        whether the sandbox is fit."""
        if not self.await_exited(timeout_s):
            return False
        stopped = [pid for pid in other_processes() if _state(pid) in (b"T", b"t")]
        if stopped:
            self.channel.log("processes of the sandbox are stopped: %s" % stopped)
            return False
        return True

    def leave_nothing_behind(self, existing):
        """After a fresh request: empty every place a job can write (the
        workspace, /tmp, /dev/shm) and remove its System V IPC objects.
        Returns whether the sandbox is as the next job of the tenant must
        find it: those places empty, no process of the job left (`existing`:
        those alive before it, the kernel among them), the kernel alive."""
        with sandbox_user():
            emptied = all([empty_dir(WORKSPACE), empty_dir("/tmp"),
                           empty_dir("/dev/shm") or not os.path.isdir("/dev/shm"),
                           empty_dir("/dev/mqueue") or not os.path.isdir("/dev/mqueue")])
            # The directories themselves too: the job owns the workspace (and /tmp, as the
            # worker mounts it), so it may have changed their mode, set extended attributes
            # (data for a later job; a default ACL that makes every later file unreadable),
            # inode flags or times.
            for path, was in self.kept_directories.items():
                if not restore_directory(path, was):
                    self.channel.log("%s is not as it was before the first job" % path)
                    emptied = False
        alone = not other_processes(existing)
        # The next job's process is forked below while what the purge killed may still be being
        # torn down, its memory still charged to the sandbox. Where that leaves too little for
        # the fork and the first pages it copies (or the charge cannot be read), first wait until
        # the job's processes are gone: the fork must not meet the sandbox's OOM killer.
        headroom = memory_headroom()
        if headroom is None or headroom < STANDBY_HEADROOM:
            alone = alone and self.await_alone(existing, timeout_s=10.0, gone=True)
        # The job ran under the zygote's uid: it could have set the zygote's resource limits,
        # priority or CPU affinity (inherited by every later job), or stopped it. The zygote
        # must answer, as it was when it became ready. It forks the next job's process first
        # (the workspace and /tmp are empty by now): that is what the tenant's next job waits
        # for.
        settings = self.ping_forking_standby()
        with sandbox_user():
            # After the fork, off the next job's path (the standby uses none). A segment still
            # attached by a process of the job that is exiting stays listed until it is gone.
            ipc_clean = remove_sysv_ipc()
        if not ipc_clean and self.await_exited():
            with sandbox_user():
                ipc_clean = remove_sysv_ipc()
        answers = settings is not None
        unchanged = answers and settings == self.kernel.settings_at_ready
        verdict = emptied and ipc_clean and alone and unchanged and answers
        if not verdict:
            self.channel.log("the sandbox is not reusable: emptied=%s ipc_clean=%s alone=%s kernel_unchanged=%s kernel_answers=%s"
                             % (emptied, ipc_clean, alone, unchanged, answers))
        return verdict

    def run(self, req_id, language, code, fresh=False, env=None, context=None):
        """Have the kernel run one cell (fresh: in a process forked for it,
        which may still be exiting on return); forward its outputs.  Returns
        (the run's id, exit_code, errno of the python exception it ended
        with)."""
        self._runs += 1
        # Unguessable: a job's process can read its own run's id, never the next one's, so it
        # cannot forge frames for a later job of the sandbox.
        run_id = "run-%d-%s" % (self._runs, secrets.token_hex(8))
        self.running = run_id
        try:
            body = {"id": run_id, "language": language, "code": code, "env": env or {}, "context": context}
            if fresh:
                # The zygote reads only the first frame and the job's own process the second:
                # the code and environment never enter the zygote, whose memory the next job's
                # process starts from (sandcell_kernel's docstring).
                self.kernel.send({"type": "run", "id": run_id, "fresh": True})
                self.kernel.send(dict(body, type="run_body"))
            else:
                self.kernel_ran_cells = True
                self.kernel.send(dict(body, type="run", fresh=False))
            exit_code, error_errno = self.forward(req_id, run_id, language)
            return run_id, exit_code, error_errno
        except KernelGone as exc:
            self.capture.sync()  # what it printed before it went
            if exc.broken:
                # Said to the worker as this request's end (the job fails with
                # driver_protocol); a kernel that merely exited is for the worker
                # to diagnose (OOM, a signal), from the container.
                self.protocol_error(safe_str(exc), req_id)
            raise
        finally:
            self.running = None

    def forward(self, req_id, run_id, language):
        """Forward the kernel's frames for run_id until its cell_done."""
        while True:
            frame = self.kernel.recv(watch=self.watch)
            kind = frame["type"]
            if kind == "log":
                self.channel.log("kernel: %s" % cap_text(safe_str(frame.get("message")), MAX_KERNEL_LOG_BYTES))
                continue
            if frame.get("id") != run_id:
                self.channel.log("dropped a kernel %s frame of another run" % cap_text(kind, 64))
                continue
            if kind == "cell_done":
                exit_code = _int(frame.get("exit_code"))
                if language == "python":
                    self.execution_count = max(_int(frame.get("execution_count")) or 0, 0)
                    exit_code = 0 if exit_code == 0 else 1
                return (1 if exit_code is None else exit_code), _int(frame.get("errno"))
            if kind == "child_exit":
                # A fresh run's process ended before its cell did (the OOM
                # killer, os._exit): as when a kernel dies, the driver ends and
                # the worker reads why from the container.
                status = _int(frame.get("status"))
                # The driver exits as the job's process did (128+N for signal N), so the
                # worker reads from the container what it would from a kernel's death.
                raise KernelGone("the job's process exited with status %s before its cell ended" % status,
                                 exit_status=exit_status_as(status))
            output = checked_output(frame)
            if output is None:
                self.channel.log("dropped a kernel frame of type %r" % cap_text(kind, 64))
                continue
            # Output printed before the frame is framed before it (the kernel
            # waits for the ack before it goes on).
            self.capture.sync()
            self.send(req_id, output)
            self.kernel.send({"type": "ack"})

    def done_frame(self, status, exit_code, truncated, duration_ms, killed, full):
        frame = {"type": "done", "status": status, "exit_code": exit_code,
                 "stdout_truncated": truncated[0], "stderr_truncated": truncated[1],
                 # For bash/input errors: the last python cell's number.
                 "execution_count": self.execution_count,
                 "duration_ms": round(duration_ms, 3),
                 "processes_killed": killed, "workspace_full": bool(full)}
        return frame

    def write_inputs(self, req_id, files):
        decoded, errors = decode_input_files(files)
        if not errors:
            root_fd = os.open(WORKSPACE, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for path, parts, content in decoded:
                    try:
                        write_input_file(root_fd, parts, content)
                    except (OSError, InputFileError) as exc:
                        errors.append((path, describe_write_error(exc)))
                        break
            finally:
                os.close(root_fd)
        for path, message in errors:
            self.send(req_id, {"type": "file_error", "path": path, "message": message})
        return not errors


def connect_worker():
    """The worker's socket (SANDCELL_CHANNEL), connected: its fd, or the error
    why not (None when there is none).  The kernel never sees the variable."""
    path = os.environ.pop("SANDCELL_CHANNEL", "")
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # non-inheritable
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        return exc
    return sock.detach()


def setup_io():
    """Take the worker's stream for the protocol (its socket, else stdin and
    stdout); return the Channel.  fd 0 becomes /dev/null and fds 1/2 the
    diagnostics, so that nothing but frames ever reaches the worker's
    stream."""
    linked = connect_worker()
    if isinstance(linked, int):
        proto_in, proto_out = linked, os.dup(linked)
    else:
        proto_in = os.dup(0)  # os.dup() fds are non-inheritable
        proto_out = os.dup(1)
    diag = os.dup(2)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(diag, 1)
    channel = Channel(proto_in, proto_out, diag, max_in=MAX_REQUEST_BYTES)
    if isinstance(linked, OSError):
        channel.log("cannot connect to the worker's socket (%s): speaking on stdin/stdout" % (linked,))
    threading.excepthook = lambda args: channel.log("exception in thread %s: %r" % (args.thread, args.exc_value))
    return channel


def start_up_failed(channel, message):
    channel.log("start-up failed: %s" % message)
    try:
        channel.send({"type": "protocol_error", "message": "driver start-up failed: %s" % message})
    finally:
        os._exit(1)


def main():
    channel = setup_io()
    # SIGINT before the kernel is up, or between cells, is ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not ISOLATED:
        channel.log("not started as root: the kernel runs under the driver's own uid")
    capture = Capture(channel)
    try:
        kernel = KernelProcess(capture, channel.log)
        ready = kernel.recv()
        while ready.get("type") == "log":  # the kernel's start-up diagnostics
            channel.log("kernel: %s" % cap_text(safe_str(ready.get("message")), MAX_KERNEL_LOG_BYTES))
            ready = kernel.recv()
    except (OSError, KernelGone) as exc:
        start_up_failed(channel, safe_str(exc))
    if ready.get("type") != "ready":
        start_up_failed(channel, "the kernel sent %r before ready" % cap_text(safe_str(ready.get("type")), 64))
    preloaded = ready.get("preloaded")
    preloaded = [cap_text(m, 256) for m in preloaded if isinstance(m, str)] if isinstance(preloaded, list) else []
    ipython = ready.get("ipython")
    kernel.settings_at_ready = kernel.ping(timeout_s=30.0)
    driver = Driver(channel, capture, kernel, prepared=ready.get("prepared") is True)
    signal.signal(signal.SIGINT, driver.on_sigint)
    channel.send({"type": "ready", "driver_version": DRIVER_VERSION,
                  "python": platform.python_version(),
                  "ipython": cap_text(ipython, 64) if isinstance(ipython, str) else "unknown",
                  "preloaded": preloaded, "kernel_isolated": ISOLATED,
                  "startup_ms": round((time.monotonic() - STARTED_AT) * 1000.0, 1)})
    try:
        driver.serve()
    except KernelGone as exc:
        channel.log(safe_str(exc))
        os._exit(exc.exit_status)
    # EOF from the worker: the kernel goes with the driver.
    try:
        kernel.proc.kill()
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--kernel":
        import sandcell_kernel

        sandcell_kernel.main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
