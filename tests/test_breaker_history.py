"""Each breaker's recent changes, as the operator console reads them: stamped on the wall
clock, bounded per dependency and in dependencies, and never claiming what was dropped."""

from __future__ import annotations

import pytest

from policies._breakers import BreakerBoard, BreakerChange, BreakerSettings, BreakerState
from supervisor.forward.breaker_history import BreakerHistory, Segment, Transition

T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def change(dependency: str, old: BreakerState, new: BreakerState) -> BreakerChange:
    return BreakerChange(dependency, old, new, "failures", at=12.5, failures=3)  # monotonic


CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def test_a_real_boards_changes_are_kept_on_the_wall_clock_and_cut_the_window_into_states() -> None:
    wall = Clock(T0)
    history = BreakerHistory(clock=wall)
    monotonic = Clock(100.0)
    board = BreakerBoard(
        BreakerSettings(fail_max=2, reset_timeout_s=30.0, success_threshold=1),
        on_change=history,
        clock=monotonic,
    )
    wall.now += 600
    board.record("tool:search", ok=False)
    board.record("tool:search", ok=False)  # opens
    wall.now += 60
    monotonic.now += 30
    assert board.state("tool:search") is BreakerState.HALF_OPEN
    wall.now += 60
    board.record("tool:search", ok=True)  # closes

    found = history.timeline("tool:search", "closed", T0, T0 + 3600)
    assert found.transitions == (
        Transition(T0 + 600, "closed", "open", "failures"),
        Transition(T0 + 660, "open", "half_open", "reset_timeout"),
        Transition(T0 + 720, "half_open", "closed", "trial_succeeded"),
    )
    assert found.segments() == (
        Segment(T0, T0 + 600, "closed"),
        Segment(T0 + 600, T0 + 660, "open"),
        Segment(T0 + 660, T0 + 720, "half_open"),
        Segment(T0 + 720, T0 + 3600, "closed"),
    )


def test_before_the_history_began_nothing_is_known() -> None:
    history = BreakerHistory(clock=Clock(T0 + 100))
    found = history.timeline("tool:quiet", "open", T0, T0 + 1000)
    assert found.segments() == (
        Segment(T0, T0 + 100, "unknown"),
        Segment(T0 + 100, T0 + 1000, "open"),
    )


def test_each_dependency_keeps_its_last_changes_and_knows_from_the_oldest_dropped() -> None:
    wall = Clock(T0)
    history = BreakerHistory(clock=wall, per_dependency=3)
    for n in range(10):
        wall.now = T0 + 10 * (n + 1)
        old, new = (CLOSED, OPEN) if n % 2 == 0 else (OPEN, CLOSED)
        history(change("tool:a", old, new))

    found = history.timeline("tool:a", "closed", T0, T0 + 200)
    assert [t.at for t in found.transitions] == [T0 + 80, T0 + 90, T0 + 100]
    assert found.known_since == T0 + 70  # the newest change dropped
    assert found.segments()[0] == Segment(T0, T0 + 70, "unknown")
    assert found.segments()[1] == Segment(T0 + 70, T0 + 80, "open")
    assert history.recorded == 10


def test_dependencies_are_bounded_and_a_dropped_ones_past_is_unknown_for_all() -> None:
    wall = Clock(T0)
    history = BreakerHistory(clock=wall, max_dependencies=2)
    for n, name in enumerate(["tool:a", "tool:b", "tool:a", "tool:c"]):
        wall.now = T0 + n + 1
        history(change(name, CLOSED, OPEN))

    assert len(history) == 2
    dropped = history.timeline("tool:b", "open", T0, T0 + 10)
    assert (dropped.transitions, dropped.known_since) == ((), T0 + 2)
    kept = history.timeline("tool:a", "open", T0, T0 + 10)
    assert [t.at for t in kept.transitions] == [T0 + 1, T0 + 3]
    assert kept.known_since == T0 + 2  # what else was dropped with b is not known


def test_changes_outside_the_window_are_left_out_and_bounds_are_checked() -> None:
    wall = Clock(T0)
    history = BreakerHistory(clock=wall)
    wall.now = T0 + 5
    history(change("tool:a", CLOSED, OPEN))
    later = history.timeline("tool:a", "open", T0 + 10, T0 + 20)
    assert later.transitions == ()
    assert later.segments() == (Segment(T0 + 10, T0 + 20, "open"),)
    with pytest.raises(ValueError, match="at least one"):
        BreakerHistory(per_dependency=0)
