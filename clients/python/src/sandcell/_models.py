"""What a job returns, shaped like E2B's ``Execution`` (results, logs, error) and built from
the result record sandcell commits in Postgres (``docs/schemas/result.schema.json``)."""

from __future__ import annotations

import asyncio
import base64
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ._errors import SandcellError

#: MIME type -> attribute of :class:`Result`.
_FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


@dataclass
class Artifact:
    """A file the job produced (or fetched), stored until ``expires_at``."""

    path: str
    kind: str
    size: int
    content_type: str
    sha256: str
    expires_at: str
    state: str
    download_url: Optional[str]

    @classmethod
    def from_json(cls, a: Dict[str, Any]) -> "Artifact":
        return cls(
            path=a["path"],
            kind=a["kind"],
            size=int(a["size_bytes"]),
            content_type=a["content_type"],
            sha256=a["sha256"],
            expires_at=a["expires_at"],
            state=a["state"],
            download_url=a.get("download_url"),
        )

    async def read(self) -> bytes:
        """The artifact's bytes (an HTTP GET of its presigned URL)."""
        url = self.download_url
        if self.state != "available" or not url:
            raise SandcellError("artifact_expired: %r has expired and was deleted" % self.path)

        def get() -> bytes:
            with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 (a presigned URL)
                data: bytes = resp.read()
                return data

        return await asyncio.to_thread(get)


@dataclass
class Result:
    """One rich output: the last expression's value (``is_main_result``) or a displayed object.
    Text formats as they are; images (``png``, ``jpeg``) base64-encoded, as E2B gives them."""

    is_main_result: bool
    text: Optional[str] = None
    html: Optional[str] = None
    markdown: Optional[str] = None
    svg: Optional[str] = None
    png: Optional[str] = None
    jpeg: Optional[str] = None
    pdf: Optional[str] = None
    latex: Optional[str] = None
    json: Optional[str] = None
    javascript: Optional[str] = None
    #: Every representation by MIME type (text as is, binary base64).
    data: Dict[str, str] = field(default_factory=dict)
    #: Binary representations stored as artifacts: MIME type -> artifact path.
    artifacts: Dict[str, str] = field(default_factory=dict)

    def formats(self) -> List[str]:
        """The formats this result has (``text``, ``png``, ...)."""
        return [name for mime, name in _FORMATS.items() if mime in self.data]

    @classmethod
    def build(cls, is_main_result: bool, data: Dict[str, str], artifacts: Dict[str, str]) -> "Result":
        r = cls(is_main_result=is_main_result, data=dict(data), artifacts=dict(artifacts))
        for mime, value in data.items():
            name = _FORMATS.get(mime)
            if name:
                setattr(r, name, value)
        return r


@dataclass
class Logs:
    """What the code printed, in chunks (one per output read by the sandbox)."""

    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass
class ExecutionError:
    """The exception the code ended with."""

    name: str
    value: str
    traceback: str


@dataclass
class Execution:
    """A finished job: ``results``, ``logs``, ``error``, plus what sandcell adds (``status``,
    ``artifacts``, ``usage``, ``record``: the whole result record)."""

    job_id: str
    status: str
    results: List[Result]
    logs: Logs
    error: Optional[ExecutionError]
    artifacts: List[Artifact]
    exit_code: Optional[int]
    record: Dict[str, Any]

    @property
    def text(self) -> Optional[str]:
        """The ``text/plain`` of the last expression's value, if there was one."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def timed_out(self) -> bool:
        return self.status == "timed_out"

    def artifact(self, path: str) -> Artifact:
        """The artifact at ``path`` (raises :class:`KeyError` if the job has none there)."""
        for a in self.artifacts:
            if a.path == path:
                return a
        raise KeyError(path)

    @classmethod
    def from_record(cls, record: Dict[str, Any]) -> "Execution":
        results = []
        for out in record.get("outputs") or []:
            results.append(Result.build(out.get("type") == "execute_result", out.get("data") or {}, out.get("artifacts") or {}))
        err = record.get("error")
        error = None
        if err:
            error = ExecutionError(name=err["ename"], value=err["evalue"], traceback="\n".join(err.get("traceback") or []))
        elif record.get("status") == "timed_out":
            error = ExecutionError(name="TimeoutError", value="the code ran past its timeout", traceback="")
        stdout, stderr = record.get("stdout") or "", record.get("stderr") or ""
        return cls(
            job_id=record["job_id"],
            status=record["status"],
            results=results,
            logs=Logs(stdout=[stdout] if stdout else [], stderr=[stderr] if stderr else []),
            error=error,
            artifacts=[Artifact.from_json(a) for a in record.get("artifacts") or []],
            exit_code=record.get("exit_code"),
            record=record,
        )

    async def load_images(self) -> None:
        """Fill in ``png``/``jpeg`` (base64) of each result from its stored artifact."""
        by_path = {a.path: a for a in self.artifacts}
        for r in self.results:
            for mime, path in r.artifacts.items():
                name = _FORMATS.get(mime)
                artifact = by_path.get(path)
                if name in ("png", "jpeg", "pdf") and artifact is not None and artifact.state == "available":
                    value = base64.b64encode(await artifact.read()).decode("ascii")
                    r.data[mime] = value
                    setattr(r, name, value)


@dataclass
class EntryInfo:
    """A file in the sandbox's workspace."""

    path: str
    size: int
    mtime: float


@dataclass
class CommandResult:
    """A shell command's outcome."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    status: str
    record: Dict[str, Any]
