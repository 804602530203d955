"""BreakerBoard: pybreaker's state machine, driven by observed outcomes and a fake clock."""

from __future__ import annotations

import gc
import logging
import types
import uuid
from dataclasses import dataclass, field

import pybreaker
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies._breakers import (
    BreakerBoard,
    BreakerChange,
    BreakerInfo,
    BreakerSettings,
    BreakerState,
)

CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN
ISOLATED = BreakerState.ISOLATED

DEP = "openai:gpt-4o"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def board(
    fail_max: int = 3,
    reset_timeout_s: float = 30.0,
    success_threshold: int = 2,
    **kwargs: object,
) -> tuple[BreakerBoard, FakeClock, list[BreakerChange]]:
    clock = FakeClock()
    changes: list[BreakerChange] = []
    result = BreakerBoard(
        BreakerSettings(fail_max, reset_timeout_s, success_threshold),
        clock=clock,
        on_change=changes.append,
        **kwargs,  # type: ignore[arg-type]
    )
    return result, clock, changes


def summary(changes: list[BreakerChange]) -> list[tuple[str, str, str, float, int]]:
    return [(c.old.value, c.new.value, c.reason, c.at, c.failures) for c in changes]


# -- settings ---------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    assert BreakerSettings() == BreakerSettings(
        fail_max=5, reset_timeout_s=30.0, success_threshold=2
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fail_max": 0}, "fail_max must be between 1 and 10000, got 0"),
        ({"fail_max": 10_001}, "fail_max must be between 1 and 10000"),
        ({"fail_max": 2.0}, "fail_max must be an integer"),
        ({"fail_max": True}, "fail_max must be an integer"),
        ({"success_threshold": 0}, "success_threshold must be between 1 and 10000"),
        ({"success_threshold": -1}, "success_threshold must be between 1 and 10000"),
        ({"reset_timeout_s": 0}, "reset_timeout_s must be more than 0"),
        ({"reset_timeout_s": -1.0}, "reset_timeout_s must be more than 0"),
        ({"reset_timeout_s": 86_400.5}, "at most 86400 seconds"),
        ({"reset_timeout_s": float("nan")}, "reset_timeout_s must be more than 0"),
        ({"reset_timeout_s": float("inf")}, "reset_timeout_s must be more than 0"),
        ({"reset_timeout_s": "30"}, "reset_timeout_s must be a number of seconds"),
    ],
)
def test_settings_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BreakerSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_extremes_are_accepted() -> None:
    BreakerSettings(fail_max=1, reset_timeout_s=1e-9, success_threshold=1)
    BreakerSettings(fail_max=10_000, reset_timeout_s=86_400, success_threshold=10_000)


def test_max_breakers_validation() -> None:
    with pytest.raises(ValueError, match="max_breakers must be at least 1"):
        BreakerBoard(max_breakers=0)


# -- the state machine ------------------------------------------------------------------------


def test_unknown_dependency_is_closed_and_not_created() -> None:
    b, _, changes = board()
    assert b.state("tool:search") is CLOSED
    assert b.info("tool:search") == BreakerInfo("tool:search", CLOSED, 0, None, None)
    assert len(b) == 0
    assert b.snapshot() == []
    assert changes == []


def test_consecutive_failures_open_and_a_success_resets_the_count() -> None:
    b, clock, changes = board(fail_max=3)
    assert b.record(DEP, False) is CLOSED
    assert b.record(DEP, False) is CLOSED
    assert b.info(DEP).failures == 2
    assert b.record(DEP, True) is CLOSED
    assert b.info(DEP).failures == 0
    assert b.record(DEP, False) is CLOSED
    assert b.record(DEP, False) is CLOSED
    assert changes == []
    clock.now = 1005.0
    assert b.record(DEP, False) is OPEN
    assert summary(changes) == [("closed", "open", "failures", 1005.0, 3)]
    assert b.snapshot() == [BreakerInfo(DEP, OPEN, 3, 1005.0, 1035.0)]


