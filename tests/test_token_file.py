"""The generated control-API token: a file only its user can read, never written through a link."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from policies import load_policy
from supervisor.api.server import ensure_token
from supervisor.errors import ConfigError
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_token_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "api-token"
    token = ensure_token(None, path)
    assert path.read_text() == token + "\n"
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["api-token"]  # no temporary left


def test_a_configured_token_writes_nothing(tmp_path: Path) -> None:
    assert ensure_token("configured-token", tmp_path / "api-token") == "configured-token"
    assert not (tmp_path / "api-token").exists()


def test_a_world_readable_token_file_is_replaced_by_a_private_one_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "api-token"
    path.write_text("old\n")
    path.chmod(0o644)
    before = os.stat(path).st_ino
    with caplog.at_level(logging.WARNING, logger="spanvisor.api"):
        token = ensure_token(None, path)
    assert path.read_text() == token + "\n"
    assert mode(path) == 0o600
    # A new file (a new inode): the token was never in the readable one.
    assert os.stat(path).st_ino != before
    assert "readable by others" in caplog.text


def test_a_symlink_at_the_token_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    target.chmod(0o644)
    link = tmp_path / "api-token"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        ensure_token(None, link)
    assert target.read_text() == "precious\n"
    assert link.is_symlink()


def test_a_dangling_symlink_is_refused_too(tmp_path: Path) -> None:
    link = tmp_path / "api-token"
    link.symlink_to(tmp_path / "not-yet")
    with pytest.raises(ConfigError, match="symbolic link"):
        ensure_token(None, link)
    assert not (tmp_path / "not-yet").exists()


def test_a_directory_at_the_token_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "api-token").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        ensure_token(None, tmp_path / "api-token")


def test_the_token_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_token(None, tmp_path / "api-token")
    finally:
        os.umask(old)
    assert mode(tmp_path / "api-token") == 0o600


@pytest.mark.parametrize("token", ["x", "fifteen-chars-x"])
def test_a_short_api_token_beyond_loopback_is_refused(tmp_path: Path, token: str) -> None:
    settings = load_settings(
        overrides={
            "api_host": "0.0.0.0",
            "api_token": token,
            "token_file": str(tmp_path / "token"),
            "state_path": ":memory:",
        }
    )
    with pytest.raises(ConfigError, match="at least 16"):
        build_sidecar(settings, load_policy())
