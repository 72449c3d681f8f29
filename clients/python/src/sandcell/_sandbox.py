"""A sandbox: one sandcell session (a stateful kernel held by a worker), shaped like E2B's
``Sandbox`` — ``run_code``, ``files``, ``commands``, ``close``.

Every call is a job submitted through the queue and answered from Postgres; ``run_code``'s
callbacks get the job's live output as it runs (``docs/protocol.md`` §2b).
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

from ._client import AsyncClient, b64
from ._errors import JobRejected, SandcellError
from ._models import CommandResult, EntryInfo, Execution, ExecutionError, Result
from ._settings import Settings

#: Largest file ``files.write`` sends inline (the protocol's per-file limit is 8 MiB).
MAX_INLINE_FILE_BYTES = 8 << 20

Callback = Callable[[Any], Union[None, Awaitable[None]]]


def _raise_if_rejected(record: Dict[str, Any]) -> None:
    if record["status"] == "rejected":
        reason = record.get("reason") or {}
        raise JobRejected(reason.get("code", "rejected"), reason.get("message", ""), record)


async def _call(cb: Optional[Callback], value: Any) -> None:
    if cb is not None:
        outcome = cb(value)
        if inspect.isawaitable(outcome):
            await outcome


def _limits(timeout: Optional[float], memory_mb: Optional[int], cpus: Optional[float]) -> Dict[str, Any]:
    return {
        "timeout_ms": None if timeout is None else max(int(timeout * 1000), 1),
        "memory_mb": memory_mb,
        "cpus": cpus,
    }


class AsyncFilesystem:
    """The sandbox's workspace (``/home/user``): paths are relative to it."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def write(self, path: str, data: Union[bytes, str]) -> None:
        """Write a file: inline in the job up to 8 MiB, larger ones through a presigned upload
        (up to the operator's upload limit, 100 MiB by default)."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        if len(raw) > MAX_INLINE_FILE_BYTES:
            keys = await self._sb.client.upload({path: raw})
            spec: Dict[str, Any] = {"path": path, "s3_key": keys[path]}
        else:
            spec = {"path": path, "content_b64": b64(raw)}
        record = await self._sb._job("pass", files=[spec])
        if record["status"] != "succeeded":
            reason = record.get("reason") or {}
            raise SandcellError("writing %s failed (%s): %s" % (path, record["status"], reason.get("message", "")))

    async def read(self, path: str) -> bytes:
        """A file's bytes (fetched as an artifact of a job that asks for it)."""
        record = await self._sb._job("", get_files=[path])
        execution = Execution.from_record(record)
        try:
            return await execution.artifact(path).read()
        except KeyError:
            skipped = [s["reason"] for s in record.get("skipped_files") or [] if s.get("path") == path]
            raise FileNotFoundError("%s: %s" % (path, skipped[0] if skipped else "no such file in the workspace")) from None

    async def list(self) -> List[EntryInfo]:
        """The workspace's regular files."""
        record = await self._sb._job("", list_files=True)
        listing = record.get("files") or {"entries": []}
        return [EntryInfo(path=e["path"], size=int(e["size"]), mtime=float(e["mtime"])) for e in listing["entries"]]


