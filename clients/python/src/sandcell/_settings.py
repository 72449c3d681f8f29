"""Connection settings: the variables `sandcell-admin tenant create` prints."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional
from urllib.parse import unquote, urlparse

from ._errors import SandcellError


@dataclass(frozen=True)
class Settings:
    """Where sandcell is and who the client is.

    ``tenant`` defaults to the broker user in ``amqp_url`` (a tenant's own user is named after
    it); a trusted backend connecting as the service user names the tenant explicitly.
    """

    amqp_url: str
    database_url: str
    tenant: str

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        """Read ``SANDCELL_AMQP_URL``, ``SANDCELL_DATABASE_URL`` and ``SANDCELL_TENANT``."""
        env = os.environ if env is None else env
        missing = [k for k in ("SANDCELL_AMQP_URL", "SANDCELL_DATABASE_URL") if not env.get(k)]
        if missing:
            raise SandcellError(
                "missing %s: set the variables `sandcell-admin tenant create` printed" % ", ".join(missing)
            )
        amqp_url = env["SANDCELL_AMQP_URL"]
        tenant = env.get("SANDCELL_TENANT") or unquote(urlparse(amqp_url).username or "")
        if not tenant:
            raise SandcellError("no tenant: set SANDCELL_TENANT (or a tenant's own SANDCELL_AMQP_URL)")
        return cls(amqp_url=amqp_url, database_url=env["SANDCELL_DATABASE_URL"], tenant=tenant)

    @property
    def broker_user(self) -> str:
        """The broker user the connection authenticates as (sent as ``user_id``)."""
        return unquote(urlparse(self.amqp_url).username or "guest")
