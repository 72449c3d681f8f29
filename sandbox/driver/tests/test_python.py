"""Python cells: outputs in order, errors, interrupts, stdio."""

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

    def test_top_level_await_runs_as_in_a_notebook(self):
        # The shell skips IPython's check for top-level await in cells that say neither
        # `await` nor `async`: those that do still run in the coroutine runner.
        frames = self.run_ok("import asyncio\nawait asyncio.sleep(0)\nx = await asyncio.sleep(0, result=41)\nx + 1")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "42")
        frames = self.run_ok("async def gen():\n    yield 1\n    yield 2\n[v async for v in gen()]")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "[1, 2]")
        # The words in a string do not make a cell a coroutine: it runs as any other.
        frames = self.run_ok("'no await, no async here'")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "'no await, no async here'")

    def test_a_scalars_value_is_formatted_as_ipython_formats_it(self):
        # Builtin scalars take a shorter path to their text/plain; it must answer as IPython's
        # full formatting (`display_formatter.format`) does: its precision setting, its
        # printers, and every other formatter's when one has a printer for the type or a base
        # of it. A driver of its own: the printers registered here must not reach other tests.
        driver = DriverProcess()
        try:
            def value(code):
                frames = driver.execute(code)
                self.assertEqual(done(frames)["status"], "ok", frames)
                results = of_type(frames, "execute_result")
                return results[0]["data"] if results else None

            def full(code):
                frames = driver.execute("import json as _j\nprint(_j.dumps(get_ipython().display_formatter.format(%s)[0]))" % code)
                return json.loads(stream_text(frames, "stdout"))

            scalars = ["7 * 6", "2 ** 70", "1 / 3", "True", "'a\\nb'", "b'x'", "1 + 2j"]
            self.assertEqual(value("7 * 6"), {"text/plain": "42"})
            self.assertEqual(value("1 / 3"), {"text/plain": "0.3333333333333333"})
            setups = [
                "None",
                "%precision 2",
                "get_ipython().display_formatter.formatters['text/plain'].for_type(int, lambda n, p, cycle: p.text('int %d' % n))",
                "get_ipython().display_formatter.formatters['text/html'].for_type(float, lambda x: '<b>%s</b>' % x)",
                "get_ipython().display_formatter.formatters['text/markdown'].for_type_by_name('builtins', 'object', lambda o: '*o*')",
            ]
            for setup in setups:
                driver.execute(setup)
                for code in scalars:
                    self.assertEqual(value(code), full(code), "%s, after %s" % (code, setup))
            self.assertEqual(value("1 / 3"), {"text/plain": "0.33", "text/html": "<b>0.3333333333333333</b>", "text/markdown": "*o*"})
            self.assertEqual(value("2.5"), {"text/plain": "2.50", "text/html": "<b>2.5</b>", "text/markdown": "*o*"})
            self.assertEqual(value("5")["text/plain"], "int 5")
        finally:
            driver.close()

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

    def test_values_shown_mid_cell_keep_their_place_among_the_output(self):
        # With every expression shown (not IPython's default), a value is followed by more of the
        # cell: what it prints next, at once and at the C level too, comes after the value (the
        # kernel waits for the driver's ack of each frame; a round without that wait for values,
        # speed-check round 30, failed this test until values shown mid-cell waited again).
        self.run_ok("get_ipython().ast_node_interactivity = 'all'")
        try:
            for _ in range(30):
                frames = self.run_ok("import os\n1\nw = os.write(1, b'a\\n')\n2\nprint('b')\n3")
                seen = [f["data"]["text/plain"] if f["type"] == "execute_result" else f["text"]
                        for f in frames if f["type"] in ("execute_result", "stream")]
                self.assertEqual(seen, ["1", "a\n", "2", "b\n", "3"])
        finally:
            self.run_ok("get_ipython().ast_node_interactivity = 'last_expr'")

    def test_output_written_just_before_a_rich_output_is_framed_before_it(self):
        # The driver skips the capture pipes' sync when they hold nothing; bytes written at the
        # C level (unbuffered) or by a child process an instant before a rich output, or before
        # the cell ends, must still be framed before it.
        frames = self.run_ok(
            "import os, subprocess\n"
            "from IPython.display import display\n"
            "for i in range(60):\n"
            "    os.write(1, b'w%d\\n' % i)\n"
            "    if i % 10 == 0:\n"
            "        subprocess.run(['echo', 'child%d' % i])\n"
            "    display(i)\n"
            "os.write(2, b'last')")
        seen = []
        for f in frames:
            if f["type"] == "stream" and f["name"] == "stdout":
                seen.append(("out", f["text"]))
            elif f["type"] == "display_data":
                seen.append(("display", f["data"]["text/plain"]))
        expected = []
        for i in range(60):
            expected.append(("out", "w%d\n" % i + ("child%d\n" % i if i % 10 == 0 else "")))
            expected.append(("display", str(i)))
        # Consecutive stream frames may be split or joined; compare with them merged.
        merged = []
        for kind, text in seen:
            if merged and kind == "out" and merged[-1][0] == "out":
                merged[-1] = ("out", merged[-1][1] + text)
            else:
                merged.append((kind, text))
        self.assertEqual(merged, expected)
        self.assertEqual(stream_text(frames, "stderr"), "last")
        self.assertEqual(frames[-1]["type"], "done")

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
        error = of_type(frames, "error")[0]
        self.assertEqual(error["ename"], "KeyboardInterrupt")
        # The traceback ends in the user's cell, not in sandcell's signal handler.
        self.assertIn("while True", "\n".join(error["traceback"]))
        self.assertNotIn("sandcell", "\n".join(error["traceback"]))
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


if __name__ == "__main__":
    unittest.main(verbosity=2)
