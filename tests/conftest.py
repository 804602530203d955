"""Shared test set-up: each test keeps its state in files of its own."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_server import RedisProxy, fresh_namespace, redis_client


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's sidecars keep their incidents and commands in a file of their own.

    The default (``~/.spanvisor/state.db``) would let one test's stored
    incidents make another's commands look like duplicates.
    """
    monkeypatch.setenv("SPANVISOR_STATE_PATH", str(tmp_path / "state.db"))
    monkeypatch.setenv("SPANVISOR_TOKEN_FILE", str(tmp_path / "api-token"))


#: What a fixture wants done when its test fails, while the test's fixtures still
#: live; each callback returns text for the failure's report (tests/browser.py
#: screenshots the test's pages).
ON_FAILURE = pytest.StashKey[list[Callable[[], str]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        for callback in item.stash.get(ON_FAILURE, []):
            report.sections.append(("on failure", callback()))
    return report


# -- Redis (tests/redis_server.py): a client, a namespace of one's own, a proxy to cut ----------


@pytest.fixture
def direct() -> Iterator[Any]:
    """A client of the machine's Redis, for a test to look at what sidecars wrote."""
    with redis_client() as client:
        yield client


@pytest.fixture
def namespace(direct: Any) -> Iterator[str]:
    """A Redis namespace no other test uses, emptied afterwards."""
    with fresh_namespace(direct) as name:
        yield name


@pytest.fixture
def proxy() -> Iterator[RedisProxy]:
    """A TCP proxy in front of Redis that a test can cut and restore."""
    found = RedisProxy()
    yield found
    found.close()
