"""What a long session's kernel keeps of its past cells: bounded, and culled quietly."""

import json
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)


def result_text(frames):
    results = of_type(frames, "execute_result")
    return results[-1]["data"]["text/plain"] if results else None


class TestHistory(DriverTestCase):
    """Each test has a driver of its own (not the shared one): they measure the kernel's memory
    and count its cells."""

    @classmethod
    def setUpClass(cls):
        pass

    def setUp(self):
        self.driver = DriverProcess()

    def tearDown(self):
        self.driver.close()

    def test_a_session_past_a_thousand_results_gets_no_warning_in_its_output(self):
        # IPython's output cache (Out, _N) holds 1,000 results; at the 1,001st it culls the
        # oldest and printed a UserWarning into that cell's stderr, which an agent reads as its
        # code's output.
        self.run_ok("n = 0")
        for _ in range(1010):
            frames = self.run_ok("n += 1\nn")
            self.assertEqual(of_type(frames, "stream"), [], "a cell of `n += 1; n` printed")
        frames = self.run_ok("(len(Out) < 1000, '_1' in dir(), _ == n, Out[max(Out)] == n,"
                             " len(get_ipython().history_manager.output_hist_reprs) == len(Out))")
        self.assertEqual(result_text(frames), "(True, False, True, True, True)")

    def test_a_long_session_of_large_cells_holds_a_bounded_history(self):
        # Each cell's ~1 MiB of code was kept three times for the kernel's life (In, _iN and the
        # raw history, linecache): 60 such cells held ~180 MiB more; the bound keeps 32 MiB.
        self.run_ok("def boom():\n    return 1 / 0")
        before = self.driver.stats()["rss_kb"]
        blob = "x" * (1 << 20)
        for i in range(60):
            self.run_ok("blob = %r\nlast = %d" % (blob, i))
        grown_kib = self.driver.stats()["rss_kb"] - before
        self.assertLess(grown_kib, 80 * 1024, "the kernel grew %d KiB over 60 cells of 1 MiB" % grown_kib)
        frames = self.run_ok("(len(In[1]), '_i1' in dir(), _i.endswith('last = 59'), len(In[-2]) > 1 << 20, last)")
        self.assertEqual(result_text(frames), "(0, False, True, True, 59)")
        # A function of a cell whose input is gone still runs, and still fails as it should,
        # with its frames in the traceback (without their source lines).
        frames = self.driver.execute("boom()")
        errors = of_type(frames, "error")
        self.assertEqual([e["ename"] for e in errors], ["ZeroDivisionError"], json.dumps(frames)[:2000])
        self.assertIn("boom", "\n".join(errors[0]["traceback"]))
        # Recent cells keep their source for tracebacks.
        frames = self.driver.execute("def near():\n    return 1 / 0\nnear()")
        self.assertIn("return 1 / 0", "\n".join(of_type(frames, "error")[0]["traceback"]))


    def test_a_session_of_failing_cells_holds_a_bounded_memory(self):
        # IPython's traceback formatting (stack_data, executing) kept every failing cell's text,
        # syntax tree and tokens for the kernel's life: 300 cells of 4 KB held ~105 MiB more.
        self.driver.execute("1 / 0")  # the traceback machinery's own imports
        before = self.driver.stats()["rss_kb"]
        for i in range(300):
            code = "\n".join("[k * %d + %d for k in range(10)]  # a line of some agent's code" % (j, i)
                             for j in range(60))
            frames = self.driver.execute(code + "\nraise ValueError(%d)" % i)
            self.assertEqual([e["ename"] for e in of_type(frames, "error")], ["ValueError"])
        grown_kib = self.driver.stats()["rss_kb"] - before
        self.assertLess(grown_kib, 64 * 1024, "the kernel grew %d KiB over 300 failing cells of 4 KB" % grown_kib)

    def test_equal_cells_of_two_contexts_keep_their_source_when_the_older_goes(self):
        # The lines a traceback quotes are kept under a name made of the cell's count and text:
        # the same cell as a context's first cell in two contexts has one name, which the older
        # one's trim must not take from the newer.
        cell = "def f():\n    return 1 / 0"
        self.run_ok(cell)  # count 1 of the default context
        self.driver.execute("x = 1", context="b")
        blob = "x" * (1 << 20)
        for _ in range(8):
            self.driver.execute("blob = %r" % blob, context="b")
        frames = self.driver.execute(cell, context="c")  # count 1 of context c: the same name
        for _ in range(4):  # past 32 MiB: the default context's cell goes
            self.driver.execute("blob = %r" % blob, context="b")
        frames = self.driver.execute("f()", context="c")
        self.assertIn("return 1 / 0", "\n".join(of_type(frames, "error")[0]["traceback"]), json.dumps(frames)[:2000])
        frames = self.run_ok("len(In[1])")
        self.assertEqual(result_text(frames), "0", "the default context's first cell was not trimmed")

    def test_each_context_culls_its_own_values(self):
        # Out was one dict for all contexts, numbered by each context's own count: a context's
        # culling left the other contexts' `_N` values held for good.
        self.run_ok("get_ipython().displayhook.cache_size = 20")
        self.driver.execute("1", context="b")
        for i in range(100):
            self.run_ok("[%d] * 1000" % i)
            self.driver.execute("[%d] * 1000" % i, context="b")
        probe = "(len(Out) <= 20, len([k for k in get_ipython().user_ns if k[:1] == '_' and k[1:].isdigit()]) <= 20, Out[max(Out)][0])"
        self.assertEqual(result_text(self.run_ok(probe)), "(True, True, 99)")
        self.assertEqual(result_text(self.driver.execute(probe, context="b")), "(True, True, 99)")

if __name__ == "__main__":
    unittest.main()