def test_counted_failures_leave_no_garbage_for_the_cycle_collector() -> None:
    """pybreaker re-raises each failure from a frame that holds it: a cycle per failure."""
    b, clock, _ = board(fail_max=3, success_threshold=1)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to look at
    try:
        for n in range(30):  # failures counted, trips (CircuitBreakerError), trials
            clock.now = 1000.0 + 40.0 * n
            b.record(DEP, False)
            b.record(DEP, n % 3 == 0)
        gc.collect()
        # Only the breakers' own: another test's threads may still make garbage meanwhile.
        ours = [o for o in gc.garbage if _from_breakers(o)]
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _from_breakers(found: object) -> bool:
    """An exception, traceback or frame of pybreaker's or the board's making."""
    if isinstance(found, BaseException):
        found = found.__traceback__
    if isinstance(found, types.TracebackType):
        found = found.tb_frame
    if not isinstance(found, types.FrameType):
        return False
    where = found.f_code.co_filename
    return "pybreaker" in where or where.endswith("_breakers.py")


def test_outcomes_while_open_are_ignored() -> None:
    b, clock, changes = board(fail_max=2)
    b.record(DEP, False)
    b.record(DEP, False)
    clock.now += 29.999
    for ok in (True, False, True, True, False):
        assert b.record(DEP, ok) is OPEN
    assert b.info(DEP) == BreakerInfo(DEP, OPEN, 2, 1000.0, 1030.0)
    assert len(changes) == 1


def test_half_open_exactly_at_the_reset_timeout_seen_by_state() -> None:
    b, clock, changes = board(fail_max=1, reset_timeout_s=30.0)
    b.record(DEP, False)
    clock.now = 1029.999999
    assert b.state(DEP) is OPEN
    clock.now = 1030.0
    assert b.state(DEP) is HALF_OPEN
    assert b.state(DEP) is HALF_OPEN  # reported once
    assert summary(changes) == [
        ("closed", "open", "failures", 1000.0, 1),
        ("open", "half_open", "reset_timeout", 1030.0, 1),
    ]
    assert b.info(DEP) == BreakerInfo(DEP, HALF_OPEN, 1, 1000.0, None)


def test_half_open_closes_after_success_threshold_successes() -> None:
    b, clock, changes = board(fail_max=1, success_threshold=3)
    b.record(DEP, False)
    clock.now += 30
    assert b.record(DEP, True) is HALF_OPEN  # the timeout is checked in record() too
    assert b.record(DEP, True) is HALF_OPEN
    assert b.record(DEP, True) is CLOSED
    assert summary(changes) == [
        ("closed", "open", "failures", 1000.0, 1),
        ("open", "half_open", "reset_timeout", 1030.0, 1),
        ("half_open", "closed", "trial_succeeded", 1030.0, 0),
    ]
    assert b.info(DEP) == BreakerInfo(DEP, CLOSED, 0, None, None)
    # Closed again: it takes fail_max fresh failures to open.
    assert b.record(DEP, False) is OPEN


def test_one_failed_trial_reopens_with_a_new_opened_at() -> None:
    b, clock, changes = board(fail_max=2, success_threshold=2)
    b.record(DEP, False)
    b.record(DEP, False)
    clock.now = 1031.0
    assert b.record(DEP, True) is HALF_OPEN
    clock.now = 1032.0
    assert b.record(DEP, False) is OPEN
    assert summary(changes)[-2:] == [
        ("open", "half_open", "reset_timeout", 1031.0, 2),
        ("half_open", "open", "trial_failed", 1032.0, 1),
    ]
    assert b.info(DEP) == BreakerInfo(DEP, OPEN, 1, 1032.0, 1062.0)
    clock.now = 1061.9
    assert b.state(DEP) is OPEN
    clock.now = 1062.0
    assert b.state(DEP) is HALF_OPEN


def test_failed_first_trial_keeps_counting() -> None:
    # pybreaker keeps the count that tripped the breaker until a success.
    b, clock, changes = board(fail_max=2)
    b.record(DEP, False)
    b.record(DEP, False)
    clock.now += 30
    assert b.record(DEP, False) is OPEN
    assert summary(changes)[-1] == ("half_open", "open", "trial_failed", 1030.0, 3)


def test_success_threshold_one_goes_open_to_closed_in_one_record() -> None:
    b, clock, changes = board(fail_max=1, success_threshold=1)
    b.record(DEP, False)
    clock.now += 30
    assert b.record(DEP, True) is CLOSED
    assert [c.reason for c in changes] == ["failures", "reset_timeout", "trial_succeeded"]


