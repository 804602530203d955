"""A client made before the sidecar restarted keeps working: the new token file is read.

A sidecar without ``api_token`` writes a new token to its token file at every
start, as ``spanvisor run`` does. Two real sidecars in turn, on the same port and
token file; clients made while the first ran are refused by the second until
they read the file again (once per 401); a token given outright is never
replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.client import SupervisorClient, SupervisorClientError
from supervisor.client.pull import CommandPuller
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar


def _start(folder: Path, api_port: int = 0) -> tuple[BackgroundSidecar, int]:
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": api_port,
            "state_path": str(folder / "state.db"),
            "token_file": str(folder / "api-token"),
            "agents": {"agent": {"pull": {}}},
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy()))
    return background, background.start().api


class Restartable:
    """A sidecar that can be restarted on its port and token file, as a redeploy does."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.token_file = folder / "api-token"
        self.background, self.port = _start(folder)

    def restart(self) -> None:
        self.background.stop()
        self.background = _start(self.folder, self.port)[0]


@pytest.fixture
def sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Restartable]:
    monkeypatch.delenv("SPANVISOR_API_TOKEN", raising=False)
    monkeypatch.delenv("SPANVISOR_CONFIG", raising=False)
    running = Restartable(tmp_path)
    monkeypatch.setenv("SPANVISOR_TOKEN_FILE", str(running.token_file))
    monkeypatch.setenv("SPANVISOR_API_URL", f"http://127.0.0.1:{running.port}")
    try:
        yield running
    finally:
        running.background.stop()


def test_a_client_reads_the_new_token_file_after_the_sidecar_restarted(
    sidecar: Restartable,
) -> None:
    before = sidecar.token_file.read_text()
    client = SupervisorClient()
    puller = CommandPuller("agent")
    try:
        assert client.breaker_state("openai:gpt-4o") == "closed"
        assert puller.poll(wait_s=0) == []
        sidecar.restart()
        assert sidecar.token_file.read_text() != before  # a new token
        assert client.breaker_state("openai:gpt-4o") == "closed"
        assert puller.poll(wait_s=0) == []
    finally:
        client.close()
        puller.close()


def test_a_token_given_outright_is_not_replaced(sidecar: Restartable) -> None:
    client = SupervisorClient(token=sidecar.token_file.read_text().strip())
    try:
        assert client.breaker_state("openai:gpt-4o") == "closed"
        sidecar.restart()
        with pytest.raises(SupervisorClientError, match="refused"):
            client.breaker_state("openai:gpt-4o")
    finally:
        client.close()
