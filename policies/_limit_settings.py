"""The settings of breakers, retry budgets and restart intensity, checked when they are made.

Why a module of its own: the breaker and budget state machines are compiled
(``setup.py``), and a compiled dataclass rejects a value of the wrong type
with a bare ``TypeError`` before ``__post_init__`` can say which setting is
wrong and why. These stay interpreted, so a policy's limits get clear errors
either way; the state machines only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MAX_FAIL_MAX",
    "MAX_RESET_TIMEOUT_S",
    "MAX_SUCCESS_THRESHOLD",
    "BreakerSettings",
    "BudgetSettings",
    "IntensitySettings",
    "check_int",
]

#: Upper bounds that keep a typo in a policy from disabling a breaker for good.
MAX_FAIL_MAX = 10_000
MAX_SUCCESS_THRESHOLD = 10_000
MAX_RESET_TIMEOUT_S = 86_400.0
MAX_ACTIONS = 10_000
MAX_PERIOD_S = 86_400.0


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """How one dependency's breaker trips and recovers.

    ``fail_max`` consecutive failures open it; it stays open ``reset_timeout_s``
    seconds, then lets trial calls through (half-open); ``success_threshold``
    successful trials close it, one failed trial opens it again.
    """

    fail_max: int = 5
    reset_timeout_s: float = 30.0
    success_threshold: int = 2

    def __post_init__(self) -> None:
        check_int("fail_max", self.fail_max, 1, MAX_FAIL_MAX)
        _check_seconds("reset_timeout_s", self.reset_timeout_s, MAX_RESET_TIMEOUT_S)
        check_int("success_threshold", self.success_threshold, 1, MAX_SUCCESS_THRESHOLD)


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """A dependency's retry budget.

    Retries are allowed while the retries counted in the last ``window_s``
    seconds are fewer than ``max(min_retries, ratio * calls)`` over the same
    window.
    """

    ratio: float = 0.2
    min_retries: int = 3
    window_s: float = 10.0

    def __post_init__(self) -> None:
        _check_float("ratio", self.ratio, 0.0, 10.0, low_open=True)
        if not isinstance(self.min_retries, int) or isinstance(self.min_retries, bool):
            raise ValueError(f"min_retries must be an integer, got {self.min_retries!r}")
        if not 0 <= self.min_retries <= 1_000_000:
            raise ValueError(f"min_retries must be between 0 and 1000000, got {self.min_retries}")
        _check_float("window_s", self.window_s, 1.0, 3600.0, low_open=False)


@dataclass(frozen=True, slots=True)
class IntensitySettings:
    """At most ``max_actions`` corrective actions per run within ``period_s`` seconds.

    ``max_actions`` 0 escalates every action (Erlang's intensity 0).
    """

    max_actions: int = 5
    period_s: float = 60.0

    def __post_init__(self) -> None:
        value = self.max_actions
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"max_actions must be an integer, got {value!r}")
        if not 0 <= value <= MAX_ACTIONS:
            raise ValueError(f"max_actions must be between 0 and {MAX_ACTIONS}, got {value}")
        period = self.period_s
        if not isinstance(period, (int, float)) or isinstance(period, bool):
            raise ValueError(f"period_s must be a number of seconds, got {period!r}")
        if not math.isfinite(period) or not 0 < period <= MAX_PERIOD_S:
            raise ValueError(
                f"period_s must be more than 0 and at most {MAX_PERIOD_S:g} seconds, got {period}"
            )


def check_int(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_seconds(name: str, value: object, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= high:
        raise ValueError(f"{name} must be more than 0 and at most {high:g} seconds, got {value}")


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        low_text = f"more than {low:g}" if low_open else f"at least {low:g}"
        raise ValueError(f"{name} must be {low_text} and at most {high:g}, got {value}")
