"""The kernel: the process that runs user code, under the sandbox user.

Started by the driver (driver.py --kernel REQ_FD REP_FD CTL_FD) as uid 1000
with no capabilities.  It reads run requests from REQ_FD, ping and purge from
CTL_FD, and answers on REP_FD with frames: execute_result, display_data,
error, log, and one cell_done per run.  CTL_FD is closed in every process
this one forks (a fresh job's included) before any code of a job runs: a
process a job leaves holds REQ_FD and REP_FD, and could read a purge from
the one and answer it on the other, but it never sees a nonce it could
answer with.
Its fds 1 and 2 are the driver's capture pipes; fd 0 is /dev/null.  Nothing
here is trusted: user code runs in this process and may rewrite any of it.
The driver checks every frame (type, id, fields, size) and decides itself
how a request ends, which files it produced and what it left running.

Kernel -> driver frames
-----------------------
ready           {"ipython", "preloaded": [module names]}
execute_result  {"id", "execution_count", "data": {mime: value}}
display_data    {"id", "data": {mime: value}}
error           {"id", "ename", "evalue", "traceback": [lines]}
log             {"message"}   a diagnostic for the driver's log
cell_done       {"id", "exit_code": int, "execution_count": int,
                 "errno": int|null}
                exit_code: python 0/1, bash its exit status (128+N if
                killed by signal N); execution_count: the last python
                cell's number; errno: that of the exception a python cell
                ended with, if any.

child_exit      {"id", "status": int|null}   after a fresh run: how the
                run's process ended (0 after its cell_done; else its exit
                status, -N for signal N); not sent once the driver purged
                (the job is over then).  Sent by the zygote, which user code
                never reaches.

pong            {"nonce", "settings", "standby": pid|null}   answer to ping:
                this process's resource limits, nice value, CPU affinity,
                scheduling policy and attributes, I/O priority, and the state
                of the open files it shares with every fresh run (restored
                first, see Kernel.restore_shared_files); standby: the process
                forked for the next fresh run, when the ping asked for one.

Driver -> kernel, on the control pipe (CTL_FD)
----------------------------------------------
ping            {"nonce", "standby": bool}   answered with pong (between
                runs); with standby (after a fresh run, once the driver has
                cleaned up after it) the zygote first forks the process for
                the next fresh run, before it reads what the pong reports
                (nothing of the job is left to change that in between): the
                fork and the copy-on-write faults of the cell machinery's
                first use are paid between jobs, not by the next job.
purge           {"nonce"}   after a fresh run (its process gone): end every
                other process of this uid at once (kill(-1, SIGKILL)), reap,
                and answer purged {"nonce"}.

Driver -> kernel, on the request pipe (REQ_FD)
----------------------------------------------
run             {"id", "language": "python"|"bash", "code", "env",
                 "context", "fresh": false}   a session's cell, run here.
run             {"id", "fresh": true}, then at once
run_body        {"id", "language", "code", "env", "context"}
                a fresh run: the cell runs in a child forked for it (a
                one-off job), which exits after its cell_done: this process
                -- the zygote, with its pre-imported modules and a pristine
                namespace -- never runs user code, so nothing one job does
                to the interpreter (variables, modules, builtins,
                environment, sys.path, threads) reaches the next.  The
                zygote reads only the first frame; the child reads the body
                itself, from the request pipe: the job's code and
                environment never enter the memory of the zygote, which the
                next job's process is forked from.
ack             {}  the rich output or error just sent was forwarded (the
                kernel waits for it, so output it prints later cannot be
                framed before that frame)
SIGINT interrupts a running cell (python: KeyboardInterrupt; bash: SIGINT
to its process group, SIGKILL after 2 s) and is ignored between cells.
"""

import contextlib
import ctypes
import fcntl
import gc
import importlib
import io
import base64
import collections
import json
import linecache
import os
import platform
import resource
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback

from sandcell_frames import (MAX_REQUEST_BYTES, Channel, cap_error, clean_mime_bundle, safe_str,
                             traceback_lines)

WORKSPACE = os.environ.get("SANDCELL_WORKSPACE", "/home/user")
# The name of a session's namespace when a request names none.
DEFAULT_CONTEXT = "default"
# Grace period between SIGINT and SIGKILL for an interrupted bash job.
BASH_INTERRUPT_GRACE_S = 2.0


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



def open_std_stream(fd):
    """Line-buffered UTF-8 text stream on fd; unencodable text becomes "?"."""
    return open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)



# Builtin types with no rich representation of their own.
_PLAIN_TYPES = frozenset((int, float, bool, complex, str, bytes))


