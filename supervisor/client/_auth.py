"""The bearer token a client shows the control API, read again when the sidecar restarts.

A sidecar without ``api_token`` writes a new token to its token file at every
start. A client made before the restart would then be refused for good; so a
token that came from the token file (or was looked for there in vain) is read
again after a 401, and the request is sent once more when the file holds
another token. A token given outright (an argument, ``SPANVISOR_API_TOKEN``,
the settings file) is never replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from pathlib import Path

import httpx

from supervisor.api_access import ApiAccess

__all__ = ["SidecarAuth"]


class SidecarAuth(httpx.Auth):
    """``Authorization: Bearer`` from an :class:`ApiAccess`; for sync and async clients alike."""

    def __init__(self, access: ApiAccess) -> None:
        self._file = access.token_file
        self._token = access.token
        self._lock = threading.Lock()

    @property
    def token(self) -> str | None:
        """The token shown now."""
        with self._lock:
            return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        shown = self.token
        if shown:
            request.headers["Authorization"] = f"Bearer {shown}"
        response = yield request
        if response.status_code != 401 or self._file is None:
            return
        fresh = _read(self._file)
        if fresh is None or fresh == shown:
            return  # the same token, or none: the refusal stands
        with self._lock:
            self._token = fresh
        request.headers["Authorization"] = f"Bearer {fresh}"
        yield request


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None
