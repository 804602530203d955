"""Shared test set-up: refuse to test stale compiled modules."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """A mypyc build (setup.py) shadows the sources it was built from: after an
    edit, the tests would run the old code. Stop and say how to rebuild."""
    stale = []
    for compiled in (*ROOT.glob("supervisor/**/*.so"), *ROOT.glob("policies/**/*.so")):
        source = compiled.with_name(compiled.name.split(".", 1)[0] + ".py")
        if source.exists() and source.stat().st_mtime > compiled.stat().st_mtime:
            stale.append(str(source.relative_to(ROOT)))
    if stale:
        pytest.exit(
            "compiled modules are older than their sources ("
            + ", ".join(stale)
            + "): rebuild with SPANVISOR_COMPILE=1 pip install --no-build-isolation -e . "
            "or delete the .so files",
            returncode=4,
        )


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's sidecars keep their incidents and commands in a file of their own.

    The default (``~/.spanvisor/state.db``) would let one test's stored
    incidents make another's commands look like duplicates.
    """
    monkeypatch.setenv("SPANVISOR_STATE_PATH", str(tmp_path / "state.db"))
    monkeypatch.setenv("SPANVISOR_TOKEN_FILE", str(tmp_path / "api-token"))
