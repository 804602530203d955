"""When spend will reach its cap, from its recent burn rate: acted on before the cap.

A budget checked only once it is crossed stops a run after the money is
spent. :class:`Burn` keeps how fast a run (or a service) spends now, in
constant memory, and :func:`forecast` says, after each call, whether the cap
is near enough to act now:

* **horizon**: at the recent rate the cap is reached within ``horizon_s``;
* **next call**: one more call of the average cost so far would cross it.

The rate is an exponentially decayed sum: the first call opens it (what was
spent before it is not timed), each later call adds its amount when it ends,
and the sum decays with time constant ``tau_s``; for a steady rate ``r`` it
tends to ``r * tau_s``. Over a span of activity ``d`` shorter than ``tau_s``
the sum holds about ``r * tau_s * (1 - exp(-d / tau_s))``, which the rate is
divided by instead, so a young run's rate is not underestimated. Times are
given by the caller (seconds, any clock, usually the spans' own): nothing here
reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_TAU_S", "Burn", "Forecast", "due_now", "forecast"]

#: The rate's time constant: calls older than a few of these barely count.
DEFAULT_TAU_S: Final = 60.0
#: A span of activity shorter than this share of ``tau_s`` gives no rate: two calls a
#: second apart say little of the next minute (a big call is caught by the next-call rule).
MIN_ACTIVE_SHARE: Final = 0.1


class Burn:
    """How fast cost and tokens are spent now: decayed sums, two floats each."""

    __slots__ = ("_cost", "_tokens", "last", "since", "tau_s")

    def __init__(self, since: float, tau_s: float = DEFAULT_TAU_S) -> None:
        #: When the first call ended: the rate counts the calls after it, since then.
        self.since = since
        self.last = since
        self.tau_s = tau_s
        self._cost = 0.0
        self._tokens = 0.0

    @classmethod
    def restored(
        cls, since: float, last: float, cost: float, tokens: float, tau_s: float = DEFAULT_TAU_S
    ) -> Burn:
        """A rate counted elsewhere (a fleet's Redis), from its four numbers."""
        burn = cls(since, tau_s)
        burn.last, burn._cost, burn._tokens = last, cost, tokens
        return burn

    def add(self, at: float, cost: float, tokens: int) -> None:
        """A call that ended ``at`` spent ``cost`` USD and ``tokens``.

        A call that ended before the latest one (spans arrive out of order)
        counts as if it ended with it.
        """
        if at > self.last:
            decay = math.exp(-(at - self.last) / self.tau_s)
            self._cost *= decay
            self._tokens *= decay
            self.last = at
        self._cost += max(0.0, cost)
        self._tokens += max(0, tokens)

    def rates(self) -> tuple[float, float] | None:
        """Cost (USD/s) and tokens per second as of the latest call; None: too soon to say."""
        active = self.last - self.since
        if active < MIN_ACTIVE_SHARE * self.tau_s:
            return None
        seen = self.tau_s * -math.expm1(-active / self.tau_s)
        return self._cost / seen, self._tokens / seen


@dataclass(frozen=True, slots=True)
class Forecast:
    """Where one budget kind is headed: ``due`` says to act now, before the cap."""

    #: ``max_cost_usd`` or ``max_tokens``.
    kind: str
    spent: float
    cap: float
    #: The recent rate per second (0: not known yet).
    rate: float
    #: The average of one call so far.
    per_call: float
    #: Seconds until the cap at ``rate`` (None: no rate yet).
    eta_s: float | None
    #: Why to act now: ``horizon``, ``next_call``, or "" (not yet).
    due: str
    #: When the cap is reached at ``rate``, on the caller's clock (None: not known).
    cap_at: float | None = None

    def _amount(self, value: float) -> str:
        return f"${value:.4f}" if self.kind == "max_cost_usd" else f"{value:,.0f} tokens"

    def describe(self) -> str:
        """One line: the spend against the cap, the rate, and why to act now."""
        fmt = self._amount
        text = f"{self.kind}: {fmt(self.spent)} of {fmt(self.cap)} spent"
        if self.rate > 0:
            text += f" at {fmt(self.rate)}/s"
        if self.eta_s is not None:
            text += f", the cap in {self.eta_s:.0f} s"
        if self.due == "next_call":
            text += f"; one more call at the average {fmt(self.per_call)} crosses it"
        return text

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "spent": round(self.spent, 6),
            "cap": self.cap,
            "rate_per_s": round(self.rate, 6),
            "per_call": round(self.per_call, 6),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 3),
            "cap_at": None if self.cap_at is None else round(self.cap_at, 3),
            "due": self.due,
        }


def forecast(
    *,
    kind: str,
    spent: float,
    cap: float | None,
    rate: float | None,
    calls: int,
    horizon_s: float,
    at: float | None = None,
) -> Forecast | None:
    """Where ``spent`` (over ``calls`` calls, spending ``rate`` per second now) is headed
    against ``cap``; None when there is no cap, no call, or it is already crossed
    (that is the crossing's to report, not a forecast's).

    ``horizon_s`` 0: never due (forecasts off); the outlook is still given.
    ``at``: when the latest call ended, for :attr:`Forecast.cap_at`.
    """
    if cap is None or calls <= 0 or spent > cap:
        return None
    left = cap - spent
    per_call = spent / calls
    eta = left / rate if rate is not None and rate > 0 else None
    due = due_now(spent=spent, cap=cap, rate=rate, calls=calls, horizon_s=horizon_s)
    cap_at = at + eta if at is not None and eta is not None else None
    return Forecast(kind, spent, cap, rate or 0.0, per_call, eta, due, cap_at)


def due_now(
    *, spent: float, cap: float | None, rate: float | None, calls: int, horizon_s: float
) -> str:
    """Why :func:`forecast` would say to act now ("" : it would not), without making one:
    what every call of a run with a budget asks."""
    if cap is None or calls <= 0 or spent > cap or horizon_s <= 0:
        return ""
    if spent + spent / calls > cap:
        return "next_call"
    if rate is not None and rate > 0 and (cap - spent) / rate <= horizon_s:
        return "horizon"
    return ""
