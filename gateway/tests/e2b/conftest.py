"""Fixtures for driving sandcell's E2B-compatible gateway with E2B's own, unmodified SDK.

The SDK is configured the way a user would configure it: by environment variables alone
(E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL, E2B_DOMAIN). An API key is made the way an operator
makes one, with `sandcell-admin tenant create` and `sandcell-admin key create`.

Environment:
- SANDCELL_GATEWAY_URL: the gateway (default http://127.0.0.1:9480), used both as the control
  plane (E2B_API_URL) and as every sandbox's address (E2B_SANDBOX_URL).
- SANDCELL_ADMIN_BIN: the `sandcell-admin` binary (default target/debug/sandcell-admin).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Dict, Iterator, Set

import pytest
from e2b_code_interpreter import Sandbox

REPO = Path(__file__).resolve().parents[3]
GATEWAY_URL = os.environ.get("SANDCELL_GATEWAY_URL", "http://127.0.0.1:9480").rstrip("/")
ADMIN_BIN = os.environ.get("SANDCELL_ADMIN_BIN", str(REPO / "target" / "debug" / "sandcell-admin"))
# Not one of E2B's own domains: with one of those the SDK would route sandbox traffic to
# https://sandbox.<domain> (E2B_SANDBOX_URL wins anyway, but nothing should point at E2B).
E2B_DOMAIN = "sandcell.localhost"
# Seconds a sandbox may live if a test dies before killing it.
SANDBOX_TIMEOUT = 120


def _admin(*args: str) -> Dict[str, str]:
    """Run sandcell-admin and return the KEY=VALUE lines it printed."""
    out = subprocess.run(
        [ADMIN_BIN, *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def new_api_key(*quotas: str) -> str:
    """A new tenant and an API key for it, as an operator makes them; `quotas` are passed to
    `sandcell-admin tenant create` (e.g. "--max-result-bytes", "600000")."""
    name = "e2b" + uuid.uuid4().hex[:12]
    _admin("tenant", "create", name, *quotas)
    created = _admin("key", "create", name)
    key = created["SANDCELL_API_KEY"]
    assert key, created
    assert created["E2B_API_KEY"] == key, created
    return key


def sandbox_ids() -> Set[str]:
    """The ids of every sandbox `Sandbox.list()` returns for the key in the environment,
    all pages read (2.63.0's list is a paginator: `has_next` / `next_items()`)."""
    paginator = Sandbox.list()
    ids: Set[str] = set()
    pages = 0
    while paginator.has_next:
        pages += 1
        assert pages <= 100, "Sandbox.list() never ends: x-next-token is sent on every page"
        ids.update(info.sandbox_id for info in paginator.next_items())
    return ids


@pytest.fixture(scope="session")
def api_key() -> str:
    """Tenant A's key: the one in E2B_API_KEY unless a test swaps it."""
    return new_api_key()


@pytest.fixture(scope="session", autouse=True)
def e2b_env(api_key: str) -> Iterator[None]:
    """Point the SDK at the gateway through the environment, for the whole session."""
    settings = {
        "E2B_API_KEY": api_key,
        "E2B_API_URL": GATEWAY_URL,
        "E2B_SANDBOX_URL": GATEWAY_URL,
        "E2B_DOMAIN": E2B_DOMAIN,
    }
    # Debug mode would skip the control plane altogether; the others change the wire.
    cleared = ["E2B_DEBUG", "E2B_HTTP_VERSION", "E2B_ACCESS_TOKEN", "E2B_CONNECTION_RETRIES"]
    saved = {k: os.environ.get(k) for k in [*settings, *cleared]}
    for k in cleared:
        os.environ.pop(k, None)
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _create() -> Sandbox:
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    assert isinstance(sbx.sandbox_id, str) and sbx.sandbox_id
    return sbx


@pytest.fixture(scope="module")
def shared_sandbox() -> Iterator[Sandbox]:
    """One sandbox for the checks whose state does not interfere (each uses its own names)."""
    sbx = _create()
    try:
        yield sbx
    finally:
        # The instance keeps the key it was created with, whatever E2B_API_KEY is by then.
        sbx.kill()


@pytest.fixture
def fresh_sandbox() -> Iterator[Sandbox]:
    """A sandbox of its own, for a test that disturbs it or needs a known history."""
    sbx = _create()
    try:
        yield sbx
    finally:
        sbx.kill()
