"""``sandcell-mcp``: an MCP server (on the official MCP Python SDK) that runs code in sandcell.

    sandcell-mcp                       # stdio (what desktop clients and agent frameworks spawn)
    sandcell-mcp --http --port 8765    # streamable HTTP on 127.0.0.1:8765/mcp

Session-aware tools: ``run_code`` (in a new session, or a given one — its variables and files
stay), ``close_session``, ``upload_file``, ``list_files`` and ``read_file``. Charts come back as
image content; a run that did not succeed is an ``isError`` result carrying the traceback;
``run_code``'s ``structuredContent`` mirrors the result (``outputSchema``: :class:`RunResult`).
Settings: the variables ``sandcell-admin tenant create`` prints.
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
from typing import Annotated, Any, List, Optional

from mcp.server.mcpserver import MCPServer
from mcp.types import BlobResourceContents, CallToolResult, EmbeddedResource, ImageContent, TextContent
from pydantic import BaseModel

from . import tools
from ._client import AsyncClient
from ._errors import JobRejected, SandcellError
from ._sandbox import AsyncSandbox


class RunError(BaseModel):
    """The exception the code ended with."""

    name: str
    value: str
    traceback: str


class RunResult(BaseModel):
    """What ``run_code`` returns as structured content."""

    session_id: str
    job_id: str
    status: str
    stdout: str
    stderr: str
    value: Optional[str]
    error: Optional[RunError]
    images: int
    files: List[str]


class Server:
    """The tools, over one sandcell client opened on first use."""

    def __init__(self, keep_alive: int) -> None:
        self.keep_alive = keep_alive
        self._client: Optional[AsyncClient] = None

    async def client(self) -> AsyncClient:
        if self._client is None:
            self._client = await AsyncClient.connect()
        return self._client

    async def sandbox(self, session_id: Optional[str]) -> AsyncSandbox:
        c = await self.client()
        if session_id:
            return await AsyncSandbox.connect(session_id, client=c)
        return await AsyncSandbox.create(self.keep_alive, client=c)

    async def run_code(
        self, code: str, language: str = "python", session_id: Optional[str] = None, timeout_s: Optional[float] = None
    ) -> Annotated[CallToolResult, RunResult]:
        """Run code (python or bash) in a sandcell session: a new one unless session_id names one
        from an earlier result, whose variables, imports and files it then sees. Returns what it
        printed, its last value, charts as images, and the traceback if it failed."""
        try:
            sb = await self.sandbox(session_id)
            execution = await sb.run_code(code, language, timeout=timeout_s)
        except JobRejected as exc:
            return _failure("%s: %s" % (exc.code, exc.message))
        except SandcellError as exc:
            return _failure(str(exc))
        content: List[Any] = [TextContent(type="text", text=tools.render_text(execution, sb.session_id))]
        images = 0
        for r in execution.results:
            for mime in ("image/png", "image/jpeg"):
                if r.data.get(mime):
                    content.append(ImageContent(type="image", data=r.data[mime], mime_type=mime))
                    images += 1
        e = execution.error
        result = RunResult(
            session_id=sb.session_id,
            job_id=execution.job_id,
            status=execution.status,
            stdout="".join(execution.logs.stdout),
            stderr="".join(execution.logs.stderr),
            value=execution.text,
            error=RunError(name=e.name, value=e.value, traceback=e.traceback) if e else None,
            images=images,
            files=[a.path for a in execution.artifacts if a.kind != "display"],
        )
        return CallToolResult(content=content, structured_content=result.model_dump(), is_error=execution.status != "succeeded")

    async def close_session(self, session_id: str) -> str:
        """Close a session: its sandbox and files are destroyed."""
        sb = await AsyncSandbox.connect(session_id, client=await self.client())
        await sb.close()
        return "closed %s" % session_id

    async def upload_file(self, session_id: str, path: str, text: Optional[str] = None, content_base64: Optional[str] = None) -> str:
        """Write a file (text, or base64 bytes; up to 8 MiB) into a session's workspace at path."""
        if (text is None) == (content_base64 is None):
            raise ValueError("give exactly one of text and content_base64")
        data = text.encode("utf-8") if text is not None else base64.b64decode(content_base64 or "", validate=True)
        sb = await AsyncSandbox.connect(session_id, client=await self.client())
        await sb.files.write(path, data)
        return "wrote %d bytes to %s" % (len(data), path)

    async def list_files(self, session_id: str) -> List[str]:
        """The files in a session's workspace, as 'path (size bytes)'."""
        sb = await AsyncSandbox.connect(session_id, client=await self.client())
        return ["%s (%d bytes)" % (e.path, e.size) for e in await sb.files.list()]

    async def read_file(self, session_id: str, path: str) -> CallToolResult:
        """A file from a session's workspace: text as text, images as images, anything else as a
        base64 resource."""
        sb = await AsyncSandbox.connect(session_id, client=await self.client())
        try:
            data = await sb.files.read(path)
        except (FileNotFoundError, JobRejected) as exc:
            return _failure(str(exc))
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        if mime in ("image/png", "image/jpeg", "image/gif"):
            return CallToolResult(content=[ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=mime)])
        try:
            return CallToolResult(content=[TextContent(type="text", text=data.decode("utf-8"))])
        except UnicodeDecodeError:
            blob = BlobResourceContents(uri="sandcell://%s/%s" % (session_id, path), mime_type=mime, blob=base64.b64encode(data).decode())
            return CallToolResult(content=[EmbeddedResource(type="resource", resource=blob)])


def _failure(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


def build(keep_alive: int = 600) -> MCPServer:
    """The MCP server with sandcell's tools."""
    server = Server(keep_alive)
    mcp = MCPServer("sandcell", instructions=tools.DESCRIPTION)
    for fn in (server.run_code, server.close_session, server.upload_file, server.list_files, server.read_file):
        mcp.add_tool(fn)
    return mcp


def main() -> None:
    parser = argparse.ArgumentParser(prog="sandcell-mcp", description="MCP server running code in sandcell")
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--keep-alive", type=int, default=600, help="keep-alive of the sessions run_code opens (s)")
    args = parser.parse_args()
    mcp = build(args.keep_alive)
    if args.http:
        mcp.run("streamable-http", host=args.host, port=args.port)
    else:
        mcp.run()


if __name__ == "__main__":
    main()
