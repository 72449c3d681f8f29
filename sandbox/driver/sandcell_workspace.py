"""The workspace, as the driver sees it: input files written, snapshots
taken before and after the code, changed files collected as artifacts.

Every function here runs with the sandbox user's rights (the driver switches
its effective uid for the duration, see driver.sandbox_user), so the driver
can never be made to read or write anything the code itself could not; and
none follows a symlink.
"""

import base64
import errno
import heapq
import os
import shutil
import stat
import struct

from sandcell_frames import FILE_CHUNK_BYTES, safe_str, write_all

MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# Most entries in a file_list frame.
MAX_LIST_ENTRIES = 1000
# Tool/cache directories that are never job artifacts.  Top-level dot-dirs
# only appear if HOME-relative defaults are used (the image points
# MPLCONFIGDIR/IPYTHONDIR at /tmp); __pycache__ appears when a cell imports a
# module the job wrote into the workspace.
SKIPPED_TOP_DIRS = {".ipython", ".jupyter", ".cache", ".config", ".local", ".matplotlib"}
SKIPPED_DIRS = {"__pycache__"}


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


def _is_directory_opened(named, fd):
    """Whether `named` (an lstat of a name) is a directory and the very inode `fd` has open:
    gVisor follows a symlink despite O_NOFOLLOW when O_DIRECTORY is set."""
    opened = os.fstat(fd)
    return stat.S_ISDIR(named.st_mode) and (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


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
                if not _is_directory_opened(os.stat(part, dir_fd=fd, follow_symlinks=False), child):
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
        write_all(fd, content)
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
            errors.append((safe_str(path), str(exc)))
    return decoded, errors


def _entry_key(st):
    return (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino)


def snapshot(root):
    """Map relative path -> (type, size, mtime_ns, inode) for every entry
    under root except directories and the skipped tool/cache directories;
    never follows symlinks (a symlink is an entry of its own)."""
    entries = {}
    walk_into(entries, root, "")
    return entries


def _skipped_dir(rel_dir, name):
    return name in SKIPPED_DIRS or (not rel_dir and name in SKIPPED_TOP_DIRS)


def walk_into(entries, root, top, on_dir=None):
    """Add to `entries` what snapshot() keeps of the tree at root/top ("" for root itself),
    relative to root. on_dir(rel_dir) is called for each directory walked, before it is
    listed (WorkspaceWatch watches it there: what is made in it later is then seen either
    by the listing or by the watch). No recursion: a deep tree cannot exhaust the stack."""
    stack = [top]
    while stack:
        rel_dir = stack.pop()
        if on_dir is not None:
            on_dir(rel_dir)
        fd = _open_dir_nofollow(os.path.join(root, rel_dir) if rel_dir else root)
        if fd is None:
            continue
        try:
            _list_into(entries, fd, rel_dir, stack)
        finally:
            os.close(fd)


def _list_into(entries, fd, rel_dir, stack):
    """walk_into's listing of one directory (an fd of it; scandir lists a duplicate)."""
    try:
        listing = os.scandir(fd)
    except OSError:
        return
    with listing:
        for entry in listing:
            name = entry.name
            rel = rel_dir + "/" + name if rel_dir else name
            try:
                # The listing's type when it has one: no lstat for a directory.
                is_dir = entry.is_dir(follow_symlinks=False)
                st = None if is_dir else entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if is_dir or stat.S_ISDIR(st.st_mode):
                if not _skipped_dir(rel_dir, name):
                    stack.append(rel)
            else:
                entries[rel] = _entry_key(st)  # a symlink to a directory is an entry


def _lstat_nofollow(root_fd, rel):
    """lstat of `rel` under the directory root_fd has open, reached without following a symlink
    anywhere on the way (a name the events gave may lead through a directory since replaced by
    one)."""
    parts = rel.split("/")
    if len(parts) == 1:
        return os.stat(rel, dir_fd=root_fd, follow_symlinks=False)
    dir_fd = _open_parent_dir(root_fd, parts, create=False)
    try:
        return os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.close(dir_fd)


def _open_dir_nofollow(path):
    """An fd of the directory at `path` itself, or None: never one a symlink there points to
    (a directory walked may have been replaced by one since it was named). gVisor follows a
    symlink despite O_NOFOLLOW when O_DIRECTORY is set, so the fd is also checked to be the
    inode the name (not followed) is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _is_directory_opened(os.lstat(path), fd):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def refresh(entries, root, rel_paths):
    """Update a snapshot of root (as snapshot() made it) for the entries at rel_paths,
    relative paths known to be valid, looked at again; the same entries snapshot() would
    keep: none under a skipped directory, and no directory."""
    for rel in rel_paths:
        if _under_skipped_dir(rel):
            continue
        try:
            st = os.lstat(os.path.join(root, rel))
        except OSError:
            entries.pop(rel, None)
            continue
        if stat.S_ISDIR(st.st_mode):
            entries.pop(rel, None)
        else:
            entries[rel] = _entry_key(st)
    return entries


# inotify(7): what a watched directory reports, and how a watch is made.
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x2000, 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK, IN_ISDIR = 0x01000000, 0x02000000, 0x04000000, 0x40000000
WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
              | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_EVENT = struct.Struct("iIII")  # struct inotify_event without its name
# Most directories a session's watch follows; a workspace with more is walked every cell.
MAX_WATCHED_DIRS = 8192
# Most paths the events of one cell may name before the watch gives up and the cell walks:
# Linux's own queue holds 16,384 events by default, gVisor's has no bound (its sentry's memory,
# ~220 bytes an event), so the driver reads the events as they come (absorb) and keeps this many.
MAX_PENDING_PATHS = 16384
_inotify = None


def _inotify_calls():
    """libc's inotify_init1 and inotify_add_watch, or None where they cannot be had."""
    global _inotify
    if _inotify is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
            libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
            _inotify = libc
        except (OSError, AttributeError):
            _inotify = False
    return _inotify or None


class _Lost(Exception):
    """The watch missed events (its queue overflowed, the workspace itself went)."""


def _has_ancestor_in(rel, dirs):
    """Whether a directory in `dirs` holds `rel` (at any depth)."""
    cut = rel.find("/")
    while cut != -1:
        if rel[:cut] in dirs:
            return True
        cut = rel.find("/", cut + 1)
    return False


class WorkspaceWatch:
    """A session's workspace followed between its cells with inotify(7): a cell's changed
    files are found by looking again at what the events name, not with an lstat of every
    entry (with 20,000 files, a walk takes 86 ms under runc and 1.4 s under gVisor).

    snapshot() walks the workspace, watching each directory before it lists it; update()
    brings that snapshot up to date from the events queued since: each file they name is
    looked at again, and a directory made, moved in, changed or removed is walked again or
    dropped whole. Whenever the watch cannot vouch for what it saw, update() says so and the
    caller walks: no inotify instance to be had (a uid's instances are few, and shared with
    everything the sandbox user runs), a queue that overflowed, a watch refused (a directory
    made unreadable), more than MAX_WATCHED_DIRS directories (then this watch stops trying),
    more than MAX_PENDING_PATHS paths named between two updates (absorb).

    Its blind spots are inotify's: a file changed only through another of its names (a hard
    link, in the workspace or in /tmp) or only through a shared memory map is seen the next
    time its name is written, closed after writing, renamed or walked.

    Call it with the sandbox user's rights (see driver.sandbox_user): the instance is then
    charged to that uid, never to root's, which the host's services share, and a watch is
    only had on a directory that user can read."""

    def __init__(self, root, max_dirs=MAX_WATCHED_DIRS, max_pending=MAX_PENDING_PATHS):
        self.root = root
        self.max_dirs = max_dirs
        self.max_pending = max_pending
        self.fd = None
        # What the events read since the last update name (absorb): files, directories removed
        # or moved away, directories made, moved in or changed, directories whose watch went.
        self.pending = (set(), set(), set(), set())
        self.wd_dir = {}  # watch descriptor -> its directory, relative to root ("" for root)
        self.dir_wd = {}
        # Directories the driver's inputs went into since the last update (see wrote).
        self.written = set()
        self.lost = False
        # Set once the workspace had more directories than max_dirs: this watch walks from then on.
        self.too_many = False

    @property
    def active(self):
        return self.fd is not None

    def close(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = None
        self.wd_dir.clear()
        self.dir_wd.clear()
        self.written.clear()
        self.pending = (set(), set(), set(), set())
        self.lost = False

    def fileno(self):
        """The instance's fd while the watch is active (readable when events are queued), else
        None."""
        return self.fd

    def absorb(self):
        """Read the events queued so far into `pending`, so that a queue never grows with what a
        cell does (gVisor's has no bound): called whenever the instance is readable, during a
        cell and between cells. Past MAX_PENDING_PATHS paths, or when the queue overflowed, the
        watch closes (its queue goes with it) and the next update walks."""
        if self.fd is None:
            return
        try:
            self._read_events()
        except (_Lost, OSError):
            self.close()

    def snapshot(self):
        """snapshot(root), every directory walked watched from then on, with nothing queued
        before it (a fresh instance). Without a watch to be had, the walk alone."""
        self.close()
        calls = None if self.too_many else _inotify_calls()
        fd = calls.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC) if calls is not None else -1
        entries = {}
        if fd < 0:
            walk_into(entries, self.root, "")
            return entries
        self.fd = fd
        walk_into(entries, self.root, "", on_dir=self._watch)
        if self.lost:
            self.close()
        return entries

    def wrote(self, rel_paths):
        """The driver wrote these input files (valid relative paths) since the snapshot."""
        for rel in rel_paths:
            cut = rel.rfind("/")
            while cut != -1:
                self.written.add(rel[:cut])
                cut = rel.rfind("/", 0, cut)

    def update(self, entries):
        """Bring `entries` (this watch's snapshot, kept up to date since, and refreshed for
        the inputs written) up to date with the events queued since. Returns (was, now): the
        entries looked at again, as they were and as they are (a path absent from one did not
        exist then), for collect_files. None when the watch cannot vouch for what it saw:
        `entries` is then untouched, and the caller walks."""
        if self.fd is None:
            return None
        self.absorb()
        if self.fd is None:
            return None
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self.close()
            return None
        try:
            return self._apply(entries, root_fd)
        finally:
            os.close(root_fd)

    def _apply(self, entries, root_fd):
        """update()'s work on the events read, with an fd of the workspace."""
        (files, dirs_gone, dirs_new, unwatched), self.pending = self.pending, (set(), set(), set(), set())
        written, self.written = self.written, set()
        was, now = {}, {}
        # What was under a directory made, moved, changed or removed goes; what is there now
        # is walked. A directory never walked (never watched) holds no entry but the inputs
        # written into it.
        stale = {d for d in dirs_gone | dirs_new if d in self.dir_wd or d in unwatched or d in written}
        if stale:
            for rel in [rel for rel in entries if _has_ancestor_in(rel, stale)]:
                was[rel] = entries.pop(rel)
        for gone in dirs_gone:
            self._forget(gone)
        for top in dirs_new:
            if _has_ancestor_in(top, dirs_new) or _has_ancestor_in(top, dirs_gone):
                # Walked with the directory above it, or gone with it: what is at its path now
                # is reached through whatever replaced that directory (a symlink, say), never
                # walked.
                continue
            found = {}
            walk_into(found, self.root, top, on_dir=self._watch)
            entries.update(found)
            now.update(found)
        for rel in files:
            if _has_ancestor_in(rel, dirs_new) or _has_ancestor_in(rel, dirs_gone):
                continue  # walked above, or gone with its directory
            if rel in entries:
                was.setdefault(rel, entries[rel])
            try:
                st = _lstat_nofollow(root_fd, rel)
            except OSError:
                entries.pop(rel, None)
                continue
            if stat.S_ISDIR(st.st_mode):
                entries.pop(rel, None)  # a directory now: its own event walks it
            else:
                entries[rel] = now[rel] = _entry_key(st)
        if self.lost:
            self.close()  # this cell's answer is whole; the next cell walks and watches anew
        return was, now

    def _watch(self, rel_dir):
        """walk_into's on_dir: watch a directory before it is listed."""
        if self.fd is None or self.lost:
            return
        if len(self.wd_dir) >= self.max_dirs and rel_dir not in self.dir_wd:
            self.lost = self.too_many = True
            return
        path = os.path.join(self.root, rel_dir) if rel_dir else self.root
        try:
            # gVisor watches what a symlink points to despite IN_DONT_FOLLOW: a directory only.
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return
        except OSError:
            return  # gone since it was named: its parent's events say so
        wd = _inotify_calls().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            import ctypes

            # Gone, or no longer a directory, since it was named: its parent's events say so.
            if ctypes.get_errno() not in (errno.ENOENT, errno.ENOTDIR):
                self.lost = True
            return
        if not os.access(path, os.R_OK | os.X_OK, effective_ids=True, follow_symlinks=False):
            # Watched (gVisor does not ask for read permission) but not listable: a walk would
            # not see what the events name in it.
            self.lost = True
        # A directory moved since it was watched keeps its watch (the same wd); its old path
        # stays known in dir_wd until its own event drops what was under it (update, _forget).
        self.wd_dir[wd] = rel_dir
        self.dir_wd[rel_dir] = wd

    def _forget(self, rel_dir):
        """Stop watching a directory that went, and those below it."""
        for rel in [d for d in self.dir_wd if d == rel_dir or d.startswith(rel_dir + "/")]:
            wd = self.dir_wd.pop(rel)
            if self.wd_dir.get(wd) == rel:  # not a directory moved and watched elsewhere since
                del self.wd_dir[wd]
                _inotify_calls().inotify_rm_watch(self.fd, wd)

    def _read_events(self):
        """Read every queued event into `pending`, paths relative to root."""
        files, dirs_gone, dirs_new, unwatched = self.pending
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            off = 0
            while off + _EVENT.size <= len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size:off + _EVENT.size + length].split(b"\0", 1)[0]
                off += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    raise _Lost()
                rel_dir = self.wd_dir.get(wd)
                if mask & IN_IGNORED:  # the watch went with its directory
                    if rel_dir is not None:
                        unwatched.add(rel_dir)
                        del self.wd_dir[wd]
                        if self.dir_wd.get(rel_dir) == wd:
                            del self.dir_wd[rel_dir]
                    continue
                if rel_dir is None:
                    continue
                if not name:
                    # The directory's own event: its parent's names what changed, but nothing
                    # names the workspace's own (its mode too: a walk may no longer list it).
                    if rel_dir == "" and mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_ATTRIB):
                        raise _Lost()
                    continue
                name = os.fsdecode(name)
                rel = rel_dir + "/" + name if rel_dir else name
                if not mask & IN_ISDIR:
                    files.add(rel)
                elif not _skipped_dir(rel_dir, name):
                    if mask & (IN_DELETE | IN_MOVED_FROM):
                        dirs_gone.add(rel)
                    if mask & (IN_CREATE | IN_MOVED_TO | IN_ATTRIB):
                        dirs_new.add(rel)
            if len(files) + len(dirs_gone) + len(dirs_new) > self.max_pending:
                raise _Lost()


