"""Bash jobs: exit codes, the workspace, interrupts, leftovers."""

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


class TestBash(DriverTestCase):
    def test_exit_code_and_output(self):
        frames = self.driver.execute("echo hi; exit 3", language="bash")
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"]), ("error", 3))
        self.assertEqual(stream_text(frames, "stdout"), "hi\n")

    def test_runs_in_workspace(self):
        frames = self.run_ok("pwd; echo err >&2", language="bash")
        self.assertEqual(os.path.realpath(stream_text(frames, "stdout").strip()), os.path.realpath(WORKSPACE))
        self.assertEqual(stream_text(frames, "stderr"), "err\n")

    def test_stdin_is_not_the_protocol_stream(self):
        frames = self.run_ok("cat; echo eof", language="bash")
        self.assertEqual(stream_text(frames, "stdout"), "eof\n")

    def test_killed_by_signal(self):
        frames = self.driver.execute("kill -TERM $$", language="bash")
        self.assertEqual(done(frames)["exit_code"], 128 + signal.SIGTERM)

    def test_leftover_processes_killed(self):
        frames = self.run_ok("sleep 300 >/dev/null 2>&1 &\necho $!", language="bash")
        pid = int(stream_text(frames, "stdout"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _process_running(pid):
            time.sleep(0.1)
        self.assertFalse(_process_running(pid), "background sleep %d survived the job" % pid)

    def test_sigint_interrupts_bash(self):
        driver = self.driver
        req_id = driver.start("echo started; sleep 100; echo not-reached", language="bash")
        frames = []
        while "started" not in stream_text(frames, "stdout"):
            frames.append(driver.next_frame(TIMEOUT))
        time.sleep(0.3)
        started = time.monotonic()
        driver.proc.send_signal(signal.SIGINT)
        driver.collect(req_id, timeout=30, frames=frames)
        self.assertLess(time.monotonic() - started, 10)
        d = done(frames)
        self.assertEqual(d["status"], "error")
        self.assertNotIn("not-reached", stream_text(frames, "stdout"))
        self.assertAlive()


if __name__ == "__main__":
    unittest.main(verbosity=2)