def test_pybreaker_wall_clock_never_holds_a_transition() -> None:
    # A day-long reset timeout: pybreaker's datetime.now() check would refuse for a day.
    b, clock, _ = board(fail_max=1, reset_timeout_s=86_400, success_threshold=1)
    b.record(DEP, False)
    clock.now += 86_400
    assert b.record(DEP, True) is CLOSED


def test_isolate_holds_open_until_close() -> None:
    b, clock, changes = board(fail_max=3)
    b.record(DEP, False)
    assert b.isolate(DEP) is True
    assert b.isolate(DEP) is True  # already isolated: no change
    assert b.state(DEP) is ISOLATED
    clock.now += 10_000_000
    for ok in (True, True, True, False):
        assert b.record(DEP, ok) is ISOLATED
    assert b.info(DEP) == BreakerInfo(DEP, ISOLATED, 1, 1000.0, None)
    b.close(DEP)
    assert b.state(DEP) is CLOSED
    assert b.info(DEP) == BreakerInfo(DEP, CLOSED, 0, None, None)
    assert summary(changes) == [
        ("closed", "isolated", "isolated", 1000.0, 1),
        ("isolated", "closed", "closed_manually", 10_001_000.0, 0),
    ]


def test_isolate_an_open_breaker_then_close_it() -> None:
    b, clock, changes = board(fail_max=1)
    b.record(DEP, False)
    clock.now += 5
    b.isolate(DEP)
    assert b.info(DEP) == BreakerInfo(DEP, ISOLATED, 1, 1000.0, None)
    clock.now += 100
    b.close(DEP)
    assert summary(changes) == [
        ("closed", "open", "failures", 1000.0, 1),
        ("open", "isolated", "isolated", 1005.0, 1),
        ("isolated", "closed", "closed_manually", 1105.0, 0),
    ]
    assert b.record(DEP, False) is OPEN  # counts start again from zero


def test_isolate_unknown_dependency_creates_it() -> None:
    b, _, changes = board()
    assert b.isolate("tool:search") is True
    assert b.state("tool:search") is ISOLATED
    assert summary(changes) == [("closed", "isolated", "isolated", 1000.0, 0)]


def test_close_resets_counts_and_creates_unknown_dependencies_closed() -> None:
    b, clock, changes = board(fail_max=3)
    b.close("tool:new")
    assert len(b) == 1
    assert b.info("tool:new") == BreakerInfo("tool:new", CLOSED, 0, None, None)
    b.record(DEP, False)
    b.record(DEP, False)
    b.close(DEP)  # closed already: counts reset, no change reported
    assert b.info(DEP).failures == 0
    assert changes == []
    b.record(DEP, False)
    b.record(DEP, False)
    b.record(DEP, False)
    clock.now += 1
    b.close(DEP)
    assert summary(changes) == [
        ("closed", "open", "failures", 1000.0, 3),
        ("open", "closed", "closed_manually", 1001.0, 0),
    ]


def test_close_a_half_open_breaker() -> None:
    b, clock, changes = board(fail_max=1)
    b.record(DEP, False)
    clock.now += 30
    b.close(DEP)
    assert [c.reason for c in changes] == ["failures", "reset_timeout", "closed_manually"]
    assert b.state(DEP) is CLOSED


def test_dependencies_are_independent_and_snapshot_is_sorted() -> None:
    b, clock, _ = board(fail_max=1)
    b.record("tool:search", False)
    clock.now += 1
    b.record("http:api.example.com", True)
    b.isolate("anthropic:claude")
    assert b.snapshot() == [
        BreakerInfo("anthropic:claude", ISOLATED, 0, 1001.0, None),
        BreakerInfo("http:api.example.com", CLOSED, 0, None, None),
        BreakerInfo("tool:search", OPEN, 1, 1000.0, 1030.0),
    ]


def test_snapshot_reports_the_reset_timeout() -> None:
    b, clock, changes = board(fail_max=1)
    b.record(DEP, False)
    clock.now += 30
    assert b.snapshot() == [BreakerInfo(DEP, HALF_OPEN, 1, 1000.0, None)]
    assert changes[-1].reason == "reset_timeout"


