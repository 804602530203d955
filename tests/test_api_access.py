"""How a client finds the control API and its token: the order, and what each answer says.

:func:`resolve_access` is given its environment as a mapping and reads real
files in tmp_path; the same function serves the CLI and the client classes
(``tests/test_cli_address.py`` runs them against real sidecars).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from supervisor.api_access import CLI, CLIENT, resolve_access
from supervisor.errors import ConfigError
from supervisor.settings import load_settings


@pytest.fixture
def settings_file(tmp_path: Path) -> Path:
    path = tmp_path / "spanvisor.yaml"
    path.write_text(
        "api_host: 10.1.2.3\napi_port: 5001\ntoken_file: "
        f"{tmp_path / 'from-settings.token'}\nmax_body_bytes: 2048\n"
    )
    (tmp_path / "from-settings.token").write_text("settings-file-token\n")
    return path


def test_with_nothing_set_the_default_address_and_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".spanvisor").mkdir(parents=True)
    (home / ".spanvisor" / "api-token").write_text("home-token\n")
    monkeypatch.setenv("HOME", str(home))

    access = resolve_access(environ={})

    assert access.url == "http://127.0.0.1:4320"
    assert access.url_from.startswith("the default address")
    assert access.token == "home-token"
    assert access.token_from == f"from the token file {home}/.spanvisor/api-token (the default)"


def test_the_address_given_beats_the_url_variable_beats_host_and_port(
    settings_file: Path,
) -> None:
    env = {
        "SPANVISOR_API_URL": "http://sidecar.internal:7000/",
        "SPANVISOR_API_PORT": "6001",
        "SPANVISOR_CONFIG": str(settings_file),
    }

    given = resolve_access("http://127.0.0.1:9000", environ=env)
    variable = resolve_access(environ=env)
    env.pop("SPANVISOR_API_URL")
    mixed = resolve_access(environ=env)
    env.pop("SPANVISOR_API_PORT")
    from_file = resolve_access(environ=env)

    assert (given.url, given.url_from) == ("http://127.0.0.1:9000", "from --api")
    assert (variable.url, variable.url_from) == (
        "http://sidecar.internal:7000",
        "from SPANVISOR_API_URL",
    )
    # api_host and api_port key by key, as the sidecar reads them: the variable over the file.
    label = f"the settings file {settings_file} (SPANVISOR_CONFIG)"
    assert (mixed.url, mixed.url_from) == (
        "http://10.1.2.3:6001",
        f"host from api_host in {label}, port from SPANVISOR_API_PORT",
    )
    assert (from_file.url, from_file.url_from) == (
        "http://10.1.2.3:5001",
        f"host from api_host in {label}, port from api_port in {label}",
    )


def test_the_port_variable_alone_keeps_working() -> None:
    access = resolve_access(environ={"SPANVISOR_API_PORT": "4400"})

    assert (access.url, access.url_from) == (
        "http://127.0.0.1:4400",
        "port from SPANVISOR_API_PORT",
    )


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:4320"),  # a bind address, reached on loopback
        ("::", "http://[::1]:4320"),
        ("::1", "http://[::1]:4320"),
        ("sidecar.local", "http://sidecar.local:4320"),
    ],
)
def test_a_host_the_sidecar_binds_to_is_one_a_client_can_reach(host: str, url: str) -> None:
    assert resolve_access(environ={"SPANVISOR_API_HOST": host}).url == url


def test_the_config_flag_beats_the_config_variable(settings_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("api_port: 5999\n")

    access = resolve_access(config=settings_file, environ={"SPANVISOR_CONFIG": str(other)})

    assert access.url == "http://10.1.2.3:5001"
    assert f"{settings_file} (--config)" in access.url_from


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SPANVISOR_API_PORT": "forty"}, "SPANVISOR_API_PORT: 'forty' is not a port number"),
        ({"SPANVISOR_API_PORT": "70000"}, "SPANVISOR_API_PORT: '70000' is not a port number"),
        ({"SPANVISOR_API_PORT": "0"}, "SPANVISOR_API_PORT: port 0 has the sidecar pick"),
        ({"SPANVISOR_API_URL": "127.0.0.1:4320"}, "SPANVISOR_API_URL: '127.0.0.1:4320' is not"),
        ({"SPANVISOR_API_URL": "http://h:port"}, "SPANVISOR_API_URL: 'http://h:port' has no"),
        ({"SPANVISOR_CONFIG": "/nonexistent/spanvisor.yaml"}, "(SPANVISOR_CONFIG): cannot read"),
    ],
)
def test_a_value_that_cannot_be_used_is_an_error_naming_where_it_came_from(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_access(environ=env)

    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("api_port: [1]\n", "api_port in the settings file"),
        ("api_port: true\n", "True is not a port number"),
        ("- a list\n", "must be a mapping"),
        ("api_port: [\n", "not valid YAML"),
    ],
)
def test_a_settings_file_that_cannot_be_used_is_named(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)

    with pytest.raises(ConfigError) as caught:
        resolve_access(config=path, environ={})

    assert str(path) in str(caught.value)
    assert problem in str(caught.value)


def test_the_token_given_beats_the_variable_beats_the_settings_file_beats_the_token_file(
    settings_file: Path, tmp_path: Path
) -> None:
    file_token = tmp_path / "variable.token"
    file_token.write_text("variable-file-token")
    env = {
        "SPANVISOR_API_TOKEN": "variable-token",
        "SPANVISOR_CONFIG": str(settings_file),
        "SPANVISOR_TOKEN_FILE": str(file_token),
    }
    with_api_token = tmp_path / "with-token.yaml"
    with_api_token.write_text("api_token: settings-token\n")

    assert resolve_access(token="given", environ=env).token_from == "given by --token"
    assert resolve_access(environ=env).token == "variable-token"
    env.pop("SPANVISOR_API_TOKEN")
    assert resolve_access(config=with_api_token, environ=env).token == "settings-token"
    # The token file: the variable naming it over the settings file's token_file.
    assert resolve_access(environ=env).token == "variable-file-token"
    env.pop("SPANVISOR_TOKEN_FILE")
    access = resolve_access(environ=env)
    assert access.token == "settings-file-token"
    assert access.token_file == tmp_path / "from-settings.token"
    assert access.token_file_from == (
        f"token_file in the settings file {settings_file} (SPANVISOR_CONFIG)"
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [(None, "No such file or directory"), ("  \n", "empty"), (b"\xff\xfe", "not text")],
)
def test_no_token_names_the_file_looked_for_and_why_it_gave_none(
    tmp_path: Path, content: str | bytes | None, problem: str
) -> None:
    path = tmp_path / "not-yet" / "api-token"
    if content is not None:
        path.parent.mkdir()
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    access = resolve_access(environ={"SPANVISOR_TOKEN_FILE": str(path)})

    assert access.token is None
    assert access.missing_token() == (
        "no API token for the sidecar at http://127.0.0.1:4320 (the default address: no --api,"
        " SPANVISOR_API_URL, SPANVISOR_API_HOST, SPANVISOR_API_PORT or settings file names"
        f" another): the token file {path} (SPANVISOR_TOKEN_FILE) gave none: {problem}; the"
        " sidecar writes its token there at start unless api_token is set. Give one with"
        " --token, SPANVISOR_API_TOKEN, or SPANVISOR_TOKEN_FILE naming the sidecar's token file"
    )


def test_the_clients_messages_name_their_own_arguments() -> None:
    access = resolve_access("http://127.0.0.1:1", "t", names=CLIENT, environ={})

    assert access.url_from == "from base_url="
    assert access.token_from == "given by token="
    assert "base_url= URL" in access.unreachable("ConnectError")
    assert "--api" not in access.unreachable("ConnectError")
    assert "--api URL" in resolve_access(names=CLI, environ={}).unreachable("ConnectError")


def test_the_sidecar_takes_the_clients_variables_for_no_misspelt_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPANVISOR_API_URL", "http://127.0.0.1:4320")
    monkeypatch.setenv("SPANVISOR_CONFIG", "/etc/spanvisor.yaml")

    with caplog.at_level(logging.WARNING, logger="spanvisor.settings"):
        load_settings()

    assert caplog.text == ""


def test_spanvisor_run_reads_the_settings_file_the_clients_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from supervisor.cli.verbs import main

    config = tmp_path / "spanvisor.yaml"
    config.write_text("otlp_grpc_port: not-a-port\n")
    monkeypatch.setenv("SPANVISOR_CONFIG", str(config))
    monkeypatch.setenv("SPANVISOR_API_PORT", "not-a-port")  # so that `run` never starts

    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert f"{config}: otlp_grpc_port: Input should be a valid integer" in err
    assert "SPANVISOR_API_PORT: api_port: Input should be a valid integer" in err
