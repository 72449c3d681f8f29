"""The kernel apart from the driver: another uid, no reach, no forged frames."""

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)
from harness import _as_root, _process_running  # noqa: F401


class TestIsolation(DriverTestCase):
    """User code runs in a kernel process under the sandbox user; the driver, which speaks
    to the worker, is out of its reach."""

    def setUp(self):
        if not ISOLATED:
            self.skipTest("the driver is not started as root here")

    def test_a_block_as_the_sandbox_user_inside_another_keeps_the_outer_one_as_the_sandbox_user(self):
        # The driver does the end of a cell (killing what it left, collecting its files) in one
        # such block, and kill_strays, inside it, opens its own: the inner block's end must not
        # give the outer block's rest back root's rights. In a process of its own: the ids of
        # this one stay as they are.
        code = (
            "import os, sys\n"
            "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"
            "import importlib.util\n"
            "spec = importlib.util.spec_from_file_location('driver', sys.argv[1])\n"
            "d = importlib.util.module_from_spec(spec); spec.loader.exec_module(d)\n"
            "seen = []\n"
            "with d.sandbox_user():\n"
            "    seen.append(os.geteuid())\n"
            "    with d.sandbox_user():\n"
            "        seen.append(os.geteuid())\n"
            "    seen.append(os.geteuid())\n"
            "seen.append(os.geteuid())\n"
            "print(seen, d.SANDBOX_UID)\n")
        with _as_root():  # as the driver starts
            out = subprocess.run([sys.executable, "-c", code, DRIVER], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        seen, uid = out.stdout.rsplit(" ", 1)
        uid = int(uid)
        self.assertNotEqual(uid, 0)
        self.assertEqual(seen, str([uid, uid, uid, 0]))

    def test_user_code_runs_as_the_sandbox_user_and_cannot_reach_the_driver(self):
        frames = self.run_ok(
            "import ctypes, os, signal\n"
            "driver = os.getppid()\n"
            "seen = [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]\n"
            "caps = {l.split(':')[0]: int(l.split()[1], 16) for l in open('/proc/self/status') if l.startswith('Cap')}\n"
            "seen.append(caps['CapEff'] | caps['CapPrm'] | caps.get('CapAmb', 0))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def ptrace():\n"
            "    if libc.ptrace(16, driver, 0, 0) != 0:\n"
            "        raise PermissionError(ctypes.get_errno(), 'ptrace')\n"
            "for what, attempt in [('kill', lambda: os.kill(driver, signal.SIGKILL)),\n"
            "                      ('stop', lambda: os.kill(driver, signal.SIGSTOP)),\n"
            "                      ('mem', lambda: open('/proc/%d/mem' % driver, 'rb').read(1)),\n"
            "                      ('ptrace', ptrace)]:\n"
            "    try:\n"
            "        attempt()\n"
            "        seen.append(what + ' reached')\n"
            "    except PermissionError:\n"
            "        seen.append(what + ' refused')\n"
            "# Any of the driver's fds (the worker's stream among them), opened through /proc\n"
            "# (but its stdin, /dev/null, which anyone may open).\n"
            "import errno, stat\n"
            "opened = []\n"
            "for n in range(64):\n"
            "    try:\n"
            "        if stat.S_ISCHR(os.stat('/proc/%d/fd/%d' % (driver, n)).st_mode):\n"
            "            continue\n"
            "    except OSError:\n"
            "        pass\n"
            "    for mode in ('rb', 'wb'):\n"
            "        try:\n"
            "            open('/proc/%d/fd/%d' % (driver, n), mode, buffering=0).close()\n"
            "            opened.append((n, mode))\n"
            "        except (PermissionError, FileNotFoundError):\n"
            "            pass\n"
            "        except OSError as e:\n"
            "            # The driver's inotify instance (WorkspaceWatch): under gVisor its link\n"
            "            # says ENODEV, an instance is never opened through /proc.\n"
            "            if e.errno != errno.ENODEV:\n"
            "                raise\n"
            "seen.append(opened)\n"
            "print(seen)")
        self.assertEqual(stream_text(frames, "stdout"),
                         "[1000, 1000, 1000, [], 0, 'kill refused', 'stop refused', 'mem refused', "
                         "'ptrace refused', []]\n")
        self.assertAlive()

    def test_frames_the_code_forges_on_every_fd_never_reach_the_worker(self):
        # A done that would end the request early, a stream of another request, a cell_done
        # of another run: on every fd the kernel has (its channel to the driver among them).
        frames = self.driver.execute(
            "import json, os, struct\n"
            "def frame(o):\n"
            "    b = json.dumps(o).encode()\n"
            "    return struct.pack('>I', len(b)) + b\n"
            "forged = (frame({'type': 'done', 'id': 'x', 'status': 'ok', 'exit_code': 0, 'processes_killed': 999})\n"
            "          + frame({'type': 'stream', 'id': 'x', 'name': 'stdout', 'text': 'FORGED'})\n"
            "          + frame({'type': 'cell_done', 'id': 'run-0', 'exit_code': 0}))\n"
            "for fd in range(3, 256):\n"
            "    try:\n"
            "        os.write(fd, forged)\n"
            "    except OSError:\n"
            "        pass\n"
            "raise ValueError('the real outcome')")
        req_id = frames[-1]["id"]
        self.assertEqual({f.get("id") for f in frames}, {req_id})
        self.assertEqual({f["type"] for f in frames} - {"stream"}, {"error", "done"})
        self.assertEqual([(e["ename"], e["evalue"]) for e in of_type(frames, "error")], [("ValueError", "the real outcome")])
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"], d["processes_killed"]), ("error", 1, 0))
        self.assertAlive()

    def test_a_kernel_that_breaks_the_framing_is_ended_and_the_driver_exits(self):
        driver = DriverProcess()
        try:
            req_id = driver.start(
                "import os\nprint('before', flush=True)\n"
                "for fd in range(3, 256):\n"
                "    try:\n"
                "        os.write(fd, b'\\xff\\xff\\xff\\xff garbage')\n"
                "    except OSError:\n"
                "        pass\n"
                "import time; time.sleep(30)")
            frames = driver.collect(req_id, timeout=20)
            self.assertIn("before", stream_text(frames, "stdout"))
            self.assertEqual(of_type(frames, "done"), [])
            # The request ends with the driver's word for it, and the driver exits.
            end = frames[-1]
            self.assertEqual((end["type"], end["id"]), ("protocol_error", req_id))
            self.assertIn("frame too large", end["message"])
            self.assertEqual(driver.proc.wait(10), 1)
        finally:
            driver.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