def test_settings_per_dependency() -> None:
    def settings_for(dependency: str) -> BreakerSettings:
        if dependency.startswith("tool:"):
            return BreakerSettings(fail_max=1, reset_timeout_s=5)
        return BreakerSettings(fail_max=10)

    seen: list[str] = []

    def recording(dependency: str) -> BreakerSettings:
        seen.append(dependency)
        return settings_for(dependency)

    clock = FakeClock()
    b = BreakerBoard(recording, clock=clock)
    assert b.record("tool:search", False) is OPEN
    for _ in range(9):
        assert b.record(DEP, False) is CLOSED
    assert b.record(DEP, False) is OPEN
    assert b.info("tool:search").reopens_at == 1005.0
    assert seen == ["tool:search", DEP]  # read once, when the breaker is made


def test_settings_for_must_return_settings() -> None:
    b = BreakerBoard(lambda _dependency: None, clock=FakeClock())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must be BreakerSettings"):
        b.record(DEP, False)
    assert len(b) == 0


def test_default_settings_and_clock() -> None:
    b = BreakerBoard()
    for _ in range(4):
        assert b.record(DEP, False) is CLOSED
    assert b.record(DEP, False) is OPEN
    info = b.info(DEP)
    assert info.opened_at is not None
    assert info.reopens_at == info.opened_at + 30.0


# -- bounds -----------------------------------------------------------------------------------


def test_full_board_evicts_the_lru_closed_breaker_without_failures() -> None:
    b, _, _ = board(fail_max=1, max_breakers=3)
    b.record("a", True)
    b.record("b", True)
    b.record("c", True)
    b.state("a")  # reading counts as use: "b" is now the least recently used
    b.record("d", True)
    assert b.evictions == 1
    assert [i.dependency for i in b.snapshot()] == ["a", "c", "d"]


def test_full_board_keeps_breakers_with_failures_open_or_isolated() -> None:
    b, _, changes = board(fail_max=2, max_breakers=3)
    b.record("failing", False)  # closed, one failure
    b.record("open", False)
    b.record("open", False)
    b.isolate("isolated")
    assert b.record("new", False) is CLOSED  # not tracked: reads as closed
    assert b.record("new", False) is CLOSED
    assert b.isolate("new2") is False
    b.close("new3")
    assert b.state("new") is CLOSED
    assert len(b) == 3
    assert b.evictions == 0
    assert b.untracked == 4
    assert [c.dependency for c in changes] == ["open", "isolated"]
    # Once one recovers (a success resets its count), it can make room.
    b.record("failing", True)
    assert b.record("new", False) is CLOSED
    assert b.record("new", False) is OPEN
    assert b.evictions == 1
    assert "failing" not in [i.dependency for i in b.snapshot()]


def test_many_dependencies_stay_bounded() -> None:
    b, _, _ = board(max_breakers=50)
    for n in range(1000):
        b.record(f"tool:{n}", True)
    assert len(b) == 50
    assert b.evictions == 950
    assert b.untracked == 0


# -- robustness -------------------------------------------------------------------------------


