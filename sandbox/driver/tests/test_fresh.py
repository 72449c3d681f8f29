"""Fresh requests (one-off jobs in a sandbox reused for their tenant): each
runs in a process forked from a kernel that never ran user code, and nothing
it leaves -- files, processes, threads, interpreter state, environment, IPC
objects -- reaches the next."""

import contextlib
import json
import platform
import os
import re
import tempfile
import signal
import sys
import time
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)

# x86-64, loaded at 0x400078 (after a 64-byte ELF header and one 56-byte program header):
#   loop: mov eax, 56 (clone); mov edi, 0x111 (CLONE_VM | SIGCHLD); xor esi, esi; xor edx, edx;
#         xor r10, r10; xor r8, r8; syscall; test rax, rax; jz loop (the child hops on);
#         js loop (retry when refused); mov eax, 60 (exit); xor edi, edi; syscall (the parent ends)
HOPPER_X86_64 = "b838000000bf1101000031f631d24d31d24d31c00f054885c074e578e3b83c00000031ff0f05"

# Job code defining write_hopper(path): the hopper above as an executable at `path`.
WRITE_HOPPER = (
    "import os, struct\n"
    "def write_hopper(path):\n"
    "    code = bytes.fromhex(%r)\n"
    "    head = b'\\x7fELF' + bytes([2, 1, 1, 0]) + bytes(8) + struct.pack('<HHIQQQIHHHHHH', 2, 0x3e, 1, 0x400078, 64, 0, 0, 64, 56, 1, 0, 0, 0)\n"
    "    segment = struct.pack('<IIQQQQQQ', 1, 5, 0, 0x400000, 0x400000, 120 + len(code), 120 + len(code), 0x1000)\n"
    "    with open(path, 'wb') as f:\n"
    "        f.write(head + segment + code)\n"
    "    os.chmod(path, 0o755)\n") % HOPPER_X86_64

# Job code that prints whether fewer than 10 processes were created in the sandbox while it
# waited 0.3 s (the last pid of /proc/loadavg): a hopper left running creates thousands.
FEW_PROCESSES_CREATED = (
    "import time\n"
    "last = lambda: int(open('/proc/loadavg').read().split()[-1])\n"
    "before = last()\n"
    "time.sleep(0.3)\n"
    "print(last() - before < 10)\n")

# A hostile job: it tries to leave something behind everywhere it can.
LEAVE_TRACES = r"""
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
shm_id = libc.shmget(0x5ca11, 4096, 0o1600)  # IPC_CREAT | 0600
subprocess.Popen(['sleep', '300'], start_new_session=True)
threading.Thread(target=lambda: time.sleep(300), daemon=False).start()
json.dumps = None
builtins.input = lambda *a: 'patched'
builtins.sandcell_left = True
os.environ['SANDCELL_LEFT'] = '1'
sys.path.append('/left/in/sys/path')
left_variable = 1
print('left', shm_id >= 0)
"""

# The next job: what it finds.
FIND_TRACES = r"""
import builtins, ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
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
}
print(json.dumps(found, sort_keys=True))
"""


def _last_pid_moves():
    """Whether /proc/loadavg's last pid follows the processes this kernel creates."""
    last = lambda: int(open("/proc/loadavg").read().split()[-1])
    before = last()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return last() != before


def setUpModule():
    # After a fresh job the kernel ends every other process of its uid (the purge): in a
    # sandbox only its own jobs', here also other drivers' kernels. So these tests run one
    # driver at a time, as a sandbox does: the shared driver of the other modules goes now
    # and is started again by the next module that needs it.
    if DriverTestCase.driver is not None:
        DriverTestCase.driver.close()
        DriverTestCase.driver = None


