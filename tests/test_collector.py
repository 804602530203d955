"""Cyclic garbage is collected between batches once the sidecar takes collection over."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from supervisor.collector import Collector


@pytest.fixture
def restore_gc() -> Iterator[None]:
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    if enabled:
        gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _leave_cycles(n: int) -> None:
    for _ in range(n):
        _Cycle()


def test_before_take_over_collection_is_left_to_cpython() -> None:
    collector = Collector(young_threshold=1)
    collector.between_batches()
    collector.tick()
    assert gc.isenabled()
    assert collector.stats().young == 0


def test_taken_over_young_collections_wait_for_the_batch_to_end(restore_gc: None) -> None:
    collector = Collector(young_threshold=1_000)
    collector.take_over()
    assert not gc.isenabled()  # nothing collects in the middle of a batch
    _leave_cycles(2_000)
    assert gc.get_count()[0] >= 1_000
    collector.between_batches()
    assert gc.get_count()[0] < 1_000
    for _ in range(2):
        _leave_cycles(2_000)
        collector.between_batches()
    stats = collector.stats()
    assert (stats.managed, stats.young) == (True, 3)
    assert stats.max_young_pause_ms >= 0


def test_few_allocations_wait_for_the_timer(restore_gc: None) -> None:
    collector = Collector(young_threshold=1_000_000)
    collector.take_over()
    _leave_cycles(10)
    collector.between_batches()
    assert collector.stats().young == 0
    collector.tick()  # an idle loop still collects what was left
    assert collector.stats().young == 1


def test_full_collections_find_what_young_ones_left(restore_gc: None) -> None:
    collector = Collector()
    collector.take_over()
    _leave_cycles(5)
    assert collector.full() >= 5
    stats = collector.stats()
    assert stats.full == 1
    assert stats.last_full_ms is not None


def test_time_in_collections_is_summed(restore_gc: None) -> None:
    readings = iter([0.0, 0.002, 1.0, 1.005, 2.0, 2.1])  # start and end of each collection
    collector = Collector(young_threshold=1, clock=lambda: next(readings))
    collector.take_over()
    for _ in range(2):
        _leave_cycles(5)
        collector.between_batches()
    collector.full()
    stats = collector.stats()
    assert (stats.young, stats.full) == (2, 1)
    assert stats.young_total_ms == pytest.approx(7.0)
    assert stats.max_young_pause_ms == pytest.approx(5.0)
    assert stats.full_total_ms == pytest.approx(100.0)
    assert stats.last_full_ms == pytest.approx(100.0)
