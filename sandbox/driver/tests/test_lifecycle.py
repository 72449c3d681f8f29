"""The driver starts, reports ready, preloads, and exits on EOF."""

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


class TestLifecycle(unittest.TestCase):
    def test_ready_frame_and_exit_on_eof(self):
        driver = DriverProcess()
        try:
            ready = driver.ready
            self.assertEqual(ready["type"], "ready")
            self.assertEqual(ready["driver_version"], 6)
            self.assertEqual(ready["kernel_isolated"], ISOLATED)
            self.assertEqual(ready["python"].split(".")[:2], [str(sys.version_info[0]), str(sys.version_info[1])])
            self.assertTrue(ready["ipython"].startswith("8."), ready)
            self.assertEqual(ready["preloaded"], [])
            self.assertIsInstance(ready["startup_ms"], (int, float))
            self.assertGreater(ready["startup_ms"], 0)
            driver.proc.stdin.close()
            self.assertEqual(driver.proc.wait(20), 0)
        finally:
            driver.close()


class TestKernelGoneBetweenRequests(unittest.TestCase):
    """A kernel killed while the driver waits for a request (the host's OOM killer, an
    operator): the driver ends at once, so the worker finds the sandbox gone before it hands
    it a job, instead of the job failing on a dead kernel."""

    def kernel_killed_while_idle_ends_the_driver(self, first_request):
        driver = DriverProcess()
        try:
            frames = driver.execute(first_request["code"], **first_request.get("fields", {}))
            self.assertEqual(done(frames)["status"], "ok", frames)
            kernels = children_of(driver.proc.pid)
            self.assertEqual(len(kernels), 1, kernels)
            time.sleep(0.2)  # idle: waiting for the next request
            os.kill(kernels[0], signal.SIGKILL)
            # No request is sent: the driver ends by itself, saying the kernel was killed.
            self.assertEqual(driver.proc.wait(5), 128 + signal.SIGKILL)
        finally:
            driver.close()

    def test_a_session_kernel_killed_between_cells_ends_the_driver_at_once(self):
        self.kernel_killed_while_idle_ends_the_driver({"code": "x = 1"})

    def test_a_zygote_killed_between_fresh_jobs_ends_the_driver_at_once(self):
        # After a fresh job the zygote has forked the next job's process: killed alone, the
        # zygote leaves it behind, and the driver must not wait for it.
        self.kernel_killed_while_idle_ends_the_driver({"code": "1", "fields": {"fresh": True}})


class TestPreload(unittest.TestCase):
    def test_preloaded_modules_are_imported_not_bound(self):
        # A workspace module that kills its importer: preloading must survive it.
        boom = os.path.join(WORKSPACE, "t_preload_boom.py")
        with open(boom, "w") as f:
            f.write("raise SystemExit(3)\n")
        spec = " wave, no_such_module_sandcell ,.relative,,t_preload_boom,wave,matplotlib.pyplot"
        with tempfile.TemporaryFile() as diag:
            driver = DriverProcess({"SANDCELL_PRELOAD": spec}, stderr=diag)
            try:
                self.assertEqual(driver.ready["preloaded"], ["wave", "matplotlib.pyplot"])
                self.assertGreater(driver.ready["startup_ms"], 0)
                frames = driver.execute(
                    "import sys\nprint(all(m in sys.modules for m in ('wave', 'matplotlib.pyplot')),"
                    " [n for n in ('wave', 'plt', 'matplotlib', 'pyplot') if n in dir()])")
                self.assertEqual(stream_text(frames, "stdout"), "True []\n")
                # The warm-up render left pyplot untouched: the cell's figure is number 1.
                frames = driver.execute("import matplotlib.pyplot as plt\nplt.plot([1, 2])\n"
                                        "print(plt.get_fignums())")
                self.assertEqual(stream_text(frames, "stdout"), "[1]\n")
                images = [f for f in of_type(frames, "display_data") if "image/png" in f["data"]]
                self.assertEqual(len(images), 1)
            finally:
                driver.close()
                os.remove(boom)
            diag.seek(0)
            log = diag.read().decode("utf-8", "replace")
        for name in ("no_such_module_sandcell", ".relative", "t_preload_boom"):
            self.assertIn("preload of %r failed" % name, log)


PREBUILT_FONT_LIST = "/usr/local/share/sandcell/matplotlib"


class TestFontList(unittest.TestCase):
    @unittest.skipUnless(os.path.isdir(PREBUILT_FONT_LIST), "not in the sandbox image")
    def test_a_kernel_starts_with_the_images_font_list_in_its_matplotlib_directory(self):
        # The image's build leaves matplotlib's font list; each kernel copies it into its own
        # (empty) MPLCONFIGDIR, so that its first matplotlib import does not scan every font.
        # Nothing here imports matplotlib: the kernel itself put the list there.
        config = "/tmp/sandcell-test-mpl-%d" % os.getpid()
        driver = DriverProcess({"SANDCELL_PRELOAD": "", "MPLCONFIGDIR": config})
        try:
            frames = driver.execute("import sys, os\nprint('matplotlib' in sys.modules, sorted(os.listdir(%r)))" % config)
        finally:
            driver.close()
        listed = sorted(n for n in os.listdir(PREBUILT_FONT_LIST) if n.startswith("fontlist-"))
        self.assertEqual(len(listed), 1, listed)
        self.assertEqual(stream_text(frames, "stdout"), "False %r\n" % listed)
        with open(os.path.join(config, listed[0]), "rb") as copied, open(os.path.join(PREBUILT_FONT_LIST, listed[0]), "rb") as built:
            self.assertEqual(copied.read(), built.read())


if __name__ == "__main__":
    unittest.main(verbosity=2)
