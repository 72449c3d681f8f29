"""Output capture, on the driver's side.

The kernel's fds 1 and 2 (and so every process it starts) are the write ends
of two pipes whose read ends only the driver holds.  A pump thread per pipe
drains it continuously and turns the bytes into stream frames of the request
running at the time, under that request's byte cap.  User code decides what
it prints, never how it is framed: nothing it writes can become a frame of
another type, or a frame of another request.
"""

import array
import codecs
import fcntl
import os
import secrets
import select
import termios
import threading
import time

from sandcell_frames import write_all

# How long to wait for a capture pipe to drain; only a wedged protocol
# channel can make this take more than milliseconds.
SYNC_TIMEOUT_S = 10.0

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
        # Bytes the pump has read from the pipe and not yet fed (while it
        # collects a few more, see _read_available).
        self._held = False
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
        if self._drained():
            return
        token = SYNC_PREFIX + secrets.token_hex(16).encode("ascii") + b"\x00"
        with self._lock:
            self._token = token
            self._token_seen.clear()
        write_all(self.write_fd, token)
        if not self._token_seen.wait(SYNC_TIMEOUT_S):
            self.channel.log("%s pipe did not drain within %ss" % (self.name, SYNC_TIMEOUT_S))

    def _drained(self):
        """Whether every byte written to the pipe so far is framed already:
        the pipe is empty, and the pump holds no bytes it read (it reads
        and feeds under the lock taken here).  The common case -- a cell
        that printed nothing since the last sync -- then costs no token,
        no wake-up of the pump and no wait for it."""
        with self._lock:
            if self._held or self._buf:
                return False
            pending = array.array("i", [0])
            try:
                fcntl.ioctl(self.read_fd, termios.FIONREAD, pending, True)
            except OSError:
                return False  # then the token tells
            return pending[0] == 0

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
            # A partial token held back at the end is this request's, never the next one's.
            self._buf = b""
            return truncated

    def _run(self):
        while True:
            try:
                data = self._read_available()
            except OSError as exc:
                self.channel.log("%s pipe read failed: %r" % (self.name, exc))
                with self._lock:
                    self._held = False  # what it read is lost with the read
                time.sleep(0.1)
                continue
            if not data:  # cannot happen while we hold write_fd open
                return
            try:
                with self._lock:
                    self._held = False
                    self._feed(data)
            except Exception as exc:  # keep draining whatever happens
                self.channel.log("%s pump error: %r" % (self.name, exc))

    def _read_available(self):
        # Wait for the first bytes, then keep collecting for a few ms so a
        # print-per-line loop becomes a few frames, not one per line.  A sync
        # token ends the wait at once: syncs must stay fast.  Bytes are read
        # under the lock and marked held until fed (see _drained).
        select.select([self.read_fd], [], [])
        data = self._read_held(READ_CHUNK)
        deadline = time.monotonic() + COALESCE_S
        while data and len(data) < READ_CHUNK and SYNC_PREFIX not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.read_fd], [], [], remaining)[0]:
                break
            more = self._read_held(READ_CHUNK - len(data))
            if not more:
                break
            data += more
        return data

    def _read_held(self, size):
        with self._lock:
            data = os.read(self.read_fd, size)  # readable: the pump is the pipe's only reader
            self._held = self._held or bool(data)
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
    """The two capture pipes and their pumps."""

    def __init__(self, channel):
        self.pumps = {}
        # The write ends the kernel gets as its fds 1 and 2 (closed by the
        # driver once the kernel has them).
        self.kernel_fds = {}
        for name in ("stdout", "stderr"):
            read_fd, write_fd = os.pipe()  # both non-inheritable
            self.kernel_fds[name] = write_fd
            # A private copy of the write end, for sync tokens; it also keeps
            # the pipe open when the kernel dies.
            self.pumps[name] = StreamPump(name, read_fd, os.dup(write_fd), channel)

    def kernel_started(self):
        for fd in self.kernel_fds.values():
            os.close(fd)
        self.kernel_fds = {}

    def begin(self, req_id, stdout_limit, stderr_limit):
        self.pumps["stdout"].begin(req_id, stdout_limit)
        self.pumps["stderr"].begin(req_id, stderr_limit)

    def sync(self):
        """Make everything written to the pipes so far appear as frames, in
        order (the kernel flushes its buffers before it sends a frame)."""
        self.pumps["stdout"].sync()
        self.pumps["stderr"].sync()

    def end(self):
        return self.pumps["stdout"].end(), self.pumps["stderr"].end()
