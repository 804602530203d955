"""The store writer stores batches in order on its own thread and hands commands back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from supervisor.act.actor import Actor
from supervisor.act.store import NewIncident, Store, StoredCommand
from supervisor.act.store_writer import StoreWriter
from supervisor.records import Action
from supervisor.settings import AgentDelivery, PullChannel
from tests.test_api import _outcome


def test_batches_are_stored_off_the_loop_and_announced_on_it(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    actor = Actor(store, {"agent": AgentDelivery(pull=PullChannel())})
    writer = StoreWriter(actor, capacity=2)

    async def scenario() -> bool:
        event = actor.waiters.event("agent")
        writer.start(asyncio.get_running_loop())
        for n in range(5):  # more than the queue holds: put waits, nothing is dropped
            writer.put([_outcome(Action.ESCALATE, span=f"{n:016x}")])
        await asyncio.wait_for(event.wait(), timeout=5)  # announced on the loop
        await asyncio.to_thread(writer.close, 5.0)
        return event.is_set()

    assert asyncio.run(scenario())
    assert (writer.stored, writer.errors) == (5, 0)
    assert len(store.incidents()) == 5
    assert store.counts()["pending"] == 5
    store.close()


def test_batches_queued_meanwhile_share_one_transaction(tmp_path: Path) -> None:
    release = threading.Event()
    transactions: list[list[str]] = []

    class SlowStore(Store):
        def record(self, incidents: Iterable[NewIncident], now: float) -> list[StoredCommand]:
            batch = list(incidents)
            transactions.append([incident.span_id for incident in batch])
            release.wait(5)  # the first transaction holds the writer while more queue up
            return super().record(batch, now)

    store = SlowStore.open(tmp_path / "state.db")
    writer = StoreWriter(Actor(store, {}), capacity=8)

    async def scenario() -> None:
        writer.start(asyncio.get_running_loop())
        for n in range(5):
            writer.put([_outcome(Action.RETRY, span=f"{n:016x}")])
        release.set()
        await asyncio.to_thread(writer.close, 5.0)

    asyncio.run(scenario())
    spans = [f"{n:016x}" for n in range(5)]
    assert [span for batch in transactions for span in batch] == spans  # in order, all
    assert len(transactions) < 5  # the four that waited were merged (one or more)
    assert (writer.stored, writer.errors) == (5, 0)
    assert len(store.incidents()) == 5
    store.close()


def test_under_load_commits_are_spaced_and_batches_wait_for_the_next_one(tmp_path: Path) -> None:
    transactions: list[list[str]] = []
    first_stored = threading.Event()

    class RecordingStore(Store):
        def record(self, incidents: Iterable[NewIncident], now: float) -> list[StoredCommand]:
            batch = list(incidents)
            transactions.append([incident.span_id for incident in batch])
            return super().record(batch, now)

    store = RecordingStore.open(tmp_path / "state.db")
    # An interval no test run outlasts: the batches after the first wait for close().
    writer = StoreWriter(
        Actor(store, {}),
        min_commit_interval_s=60.0,
        after_store=lambda _: first_stored.set(),
    )

    async def scenario() -> int:
        writer.start(asyncio.get_running_loop())
        writer.put([_outcome(Action.RETRY, span=f"{0:016x}")])
        # The first batch after a quiet spell is stored at once.
        assert await asyncio.to_thread(first_stored.wait, 5.0)
        for n in range(1, 4):
            writer.put([_outcome(Action.RETRY, span=f"{n:016x}")])
        waiting = writer.backlog  # held for the next commit, and counted
        await asyncio.to_thread(writer.close, 5.0)  # stores what waits at once
        return waiting

    assert asyncio.run(scenario()) == 3
    assert transactions == [[f"{0:016x}"], [f"{n:016x}" for n in range(1, 4)]]
    assert writer.backlog == 0
    store.close()


def test_a_negative_commit_interval_is_refused(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    with pytest.raises(ValueError, match="min_commit_interval_s"):
        StoreWriter(Actor(store, {}), min_commit_interval_s=-1.0)
    store.close()
