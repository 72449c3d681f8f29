"""What a long session's kernel keeps of its past cells: bounded, and culled quietly."""

import json
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)


def result_text(frames):
    results = of_type(frames, "execute_result")
    return results[-1]["data"]["text/plain"] if results else None


class TestHistory(unittest.TestCase):
    """Each test has a driver of its own: they measure the kernel's memory and count its cells."""

    def setUp(self):
        self.driver = DriverProcess()

    def tearDown(self):
        self.driver.close()

    def run_ok(self, code):
        frames = self.driver.execute(code)
        d = done(frames)
        self.assertEqual((d["status"], d["exit_code"]), ("ok", 0), "frames: %s" % json.dumps(frames)[:2000])
        return frames

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


if __name__ == "__main__":
    unittest.main()
