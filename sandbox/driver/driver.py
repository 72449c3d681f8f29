"""sandcell in-container driver.

Runs inside the sandbox container as ``python3 -u /opt/sandcell/driver.py``
and executes jobs for the worker, which talks to it over the container's
attached stdin/stdout (no TTY).

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
ready           {"driver_version": 1, "python": "3.11.2", "ipython": "8.5.0",
                 "preloaded": [module names], "startup_ms": float}
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
                answer to a stats request: the driver's VmRSS, and how many
                live (non-zombie) processes the container has besides the
                driver and PID 1.
done            {"id", "status": "ok"|"error"|"input_error",
                 "exit_code": int|null, "stdout_truncated", "stderr_truncated",
                 "execution_count", "duration_ms", "processes_killed",
                 "workspace_full"}
                the last frame of a request.  exit_code: python 0/1; bash
                the exit status (128+N if killed by signal N); null for
                input_error.  execution_count: the cell's IPython number
                (for bash/input_error: the last python cell's, 0 if none).
                duration_ms: time spent running the code.
                processes_killed: processes the code left running (a
                background sleep, a daemonized child) that were killed
                when it ended: after a request, only the driver and PID 1
                are alive.  workspace_full: the workspace or /tmp had less
                than 1% (at least 64 KiB) free after the code ran, or the
                code's exception was ENOSPC.
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
                 "get_files": [path], "list_files": bool}
                "id" is opaque and echoed as "id" on every frame of the
                request.  Only id/language/code are required.
                get_files: at most 64 workspace-relative paths to send
                after the code ran even if unchanged, in this order, after
                the new/changed files and under the same limits (a repeated
                path is sent once).  list_files: send a file_list.  Neither
                is done for an input_error.
stats           {"id"}
                answered with one stats frame (no done).  Like any request
                it is read only once the previous one is finished.

Frames of one execute request are either
    file_error+, done(status "input_error")        (code not run), or
    (stream | execute_result | display_data | error)*  in the order produced,
    (file | file_skipped)*  (changed files sorted by path, then get_files),
    file_list?,  done.
Requests are handled one at a time; python state persists between them.
EOF on stdin makes the driver exit with status 0.  SIGINT interrupts a
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
"""

import base64
import codecs
import contextlib
import ctypes
import errno
import heapq
import importlib
import io
import json
import os
import platform
import re
import secrets
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback

# Start of the driver script, for "startup_ms" in the ready frame.
STARTED_AT = time.monotonic()

DRIVER_VERSION = 2
WORKSPACE = os.environ.get("SANDCELL_WORKSPACE", "/home/user")

DEFAULT_LIMITS = {
    "stdout_limit": 1048576,
    "stderr_limit": 1048576,
    "max_file_bytes": 52428800,
    "max_artifact_files": 100,
    "max_artifact_bytes": 104857600,
}
# A request carries its input files inline; anything bigger than this is
# certainly not a request we want to hold in memory.
MAX_REQUEST_BYTES = 1 << 30
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# Most entries in an execute request's get_files.
MAX_GET_FILES = 64
# Most entries in a file_list frame.
MAX_LIST_ENTRIES = 1000
# Output files travel in chunks of this many bytes (one file_data frame each), so
# no frame the worker must buffer is larger than a few MiB.
FILE_CHUNK_BYTES = 1 << 20
# Longest value of a rich output (a repr, an HTML table, a base64 PNG) sent to the
# worker; a longer text is cut with TRUNCATION_MARKER, a longer image dropped.
MAX_DISPLAY_VALUE_BYTES = 4 << 20
# Longest frame the driver sends (the worker refuses longer ones: MAX_FRAME_BYTES in
# worker/src/sandbox/frames.rs is 32 MiB).  Only a rich output can come near it (its
# values JSON-escaped); one that does not fit is replaced by a note.
MAX_FRAME_BYTES = 24 << 20
# Longest exception message, and longest traceback (all lines together).
MAX_EVALUE_BYTES = 64 << 10
MAX_TRACEBACK_BYTES = 1 << 20
TRUNCATION_MARKER = "\n\u2026[truncated by sandcell]"

KEPT_MIME_TYPES = (
    "text/plain",
    "text/html",
    "text/markdown",
    "image/png",
    "image/svg+xml",
    "application/json",
)
# Tool/cache directories that are never job artifacts.  Top-level dot-dirs
# only appear if HOME-relative defaults are used (the image points
# MPLCONFIGDIR/IPYTHONDIR at /tmp); __pycache__ appears when a cell imports a
# module the job wrote into the workspace.
SKIPPED_TOP_DIRS = {".ipython", ".jupyter", ".cache", ".config", ".local", ".matplotlib"}
SKIPPED_DIRS = {"__pycache__"}

# How long to wait for a capture pipe to drain; only a wedged protocol
# channel can make this take more than milliseconds.
SYNC_TIMEOUT_S = 10.0
# Grace period between SIGINT and SIGKILL for an interrupted bash job.
BASH_INTERRUPT_GRACE_S = 2.0


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _safe_str(value):
    try:
        return str(value)
    except BaseException:  # a hostile __str__ must not break reporting
        return "<unprintable %s object>" % type(value).__name__


# --------------------------------------------------------------------------
# SIGINT policy
# --------------------------------------------------------------------------


