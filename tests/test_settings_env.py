"""Settings from arguments, SPANVISOR_* variables and the settings file, in the documented order."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from supervisor.errors import ConfigError
from supervisor.settings import load_settings


def test_a_mapping_setting_is_json_in_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANVISOR_AGENTS", '{"research-agent": {"pull": {"visibility_s": 30}}}')

    settings = load_settings()

    assert settings.agents["research-agent"].pull is not None
    assert settings.agents["research-agent"].pull.visibility_s == 30


def test_bad_json_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANVISOR_AGENTS", '{"research-agent": ')

    with pytest.raises(ConfigError, match="SPANVISOR_AGENTS: not valid JSON"):
        load_settings()


def test_a_nested_variable_overrides_one_key_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "spanvisor.yaml"
    config.write_text(
        "downstream:\n  endpoint: http://from-file:4318/v1/traces\n  compression: gzip\n"
    )
    monkeypatch.setenv("SPANVISOR_DOWNSTREAM__ENDPOINT", "http://from-env:4318/v1/traces")

    downstream = load_settings(config).downstream

    # The environment comes before the file, key by key.
    assert downstream is not None
    assert (downstream.endpoint, downstream.compression) == (
        "http://from-env:4318/v1/traces",
        "gzip",
    )


def test_a_misspelt_variable_is_logged_not_silently_ignored(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPANVISOR_BREAKER_REDIS_URI", "redis://127.0.0.1:6379")
    monkeypatch.setenv("SPANVISOR_LLM_API_KEY", "sk-not-a-setting-but-known")

    with caplog.at_level(logging.WARNING, logger="spanvisor.settings"):
        settings = load_settings()

    assert settings.breaker_redis_url is None
    assert "SPANVISOR_BREAKER_REDIS_URI" in caplog.text
    assert "SPANVISOR_LLM_API_KEY" not in caplog.text


def test_arguments_come_before_variables_before_the_file_before_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "spanvisor.yaml"
    config.write_text("api_port: 5001\notlp_http_port: 5002\notlp_grpc_port: 5003\n")
    monkeypatch.setenv("SPANVISOR_API_PORT", "6001")
    monkeypatch.setenv("SPANVISOR_OTLP_HTTP_PORT", "6002")

    settings = load_settings(config, {"api_port": 7001, "otlp_grpc_port": None})

    assert (settings.api_port, settings.otlp_http_port, settings.otlp_grpc_port) == (
        7001,  # the argument
        6002,  # the variable, over the file
        5003,  # the file: an argument of None is no argument
    )
    assert settings.api_host == "127.0.0.1"  # the default


def test_a_home_relative_path_is_the_users_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANVISOR_STATE_PATH", "~/spanvisor/state.db")

    assert load_settings().state_path == Path.home() / "spanvisor" / "state.db"


def test_a_misspelt_variable_is_logged_once_with_the_closest_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPANVISOR_API_PROT", "9999")
    monkeypatch.setenv("SPANVISOR_QWXZ", "1")

    with caplog.at_level(logging.WARNING, logger="spanvisor.settings"):
        settings = load_settings()

    assert settings.api_port == 4320
    typo = [r.getMessage() for r in caplog.records if "SPANVISOR_API_PROT" in r.getMessage()]
    assert len(typo) == 1
    assert "did you mean SPANVISOR_API_PORT?" in typo[0]
    unrelated = [r.getMessage() for r in caplog.records if "SPANVISOR_QWXZ" in r.getMessage()]
    assert len(unrelated) == 1
    assert "did you mean" not in unrelated[0]


def test_a_bad_variable_is_named_with_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "spanvisor.yaml"
    config.write_text("api_port: 5001\n")
    monkeypatch.setenv("SPANVISOR_API_PORT", "not-a-port")

    with pytest.raises(ConfigError) as caught:
        load_settings(config)

    assert "SPANVISOR_API_PORT: api_port: Input should be a valid integer" in str(caught.value)
    assert str(config) not in str(caught.value)


def test_a_bad_nested_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANVISOR_AGENTS__BILLING__PULL__TTL_S", "-1")

    with pytest.raises(ConfigError) as caught:
        load_settings()

    assert "SPANVISOR_AGENTS__BILLING__PULL__TTL_S: agents.billing.pull.ttl_s:" in str(caught.value)


def test_a_bad_value_in_the_file_names_the_file_and_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "spanvisor.yaml"
    config.write_text("agents:\n  research-agent:\n    webhook:\n      url: ftp://agent\n")
    monkeypatch.setenv("SPANVISOR_API_PORT", "4400")  # good: not mentioned

    with pytest.raises(ConfigError) as caught:
        load_settings(config)

    message = str(caught.value)
    assert f"{config}: agents.research-agent.webhook.url: String should match" in message
    assert "SPANVISOR_" not in message


def test_a_missing_key_is_blamed_on_the_variable_that_began_its_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPANVISOR_DOWNSTREAM__COMPRESSION", "gzip")

    with pytest.raises(ConfigError) as caught:
        load_settings()

    assert "SPANVISOR_DOWNSTREAM__COMPRESSION: downstream.endpoint: Field required" in str(
        caught.value
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (None, "cannot read settings file: no such file"),
        ("agents: [\n", "not valid YAML"),
        ("- api_port\n", "must be a mapping"),
    ],
)
def test_a_settings_file_that_cannot_be_used_is_named(
    tmp_path: Path, text: str | None, problem: str
) -> None:
    config = tmp_path / "spanvisor.yaml"
    if text is not None:
        config.write_text(text)

    with pytest.raises(ConfigError, match=problem) as caught:
        load_settings(config)

    assert str(caught.value).startswith(f"{config}: ")
