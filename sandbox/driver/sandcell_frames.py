"""Frames and the values inside them, shared by the driver and the kernel.

A frame is a 4-byte unsigned big-endian length N followed by N bytes of UTF-8
JSON encoding one object with a "type" field.  The driver speaks frames to
the worker (over the container's attach stream) and to its kernel (over a
pair of pipes); this module is the one encoder and decoder of both, and the
one place that bounds what a value inside a frame may be.
"""

import base64
import json
import os
import re
import struct
import threading
from json import dumps as _json_dumps  # bound now: a cell that replaces json.dumps cannot break framing

DRIVER_VERSION = 6

# A request carries its input files inline; anything bigger than this is
# certainly not a request we want to hold in memory.
MAX_REQUEST_BYTES = 1 << 30
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
# Longest frame the driver reads from its kernel: what the kernel may send, and a
# margin.  A longer one is discarded unread (the driver's memory stays bounded).
MAX_KERNEL_FRAME_BYTES = MAX_FRAME_BYTES + (1 << 20)
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


def write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def safe_str(value):
    try:
        return str(value)
    except BaseException:  # a hostile __str__ must not break reporting
        return "<unprintable %s object>" % type(value).__name__


class FrameTooLarge(ValueError):
    pass


class Channel:
    """Framed JSON over fds; frame writes are serialized.

    `guard` is a context manager factory held around each frame write (the
    kernel defers SIGINT there, so a frame is never half-written);
    `max_in` bounds the frames read: a longer one raises FrameTooLarge,
    after its bytes are read and discarded when `discard_oversize` (which
    keeps the stream in sync).
    """

    def __init__(self, in_fd, out_fd, diag_fd, max_in, guard=None, discard_oversize=True):
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.diag_fd = diag_fd
        self.max_in = max_in
        self._guard = guard
        self._discard_oversize = discard_oversize
        self._lock = threading.Lock()
        # A process forked from the kernel (os.fork, multiprocessing) inherits
        # these fds: only the process that made the channel may speak on it.
        self.owner = os.getpid()
        self._bequeath = False
        os.register_at_fork(after_in_child=self._disown)

    def fork_heir(self):
        """Fork a child that inherits this channel and speaks on it in the
        parent's place (the kernel's process for a fresh job); returns what
        os.fork() returns.  Processes the heir forks disown it as usual."""
        self._bequeath = True
        try:
            return os.fork()
        finally:
            self._bequeath = False

    def _disown(self):
        if self._bequeath:
            self._bequeath = False
            self.owner = os.getpid()
            return
        for fd in (self.in_fd, self.out_fd):
            if fd is None:
                continue  # a channel that only reads (the kernel's control pipe), or closed
            try:
                os.close(fd)
            except OSError:
                pass
        # Closed once: a later fork of this process must not close what took the numbers.
        self.in_fd = self.out_fd = None

    def send(self, frame):
        if os.getpid() != self.owner:
            return  # a forked child: it has no voice
        payload = encode(frame)
        if len(payload) > MAX_FRAME_BYTES and frame.get("type") in ("execute_result", "display_data"):
            note = "<%s of %d bytes not shown: larger than %d bytes once encoded>" % (
                frame["type"], len(payload), MAX_FRAME_BYTES)
            payload = encode(dict(frame, data={"text/plain": note}))
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError("frame too large (%d bytes)" % len(payload))
        data = struct.pack(">I", len(payload)) + payload
        if self._guard is None:
            with self._lock:
                write_all(self.out_fd, data)
        else:
            with self._guard(), self._lock:
                write_all(self.out_fd, data)

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
        if length > self.max_in:
            if self._discard_oversize:
                self._discard(length)
            raise FrameTooLarge("frame too large (%d bytes)" % length)
        return self._read_exact(length)

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
            write_all(self.diag_fd, ("sandcell-driver: %s\n" % message).encode("utf-8", "replace"))
        except OSError:
            pass


def encode(frame):
    # ensure_ascii=False keeps frames compact; "replace" turns lone
    # surrogates (possible in user strings) into "?" so the output is
    # always valid UTF-8 for the Rust side.
    payload = _json_dumps(frame, ensure_ascii=False, separators=(",", ":"))
    return payload.encode("utf-8", "replace")


def frame_bytes(frame):
    """One frame as written: its length, then its JSON."""
    payload = encode(frame)
    return struct.pack(">I", len(payload)) + payload


# --------------------------------------------------------------------------
# Values: what a rich output or an error may hold
# --------------------------------------------------------------------------


def clean_mime_bundle(data):
    """Keep the mime types we forward, in JSON-safe form, each value bounded."""
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
                _json_dumps(value)
            except (TypeError, ValueError, RecursionError):
                continue
        elif isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        elif not isinstance(value, str):
            value = safe_str(value)
        if mime == "image/png" and len(value) > MAX_DISPLAY_VALUE_BYTES:
            continue  # an image cut short is no image
        if mime == "application/json":
            if len(_json_dumps(value)) > MAX_DISPLAY_VALUE_BYTES:
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
    """An error frame with its message and traceback bounded (and of the
    right types, whoever built it)."""
    evalue = frame.get("evalue", "")
    frame["evalue"] = cap_text(evalue if isinstance(evalue, str) else safe_str(evalue), MAX_EVALUE_BYTES)
    traceback = frame.get("traceback", [])
    lines, total = [], 0
    for line in traceback if isinstance(traceback, list) else []:
        line = cap_text(line if isinstance(line, str) else safe_str(line), MAX_TRACEBACK_BYTES)
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
        lines.extend(ANSI_ESCAPE.sub("", safe_str(chunk)).split("\n"))
    while lines and not lines[-1].strip():
        lines.pop()
    return lines