def _only_plain_text(display_formatter, cls):
    """Whether IPython's formatting of a cls value yields text/plain alone:
    the plain formatter is enabled and no other formatter (nor the
    _ipython_display_ or mimebundle one) has a printer for cls or a base."""
    plain = display_formatter.formatters.get("text/plain")
    if plain is None or not plain.enabled:
        return False
    others = [f for name, f in display_formatter.formatters.items() if name != "text/plain"]
    others += [display_formatter.ipython_display_formatter, display_formatter.mimebundle_formatter]
    for formatter in others:
        for base in cls.__mro__:
            if base in formatter.type_printers or (base.__module__, base.__name__) in formatter.deferred_printers:
                return False
    return True


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

        def compute_format_data(self, result):
            # A builtin scalar (`1+1`, most agents' one-liners) is shown as text/plain alone:
            # asked of all twelve formatters, it costs ~0.3 ms of the cell. Only the plain
            # formatter is asked unless a formatter has a printer for the type (or a base of
            # it), so the answer is IPython's own (its precision, its printers).
            if type(result) in _PLAIN_TYPES and _only_plain_text(self.shell.display_formatter, type(result)):
                data = self.shell.display_formatter.formatters["text/plain"](result)
                return ({"text/plain": data} if data is not None else {}), {}
            return super().compute_format_data(result)

        def cull_cache(self):
            # IPython's culling of Out (its oldest fifth once it holds cache_size results),
            # without the UserWarning IPython prints into the cell's stderr (each context has
            # an Out of its own: Kernel.use_context). The texts IPython keeps of results
            # (output_hist_reprs, never culled by it, one for all contexts) are bounded too.
            oh = self.shell.user_ns.get("_oh", {})
            for number in sorted(oh)[:max(int(len(oh) * self.cull_fraction), 2)]:
                self.shell.user_ns.pop("_%i" % number, None)
                self.shell.user_ns_hidden.pop("_%i" % number, None)
                oh.pop(number, None)
            reprs = self.shell.history_manager.output_hist_reprs
            if len(reprs) > len(oh):
                for number in sorted(reprs)[:len(reprs) - len(oh)]:
                    del reprs[number]

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

        def should_run_async(self, raw_cell, *, transformed_cell=None, preprocessing_exc_tuple=None):
            # IPython compiles every cell once more to learn whether it awaits at top level;
            # only a cell with `await` or `async` in its text can (the compiler marks a code
            # object a coroutine for those alone), so the others are spared that compile
            # (~30 us of a ~300 us `n += 1` cell).
            cell = raw_cell if transformed_cell is None else transformed_cell
            if preprocessing_exc_tuple is None and "await" not in cell and "async" not in cell:
                return False
            return super().should_run_async(raw_cell, transformed_cell=transformed_cell,
                                            preprocessing_exc_tuple=preprocessing_exc_tuple)

        async def run_code(self, code_obj, result=None, *, async_=False):
            # SIGINT interrupts user code only, not IPython's own
            # bookkeeping around it (history, counters, events).
            with GATE.cell():
                return await super().run_code(code_obj, result, async_=async_)

        def showtraceback(self, exc_tuple=None, *args, **kwargs):
            with GATE.quiet():
                sent_before = self.sandcell_errors_sent
                try:
                    try:
                        exc_tuple = _without_own_frames(self._get_exc_info(exc_tuple))
                    except ValueError:
                        pass  # nothing to report: IPython says so itself
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
                "ename": getattr(etype, "__name__", safe_str(etype)),
                "evalue": safe_str(evalue),
                "traceback": traceback_lines(stb),
            })

        def show_usage_error(self, exc):
            message = safe_str(exc)
            self.sandcell_publish({"type": "error", "ename": "UsageError", "evalue": message,
                                   "traceback": ["UsageError: " + message]})

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no sqlite file, no saver thread
    return SandcellShell.instance(config=config, colors="NoColor")


def _without_own_frames(exc_tuple):
    """An interrupt is raised in the interrupt gate's signal handler, so its traceback ends in a
    frame of this file: sandcell's, not the user's code, and noise to an agent fixing that code.
    Drop such frames from the end of a KeyboardInterrupt's traceback."""
    etype, evalue, tb = exc_tuple
    if not isinstance(evalue, KeyboardInterrupt) or tb is None:
        return exc_tuple
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    keep = len(frames)
    while keep > 1 and frames[keep - 1].tb_frame.f_code.co_filename == __file__:
        keep -= 1
    if keep < len(frames):
        frames[keep - 1].tb_next = None
    return etype, evalue.with_traceback(frames[0]), frames[0]


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
                           "text/plain": safe_str(figure)}})
        except Exception as exc:
            print("sandcell: could not render figure %s: %r" % (number, exc), file=sys.stderr)
        finally:
            try:
                plt.close(number)
            except Exception:
                pass


# --------------------------------------------------------------------------
# What IPython keeps of past cells
# --------------------------------------------------------------------------


# IPython keeps every cell's input for as long as the kernel lives, about three times over (`In`,
# the raw history behind `_iN`, and linecache's copy of the compiled lines, for tracebacks). In a
# session that is memory the sandbox's limit counts: 300 cells of 100 KB of code held 87 MiB more
# (measured 2026-11-28), and at the 1 MiB a job's code may have, ~300 cells would have ended the
# session in an out-of-memory kill on history alone. The inputs of the last HISTORY_CELLS cells
# are kept as IPython keeps them, within HISTORY_BYTES of text; an older cell's reads as "" in
# `In` (the indices stay), its `_iN` name is gone, and a traceback through a function it defined
# shows no source lines. Out keeps the last results as IPython's cache_size (1000) says, culled
# by SandcellDisplayHook.cull_cache.
HISTORY_CELLS = 1000
HISTORY_BYTES = 32 << 20