class InterruptGate:
    """Decides what SIGINT means at any moment.

    * no cell running: ignored (the driver must survive stray interrupts);
    * a cell running: KeyboardInterrupt in the main thread, as in plain
      Python, so the cell is interrupted and IPython reports it;
    * inside a protected section of driver code (writing a frame, syncing
      the capture pipes) the interrupt is deferred to the end of the
      section, so a frame can never be half-written;
    * while the shell reports an exception (quiet section) it is dropped:
      the cell is already ending, and a second KeyboardInterrupt there
      would make IPython lose the error report.
    Python runs signal handlers only in the main thread, so the state here is
    only touched by the main thread.
    """

    def __init__(self):
        self.armed = False
        self.pending = False
        self._depth = 0

    def install(self):
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if not self.armed:
            return
        if self._depth:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def cell(self):
        """Arm for user code; re-entrant (a cell may run nested cells)."""
        was_armed = self.armed
        if not was_armed:
            self.pending = False
        self.armed = True
        try:
            yield
        finally:
            self.armed = was_armed
            if not was_armed:
                self.pending = False

    @contextlib.contextmanager
    def protected(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self.pending and self.armed:
                self.pending = False
                raise KeyboardInterrupt

    @contextlib.contextmanager
    def quiet(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.pending = False


GATE = InterruptGate()


# --------------------------------------------------------------------------
# Protocol channel
# --------------------------------------------------------------------------


class Channel:
    """Framed JSON over private fds; frame writes are serialized."""

    def __init__(self, in_fd, out_fd, diag_fd):
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.diag_fd = diag_fd
        self._lock = threading.Lock()
        # A process forked from the kernel (os.fork, multiprocessing) inherits
        # these fds.  Only the driver itself may speak the protocol, or a
        # fork bomb's children would interleave frames and read requests.
        self.owner = os.getpid()
        os.register_at_fork(after_in_child=self._disown)

    def _disown(self):
        for fd in (self.in_fd, self.out_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def send(self, frame):
        if os.getpid() != self.owner:
            return  # a forked child: it has no voice
        payload = self._encode(frame)
        if len(payload) > MAX_FRAME_BYTES and frame.get("type") in ("execute_result", "display_data"):
            note = "<%s of %d bytes not shown: larger than %d bytes once encoded>" % (
                frame["type"], len(payload), MAX_FRAME_BYTES)
            payload = self._encode(dict(frame, data={"text/plain": note}))
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError("frame too large (%d bytes)" % len(payload))
        data = struct.pack(">I", len(payload)) + payload
        with GATE.protected(), self._lock:
            _write_all(self.out_fd, data)

    @staticmethod
    def _encode(frame):
        # ensure_ascii=False keeps frames compact; "replace" turns lone
        # surrogates (possible in user strings) into "?" so the output is
        # always valid UTF-8 for the Rust side.
        payload = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
        return payload.encode("utf-8", "replace")

    def recv(self):
        """Return the next frame's payload, or None on EOF."""
        if os.getpid() != self.owner:
            # A forked child that finished the cell it was forked in: it must
            # not serve requests.
            os._exit(0)
        header = self._read_exact(4)
        if header is None:
            return None
        (length,) = struct.unpack(">I", header)
        if length > MAX_REQUEST_BYTES:
            # Keep the stream in sync by discarding the body, then complain.
            self._discard(length)
            raise ValueError("request frame too large (%d bytes)" % length)
        payload = self._read_exact(length)
        if payload is None:
            return None
        return payload

    def _read_exact(self, n):
        chunks = bytearray()
        while len(chunks) < n:
            chunk = os.read(self.in_fd, min(n - len(chunks), 1 << 20))
            if not chunk:
                if chunks:
                    self.log("EOF in the middle of a frame")
                return None
            chunks += chunk
        return bytes(chunks)

    def _discard(self, n):
        while n > 0:
            chunk = os.read(self.in_fd, min(n, 1 << 20))
            if not chunk:
                return
            n -= len(chunk)

    def log(self, message):
        try:
            _write_all(self.diag_fd, ("sandcell-driver: %s\n" % message).encode("utf-8", "replace"))
        except OSError:
            pass


# --------------------------------------------------------------------------
# Output capture
# --------------------------------------------------------------------------

# Sync tokens are written into a capture pipe by the driver; when the reader
# sees one, everything written before it has been framed.  A pipe write of
# fewer than PIPE_BUF bytes is atomic, so a token never interleaves with
# other writers' bytes.
SYNC_PREFIX = b"\x00\x1bsandcell-sync:"
SYNC_LEN = len(SYNC_PREFIX) + 32 + 1  # 32 hex digits and a closing NUL
READ_CHUNK = 65536
COALESCE_S = 0.005


def _is_sync_token(candidate):
    body = candidate[len(SYNC_PREFIX):-1]
    return (
        len(candidate) == SYNC_LEN
        and candidate.endswith(b"\x00")
        and all(c in b"0123456789abcdef" for c in body)
    )


def _partial_prefix_len(buf):
    """Length of the longest tail of buf that could start a sync token."""
    for k in range(min(len(SYNC_PREFIX) - 1, len(buf)), 0, -1):
        if buf.endswith(SYNC_PREFIX[:k]):
            return k
    return 0


class StreamPump:
    """Drains one capture pipe continuously and turns it into stream frames.

    The reader thread never stops reading, so user code can never block on a
    full pipe; bytes arriving while no request is active (e.g. from a
    process left running after its job) are logged, not framed.
    """

    def __init__(self, name, read_fd, write_fd, channel):
        self.name = name
        self.read_fd = read_fd
        self.write_fd = write_fd  # private dup of the pipe's write end
        self.channel = channel
        self._lock = threading.Lock()
        self._buf = b""
        self._req_id = None
        self._limit = 0
        self._count = 0
        self._truncated = False
        self._decoder = None
        self._token = None
        self._token_seen = threading.Event()
        threading.Thread(target=self._run, name="pump-" + name, daemon=True).start()

    def begin(self, req_id, limit):
        with self._lock:
            self._req_id = req_id
            self._limit = limit
            self._count = 0
            self._truncated = False
            self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def sync(self):
        """Block until every byte written to the pipe so far is framed."""
        token = SYNC_PREFIX + secrets.token_hex(16).encode("ascii") + b"\x00"
        with self._lock:
            self._token = token
            self._token_seen.clear()
        _write_all(self.write_fd, token)
        if not self._token_seen.wait(SYNC_TIMEOUT_S):
            self.channel.log("%s pipe did not drain within %ss" % (self.name, SYNC_TIMEOUT_S))

    def end(self):
        """Detach from the current request; return its truncated flag."""
        with self._lock:
            if self._req_id is None:
                return False
            tail = self._decoder.decode(b"", final=True)
            if tail:
                self._emit(tail)
            truncated = self._truncated
            self._req_id = None
            self._decoder = None
            return truncated

    def _run(self):
        while True:
            try:
                data = self._read_available()
            except OSError as exc:
                self.channel.log("%s pipe read failed: %r" % (self.name, exc))
                time.sleep(0.1)
                continue
            if not data:  # cannot happen while we hold write_fd open
                return
            try:
                with self._lock:
                    self._feed(data)
            except Exception as exc:  # keep draining whatever happens
                self.channel.log("%s pump error: %r" % (self.name, exc))

    def _read_available(self):
        # Block for the first bytes, then keep collecting for a few ms so a
        # print-per-line loop becomes a few frames, not one per line.  A sync
        # token ends the wait at once: syncs must stay fast.
        data = os.read(self.read_fd, READ_CHUNK)
        deadline = time.monotonic() + COALESCE_S
        while data and len(data) < READ_CHUNK and SYNC_PREFIX not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.read_fd], [], [], remaining)[0]:
                break
            more = os.read(self.read_fd, READ_CHUNK - len(data))
            if not more:
                break
            data += more
        return data

    def _feed(self, data):
        buf = self._buf + data
        pos = 0
        while True:
            i = buf.find(SYNC_PREFIX, pos)
            if i < 0:
                keep = _partial_prefix_len(buf[pos:])
                break
            if len(buf) - i < SYNC_LEN:
                keep = len(buf) - i  # maybe a token still arriving
                break
            candidate = buf[i:i + SYNC_LEN]
            if not _is_sync_token(candidate):
                self._deliver(buf[pos:i + 1])  # user bytes that merely look alike
                pos = i + 1
                continue
            self._deliver(buf[pos:i])
            pos = i + SYNC_LEN
            if candidate == self._token:
                self._token = None
                self._token_seen.set()
            # other valid tokens are stale ones from a timed-out sync: drop
        end = len(buf) - keep
        self._deliver(buf[pos:end])
        self._buf = buf[end:]

    def _deliver(self, data):
        if not data:
            return
        if self._req_id is None:
            self.channel.log("dropped %d bytes of %s written outside a job: %r"
                             % (len(data), self.name, data[:200]))
            return
        if self._truncated:
            return
        room = self._limit - self._count
        if len(data) > room:
            cut = room
            # Don't split a UTF-8 sequence at the cap (avoids a stray U+FFFD).
            while cut > 0 and (data[cut] & 0xC0) == 0x80:
                cut -= 1
            data = data[:cut]
            self._truncated = True
        self._count += len(data)
        text = self._decoder.decode(data)
        if text:
            self._emit(text)

    def _emit(self, text):
        self.channel.send({"type": "stream", "id": self._req_id, "name": self.name, "text": text})


class Capture:
    """Owns the fd 1/2 redirection and the two pumps."""

    def __init__(self, channel):
        self.channel = channel
        self.pumps = {}
        self._private_w = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_fd, write_fd = os.pipe()  # both non-inheritable
            os.dup2(write_fd, fd)  # fd 1/2 stay inheritable for subprocesses
            self._private_w[fd] = write_fd
            self.pumps[name] = StreamPump(name, read_fd, write_fd, channel)
        self._libc = self._load_libc()

    @staticmethod
    def _load_libc():
        try:
            return ctypes.CDLL(None)
        except OSError:
            return None

    def reassert(self):
        """Undo what a previous cell may have done to stdio: point fds 1/2
        back at the pipes, and replace closed or missing sys.stdout/stderr."""
        for fd, write_fd in self._private_w.items():
            os.dup2(write_fd, fd)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name, None)
            if stream is None or getattr(stream, "closed", False) is True:
                setattr(sys, name, open_std_stream(fd))

    def begin(self, req_id, stdout_limit, stderr_limit):
        self.pumps["stdout"].begin(req_id, stdout_limit)
        self.pumps["stderr"].begin(req_id, stderr_limit)

    def flush_and_sync(self):
        """Make everything written so far appear as frames, in order."""
        with GATE.protected():
            # A list, not a set: user stream objects need not be hashable.
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    stream.flush()
                except BaseException:
                    pass
            if self._libc is not None:
                try:
                    self._libc.fflush(None)  # C stdio buffers of extensions
                except Exception:
                    pass
            self.pumps["stdout"].sync()
            self.pumps["stderr"].sync()

    def end(self):
        return self.pumps["stdout"].end(), self.pumps["stderr"].end()


