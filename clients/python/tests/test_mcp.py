"""sandcell-mcp driven by the MCP SDK's own client over stdio, against the real stack."""

from __future__ import annotations

import asyncio
import base64
import sys
from typing import Any, Dict

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.types import CallToolResult, ImageContent, TextContent

from sandcell import Settings


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def test_an_mcp_client_keeps_state_between_calls_gets_images_and_errors_as_is_error(tenant: Settings) -> None:
    env = {"SANDCELL_AMQP_URL": tenant.amqp_url, "SANDCELL_DATABASE_URL": tenant.database_url, "SANDCELL_TENANT": tenant.tenant}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sandcell.mcp_server", "--keep-alive", "120"], env=env)

    async def session() -> Dict[str, Any]:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                listed = {t.name: t for t in (await s.list_tools()).tools}
                assert {"run_code", "close_session", "upload_file", "list_files", "read_file"} <= set(listed)
                schema = listed["run_code"].output_schema or {}
                assert {"session_id", "status", "stdout", "value", "error"} <= set(schema.get("properties", {}))

                first = await s.call_tool("run_code", {"code": "rate = 0.05\nprint('set')"})
                assert not first.is_error, text_of(first)
                sid = (first.structured_content or {})["session_id"]
                assert (first.structured_content or {})["stdout"] == "set\n"

                # State kept between calls that name the session.
                second = await s.call_tool("run_code", {"code": "round(100 * (1 + rate) ** 10, 2)", "session_id": sid})
                assert (second.structured_content or {})["value"] == "162.89", text_of(second)

                # A chart as image content.
                chart = await s.call_tool("run_code", {"code": "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])", "session_id": sid})
                images = [c for c in chart.content if isinstance(c, ImageContent)]
                assert len(images) == 1 and images[0].mime_type == "image/png"
                assert base64.b64decode(images[0].data).startswith(b"\x89PNG")

                # A failure is an isError result with the traceback, and the session goes on.
                failed = await s.call_tool("run_code", {"code": "1 / 0", "session_id": sid})
                assert failed.is_error
                assert "ZeroDivisionError" in text_of(failed) and "1 / 0" in text_of(failed)
                assert ((failed.structured_content or {}).get("error") or {}).get("name") == "ZeroDivisionError"

                # Files: upload, list, read back.
                up = await s.call_tool("upload_file", {"session_id": sid, "path": "data/prices.csv", "text": "item,price\nwidget,10\n"})
                assert not up.is_error, text_of(up)
                listing = await s.call_tool("list_files", {"session_id": sid})
                assert "data/prices.csv" in text_of(listing)
                read = await s.call_tool("read_file", {"session_id": sid, "path": "data/prices.csv"})
                assert text_of(read) == "item,price\nwidget,10\n"

                closed = await s.call_tool("close_session", {"session_id": sid})
                assert not closed.is_error
                after = await s.call_tool("run_code", {"code": "rate", "session_id": sid})
                assert after.is_error and "session_closed" in text_of(after)
                return {"ok": True}

    assert asyncio.run(session()) == {"ok": True}


def test_the_server_also_speaks_streamable_http(tenant: Settings) -> None:
    import os
    import socket
    import subprocess
    import time

    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, SANDCELL_AMQP_URL=tenant.amqp_url, SANDCELL_DATABASE_URL=tenant.database_url, SANDCELL_TENANT=tenant.tenant)
    proc = subprocess.Popen([sys.executable, "-m", "sandcell.mcp_server", "--http", "--port", str(port), "--keep-alive", "20"], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "sandcell-mcp --http did not listen"
                time.sleep(0.1)

        async def call() -> CallToolResult:
            async with streamable_http_client("http://127.0.0.1:%d/mcp" % port) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    return await s.call_tool("run_code", {"code": "6 * 7"})

        result = asyncio.run(call())
        assert not result.is_error, text_of(result)
        assert (result.structured_content or {})["value"] == "42"
    finally:
        proc.terminate()
        proc.wait(10)