class InputHistory:
    """The inputs of past cells IPython holds, oldest first, trimmed to HISTORY_CELLS cells and
    HISTORY_BYTES of text after each cell (`begin` before it, `end` after it). It learns what a
    cell stored from IPython's own calls (the history's store_inputs, the compiler's cache), so
    a cell that ran cells itself is followed too."""

    # What linecache holds per line beyond its text: a str object and its list slot.
    LINE_OVERHEAD = 56

    def __init__(self, shell):
        self.shell = shell
        # Per stored input: (index in In, raw input, parsed input, its `_iN` name, the namespace
        # and hidden names it was put in, the linecache names compiled with it, bytes held).
        self.cells = collections.deque()
        self.bytes = 0
        # How many kept cells compiled each linecache name: a name is the input's count and a
        # hash of its text, so two contexts' (or a count reset by %reset) equal cells share one.
        self._name_uses = collections.Counter()
        self._inputs = []
        self._names = []
        hm, store_inputs, cache = shell.history_manager, shell.history_manager.store_inputs, shell.compile.cache

        def store_and_note(line_num, source, source_raw=None):
            index = len(hm.input_hist_raw)
            store_inputs(line_num, source, source_raw)
            if len(hm.input_hist_raw) == index + 1 and len(hm.input_hist_parsed) == index + 1:
                self._inputs.append((index, hm.input_hist_raw[index], hm.input_hist_parsed[index],
                                     "_i%d" % line_num, shell.user_ns, shell.user_ns_hidden))

        def cache_and_note(transformed_code, number=0, raw_code=None):
            name = cache(transformed_code, number, raw_code)
            self._names.append(name)
            return name

        hm.store_inputs = store_and_note
        shell.compile.cache = cache_and_note

    def begin(self):
        self._inputs, self._names = [], []

    def end(self):
        inputs, self._inputs = self._inputs, []
        names, self._names = self._names, []
        lines = 0
        for name in names:
            entry = linecache.cache.get(name)
            if entry is not None:
                lines += entry[0] + self.LINE_OVERHEAD * len(entry[2])
            self._name_uses[name] += 1
        if not inputs:
            if not names:
                return
            inputs = [(None, None, None, None, None, None)]  # compiled, not stored: exit, quit
        for i, (index, raw, parsed, key, ns, hidden) in enumerate(inputs):
            last = i == len(inputs) - 1
            held = (len(raw) + len(parsed) if raw is not None else 0) + (lines if last else 0)
            self.cells.append((index, raw, parsed, key, ns, hidden, names if last else [], held))
            self.bytes += held
        if len(self.cells) > HISTORY_CELLS or self.bytes > HISTORY_BYTES:
            self.trim()

    def trim(self):
        """Drop the oldest cells' inputs down to four fifths of the bounds (as IPython culls Out:
        a cell over the bounds does not pay for a trim each)."""
        hm = self.shell.history_manager
        dropped = set()
        cells, size_left = HISTORY_CELLS * 4 // 5, HISTORY_BYTES * 4 // 5
        while len(self.cells) > 1 and (len(self.cells) > cells or self.bytes > size_left):
            index, raw, parsed, key, ns, hidden, names, size = self.cells.popleft()
            self.bytes -= size
            for name in names:
                self._name_uses[name] -= 1
                if self._name_uses[name] <= 0:
                    del self._name_uses[name]
                    linecache.cache.pop(name, None)
                    self.shell.compile._filename_map.pop(name, None)
            if index is None:
                continue
            # Only what is still this cell's: `%reset` empties the history, code may rewrite it.
            for inputs, text in ((hm.input_hist_raw, raw), (hm.input_hist_parsed, parsed)):
                if index < len(inputs) and inputs[index] is text:
                    inputs[index] = ""
            if ns.get(key) is raw:
                del ns[key]
                hidden.pop(key, None)
            dropped.add(id(raw))
        if dropped:
            # Queued for a database this kernel never writes to (its history is in memory).
            with hm.db_input_cache_lock:
                hm.db_input_cache[:] = [e for e in hm.db_input_cache if id(e[2]) not in dropped]


