"""End-to-end tests for the sandcell driver (stdlib unittest only).

The driver runs as a subprocess of the test runner, with the same
interpreter (sys.executable), and is spoken to in framed JSON exactly as the
worker does.

    SANDCELL_DRIVER     path of driver.py      (default /opt/sandcell/driver.py)
    SANDCELL_WORKSPACE  workspace directory    (default /home/user)

On a dev machine:
    SANDCELL_DRIVER=$PWD/sandbox/driver/driver.py SANDCELL_WORKSPACE=$(mktemp -d) \
        python -m unittest sandbox/driver/test_driver.py -v
Inside the sandbox image (the script can be fed on stdin):
    docker run --rm -i ... <image> python3 - < sandbox/driver/test_driver.py
"""

import base64
import contextlib
import hashlib
import itertools
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

DRIVER = os.environ.get("SANDCELL_DRIVER", "/opt/sandcell/driver.py")
WORKSPACE = os.environ.get("SANDCELL_WORKSPACE", "/home/user")
TIMEOUT = 120  # generous: the first pandas/matplotlib import can be slow
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_ids = itertools.count(1)

# Started as root (as test.sh starts it, like the worker starts a sandbox), the runner does its
# own work as the sandbox user, and starts each driver as root, so the driver runs its kernel
# under another uid exactly as in a sandbox.
ISOLATED = os.getuid() == 0
if ISOLATED:
    os.setegid(1000)
    os.seteuid(1000)


def _driver_as_root():
    if ISOLATED:
        os.seteuid(0)
        os.setegid(0)


@contextlib.contextmanager
def _as_root():
    """Root's rights for the block: the pipes to a driver are made by root, as in a sandbox
    (where they are the container's stdio), not by the sandbox user."""
    _driver_as_root()
    try:
        yield
    finally:
        if ISOLATED:
            os.setegid(1000)
            os.seteuid(1000)


def b64(data):
    return base64.b64encode(data).decode("ascii")


class DriverProcess:
    """A driver subprocess plus a thread that parses its frames."""

    def __init__(self, env_extra=None, stderr=None):
        env = dict(os.environ)
        env["SANDCELL_WORKSPACE"] = WORKSPACE
        env.pop("SANDCELL_PRELOAD", None)  # only where a test asks for it
        env.update(env_extra or {})
        env.setdefault("MPLBACKEND", "Agg")
        # Keep tool state out of the workspace and out of the user's HOME.
        self._state = tempfile.TemporaryDirectory(prefix="sandcell-test-")
        env.setdefault("IPYTHONDIR", os.path.join(self._state.name, "ipython"))
        env.setdefault("MPLCONFIGDIR", os.path.join(self._state.name, "mpl"))
        with _as_root():
            self.proc = subprocess.Popen(
                [sys.executable, "-u", DRIVER],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env)
        self.frames = queue.Queue()
        threading.Thread(target=self._read_frames, daemon=True).start()
        self.ready = self.next_frame(TIMEOUT)

    def _read_frames(self):
        out = self.proc.stdout
        while True:
            header = out.read(4)
            if len(header) < 4:
                self.frames.put(None)
                return
            (length,) = struct.unpack(">I", header)
            payload = out.read(length)
            if len(payload) < length:
                self.frames.put(None)
                return
            self.frames.put(json.loads(payload.decode("utf-8")))

    def next_frame(self, timeout):
        try:
            frame = self.frames.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no frame from the driver within %ss" % timeout)
        if frame is None:
            raise AssertionError("driver closed its output (exit status %s)" % self.proc.poll())
        return frame

    def send_raw(self, payload):
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()

    def send(self, obj):
        self.send_raw(json.dumps(obj).encode("utf-8"))

    def start(self, code, language="python", **fields):
        req_id = "req-%d" % next(_ids)
        request = {"type": "execute", "id": req_id, "language": language, "code": code}
        request.update(fields)
        self.send(request)
        return req_id

    def collect(self, req_id, timeout=TIMEOUT, frames=None):
        """Frames of one request up to and including its final frame."""
        frames = frames if frames is not None else []
        deadline = time.monotonic() + timeout
        while True:
            frame = self.next_frame(max(deadline - time.monotonic(), 0.01))
            frames.append(frame)
            if frame.get("id") == req_id and frame["type"] in ("done", "protocol_error"):
                return frames

    def stats(self):
        req_id = "stats-%d" % next(_ids)
        self.send({"type": "stats", "id": req_id})
        frame = self.next_frame(TIMEOUT)
        assert (frame["type"], frame.get("id")) == ("stats", req_id), frame
        return frame

    def execute(self, code, language="python", **fields):
        req_id = self.start(code, language, **fields)
        frames = self.collect(req_id)
        for frame in frames:
            assert frame.get("id") == req_id, "frame without the request id: %r" % (frame,)
        return frames

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._state.cleanup()


