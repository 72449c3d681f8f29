"""A cell's own environment variables, and a session's contexts (namespaces)."""

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)


class TestEnv(DriverTestCase):
    def test_python_sees_the_cells_env_and_it_is_gone_after(self):
        frames = self.run_ok("import os\nos.environ.get('GREETING'), os.environ.get('HOME')",
                             env={"GREETING": "hey", "HOME": "/elsewhere"})
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "('hey', '/elsewhere')")
        frames = self.run_ok("import os\nos.environ.get('GREETING'), os.environ.get('HOME')")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "(None, '/home/user')")

    def test_bash_sees_the_cells_env(self):
        frames = self.run_ok("echo \"$GREETING\"", "bash", env={"GREETING": "hi there"})
        self.assertEqual(stream_text(frames, "stdout"), "hi there\n")

    def test_a_bad_env_is_a_protocol_error(self):
        for env in ({"A-B": "x"}, {"A": 1}, {"A": "x\0y"}, ["A"]):
            req_id = self.driver.start("1", "python", env=env)
            frames = self.driver.collect(req_id)
            self.assertEqual([f["type"] for f in frames], ["protocol_error"], (env, frames))
        self.assertAlive()


class TestContexts(DriverTestCase):
    def test_contexts_do_not_share_variables(self):
        self.run_ok("z = 5")
        frames = self.driver.execute("z", context="other")
        self.assertEqual(of_type(frames, "error")[0]["ename"], "NameError")
        self.run_ok("w = 1", context="other")
        frames = self.run_ok("w", context="other")
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "1")
        frames = self.run_ok("z")  # the default context kept its own
        self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "5")
        frames = self.driver.execute("w", context="default")
        self.assertEqual(of_type(frames, "error")[0]["ename"], "NameError")

    def test_a_context_has_its_own_execution_count_and_the_kernels_files(self):
        self.run_ok("open('shared.txt', 'w').write('x')")
        first = done(self.run_ok("1", context="c2"))["execution_count"]
        second = done(self.run_ok("open('shared.txt').read()", context="c2"))["execution_count"]
        self.assertEqual(second, first + 1)
        self.assertEqual(first, 1)

    def test_a_bad_context_is_a_protocol_error(self):
        for fields in ({"context": "a b"}, {"context": ""}, {"context": 3}):
            req_id = self.driver.start("1", "python", **fields)
            frames = self.driver.collect(req_id)
            self.assertEqual([f["type"] for f in frames], ["protocol_error"], (fields, frames))
        req_id = self.driver.start("echo", "bash", context="c")
        self.assertEqual([f["type"] for f in self.driver.collect(req_id)], ["protocol_error"])
        self.assertAlive()

    def test_ipythons_own_names_stay_hidden_in_each_context_after_switches(self):
        self.run_ok("a = 1")
        self.run_ok("b = 2", context="c3")
        for context in (None, "c3"):
            fields = {"context": context} if context else {}
            frames = self.run_ok("sorted(n for n in ('In', 'Out', 'exit') if n not in get_ipython().user_ns_hidden)", **fields)
            self.assertEqual(of_type(frames, "execute_result")[0]["data"]["text/plain"], "[]", context)
