"""What a cell leaves behind: processes killed, stats, a full workspace."""

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
from harness import _process_running  # noqa: F401


class TestStats(DriverTestCase):
    def test_stats(self):
        driver = self.driver
        stats = driver.stats()
        self.assertEqual(set(stats), {"type", "id", "rss_kb", "children"})
        self.assertGreater(stats["rss_kb"], 10000)  # an IPython process is tens of MB
        self.assertIsInstance(stats["children"], int)
        self.assertAlive()

    def test_processes_left_by_a_python_cell_are_killed_when_it_ends(self):
        base = self.driver.stats()["children"]  # other drivers of this test run
        # A plain child, and a daemon that double-forked away from the driver.
        frames = self.run_ok(
            "import os, subprocess\n"
            "_sleeper = subprocess.Popen(['sleep', '300'])\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        os.execvp('sleep', ['sleep', '301'])\n"
            "    os._exit(0)\n"
            "os.wait()\n"
            "import time; time.sleep(0.3)")
        self.assertEqual(done(frames)["processes_killed"], 2)
        self.assertEqual(self.driver.stats()["children"], base)
        # The cell's Popen object still works: the child is gone.
        self.run_ok("assert _sleeper.wait(5) is not None")

    def test_a_forked_kernel_cannot_speak_the_protocol(self):
        # The child finishes the cell too; neither its output frames nor its
        # done may reach the worker, and it must not serve the next request.
        # (Its plain output is captured like any subprocess's.)
        frames = self.run_ok("import os, time\npid = os.fork()\nif pid == 0:\n    raise RuntimeError('from the child')\ntime.sleep(0.3)")
        self.assertEqual(len([f for f in frames if f["type"] == "done"]), 1)
        self.assertEqual([f for f in frames if f["type"] == "error"], [])
        self.assertAlive()
        self.assertAlive()

    def test_a_setsid_background_bash_process_is_killed(self):
        base = self.driver.stats()["children"]
        frames = self.run_ok("setsid sleep 300 >/dev/null 2>&1 < /dev/null &\nsleep 0.3", language="bash")
        self.assertEqual(done(frames)["processes_killed"], 1)
        self.assertEqual(self.driver.stats()["children"], base)

    def test_a_process_whose_name_is_not_text_is_killed_too(self):
        # A process name may hold any byte but NUL; read from /proc/<pid>/stat as UTF-8 text,
        # "\\xff" failed to decode and the process was skipped by every scan: it outlived its
        # cell, uncounted.
        base = self.driver.stats()["children"]
        frames = self.run_ok(
            "import ctypes, os, time\n"
            "if os.fork() == 0:\n"
            "    ctypes.CDLL(None).prctl(15, b'\\xff\\xfehidden', 0, 0, 0)\n"
            "    time.sleep(300)\n"
            "    os._exit(0)\n"
            "time.sleep(0.3)")
        self.assertEqual(done(frames)["processes_killed"], 1, frames)
        self.assertEqual(self.driver.stats()["children"], base)

    def test_a_cell_that_leaves_nothing_running_kills_nothing(self):
        self.assertEqual(done(self.run_ok("1 + 1"))["processes_killed"], 0)
        self.assertFalse(done(self.run_ok("1 + 1"))["workspace_full"])

    def test_a_full_workspace_is_reported(self):
        # Fill the workspace in chunks, catching the error: the free space tells.
        frames = self.run_ok(
            "import os\n"
            "fd = os.open('fill.bin', os.O_WRONLY | os.O_CREAT)\n"
            "off = 0\n"
            "try:\n"
            "    while True:\n"
            "        os.posix_fallocate(fd, off, 8 << 20); off += 8 << 20\n"
            "except OSError:\n"
            "    pass\n"
            "try:\n"
            "    while True:\n"
            "        os.posix_fallocate(fd, off, 64 << 10); off += 64 << 10\n"
            "except OSError:\n"
            "    pass\n"
            "os.close(fd)", max_file_bytes=1)
        self.assertTrue(done(frames)["workspace_full"])
        # Freed again: no longer full.
        self.assertFalse(done(self.run_ok("import os; os.remove('fill.bin')"))["workspace_full"])

    def test_an_enospc_exception_is_reported_as_workspace_full(self):
        frames = self.driver.execute(
            "import os\n"
            "fd = os.open('big.bin', os.O_WRONLY | os.O_CREAT)\n"
            "try:\n"
            "    os.posix_fallocate(fd, 0, 1 << 40)\n"
            "finally:\n"
            "    os.close(fd); os.remove('big.bin')")
        self.assertEqual(done(frames)["status"], "error")
        self.assertTrue(done(frames)["workspace_full"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