class TestFresh(DriverTestCase):
    """A driver of its own that runs only fresh requests, as a one-off
    sandbox does."""

    driver = None

    @classmethod
    def setUpClass(cls):
        cls.driver = DriverProcess()

    @classmethod
    def tearDownClass(cls):
        cls.driver.close()

    def test_nothing_a_fresh_job_leaves_reaches_the_next(self):
        frames = self.run_ok(LEAVE_TRACES, fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "left True\n")
        d = done(frames)
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        self.assertEqual(d["processes_killed"], 1)  # the sleep; the thread died with its process
        frames = self.run_ok(FIND_TRACES, fresh=True)
        found = json.loads(stream_text(frames, "stdout"))
        self.assertEqual(found, {"workspace": [], "tmp": [], "shm": [], "ipc_segment": False, "json_dumps_broken": False,
                                 "builtins_patched": False, "env": False, "sys_path": False, "variable": False})

    def test_a_fresh_jobs_result_comes_before_the_cleanup_and_its_verdict_after_it(self):
        # done does not wait for the job's process to exit or for the cleanup; settled, the
        # request's last frame, says whether the cleanup left the sandbox fit for the next job.
        frames = self.run_ok("for i in range(2000):\n    open('/tmp/left-%d' % i, 'w').close()\nprint('made')",
                             fresh=True)
        self.assertEqual([f["type"] for f in frames[-2:]], ["done", "settled"])
        self.assertEqual(stream_text(frames, "stdout"), "made\n")
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        frames = self.run_ok("import os\nprint(sum(n.startswith('left-') for n in os.listdir('/tmp')))", fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "0\n")

    def test_a_process_the_job_forks_on_its_way_out_is_killed_before_the_cleanup(self):
        # The result is sent while the job's process exits; one that forks then (os._exit
        # patched), after the strays were killed, must not outlive the cleanup to leave a file
        # for the next job.
        code = (
            "import os, time\n"
            "real_exit = os._exit\n"
            "def late_exit(status):\n"
            "    time.sleep(0.1)  # after the result's kill\n"
            "    if os.fork() == 0:\n"
            "        for _ in range(500):\n"
            "            time.sleep(0.005)\n"
            "            if not os.path.exists('marker'):\n"
            "                break\n"
            "        open('implant.py', 'w').write('x')\n"
            "        open('/tmp/implant', 'w').write('x')\n"
            "        real_exit(0)\n"
            "    time.sleep(0.2)\n"
            "    real_exit(status)\n"
            "os._exit = late_exit\n"
            "open('marker', 'w').write('x')\n"
            "print('set')")
        self.run_ok("1", fresh=True)  # so the job runs in a standby, forked before it
        frames = self.run_ok(code, fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "set\n")
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        time.sleep(0.5)  # what a surviving process would have had to write
        frames = self.run_ok("import os\nprint(os.path.exists('implant.py'), os.path.exists('/tmp/implant'))", fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "False False\n")

    def test_an_input_error_after_a_fresh_job_does_not_hold_up_the_next(self):
        # The cleanup after a refused request asks the kernel for a standby it already has:
        # the kernel says so at once, and the next job does not wait for it.
        self.run_ok("1", fresh=True)
        frames = self.driver.execute("1", fresh=True, files=[{"path": "../escape", "content_b64": ""}])
        self.assertEqual(done(frames)["status"], "input_error")
        started = time.monotonic()
        frames = self.run_ok("print('quick')", fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "quick\n")
        self.assertLess(time.monotonic() - started, 3.0, "the job waited for a standby frame")

    def test_each_fresh_job_is_cell_one_in_a_process_of_its_own(self):
        pids = set()
        for _ in range(3):
            frames = self.run_ok("import os\nos.getpid()", fresh=True)
            d = done(frames)
            self.assertEqual(d["execution_count"], 1)
            pids.add(of_type(frames, "execute_result")[0]["data"]["text/plain"])
        self.assertEqual(len(pids), 3)

    def test_a_fresh_job_cannot_reach_into_the_kernel_that_forks_the_next(self):
        frames = self.run_ok(
            "import os\n"
            "try:\n"
            "    open('/proc/%d/mem' % os.getppid(), 'rb').close()\n"
            "    print('reached')\n"
            "except OSError as e:\n"
            "    print('refused')\n", fresh=True)
        self.assertEqual(stream_text(frames, "stdout"), "refused\n")

    def test_fresh_must_be_a_boolean(self):
        req_id = self.driver.start("1", fresh="yes")
        frames = self.driver.collect(req_id)
        self.assertEqual(frames[-1]["type"], "protocol_error")
        self.assertIn("fresh", frames[-1]["message"])
        self.assertAlive()


class TestSessionCells(DriverTestCase):
    def test_state_persists_between_requests_that_are_not_fresh(self):
        self.run_ok("kept = 41", fresh=False)
        frames = self.run_ok("kept + 1")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "42")


    def test_a_sessions_kernel_keeps_its_objects_mortal(self):
        # A kernel started for a session makes no preparation for forked jobs: it frees what
        # its cells drop, preloaded objects included. (A warm-pool kernel a session takes was
        # prepared in its start: its preloaded objects are immortal, what its cells create is
        # not; test_fresh.TestFreshPreparedAtStart.)
        frames = self.run_ok("import sys, json\nprint(sys.getrefcount(json.dumps) < 2**31)", fresh=False)
        self.assertEqual(stream_text(frames, "stdout"), "True\n")


IMMORTALS = sys.version_info[:2] in ((3, 12), (3, 13))


class TestFreshProcessDeath(unittest.TestCase):
    def test_a_fresh_job_whose_process_dies_ends_the_driver(self):
        # As when a kernel dies: no done, the driver exits, and the worker
        # reads why from the container (and never reuses it).
        driver = DriverProcess()
        try:
            driver.start("import os\nos._exit(3)", fresh=True)
            self.assertEqual(driver.proc.wait(60), 3)  # as the job's process exited
            frames = []
            while True:
                frame = driver.frames.get(timeout=10)
                if frame is None:
                    break
                frames.append(frame)
            self.assertNotIn("done", [f["type"] for f in frames])
        finally:
            driver.close()


if __name__ == "__main__":
    unittest.main()


class TestFreshOwnProcess(unittest.TestCase):
    """A driver per test (no other driver may live while a fresh job's purge runs)."""

    def test_a_fresh_jobs_own_process_is_not_counted_as_left_running_while_it_exits(self):
        # The first job of a sandbox runs in a process forked for it (no standby yet); it is
        # still exiting when the strays are killed, and is not one. What it prints on its way
        # out reaches neither its result nor the next job's.
        driver = DriverProcess()
        try:
            code = ("import os, threading, time\n"
                    "real_exit = os._exit\n"
                    "os._exit = lambda status: (time.sleep(0.3), real_exit(status))\n"
                    "threading.Timer(0.1, lambda: print('late', flush=True)).start()\n"
                    "print('first')")
            frames = driver.execute(code, fresh=True)
            self.assertEqual((done(frames)["status"], done(frames)["processes_killed"]), ("ok", 0), frames[-2:])
            self.assertEqual(stream_text(frames, "stdout"), "first\n")
            self.assertTrue(settled(frames)["reusable"], frames[-2:])
            frames = driver.execute("print('next')", fresh=True)
            self.assertEqual(stream_text(frames, "stdout"), "next\n")
            self.assertEqual(done(frames)["processes_killed"], 0)
        finally:
            driver.close()