def test_listener_that_raises_is_logged_once_and_never_breaks_the_board(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    calls: list[BreakerChange] = []

    def listener(change: BreakerChange) -> None:
        calls.append(change)
        raise RuntimeError("listener bug")

    b = BreakerBoard(
        BreakerSettings(fail_max=1, success_threshold=1), clock=clock, on_change=listener
    )
    with caplog.at_level(logging.ERROR, logger="spanvisor.breakers"):
        assert b.record(DEP, False) is OPEN
        clock.now += 30
        assert b.record(DEP, True) is CLOSED
        assert b.isolate(DEP) is True
    assert [c.reason for c in calls] == ["failures", "reset_timeout", "trial_succeeded", "isolated"]
    assert b.listener_errors == 4
    errors = [r for r in caplog.records if r.name == "spanvisor.breakers"]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert "listener bug" in caplog.text


def test_clock_going_backwards_restarts_the_wait() -> None:
    b, clock, changes = board(fail_max=1, reset_timeout_s=30.0)
    b.record(DEP, False)
    clock.now = 500.0  # 500 s before it opened
    assert b.state(DEP) is OPEN
    assert b.info(DEP) == BreakerInfo(DEP, OPEN, 1, 500.0, 530.0)
    clock.now = 529.0
    assert b.record(DEP, True) is OPEN
    clock.now = 530.0
    assert b.state(DEP) is HALF_OPEN
    clock.now = 0.0
    assert b.record(DEP, True) is HALF_OPEN
    assert b.record(DEP, True) is CLOSED
    assert [c.reason for c in changes] == ["failures", "reset_timeout", "trial_succeeded"]


def test_non_finite_clock_readings_are_replaced_by_the_last_finite_one() -> None:
    b, clock, _ = board(fail_max=1)
    b.record(DEP, False)
    for bad in (float("nan"), float("inf"), float("-inf")):
        clock.now = bad
        assert b.state(DEP) is OPEN
        assert b.record(DEP, True) is OPEN
    assert b.info(DEP) == BreakerInfo(DEP, OPEN, 1, 1000.0, 1030.0)
    clock.now = 1030.0
    assert b.state(DEP) is HALF_OPEN


def test_huge_clock_values() -> None:
    b, clock, _ = board(fail_max=1, reset_timeout_s=86_400, success_threshold=1)
    clock.now = 1e15
    b.record(DEP, False)
    assert b.info(DEP).reopens_at == 1e15 + 86_400
    clock.now = 1e15 + 86_400
    assert b.record(DEP, True) is CLOSED


# -- a reference model, driven by Hypothesis ------------------------------------------------


@dataclass
class ModelBreaker:
    state: BreakerState = CLOSED
    failures: int = 0
    successes: int = 0
    opened_at: float | None = None


@dataclass
class Model:
    """The semantics the board promises, written plainly."""

    settings: BreakerSettings
    breakers: dict[str, ModelBreaker] = field(default_factory=dict)
    changes: list[tuple[str, str, str, str, float, int]] = field(default_factory=list)

    def _change(self, dep: str, m: ModelBreaker, new: BreakerState, reason: str, at: float) -> None:
        self.changes.append((dep, m.state.value, new.value, reason, at, m.failures))
        m.state = new

    def _tick(self, dep: str, m: ModelBreaker, now: float) -> None:
        if m.state is OPEN:
            assert m.opened_at is not None
            if now < m.opened_at:
                m.opened_at = now
            if now >= m.opened_at + self.settings.reset_timeout_s:
                m.successes = 0
                self._change(dep, m, HALF_OPEN, "reset_timeout", now)

    def op(self, kind: str, dep: str, now: float) -> BreakerState:
        if kind == "state" and dep not in self.breakers:
            return CLOSED
        m = self.breakers.setdefault(dep, ModelBreaker())
        self._tick(dep, m, now)
        s = self.settings
        if kind in ("ok", "fail") and m.state in (CLOSED, HALF_OPEN):
            if kind == "ok":
                m.failures = 0
                if m.state is HALF_OPEN:
                    m.successes += 1
                    if m.successes >= s.success_threshold:
                        m.successes = 0
                        m.opened_at = None
                        self._change(dep, m, CLOSED, "trial_succeeded", now)
            else:
                m.failures += 1
                if m.state is HALF_OPEN or m.failures >= s.fail_max:
                    reason = "trial_failed" if m.state is HALF_OPEN else "failures"
                    m.opened_at = now
                    self._change(dep, m, OPEN, reason, now)
        elif kind == "isolate" and m.state is not ISOLATED:
            if m.state is not OPEN:
                m.opened_at = now
            self._change(dep, m, ISOLATED, "isolated", now)
        elif kind == "close":
            old = m.state
            m.failures = m.successes = 0
            m.opened_at = None
            if old is not CLOSED:
                self._change(dep, m, CLOSED, "closed_manually", now)
        return m.state


OPS = st.lists(
    st.tuples(
        st.sampled_from(["ok", "ok", "fail", "fail", "fail", "state", "isolate", "close"]),
        st.sampled_from(["a", "b"]),
        # Mostly forward, sometimes far forward, sometimes backwards.
        st.one_of(
            st.sampled_from([0.0, 0.5, 1.0, 5.0]),
            st.sampled_from([10.0, 30.0, 100.0]),
            st.sampled_from([-1.0, -50.0]),
        ),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    fail_max=st.integers(1, 4),
    reset_timeout_s=st.sampled_from([1.0, 10.0, 30.0]),
    success_threshold=st.integers(1, 3),
    ops=OPS,
)
def test_board_matches_the_reference_model(
    fail_max: int,
    reset_timeout_s: float,
    success_threshold: int,
    ops: list[tuple[str, str, float]],
) -> None:
    s = BreakerSettings(fail_max, reset_timeout_s, success_threshold)
    clock = FakeClock()
    changes: list[BreakerChange] = []
    b = BreakerBoard(s, clock=clock, on_change=changes.append)
    model = Model(s)
    for kind, dep, dt in ops:
        clock.now += dt
        if kind in ("ok", "fail"):
            got = b.record(dep, kind == "ok")
        elif kind == "state":
            got = b.state(dep)
        elif kind == "isolate":
            b.isolate(dep)
            got = b.state(dep)
        else:
            b.close(dep)
            got = b.state(dep)
        assert got is model.op(kind, dep, clock.now)
        m = model.breakers.get(dep)
        if m is not None:
            info = b.info(dep)
            assert (info.state, info.failures, info.opened_at) == (
                m.state,
                m.failures,
                m.opened_at,
            )
    assert [
        (c.dependency, c.old.value, c.new.value, c.reason, c.at, c.failures) for c in changes
    ] == model.changes


# -- a shared Redis storage -------------------------------------------------------------------


def test_boards_sharing_a_redis_storage() -> None:
    redis = pytest.importorskip("redis")
    client = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5, socket_timeout=2)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        client.close()
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    prefix = f"spanvisor-test-{uuid.uuid4().hex}"

    def storage(dependency: str) -> pybreaker.CircuitBreakerStorage:
        return pybreaker.CircuitRedisStorage(
            pybreaker.STATE_CLOSED, client, namespace=f"{prefix}:{dependency}"
        )

    s = BreakerSettings(fail_max=2, reset_timeout_s=10.0, success_threshold=1)
    clock_a, clock_b = FakeClock(), FakeClock(5000.0)
    changes_a: list[BreakerChange] = []
    changes_b: list[BreakerChange] = []
    a = BreakerBoard(s, clock=clock_a, on_change=changes_a.append, storage_factory=storage)
    b = BreakerBoard(s, clock=clock_b, on_change=changes_b.append, storage_factory=storage)
    try:
        # Failures seen by two sidecars add up in the shared counter.
        assert a.record(DEP, False) is CLOSED
        assert b.record(DEP, False) is OPEN
        assert summary(changes_b) == [("closed", "open", "failures", 5000.0, 2)]
        assert client.get(f"{prefix}:{DEP}:pybreaker:state") == b"open"
        # The other board notices; its own clock times the reset.
        assert a.state(DEP) is OPEN
        assert summary(changes_a) == [("closed", "open", "shared_storage", 1000.0, 2)]
        assert a.info(DEP).reopens_at == 1010.0
        clock_a.now += 10
        assert a.record(DEP, True) is CLOSED
        assert [c.reason for c in changes_a] == [
            "shared_storage",
            "reset_timeout",
            "trial_succeeded",
        ]
        assert b.state(DEP) is CLOSED
        assert summary(changes_b)[-1] == ("open", "closed", "shared_storage", 5000.0, 0)
        assert b.info(DEP).failures == 0
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@settings(max_examples=300, deadline=None)
@given(
    fail_max=st.integers(1, 4),
    reset_timeout_s=st.sampled_from([0.001, 5.0]),
    success_threshold=st.integers(1, 3),
    batches=st.lists(
        st.tuples(st.sampled_from([0.0, 6.0]), st.lists(st.booleans(), max_size=12)),
        max_size=6,
    ),
)
def test_a_batch_of_outcomes_counts_as_recording_them_one_by_one(
    fail_max: int,
    reset_timeout_s: float,
    success_threshold: int,
    batches: list[tuple[float, list[bool]]],
) -> None:
    one, one_clock, one_changes = board(fail_max, reset_timeout_s, success_threshold)
    many, many_clock, many_changes = board(fail_max, reset_timeout_s, success_threshold)
    for dt, outcomes in batches:  # a wait, then a batch (half-open after a wait of 6 s)
        one_clock.now += dt
        many_clock.now += dt
        expected = one.state(DEP)
        for ok in outcomes:
            expected = one.record(DEP, ok)
        got = many.record_all(DEP, outcomes) if outcomes else many.state(DEP)
        assert got is expected
        assert many.info(DEP) == one.info(DEP)
    assert summary(many_changes) == summary(one_changes)