def forget_traceback_sources():
    """Drop the cells' sources from the caches IPython's traceback formatting fills and never
    empties (stack_data's and executing's: every cell a traceback went through, kept with its
    text, syntax tree and tokens for the kernel's life; measured: 900 failing cells of 4 KB held
    311 MiB). Library files stay cached: there are only so many, and a traceback through pandas
    would parse its module again."""
    executing = sys.modules.get("executing.executing")
    if executing is None:
        return
    def a_cell(filename):
        return isinstance(filename, str) and filename.startswith("<ipython-input-")
    classes = [executing.Source]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        sources = cls.__dict__.get("__source_cache_with_lines")
        if isinstance(sources, dict):
            for key in [k for k in sources if a_cell(k[0])]:
                del sources[key]
        frames = cls.__dict__.get("__executing_cache")
        if isinstance(frames, dict):
            for key in [k for k in frames if a_cell(getattr(k[0], "co_filename", None))]:
                del frames[key]
    # Keyed by a source's statements (the cells' among them): cheap to fill again.
    for cached in (getattr(executing.Source, "statements_at_line", None),
                   getattr(executing, "statement_containing_node", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------


class Kernel:
    def __init__(self, channel, control, shell, prepared=False):
        self.channel = channel
        # The control pipe's reader: ping and purge (see the module's docstring).
        self.control = control
        self.shell = shell
        self._libc = _load_libc()
        # Private copies of the capture pipes, to point fds 1/2 back at them.
        self._private_w = {1: os.dup(1), 2: os.dup(2)}
        # The process forked for the next fresh run, and the pipe its request goes down:
        # (pid, write fd), or None.
        self.standby = None
        # The pidfd of the fresh run's process being waited for, if any (see run_fresh).
        self.exit_watch = None
        # Whether the zygote made its one-off preparation for forked jobs (prepare_for_forks):
        # before its first standby, or at start (SANDCELL_PREPARE_AT_START).
        self.prepared = prepared
        # The namespaces of a session's contexts other than the current one, by name:
        # (module, namespace, execution count).
        self.context = DEFAULT_CONTEXT
        self.contexts = {}
        # The inputs of a session's past cells, bounded (see InputHistory).
        self.history = InputHistory(shell)
        # The state of every open file this process holds, as it was when it became ready:
        # a fresh run inherits them (see restore_shared_files).
        self.shared_files = shared_file_states()

    def serve(self):
        while True:
            # Between requests only (a cell's acks are read where it waits for them).
            readable = select.select([self.channel.in_fd, self.control.in_fd], [], [])[0]
            if self.control.in_fd in readable:
                payload = self.control.recv()
                if payload is None:
                    return
                self.answer_control(json.loads(payload))
                continue
            payload = self.channel.recv()
            if payload is None:
                return
            req = json.loads(payload)  # built by the driver
            if req.get("type") != "run":
                continue  # an ack of a frame the code forged itself
            # The processes the driver killed after the last cell were children of this
            # process: reap them (as a notebook's kernel would never need to).
            _reap_children()
            if req.get("fresh") is True:
                # Only the run's id: its code and environment are for its own process to read.
                self.run_fresh(str(req.get("id")))
            else:
                self.run_cell(req)

    def answer_control(self, req):
        """A request of the control pipe: ping or purge (anything else is dropped)."""
        kind = req.get("type")
        if kind == "ping":
            # The driver checks, after a fresh job, that this process still answers, as it was
            # when it became ready.
            self.restore_shared_files()
            # The standby first: it is the next job's wait, and no process of the last job is
            # left to change what is read below between the fork and the read (the driver
            # asks only once the job's processes are gone); the standby inherits exactly it.
            standby = self.fork_standby() if req.get("standby") is True else None
            settings = _own_settings()
            settings["files"] = {str(fd): state for fd, state in shared_file_states(skip=self.own_fds()).items()}
            self.channel.send({"type": "pong", "nonce": req.get("nonce"), "settings": settings, "standby": standby})
        elif kind == "purge":
            self.purge()
            self.channel.send({"type": "purged", "nonce": req.get("nonce")})

    def run_cell(self, req):
        self.reassert()
        env = req.get("env") or {}
        if req["language"] == "python":
            self.use_context(req.get("context"))
            self.shell.sandcell_last_exc = None
            with cell_environment(env):
                exit_code = self.run_python(req["id"], req["code"])
        else:
            exit_code = self.run_bash(req["code"], env)
        self.flush()
        self.channel.send({"type": "cell_done", "id": req["id"], "exit_code": exit_code,
                           "execution_count": self.execution_count, "errno": self.last_error_errno})

    def run_fresh(self, run_id):
        """Run the fresh run run_id in a child forked for it (the standby, when
        there is one), which reads the run's body itself; this process waits,
        then says how the child ended (child_exit), unless the driver purged
        meanwhile.  The child never returns here.

        While it waits it answers the control pipe (never the request pipe:
        the child reads its acks there): after the job's done the driver
        purges and asks for the next job's standby while the job's process
        may still be being torn down (its memory unmapped, milliseconds),
        which then no longer delays that standby."""
        pid = self.hand_to_standby(run_id)
        if pid is None:
            pid = self.channel.fork_heir()
            if pid == 0:
                self.run_as_child(run_id)
        exited = self.exit_watch = _exit_watch(pid)
        purged = False
        try:
            while True:
                try:
                    reaped, wait_status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    reaped, wait_status = pid, None  # reaped by the purge
                if reaped == pid:
                    break
                # Without a pidfd (gVisor) the child's exit is polled.
                watched = [self.control.in_fd] if exited is None else [self.control.in_fd, exited]
                readable = select.select(watched, [], [], None if exited is not None else 0.005)[0]
                if self.control.in_fd in readable:
                    payload = self.control.recv()
                    if payload is None:
                        os._exit(0)  # the driver is gone
                    control = json.loads(payload)
                    purged = purged or control.get("type") == "purge"
                    self.answer_control(control)
        finally:
            self.exit_watch = None
            if exited is not None:
                os.close(exited)
        if not purged:
            status = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
            self.channel.send({"type": "child_exit", "id": run_id, "status": status})

    def read_body(self, run_id):
        """The body of fresh run run_id, the next frame of the request pipe."""
        payload = self.channel.recv()
        body = json.loads(payload) if payload is not None else None
        if not isinstance(body, dict) or body.get("type") != "run_body" or body.get("id") != run_id:
            raise ValueError("expected the body of %s on the request pipe" % run_id)
        body["fresh"] = True
        return body

    def run_as_child(self, run_id, reseeded=False):
        """A fresh run's process: read the run's body, run the cell, then exit
        (never returns).  reseeded: a standby that drew its own random state
        while it waited."""
        status = 70  # EX_SOFTWARE: the cell's machinery failed
        try:
            if not reseeded:
                _reseed_after_fork()
            self.run_cell(self.read_body(run_id))
            status = 0
        except BaseException as exc:
            try:
                self.channel.log("fresh run failed: %r" % (exc,))
            except BaseException:
                pass
        finally:
            # Not sys.exit: no atexit handler or thread of the job's runs on.
            os._exit(status)

    def fork_standby(self):
        """Fork the process for the next fresh run and have it take, before
        any job exists, the page faults a forked process pays on the cell
        machinery's first use; it then waits for its request on a pipe only
        this process writes.  Returns its pid."""
        if self.standby is not None:
            return self.standby[0]  # still unused: the last request ran no cell
        if not self.prepared:
            # Once, before the first standby (so not on a job's path, and only in a sandbox
            # that forks), unless it was made at start.
            self.prepared = True
            prepare_for_forks(self._libc, self.channel.log)
        go_r, go_w = os.pipe()
        try:
            pid = self.channel.fork_heir()
        except OSError as exc:
            # The sandbox's pids limit, say (what the last job left may still be exiting): the
            # next run forks for itself.
            os.close(go_r)
            os.close(go_w)
            self.channel.log("cannot fork the standby: %r" % (exc,))
            return None
        if pid == 0:
            try:
                os.close(go_w)
                if self.exit_watch is not None:
                    # The last job's process, still being torn down: nothing of it for this one.
                    os.close(self.exit_watch)
                warm_up_shell(self.shell)
                # Its own random state now, off the job's path: this process serves one job.
                _reseed_after_fork()
                go = _read_request(go_r)
            except BaseException:
                os._exit(70)
            if go is None:
                os._exit(0)  # the zygote went, or dropped this standby
            self.run_as_child(go["id"], reseeded=True)
        os.close(go_r)
        self.standby = (pid, go_w)
        return pid

    def hand_to_standby(self, run_id):
        """Have the standby run run_id; its pid, or None when there is none (or
        it died: it is then reaped, and the caller forks as before)."""
        if self.standby is None:
            return None
        pid, go_w = self.standby
        self.standby = None
        try:
            _write_all(go_w, json.dumps({"id": run_id}).encode("utf-8"))
            return pid
        except OSError as exc:
            self.channel.log("the standby process is gone (%r): forking anew" % (exc,))
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # already reaped between runs
            return None
        finally:
            os.close(go_w)

    def purge(self):
        """After a fresh job (its own process gone): end every other process of
        this uid -- whatever the job left, wherever it hides -- with one
        kill(-1, SIGKILL). The kernel holds the task list while it signals, so
        no process forks past it (a job's processes that fork and exit in a
        loop slipped through the driver's scans of /proc), and a process with
        the signal pending cannot fork. Only the sandbox's own processes share
        this uid; this process is spared by kill(-1) itself, and a standby
        would not be (there is none between a job and its cleanup)."""
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing else of this uid
        _reap_children()
        if self.standby is not None:
            os.close(self.standby[1])
            self.standby = None

    def own_fds(self):
        """The fds this process opened since it became ready that no job shares: the pipe the
        standby's request goes down, the pidfd of a fresh run's process it waits for."""
        return {fd for fd in (None if self.standby is None else self.standby[1], self.exit_watch) if fd is not None}

    def restore_shared_files(self):
        """Between fresh runs (every process of the last one gone): put the open files this
        process shares with every fresh run back as they were when it became ready.

        A forked job holds this process's open file descriptions -- /dev/null on fd 0, the
        capture pipes on fds 1 and 2, the pipes to the driver, files a preloaded library
        keeps open -- and what it sets on one stays set on it after the job is gone: status
        flags (O_NONBLOCK, O_ASYNC, O_DIRECT, O_APPEND), the owner and signal of O_ASYNC, the
        offset of a file, a pipe's size, and locks (flock, open-file-description locks). The
        next job would inherit them: its output lost or cut (a non-blocking or packet-mode
        pipe), a SIGINT at its first print, data left in lock ranges or an offset. Each is
        reset here; the pong then reports the state, which the driver compares with the one
        at ready (the sandbox is not reused if any differs)."""
        for fd, was in self.shared_files.items():
            for reset in (lambda: fcntl.flock(fd, fcntl.LOCK_UN),
                          lambda: fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)),
                          lambda: was["flags"] is not None and fcntl.fcntl(fd, fcntl.F_SETFL, was["flags"]),
                          lambda: was["owner"] is not None and fcntl.fcntl(fd, fcntl.F_SETOWN, was["owner"]),
                          lambda: was["signal"] is not None and fcntl.fcntl(fd, fcntl.F_SETSIG, was["signal"]),
                          lambda: was.get("pipe_size") is not None and fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, was["pipe_size"]),
                          lambda: was.get("offset") is not None and os.lseek(fd, was["offset"], os.SEEK_SET)):
                try:
                    reset()
                except OSError:
                    pass  # not applicable to this kind of file (then it was not changed either)

    def await_ack(self):
        """Block until the driver has forwarded the frame just sent."""
        if os.getpid() != self.channel.owner:
            return  # a forked child: its frames went nowhere
        payload = self.channel.recv()
        if payload is None:
            os._exit(0)  # the driver is gone

    def reassert(self):
        """Undo what a previous cell may have done to stdio: point fds 1/2
        back at the pipes, and replace closed or missing sys.stdout/stderr."""
        for fd, write_fd in self._private_w.items():
            os.dup2(write_fd, fd)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name, None)
            if stream is None or getattr(stream, "closed", False) is True:
                setattr(sys, name, open_std_stream(fd))

    def flush(self):
        """Push buffered output into the pipes (the driver frames it in order
        before the frame the kernel sends next)."""
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

    @property
    def execution_count(self):
        # IPython's counter names the *next* cell.
        return max(self.shell.execution_count - 1, 0)

    @property
    def last_error_errno(self):
        # The errno of the exception the last python cell ended with, if any.
        value = getattr(getattr(self.shell, "sandcell_last_exc", None), "errno", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def run_python(self, req_id, code):
        shell = self.shell

        def sink(frame):
            # Flush output first, and wait until the driver has forwarded the
            # frame, so frames keep the order in which the cell produced them
            # (the driver frames what is in the pipes before it forwards).
            with GATE.protected():
                self.flush()
                self.channel.send(dict(frame, id=req_id))
                self.await_ack()

        shell.sandcell_sink = sink
        shell.sandcell_errors_sent = 0
        self.history.begin()
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
            try:
                self.history.end()
                if shell.sandcell_errors_sent:
                    forget_traceback_sources()
            except Exception as exc:  # the cell's code may have rewritten IPython's history
                self.channel.log("could not bound the history of past cells: %r" % (exc,))
        return 1 if failed else 0

    def use_context(self, name):
        """Make `name`'s namespace the shell's (None: the default one), made
        fresh on first use. Each keeps its own variables and execution count;
        modules, files and processes are the kernel's."""
        name = name or DEFAULT_CONTEXT
        if name == self.context:
            return
        shell = self.shell
        # user_ns_hidden too: the names IPython put in a namespace (In, Out, exit, ...), which
        # are not the user's (%who, and a moving session's snapshot, leave them out).
        self.contexts[self.context] = (shell.user_module, shell.user_ns, shell.execution_count, shell.user_ns_hidden)
        made = name not in self.contexts
        if made:
            module, ns = shell.prepare_user_module(None, None)
            self.contexts[name] = (module, ns, 1, None)
        module, ns, count, hidden = self.contexts[name]
        shell.init_create_namespaces(module, ns)
        sys.modules["__main__"] = module
        shell.execution_count = count
        if made:
            shell.init_user_ns()
            # Its own Out, as it has its own execution count (IPython's is the history's one
            # dict, shared, whose numbers would collide, and whose culling would leave the
            # other contexts' `_N` values held).
            out = {}
            for names in (shell.user_ns, shell.user_ns_hidden):
                names["_oh"] = names["Out"] = out
        else:
            shell.user_ns_hidden = hidden
        self.context = name

    def run_bash(self, code, env=None):
        # stdout/stderr are inherited: fds 1/2 are the capture pipes.
        proc = subprocess.Popen(["bash", "-c", code], cwd=WORKSPACE, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=dict(os.environ, **(env or {})))
        try:
            with GATE.cell():
                returncode = proc.wait()
        except KeyboardInterrupt:
            returncode = self.interrupt_bash(proc)
        # Whatever the script left running (in its process group or not) is killed,
        # and counted, by the driver.
        return 128 - returncode if returncode < 0 else returncode

    @staticmethod
    def interrupt_bash(proc):
        _killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(BASH_INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


@contextlib.contextmanager
def cell_environment(env):
    """`env` in os.environ for the cell, and os.environ's earlier values
    back after it (what the cell itself set besides stays, as in a notebook)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass



# matplotlib's font list as the image's build left it (sandbox/build-image.sh MPL_FONT_CACHE).
MPL_FONT_CACHE = "/usr/local/share/sandcell/matplotlib"


def seed_font_cache(log):
    """Copy the image's prebuilt font list into this sandbox's MPLCONFIGDIR (a fresh tmpfs),
    where matplotlib looks for it: else its first import scans every font file of the image.
    Best effort: without it matplotlib builds the list itself, as before."""
    target = os.environ.get("MPLCONFIGDIR")
    try:
        names = [n for n in os.listdir(MPL_FONT_CACHE) if n.startswith("fontlist-") and n.endswith(".json")]
        if not target or not names:
            return
        os.makedirs(target, exist_ok=True)
        for name in names:
            if not os.path.exists(os.path.join(target, name)):
                with open(os.path.join(MPL_FONT_CACHE, name), "rb") as src, \
                        open(os.path.join(target, name), "xb") as dst:
                    dst.write(src.read())
    except OSError as exc:
        log("no prebuilt font list: %r" % (exc,))


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


def forget_fonts():
    """Empty matplotlib's cache of open fonts, which the warm-up's figure filled. Every process
    forked from this one empties it at the fork anyway (matplotlib's own at-fork handler: a
    FreeType font must not be shared across a fork), and freeing this process's fonts there
    wrote some 100-150 of its pages, each copied for every fresh job; each also inherited the
    font file's fd. A session's first figure loads its font again: no cost this machine can
    measure (a 2-inch figure with a title, saved: 37.5-40.1 ms either way)."""
    font_manager = sys.modules.get("matplotlib.font_manager")
    get_font = getattr(font_manager, "_get_font", None)
    if get_font is not None and hasattr(get_font, "cache_clear"):
        get_font.cache_clear()


def warm_up_matplotlib(log):
    """Render a throwaway figure so a cell's first figure doesn't pay for
    loading the Agg backend and its modules.  Uses Figure directly: pyplot's
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
        forget_fonts()
    except Exception as exc:
        log("matplotlib warm-up failed: %r" % (exc,))
        return
    log("matplotlib warm-up took %.0f ms" % ((time.monotonic() - started) * 1000.0))




# The resource limits a process can have, by name (RLIMIT_AS, ...): listed once.
_RLIMITS = tuple((name, getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_"))


def _own_settings():
    """What a process of this uid can change about this process from outside
    (prlimit, setpriority, sched_setaffinity, sched_setscheduler, sched_setattr
    -- a CFS slice, utilization clamps --, ioprio_set, its session's autogroup
    nice), read in-process: every fresh job inherits it.

    Read at every ping, right after the standby is forked, when each page this process writes
    is copied for it (the standby shares them): so it builds nothing it could have built once
    (the list of limits, the libc handle: a ctypes.CDLL made per call creates classes)."""
    limits = {}
    for name, resource_id in _RLIMITS:
        try:
            limits[name] = list(resource.getrlimit(resource_id))
        except (ValueError, OSError):
            pass
    settings = {"rlimits": limits}
    for key, read in (("nice", lambda: os.getpriority(os.PRIO_PROCESS, 0)),
                      ("affinity", lambda: sorted(os.sched_getaffinity(0))),
                      ("policy", lambda: os.sched_getscheduler(0)),
                      ("io_priority", _io_priority),
                      ("sched_attr", _sched_attr),
                      ("autogroup", _autogroup)):
        try:
            settings[key] = read()
        except (OSError, AttributeError):
            settings[key] = None
    return settings


# Numbers of the system calls Python has no function for, on this machine.
_SYSCALLS = {"x86_64": {"ioprio_get": 252, "sched_getattr": 315},
             "aarch64": {"ioprio_get": 31, "sched_getattr": 275}}.get(platform.machine(), {})
# libc's syscall(), loaded on first use (a list: assigned once, no global statement).
_SYSCALL_FN = []


def _syscall(name, *args):
    number = _SYSCALLS.get(name)
    if number is None:
        return None
    if not _SYSCALL_FN:
        try:
            _SYSCALL_FN.append(ctypes.CDLL(None, use_errno=True).syscall)
        except OSError:
            return None
    result = _SYSCALL_FN[0](number, *args)
    if result < 0:
        raise OSError(ctypes.get_errno(), "%s failed" % name)
    return result


def _autogroup():
    """This process's autogroup and its nice ("/autogroup-N nice K"): a job of the session may
    set it (after making itself dumpable), for every later job; None without autogroups."""
    try:
        with open("/proc/self/autogroup") as f:
            return f.read().strip()
    except OSError:
        return None


def _io_priority():
    """ioprio_get(IOPRIO_WHO_PROCESS, this process)."""
    return _syscall("ioprio_get", 1, 0)


def _sched_attr():
    """sched_getattr(this process): policy, flags, nice, priority, runtime (EEVDF's slice for
    a normal task), deadline, period, utilization clamps."""
    buf = ctypes.create_string_buffer(56)
    if _syscall("sched_getattr", 0, buf, ctypes.c_uint(56), ctypes.c_uint(0)) is None:
        return None
    return list(struct.unpack("=IIQiIQQQII", buf.raw))


def shared_file_states(skip=()):
    """The open files of this process by fd (but those in `skip`), with what a process holding the same
    open file description could change: which file it is, its status flags, the owner and
    signal of O_ASYNC, a pipe's size, a seekable file's offset (None where the kernel, gVisor's
    say, does not tell)."""
    def read(f):
        try:
            return f()
        except OSError:
            return None

    states = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in skip:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # the directory listing's own fd, closed by now
        state = {"file": [st.st_dev, st.st_ino], "flags": read(lambda: fcntl.fcntl(fd, fcntl.F_GETFL)),
                 "owner": read(lambda: fcntl.fcntl(fd, fcntl.F_GETOWN)), "signal": read(lambda: fcntl.fcntl(fd, fcntl.F_GETSIG))}
        if stat.S_ISFIFO(st.st_mode):
            state["pipe_size"] = read(lambda: fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
        if stat.S_ISREG(st.st_mode):
            state["offset"] = read(lambda: os.lseek(fd, 0, os.SEEK_CUR))
        states[fd] = state
    return states


def warm_up_shell(shell):
    """Run the cell machinery once on code of our own, leaving the user
    namespace and the execution count as they were: IPython initialises
    much of it lazily (the formatters' traits, the tokenizer's patterns),
    which every fresh job would otherwise pay for again in its own process."""
    shell.run_cell("None", store_history=False)
    shell.display_formatter.format(2)


def _read_request(fd):
    """All of a request written to fd up to its end of file; None if empty."""
    parts = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        parts.append(chunk)
    os.close(fd)
    return json.loads(b"".join(parts)) if parts else None


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _reseed_after_fork():
    """A forked job must not share the zygote's random state: Python's random
    reseeds itself after a fork; numpy's global generator does not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:
            pass


# The reference count that marks an object immortal in CPython 3.12 and 3.13 (64-bit builds
# with the GIL): _Py_IMMORTAL_REFCNT, UINT_MAX; an object is immortal when the low 32 bits of
# its count, read as a signed integer, are negative. Python 3.14 changed the representation.
IMMORTAL_REFCNT = 0xFFFFFFFF

# The longest the zygote's one-off preparation before its first standby (immortalize, then
# collapse_to_huge_pages) may take, in ms: what is done by then stays done, the rest is left as
# it is. The default preload takes 0.3-0.5 s on a 2-core VM; a much larger one (millions of
# objects) could take longer than the driver waits for that ping (FIRST_STANDBY_S in
# driver.py, 8 s), which would cost the sandbox its reuse after its first job.
def _budget_ms(default=3000):
    try:
        return max(0, int(os.environ.get("SANDCELL_PREPARE_BUDGET_MS", default)))
    except ValueError:
        return default


PREPARE_BUDGET_MS = _budget_ms()


def prepare_for_forks(libc, log, clock=time.monotonic, advise=True):
    """The zygote's one-off preparation for the jobs it will fork, within PREPARE_BUDGET_MS
    of `clock`: its objects immortal, then its memory huge pages. A job's process then writes
    fewer of the zygote's pages (each it writes is copied), and a fork and a job's exit cost
    per page table entry of it. Before the first standby the budget is wall-clock time (it
    must fit the driver's wait for that ping); in a warm kernel's start it is this process's
    CPU time: that start runs in the idle CPU class, where a busy machine would otherwise cut
    the walk short for the sandbox's whole life (the start's own timeout bounds the wait).
    advise: see collapse_to_huge_pages."""
    deadline = clock() + PREPARE_BUDGET_MS / 1000
    immortalize(log, deadline, clock)
    collapse_to_huge_pages(libc, log, deadline, clock, advise)


def _immortal_layout():
    """Whether objects here carry CPython 3.12/3.13's immortal count, as immortalize writes it:
    None's whole count word reads IMMORTAL_REFCNT. It does not in a free-threaded build (whose
    first word is the owning thread's id, even with the GIL turned on), in 3.14 (another
    value) or on 32-bit; debug builds check counts and are left alone too."""
    if sys.version_info[:2] not in ((3, 12), (3, 13)) or hasattr(sys, "gettotalrefcount") \
            or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    return ctypes.c_int64.from_address(id(None)).value == IMMORTAL_REFCNT


def immortalize(log, deadline, clock=time.monotonic):
    """Make every object the zygote holds now immortal, so that a forked job's process that
    only reads one no longer writes to it. CPython counts the references to an object in the
    object itself: reading a module's function, a type, a name, writes their counts, and each
    page so written is copied into the job's process (copy on write). From 3.12 on an immortal
    object's count is never written (PEP 683); CPython makes only its static objects immortal,
    this makes the zygote's whole heap so: what the modules preloaded, the shell and the
    warm-up created. They are never freed, which changes nothing in a zygote, whose objects
    live as long as it does (and are frozen for the collector already); objects created after
    this are as before. Best effort: other versions or builds are left as they are, and what
    is not marked by `deadline` (of `clock`) stays mortal.
    Measured in the sandbox image (Python 3.13) on a 2-core VM: a fresh `1+1` job's page faults
    948 -> 598, its process's CPU 7.4 -> 5.6 ms (docs/benchmarks/speed-check.md, round 13)."""
    if not _immortal_layout():
        return
    started = time.monotonic()
    count = ctypes.c_int32.from_address
    whole = ctypes.c_ssize_t.from_address
    referents = gc.get_referents
    # The frozen generation is not listed by get_objects: thaw, walk, freeze again; no
    # collection meanwhile (it would visit every thawed object for nothing).
    collecting = gc.isenabled()
    gc.disable()
    gc.unfreeze()
    marked = 0
    try:
        todo = gc.get_objects()
        while todo:
            found = []
            for obj in todo:
                address = id(obj)
                if count(address).value < 0:
                    continue  # immortal already (or marked here: each object is walked once)
                whole(address).value = IMMORTAL_REFCNT
                marked += 1
                found += referents(obj)
                if not marked & 0x3FFF and clock() > deadline:
                    log("immortal: stopped at the time budget after %d objects in %d ms"
                        % (marked, (time.monotonic() - started) * 1000))
                    return
            todo = found
    except Exception as exc:  # MemoryError, say: what is marked stays so, the rest is as before
        log("immortal: stopped after %d objects: %r" % (marked, exc))
        return
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    log("immortal: %d objects in %d ms" % (marked, (time.monotonic() - started) * 1000))


# madvise(2) advice: MADV_HUGEPAGE (14), MADV_COLLAPSE (25, Linux 6.1).
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 2 << 20


def collapse_to_huge_pages(libc, log, deadline, clock=time.monotonic, advise=True):
    """Back the zygote's private writable memory (the imported modules' objects, some 80 MiB
    with numpy, pandas and matplotlib) with 2 MiB pages where the kernel can: a fork then
    copies one entry per 2 MiB instead of 512, and a job's exit unmaps as few. A page a job
    writes is still copied alone (the kernel splits a shared huge page on a write fault).
    Best effort: where the kernel has no MADV_COLLAPSE (older kernels, gVisor) nothing changes,
    and no region is begun after `deadline` (of `clock`).
    advise: also mark the regions MADV_HUGEPAGE, which lasts: their later faults, in the
    zygote and in every process it forks, take huge pages too (with direct compaction under
    the kernel's default defrag setting). Not in a warm kernel's start: a session may take
    that kernel and run its cells in those regions for hours (16 sessions of which some took
    such kernels ran 4-20 % fewer jobs a second, in 7 runs of 7; with the collapse alone, no
    loss in 3 runs). MADV_COLLAPSE needs no mark.
    Measured in the sandbox image on a 2-core VM: fork + exit + wait of the zygote 5.4 -> 3.8 ms."""
    if libc is None:
        return
    started = time.monotonic()
    collapsed = refused = 0
    try:
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except (OSError, AttributeError) as exc:
        log("no huge pages: %r" % (exc,))
        return
    for line in lines:
        if clock() > deadline:
            log("huge pages: stopped at the time budget")
            break
        fields = line.split()
        if len(fields) < 2 or not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith(("[v", "[stack"))):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end &= ~(HUGE_PAGE - 1)
        if end - start < HUGE_PAGE:
            continue
        if advise:
            madvise(start, end - start, MADV_HUGEPAGE)
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += 1
        else:
            refused += 1
    log("huge pages: %d regions collapsed, %d not, in %d ms"
        % (collapsed, refused, (time.monotonic() - started) * 1000))


def _exit_watch(pid):
    """A pidfd of child `pid`, readable once it has exited; None where there is none (gVisor)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _reap_children():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _load_libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def main(req_fd, rep_fd, ctl_fd):
    channel = Channel(req_fd, rep_fd, None, max_in=MAX_REQUEST_BYTES, guard=GATE.protected)
    # Read only here, and closed in every process forked from this one before any code of a
    # job runs (the channel's at-fork handler): see the module's docstring.
    os.set_inheritable(ctl_fd, False)
    control = Channel(ctl_fd, None, None, max_in=MAX_REQUEST_BYTES)

    def log(message):
        try:
            channel.send({"type": "log", "message": message})
        except Exception:
            pass

    channel.log = log
    control.log = log
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open_std_stream(1)
    sys.stderr = open_std_stream(2)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    threading.excepthook = lambda args: log("exception in thread %s: %r" % (args.thread, args.exc_value))
    GATE.install()
    # Defaults for running outside the image; the image sets these itself.
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("MPLCONFIGDIR", "/tmp/.mpl")
    os.environ.setdefault("IPYTHONDIR", "/tmp/.ipython")
    os.chdir(WORKSPACE)
    # Like Jupyter: modules the job writes to the workspace are importable.
    sys.path[0] = ""
    # And so are packages a cell installs with pip (into the user's site, in the workspace):
    # the directory must exist for site to put it on the path.
    try:
        import site

        os.makedirs(site.getusersitepackages(), exist_ok=True)
        site.addsitedir(site.getusersitepackages())
    except (OSError, AttributeError) as exc:
        log("no user site: %r" % (exc,))
    import warnings

    # plt.show() on Agg is expected here: figures are captured after the
    # cell, so the "non-GUI backend" warning is just noise.
    warnings.filterwarnings("ignore", message=".*non-GUI backend.*")
    warnings.filterwarnings("ignore", message=".*is non-interactive, and thus cannot be shown.*")
    seed_font_cache(log)
    shell = create_shell()
    import IPython

    # After the shell exists, so a preloaded pyplot hooks into IPython
    # exactly as if a cell had imported it.
    preloaded = preload(os.environ.get("SANDCELL_PRELOAD", ""), log)
    # Neither ptrace nor /proc/<pid>/mem of this process for the code it runs or forks (same
    # uid): a fresh job's process cannot reach into the zygote that forks the next one.
    try:
        warm_up_shell(shell)
    except Exception as exc:
        log("shell warm-up failed: %r" % (exc,))
    # What exists now is the zygote's for good: the garbage collector of a forked job need not
    # visit (and so copy) it.
    gc.collect()
    gc.freeze()
    libc = _load_libc()
    if libc is not None:
        try:
            libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
        except Exception as exc:
            log("cannot clear the dumpable flag: %r" % (exc,))
    # A warm-pool kernel makes its preparation for forked jobs now, in its start (in the idle
    # CPU class, off every job's path), rather than after the first one-off job that takes it:
    # in a tenant's first burst that was ~0.3 s of CPU per warm kernel taken. A session that
    # takes it instead keeps preloaded objects that are never freed (they live as long as the
    # kernel anyway) and ~2 MiB more of huge pages.
    prepared = os.environ.get("SANDCELL_PREPARE_AT_START") == "1"
    if prepared:
        prepare_for_forks(libc, log, clock=time.process_time, advise=False)
    channel.send({"type": "ready", "ipython": IPython.__version__, "preloaded": preloaded, "prepared": prepared})
    Kernel(channel, control, shell, prepared=prepared).serve()
    # os._exit: don't wait for threads a job may have left running.
    os._exit(0)
