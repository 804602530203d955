"""Settings from the environment: every key a SPANVISOR_* variable, in the documented order."""

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
