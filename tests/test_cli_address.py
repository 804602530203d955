"""The CLI, guard(), the pull client and the LangGraph adapter's puller find a real sidecar alike.

Two real sidecars in process (real sockets), each writing its own token file
as ``spanvisor run`` does without ``api_token``. Clients are pointed at them
only by variables or a settings file, never by arguments; when they reach the
wrong one, or none, or find no token, the error says which sidecar was asked,
how its address was chosen and which token file was read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.cli.verbs import main
from supervisor.client import BreakerOpen, SupervisorClient, SupervisorClientError, guard
from supervisor.client import _http as client_http
from supervisor.client.pull import CommandPuller
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar

#: Every variable that names the API or its token: each test sets its own.
VARIABLES = (
    "SPANVISOR_API_URL",
    "SPANVISOR_API_HOST",
    "SPANVISOR_API_PORT",
    "SPANVISOR_API_TOKEN",
    "SPANVISOR_TOKEN_FILE",
    "SPANVISOR_CONFIG",
)


@dataclass
class Running:
    background: BackgroundSidecar
    url: str
    token_file: Path


def _start(directory: Path) -> Running:
    directory.mkdir()
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "state_path": str(directory / "state.db"),
            "token_file": str(directory / "api-token"),
            "agents": {"agent": {"pull": {}}},
        }
    )
    assert settings.api_token is None  # a token made at start and written to token_file
    background = BackgroundSidecar(build_sidecar(settings, load_policy()))
    ports = background.start()
    return Running(background, f"http://127.0.0.1:{ports.api}", settings.token_file)


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # guard() without a client uses the process's shared one: a fresh one per test.
    monkeypatch.setattr(client_http, "_shared", None)
    yield monkeypatch
    if client_http._shared is not None:
        client_http._shared.close()


@pytest.fixture
def one(tmp_path: Path, quiet_env: pytest.MonkeyPatch) -> Iterator[Running]:
    running = _start(tmp_path / "one")
    try:
        yield running
    finally:
        running.background.stop()


@pytest.fixture
def other(tmp_path: Path, one: Running) -> Iterator[Running]:
    running = _start(tmp_path / "other")
    try:
        yield running
    finally:
        running.background.stop()


def _port(running: Running) -> str:
    return running.url.rsplit(":", 1)[1]


def test_every_client_finds_the_sidecar_by_its_variables(
    one: Running, quiet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # What `spanvisor run` reads (SPANVISOR_API_PORT, SPANVISOR_TOKEN_FILE) names it for all.
    quiet_env.setenv("SPANVISOR_API_PORT", _port(one))
    quiet_env.setenv("SPANVISOR_TOKEN_FILE", str(one.token_file))

    assert main(["breakers", "isolate", "openai:gpt-4o"]) == 0
    assert "openai:gpt-4o: isolated" in capsys.readouterr().out

    # guard() asks the same sidecar: the breaker isolated above fails the call fast.
    with pytest.raises(BreakerOpen, match="isolated"):
        guard("openai:gpt-4o").call(lambda: "called")
    with SupervisorClient() as client:
        assert client.access.url == one.url
        assert client.breaker_state("openai:gpt-4o") == "isolated"
    # The pull client (and so the LangGraph adapter's poll loop) too.
    with CommandPuller("agent") as puller:
        assert puller.base_url == one.url
        assert puller.poll(wait_s=0) == []  # answered: a refused token would raise


def test_a_settings_file_names_the_sidecar_for_the_cli_and_the_clients(
    one: Running, quiet_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "spanvisor.yaml"
    config.write_text(f"api_port: {_port(one)}\ntoken_file: {one.token_file}\n")

    assert main(["breakers", "--config", str(config)]) == 0
    assert "DEPENDENCY" in capsys.readouterr().out

    quiet_env.setenv("SPANVISOR_CONFIG", str(config))
    assert main(["breakers", "close", "tool:search"]) == 0
    assert "tool:search: closed" in capsys.readouterr().out
    with SupervisorClient() as client:
        assert client.breaker_state("tool:search") == "closed"
        assert client.access.token_file == one.token_file
    with CommandPuller("agent") as puller:
        assert puller.poll(wait_s=0) == []


def test_the_url_variable_beats_the_port_and_the_settings_file(
    one: Running, other: Running, quiet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet_env.setenv("SPANVISOR_API_URL", one.url)
    quiet_env.setenv("SPANVISOR_API_PORT", _port(other))
    quiet_env.setenv("SPANVISOR_TOKEN_FILE", str(one.token_file))

    assert main(["breakers", "isolate", "tool:search"]) == 0
    capsys.readouterr()
    assert one.background.sidecar.governor.breaker_state("tool:search").value == "isolated"
    assert other.background.sidecar.governor.breaker_state("tool:search").value == "closed"


def test_the_wrong_sidecar_refusing_the_token_says_which_sidecar_and_which_token_file(
    one: Running, other: Running, quiet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The address is the other sidecar's, the token file the first one's.
    quiet_env.setenv("SPANVISOR_API_PORT", _port(other))
    quiet_env.setenv("SPANVISOR_TOKEN_FILE", str(one.token_file))
    refused = (
        f"the sidecar at {other.url} (port from SPANVISOR_API_PORT) refused the API token from"
        f" the token file {one.token_file} (SPANVISOR_TOKEN_FILE) (401: "
    )

    assert main(["reload"]) == 2
    err = capsys.readouterr().err
    assert refused in err
    assert f"check that its token_file is {one.token_file}" in err

    with pytest.raises(SupervisorClientError) as caught:
        guard("openai:gpt-4o").call(lambda: "called")
    assert refused in str(caught.value)
    with CommandPuller("agent") as puller, pytest.raises(SupervisorClientError) as caught:
        puller.poll(wait_s=0)
    assert refused in str(caught.value)


def test_before_the_token_file_exists_the_error_names_the_file_looked_for(
    one: Running, quiet_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tmp_path / "not-started-yet" / "api-token"
    quiet_env.setenv("SPANVISOR_API_URL", one.url)
    quiet_env.setenv("SPANVISOR_TOKEN_FILE", str(absent))

    assert main(["runs"]) == 2
    err = capsys.readouterr().err
    assert (
        f"no API token for the sidecar at {one.url} (from SPANVISOR_API_URL): the token file"
        f" {absent} (SPANVISOR_TOKEN_FILE) gave none: No such file or directory" in err
    )

    # The client asks all the same (the sidecar may take no token one day) and is refused.
    with SupervisorClient() as client, pytest.raises(SupervisorClientError) as caught:
        client.breaker_state("openai:gpt-4o")
    assert f"the sidecar at {one.url} (from SPANVISOR_API_URL) answered 401" in str(caught.value)
    assert f"no API token was sent: the token file {absent}" in str(caught.value)


def test_nobody_listening_names_the_url_and_how_it_was_chosen(
    one: Running, quiet_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = one.url
    one.background.stop()  # its port is closed now
    quiet_env.setenv("SPANVISOR_TOKEN_FILE", str(one.token_file))
    config = tmp_path / "spanvisor.yaml"
    config.write_text(f"api_port: {_port(one)}\n")

    assert main(["incidents", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        f"cannot reach the control API at {url} (port from api_port in the settings file"
        f" {config} (--config)): ConnectError" in err
    )
    assert "--api URL, SPANVISOR_API_URL, or api_host/api_port in the settings file" in err