class AsyncCommands:
    """Shell commands in the sandbox (``bash -c`` in the workspace)."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def run(self, cmd: str, timeout: Optional[float] = None, on_stdout: Optional[Callback] = None, on_stderr: Optional[Callback] = None) -> CommandResult:
        execution = await self._sb.run_code(cmd, language="bash", timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr)
        r = execution.record
        return CommandResult(stdout=r.get("stdout") or "", stderr=r.get("stderr") or "", exit_code=r.get("exit_code"), status=r["status"], record=r)


class AsyncSandbox:
    """A session (asyncio). Create with :meth:`create`, or attach with :meth:`connect`."""

    def __init__(self, client: AsyncClient, session_id: str, owns_client: bool) -> None:
        self.client = client
        self.session_id = session_id
        self._owns_client = owns_client
        self.files = AsyncFilesystem(self)
        self.commands = AsyncCommands(self)

    @classmethod
    async def create(
        cls,
        keep_alive: Optional[int] = None,
        *,
        memory_mb: Optional[int] = None,
        cpus: Optional[float] = None,
        settings: Optional[Settings] = None,
        client: Optional[AsyncClient] = None,
        wait: float = 120.0,
    ) -> "AsyncSandbox":
        """Open a session that lives ``keep_alive`` seconds after its last job (default 300,
        at most the operator's maximum); ``memory_mb``/``cpus`` are its container's limits."""
        owns = client is None
        c = client or await AsyncClient.connect(settings)
        try:
            session: Dict[str, Any] = {"new": True}
            if keep_alive is not None:
                session["keep_alive_s"] = int(keep_alive)
            record = await c.run(c.job("pass", session=session, **_limits(None, memory_mb, cpus)), timeout=wait)
            _raise_if_rejected(record)
            if record["status"] != "succeeded" or not record.get("session"):
                reason = record.get("reason") or {}
                raise SandcellError("the session did not open (%s): %s" % (record["status"], reason.get("message", "")))
            return cls(c, record["session"]["id"], owns)
        except BaseException:
            if owns:
                await c.close()
            raise

    @classmethod
    async def connect(cls, session_id: str, *, settings: Optional[Settings] = None, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        """Attach to an existing session of this tenant."""
        c = client or await AsyncClient.connect(settings)
        return cls(c, session_id, client is None)

    async def _job(self, code: str, language: str = "python", wait: Optional[float] = None, on_event: Any = None, **fields: Any) -> Dict[str, Any]:
        fields["session"] = {"id": self.session_id, **fields.get("session", {})}
        record = await self.client.run(self.client.job(code, language, **fields), timeout=wait, on_event=on_event)
        _raise_if_rejected(record)
        return record

    async def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        timeout: Optional[float] = None,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        on_result: Optional[Callback] = None,
        on_error: Optional[Callback] = None,
        wait: Optional[float] = None,
    ) -> Execution:
        """Run ``code`` (``python`` or ``bash``) in the session, its variables kept for the next
        call. ``timeout`` (seconds) is the code's own limit: past it the cell is interrupted
        (``status == "timed_out"``) and the session keeps its state. The callbacks get the
        output as it happens: ``on_stdout``/``on_stderr`` a text chunk, ``on_result`` a
        :class:`Result`, ``on_error`` an :class:`ExecutionError`. Raises :class:`JobRejected`
        when sandcell refuses the job (``session_expired``, ...)."""
        callbacks = (on_stdout, on_stderr, on_result, on_error)

        async def on_event(event: Dict[str, Any]) -> None:
            kind = event.get("type")
            if kind == "stdout":
                await _call(on_stdout, event["text"])
            elif kind == "stderr":
                await _call(on_stderr, event["text"])
            elif kind == "output":
                await _call(on_result, Result.build(event.get("output_type") == "execute_result", event.get("data") or {}, {}))
            elif kind == "error":
                await _call(on_error, ExecutionError(event["ename"], event["evalue"], "\n".join(event.get("traceback") or [])))

        record = await self._job(
            code,
            language,
            wait=wait,
            on_event=on_event if any(cb is not None for cb in callbacks) else None,
            timeout_ms=None if timeout is None else max(int(timeout * 1000), 1),
        )
        execution = Execution.from_record(record)
        await execution.load_images()
        return execution

    async def set_timeout(self, keep_alive: int) -> None:
        """Give the session a new keep-alive (seconds after its last job; clamped to the
        operator's range), from now on."""
        await self._job("pass", session={"keep_alive_s": int(keep_alive)})

    async def info(self) -> Dict[str, Any]:
        """The session's document (state, keep-alive, expiry)."""
        doc = await self.client.session(self.session_id)
        if doc is None:
            raise SandcellError("no session %s for tenant %s" % (self.session_id, self.client.settings.tenant))
        return doc

    async def close(self) -> None:
        """Close the session (its container and workspace are destroyed) and, if this sandbox
        opened its own client, the client."""
        try:
            await self._job("", session={"close": True})
        except JobRejected as exc:
            if exc.code not in ("session_closed", "session_expired", "session_lost"):
                raise
        finally:
            if self._owns_client:
                await self.client.close()

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
