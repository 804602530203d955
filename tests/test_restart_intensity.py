"""RestartIntensity: Erlang's MaxR in MaxT per run, with a fake clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies._intensity import IntensitySettings, RestartIntensity

RUN = "run-1"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def intensity(
    max_actions: int = 5, period_s: float = 60.0, **kwargs: int
) -> tuple[RestartIntensity, FakeClock]:
    clock = FakeClock()
    limiter = RestartIntensity(IntensitySettings(max_actions, period_s), clock=clock, **kwargs)
    return limiter, clock


# -- settings ---------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    assert IntensitySettings() == IntensitySettings(max_actions=10, period_s=60.0)
    assert RestartIntensity().settings == IntensitySettings()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_actions": -1}, "max_actions must be between 0 and 10000, got -1"),
        ({"max_actions": 10_001}, "max_actions must be between 0 and 10000"),
        ({"max_actions": 2.0}, "max_actions must be an integer"),
        ({"max_actions": True}, "max_actions must be an integer"),
        ({"period_s": 0}, "period_s must be more than 0 and at most 86400 seconds"),
        ({"period_s": -5}, "period_s must be more than 0"),
        ({"period_s": 86_401}, "period_s must be more than 0 and at most 86400"),
        ({"period_s": float("nan")}, "period_s must be more than 0"),
        ({"period_s": float("inf")}, "period_s must be more than 0"),
        ({"period_s": None}, "period_s must be a number of seconds"),
    ],
)
def test_settings_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IntensitySettings(**kwargs)  # type: ignore[arg-type]


def test_max_runs_validation() -> None:
    with pytest.raises(ValueError, match="max_runs must be at least 1"):
        RestartIntensity(max_runs=0)


# -- the limit --------------------------------------------------------------------------------


def test_max_actions_within_the_period_then_denied() -> None:
    limiter, clock = intensity(max_actions=5, period_s=60.0)
    for _ in range(5):
        assert limiter.allow(RUN) is True
        clock.now += 1
    assert limiter.allow(RUN) is False
    assert limiter.actions(RUN) == 5
    assert limiter.denied == 1


def test_period_boundary_is_inclusive_as_erlang() -> None:
    limiter, clock = intensity(max_actions=2, period_s=60.0)
    assert limiter.allow(RUN) is True  # t = 1000
    clock.now = 1010.0
    assert limiter.allow(RUN) is True
    clock.now = 1060.0  # the action at 1000 is exactly period_s old: it still counts
    assert limiter.allow(RUN) is False
    assert limiter.actions(RUN) == 2
    clock.now = 1060.25
    assert limiter.actions(RUN) == 1
    assert limiter.allow(RUN) is True
    assert limiter.allow(RUN) is False


def test_denied_actions_are_not_counted() -> None:
    limiter, clock = intensity(max_actions=3, period_s=10.0)
    for _ in range(3):
        assert limiter.allow(RUN)
    for _ in range(100):
        clock.now += 0.05
        assert limiter.allow(RUN) is False
    assert limiter.actions(RUN) == 3
    clock.now = 1010.001  # only the three allowed actions had to age out
    assert limiter.allow(RUN) is True
    assert limiter.denied == 100


def test_runs_are_independent() -> None:
    limiter, _ = intensity(max_actions=1)
    assert limiter.allow("a") is True
    assert limiter.allow("a") is False
    assert limiter.allow("b") is True


def test_zero_max_actions_escalates_everything_and_stores_nothing() -> None:
    limiter, _ = intensity(max_actions=0)
    assert limiter.allow(RUN) is False
    assert limiter.allow(RUN) is False
    assert len(limiter) == 0
    assert limiter.denied == 2


def test_forget_and_unknown_runs() -> None:
    limiter, _ = intensity(max_actions=1)
    assert limiter.actions("nobody") == 0
    assert limiter.allow(RUN) is True
    limiter.forget(RUN)
    limiter.forget("nobody")
    assert len(limiter) == 0
    assert limiter.allow(RUN) is True


def test_default_clock() -> None:
    limiter = RestartIntensity(IntensitySettings(max_actions=2))
    assert [limiter.allow(RUN) for _ in range(3)] == [True, True, False]


# -- bounds -----------------------------------------------------------------------------------


def test_runs_are_bounded_lru() -> None:
    limiter, _ = intensity(max_actions=1, max_runs=2)
    limiter.allow("a")
    limiter.allow("b")
    limiter.allow("a")  # denied, but "a" is now the most recently active
    limiter.allow("c")
    assert len(limiter) == 2
    assert limiter.evictions == 1
    assert limiter.actions("a") == 1
    assert limiter.actions("b") == 0
    assert limiter.allow("b") is True  # starts afresh
    assert limiter.evictions == 2


def test_timestamps_per_run_are_bounded() -> None:
    limiter, clock = intensity(max_actions=4, period_s=1e4)
    for _ in range(1000):
        clock.now += 0.5
        limiter.allow(RUN)
    assert len(limiter._runs[RUN]) == 4


def test_many_runs_stay_bounded() -> None:
    limiter, _ = intensity(max_runs=100)
    for n in range(5000):
        assert limiter.allow(f"run-{n}") is True
    assert len(limiter) == 100
    assert limiter.evictions == 4900


# -- robustness -------------------------------------------------------------------------------


def test_clock_going_backwards_stamps_at_the_newest_time() -> None:
    limiter, clock = intensity(max_actions=3, period_s=60.0)
    assert limiter.allow(RUN) is True
    clock.now = 500.0
    assert limiter.allow(RUN) is True
    assert limiter.allow(RUN) is True
    assert limiter.allow(RUN) is False
    clock.now = 1060.0
    assert limiter.actions(RUN) == 3
    clock.now = 1060.5
    assert limiter.actions(RUN) == 0
    assert limiter.allow(RUN) is True


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_clock_readings_are_replaced_by_the_last_finite_one(bad: float) -> None:
    limiter, clock = intensity(max_actions=2, period_s=60.0)
    assert limiter.allow(RUN) is True
    clock.now = bad
    assert limiter.allow(RUN) is True
    assert limiter.allow(RUN) is False
    clock.now = 1060.5
    assert limiter.actions(RUN) == 0


@pytest.mark.parametrize("start", [1e15, 1e300, -1e300])
def test_huge_clock_values(start: float) -> None:
    limiter, clock = intensity(max_actions=1, period_s=86_400)
    clock.now = start
    assert limiter.allow(RUN) is True
    assert limiter.allow(RUN) is False


# -- properties -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    max_actions=st.integers(0, 5),
    period_quarters=st.integers(1, 80),
    steps=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 40)), max_size=120),
)
def test_never_more_than_max_actions_in_any_period(
    max_actions: int, period_quarters: int, steps: list[tuple[str, int]]
) -> None:
    """Matches a plain reference, and no closed window of period_s holds more than R grants."""
    period_s = period_quarters / 4  # quarter seconds: exact in binary
    limiter, clock = intensity(max_actions, period_s)
    granted: dict[str, list[float]] = {"a": [], "b": []}
    for run, quarter_seconds in steps:
        clock.now += quarter_seconds / 4
        now = clock.now
        recent = sum(1 for t in granted[run] if now - period_s <= t)
        allowed = limiter.allow(run)
        assert allowed is (recent < max_actions)
        if allowed:
            granted[run].append(now)
        assert limiter.actions(run) == min(recent + allowed, max_actions)
    for times in granted.values():
        for end in times:
            assert sum(1 for t in times if end - period_s <= t <= end) <= max_actions