def open_std_stream(fd):
    """Line-buffered UTF-8 text stream on fd; unencodable text becomes "?"."""
    return open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)


def setup_io():
    """Move the real stdio out of user code's reach; return the Channel.

    Must run before anything user-controlled (including IPython start-up).
    """
    proto_in = os.dup(0)  # os.dup() fds are non-inheritable
    proto_out = os.dup(1)
    diag = os.dup(2)
    # fd 0 becomes /dev/null so neither user code nor its subprocesses can
    # read (and thereby steal) request frames.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    channel = Channel(proto_in, proto_out, diag)
    capture = Capture(channel)

    for old in (sys.stdout, sys.stderr):
        try:
            old.flush()
        except Exception:
            pass
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open_std_stream(1)
    sys.stderr = open_std_stream(2)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr

    def log_thread_exception(args):
        channel.log("exception in thread %s: %r" % (args.thread, args.exc_value))

    threading.excepthook = log_thread_exception
    return channel, capture


# --------------------------------------------------------------------------
# Workspace: input files, snapshots, artifacts
# --------------------------------------------------------------------------


class InputFileError(Exception):
    pass


def validate_rel_path(path):
    """Return the path's components, or raise InputFileError."""
    if not isinstance(path, str) or not path:
        raise InputFileError("path must be a non-empty string")
    if "\x00" in path:
        raise InputFileError("path contains a NUL byte")
    if path.startswith("/"):
        raise InputFileError("path must be relative")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise InputFileError("path is not valid UTF-8")
    if len(encoded) > MAX_PATH_BYTES:
        raise InputFileError("path longer than %d bytes" % MAX_PATH_BYTES)
    parts = path.split("/")
    for part in parts:
        if part == "":
            raise InputFileError("path has an empty component")
        if part in (".", ".."):
            raise InputFileError("path component %r is not allowed" % part)
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise InputFileError("path component longer than %d bytes" % MAX_NAME_BYTES)
    return parts


