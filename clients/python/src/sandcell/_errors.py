"""Errors the SDK raises. A job that ran and failed is not an error: its `Execution` says so."""

from __future__ import annotations

from typing import Any, Dict, Optional


class SandcellError(Exception):
    """Something kept the SDK from getting an answer (connection, configuration)."""


class JobRejected(SandcellError):
    """sandcell refused the job without running it (``status`` ``rejected``): ``code`` is the
    protocol's error code (``session_expired``, ``quota_exceeded``, ...)."""

    def __init__(self, code: str, message: str, result: Optional[Dict[str, Any]] = None) -> None:
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.result = result


class JobTimeout(SandcellError):
    """The SDK stopped waiting for a job (its own wait, not the job's ``timeout``)."""
