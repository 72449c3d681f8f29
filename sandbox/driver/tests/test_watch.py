"""A session's workspace followed between cells (sandcell_workspace.WorkspaceWatch): what a
cell reports and lists is what a walk of the workspace before and after it would say."""

import os
import random
import shutil
import stat
import sys
import tempfile
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)

sys.path.insert(0, os.path.dirname(os.environ.get("SANDCELL_DRIVER", "/opt/sandcell/driver.py")))
import sandcell_workspace  # noqa: E402
from sandcell_workspace import WorkspaceWatch, snapshot  # noqa: E402


def walk(root, under=""):
    """The reference: os.walk and an lstat of every entry, as the driver walked before the
    watch (skipped directories left out), for the paths that begin with `under`."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        kept = []
        for name in dirnames:
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISDIR(st.st_mode):
                entries[os.path.join(rel_dir, name)] = st
            elif name not in sandcell_workspace.SKIPPED_DIRS and not (not rel_dir and name in sandcell_workspace.SKIPPED_TOP_DIRS):
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            entries[os.path.join(rel_dir, name)] = os.lstat(os.path.join(dirpath, name))
    return {p: (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino)
            for p, st in entries.items() if p.startswith(under)}


# Defined in the kernel once: `k` random changes under t_watch/r, of every kind a cell makes to
# its files (new, appended, touched, removed, renamed or replaced files; directories made,
# renamed, removed, or moved in from /tmp; symlinks; a file replaced by a directory).
OPS = r'''
import os, random, shutil, time
def t_watch_ops(seed, k):
    rng = random.Random(seed)
    root = "t_watch/r"
    os.makedirs(root, exist_ok=True)
    def dirs():
        return [d for d, _, _ in os.walk(root)]
    def files():
        return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not os.path.islink(os.path.join(d, f))]
    for i in range(k):
        op = rng.randrange(11)
        ds, fs = dirs(), files()
        name = "n%d_%d" % (seed, i)
        if op == 0 or not fs:
            open(os.path.join(rng.choice(ds), name), "w").write("x" * rng.randrange(50))
        elif op == 1:
            open(rng.choice(fs), "a").write("more")
        elif op == 2:
            os.utime(rng.choice(fs), ns=(time.time_ns(), rng.randrange(1, 10**18)))
        elif op == 3:
            os.unlink(rng.choice(fs))
        elif op == 4:
            os.rename(rng.choice(fs), os.path.join(rng.choice(ds), name))
        elif op == 5:
            path = os.path.join(rng.choice(ds), name, "deeper")
            os.makedirs(path)
            open(os.path.join(path, "f"), "w").write("deep")
        elif op == 6 and len(ds) > 1:
            src = rng.choice(ds[1:])
            dst = os.path.join(root, name)
            if not dst.startswith(src + "/"):
                os.rename(src, dst)
        elif op == 7 and len(ds) > 1:
            shutil.rmtree(rng.choice(ds[1:]))
        elif op == 8:
            outside = os.path.join("/tmp", name)
            os.makedirs(os.path.join(outside, "in"))
            open(os.path.join(outside, "in", "g"), "w").write("from tmp")
            shutil.move(outside, os.path.join(rng.choice(ds), name))
        elif op == 9:
            os.symlink("/etc/hostname", os.path.join(rng.choice(ds), name))
        elif op == 10 and len(fs) > 1:
            a, b = rng.sample(fs, 2)
            os.replace(a, b)
        else:
            victim = rng.choice(fs)
            os.unlink(victim)
            os.makedirs(victim)
            open(os.path.join(victim, "inside"), "w").write("was a file")
'''


class TestWatchedSessionWorkspace(DriverTestCase):
    def reported(self, frames, under):
        return sorted(f["path"] for f in frames if f["type"] in ("file", "file_skipped") and f["path"].startswith(under))

    def test_a_session_cell_reports_and_lists_what_a_walk_before_and_after_it_would_find(self):
        self.run_ok(OPS)
        for seed in range(60):
            with self.subTest(seed=seed):
                before = walk(WORKSPACE, "t_watch/")
                inputs = []
                if seed % 7 == 3:  # inputs into a directory of their own, new or not
                    inputs = [{"path": "t_watch/in%d/sub/f%d.txt" % (seed % 2, seed), "content_b64": b64(b"in")}]
                frames = self.run_ok("t_watch_ops(%d, %d)" % (seed, 1 + seed % 6), files=inputs, list_files=True)
                after = walk(WORKSPACE, "t_watch/")
                changed = sorted(p for p, key in after.items() if before.get(p) != key and not p.startswith("t_watch/in"))
                self.assertEqual(self.reported(frames, "t_watch/"), changed)
                listing = of_type(frames, "file_list")[0]
                self.assertFalse(listing["truncated"])
                self.assertEqual([e["path"] for e in listing["entries"] if e["path"].startswith("t_watch/")],
                                 sorted(p for p, key in after.items() if key[0] == stat.S_IFREG))

    def test_a_cell_naming_more_paths_than_the_watch_keeps_reports_what_a_walk_finds(self):
        # 17,000 names made and removed: past what the watch keeps (its events are read during
        # the cell, so no queue grows with them, gVisor's included); the cell walks.
        frames = self.run_ok("import os\nfor i in range(17000):\n    open('t_many_%d' % i, 'w').close()\n"
                             "    os.unlink('t_many_%d' % i)\nopen('t_many_kept.txt', 'w').write('k')")
        self.assertEqual(file_contents(frames), {"t_many_kept.txt": b"k"})
        frames = self.run_ok("open('t_many_kept.txt', 'a').write('+')")
        self.assertEqual(file_contents(frames), {"t_many_kept.txt": b"k+"})

    def test_an_input_written_into_a_new_directory_is_reported_only_once_the_cell_changes_it(self):
        frames = self.run_ok("print(open('t_win/new/a.txt').read())",
                             files=[{"path": "t_win/new/a.txt", "content_b64": b64(b"a")}])
        self.assertEqual(of_type(frames, "file"), [])
        frames = self.run_ok("open('t_win/new2/b.txt', 'a').write('+')",
                             files=[{"path": "t_win/new2/b.txt", "content_b64": b64(b"b")}])
        self.assertEqual(file_contents(frames), {"t_win/new2/b.txt": b"b+"})
        # Written into a directory the cell made and the next one's input goes to.
        frames = self.run_ok("open('t_win/new2/c.txt', 'w').write('c')",
                             files=[{"path": "t_win/new2/d.txt", "content_b64": b64(b"d")}])
        self.assertEqual(file_contents(frames), {"t_win/new2/c.txt": b"c"})


class TestWorkspaceWatch(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="t_watch_unit")
        self.addCleanup(shutil.rmtree, self.root, True)

    def test_an_update_brings_the_snapshot_to_what_a_walk_finds_after_random_changes(self):
        rng = random.Random(7)
        watch = WorkspaceWatch(self.root)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        self.assertTrue(watch.active)
        for round_ in range(200):
            before = dict(entries)
            dirs = [d for d, _, _ in os.walk(self.root)]
            for i in range(rng.randrange(1, 5)):
                d = rng.choice(dirs)
                pick = rng.randrange(4)
                if pick == 0:
                    os.makedirs(os.path.join(d, "d%d_%d" % (round_, i), "e"), exist_ok=True)
                elif pick == 1 and d != self.root:
                    shutil.rmtree(d)
                    dirs = [x for x in dirs if not (x == d or x.startswith(d + "/"))]
                elif pick == 2 and d != self.root:
                    os.rename(d, os.path.join(self.root, "m%d_%d" % (round_, i)))
                    dirs = [d for d, _, _ in os.walk(self.root)]
                else:
                    with open(os.path.join(d, "f%d" % rng.randrange(5)), "a") as f:
                        f.write("x")
            was, now = watch.update(entries)
            truth = snapshot(self.root)
            self.assertEqual(entries, truth, "round %d" % round_)
            changed = {p for p, key in truth.items() if before.get(p) != key}
            self.assertEqual({p for p, key in now.items() if was.get(p) != key}, changed, "round %d" % round_)
            self.assertTrue(watch.active)

    def assert_update_is_a_walk(self, watch, entries):
        """update() leaves `entries` as a walk finds the tree and returns what changed since
        `entries` was taken; or None, `entries` untouched. Returns the entries to go on with."""
        before = dict(entries)
        result = watch.update(entries)
        truth = snapshot(self.root)
        if result is None:
            self.assertEqual(entries, before)
            return watch.snapshot()
        was, now = result
        self.assertEqual(entries, truth)
        self.assertEqual({p for p, key in now.items() if was.get(p) != key},
                         {p for p, key in truth.items() if before.get(p) != key})
        return entries

    def test_a_directory_replaced_by_a_symlink_is_never_walked_through(self):
        outside = tempfile.mkdtemp(prefix="t_watch_outside")
        self.addCleanup(shutil.rmtree, outside, True)
        os.makedirs(os.path.join(outside, "sub"))
        open(os.path.join(outside, "sub", "secret"), "w").close()
        watch = WorkspaceWatch(self.root)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        d = os.path.join(self.root, "d")
        os.mkdir(d)
        os.rmdir(d)
        os.symlink(outside, d)
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertEqual(set(entries), {"d"})
        # Written where the symlink points only (gVisor would watch there, despite IN_DONT_FOLLOW).
        open(os.path.join(outside, "later"), "w").close()
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertEqual(set(entries), {"d"})
        # A subdirectory named through a parent that was then moved and replaced by a symlink.
        os.mkdir(os.path.join(self.root, "a"))
        entries = self.assert_update_is_a_walk(watch, entries)
        os.makedirs(os.path.join(self.root, "a", "b"))
        open(os.path.join(self.root, "a", "b", "x"), "w").close()
        os.rename(os.path.join(self.root, "a"), os.path.join(self.root, "c"))
        os.symlink("c", os.path.join(self.root, "a"))
        entries = self.assert_update_is_a_walk(watch, entries)
        open(os.path.join(self.root, "c", "b", "y"), "w").close()
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertIn("c/b/y", entries)

    def test_a_directory_moved_while_an_update_walks_is_followed_at_its_new_path(self):
        os.makedirs(os.path.join(self.root, "a"))
        open(os.path.join(self.root, "a", "f"), "w").close()
        os.makedirs(os.path.join(self.root, "b"))
        watch = WorkspaceWatch(self.root)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        watching = watch._watch

        def watch_then_move(rel_dir):  # what a thread of the kernel may do meanwhile
            watching(rel_dir)
            if rel_dir == "b" and os.path.isdir(os.path.join(self.root, "a")):
                os.rename(os.path.join(self.root, "a"), os.path.join(self.root, "b", "a2"))

        watch._watch = watch_then_move
        os.utime(os.path.join(self.root, "b"))  # the update walks b
        watch.update(entries)
        watch._watch = watching
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertEqual(set(entries), {"b/a2/f"})
        open(os.path.join(self.root, "b", "a2", "g"), "w").close()
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertEqual(set(entries), {"b/a2/f", "b/a2/g"})

    def test_a_directory_made_unlistable_is_not_vouched_for(self):
        watch = WorkspaceWatch(self.root)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        d = os.path.join(self.root, "d")
        os.mkdir(d)
        entries = self.assert_update_is_a_walk(watch, entries)
        os.chmod(d, 0o311)
        self.addCleanup(os.chmod, d, 0o755)
        if os.access(d, os.R_OK):
            self.skipTest("the tests' user reads any directory")
        entries = self.assert_update_is_a_walk(watch, entries)
        open(os.path.join(d, "new"), "w").close()
        entries = self.assert_update_is_a_walk(watch, entries)
        self.assertNotIn("d/new", entries)

    def test_a_queue_that_overflowed_is_walked_and_watched_anew(self):
        try:
            with open("/proc/sys/fs/inotify/max_queued_events") as f:
                queued = int(f.read())
        except FileNotFoundError:
            self.skipTest("no inotify queue limit to reach here (gVisor)")
        if queued > 100000:
            self.skipTest("an inotify queue of %d events" % queued)
        watch = WorkspaceWatch(self.root)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        for i in range(queued + 10):
            open(os.path.join(self.root, "f%d" % i), "w").close()
        self.assertIsNone(watch.update(entries))
        self.assertEqual(entries, {}, "untouched when the watch cannot vouch for it")
        self.assertFalse(watch.active)
        entries = watch.snapshot()
        self.assertEqual(len(entries), queued + 10)
        with open(os.path.join(self.root, "f0"), "w") as f:
            f.write("x")
        was, now = watch.update(entries)
        self.assertEqual(list(now), ["f0"])

    def test_past_its_pending_paths_the_watch_closes_and_an_update_walks(self):
        watch = WorkspaceWatch(self.root, max_pending=100)
        self.addCleanup(watch.close)
        entries = watch.snapshot()
        for _ in range(300):  # one name, written again and again: one pending path
            with open(os.path.join(self.root, "same"), "w") as f:
                f.write("x")
        watch.absorb()
        self.assertTrue(watch.active)
        for i in range(300):
            open(os.path.join(self.root, "f%d" % i), "w").close()
            os.unlink(os.path.join(self.root, "f%d" % i))
        watch.absorb()
        self.assertFalse(watch.active, "its queue went with it")
        self.assertIsNone(watch.update(entries))
        self.assertEqual(entries, {}, "untouched")
        self.assertEqual(set(watch.snapshot()), {"same"})

    def test_more_directories_than_the_watch_follows_are_walked_every_time(self):
        for i in range(4):
            os.makedirs(os.path.join(self.root, "d%d" % i))
        watch = WorkspaceWatch(self.root, max_dirs=3)
        entries = watch.snapshot()
        self.assertFalse(watch.active)
        self.assertIsNone(watch.update(entries))
        entries = watch.snapshot()
        self.assertFalse(watch.active, "it does not try again")
        open(os.path.join(self.root, "d3", "f"), "w").close()
        self.assertEqual(watch.snapshot(), {"d3/f": snapshot(self.root)["d3/f"]})


if __name__ == "__main__":
    unittest.main()
