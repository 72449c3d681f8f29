"""The harness of the driver's tests (stdlib unittest only): a driver
subprocess spoken to in framed JSON exactly as the worker does, and helpers
to read its frames.  One test module per part of the driver:
test_lifecycle (start-up, preload), test_python, test_bash, test_files
(workspace), test_processes (strays, stats, a full workspace),
test_isolation (the kernel apart from the driver), test_protocol.

    SANDCELL_DRIVER     path of driver.py      (default /opt/sandcell/driver.py)
    SANDCELL_WORKSPACE  workspace directory    (default /home/user)

On a dev machine:
    SANDCELL_DRIVER=$PWD/sandbox/driver/driver.py SANDCELL_WORKSPACE=$(mktemp -d) \
        python3 -m unittest discover -s sandbox/driver/tests -v
Inside the sandbox image, as deploy/local/test.sh runs them:
    docker run --rm -v $PWD/sandbox/driver/tests:/tests:ro ... <image> \
        python3 -m unittest discover -s /tests -v
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

    def collect(self, req_id, timeout=TIMEOUT, frames=None, fresh=False):
        """Frames of one request up to and including its final frame (of a
        fresh request: settled, after done)."""
        frames = frames if frames is not None else []
        final = ("settled", "protocol_error") if fresh else ("done", "protocol_error")
        deadline = time.monotonic() + timeout
        while True:
            frame = self.next_frame(max(deadline - time.monotonic(), 0.01))
            frames.append(frame)
            if frame.get("id") == req_id and frame["type"] in final:
                return frames

    def stats(self):
        req_id = "stats-%d" % next(_ids)
        self.send({"type": "stats", "id": req_id})
        frame = self.next_frame(TIMEOUT)
        assert (frame["type"], frame.get("id")) == ("stats", req_id), frame
        return frame

    def prepare(self):
        """The prepare request's answer (prepared, or protocol_error)."""
        req_id = "prepare-%d" % next(_ids)
        self.send({"type": "prepare", "id": req_id})
        frame = self.next_frame(TIMEOUT)
        assert frame.get("id") == req_id, frame
        return frame

    def execute(self, code, language="python", **fields):
        req_id = self.start(code, language, **fields)
        frames = self.collect(req_id, fresh=fields.get("fresh") is True)
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


def children_of(pid):
    """The pids of pid's child processes, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def running_children_of(pid):
    """The pids of pid's child processes that can still run code: neither zombies nor killed
    and exiting (a fresh job's process may still be being torn down once the job settled)."""
    kids = []
    for kid in children_of(pid):
        try:
            with open("/proc/%d/stat" % kid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and not int(fields[6]) & 0x4:  # PF_EXITING
            kids.append(kid)
    return kids


def is_zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


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
    """The request's done frame: its last, or (a fresh request) the one before settled."""
    last = frames[-1]
    if last["type"] == "settled" and len(frames) > 1:
        last = frames[-2]
    assert last["type"] == "done", "request did not end with done: %r" % (last,)
    return last


def settled(frames):
    """A fresh request's settled frame, its last, right after done."""
    assert len(frames) > 1 and frames[-2]["type"] == "done", "no done before the end: %r" % (frames[-2:],)
    assert frames[-1]["type"] == "settled", "request did not end with settled: %r" % (frames[-1],)
    return frames[-1]


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


def _process_running(pid):
    """True if pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