class TestFreshHostile(unittest.TestCase):
    """Jobs that attack the kernel they were forked from, or the next job."""

    def setUp(self):
        self.driver = DriverProcess()

    def tearDown(self):
        self.driver.close()

    def run_fresh(self, code, **fields):
        frames = self.driver.execute(code, fresh=True, **fields)
        return frames, done(frames)

    def test_changing_the_kernels_limits_makes_the_sandbox_not_reusable(self):
        # Same uid: prlimit on the parent is allowed, and every later fork would inherit it.
        frames, d = self.run_fresh("import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (256, 256))\nprint('set')")
        self.assertEqual(stream_text(frames, "stdout"), "set\n")
        self.assertFalse(settled(frames)["reusable"], frames[-2:])

    def test_frames_a_job_forges_on_the_kernels_pipe_never_reach_the_next_job(self):
        # The job writes complete frames straight to the kernel's reply pipe (its fd is in
        # argv): a cell_done and output for a guessed next run, and junk.
        forge = (
            "import json, struct, sys\n"
            "fd = int(sys.argv[3])\n"
            "def frame(o):\n"
            "    b = json.dumps(o).encode()\n"
            "    return struct.pack('>I', len(b)) + b\n"
            "import os\n"
            "for i in range(1, 6):\n"
            "    rid = 'run-%d' % i\n"
            "    os.write(fd, frame({'type': 'display_data', 'id': rid, 'data': {'text/plain': 'FORGED'}}))\n"
            "    os.write(fd, frame({'type': 'cell_done', 'id': rid, 'exit_code': 0, 'execution_count': 99, 'errno': None}))\n"
            "os.write(fd, frame({'type': 'whatever'}))\n"
            "print('forged')\n")
        frames, d = self.run_fresh(forge)
        self.assertEqual(stream_text(frames, "stdout"), "forged\n")
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        frames, d = self.run_fresh("print('honest')")
        self.assertEqual(stream_text(frames, "stdout"), "honest\n")
        self.assertEqual(of_type(frames, "display_data"), [])
        self.assertEqual(d["execution_count"], 1)

    def standby(self):
        """The process the kernel forked for the next fresh job (once it exists)."""
        kernels = children_of(self.driver.proc.pid)
        self.assertEqual(len(kernels), 1, kernels)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = running_children_of(kernels[0])
            if kids:
                self.assertEqual(len(kids), 1, kids)
                return kids[0]
            time.sleep(0.01)
        self.fail("no process forked for the next fresh job")

    def test_the_next_fresh_job_runs_in_a_process_forked_after_the_last_was_cleaned_up(self):
        self.run_fresh("open('left.txt', 'w').write('x')")
        standby = self.standby()
        frames, d = self.run_fresh("import os\nprint(os.getpid(), sorted(n for n in os.listdir('.') if n != '.local'))")
        self.assertEqual(stream_text(frames, "stdout"), "%d []\n" % standby)
        # Counted as there before the job, so not as a process the job left.
        self.assertEqual(d["processes_killed"], 0)
        self.assertTrue(settled(frames)["reusable"], frames[-2:])

    def test_a_fresh_job_still_runs_when_the_process_forked_for_it_is_gone(self):
        self.run_fresh("1")
        standby = self.standby()
        os.kill(standby, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while standby in children_of(children_of(self.driver.proc.pid)[0]) and not is_zombie(standby):
            self.assertLess(time.monotonic(), deadline, "the standby process did not die")
            time.sleep(0.01)
        frames, d = self.run_fresh("import os\nprint(os.getpid())")
        self.assertNotEqual(stream_text(frames, "stdout"), "%d\n" % standby)
        self.assertEqual(d["status"], "ok")
        self.assertEqual(d["execution_count"], 1)
        self.assertTrue(settled(frames)["reusable"], frames[-2:])

    def test_a_fresh_job_finds_the_namespace_of_a_shell_that_never_ran_a_cell(self):
        # The kernel and the process forked for the next job each run the cell machinery
        # once on code of their own (IPython initialises much of it lazily): nothing of
        # it shows.
        probe = "print(repr(_), len(In), len(Out), sorted(k for k in globals() if not k.startswith('_')))"
        first, _ = self.run_fresh(probe)
        second, d = self.run_fresh(probe)
        self.assertEqual(stream_text(first, "stdout"), stream_text(second, "stdout"))
        # IPython's own names (since 8.x its `open`, which refuses the standard streams' fds).
        self.assertEqual(stream_text(second, "stdout"), "'' 2 0 ['In', 'Out', 'exit', 'get_ipython', 'open', 'quit']\n")
        self.assertEqual(d["execution_count"], 1)

    def test_an_input_error_keeps_the_process_forked_for_the_next_job(self):
        # No code ran for the refused request: the process forked after the last job is still
        # unused, and the next job runs in it (it was killed as a stray, and the next job
        # paid for a fork of its own).
        self.run_fresh("1")
        standby = self.standby()
        frames = self.driver.execute("1", fresh=True, files=[{"path": "../escape", "content_b64": ""}])
        self.assertEqual(done(frames)["status"], "input_error")
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        frames, d = self.run_fresh("import os\nprint(os.getpid())")
        self.assertEqual(stream_text(frames, "stdout"), "%d\n" % standby)

    def test_a_fresh_job_reports_no_cell_number_of_the_job_before(self):
        # A bash job (or an input error) reports the number of the last python cell of its
        # own process: none ran, so 0, never the number the job before chose.
        frames, d = self.run_fresh("get_ipython().execution_count = 3735928559")
        self.assertEqual(d["status"], "ok")
        frames = self.driver.execute("echo hi", fresh=True, language="bash")
        self.assertEqual((stream_text(frames, "stdout"), done(frames)["execution_count"]), ("hi\n", 0))

    def test_attributes_an_acl_and_times_a_job_sets_on_the_workspace_do_not_reach_the_next(self):
        # The workspace outlives the job (a mount point, emptied): its owner, the job, can set
        # extended attributes on it (data for the next job), a default ACL (every file made in
        # it later, the next job's inputs too, would have mode 0000) and its times.
        leave = (
            "import os, struct\n"
            "acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, 0, 0xffffffff) for tag in (1, 4, 0x20))\n"
            "done = []\n"
            "for name, value in (('user.left', b'from the last job'), ('system.posix_acl_default', acl)):\n"
            "    try:\n"
            "        os.setxattr('.', name, value)\n"
            "        done.append(name)\n"
            "    except OSError as e:\n"
            "        done.append('%s: %s' % (name, e.strerror))\n"
            "os.utime('.', (1000000000, 1000000000))\n"
            "print(done)\n")
        frames, d = self.run_fresh(leave)
        left = stream_text(frames, "stdout")
        # gVisor's tmpfs may refuse them; where it takes them, they must be gone after.
        self.assertRegex(left, r"user\.left(: Operation not supported)?'")
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        find = (
            "import os, stat\n"
            "mtime = os.stat('.').st_mtime\n"
            "open('made.txt', 'w').write('x')\n"
            "print(os.listxattr('.'), open('input.txt').read(), oct(stat.S_IMODE(os.stat('made.txt').st_mode)),\n"
            "      mtime > 1000000000)\n")
        frames = self.driver.execute(find, fresh=True, files=[{"path": "input.txt", "content_b64": b64(b"in")}])
        self.assertEqual(stream_text(frames, "stdout"), "[] in 0o644 True\n", frames)

    def test_what_a_job_sets_on_the_files_it_shares_with_the_kernel_does_not_reach_the_next(self):
        # A job's process holds the kernel's open file descriptions (fd 0, the capture pipes
        # on fds 1 and 2): flags, a lock, the owner and signal of O_ASYNC, a pipe's size set
        # on them would stay set for every later job -- its output cut or lost, a SIGINT at
        # its first print, data in a lock's range.
        leave = (
            "import fcntl, os, signal, struct\n"
            "done = []\n"
            "def attempt(name, f):\n"
            "    try:\n"
            "        f()\n"
            "        done.append(name)\n"
            "    except OSError as e:\n"
            "        done.append('%s: %s' % (name, e.strerror))\n"
            "attempt('lock', lambda: fcntl.fcntl(0, fcntl.F_OFD_SETLK, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, 4242, 7, 0)))\n"
            "attempt('size', lambda: fcntl.fcntl(2, fcntl.F_SETPIPE_SZ, 4096))\n"
            "attempt('owner', lambda: fcntl.fcntl(2, fcntl.F_SETOWN, -os.getpgid(0)))\n"
            "attempt('signal', lambda: fcntl.fcntl(2, fcntl.F_SETSIG, signal.SIGINT))\n"
            "print(done, flush=True)\n"
            "for fd in (1, 2):\n"
            "    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK | os.O_ASYNC)\n")
        frames, d = self.run_fresh(leave)
        if stream_text(frames, "stdout") != "['lock', 'size', 'owner', 'signal']\n":
            # A kernel that refuses some of it (gVisor has no open-file-description locks):
            # what it took must be undone, or the sandbox not reused.
            if not settled(frames)["reusable"]:
                return
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        find = (
            "import fcntl, os, struct, time\n"
            "flags = [fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_NONBLOCK | os.O_ASYNC) for fd in (0, 1, 2)]\n"
            "null = os.open('/dev/null', os.O_RDWR)\n"
            "try:\n"
            "    lock = struct.unpack('hhqqi4x', fcntl.fcntl(null, fcntl.F_OFD_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0)))\n"
            "    unlocked = lock[0] == fcntl.F_UNLCK\n"
            "except OSError:\n"
            "    unlocked = True  # no such locks here\n"
            "print(flags, unlocked, fcntl.fcntl(2, fcntl.F_GETPIPE_SZ), fcntl.fcntl(2, fcntl.F_GETSIG), fcntl.fcntl(2, fcntl.F_GETOWN))\n"
            "print('x' * 300000)\n"
            "time.sleep(0.2)\n"
            "print('still here')\n")
        frames, d = self.run_fresh(find)
        self.assertEqual(d["status"], "ok", frames)
        lines = stream_text(frames, "stdout").split("\n")
        self.assertEqual(lines[0], "[0, 0, 0] True 65536 0 0")
        self.assertEqual((len(lines[1]), lines[2]), (300000, "still here"))

    def test_a_process_whose_main_thread_exited_while_its_threads_run_is_killed(self):
        # Its main thread leaves with the exit system call (not exit_group): /proc/<pid>/stat
        # says Z, the thread group runs on -- here, writing into the workspace every 20 ms.
        leave = (
            "import ctypes, os, threading, time\n"
            "r, w = os.pipe()\n"
            "if os.fork() == 0:\n"
            "    def spy():\n"
            "        while True:\n"
            "            try:\n"
            "                open('/home/user/spy-alive', 'w').close()\n"
            "            except OSError:\n"
            "                pass\n"
            "            time.sleep(0.02)\n"
            "    threading.Thread(target=spy).start()\n"
            "    os.write(w, b'x')\n"
            "    ctypes.CDLL(None).syscall(60, 0)\n"
            "os.read(r, 1)\n"
            "print('left')\n")
        frames, d = self.run_fresh(leave)
        self.assertEqual(stream_text(frames, "stdout"), "left\n")
        self.assertEqual(d["processes_killed"], 1, frames)
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        frames, d = self.run_fresh("import os, time\ntime.sleep(0.3)\nprint(sorted(n for n in os.listdir('.') if n != '.local'))")
        self.assertEqual(stream_text(frames, "stdout"), "[]\n")

    def test_processes_that_fork_and_exit_in_a_loop_do_not_outlive_their_job(self):
        # A process that clones itself and exits at once, in a loop (tens of thousands of times
        # a second), is never where a scan of /proc saw it: the kill after the cell and the one
        # after the job's process exited both missed it. One starts during the cell, one from
        # the job's own process after its done (os._exit patched), past the first kill. The
        # next job counts the processes created while it waits (the last pid of /proc/loadavg).
        leave = WRITE_HOPPER + (
            "import subprocess, time\n"
            "write_hopper('hopper')\n"
            "hop = lambda: subprocess.Popen(['./hopper'], start_new_session=True, stdin=subprocess.DEVNULL)\n"
            "hop()\n"
            "real_exit = os._exit\n"
            "os._exit = lambda status: (time.sleep(0.3), hop(), time.sleep(0.05), real_exit(status))\n"
            "print('hopping')\n")
        if platform.machine() != "x86_64":
            self.skipTest("the hopper is x86-64 machine code")
        if not _last_pid_moves():
            # gVisor: its /proc/loadavg shows no last pid (and its kill(-1) does not stop a
            # cloning loop: one-off sandboxes are not reused there, docs/security.md).
            self.skipTest("this kernel shows no last pid")
        frames, d = self.run_fresh(leave)
        self.assertEqual(stream_text(frames, "stdout"), "hopping\n")
        frames, d = self.run_fresh(FEW_PROCESSES_CREATED)
        self.assertEqual(stream_text(frames, "stdout"), "True\n", "a hopper of the last job runs on")

    def test_a_fresh_jobs_process_holds_no_end_of_the_pipe_its_cleanup_is_asked_on(self):
        # The purge and the ping (whose answers vouch for the cleanup) come down the kernel's
        # control pipe. A job's process holds the request pipe, and a process it leaves
        # behind (forked with the raw system call, past every at-fork handler) could read a
        # purge there and answer it itself: the kill that ends what the job left would never
        # come. The control pipe is closed before any code of the job runs.
        frames, d = self.run_fresh(
            "import os, stat, sys\n"
            "fd = int(sys.argv[4])\n"
            "try:\n"
            "    held = stat.S_ISFIFO(os.fstat(fd).st_mode)\n"
            "except OSError:\n"
            "    held = False\n"
            "print(sys.argv[1], 'held' if held else 'closed')\n")
        self.assertEqual(stream_text(frames, "stdout"), "--kernel closed\n", frames)
        # The sandbox is still vouched for: the kernel read its ping on the control pipe.
        self.assertTrue(settled(frames)["reusable"], frames[-2:])
        frames, d = self.run_fresh("print('next')")
        self.assertEqual(stream_text(frames, "stdout"), "next\n", frames)

    def test_a_process_a_job_leaves_on_the_kernels_request_pipe_cannot_answer_the_purge(self):
        # From the start of its cell a thread of the job's process keeps forking, with the raw
        # system call (no at-fork handler closes the kernel's pipes), a process that waits on
        # the kernel's request pipe; each kills the one before, and the job's process lingers
        # after its done (os._exit patched) until the driver kills it, so the last one comes
        # after every scan for leftovers. Should a purge come down that pipe, it reads the
        # whole frame at once, answers it with its nonce and becomes a hopper (a cloning loop
        # no scan sees). The next job counts the processes created while it waits.
        leave = WRITE_HOPPER + (
            "import ctypes, json, sys, threading, time\n"
            "write_hopper('/tmp/hopper')\n"
            "req, rep = int(sys.argv[2]), int(sys.argv[3])\n"
            "libc = ctypes.PyDLL(None)\n"
            "def listen(before):\n"
            "    pid = libc.syscall(57)\n"
            "    if pid != 0:\n"
            "        return pid\n"
            "    try:\n"
            "        if before:\n"
            "            os.kill(before, 9)\n"
            "        while True:\n"
            "            data = os.read(req, 1 << 16)\n"
            "            if len(data) < 4:\n"
            "                break\n"
            "            body = json.loads(data[4:4 + struct.unpack('>I', data[:4])[0]])\n"
            "            if body.get('type') == 'purge':\n"
            "                answer = json.dumps({'type': 'purged', 'nonce': body.get('nonce')}).encode()\n"
            "                os.write(rep, struct.pack('>I', len(answer)) + answer)\n"
            "                os.execv('/tmp/hopper', ['hopper'])\n"
            "    finally:\n"
            "        os._exit(0)\n"
            "def keep_listening():\n"
            "    last = 0\n"
            "    while True:\n"
            "        last = listen(last)\n"
            "        time.sleep(0.0005)\n"
            "threading.Thread(target=keep_listening, daemon=True).start()\n"
            "os._exit = lambda status: time.sleep(60)\n"
            "print('listening')\n")
        if platform.machine() != "x86_64":
            self.skipTest("the hopper is x86-64 machine code")
        if not _last_pid_moves():
            self.skipTest("this kernel shows no last pid")
        # The listener races the kernel for what comes down the pipe: several tries.
        for attempt in range(4):
            frames, d = self.run_fresh(leave)
            self.assertEqual(stream_text(frames, "stdout"), "listening\n", frames)
            if not settled(frames)["reusable"]:
                # Not vouched for: the worker would destroy it (a frame the kernel and the
                # listener split between them leaves the kernel waiting for the rest).
                self.driver.close()
                self.driver = DriverProcess()
                continue
            frames, d = self.run_fresh(FEW_PROCESSES_CREATED)
            self.assertEqual(stream_text(frames, "stdout"), "True\n", "try %d: a process of the last job runs on" % attempt)

    def test_no_code_of_the_next_job_runs_while_a_process_of_the_last_is_still_exiting(self):
        # The next job's process may be forked while the last job's processes are still being
        # torn down (they run no code), but none of its code runs before they are gone: once a
        # dying process's memory is unmapped and until its files are closed, a process of the
        # same uid may open its /proc/<pid>/fd. A process holding 400 MiB takes tens of
        # milliseconds to tear down; the next job looks for any process still exiting.
        if not _last_pid_moves():
            self.skipTest("this kernel's /proc shows no task flags")  # gVisor: always 0
        frames, d = self.run_fresh(
            "import subprocess, time\n"
            "subprocess.Popen(['python3', '-c', 'import time\\nb = b\"x\" * (400 << 20)\\nprint(\"full\", flush=True)\\ntime.sleep(300)'],\n"
            "                 start_new_session=True, stdout=subprocess.PIPE).stdout.readline()\n"
            "print('holding')\n")
        self.assertEqual(stream_text(frames, "stdout"), "holding\n", frames)
        self.assertEqual(d["processes_killed"], 1, frames)
        frames, d = self.run_fresh(
            "import os\n"
            "def exiting(pid):\n"
            "    try:\n"
            "        return int(open('/proc/%s/stat' % pid).read().rsplit(')', 1)[1].split()[6]) & 4\n"
            "    except OSError:\n"
            "        return 0\n"
            "print(sum(1 for p in os.listdir('/proc') if p.isdigit() and exiting(p)))\n")
        self.assertEqual(stream_text(frames, "stdout"), "0\n", frames)

    def test_a_job_cannot_open_the_kernels_request_pipe_for_writing(self):
        # A job's process holds the read end of the kernel's request pipe; were it to reopen it
        # through /proc/self/fd for writing, it could send the kernel a run request of its own
        # (a cell run in the kernel itself, which forks every later job). The pipes are the
        # driver's, made as root: the reopen is refused.
        frames, d = self.run_fresh(
            "import os, sys\n"
            "for fd in (int(sys.argv[2]), int(sys.argv[3])):\n"
            "    try:\n"
            "        os.close(os.open('/proc/self/fd/%d' % fd, os.O_WRONLY))\n"
            "        print('opened')\n"
            "    except OSError as exc:\n"
            "        print('refused', exc.errno)\n")
        self.assertEqual(stream_text(frames, "stdout"), "refused 13\nrefused 13\n", frames)

    def test_changing_the_kernels_io_priority_or_time_slice_makes_the_sandbox_not_reusable(self):
        # Same uid: ioprio_set and sched_setattr on the parent are allowed, and every later
        # fork would inherit them (an idle I/O class, a long slice).
        for name, code in (
                ("ioprio", "import ctypes, os\n"
                           "libc = ctypes.CDLL(None, use_errno=True)\n"
                           "r = libc.syscall(251, 1, os.getppid(), 3 << 13)\n"
                           "print('set' if r == 0 else 'refused %d' % ctypes.get_errno())\n"),
                ("slice", "import ctypes, os, struct\n"
                          "libc = ctypes.CDLL(None, use_errno=True)\n"
                          "attr = ctypes.create_string_buffer(struct.pack('=IIQiIQQQII', 56, 0, 0, 0, 0, 30000000, 0, 0, 0, 0))\n"
                          "r = libc.syscall(314, os.getppid(), attr, 0)\n"
                          "print('set' if r == 0 else 'refused %d' % ctypes.get_errno())\n")):
            with self.subTest(name):
                self.driver.close()  # one driver at a time (see setUpModule)
                driver = self.driver = DriverProcess()
                try:
                    frames = driver.execute(code, fresh=True)
                    said = stream_text(frames, "stdout")
                    if said != "set\n":
                        self.skipTest("%s: this kernel refuses it (%s)" % (name, said.strip()))
                    self.assertFalse(settled(frames)["reusable"], frames[-2:])
                finally:
                    pass  # tearDown closes it

    def test_the_next_job_finds_nothing_of_the_last_ones_code_or_environment_in_its_memory(self):
        # A job's request (its code, its environment: a key, say) reaches only the process that
        # runs it: the kernel that forks the next job's process never holds it, so the next job,
        # reading every page of its own memory, finds no trace of it. The secret is searched for
        # by its hash: the probe itself never holds it.
        import hashlib
        import secrets as tokens
        head, tail = "sk%s" % tokens.token_hex(6), tokens.token_hex(12)
        secret = head + tail
        # (Its own memory through ctypes: the process is not dumpable, so not /proc/self/mem.
        # Anonymous memory, the heap and the stack: where a request's bytes and strings live.)
        probe = (
            "import ctypes, hashlib\n"
            "head, digest, size = %r, %r, %d\n"
            "found = 0\n"
            "with open('/proc/self/maps') as f:\n"
            "    regions = [l.split() for l in f.read().splitlines()]\n"
            "for r in regions:\n"
            "    lo, hi = (int(x, 16) for x in r[0].split('-'))\n"
            "    if not r[1].startswith('rw') or (len(r) > 5 and r[5] not in ('[heap]', '[stack]')):\n"
            "        continue\n"
            "    data = ctypes.string_at(lo, hi - lo)\n"
            "    at = data.find(head.encode())\n"
            "    while at >= 0:\n"
            "        found += hashlib.sha256(data[at:at + size]).hexdigest() == digest\n"
            "        at = data.find(head.encode(), at + 1)\n"
            "print('found', found)\n"
        ) % (head, hashlib.sha256(secret.encode()).hexdigest(), len(secret))
        self.run_fresh("1")  # the sandbox's first job: its kernel forks a standby after it
        for _ in range(2):  # each job after the secret one: the first in that job's standby
            frames, d = self.run_fresh("key = %r\nprint(len(key))" % secret, env={"API_KEY": secret})
            self.assertEqual(stream_text(frames, "stdout"), "%d\n" % len(secret))
            frames, d = self.run_fresh("import os\nprint('API_KEY' in os.environ)\n" + probe)
            self.assertEqual(stream_text(frames, "stdout"), "False\nfound 0\n", json.dumps(frames)[:2000])

    def test_each_job_gets_its_own_random_numbers(self):
        code = "import numpy, random\nprint(numpy.random.randint(0, 2**31), random.randint(0, 2**31))"
        first, _ = self.run_fresh(code)
        second, _ = self.run_fresh(code)
        a, b = stream_text(first, "stdout").split(), stream_text(second, "stdout").split()
        self.assertNotEqual(a[0], b[0], "numpy's generator repeated across jobs")
        self.assertNotEqual(a[1], b[1], "random's generator repeated across jobs")


def _huge_pages_expected():
    """Whether this kernel can collapse a process's memory into huge pages on request
    (MADV_COLLAPSE, Linux 6.1, THP not disabled); gVisor cannot."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except (OSError, ValueError):
        return False
    return (major, minor) >= (6, 1)


@contextlib.contextmanager
def logged_driver(env_extra):
    """A driver with `env_extra`, and a function returning what it logged so far (its
    diagnostics: the kernel says there what it prepared)."""
    diag = tempfile.TemporaryFile()
    driver = DriverProcess(env_extra=env_extra, stderr=diag)

    def log():
        diag.seek(0)
        return diag.read().decode("utf-8", "replace")
    try:
        yield driver, log
    finally:
        driver.close()
        diag.close()


class TestFreshPrepared(unittest.TestCase):
    """prepare: a kernel that will fork jobs prepares for them before the first (the worker asks
    it of a sandbox started for a tenant ahead of its jobs), so no job waits for that."""

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_a_prepared_kernels_first_fresh_job_already_finds_its_objects_immortal(self):
        with logged_driver({"SANDCELL_PRELOAD": "numpy"}) as (driver, log):
            self.assertEqual(driver.prepare()["type"], "prepared")
            self.assertRegex(log(), r"immortal: \d+ objects", "prepared before any job")
            probe = "import sys, numpy\nmine = object()\nprint([sys.getrefcount(o) >= 2**32 - 1 for o in (numpy, numpy.add, mine)])"
            for _ in range(2):
                frames = driver.execute(probe, fresh=True)
                self.assertEqual((done(frames)["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
                self.assertEqual(stream_text(frames, "stdout"), "[True, True, False]\n")
            said = re.findall(r"immortal: (\d+) objects", log())
        self.assertEqual(len(said), 1, "prepared once")

    def test_a_prepared_kernel_answers_ready_and_its_jobs_leave_nothing_for_the_next(self):
        driver = DriverProcess()
        try:
            prepared = driver.prepare()
            self.assertEqual((prepared["type"], prepared.get("ready")), ("prepared", True), prepared)
            frames = driver.execute("import os\nos.environ['LEFT'] = '1'\nleft = 1\nopen('/tmp/left', 'w').close()", fresh=True)
            self.assertEqual((done(frames)["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
            frames = driver.execute("import os\nprint('LEFT' in os.environ, 'left' in globals(), os.path.exists('/tmp/left'))", fresh=True)
            self.assertEqual(stream_text(frames, "stdout"), "False False False\n")
        finally:
            driver.close()

    def test_a_kernel_that_ran_a_cell_of_its_own_refuses_to_prepare(self):
        # A session's kernel holds its tenant's state: no job's process may be forked from it.
        driver = DriverProcess()
        try:
            frames = driver.execute("secret = 42")
            self.assertEqual(done(frames)["status"], "ok")
            refused = driver.prepare()
            self.assertEqual(refused["type"], "protocol_error", refused)
            self.assertIn("ran cells of its own", refused["message"])
            frames = driver.execute("print(secret)")
            self.assertEqual(stream_text(frames, "stdout"), "42\n")
        finally:
            driver.close()


class TestFreshPreparedAtStart(unittest.TestCase):
    """SANDCELL_PREPARE_AT_START=1 (the worker's warm pool): the kernel makes its preparation for
    forked jobs before ready, so the first fresh job that takes it finds it done, and a session
    that takes it instead runs as any session does."""

    PROBE = "import sys, numpy\nmine = object()\nprint([sys.getrefcount(o) >= 2**32 - 1 for o in (numpy, numpy.add, mine)])"

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_a_kernel_prepared_at_start_runs_its_first_fresh_job_prepared_and_prepares_once(self):
        with logged_driver({"SANDCELL_PRELOAD": "numpy", "SANDCELL_PREPARE_AT_START": "1"}) as (driver, log):
            self.assertRegex(log(), r"immortal: \d+ objects", "prepared before ready")
            for _ in range(2):
                frames = driver.execute(self.PROBE, fresh=True)
                self.assertEqual((done(frames)["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
                self.assertEqual(stream_text(frames, "stdout"), "[True, True, False]\n")
            said = log()
        self.assertEqual(len(re.findall(r"immortal: (\d+) objects", said)), 1, "prepared once")
        self.assertEqual(len(re.findall(r"huge pages: \d+ regions", said)), 1, "huge pages once")

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_without_it_the_first_fresh_job_runs_before_the_preparation(self):
        with logged_driver({"SANDCELL_PRELOAD": "numpy"}) as (driver, log):
            self.assertNotRegex(log(), r"immortal: ")
            frames = driver.execute(self.PROBE, fresh=True)
            self.assertEqual(stream_text(frames, "stdout"), "[False, False, False]\n")
            frames = driver.execute(self.PROBE, fresh=True)
            self.assertEqual(stream_text(frames, "stdout"), "[True, True, False]\n")

    def test_a_session_on_a_kernel_prepared_at_start_keeps_its_state_and_frees_its_own_objects(self):
        with logged_driver({"SANDCELL_PRELOAD": "numpy", "SANDCELL_PREPARE_AT_START": "1"}) as (driver, _):
            code = ("import gc, weakref, numpy\nclass Big: pass\nb = Big()\nr = weakref.ref(b)\n"
                    "total = int(numpy.arange(10).sum())")
            self.assertEqual(done(driver.execute(code))["status"], "ok")
            frames = driver.execute("del b\ngc.collect()\nprint(total, r() is None, len(numpy.ones(3)))")
            self.assertEqual((done(frames)["status"], stream_text(frames, "stdout")), ("ok", "45 True 3\n"),
                             json.dumps(frames)[:2000])
            # A prepared kernel that ran cells of its own still refuses to fork jobs.
            self.assertEqual(driver.prepare()["type"], "protocol_error")


class TestFreshPreparationBudget(unittest.TestCase):
    """The zygote's one-off preparation before its first standby (immortal objects, huge pages)
    stops at its time budget, SANDCELL_PREPARE_BUDGET_MS: with many more libraries preloaded
    it could outlast the driver's wait for that ping and cost the sandbox its reuse."""

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_a_preparation_past_its_budget_stops_there_and_the_sandbox_stays_reusable(self):
        with logged_driver({"SANDCELL_PRELOAD": "numpy,matplotlib.pyplot", "SANDCELL_PREPARE_BUDGET_MS": "1"}) as (driver, said):
            for code in ("print(1)", "print(2)", "import numpy\nprint(int(numpy.add(1, 2)))"):
                frames = driver.execute(code, fresh=True)
                self.assertEqual((done(frames)["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
            self.assertEqual(stream_text(frames, "stdout"), "3\n")
            log = said()
        stopped = re.findall(r"immortal: stopped at the time budget after (\d+) objects", log)
        self.assertEqual(len(stopped), 1, log[-2000:])
        self.assertLess(int(stopped[0]), 100000, "the walk went on past its budget")
        self.assertIn("huge pages: stopped at the time budget", log)


class TestFreshPreloaded(unittest.TestCase):
    """Fresh jobs forked from a kernel with numpy and matplotlib imported, as a one-off sandbox's
    kernel is (the worker's default also preloads pandas)."""

    @classmethod
    def setUpClass(cls):
        cls.diag = tempfile.TemporaryFile()
        cls.driver = DriverProcess(env_extra={"SANDCELL_PRELOAD": "numpy,matplotlib.pyplot"}, stderr=cls.diag)

    @classmethod
    def tearDownClass(cls):
        cls.driver.close()
        cls.diag.close()

    def run_fresh(self, code):
        frames = self.driver.execute(code, fresh=True)
        d = done(frames)
        self.assertEqual((d["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
        return stream_text(frames, "stdout")

    def test_each_job_draws_numbers_of_its_own_from_a_preloaded_numpy(self):
        # The first job is forked anew, the next ones are standbys that reseeded while waiting.
        draws = [self.run_fresh("import numpy\nprint(numpy.random.randint(0, 2**62))") for _ in range(4)]
        self.assertEqual(len(set(draws)), 4, draws)

    def test_figures_with_text_render_in_each_fresh_job(self):
        # The kernel empties matplotlib's font cache after its warm-up (forget_fonts), as each
        # forked process would at the fork: a job's figure loads its font for itself.
        for _ in range(3):
            frames = self.driver.execute(
                "import matplotlib.pyplot as plt\nplt.bar([1, 2], [2, 1])\nplt.title('sales by region')\n"
                "from matplotlib import font_manager\nplt.gcf().canvas.draw()\nprint(font_manager._get_font.cache_info().currsize)",
                fresh=True)
            self.assertEqual((done(frames)["status"], settled(frames)["reusable"]), ("ok", True), json.dumps(frames)[:2000])
            self.assertEqual(stream_text(frames, "stdout"), "1\n", "the figure's text loaded a font")
            images = [f["data"]["image/png"] for f in of_type(frames, "display_data") if "image/png" in f["data"]]
            self.assertEqual(len(images), 1, json.dumps(frames)[:2000])

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_jobs_after_the_first_find_the_kernels_objects_immortal_and_their_own_not(self):
        # Before its first standby the kernel makes every object it holds immortal: a job that
        # reads a preloaded module's objects no longer writes (and so copies) their pages.
        probe = ("import sys, json, numpy, matplotlib.pyplot as plt\n"
                 "mine = object()\n"
                 "print([sys.getrefcount(o) >= 2**32 - 1 for o in (numpy, numpy.add, json.dumps, plt.plot, mine)])")
        self.run_fresh("1")
        self.assertEqual(self.run_fresh(probe), "[True, True, True, True, False]\n")
        self.assertEqual(self.run_fresh(probe), "[True, True, True, True, False]\n")
        self.diag.seek(0)
        said = re.findall(r"immortal: (\d+) objects", self.diag.read().decode("utf-8", "replace"))
        self.assertEqual(len(said), 1, "made immortal once, before the first standby")
        self.assertGreater(int(said[0]), 100000)

    @unittest.skipUnless(IMMORTALS, "CPython 3.12 and 3.13 only")
    def test_a_job_that_drops_every_module_leaves_the_next_its_libraries(self):
        # Immortal objects are never freed: a job that lets go of them frees nothing of the
        # kernel's, and changes nothing the next job finds.
        self.run_fresh("1")
        # However that job itself ends (its own machinery may need a module it dropped).
        self.driver.execute("import sys, gc\nfor name in list(sys.modules):\n    del sys.modules[name]\n"
                            "gc.collect()\nprint('dropped')", fresh=True)
        self.assertEqual(self.run_fresh("import numpy, json\nprint(int(numpy.add(2, 3)), json.dumps([1]))"), "5 [1]\n")

    def test_the_kernel_that_forks_jobs_is_backed_by_huge_pages_after_its_first_job(self):
        if not _huge_pages_expected():
            self.skipTest("this kernel collapses no huge pages on request")
        self.run_fresh("1")
        self.run_fresh("2")  # it waited for the first standby, forked after the collapse
        # The kernel is not dumpable (no one reads its memory map without CAP_SYS_PTRACE):
        # it says what it did in the driver's log.
        self.diag.seek(0)
        said = re.findall(r"huge pages: (\d+) regions collapsed", self.diag.read().decode("utf-8", "replace"))
        self.assertEqual(len(said), 1, "collapsed once, before the first standby")
        self.assertGreater(int(said[0]), 0)