def of_type(frames, type_):
    return [f for f in frames if f["type"] == type_]


def file_contents(frames):
    """path -> bytes of every file frame, from the file_data chunks that follow it; checks
    that each file's chunks add up to its announced size and are at most 1 MiB."""
    out, current = {}, None
    for f in frames:
        if f["type"] == "file_data":
            assert current is not None, "file_data without a file"
            chunk = base64.b64decode(f["content_b64"])
            assert 0 < len(chunk) <= 1 << 20, len(chunk)
            out[current] += chunk
            continue
        if current is not None:
            assert len(out[current]) == sizes[current], (current, len(out[current]), sizes[current])
            current = None
        if f["type"] == "file":
            current = f["path"]
            out[current] = b""
            sizes = {current: f["size"]}
    return out


def stream_text(frames, name):
    return "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == name)


def done(frames):
    last = frames[-1]
    assert last["type"] == "done", "request did not end with done: %r" % (last,)
    return last


class DriverTestCase(unittest.TestCase):
    """Most tests share one driver, which also exercises state and recovery
    across many requests in a single process."""

    driver = None

    @classmethod
    def setUpClass(cls):
        if DriverTestCase.driver is None or DriverTestCase.driver.proc.poll() is not None:
            DriverTestCase.driver = DriverProcess()

    def run_ok(self, code, language="python", **fields):
        frames = self.driver.execute(code, language, **fields)
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"]), ("ok", 0),
                         "frames: %s" % json.dumps(frames)[:2000])
        return frames

    def assertAlive(self):
        frames = self.run_ok("print('alive')")
        self.assertEqual(stream_text(frames, "stdout"), "alive\n")


class TestLifecycle(unittest.TestCase):
    def test_ready_frame_and_exit_on_eof(self):
        driver = DriverProcess()
        try:
            ready = driver.ready
            self.assertEqual(ready["type"], "ready")
            self.assertEqual(ready["driver_version"], 3)
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