def _open_parent_dir(root_fd, parts, create):
    """Open the directory holding parts[-1] without following any symlink.

    Each component is opened relative to its parent's fd with O_NOFOLLOW, so
    a symlink anywhere on the path (even one swapped in concurrently) fails
    with ELOOP/ENOTDIR instead of being followed.  gVisor (runsc) follows a
    symlink despite O_NOFOLLOW when O_DIRECTORY is set, so each opened
    directory is also checked to be the very inode that the name (not
    followed) refers to.
    """
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                named = os.stat(part, dir_fd=fd, follow_symlinks=False)
                opened = os.fstat(child)
                if not stat.S_ISDIR(named.st_mode) or (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
                    raise OSError(errno.ELOOP, "path component is a symlink", part)
            except BaseException:
                os.close(child)
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_input_file(root_fd, parts, content):
    dir_fd = _open_parent_dir(root_fd, parts, create=True)
    try:
        # O_NONBLOCK: opening a FIFO for writing must fail, not hang.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, 0o644, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputFileError("destination exists and is not a regular file")
        _write_all(fd, content)
    finally:
        os.close(fd)


def decode_input_files(files):
    """Validate all input files before writing any.

    Returns (decoded, errors): decoded is [(path, parts, bytes)], errors is
    [(path, message)].
    """
    decoded, errors = [], []
    for entry in files:
        path = entry.get("path")
        try:
            parts = validate_rel_path(path)
            content_b64 = entry.get("content_b64", "")
            if not isinstance(content_b64, str):
                raise InputFileError("content_b64 must be a string")
            try:
                content = base64.b64decode(content_b64, validate=True)
            except ValueError:
                raise InputFileError("content_b64 is not valid base64")
            decoded.append((path, parts, content))
        except InputFileError as exc:
            errors.append((_safe_str(path), str(exc)))
    return decoded, errors


def _entry_key(st):
    return (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino)


def snapshot(root):
    """Map relative path -> (type, size, mtime_ns, inode) for every entry
    under root except directories and the skipped tool/cache directories;
    never follows symlinks (a symlink is an entry of its own)."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        descend = []
        for name in dirnames:
            rel = os.path.join(rel_dir, name)
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                entries[rel] = _entry_key(st)  # a symlink to a directory
            elif name in SKIPPED_DIRS or (not rel_dir and name in SKIPPED_TOP_DIRS):
                continue
            else:
                descend.append(name)
        dirnames[:] = descend
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            entries[os.path.join(rel_dir, name)] = _entry_key(st)
    return entries


def file_listing(entries):
    """The file_list frame for a snapshot: its regular files, sorted by
    path, at most MAX_LIST_ENTRIES of them."""
    regular = ((path, key) for path, key in entries.items() if key[0] == stat.S_IFREG)
    first = heapq.nsmallest(MAX_LIST_ENTRIES + 1, regular)
    return {"type": "file_list",
            "entries": [{"path": path, "size": key[1], "mtime": round(key[2] / 1e9, 3)}
                        for path, key in first[:MAX_LIST_ENTRIES]],
            "truncated": len(first) > MAX_LIST_ENTRIES}


def open_artifact(root_fd, rel_path):
    """Open a workspace file for reading without following any symlink.

    Returns (fd, size, None), or (None, None, reason) with reason None when
    the path does not exist.
    """
    parts = rel_path.split("/")
    try:
        dir_fd = _open_parent_dir(root_fd, parts, create=False)
        try:
            # O_NONBLOCK: a FIFO (swapped in after the walk, or asked for by
            # name) must not hang us.
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except FileNotFoundError:
        return None, None, None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            return None, None, "not_regular_file"
        return None, None, "unreadable"
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None, None, "unreadable"
    if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO, or replaced since the walk
        os.close(fd)
        return None, None, "not_regular_file"
    return fd, st.st_size, None


def read_artifact(fd, size, max_bytes):
    """Return (data, None) or (None, skip_reason) for an fd from open_artifact."""
    if size > max_bytes:
        return None, "too_large"
    chunks, total = [], 0
    try:
        while True:  # read to EOF: the file may still be growing
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                return None, "too_large"
            chunks.append(chunk)
    except OSError:
        return None, "unreadable"
    return b"".join(chunks), None


def _is_utf8(name):
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _shown_name(name):
    """A name with its undecodable bytes replaced, for reporting only."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class FileCollector:
    """Sends workspace files as file/file_skipped frames after a job, under
    the request's max_file_bytes / max_artifact_files / max_artifact_bytes,
    which changed and requested files share."""

    def __init__(self, root_fd, limits, send):
        self.root_fd = root_fd
        self.limits = limits
        self.send = send
        self.count = 0
        self.total = 0
        self.reported = set()  # paths that got a file or file_skipped frame

    def skip(self, rel, reason):
        self.reported.add(rel)
        self.send({"type": "file_skipped", "path": rel, "reason": reason})

    def changed(self, before, after):
        for rel in sorted(p for p, key in after.items() if before.get(p) != key):
            if not _is_utf8(rel):
                # Bytes that are not UTF-8 (os.walk keeps them as surrogates): two such names
                # can look alike once replaced, so neither is sent as a file.
                self.skip(_shown_name(rel), "invalid_name")
            elif after[rel][0] != stat.S_IFREG:
                self.skip(rel, "not_regular_file")  # never opened
            else:
                self._deliver(rel, requested=False)

    def requested(self, paths):
        for rel in paths:
            if rel in self.reported:
                continue  # already sent (or skipped) as a changed file, or a repeat
            try:
                validate_rel_path(rel)
            except InputFileError:
                self.skip(rel, "invalid_path")
                continue
            self._deliver(rel, requested=True)

    def _deliver(self, rel, requested):
        fd, size, reason = open_artifact(self.root_fd, rel)
        if fd is None:
            if reason is not None:
                self.skip(rel, reason)
            elif requested:
                self.skip(rel, "not_found")
            # a changed file deleted since the walk: nothing to report
            return
        try:
            if self.count >= self.limits["max_artifact_files"]:
                reason = "limit_reached"
            else:
                data, reason = read_artifact(fd, size, self.limits["max_file_bytes"])
                if reason is None and self.total + len(data) > self.limits["max_artifact_bytes"]:
                    reason = "limit_reached"
        finally:
            os.close(fd)
        if reason is not None:
            self.skip(rel, reason)
            return
        self.count += 1
        self.total += len(data)
        self.reported.add(rel)
        frame = {"type": "file", "path": rel, "size": len(data)}
        if requested:
            frame["requested"] = True
        self.send(frame)
        for start in range(0, len(data), FILE_CHUNK_BYTES):
            chunk = data[start:start + FILE_CHUNK_BYTES]
            self.send({"type": "file_data", "content_b64": base64.b64encode(chunk).decode("ascii")})


def collect_files(root, before, after, limits, get_files, send):
    """Send the files changed between the snapshots, then the get_files ones."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        collector = FileCollector(root_fd, limits, send)
        collector.changed(before, after)
        collector.requested(get_files)
    finally:
        os.close(root_fd)


# --------------------------------------------------------------------------
# IPython integration
# --------------------------------------------------------------------------


def clean_mime_bundle(data):
    """Keep the mime types we forward, in JSON-safe form."""
    bundle = {}
    if not isinstance(data, dict):
        return bundle
    for mime in KEPT_MIME_TYPES:
        if mime not in data:
            continue
        value = data[mime]
        if mime == "image/png":
            # IPython 8 formatters may return raw bytes or base64 text.
            if isinstance(value, (bytes, bytearray)):
                value = base64.b64encode(bytes(value)).decode("ascii")
            elif not isinstance(value, str):
                continue
        elif mime == "application/json":
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
        elif isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        elif not isinstance(value, str):
            value = _safe_str(value)
        if mime == "image/png" and len(value) > MAX_DISPLAY_VALUE_BYTES:
            continue  # an image cut short is no image
        if mime == "application/json":
            if len(json.dumps(value)) > MAX_DISPLAY_VALUE_BYTES:
                continue
        else:
            value = cap_text(value, MAX_DISPLAY_VALUE_BYTES)
        bundle[mime] = value
    return bundle


def cap_text(text, max_bytes):
    """text cut to at most max_bytes of UTF-8 (plus the marker) when longer."""
    if len(text) <= max_bytes // 4:
        return text  # short enough whatever its characters
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", "ignore") + TRUNCATION_MARKER


def cap_error(frame):
    """An error frame with its message and traceback bounded."""
    frame["evalue"] = cap_text(frame.get("evalue", ""), MAX_EVALUE_BYTES)
    lines, total = [], 0
    for line in frame.get("traceback", []):
        line = cap_text(line, MAX_TRACEBACK_BYTES)
        total += len(line)
        if total > MAX_TRACEBACK_BYTES:
            lines.append(TRUNCATION_MARKER.strip())
            break
        lines.append(line)
    frame["traceback"] = lines
    return frame


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def traceback_lines(stb):
    """IPython's structured traceback as plain lines (colours are off, but
    strip ANSI anyway: custom _render_traceback_ may add them)."""
    lines = []
    for chunk in stb or []:
        lines.extend(ANSI_ESCAPE.sub("", _safe_str(chunk)).split("\n"))
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def create_shell():
    """Build the (singleton) IPython shell; imported lazily so that IPython's
    start-up runs after stdio is redirected."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import Type
    from traitlets.config import Config

    class SandcellDisplayHook(DisplayHook):
        """Sends the last expression's value as execute_result instead of
        printing "Out[N]: ..." to stdout."""

        def start_displayhook(self):
            pass

        def write_output_prompt(self):
            pass

        def finish_displayhook(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            bundle = clean_mime_bundle(format_dict)
            if bundle:
                self.shell.sandcell_publish({"type": "execute_result",
                                             "execution_count": self.prompt_count,
                                             "data": bundle})

    class SandcellDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            bundle = clean_mime_bundle(data)
            if bundle:
                self.shell.sandcell_publish({"type": "display_data", "data": bundle})

        def clear_output(self, wait=False):
            pass  # nothing to clear in a batch transcript

    class SandcellShell(InteractiveShell):
        displayhook_class = Type(SandcellDisplayHook)
        display_pub_class = Type(SandcellDisplayPublisher)
        # `!cmd` via subprocess on the captured fds; the default piped
        # variant needs a pty and re-prints the output itself.
        system = InteractiveShell.system_raw

        # Set by the driver for the duration of a request: callable(frame).
        sandcell_sink = None
        # Error frames sent by the current cell.
        sandcell_errors_sent = 0

        def sandcell_publish(self, frame):
            sink = self.sandcell_sink
            if sink is not None:
                if frame["type"] == "error":
                    self.sandcell_errors_sent += 1
                    frame = cap_error(frame)
                sink(frame)

        async def run_code(self, code_obj, result=None, *, async_=False):
            # SIGINT interrupts user code only, not IPython's own
            # bookkeeping around it (history, counters, events).
            with GATE.cell():
                return await super().run_code(code_obj, result, async_=async_)

        def showtraceback(self, exc_tuple=None, *args, **kwargs):
            with GATE.quiet():
                sent_before = self.sandcell_errors_sent
                try:
                    return super().showtraceback(exc_tuple, *args, **kwargs)
                finally:
                    if self.sandcell_errors_sent == sent_before:
                        # IPython's formatter itself failed (it then prints
                        # its own failure and gives up): report it plainly.
                        self._sandcell_fallback_error(exc_tuple)

        def _sandcell_fallback_error(self, exc_tuple):
            try:
                etype, evalue, tb = self._get_exc_info(exc_tuple)
            except ValueError:
                return  # no exception to report
            stb = traceback.format_exception(etype, evalue, tb)
            self._showtraceback(etype, evalue, stb)

        def showsyntaxerror(self, *args, **kwargs):
            with GATE.quiet():
                return super().showsyntaxerror(*args, **kwargs)

        def _showtraceback(self, etype, evalue, stb):
            # Replaces printing the traceback to stdout.
            self.sandcell_last_exc = evalue
            self.sandcell_publish({
                "type": "error",
                "ename": getattr(etype, "__name__", _safe_str(etype)),
                "evalue": _safe_str(evalue),
                "traceback": traceback_lines(stb),
            })

        def show_usage_error(self, exc):
            message = _safe_str(exc)
            self.sandcell_publish({"type": "error", "ename": "UsageError", "evalue": message,
                                   "traceback": ["UsageError: " + message]})

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no sqlite file, no saver thread
    return SandcellShell.instance(config=config, colors="NoColor")


def flush_figures(sink):
    """Emit every open matplotlib figure as PNG display_data and close it.

    Only if the cell imported pyplot: importing it here would cost every
    plain cell a second or so.
    """
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        numbers = list(plt.get_fignums())
    except Exception:
        return
    for number in numbers:
        try:
            figure = plt.figure(number)
            buf = io.BytesIO()
            figure.savefig(buf, format="png", bbox_inches="tight", dpi=100)
            sink({"type": "display_data",
                  "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                           "text/plain": _safe_str(figure)}})
        except Exception as exc:
            print("sandcell: could not render figure %s: %r" % (number, exc), file=sys.stderr)
        finally:
            try:
                plt.close(number)
            except Exception:
                pass


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
    limits = {name: _int_field(obj, name, default) for name, default in DEFAULT_LIMITS.items()}
    return {"id": req_id, "language": obj["language"], "code": obj["code"],
            "files": files, "limits": limits, "get_files": get_files, "list_files": list_files}


def other_processes():
    """PIDs of the live (non-zombie) processes in the container other than
    the driver and PID 1 (tini)."""
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # exited meanwhile
        if state not in ("Z", "X"):  # zombies are not alive
            pids.append(int(name))
    return pids


def _reap_children():
    # The driver's own children (subprocess.Popen from a cell) become
    # zombies of the driver when killed; tini reaps everything else.
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_strays(existing, rounds=100):
    """Kill every process a cell left behind; returns how many were killed.
    `existing`: the processes alive before the cell, which are spared (in a
    sandbox there are none, since every cell's strays are killed; the set
    matters where the driver is not alone, as in its tests).  Repeats while
    processes keep appearing (a fork bomb forks between the scan and the
    kill), up to `rounds` scans."""
    killed = set()
    for _ in range(rounds):
        pids = [p for p in other_processes() if p not in existing]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)
        _reap_children()
    _reap_children()
    return len(killed)


def space_exhausted(path):
    """Whether the filesystem at `path` is (nearly) full: under 1% free, and
    never less than 64 KiB counts as full."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    return total > 0 and free < max(64 * 1024, total // 100)


def process_stats():
    """The driver's resident memory and how many other processes are alive
    in the container (not counting the driver and PID 1)."""
    rss_kb = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss_kb = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    return {"type": "stats", "rss_kb": rss_kb, "children": len(other_processes())}


class Driver:
    def __init__(self, channel, capture, shell):
        self.channel = channel
        self.capture = capture
        self.shell = shell

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

    # -- loop --------------------------------------------------------------

    def serve(self):
        while True:
            try:
                payload = self.channel.recv()
            except KeyboardInterrupt:
                continue
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
                elif kind == "stats":
                    if req_id is None:
                        raise RequestError("stats: id must be a string")
                    self.send(req_id, process_stats())
                else:
                    raise RequestError("unknown request type %r" % (kind,))
            except (RequestError, ValueError) as exc:
                self.protocol_error(_safe_str(exc), req_id)
            except (Exception, KeyboardInterrupt) as exc:
                self.channel.log("internal error: %r" % (exc,))
                self.protocol_error("internal driver error: %r" % (exc,), req_id)

    # -- one request -------------------------------------------------------

    def execute(self, req):
        req_id, limits = req["id"], req["limits"]
        self.capture.reassert()
        os.makedirs(WORKSPACE, exist_ok=True)

        if not self.write_inputs(req_id, req["files"]):
            self.send(req_id, self.done_frame("input_error", None, (False, False), 0.0, 0, False))
            return

        before = snapshot(WORKSPACE)
        existing = set(other_processes())
        self.shell.sandcell_last_exc = None
        self.capture.begin(req_id, limits["stdout_limit"], limits["stderr_limit"])
        started = time.monotonic()
        try:
            if req["language"] == "python":
                exit_code = self.run_python(req_id, req["code"])
            else:
                exit_code = self.run_bash(req["code"])
            duration_ms = (time.monotonic() - started) * 1000.0
            self.capture.flush_and_sync()
        finally:
            truncated = self.capture.end()

        # Nothing the cell started outlives it (and nothing changes files while
        # they are collected).
        killed = kill_strays(existing)
        full = (space_exhausted(WORKSPACE) or space_exhausted("/tmp")
                or self.last_error_errno == errno.ENOSPC)
        after = snapshot(WORKSPACE)
        collect_files(WORKSPACE, before, after, limits, req["get_files"], lambda f: self.send(req_id, f))
        if req["list_files"]:
            self.send(req_id, file_listing(after))
        status = "ok" if exit_code == 0 else "error"
        self.send(req_id, self.done_frame(status, exit_code, truncated, duration_ms, killed, full))

    def done_frame(self, status, exit_code, truncated, duration_ms, killed, full):
        return {"type": "done", "status": status, "exit_code": exit_code,
                "stdout_truncated": truncated[0], "stderr_truncated": truncated[1],
                # For bash/input errors: the last python cell's number.
                "execution_count": self.execution_count,
                "duration_ms": round(duration_ms, 3),
                "processes_killed": killed, "workspace_full": bool(full)}

    @property
    def last_error_errno(self):
        # The errno of the exception the last python cell ended with, if any.
        return getattr(getattr(self.shell, "sandcell_last_exc", None), "errno", None)

    def write_inputs(self, req_id, files):
        decoded, errors = decode_input_files(files)
        if not errors:
            root_fd = os.open(WORKSPACE, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for path, parts, content in decoded:
                    try:
                        write_input_file(root_fd, parts, content)
                    except (OSError, InputFileError) as exc:
                        errors.append((path, _describe_write_error(exc)))
                        break
            finally:
                os.close(root_fd)
        for path, message in errors:
            self.send(req_id, {"type": "file_error", "path": path, "message": message})
        return not errors

    # -- python ------------------------------------------------------------

    @property
    def execution_count(self):
        # IPython's counter names the *next* cell.
        return max(self.shell.execution_count - 1, 0)

    def run_python(self, req_id, code):
        shell = self.shell

        def sink(frame):
            # Flush and drain output first so frames keep the order in
            # which the cell produced them.
            with GATE.protected():
                self.capture.flush_and_sync()
                self.send(req_id, frame)

        shell.sandcell_sink = sink
        shell.sandcell_errors_sent = 0
        try:
            try:
                result = shell.run_cell(code, store_history=True)
                failed = not result.success
            except KeyboardInterrupt:
                # Escaped the user code proper (a SIGINT in the instant
                # around it), so IPython did not report it: we do, unless
                # the cell already ended with an error.
                if not shell.sandcell_errors_sent:
                    shell.sandcell_publish({"type": "error", "ename": "KeyboardInterrupt", "evalue": "",
                                            "traceback": ["KeyboardInterrupt"]})
                failed = True
            # exit()/quit() only set this flag; the driver keeps serving.
            shell.exit_now = False
            flush_figures(sink)
        finally:
            shell.sandcell_sink = None
        return 1 if failed else 0

    # -- bash --------------------------------------------------------------

    def run_bash(self, code):
        # stdout/stderr are inherited: fds 1/2 are the capture pipes.
        proc = subprocess.Popen(["bash", "-c", code], cwd=WORKSPACE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            with GATE.cell():
                returncode = proc.wait()
        except KeyboardInterrupt:
            returncode = self.interrupt_bash(proc)
        # Whatever the script left running (in its process group or not) is killed,
        # and counted, by execute().
        return 128 - returncode if returncode < 0 else returncode

    @staticmethod
    def interrupt_bash(proc):
        _killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(BASH_INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_write_error(exc):
    if isinstance(exc, InputFileError):
        return str(exc)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
        return "a path component is a symlink or not a directory"
    if exc.errno == errno.EISDIR:
        return "destination is a directory"
    if exc.errno == errno.ENXIO:
        return "destination exists and is not a regular file"
    return "cannot write file: %s" % (exc.strerror or exc,)


def preload(spec, log):
    """Import the comma-separated modules in spec (SANDCELL_PRELOAD) into
    sys.modules, binding no names in the user namespace; return the names
    that imported.  A failure is logged, never fatal."""
    loaded = []
    for name in spec.split(","):
        name = name.strip()
        if not name or name in loaded:
            continue
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit too: a module must not stop the driver
            log("preload of %r failed: %r" % (name, exc))
            continue
        loaded.append(name)
        log("preloaded %s in %.0f ms" % (name, (time.monotonic() - started) * 1000.0))
    if "matplotlib" in sys.modules:
        warm_up_matplotlib(log)
    return loaded


def warm_up_matplotlib(log):
    """Render a throwaway figure so a cell's first figure doesn't pay for
    loading the Agg backend and the font.  Uses Figure directly: pyplot's
    figure numbering and state are left untouched."""
    started = time.monotonic()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(2, 2))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.plot([0, 1], [0, 1])
        axes.set_title("warm-up")
        figure.savefig(io.BytesIO(), format="png", bbox_inches="tight", dpi=100)
    except Exception as exc:
        log("matplotlib warm-up failed: %r" % (exc,))
        return
    log("matplotlib warm-up took %.0f ms" % ((time.monotonic() - started) * 1000.0))


def main():
    channel, capture = setup_io()
    GATE.install()
    # Defaults for running outside the image; the image sets these itself.
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("MPLCONFIGDIR", "/tmp/.mpl")
    os.environ.setdefault("IPYTHONDIR", "/tmp/.ipython")
    try:
        os.makedirs(WORKSPACE, exist_ok=True)
        os.chdir(WORKSPACE)
        # Like Jupyter: modules the job writes to the workspace are importable.
        sys.path[0] = ""
        import warnings

        # plt.show() on Agg is expected here: figures are captured after the
        # cell, so the "non-GUI backend" warning is just noise.
        warnings.filterwarnings("ignore", message=".*non-GUI backend.*")
        warnings.filterwarnings("ignore", message=".*is non-interactive, and thus cannot be shown.*")
        shell = create_shell()
        import IPython

        ipython_version = IPython.__version__
        # After the shell exists, so a preloaded pyplot hooks into IPython
        # exactly as if a cell had imported it.
        preloaded = preload(os.environ.get("SANDCELL_PRELOAD", ""), channel.log)
    except Exception as exc:
        channel.log("start-up failed: %r" % (exc,))
        try:
            channel.send({"type": "protocol_error", "message": "driver start-up failed: %r" % (exc,)})
        finally:
            os._exit(1)
    channel.send({"type": "ready", "driver_version": DRIVER_VERSION,
                  "python": platform.python_version(), "ipython": ipython_version,
                  "preloaded": preloaded,
                  "startup_ms": round((time.monotonic() - STARTED_AT) * 1000.0, 1)})
    Driver(channel, capture, shell).serve()
    # os._exit: don't wait for threads a job may have left running.
    os._exit(0)


if __name__ == "__main__":
    main()
