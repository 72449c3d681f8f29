"""The SDK against the real stack: what an agent developer does in the first five minutes."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import List, Optional, Tuple

import pytest

from sandcell import AsyncClient, AsyncSandbox, Client, ExecutionError, JobRejected, Result, Sandbox, Settings


def test_a_calculation_returns_its_value(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import math\nmath.sqrt(15129)")
    assert execution.status == "succeeded"
    assert execution.text == "123.0"
    assert execution.error is None


def test_an_uploaded_csv_summed_by_category_gives_exact_sums(sandbox: Sandbox) -> None:
    csv = "date,category,amount\n2026-01-02,rent,1450.00\n2026-01-03,groceries,82.10\n2026-01-09,groceries,55.10\n2026-01-11,dining,62.50\n"
    sandbox.files.write("tx.csv", csv)
    code = "import pandas as pd, json\nsums = pd.read_csv('tx.csv').groupby('category')['amount'].sum().round(2)\nprint(json.dumps(sums.to_dict()))"
    execution = sandbox.run_code(code)
    assert execution.status == "succeeded", execution.record
    assert json.loads("".join(execution.logs.stdout)) == {"dining": 62.5, "groceries": 137.2, "rent": 1450.0}


def test_a_bar_chart_drawn_without_savefig_comes_back_as_png(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import matplotlib.pyplot as plt\nplt.bar(['2025', '2026', '2027'], [100, 120, 144])\nplt.title('growth')")
    charts = [r for r in execution.results if r.png]
    assert len(charts) == 1, execution.results
    assert base64.b64decode(charts[0].png or "").startswith(b"\x89PNG\r\n\x1a\n")
    assert "png" in charts[0].formats()


def test_a_quote_pdf_written_with_reportlab_reads_back_as_pdf(sandbox: Sandbox) -> None:
    code = (
        "from reportlab.pdfgen import canvas\n"
        "c = canvas.Canvas('quote.pdf')\nc.drawString(72, 720, 'Quote #42: 3 x widget = 30.00 EUR')\nc.save()"
    )
    assert sandbox.run_code(code).status == "succeeded"
    assert sandbox.files.read("quote.pdf").startswith(b"%PDF")
    assert "quote.pdf" in [e.path for e in sandbox.files.list()]


def test_variables_persist_across_cells_and_an_error_is_fixed_in_the_next(sandbox: Sandbox) -> None:
    sandbox.run_code("rate = 0.2")
    failed = sandbox.run_code("1 / 0")
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "1 / 0" in failed.error.traceback
    fixed = sandbox.run_code("100 * (1 + rate)")
    assert fixed.text == "120.0"


def test_a_cell_past_its_timeout_is_interrupted_and_the_session_keeps_its_state(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'still here'")
    slow = sandbox.run_code("import time\ntime.sleep(30)", timeout=1)
    assert slow.timed_out
    assert sandbox.run_code("kept").text == "'still here'"


def test_output_printed_before_a_pause_reaches_on_stdout_long_before_the_cell_ends(sandbox: Sandbox) -> None:
    chunks: List[Tuple[float, str]] = []
    code = "import time\nprint('a', flush=True)\ntime.sleep(5)\nprint('b')"
    execution = sandbox.run_code(code, on_stdout=lambda text: chunks.append((time.monotonic(), text)))
    returned = time.monotonic()
    assert "".join(t for _, t in chunks) == "a\nb\n", chunks  # in order, each once
    assert chunks[0][1] == "a\n"
    assert returned - chunks[0][0] >= 3, "'a' arrived only %.2f s before the cell ended" % (returned - chunks[0][0])
    assert "".join(execution.logs.stdout) == "a\nb\n"


def test_results_and_errors_reach_their_callbacks(sandbox: Sandbox) -> None:
    results: List[Result] = []
    errors: List[ExecutionError] = []
    stderr: List[str] = []
    code = "import sys\nfrom IPython.display import display\nprint('careful', file=sys.stderr)\ndisplay(6 * 7)\nint('x')"
    sandbox.run_code(code, on_result=results.append, on_error=errors.append, on_stderr=stderr.append)
    assert [r.text for r in results] == ["42"]
    assert [e.name for e in errors] == ["ValueError"]
    assert "".join(stderr) == "careful\n"


def test_shell_commands_run_in_the_same_workspace(sandbox: Sandbox) -> None:
    sandbox.files.write("notes/a.txt", "hello")
    result = sandbox.commands.run("wc -c < notes/a.txt && ls notes")
    assert (result.exit_code, result.stdout) == (0, "5\na.txt\n")
    assert sandbox.commands.run("exit 3").exit_code == 3


def test_a_hundred_jobs_submitted_at_once_are_gathered_on_one_listener(client: Client) -> None:
    ids = [client.submit(client.job("print(%d * %d)" % (i, i))) for i in range(100)]
    records = client.wait_all(ids, timeout=300)
    assert [r["status"] for r in records] == ["succeeded"] * 100
    assert [r["stdout"] for r in records] == ["%d\n" % (i * i) for i in range(100)]


def test_a_job_in_a_session_that_does_not_exist_raises_job_rejected(client: Client) -> None:
    ghost = Sandbox.connect("ses_" + "0" * 32, client=client)
    with pytest.raises(JobRejected) as caught:
        ghost.run_code("1")
    assert caught.value.code == "session_not_found"


def test_the_asyncio_api_runs_cells_with_async_callbacks(tenant: Settings) -> None:
    async def main() -> Tuple[str, List[str]]:
        seen: List[str] = []

        async def on_stdout(text: str) -> None:
            seen.append(text)

        async with await AsyncSandbox.create(keep_alive=60, settings=tenant) as sb:
            await sb.run_code("total = sum(range(10))")
            execution = await sb.run_code("print('total', total)\ntotal * 2", on_stdout=on_stdout)
            return execution.text or "", seen

    text, seen = asyncio.run(main())
    assert text == "90"
    assert seen == ["total 45\n"]


def test_a_closed_sandbox_refuses_further_cells(client: Client) -> None:
    sb = Sandbox.create(keep_alive=60, client=client)
    sb.run_code("x = 1")
    sb.close()
    with pytest.raises(JobRejected) as caught:
        sb.run_code("x")
    assert caught.value.code == "session_closed"
    assert sb.info()["state"] == "closed"


def test_a_50_mb_file_written_without_store_credentials_lands_in_the_workspace(sandbox: Sandbox) -> None:
    import hashlib
    import os

    data = os.urandom(50 << 20)
    sandbox.files.write("big/data.bin", data)  # over 8 MiB: a presigned upload, not inline
    execution = sandbox.run_code("import hashlib\nhashlib.sha256(open('big/data.bin', 'rb').read()).hexdigest()")
    assert execution.text == "'%s'" % hashlib.sha256(data).hexdigest(), execution.record


def test_an_upload_outside_the_workspace_rules_is_refused(client: Client) -> None:
    from sandcell import AsyncClient, SandcellError

    async def ask() -> None:
        c = await AsyncClient.connect(client.settings)
        try:
            await c.upload({"../outside": b"x"})
        finally:
            await c.close()

    with pytest.raises(SandcellError) as caught:
        asyncio.run(ask())
    assert "invalid_file_path" in str(caught.value)


def test_set_timeout_gives_the_session_a_new_keep_alive(sandbox: Sandbox) -> None:
    sandbox.set_timeout(45)
    assert sandbox.info()["keep_alive_s"] == 45
    assert sandbox.run_code("1 + 1").text == "2"


def test_a_result_its_notification_carries_is_returned_without_reading_the_row(tenant: Settings) -> None:
    """A job's final notification carries its record when it fits (``docs/protocol.md`` §2):
    the waiter returns it, and reads the row only for a record too large for a notification."""

    async def main() -> List[Tuple[dict, List[str]]]:
        client = await AsyncClient.connect(tenant)
        try:
            outcomes = []
            # For the small record, reads of the row never show it finished (one may come between
            # the commit and its notification, as it may for any client): the record the wait
            # returns can only be the one the notification carried. The large one needs reads.
            for code, rows_hide_the_end in (("import time; time.sleep(1); print('small')", True),
                                            ("import time; time.sleep(1); print('y' * 20000)", False)):
                reads: List[str] = []
                read_row = client.result

                async def counted(job_id: str) -> Optional[dict]:
                    record = await read_row(job_id)
                    reads.append(record["status"] if record else "not recorded")
                    if record and rows_hide_the_end and record["status"] not in ("queued", "running"):
                        return dict(record, status="running")
                    return record

                client.result = counted  # type: ignore[method-assign]
                record = await client.wait(await client.submit(client.job(code)), timeout=120)
                client.result = read_row  # type: ignore[method-assign]
                outcomes.append((record, reads))
            return outcomes
        finally:
            await client.close()

    (small, small_reads), (large, large_reads) = asyncio.run(main())
    assert (small["status"], small["stdout"]) == ("succeeded", "small\n"), (small, small_reads)
    assert small_reads, "the waiter read the row while the job ran"
    assert (large["status"], len(large["stdout"])) == ("succeeded", 20001)
    assert large_reads[-1] == "succeeded", large_reads


def test_a_cancelled_cell_ends_the_wait_as_cancelled_and_the_session_keeps_its_state(client: Client) -> None:
    with Sandbox.create(keep_alive=60, client=client) as sb:
        sb.run_code("kept = 7")
        job_id = client.submit(client.job("import time\nfor i in range(600):\n    time.sleep(0.05)", session={"id": sb.session_id}))
        time.sleep(1.0)  # it is running by now (or about to start: the cancel then stops it as it starts)
        client.cancel(job_id, sb.session_id)
        record = client.wait(job_id, timeout=20)
        assert record["status"] == "cancelled", record
        assert sb.run_code("kept").text == "7"
