"""Where the sidecar's control API listens and its token lies unless told otherwise.

For the sidecar and its clients (:mod:`supervisor.api_access` finds both).

Standard library only: the agent-side client imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = [
    "API_PORT_ENV",
    "DEFAULT_API_PORT",
    "DEFAULT_API_URL",
    "LOOPBACK",
    "api_url",
    "default_token_file",
]

#: The address the sidecar binds to by default: it serves the agents of its own host.
LOOPBACK: Final = "127.0.0.1"
#: The control API's default port.
DEFAULT_API_PORT: Final = 4320
#: The variable that sets the control API's port (``spanvisor run`` and the CLI read it).
API_PORT_ENV: Final = "SPANVISOR_API_PORT"


def api_url(port: int | str = DEFAULT_API_PORT, host: str = LOOPBACK) -> str:
    """The control API's base URL on ``host``:``port``."""
    return f"http://{host}:{port}"


#: The control API's base URL when nothing says otherwise.
DEFAULT_API_URL: Final = api_url()


def default_token_file() -> Path:
    """``~/.spanvisor/api-token``: where the sidecar writes its token unless ``token_file`` says.

    Raises RuntimeError when there is no home directory to find it in.
    """
    return Path.home() / ".spanvisor" / "api-token"
