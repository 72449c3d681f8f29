"""E2B's unmodified `e2b-code-interpreter` SDK works against sandcell's gateway, configured by
environment variables alone (conftest.py sets them; nothing here passes api_key=, domain= or
an address).

Each test names the behaviour it proves and asserts exact values, so a gateway that answers
loosely fails.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import threading
import time
from typing import Dict, List, Set

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    RateLimitException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b_code_interpreter import Context, Execution, ExecutionError, OutputMessage, Result, Sandbox

from conftest import GATEWAY_URL, SANDBOX_TIMEOUT, new_api_key, sandbox_ids

# The code interpreter's port: what the SDK sends as E2b-Sandbox-Port for /execute.
JUPYTER_PORT = "49999"


def main_results(execution: Execution) -> List[Result]:
    return [r for r in execution.results if r.is_main_result]


# --- lifecycle -------------------------------------------------------------------------------


def test_create_then_kill_and_a_killed_sandbox_is_gone() -> None:
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    killed = False
    try:
        assert isinstance(sbx.sandbox_id, str) and sbx.sandbox_id
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.sandbox_id == sbx.sandbox_id
        assert info.state == SandboxState.RUNNING
        assert info.end_at > info.started_at
        assert sbx.is_running() is True
        assert sbx.run_code("1 + 1").text == "2"

        assert sbx.kill() is True
        killed = True
    finally:
        if not killed:
            Sandbox.kill(sbx.sandbox_id)

    # The sandbox's own port answers 502 for a sandbox that is not running, as E2B's does;
    # the SDK reports that as a TimeoutException about the sandbox's timeout (not a hang:
    # a client-side deadline would say "Execution timed out").
    with pytest.raises(TimeoutException) as gone:
        sbx.run_code("1", timeout=30)
    assert "sandbox timeout" in str(gone.value)
    assert sbx.is_running() is False
    # envd's port (files, commands) too: a 502 whose message says the sandbox "was not
    # found", as E2B's proxy words it, is the SDK's SandboxNotRunningException.
    with pytest.raises(SandboxNotRunningException):
        sbx.files.read("/home/user/anything.txt")
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("true")
    # Killing again finds nothing (404).
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


# --- the code interpreter --------------------------------------------------------------------


def test_last_expression_is_the_main_result(shared_sandbox: Sandbox) -> None:
    execution = shared_sandbox.run_code("x = 1; x")
    assert execution.error is None
    assert execution.text == "1"
    main = main_results(execution)
    assert len(main) == 1
    assert main[0].text == "1"
    assert execution.logs.stdout == []
    assert execution.logs.stderr == []


def test_state_is_kept_across_runs(shared_sandbox: Sandbox) -> None:
    first = shared_sandbox.run_code("y = 41")
    assert first.error is None
    assert first.results == []
    second = shared_sandbox.run_code("y + 1")
    assert second.text == "42"
    # The kernel's own count, as a notebook's In [n].
    assert isinstance(first.execution_count, int) and first.execution_count >= 1
    assert second.execution_count == first.execution_count + 1


def test_stdout_and_stderr_reach_the_callbacks_and_the_logs(shared_sandbox: Sandbox) -> None:
    stdout: List[OutputMessage] = []
    stderr: List[OutputMessage] = []
    execution = shared_sandbox.run_code(
        'print("a"); print("b"); import sys; print("c", file=sys.stderr)',
        on_stdout=stdout.append,
        on_stderr=stderr.append,
    )
    assert execution.error is None
    # A message's `line` is the text as printed, newline included; it may come in any chunks.
    assert "".join(m.line for m in stdout) == "a\nb\n"
    assert "".join(m.line for m in stderr) == "c\n"
    assert all(m.error is False for m in stdout)
    assert all(m.error is True for m in stderr)
    assert "".join(execution.logs.stdout) == "a\nb\n"
    assert "".join(execution.logs.stderr) == "c\n"
    # print() returns None: nothing to show.
    assert execution.text is None
    assert execution.results == []


def test_a_matplotlib_figure_is_a_png_result(shared_sandbox: Sandbox) -> None:
    execution = shared_sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    )
    assert execution.error is None
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1, execution.results
    data = base64.b64decode(pngs[0])
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert data.endswith(b"IEND\xaeB`\x82")  # the whole image, not a truncated one


def test_a_dataframe_is_an_html_table(shared_sandbox: Sandbox) -> None:
    execution = shared_sandbox.run_code(
        'import pandas as pd\npd.DataFrame({"a": [1, 2], "b": [3, 4]})'
    )
    assert execution.error is None
    main = main_results(execution)
    assert len(main) == 1
    assert main[0].html is not None
    assert "<table" in main[0].html and "</table>" in main[0].html
    assert main[0].text == "   a  b\n0  1  3\n1  2  4"


def test_an_exception_is_an_execution_error(shared_sandbox: Sandbox) -> None:
    errors: List[ExecutionError] = []
    execution = shared_sandbox.run_code("1/0", on_error=errors.append)
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert "division by zero" in execution.error.value
    assert isinstance(execution.error.traceback, str)
    assert "ZeroDivisionError" in execution.error.traceback
    assert errors == [execution.error]
    assert execution.results == []
    assert execution.text is None


def test_two_contexts_do_not_share_variables(shared_sandbox: Sandbox) -> None:
    ctx = shared_sandbox.create_code_context()
    assert isinstance(ctx, Context)
    assert ctx.id
    assert ctx.language == "python"
    assert ctx.cwd == "/home/user"

    assert shared_sandbox.run_code("z = 5").error is None
    assert shared_sandbox.run_code("z").text == "5"
    missing = shared_sandbox.run_code("z", context=ctx)
    assert missing.error is not None
    assert missing.error.name == "NameError"
    assert missing.error.value == "name 'z' is not defined"

    assert shared_sandbox.run_code("w = 1", context=ctx).error is None
    assert shared_sandbox.run_code("w", context=ctx).text == "1"
    other_way = shared_sandbox.run_code("w")
    assert other_way.error is not None
    assert other_way.error.name == "NameError"


def test_a_context_is_listed_until_removed(shared_sandbox: Sandbox) -> None:
    ctx = shared_sandbox.create_code_context()
    assert ctx.id in {c.id for c in shared_sandbox.list_code_contexts()}
    shared_sandbox.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in shared_sandbox.list_code_contexts()}


def test_a_run_cut_off_by_the_client_does_not_hold_up_the_next(fresh_sandbox: Sandbox) -> None:
    assert fresh_sandbox.run_code("kept = 7").error is None
    started = time.monotonic()
    with pytest.raises(TimeoutException) as cut:
        fresh_sandbox.run_code("import time; time.sleep(30)", timeout=2)
    waited = time.monotonic() - started
    # The SDK's deadline for timeout=2 is read + write = 4 s (pyqwest sums them); it then
    # drops the connection, the server's only signal to stop the run.
    assert "Execution timed out" in str(cut.value)
    assert 1.5 <= waited < 10, waited

    started = time.monotonic()
    execution = fresh_sandbox.run_code("1+1")
    took = time.monotonic() - started
    assert execution.error is None
    assert execution.text == "2"
    # Had the gateway let the sleep run on, this would wait ~25 s more for it.
    assert took < 15, took
    # E2B interrupts the kernel when the client goes away; it does not restart it.
    assert fresh_sandbox.run_code("kept").text == "7"


def test_per_run_env_vars_are_seen_by_that_run_only(shared_sandbox: Sandbox) -> None:
    execution = shared_sandbox.run_code(
        "import os; os.environ.get('GREETING')", envs={"GREETING": "hey"}
    )
    assert execution.error is None
    assert execution.text == "'hey'"
    after = shared_sandbox.run_code("import os; str(os.environ.get('GREETING'))")
    assert after.text == "'None'"


# --- files and commands (envd) ---------------------------------------------------------------


def test_files_written_are_read_back_listed_and_seen_by_code(shared_sandbox: Sandbox) -> None:
    files = shared_sandbox.files

    written = files.write("/home/user/data.txt", "hello\n")
    assert written.name == "data.txt"
    assert written.path == "/home/user/data.txt"
    assert written.type == FileType.FILE
    assert files.read("/home/user/data.txt") == "hello\n"

    blob = bytes(range(256)) * 4
    files.write("/home/user/blob.bin", blob)
    assert files.read("/home/user/blob.bin", format="bytes") == bytearray(blob)

    entries = {e.name: e for e in files.list("/home/user")}
    assert "data.txt" in entries and "blob.bin" in entries
    assert entries["data.txt"].type == FileType.FILE
    assert entries["data.txt"].path == "/home/user/data.txt"
    assert entries["data.txt"].size == 6
    assert entries["blob.bin"].size == len(blob)

    # Code runs in /home/user and sees the file; the SDK sees what code writes.
    assert shared_sandbox.run_code("open('data.txt').read()").text == "'hello\\n'"
    wrote = shared_sandbox.run_code("open('/home/user/out.txt', 'w').write('from code')")
    assert wrote.error is None
    assert files.read("/home/user/out.txt") == "from code"

    with pytest.raises(FileNotFoundException):
        files.read("/home/user/no-such-file.txt")


def test_commands_run_reports_output_and_exit_code(shared_sandbox: Sandbox) -> None:
    result = shared_sandbox.commands.run("echo hi")
    assert result.stdout == "hi\n"
    assert result.stderr == ""
    assert result.exit_code == 0

    with pytest.raises(CommandExitException) as failed:
        shared_sandbox.commands.run("echo oops >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stderr == "oops\n"
    assert failed.value.stdout == ""


# --- keys and tenants ------------------------------------------------------------------------


def test_another_key_sees_none_of_this_keys_sandboxes(
    fresh_sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = fresh_sandbox.sandbox_id
    # With its own key, the sandbox is listed and can be connected to.
    assert mine in sandbox_ids()
    assert Sandbox.connect(mine).run_code("1 + 1").text == "2"

    monkeypatch.setenv("E2B_API_KEY", new_api_key())
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(mine)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(mine)
    assert Sandbox.kill(mine) is False
    assert mine not in sandbox_ids()

    # And it was not killed: its owner still runs code in it.
    assert fresh_sandbox.run_code("2 + 2").text == "4"


def test_sandbox_traffic_without_its_access_token_is_refused(shared_sandbox: Sandbox) -> None:
    # Knowing a sandbox's id is not enough: its ports want the token create/connect returned.
    headers = {"E2b-Sandbox-Id": shared_sandbox.sandbox_id, "E2b-Sandbox-Port": JUPYTER_PORT}
    body = {"code": "1", "context_id": None, "language": None, "env_vars": None}
    with httpx.Client(timeout=30) as http:
        bare = http.post(f"{GATEWAY_URL}/execute", json=body, headers=headers)
        forged = http.post(
            f"{GATEWAY_URL}/execute", json=body, headers={**headers, "X-Access-Token": "0" * 64}
        )
    assert bare.status_code == 401, bare.text
    assert forged.status_code == 401, forged.text


def test_a_request_refused_before_its_body_is_read_closes_its_connection_and_says_so(shared_sandbox: Sandbox) -> None:
    # Refused on its headers, its body not yet sent: the gateway answers without reading the
    # body and must not keep the connection for a next request (a client that reused it saw
    # it close without an answer). Raw HTTP, so the body's arrival is the test's to decide.
    host, port = GATEWAY_URL.split("//", 1)[1].rsplit(":", 1)
    head = (
        "POST /execute HTTP/1.1\r\nHost: %s\r\nE2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: %s\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" % (host, shared_sandbox.sandbox_id, JUPYTER_PORT)
    )
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            assert chunk, "the gateway closed the connection without an answer: %r" % answer
            answer += chunk
    status_line, *header_lines = answer.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    headers = {k.strip().lower(): v.strip().lower() for k, v in (line.split(":", 1) for line in header_lines)}
    assert status_line.split()[1] == "401", answer
    assert headers.get("connection") == "close", answer


def test_a_bad_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "sk_nonsense")
    try:
        sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    except AuthenticationException:
        pass
    else:
        sbx.kill()
        pytest.fail("a sandbox was created with a key no one issued")
    with pytest.raises(AuthenticationException):
        Sandbox.list().next_items()


def test_kill_does_not_wait_for_a_running_cell() -> None:
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    ended: List[Execution] = []
    running = threading.Event()
    code = "import time\nprint('running', flush=True)\ntime.sleep(60)"
    runner = threading.Thread(target=lambda: ended.append(sbx.run_code(code, on_stdout=lambda _: running.set())))
    runner.start()
    assert running.wait(60), "the cell never started"
    started = time.monotonic()
    assert sbx.kill() is True
    took = time.monotonic() - started
    assert took < 15, took
    runner.join(30)
    assert not runner.is_alive(), "the interrupted run's stream never ended"
    assert ended and ended[0].error is not None and ended[0].error.name == "KeyboardInterrupt"
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_a_key_over_its_stored_results_quota_is_refused_new_work_but_can_still_kill_its_sandbox(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a tenant past max_result_bytes had every job refused, the kill's close among
    # them: the SDK got False (404) and the sandbox kept running, holding its container and
    # its place in max_sessions until its timeout. A kill is a bare close, which the quota
    # lets through (docs/protocol.md, "Quotas").
    monkeypatch.setenv("E2B_API_KEY", new_api_key("--max-result-bytes", "600000"))
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    killed = False
    try:
        # ~700 KB of output, kept as the run's result: past the tenant's 600 KB.
        big = sbx.run_code("import base64, os\nprint(base64.b64encode(os.urandom(525_000)).decode())")
        assert big.error is None, big.error
        assert sum(len(line) for line in big.logs.stdout) > 600_000

        # A run is answered as a stream before its job is recorded: the refusal is its error.
        refused = sbx.run_code("1 + 1")
        assert refused.text is None
        assert refused.error is not None and refused.error.name == "SandboxError", refused.error
        assert refused.error.value.startswith("rejected: "), refused.error.value
        assert "a job that only closes a session is still accepted" in refused.error.value
        with pytest.raises(RateLimitException):
            Sandbox.create(timeout=SANDBOX_TIMEOUT)
        assert sbx.sandbox_id in sandbox_ids()

        assert sbx.kill() is True
        killed = True
    finally:
        if not killed:
            Sandbox.kill(sbx.sandbox_id)
    assert sbx.sandbox_id not in sandbox_ids()
    assert sbx.is_running() is False
    # Killing again finds nothing (404), as for any killed sandbox.
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_what_a_key_stores_with_its_sandboxes_counts_against_its_stored_results_quota(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a sandbox's metadata and envVars (up to 80 KB) were kept for 30 days after it
    # ended, and no quota saw them: creating and killing sandboxes in a loop grew the database
    # every tenant shares by that much each time. Now they count in max_result_bytes, and a
    # create past it is refused (429) like any job.
    monkeypatch.setenv("E2B_API_KEY", new_api_key("--max-result-bytes", "400000"))
    created = 0
    with pytest.raises(RateLimitException) as refused:
        for _ in range(12):
            # 60,000 characters of base64: as many bytes stored (Postgres cannot compress them).
            env = {"PAYLOAD": base64.b64encode(os.urandom(45_000)).decode()}
            sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT, envs=env)
            created += 1
            assert sbx.kill() is True
    print("%d sandboxes of 60 KB of envVars created and killed before the refusal" % created)
    assert 5 <= created <= 8, created
    assert "quota" in str(refused.value), refused.value


def _gateway_rss_mb() -> float:
    """The resident memory of the gateway this suite drives (the one deploy/local/test.sh starts)."""
    pids = subprocess.run(["pgrep", "-f", "target/.*/sandcell-gateway"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, "expected one gateway process, found %r" % pids
    with open("/proc/%s/status" % pids[0]) as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _gateway_metric(name: str) -> float:
    text = httpx.get(f"{GATEWAY_URL}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_client_that_stops_reading_its_runs_cannot_grow_the_gateway_past_its_tenants_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a streamed answer's lines were queued without bound for a client that did not
    # read them: each run below (~12 MB of lines: 2 MiB of output, JSON-escaped) stayed in the
    # gateway for as long as its connection was open, and one tenant could so grow the process
    # every tenant goes through. Now a tenant's unread lines stay within
    # SANDCELL_GATEWAY_UNREAD_BYTES (64 MiB) and few of its answers wait for room; the others
    # are abandoned (their connections closed, their jobs cancelled).
    monkeypatch.setenv("E2B_API_KEY", new_api_key())
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    host, port = GATEWAY_URL.split("//", 1)[1].rsplit(":", 1)
    code = "import sys\nsys.stdout.write('\\x01' * (1 << 20)); sys.stderr.write('\\x01' * (1 << 20))"
    body = json.dumps({"code": code, "context_id": None, "language": None, "env_vars": None}).encode()
    head = (
        "POST /execute HTTP/1.1\r\nHost: %s\r\nE2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: %s\r\n"
        "X-Access-Token: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (host, sbx.sandbox_id, JUPYTER_PORT, sbx._envd_access_token, len(body))
    ).encode()
    stalled = 40
    rss_before = _gateway_rss_mb()
    abandoned_before = _gateway_metric("sandcell_gateway_responses_abandoned_total")
    runs_before = _gateway_metric("sandcell_gateway_runs_total")
    conns: List[socket.socket] = []
    try:
        for _ in range(stalled):
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.connect((host, int(port)))
            conn.sendall(head + body)
            conns.append(conn)  # and never read
        # Every run ends (the session runs them one after another); the answers stay unread.
        deadline = time.monotonic() + 180
        while _gateway_metric("sandcell_gateway_runs_total") < runs_before + stalled:
            assert time.monotonic() < deadline, "the stalled runs did not all end"
            time.sleep(1)
        time.sleep(2)
        grown = _gateway_rss_mb() - rss_before
        abandoned = _gateway_metric("sandcell_gateway_responses_abandoned_total") - abandoned_before
        print("%d unread answers: the gateway grew by %.0f MB, %d answers abandoned" % (stalled, grown, abandoned))
        assert abandoned >= 1, "no answer was abandoned"
        assert grown < 250, "the gateway grew by %.0f MB for %d unread answers" % (grown, stalled)

        # Another tenant is served meanwhile, its answers whole.
        monkeypatch.setenv("E2B_API_KEY", new_api_key())
        other = Sandbox.create(timeout=SANDBOX_TIMEOUT)
        try:
            seen = other.run_code("print('x' * 100_000); 6 * 7")
            assert seen.text == "42"
            assert "".join(seen.logs.stdout) == "x" * 100_000 + "\n"
        finally:
            other.kill()
    finally:
        for conn in conns:
            conn.close()
        sbx.kill()  # with the key it was created with


def test_list_filters_by_metadata() -> None:
    tag = "m" + str(time.monotonic_ns())
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT, metadata={"suite": tag, "kind": "listed"})
    try:
        def listed(metadata: Dict[str, str]) -> Set[str]:
            paginator = Sandbox.list(query=SandboxQuery(metadata=metadata))
            ids: Set[str] = set()
            while paginator.has_next:
                ids.update(s.sandbox_id for s in paginator.next_items())
            return ids

        assert listed({"suite": tag}) == {sbx.sandbox_id}
        assert listed({"suite": tag, "kind": "listed"}) == {sbx.sandbox_id}
        assert listed({"suite": tag, "kind": "other"}) == set()
        assert sbx.get_info().metadata == {"suite": tag, "kind": "listed"}
    finally:
        sbx.kill()


def test_a_call_the_gateway_does_not_offer_is_a_json_error() -> None:
    response = httpx.get(GATEWAY_URL + "/sandboxes/x/metrics", headers={"X-API-KEY": "sk_sandcell_x"})
    assert response.status_code == 501
    assert "not supported" in response.json()["message"]
