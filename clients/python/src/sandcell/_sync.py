"""The synchronous API: the asyncio one, run on a private event loop in a daemon thread.

Every call blocks until its coroutine is done on that loop; callbacks (``on_stdout``, ...) run
on the loop's thread. One implementation of the protocol, two ways to call it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Dict, Iterable, List, Optional, TypeVar, Union

from ._client import AsyncClient
from ._models import CommandResult, EntryInfo, Execution
from ._sandbox import AsyncSandbox, Callback
from ._settings import Settings

T = TypeVar("T")


class _Loop:
    """One event loop in a daemon thread, shared by every synchronous object."""

    _lock = threading.Lock()
    _loop: Optional[asyncio.AbstractEventLoop] = None

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, T]) -> T:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="sandcell-loop", daemon=True).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


class Client:
    """A tenant's connection to sandcell, blocking. See :class:`sandcell.AsyncClient`."""

    def __init__(self, settings: Optional[Settings] = None) -> None:
        self._async: AsyncClient = _Loop.run(AsyncClient.connect(settings))

    @property
    def settings(self) -> Settings:
        return self._async.settings

    def job(self, code: str, language: str = "python", **fields: Any) -> Dict[str, Any]:
        """A submission for this client's tenant."""
        return self._async.job(code, language, **fields)

    def submit(self, job: Dict[str, Any]) -> str:
        """Publish a submission (confirmed by the broker); its job id."""
        return _Loop.run(self._async.submit(job))

    def wait(self, job_id: str, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Wait for a job's terminal result record."""
        return _Loop.run(self._async.wait(job_id, timeout))

    def wait_all(self, job_ids: Iterable[str], timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Wait for many jobs on one listener; their records in order."""
        return _Loop.run(self._async.wait_all(list(job_ids), timeout))

    def cancel(self, job_id: str, session_id: str) -> None:
        """Ask sandcell to stop a job of a session (it ends ``cancelled``)."""
        _Loop.run(self._async.cancel(job_id, session_id))

    def result(self, job_id: str) -> Optional[Dict[str, Any]]:
        """A job's record as it stands."""
        return _Loop.run(self._async.result(job_id))

    def close(self) -> None:
        _Loop.run(self._async.close())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Filesystem:
    """The sandbox's workspace, blocking."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._a = sandbox.files

    def write(self, path: str, data: Union[bytes, str]) -> None:
        _Loop.run(self._a.write(path, data))

    def read(self, path: str) -> bytes:
        return _Loop.run(self._a.read(path))

    def list(self) -> List[EntryInfo]:
        return _Loop.run(self._a.list())


class Commands:
    """Shell commands in the sandbox, blocking."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._a = sandbox.commands

    def run(self, cmd: str, timeout: Optional[float] = None, on_stdout: Optional[Callback] = None, on_stderr: Optional[Callback] = None) -> CommandResult:
        return _Loop.run(self._a.run(cmd, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr))


class Sandbox:
    """A session, blocking: ``Sandbox.create()``, ``run_code``, ``files``, ``commands``,
    ``close`` (or ``with Sandbox.create() as sb:``). See :class:`sandcell.AsyncSandbox`."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._a = sandbox
        self.files = Filesystem(sandbox)
        self.commands = Commands(sandbox)

    @property
    def session_id(self) -> str:
        return self._a.session_id

    @classmethod
    def create(
        cls,
        keep_alive: Optional[int] = None,
        *,
        memory_mb: Optional[int] = None,
        cpus: Optional[float] = None,
        settings: Optional[Settings] = None,
        client: Optional[Client] = None,
        wait: float = 120.0,
    ) -> "Sandbox":
        """Open a session (see :meth:`sandcell.AsyncSandbox.create`)."""
        shared = client._async if client is not None else None
        return cls(_Loop.run(AsyncSandbox.create(keep_alive, memory_mb=memory_mb, cpus=cpus, settings=settings, client=shared, wait=wait)))

    @classmethod
    def connect(cls, session_id: str, *, settings: Optional[Settings] = None, client: Optional[Client] = None) -> "Sandbox":
        shared = client._async if client is not None else None
        return cls(_Loop.run(AsyncSandbox.connect(session_id, settings=settings, client=shared)))

    def run_code(
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
        """Run code in the session (see :meth:`sandcell.AsyncSandbox.run_code`)."""
        return _Loop.run(
            self._a.run_code(code, language, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result, on_error=on_error, wait=wait)
        )

    def set_timeout(self, keep_alive: int) -> None:
        """Give the session a new keep-alive (see :meth:`sandcell.AsyncSandbox.set_timeout`)."""
        _Loop.run(self._a.set_timeout(keep_alive))

    def info(self) -> Dict[str, Any]:
        return _Loop.run(self._a.info())

    def close(self) -> None:
        _Loop.run(self._a.close())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
