"""sandcell's Python SDK: run code in resource-capped sandboxes, E2B-style.

    from sandcell import Sandbox

    with Sandbox.create() as sb:
        sb.run_code("x = 41")
        print(sb.run_code("x + 1").text)          # 42

Settings come from the variables ``sandcell-admin tenant create`` prints
(``SANDCELL_AMQP_URL``, ``SANDCELL_DATABASE_URL``; ``SANDCELL_TENANT`` for a trusted backend).
Jobs go in through RabbitMQ and results come out of Postgres; ``AsyncSandbox``/``AsyncClient``
are the asyncio API, ``Sandbox``/``Client`` the blocking one. ``Client.submit`` + ``wait_all``
run many one-off jobs at once. ``sandcell.tools`` has a ``run_code`` tool for the OpenAI and
Anthropic APIs and renders an ``Execution`` as each one's tool result.
"""

from ._client import AsyncClient, new_job_id
from ._errors import JobRejected, JobTimeout, SandcellError
from ._models import Artifact, CommandResult, EntryInfo, Execution, ExecutionError, Logs, Result
from ._sandbox import AsyncSandbox
from ._settings import Settings
from ._sync import Client, Sandbox

__all__ = [
    "Artifact",
    "AsyncClient",
    "AsyncSandbox",
    "Client",
    "CommandResult",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "JobRejected",
    "JobTimeout",
    "Logs",
    "Result",
    "Sandbox",
    "SandcellError",
    "Settings",
    "new_job_id",
]