def _under_skipped_dir(rel):
    parts = rel.split("/")
    return parts[0] in SKIPPED_TOP_DIRS and len(parts) > 1 or any(p in SKIPPED_DIRS for p in parts[:-1])


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


def describe_write_error(exc):
    if isinstance(exc, InputFileError):
        return str(exc)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
        return "a path component is a symlink or not a directory"
    if exc.errno == errno.EISDIR:
        return "destination is a directory"
    if exc.errno == errno.ENXIO:
        return "destination exists and is not a regular file"
    return "cannot write file: %s" % (exc.strerror or exc,)



def empty_dir(root):
    """Remove everything under root (root itself stays), never following a
    symlink (rmtree works from directory fds); a directory the code made
    unwritable or unreadable is made accessible again first.  Returns
    whether root is empty afterwards."""
    def make_accessible_and_retry(func, path, exc_info):
        try:
            os.chmod(os.path.dirname(path), 0o700)
            if func in (os.rmdir, os.open, os.scandir, os.listdir) and not os.path.islink(path) and os.path.isdir(path):
                os.chmod(path, 0o700)
                shutil.rmtree(path, onerror=lambda *args: None)
            else:
                os.unlink(path)
        except OSError:
            pass

    try:
        names = os.listdir(root)
    except OSError:
        return False
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)
                shutil.rmtree(path, onerror=make_accessible_and_retry)
            else:
                os.unlink(path)
        except OSError:
            pass
    try:
        return not os.listdir(root)
    except OSError:
        return False


# FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (linux/fs.h; the kernel reads and writes an int): the
# inode flags chattr sets. The owner of a tmpfs directory may set some (nodump, noatime).
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602


def directory_state(path, values_of=()):
    """What the owner of a directory that outlives a job (the workspace, /tmp: mount points,
    emptied but never removed) can set on the directory itself and a later job could read
    back: its mode, its extended attributes (user.* data, POSIX ACLs: a default ACL would give
    every file made in it later mode 0000) and its inode flags. The values of the attributes
    named in `values_of` are read too (those it had before any job; a job's own are only
    named, never read: they may hold hundreds of megabytes). Its times are not part of it:
    restore_directory sets them to the present. Raises OSError when the attributes cannot be
    listed (more names than listxattr returns at once, say)."""
    try:
        names = sorted(os.listxattr(path, follow_symlinks=False))
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        names = None  # a file system without them
    values = {name: os.getxattr(path, name, follow_symlinks=False).hex() for name in values_of if name in (names or ())}
    return {"mode": stat.S_IMODE(os.lstat(path).st_mode), "xattrs": names, "values": values, "flags": _inode_flags(path)}


def kept_directory_state(path):
    """directory_state before any job, with the values of the attributes it has then."""
    names = directory_state(path)["xattrs"] or ()
    return directory_state(path, values_of=names)