class TestPython(DriverTestCase):
    def test_print(self):
        frames = self.run_ok("import math\nprint(math.sqrt(15129))")
        self.assertEqual(stream_text(frames, "stdout"), "123.0\n")
        d = done(frames)
        self.assertFalse(d["stdout_truncated"])
        self.assertFalse(d["stderr_truncated"])
        self.assertIsInstance(d["duration_ms"], (int, float))
        self.assertIsInstance(d["execution_count"], int)

    def test_state_persists_and_execute_result(self):
        self.run_ok("x = 41")
        frames = self.run_ok("x + 1")
        results = of_type(frames, "execute_result")
        self.assertEqual(len(results), 1)
        self.assertEqual(results[0]["data"]["text/plain"], "42")
        self.assertEqual(results[0]["execution_count"], done(frames)["execution_count"])
        self.assertNotIn("Out[", stream_text(frames, "stdout"))
        self.assertEqual(stream_text(frames, "stdout"), "")

    def test_trailing_semicolon_suppresses_result(self):
        frames = self.run_ok("1 + 1;")
        self.assertEqual(of_type(frames, "execute_result"), [])

    def test_dataframe_has_html(self):
        frames = self.run_ok("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
        data = of_type(frames, "execute_result")[0]["data"]
        self.assertIn("<table", data["text/html"])
        self.assertIn("a", data["text/plain"])

    def test_display_and_output_order(self):
        frames = self.run_ok(
            "from IPython.display import display, Markdown\n"
            "print('before')\n"
            "display(Markdown('**hi**'))\n"
            "print('after')\n"
            "7")
        kinds = [(f["type"], f.get("text")) for f in frames if f["type"] != "done"]
        self.assertEqual([k for k, _ in kinds], ["stream", "display_data", "stream", "execute_result"])
        self.assertEqual(kinds[0][1], "before\n")
        markdown = of_type(frames, "display_data")[0]["data"]
        self.assertEqual(markdown["text/markdown"], "**hi**")

    def test_matplotlib_figure_captured(self):
        frames = self.run_ok("import matplotlib.pyplot as plt\nplt.bar([1, 2, 3], [3, 1, 2])")
        images = [f["data"]["image/png"] for f in of_type(frames, "display_data") if "image/png" in f["data"]]
        self.assertEqual(len(images), 1)
        self.assertTrue(base64.b64decode(images[0]).startswith(PNG_SIGNATURE))
        # The figure was closed after being sent, and plt.show() on Agg is quiet.
        frames = self.run_ok("plt.plot([1, 2]); plt.show()\nprint(len(plt.get_fignums()))")
        self.assertEqual(stream_text(frames, "stdout"), "1\n")
        self.assertEqual(stream_text(frames, "stderr"), "")
        self.assertEqual(len(of_type(frames, "display_data")), 1)
        frames = self.run_ok("print(plt.get_fignums())")
        self.assertEqual(of_type(frames, "display_data"), [])
        self.assertEqual(stream_text(frames, "stdout"), "[]\n")

    def test_error_then_state_survives(self):
        self.run_ok("kept = 'still here'")
        frames = self.driver.execute("1/0")
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"]), ("error", 1))
        errors = of_type(frames, "error")
        self.assertEqual(len(errors), 1)
        self.assertEqual(errors[0]["ename"], "ZeroDivisionError")
        self.assertEqual(errors[0]["evalue"], "division by zero")
        self.assertTrue(errors[0]["traceback"])
        self.assertTrue(any("ZeroDivisionError" in line for line in errors[0]["traceback"]))
        self.assertFalse(any("\x1b" in line for line in errors[0]["traceback"]))
        # The traceback goes only to the error frame.
        self.assertEqual(stream_text(frames, "stderr"), "")
        self.assertEqual(stream_text(frames, "stdout"), "")
        frames = self.run_ok("print(kept)")
        self.assertEqual(stream_text(frames, "stdout"), "still here\n")

    def test_error_reported_even_if_ipython_formatter_fails(self):
        self.run_ok("ip = get_ipython()\n"
                    "def _broken(*args, **kwargs):\n    raise RuntimeError('formatter broke')\n"
                    "ip.InteractiveTB.structured_traceback = _broken")
        try:
            frames = self.driver.execute("raise ValueError('boom')")
        finally:
            self.run_ok("del ip.InteractiveTB.structured_traceback")
        self.assertEqual(done(frames)["exit_code"], 1)
        errors = of_type(frames, "error")
        self.assertEqual([(e["ename"], e["evalue"]) for e in errors], [("ValueError", "boom")])
        self.assertIn("ValueError: boom", errors[0]["traceback"])

    def test_syntax_error(self):
        frames = self.driver.execute("def f(:\n    pass")
        self.assertEqual(done(frames)["exit_code"], 1)
        self.assertEqual(of_type(frames, "error")[0]["ename"], "SyntaxError")
        self.assertEqual(stream_text(frames, "stderr"), "")

    def test_stderr_stream(self):
        frames = self.run_ok("import sys\nprint('oops', file=sys.stderr)")
        self.assertEqual(stream_text(frames, "stderr"), "oops\n")

    def test_os_system_and_c_level_writes_captured(self):
        frames = self.run_ok("import os\nos.system('echo hi')\nos.write(1, b'raw\\n')\n_ = os.write(2, b'rawerr\\n')")
        self.assertEqual(stream_text(frames, "stdout"), "hi\nraw\n")
        self.assertEqual(stream_text(frames, "stderr"), "rawerr\n")
        frames = self.run_ok("!echo bang")
        self.assertEqual(stream_text(frames, "stdout"), "bang\n")

    def test_stdio_restored_after_a_cell_breaks_it(self):
        self.run_ok("import os\nfd = os.open(os.devnull, os.O_WRONLY)\nos.dup2(fd, 1)\nos.dup2(fd, 2)")
        self.assertAlive()
        self.run_ok("import sys\nsys.stdout.close()\nsys.stderr = None")
        frames = self.run_ok("import sys\nprint('out')\nprint('err', file=sys.stderr)")
        self.assertEqual(stream_text(frames, "stdout"), "out\n")
        self.assertEqual(stream_text(frames, "stderr"), "err\n")

    def test_many_small_writes_are_coalesced(self):
        frames = self.run_ok("for i in range(20000):\n    print(i)")
        out = stream_text(frames, "stdout")
        self.assertEqual(out, "".join("%d\n" % i for i in range(20000)))
        self.assertLess(len(of_type(frames, "stream")), 20000)

    def test_stdout_limit(self):
        frames = self.driver.execute("print('x' * 10000)\nprint('done')", stdout_limit=100)
        d = done(frames)
        self.assertEqual(d["status"], "ok")
        self.assertTrue(d["stdout_truncated"])
        self.assertFalse(d["stderr_truncated"])
        self.assertEqual(stream_text(frames, "stdout"), "x" * 100)

    def test_limit_does_not_split_utf8(self):
        frames = self.driver.execute("print('\u00e9' * 10)", stdout_limit=5)
        self.assertEqual(stream_text(frames, "stdout"), "\u00e9\u00e9")
        self.assertTrue(done(frames)["stdout_truncated"])

    def test_binary_garbage(self):
        frames = self.run_ok(
            "import os, sys\n"
            "os.write(1, bytes(range(256)) * 16)\n"
            "sys.stdout.buffer.write(b'\\xff\\xfe\\x00 tail\\n')\n"
            "print('\\udcff lone surrogate')\n"
            "print('after')")
        out = stream_text(frames, "stdout")
        self.assertIn("\ufffd", out)
        self.assertTrue(out.endswith("after\n"), out[-50:])
        self.assertAlive()

    def test_exit_does_not_kill_driver(self):
        for code in ("exit()", "quit()"):
            frames = self.driver.execute(code)
            self.assertEqual(done(frames)["type"], "done")
            self.assertAlive()
        frames = self.driver.execute("import sys\nsys.exit(3)")
        self.assertEqual(done(frames)["exit_code"], 1)
        self.assertEqual(of_type(frames, "error")[0]["ename"], "SystemExit")
        self.assertAlive()

    def test_sigint_interrupts_cell_and_is_ignored_between_cells(self):
        driver = self.driver
        driver.proc.send_signal(signal.SIGINT)  # idle: must be ignored
        time.sleep(0.3)
        self.assertAlive()
        self.run_ok("defined_before_sigint = 'kept'")

        req_id = driver.start("print('spinning', flush=True)\nwhile True:\n    pass")
        frames = []
        while "spinning" not in stream_text(frames, "stdout"):
            frames.append(driver.next_frame(TIMEOUT))
        time.sleep(0.3)
        driver.proc.send_signal(signal.SIGINT)
        driver.collect(req_id, timeout=30, frames=frames)
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"]), ("error", 1))
        self.assertEqual(of_type(frames, "error")[0]["ename"], "KeyboardInterrupt")
        frames = self.run_ok("print(defined_before_sigint)")
        self.assertEqual(stream_text(frames, "stdout"), "kept\n")

    def test_repeated_sigint_still_reports_one_error(self):
        driver = self.driver
        for burst in (2, 5):
            req_id = driver.start(
                "from IPython.display import display\nimport sys\ni = 0\n"
                "print('spinning', flush=True)\n"
                "while True:\n    display(i); print(i); print(i, file=sys.stderr); i += 1")
            frames = []
            while "spinning" not in stream_text(frames, "stdout"):
                frames.append(driver.next_frame(TIMEOUT))
            time.sleep(0.1)
            for _ in range(burst):
                driver.proc.send_signal(signal.SIGINT)
                time.sleep(0.002)
            driver.collect(req_id, timeout=30, frames=frames)
            self.assertEqual(done(frames)["exit_code"], 1)
            self.assertEqual([e["ename"] for e in of_type(frames, "error")], ["KeyboardInterrupt"])
        time.sleep(0.2)  # let any straggling signal land between cells
        self.assertAlive()

    def test_usage_error(self):
        frames = self.driver.execute("%no_such_magic")
        self.assertEqual(done(frames)["exit_code"], 1)
        self.assertEqual(of_type(frames, "error")[0]["ename"], "UsageError")


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


def _process_running(pid):
    """True if pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class TestFiles(DriverTestCase):
    def test_input_file_round_trip(self):
        content = b"id,amount\n1,9.5\n"
        frames = self.run_ok("print(open('t_in/data/tx.csv').read(), end='')",
                             files=[{"path": "t_in/data/tx.csv", "content_b64": b64(content)}])
        self.assertEqual(stream_text(frames, "stdout"), content.decode())
        # Inputs are not echoed back as artifacts unless the job changes them.
        self.assertEqual(of_type(frames, "file"), [])
        frames = self.run_ok("cat t_in/data/tx.csv", language="bash",
                             files=[{"path": "t_in/data/tx.csv", "content_b64": b64(b"v2\n")}])
        self.assertEqual(stream_text(frames, "stdout"), "v2\n")

    def test_hostile_input_paths_refused(self):
        marker = os.path.join(WORKSPACE, "t_hostile_marker")
        for path in ("../x", "/etc/x", "a\x00b", "", "a//b", "a/./b", "a/", "x" * 256,
                     "/".join(["d"] * 2049)):
            with self.subTest(path=path[:40]):
                frames = self.driver.execute(
                    "open('t_hostile_marker', 'w').close()\nprint('RAN')",
                    files=[{"path": "t_ok.txt", "content_b64": b64(b"ok")},
                           {"path": path, "content_b64": b64(b"evil")}])
                d = done(frames)
                self.assertEqual((d["status"], d["exit_code"]), ("input_error", None))
                errors = of_type(frames, "file_error")
                self.assertEqual(len(errors), 1)
                self.assertEqual(errors[0]["path"], path)
                self.assertTrue(errors[0]["message"])
                self.assertEqual(stream_text(frames, "stdout"), "")
                self.assertFalse(os.path.exists(marker))
        self.assertFalse(os.path.exists(os.path.join(os.path.dirname(WORKSPACE.rstrip("/")), "x")))

    def test_bad_base64_refused(self):
        frames = self.driver.execute("print('RAN')", files=[{"path": "t_b64.txt", "content_b64": "!!!"}])
        self.assertEqual(done(frames)["status"], "input_error")
        self.assertEqual(len(of_type(frames, "file_error")), 1)

    def test_input_never_written_through_symlinks(self):
        with tempfile.TemporaryDirectory() as outside:
            target = os.path.join(outside, "target")
            with open(target, "w") as f:
                f.write("original")
            self.run_ok("mkdir -p t_sym && ln -sfn %s t_sym/dirlink && ln -sf %s t_sym/filelink"
                        % (outside, target), language="bash")
            for path in ("t_sym/dirlink/new", "t_sym/filelink"):
                with self.subTest(path=path):
                    frames = self.driver.execute("print('RAN')",
                                                 files=[{"path": path, "content_b64": b64(b"evil")}])
                    self.assertEqual(done(frames)["status"], "input_error")
                    self.assertEqual(of_type(frames, "file_error")[0]["path"], path)
            self.assertEqual(os.listdir(outside), ["target"])
            with open(target) as f:
                self.assertEqual(f.read(), "original")

    def test_artifacts(self):
        frames = self.run_ok(
            "import os\nos.makedirs('t_art/sub', exist_ok=True)\n"
            "open('t_art/sub/result.txt', 'w').write('hello')\n"
            "open('t_art/blob.bin', 'wb').write(bytes(range(256)))")
        files = {f["path"]: f for f in of_type(frames, "file")}
        content = file_contents(frames)
        self.assertEqual(sorted(files), ["t_art/blob.bin", "t_art/sub/result.txt"])
        self.assertEqual(content["t_art/sub/result.txt"], b"hello")
        self.assertEqual(files["t_art/sub/result.txt"]["size"], 5)
        self.assertEqual(content["t_art/blob.bin"], bytes(range(256)))
        # Unchanged on the next request: not sent again; modified: sent again.
        frames = self.run_ok("open('t_art/sub/result.txt', 'a').write('!')")
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_art/sub/result.txt"])

    def test_a_large_file_travels_in_chunks_of_at_most_one_mib(self):
        frames = self.run_ok("head -c 2621440 /dev/urandom > t_chunk.bin && sha256sum t_chunk.bin", language="bash")
        data = file_contents(frames)["t_chunk.bin"]
        self.assertEqual(len(of_type(frames, "file_data")), 3)
        self.assertEqual(hashlib.sha256(data).hexdigest(), stream_text(frames, "stdout").split()[0])

    def test_huge_rich_outputs_and_errors_are_cut_before_they_are_framed(self):
        frames = self.driver.execute("x = 'a' * (20 << 20)\nraise ValueError(x)")
        err = of_type(frames, "error")[0]
        self.assertLess(len(err["evalue"]), (64 << 10) + 100)
        self.assertTrue(err["evalue"].endswith("[truncated by sandcell]"))
        self.assertLess(sum(map(len, err["traceback"])), (1 << 20) + 1000)
        frames = self.run_ok("'b' * (20 << 20)")
        text = of_type(frames, "execute_result")[0]["data"]["text/plain"]
        self.assertLess(len(text), (4 << 20) + 100)
        self.assertTrue(text.endswith("[truncated by sandcell]"))

    def test_names_that_are_not_utf8_are_skipped_never_merged(self):
        frames = self.run_ok(
            "import os\nos.makedirs(b't_name', exist_ok=True)\n"
            "open(b't_name/a\\xff', 'wb').write(b'one')\n"
            "open(b't_name/a\\xfe', 'wb').write(b'two')\n"
            "open('t_name/ok.txt', 'w').write('fine')")
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_name/ok.txt"])
        skipped = [(f["path"], f["reason"]) for f in of_type(frames, "file_skipped")]
        self.assertEqual(skipped, [("t_name/a\ufffd", "invalid_name")] * 2)

    def test_symlink_and_fifo_skipped_never_read(self):
        frames = self.run_ok(
            "import os\nos.makedirs('t_link', exist_ok=True)\n"
            "os.symlink('/etc/passwd', 't_link/passwd')\n"
            "os.symlink('/etc', 't_link/etcdir')\n"
            "os.mkfifo('t_link/fifo')")
        skipped = {f["path"]: f["reason"] for f in of_type(frames, "file_skipped")}
        self.assertEqual(skipped, {"t_link/passwd": "not_regular_file",
                                   "t_link/etcdir": "not_regular_file",
                                   "t_link/fifo": "not_regular_file"})
        self.assertEqual(of_type(frames, "file"), [])
        self.assertNotIn("root:", json.dumps(frames))

    def test_artifact_limits(self):
        frames = self.run_ok("head -c 100 /dev/zero > t_lim_big.bin; echo small > t_lim_small.txt",
                             language="bash", max_file_bytes=50)
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_lim_big.bin": "too_large"})
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_lim_small.txt"])

        frames = self.run_ok("mkdir -p t_cnt && for i in 1 2 3; do echo $i > t_cnt/$i; done",
                             language="bash", max_artifact_files=1)
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_cnt/1"])
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_cnt/2": "limit_reached", "t_cnt/3": "limit_reached"})

        frames = self.run_ok("mkdir -p t_tot && for i in 1 2 3; do head -c 40 /dev/zero > t_tot/$i; done",
                             language="bash", max_artifact_bytes=100)
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_tot/1", "t_tot/2"])
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_tot/3": "limit_reached"})


    def test_get_files(self):
        self.run_ok("mkdir -p t_get/dir && echo one > t_get/a.txt && echo two > t_get/b.txt"
                    " && ln -s /etc/passwd t_get/link && ln -s b.txt t_get/relink && ln -s /etc t_get/etcdir",
                    language="bash")
        get_files = ["t_get/b.txt", "t_get/a.txt", "t_get/missing.txt", "t_get/link", "t_get/relink",
                     "t_get/dir", "t_get/etcdir", "t_get/etcdir/passwd", "../etc/passwd", "/etc/passwd", "t_get//b.txt",
                     "t_get/./b.txt", "", "t_get/b.txt"]
        frames = self.run_ok("open('t_get/a.txt', 'a').write('more')", get_files=get_files)
        # Changed files first (not marked, not repeated), then the requested ones in request order.
        self.assertEqual([(f["type"], f["path"], f.get("requested", f.get("reason")))
                          for f in frames if f["type"] in ("file", "file_skipped")],
                         [("file", "t_get/a.txt", None),
                          ("file", "t_get/b.txt", True),
                          ("file_skipped", "t_get/missing.txt", "not_found"),
                          ("file_skipped", "t_get/link", "not_regular_file"),
                          ("file_skipped", "t_get/relink", "not_regular_file"),
                          ("file_skipped", "t_get/dir", "not_regular_file"),
                          ("file_skipped", "t_get/etcdir", "not_regular_file"),
                          ("file_skipped", "t_get/etcdir/passwd", "not_regular_file"),
                          ("file_skipped", "../etc/passwd", "invalid_path"),
                          ("file_skipped", "/etc/passwd", "invalid_path"),
                          ("file_skipped", "t_get//b.txt", "invalid_path"),
                          ("file_skipped", "t_get/./b.txt", "invalid_path"),
                          ("file_skipped", "", "invalid_path")])
        files = {f["path"]: f for f in of_type(frames, "file")}
        content = file_contents(frames)
        self.assertEqual(content["t_get/a.txt"], b"one\nmore")
        self.assertEqual(content["t_get/b.txt"], b"two\n")
        self.assertEqual(files["t_get/b.txt"]["size"], 4)
        self.assertNotIn("root:", json.dumps(frames))
        self.assertEqual(of_type(frames, "file_list"), [])
        # Works for bash and with no code at all.
        for language in ("bash", "python"):
            frames = self.run_ok("", language=language, get_files=["t_get/a.txt"])
            self.assertEqual([(f["path"], f["requested"]) for f in of_type(frames, "file")],
                             [("t_get/a.txt", True)])

    def test_get_files_limits(self):
        self.run_ok("mkdir -p t_getlim && head -c 100 /dev/zero > t_getlim/big && echo 1 > t_getlim/1"
                    " && echo 2 > t_getlim/2", language="bash")
        frames = self.run_ok("pass", get_files=["t_getlim/big", "t_getlim/1", "t_getlim/2", "t_getlim/none"],
                             max_file_bytes=50, max_artifact_files=1)
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_getlim/1"])
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_getlim/big": "too_large", "t_getlim/2": "limit_reached",
                          "t_getlim/none": "not_found"})
        # Changed files use up the budget first.
        frames = self.run_ok("echo x > t_getlim/new", language="bash", get_files=["t_getlim/1"],
                             max_artifact_files=1)
        self.assertEqual([(f["path"], f.get("requested")) for f in of_type(frames, "file")],
                         [("t_getlim/new", None)])
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_getlim/1": "limit_reached"})
        frames = self.run_ok("pass", get_files=["t_getlim/1", "t_getlim/2"], max_artifact_bytes=3)
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_getlim/1"])
        self.assertEqual({f["path"]: f["reason"] for f in of_type(frames, "file_skipped")},
                         {"t_getlim/2": "limit_reached"})

    def test_get_and_list_files_not_processed_on_input_error(self):
        self.run_ok("echo kept > t_gie.txt", language="bash")
        frames = self.driver.execute("print('RAN')", files=[{"path": "../t_gie_bad", "content_b64": ""}],
                                     get_files=["t_gie.txt"], list_files=True)
        self.assertEqual(done(frames)["status"], "input_error")
        self.assertEqual([f["type"] for f in frames], ["file_error", "done"])

    def test_list_files(self):
        frames = self.run_ok(
            "mkdir -p t_ls/sub t_ls/__pycache__ t_ls/.cache .cache && echo hello > t_ls/sub/f.txt"
            " && : > t_ls/empty && echo x > t_ls/__pycache__/m.pyc && echo x > t_ls/.cache/kept"
            " && echo x > .cache/t_ls_hidden && ln -s /etc/passwd t_ls/link && ln -s /etc t_ls/etclink"
            " && ln -s sub t_ls/sublink && mkfifo t_ls/fifo",
            language="bash", list_files=True)
        # After the file frames, just before done.
        self.assertEqual([f["type"] for f in frames][-2:], ["file_list", "done"])
        self.assertEqual(len(of_type(frames, "file_list")), 1)
        self.assertLess(max(i for i, f in enumerate(frames) if f["type"] == "file"), len(frames) - 2)
        listing = frames[-2]
        self.assertFalse(listing["truncated"])
        paths = [e["path"] for e in listing["entries"]]
        self.assertEqual(paths, sorted(paths))
        self.assertEqual(len(paths), len(set(paths)))
        self.assertEqual([p for p in paths if p.startswith("t_ls/")],
                         ["t_ls/.cache/kept", "t_ls/empty", "t_ls/sub/f.txt"])
        self.assertFalse([p for p in paths if p.startswith((".cache/", "__pycache__/")) or "/__pycache__/" in p])
        entries = {e["path"]: e for e in listing["entries"]}
        self.assertEqual(set(entries["t_ls/sub/f.txt"]), {"path", "size", "mtime"})
        self.assertEqual(entries["t_ls/sub/f.txt"]["size"], 6)
        self.assertEqual(entries["t_ls/empty"]["size"], 0)
        mtime = entries["t_ls/sub/f.txt"]["mtime"]
        self.assertIsInstance(mtime, float)
        self.assertLess(abs(mtime - time.time()), 60)
        self.assertEqual(mtime, round(mtime, 3))
        self.assertNotIn("root:", json.dumps(frames))

    def test_list_files_truncated(self):
        try:
            frames = self.run_ok("mkdir -p t_many && cd t_many && for i in $(seq 1000 2000); do : > f$i; done",
                                 language="bash", list_files=True, max_artifact_files=0)
            listing = of_type(frames, "file_list")[0]
            self.assertTrue(listing["truncated"])
            paths = [e["path"] for e in listing["entries"]]
            self.assertEqual(len(paths), 1000)
            self.assertEqual(paths, sorted(paths))
        finally:
            self.run_ok("rm -rf t_many", language="bash")


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


class TestIsolation(DriverTestCase):
    """User code runs in a kernel process under the sandbox user; the driver, which speaks
    to the worker, is out of its reach."""

    def setUp(self):
        if not ISOLATED:
            self.skipTest("the driver is not started as root here")

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
            "import stat\n"
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


class TestProtocol(DriverTestCase):
    def test_malformed_requests(self):
        driver = self.driver
        driver.send_raw(b"this is not json")
        frame = driver.next_frame(TIMEOUT)
        self.assertEqual(frame["type"], "protocol_error")
        self.assertTrue(frame["message"])

        driver.send_raw(b"\xff\xfe")
        self.assertEqual(driver.next_frame(TIMEOUT)["type"], "protocol_error")

        driver.send({"type": "bogus", "id": "b1"})
        frame = driver.next_frame(TIMEOUT)
        self.assertEqual((frame["type"], frame.get("id")), ("protocol_error", "b1"))

        for bad in ({"type": "execute", "id": "b2", "language": "python"},
                    {"type": "execute", "id": "b3", "language": "cobol", "code": ""},
                    {"type": "execute", "id": "b4", "language": "python", "code": "", "stdout_limit": -1},
                    {"type": "execute", "id": "b5", "language": "python", "code": "", "get_files": "a.txt"},
                    {"type": "execute", "id": "b6", "language": "python", "code": "", "get_files": ["a", 1]},
                    {"type": "execute", "id": "b7", "language": "python", "code": "",
                     "get_files": ["f%d" % i for i in range(65)]},
                    {"type": "execute", "id": "b8", "language": "python", "code": "", "list_files": "yes"},
                    {"type": "stats", "id": 5}):
            driver.send(bad)
            frame = driver.next_frame(TIMEOUT)
            expected_id = bad["id"] if isinstance(bad["id"], str) else None
            self.assertEqual((frame["type"], frame.get("id")), ("protocol_error", expected_id))
        self.assertAlive()


if __name__ == "__main__":
    unittest.main(verbosity=2)
