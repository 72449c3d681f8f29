"""The connection to sandcell: jobs in through RabbitMQ, results out of Postgres, live output
from the broker's events exchange (``docs/protocol.md`` §1, §2, §2b).

One :class:`AsyncClient` holds three connections: an AMQP connection (a confirm-mode channel for
submissions, and one channel whose server-named queue carries the live output of the jobs being
watched), a Postgres connection for reads, and a Postgres connection that ``LISTEN``s on the
tenant's notification channel and wakes every waiter — so any number of jobs are waited for on
one listener, with a re-read every second in case a notification was missed. A job's final
notification carries its result record when it fits one (``docs/protocol.md`` §2): the waiter
then returns it without reading the row.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import urllib.request
import uuid
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Optional, Union

import aio_pika
import psycopg
from psycopg import sql

from ._errors import JobTimeout, SandcellError
from ._settings import Settings

INTAKE_EXCHANGE = "sandcell.intake"
EVENTS_EXCHANGE = "sandcell.events"
UPLOAD_MESSAGE_TYPE = "sandcell.upload"
CANCEL_MESSAGE_TYPE = "sandcell.cancel"
TERMINAL = frozenset(
    {"succeeded", "failed", "timed_out", "oom_killed", "cancelled", "rejected", "infrastructure_error"}
)

#: A callback for one live event (a dict, ``docs/schemas/event.schema.json``); may be async.
EventHandler = Callable[[Dict[str, Any]], Union[None, Awaitable[None]]]


def new_job_id(prefix: str = "sdk") -> str:
    """A fresh job id (the idempotency key: reuse one to make a submission retry-safe)."""
    return "%s-%s" % (prefix, uuid.uuid4().hex)


class AsyncClient:
    """A tenant's connection to sandcell (asyncio). Create with :meth:`connect`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._amqp: Any = None
        self._publisher: Any = None
        self._intake: Any = None
        self._events_exchange: Any = None
        self._events_queue: Any = None
        self._db: Optional[psycopg.AsyncConnection[Any]] = None
        self._db_lock = asyncio.Lock()
        self._listener: Optional[psycopg.AsyncConnection[Any]] = None
        self._listen_task: Optional["asyncio.Task[None]"] = None
        self._wakers: Dict[str, asyncio.Event] = {}
        # Result records a final notification carried, by job id, for the waiter it woke.
        self._carried: Dict[str, Dict[str, Any]] = {}
        self._handlers: Dict[str, EventHandler] = {}

    @classmethod
    async def connect(cls, settings: Optional[Settings] = None) -> "AsyncClient":
        """Connect with ``settings`` (default: :meth:`Settings.from_env`)."""
        self = cls(settings or Settings.from_env())
        try:
            self._amqp = await aio_pika.connect_robust(self.settings.amqp_url, client_properties={"connection_name": "sandcell-python"})
            self._publisher = await self._amqp.channel(publisher_confirms=True, on_return_raises=True)
            self._intake = await self._publisher.get_exchange(INTAKE_EXCHANGE, ensure=False)
            self._db = await psycopg.AsyncConnection.connect(self.settings.database_url, autocommit=True)
        except Exception:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        """Close every connection (waits in progress fail)."""
        if self._listen_task is not None:
            self._listen_task.cancel()
            self._listen_task = None
        for conn in (self._listener, self._db):
            if conn is not None:
                await conn.close()
        self._listener = self._db = None
        if self._amqp is not None:
            await self._amqp.close()
            self._amqp = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- submitting ----------------------------------------------------------------------

    def job(self, code: str, language: str = "python", *, job_id: Optional[str] = None, **fields: Any) -> Dict[str, Any]:
        """A submission for this client's tenant (``docs/schemas/submission.schema.json``);
        ``fields`` are its optional fields (``session``, ``timeout_ms``, ``files``, ...)."""
        job: Dict[str, Any] = {"job_id": job_id or new_job_id(), "tenant": self.settings.tenant, "language": language, "code": code}
        job.update({k: v for k, v in fields.items() if v is not None})
        return job

    async def submit(self, job: Dict[str, Any]) -> str:
        """Publish one submission; returns its job id once the broker has confirmed it (the job
        is then durable and will be answered)."""
        # The session's id as the routing key: a session's submissions share an intake partition,
        # which keeps them in order however many schedulers run (docs/protocol.md).
        session = job.get("session") or {}
        await self._publish(job, str(job["job_id"]), str(session.get("id") or job["job_id"]))
        return str(job["job_id"])

    async def _publish(self, document: Dict[str, Any], message_id: str, routing_key: str, message_type: Optional[str] = None) -> None:
        """Publish one JSON document to the intake exchange as this tenant's broker user,
        persistent and confirmed (``message_type``: the AMQP ``type`` of a request that is not
        a submission)."""
        message = aio_pika.Message(
            json.dumps(document).encode("utf-8"),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message_id,
            user_id=self.settings.broker_user,
            type=message_type,
        )
        await self._intake.publish(message, routing_key=routing_key, mandatory=True)

    async def cancel(self, job_id: str, session_id: str) -> None:
        """Ask sandcell to stop a job of a session (``docs/protocol.md`` §2c): its cell is
        interrupted, the job ends ``cancelled`` and the session keeps its state. A job that
        already ended, or a one-off job, is left as it is."""
        # The session's id as the routing key: the request follows the job through its partition.
        await self._publish({"tenant": self.settings.tenant, "job_id": job_id}, job_id, session_id, CANCEL_MESSAGE_TYPE)

    # -- reading -------------------------------------------------------------------------

    async def _fetch_one(self, query: str, params: Iterable[Any]) -> Optional[Any]:
        if self._db is None:
            raise SandcellError("the client is closed")
        async with self._db_lock:
            cur = await self._db.execute(query, tuple(params))
            row = await cur.fetchone()
        return row[0] if row else None

    async def result(self, job_id: str) -> Optional[Dict[str, Any]]:
        """The job's result record as it stands (``None`` before the scheduler recorded it)."""
        doc = await self._fetch_one("SELECT result FROM job_results WHERE tenant = %s AND job_id = %s", (self.settings.tenant, job_id))
        return dict(doc) if doc is not None else None

    async def session(self, session_id: str) -> Optional[Dict[str, Any]]:
        """A session's document (``docs/schemas/session.schema.json``)."""
        doc = await self._fetch_one(
            "SELECT document FROM session_documents WHERE session_id = %s AND tenant = %s", (session_id, self.settings.tenant)
        )
        return dict(doc) if doc is not None else None

    async def _ensure_listening(self) -> bool:
        """LISTEN on the tenant's channel once the tenant is registered; whether it listens."""
        if self._listen_task is not None:
            return True
        channel = await self._fetch_one("SELECT notify_channel FROM tenants WHERE tenant = %s", (self.settings.tenant,))
        if channel is None:
            return False
        self._listener = await psycopg.AsyncConnection.connect(self.settings.database_url, autocommit=True)
        await self._listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self._listen_task = asyncio.ensure_future(self._listen(self._listener))
        return True

    async def _listen(self, conn: "psycopg.AsyncConnection[Any]") -> None:
        try:
            async for note in conn.notifies():
                try:
                    payload = json.loads(note.payload)
                except ValueError:
                    continue
                if "upload_id" in payload:  # an upload grant: recorded once, final
                    waker = self._wakers.get("upload:%s" % payload["upload_id"])
                    if waker is not None:
                        waker.set()
                    continue
                job_id = payload.get("job_id", "")
                waker = self._wakers.get(job_id)
                if waker is not None and payload.get("status") in TERMINAL:
                    record = payload.get("result")
                    if isinstance(record, dict) and record.get("job_id") == job_id and record.get("status") in TERMINAL:
                        self._carried[job_id] = record
                    waker.set()
        except (psycopg.Error, asyncio.CancelledError):
            pass  # the waits fall back to re-reading every second
        finally:
            if self._listen_task is asyncio.current_task():
                self._listen_task = None

    async def wait(self, job_id: str, timeout: Optional[float] = None, _armed: bool = False) -> Dict[str, Any]:
        """Wait until the job reaches a terminal status; its result record. (``_armed``: the
        listener was listening and the waker registered before the job was submitted, so its
        notification cannot have been missed and the first read can wait for it.)"""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        waker = self._wakers.setdefault(job_id, asyncio.Event())
        try:
            listening = _armed and self._listen_task is not None
            last = "not recorded yet"
            if listening:
                try:
                    await asyncio.wait_for(waker.wait(), 1.0 if deadline is None else max(min(1.0, deadline - loop.time()), 0.0))
                except asyncio.TimeoutError:
                    pass
                waker.clear()
            while True:
                record = self._carried.pop(job_id, None) or await self.result(job_id)
                if record is not None:
                    if record["status"] in TERMINAL:
                        return record
                    last = record["status"]
                if not listening:
                    listening = await self._ensure_listening()
                    if listening:
                        continue  # re-read: it may have finished before LISTEN
                now = loop.time()
                if deadline is not None and now >= deadline:
                    raise JobTimeout("job %s did not finish within %ss; last status %s" % (job_id, timeout, last))
                wake = 1.0 if deadline is None else min(1.0, deadline - now)
                try:
                    await asyncio.wait_for(waker.wait(), wake)
                except asyncio.TimeoutError:
                    pass
                waker.clear()
        finally:
            self._wakers.pop(job_id, None)
            self._carried.pop(job_id, None)

    async def wait_all(self, job_ids: Iterable[str], timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Wait for many jobs together (one listener); their records in the order given."""
        return list(await asyncio.gather(*(self.wait(j, timeout) for j in job_ids)))

    # -- large uploads -------------------------------------------------------------------

    async def upload(self, files: Dict[str, bytes], timeout: float = 600.0) -> Dict[str, str]:
        """Put large files where a job can name them, without the store's credentials: ask the
        scheduler for presigned PUT URLs (``docs/protocol.md`` §1a), PUT each file, and return
        path -> ``s3_key`` for a job's ``files`` (``{"path": ..., "s3_key": ...}``)."""
        upload_id = new_job_id("upload")
        request = {"tenant": self.settings.tenant, "upload_id": upload_id, "files": [{"path": p, "size_bytes": len(b)} for p, b in files.items()]}
        waker = self._wakers.setdefault("upload:" + upload_id, asyncio.Event())
        try:
            await self._ensure_listening()
            await self._publish(request, upload_id, upload_id, UPLOAD_MESSAGE_TYPE)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60.0
            while True:
                grant = await self._fetch_one("SELECT grant_doc FROM uploads WHERE tenant = %s AND upload_id = %s", (self.settings.tenant, upload_id))
                if grant is not None:
                    break
                if loop.time() >= deadline:
                    raise JobTimeout("no answer to upload request %s within 60 s" % upload_id)
                try:
                    await asyncio.wait_for(waker.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                waker.clear()
        finally:
            self._wakers.pop("upload:" + upload_id, None)
        if grant["status"] != "ready":
            reason = grant.get("reason") or {}
            raise SandcellError("upload refused: %s: %s" % (reason.get("code"), reason.get("message")))
        keys = {}
        for target in grant["files"]:
            data = files[target["path"]]
            await asyncio.wait_for(asyncio.to_thread(_put, target["put_url"], data), timeout)
            keys[target["path"]] = target["s3_key"]
        return keys

    # -- live output ---------------------------------------------------------------------

    async def _events(self) -> Any:
        if self._events_queue is None:
            ch = await self._amqp.channel()
            self._events_exchange = await ch.get_exchange(EVENTS_EXCHANGE, ensure=False)
            # Named in the tenant's own namespace (aio-pika's robust queues name themselves;
            # the broker lets a tenant's user declare only server-named queues and these).
            name = "sandcell.live.%s.%s" % (self.settings.tenant, uuid.uuid4().hex)
            queue = await ch.declare_queue(name, exclusive=True, auto_delete=True)
            await queue.consume(self._on_event, no_ack=True)
            self._events_queue = queue
        return self._events_queue

    async def _on_event(self, message: Any) -> None:
        try:
            event = json.loads(message.body)
        except ValueError:
            return
        handler = self._handlers.get(event.get("job_id", ""))
        if handler is not None:
            outcome = handler(event)
            if inspect.isawaitable(outcome):
                await outcome

    async def watch(self, job_id: str, handler: EventHandler) -> None:
        """Call ``handler`` with each live event of ``job_id`` — call before submitting it
        (events are kept for nobody); :meth:`unwatch` when done."""
        queue = await self._events()
        self._handlers[job_id] = handler
        await queue.bind(self._events_exchange, routing_key="%s.%s" % (self.settings.tenant, job_id))

    async def unwatch(self, job_id: str) -> None:
        self._handlers.pop(job_id, None)
        if self._events_queue is not None:
            await self._events_queue.unbind(self._events_exchange, routing_key="%s.%s" % (self.settings.tenant, job_id))

    async def run(self, job: Dict[str, Any], timeout: Optional[float] = None, on_event: Optional[EventHandler] = None) -> Dict[str, Any]:
        """Submit ``job`` and wait for its record; with ``on_event``, its live events are handed
        over as they come, all of them before this returns (unless some were lost: the record
        is complete either way)."""
        job_id = job["job_id"]
        # Listening, and this job's waker in place, before it is submitted: the wait then
        # needs no read before its notification.
        armed = await self._ensure_listening()
        self._wakers.setdefault(job_id, asyncio.Event())
        ended = asyncio.Event()

        async def relay(event: Dict[str, Any]) -> None:
            if event.get("type") == "end":
                ended.set()
                return
            if on_event is not None:
                outcome = on_event(event)
                if inspect.isawaitable(outcome):
                    await outcome

        try:
            if on_event is not None:
                await self.watch(job_id, relay)
            await self.submit(job)
            record = await self.wait(job_id, timeout, _armed=armed)
            if on_event is not None:
                # `end` follows the commit the wait saw; give the stream a moment to deliver it.
                try:
                    await asyncio.wait_for(ended.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
            return record
        finally:
            self._wakers.pop(job_id, None)
            if on_event is not None:
                await self.unwatch(job_id)


def _put(url: str, data: bytes) -> None:
    """PUT ``data`` to a presigned URL."""
    req = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Length": str(len(data))})
    with urllib.request.urlopen(req, timeout=600) as resp:  # noqa: S310 (a presigned URL)
        if resp.status // 100 != 2:
            raise SandcellError("upload PUT answered %d" % resp.status)


def b64(data: Union[bytes, str]) -> str:
    """Base64 of bytes (a str is UTF-8 encoded first)."""
    return base64.b64encode(data.encode("utf-8") if isinstance(data, str) else data).decode("ascii")
