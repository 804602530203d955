"""RetryBudget: Envoy-style budgets over a bucketed sliding window, with a fake clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies._budget import BudgetSettings, BudgetSnapshot, RetryBudget

DEP = "openai:gpt-4o"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def budget(
    ratio: float = 0.2, min_retries: int = 3, window_s: float = 10.0, **kwargs: int
) -> tuple[RetryBudget, FakeClock]:
    clock = FakeClock()
    return RetryBudget(BudgetSettings(ratio, min_retries, window_s), clock=clock, **kwargs), clock


def spend_all(b: RetryBudget, dependency: str = DEP, limit: int = 10_000) -> int:
    granted = 0
    while granted < limit and b.try_spend(dependency):
        granted += 1
    return granted


# -- settings ---------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    assert BudgetSettings() == BudgetSettings(ratio=0.2, min_retries=3, window_s=10.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": 0}, "ratio must be more than 0 and at most 10"),
        ({"ratio": -0.1}, "ratio must be more than 0"),
        ({"ratio": 10.01}, "ratio must be more than 0 and at most 10"),
        ({"ratio": float("nan")}, "ratio must be more than 0"),
        ({"ratio": float("inf")}, "ratio must be more than 0"),
        ({"ratio": "0.2"}, "ratio must be a number"),
        ({"min_retries": -1}, "min_retries must be between 0 and 1000000"),
        ({"min_retries": 1_000_001}, "min_retries must be between 0 and 1000000"),
        ({"min_retries": 1.5}, "min_retries must be an integer"),
        ({"min_retries": False}, "min_retries must be an integer"),
        ({"window_s": 0.99}, "window_s must be at least 1 and at most 3600"),
        ({"window_s": 3600.5}, "window_s must be at least 1 and at most 3600"),
        ({"window_s": float("nan")}, "window_s must be at least 1"),
    ],
)
def test_settings_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BudgetSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_extremes_are_accepted() -> None:
    BudgetSettings(ratio=1e-9, min_retries=0, window_s=1)
    BudgetSettings(ratio=10, min_retries=1_000_000, window_s=3600)


def test_max_dependencies_validation() -> None:
    with pytest.raises(ValueError, match="max_dependencies must be at least 1"):
        RetryBudget(max_dependencies=0)


# -- the budget -------------------------------------------------------------------------------


def test_min_retries_with_no_calls() -> None:
    b, _ = budget()
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 0, 0, 3.0, True)
    assert spend_all(b) == 3
    assert b.denied == 1
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 0, 3, 3.0, False)


def test_ratio_of_calls_once_above_the_floor() -> None:
    b, _ = budget(ratio=0.2, min_retries=3)
    for _ in range(100):
        b.record_call(DEP)
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 100, 0, 20.0, True)
    assert spend_all(b) == 20
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 100, 20, 20.0, False)
    b.record_call(DEP)  # 101 calls: limit 20.2, so one more retry fits
    assert spend_all(b) == 1


def test_fractional_limit_rounds_up() -> None:
    b, _ = budget(ratio=0.25, min_retries=0)
    for _ in range(10):
        b.record_call(DEP)
    assert spend_all(b) == 3  # 0, 1 and 2 are each < 2.5


def test_no_floor_and_no_calls_denies_without_making_a_window() -> None:
    b, _ = budget(min_retries=0)
    assert b.try_spend(DEP) is False
    assert len(b) == 0
    assert b.denied == 1
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 0, 0, 0.0, False)
    assert len(b) == 0
    b.record_call(DEP)
    assert b.try_spend(DEP) is True  # 0 < 0.2


def test_counts_leave_the_window_exactly_with_their_bucket() -> None:
    b, clock = budget()  # 10 s window, 1 s buckets
    b.record_call(DEP)
    clock.now = 1000.999
    b.record_call(DEP)
    assert spend_all(b) == 3
    clock.now = 1009.999
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 2, 3, 3.0, False)
    assert b.try_spend(DEP) is False
    clock.now = 1010.0
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 0, 0, 3.0, True)
    assert b.try_spend(DEP) is True


def test_sliding_window_forgets_old_buckets_one_by_one() -> None:
    b, clock = budget(ratio=1.0, min_retries=0)
    for second in range(10):
        clock.now = 1000.0 + second
        b.record_call(DEP)
    assert b.snapshot(DEP).calls == 10
    for second in range(10, 20):
        clock.now = 1000.0 + second
        assert b.snapshot(DEP).calls == 19 - second
    assert b.snapshot(DEP).calls == 0


def test_dependencies_have_separate_budgets() -> None:
    b, _ = budget()
    assert spend_all(b, "tool:search") == 3
    assert spend_all(b, DEP) == 3
    assert b.snapshot("tool:search").retries == 3


def test_settings_per_dependency() -> None:
    def settings_for(dependency: str) -> BudgetSettings:
        if dependency.startswith("tool:"):
            return BudgetSettings(ratio=1.0, min_retries=0)
        return BudgetSettings(min_retries=1)

    b = RetryBudget(settings_for, clock=FakeClock())
    assert b.try_spend("tool:search") is False
    assert spend_all(b, DEP) == 1
    b.record_call("tool:search")
    assert spend_all(b, "tool:search") == 1


def test_settings_for_must_return_settings() -> None:
    b = RetryBudget(lambda _dependency: 3, clock=FakeClock())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must be BudgetSettings"):
        b.record_call(DEP)
    assert len(b) == 0


def test_default_settings_and_clock() -> None:
    b = RetryBudget()
    for _ in range(50):
        b.record_call(DEP)
    assert spend_all(b) == 10


# -- bounds -----------------------------------------------------------------------------------


def test_dependencies_are_bounded_lru() -> None:
    b, _ = budget(max_dependencies=2)
    b.record_call("a")
    b.record_call("b")
    b.try_spend("a")  # "b" is now the least recently used
    b.record_call("c")
    assert len(b) == 2
    assert b.evictions == 1
    assert b.snapshot("a").retries == 1
    assert b.snapshot("b") == BudgetSnapshot("b", 0, 0, 3.0, True)  # starts afresh
    assert b.snapshot("c").calls == 1
    assert len(b) == 2  # snapshot creates nothing


def test_memory_per_dependency_is_bounded_by_the_window() -> None:
    for window_s, buckets in ((1.0, 10), (10.0, 10), (30.0, 30), (3600.0, 60)):
        b, clock = budget(window_s=window_s)
        for _ in range(5000):
            clock.now += window_s / 97
            b.record_call(DEP)
            b.try_spend(DEP)
        window = b._windows[DEP]
        assert window.count == buckets
        assert len(window.buckets) <= buckets
        assert window.calls == sum(bucket[1] for bucket in window.buckets)
        assert window.retries == sum(bucket[2] for bucket in window.buckets)


def test_many_calls() -> None:
    b, _ = budget(ratio=10.0)
    for _ in range(20_000):
        b.record_call(DEP)
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 20_000, 0, 200_000.0, True)


# -- robustness -------------------------------------------------------------------------------


def test_clock_going_backwards_counts_in_the_newest_bucket() -> None:
    b, clock = budget()
    b.record_call(DEP)
    clock.now = 500.0
    b.record_call(DEP)
    assert spend_all(b) == 3
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 2, 3, 3.0, False)
    clock.now = 1009.5
    assert b.snapshot(DEP).calls == 2
    clock.now = 1010.0
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 0, 0, 3.0, True)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_clock_readings_are_replaced_by_the_last_finite_one(bad: float) -> None:
    b, clock = budget()
    b.record_call(DEP)
    clock.now = bad
    b.record_call(DEP)
    assert b.try_spend(DEP) is True
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 2, 1, 3.0, True)
    clock.now = 1010.0
    assert b.snapshot(DEP).calls == 0


@pytest.mark.parametrize("now", [1e15, 1e300, 1.7e308, -1e300])
@pytest.mark.parametrize("window_s", [1.0, 10.0, 3600.0])
def test_huge_clock_values(now: float, window_s: float) -> None:
    b, clock = budget(window_s=window_s)
    clock.now = now
    b.record_call(DEP)
    assert spend_all(b) == 3
    assert b.snapshot(DEP) == BudgetSnapshot(DEP, 1, 3, 3.0, False)


# -- properties -------------------------------------------------------------------------------

STEPS = st.lists(
    st.tuples(
        st.sampled_from(["call", "call", "call", "spend", "spend"]),
        # quarter seconds: exact in binary, so the reference's arithmetic matches exactly
        st.integers(-8, 48).map(lambda q: q / 4),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.sampled_from([0.1, 0.2, 0.5, 1.0, 2.5]),
    min_retries=st.integers(0, 4),
    window_s=st.sampled_from([1.0, 2.5, 10.0, 75.0]),
    steps=STEPS,
)
def test_budget_matches_a_reference_over_exact_events(
    ratio: float, min_retries: int, window_s: float, steps: list[tuple[str, float]]
) -> None:
    b, clock = budget(ratio, min_retries, window_s)
    count = min(60, max(10, math.ceil(window_s)))
    width = window_s / count
    events: list[tuple[int, str]] = []  # every counted event with its bucket index
    newest: int | None = None
    for kind, dt in steps:
        clock.now += dt
        index = math.floor(clock.now / width)
        # The clock may go back: the budget then counts in its newest bucket.
        if newest is not None:
            index = max(index, newest)
        calls = sum(1 for i, k in events if k == "call" and i > index - count)
        retries = sum(1 for i, k in events if k == "spend" and i > index - count)
        allowed = retries < max(min_retries, ratio * calls)
        if kind == "call":
            b.record_call(DEP)
            events.append((index, "call"))
        else:
            assert b.try_spend(DEP) is allowed
            if allowed:
                events.append((index, "spend"))
        if events:  # the budget holds a window from its first counted event on
            newest = index
        snap = b.snapshot(DEP)
        calls = sum(1 for i, k in events if k == "call" and i > index - count)
        retries = sum(1 for i, k in events if k == "spend" and i > index - count)
        assert (snap.calls, snap.retries) == (calls, retries)


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.sampled_from([0.1, 0.2, 0.5, 1.0]),
    min_retries=st.integers(0, 3),
    steps=st.lists(
        st.tuples(st.sampled_from(["call", "spend", "spend"]), st.integers(0, 12)),
        max_size=150,
    ),
)
def test_granted_retries_never_exceed_the_budget_in_any_window(
    ratio: float, min_retries: int, steps: list[tuple[str, int]]
) -> None:
    """In any (T - 9 s, T] (the window less a bucket), grants <= ceil(limit on 19 s of calls).

    Every grant in such an interval is still counted when the last of them is
    asked, and the calls that set its limit were made in the 10 s before it.
    """
    b, clock = budget(ratio, min_retries, 10.0)
    calls: list[float] = []
    grants: list[float] = []
    for kind, quarter_seconds in steps:
        clock.now += quarter_seconds / 4
        if kind == "call":
            b.record_call(DEP)
            calls.append(clock.now)
        elif b.try_spend(DEP):
            grants.append(clock.now)
    for end in grants:
        granted = sum(1 for t in grants if end - 9 < t <= end)
        seen = sum(1 for t in calls if end - 19 < t <= end)
        assert granted <= math.ceil(max(min_retries, ratio * seen))
