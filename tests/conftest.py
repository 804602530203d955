"""Shared test set-up: each test keeps its state in files of its own."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's sidecars keep their incidents and commands in a file of their own.

    The default (``~/.spanvisor/state.db``) would let one test's stored
    incidents make another's commands look like duplicates.
    """
    monkeypatch.setenv("SPANVISOR_STATE_PATH", str(tmp_path / "state.db"))
    monkeypatch.setenv("SPANVISOR_TOKEN_FILE", str(tmp_path / "api-token"))
