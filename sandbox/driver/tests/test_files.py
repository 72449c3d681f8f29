"""The workspace: input files, artifacts, limits, listings, hostile names."""

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

    def test_a_session_cell_reports_what_a_thread_of_an_earlier_cell_wrote_between_cells(self):
        # The walk before a session's cell is the last cell's walk after it (one walk a cell):
        # a file the kernel's own thread wrote in between is the next cell's.
        self.run_ok("import threading, time\n"
                    "t_late = threading.Thread(target=lambda: (time.sleep(0.3), open('t_late.txt', 'w').write('late')))\n"
                    "t_late.start()")
        time.sleep(0.8)
        frames = self.run_ok("t_late.join()")
        self.assertEqual([f["path"] for f in of_type(frames, "file")], ["t_late.txt"])
        self.assertEqual(file_contents(frames)["t_late.txt"], b"late")
        # Reported once: the cell after it finds it unchanged.
        self.assertEqual(of_type(self.run_ok("None"), "file"), [])

    def test_inputs_written_before_an_input_error_are_not_reported_by_the_next_cell(self):
        self.run_ok("mkdir -p t_half && ln -sf /etc/hostname t_half/link", language="bash")
        frames = self.driver.execute("print('RAN')", files=[{"path": "t_half/first.txt", "content_b64": b64(b"1")},
                                                            {"path": "t_half/link", "content_b64": b64(b"x")}])
        self.assertEqual(done(frames)["status"], "input_error")
        self.assertTrue(os.path.exists(os.path.join(WORKSPACE, "t_half/first.txt")), "written before the error")
        self.assertEqual(of_type(self.run_ok("print('next')"), "file"), [])

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


if __name__ == "__main__":
    unittest.main(verbosity=2)
