"""Fixtures against the real local stack (deploy/local/test.sh starts it and exports its
settings): a tenant created as an operator creates one, with `sandcell-admin tenant create`."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from sandcell import Client, Sandbox, Settings

REPO = Path(__file__).resolve().parents[3]


def create_tenant() -> Settings:
    admin = os.environ.get("SANDCELL_ADMIN_BIN", str(REPO / "target" / "debug" / "sandcell-admin"))
    name = "py" + uuid.uuid4().hex[:12]
    out = subprocess.run([admin, "tenant", "create", name], capture_output=True, text=True, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    settings = Settings.from_env(env)
    assert settings.tenant == name
    return settings


@pytest.fixture(scope="session")
def tenant() -> Settings:
    return create_tenant()


@pytest.fixture(scope="session")
def client(tenant: Settings) -> Iterator[Client]:
    with Client(tenant) as c:
        yield c


@pytest.fixture
def sandbox(client: Client) -> Iterator[Sandbox]:
    with Sandbox.create(keep_alive=120, client=client) as sb:
        yield sb