def restore_directory(path, was):
    """Put a directory's own state back as `was` (kept_directory_state, taken before any job;
    None if it could not be read then): remove the extended attributes a job added and write
    back those it changed, restore the mode and the inode flags, and set its times to now.
    Returns whether it is as it was."""
    if was is None:
        return False
    try:
        now = directory_state(path, values_of=was["values"])
    except OSError:
        return False
    for name in set(now["xattrs"] or ()) - set(was["xattrs"] or ()):
        _ignore_oserror(lambda: os.removexattr(path, name, follow_symlinks=False))
    for name, value in was["values"].items():
        if now["values"].get(name) != value:
            _ignore_oserror(lambda: os.setxattr(path, name, bytes.fromhex(value), follow_symlinks=False))
    if now["mode"] != was["mode"]:
        _ignore_oserror(lambda: os.chmod(path, was["mode"]))
    if now["flags"] != was["flags"] and was["flags"] is not None:
        _ignore_oserror(lambda: _set_inode_flags(path, was["flags"]))
    # Times a job set (an mtime of its choosing is data too) say nothing once they are now.
    _ignore_oserror(lambda: os.utime(path))
    try:
        return directory_state(path, values_of=was["values"]) == was
    except OSError:
        return False


def _inode_flags(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        import fcntl

        return int.from_bytes(fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))[:4], "little")
    except OSError:
        return None  # not supported here (an older kernel, gVisor)
    finally:
        os.close(fd)


def _set_inode_flags(path, flags):
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags.to_bytes(4, "little") + bytes(4))
    finally:
        os.close(fd)


def _ignore_oserror(f):
    try:
        f()
    except OSError:
        pass
