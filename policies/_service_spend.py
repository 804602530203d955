"""What each service's runs spent over a sliding window, against its budget.

``service_budgets:`` in a policy caps a service's spend over ``window_s``
(:class:`~policies._schema_budgets.ServiceBudgetSpec`). :class:`ServiceSpend`
counts it in one sidecar: per service, the window cut into buckets
(:func:`policies._window_counter.window_buckets`, at most 60) and its burn
rate (:class:`policies._forecast.Burn`); at most ``max_services`` services,
the least recently charged forgotten first. Times are given by the caller.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final

from policies._forecast import DEFAULT_TAU_S, Burn, Forecast, due_now, forecast
from policies._schema_budgets import ServiceBudgetSpec
from policies._window_counter import window_buckets

__all__ = ["SERVICE_BUDGET_RULE", "ServiceOutlook", "ServiceSpend"]

MAX_SERVICES: Final = 1024
#: The rule a service budget's reports are under: its decision entries match it.
SERVICE_BUDGET_RULE: Final = "builtin.detect.service_budget"


@dataclass(frozen=True, slots=True)
class ServiceOutlook:
    """A service's window after a charge: what it spent, and whether its runs must stop."""

    service: str
    cost_usd: float
    tokens: int
    calls: int
    #: The budget kinds the window's spend is above, joined by "+" ("" : none).
    crossed: str
    #: A cap forecast to be reached soon (None: none is).
    due: Forecast | None

    @property
    def stop(self) -> bool:
        return bool(self.crossed) or self.due is not None

    def describe(self, spec: ServiceBudgetSpec) -> str:
        window = f"{spec.window_s:g} s"
        text = (
            f"service {self.service} spent {self.tokens:,} tokens and ${self.cost_usd:.4f}"
            f" over {self.calls} LLM calls in {window}"
        )
        if self.crossed:
            caps = []
            if spec.max_tokens is not None:
                caps.append(f"max_tokens {spec.max_tokens:,}")
            if spec.max_cost_usd is not None:
                caps.append(f"max_cost_usd ${spec.max_cost_usd:g}")
            return f"{self.crossed}: {text} ({', '.join(caps)})"
        assert self.due is not None
        return f"{self.due.describe()}; {text}"

    def to_json(self) -> dict[str, object]:
        return {
            "service": self.service,
            "window_cost_usd": round(self.cost_usd, 6),
            "window_tokens": self.tokens,
            "window_calls": self.calls,
            "crossed": self.crossed,
            "forecast": None if self.due is None else self.due.to_json(),
        }


class _Window:
    """One service's buckets: (bucket number, cost, tokens, calls), oldest first."""

    __slots__ = ("buckets", "burn", "calls", "cost", "tokens", "width")

    def __init__(self, window_s: float, now: float) -> None:
        _, self.width = window_buckets(window_s)
        self.buckets: deque[list[float]] = deque()
        self.cost = 0.0
        self.tokens = 0
        self.calls = 0
        self.burn: Burn | None = None

    def add(self, now: float, cost: float, tokens: int, count: int) -> None:
        slot = float(now // self.width)
        buckets = self.buckets
        if buckets and buckets[-1][0] >= slot:
            bucket = buckets[-1]  # the clock went back: counted in the newest bucket
        else:
            bucket = [slot, 0.0, 0.0, 0.0]
            buckets.append(bucket)
        bucket[1] += cost
        bucket[2] += tokens
        bucket[3] += count
        self.cost += cost
        self.tokens += tokens
        self.calls += count
        if self.burn is None:
            self.burn = Burn(now)  # the first call opens the rate (see Burn)
        else:
            self.burn.add(now, cost, tokens)

    def expire(self, now: float, window_s: float) -> None:
        oldest = (now - window_s) // self.width  # buckets wholly before the window
        buckets = self.buckets
        while buckets and buckets[0][0] <= oldest:
            _, cost, tokens, count = buckets.popleft()
            self.cost = max(0.0, self.cost - cost)
            self.tokens = max(0, self.tokens - int(tokens))
            self.calls = max(0, self.calls - int(count))

    @property
    def last(self) -> float:
        """When the latest call ended (its rate's clock)."""
        return self.burn.last if self.burn is not None else 0.0

    def outlook(self, service: str, spec: ServiceBudgetSpec) -> ServiceOutlook:
        """The window's spend against ``spec``: crossed, or a cap forecast near."""
        crossed = []
        if spec.max_tokens is not None and self.tokens > spec.max_tokens:
            crossed.append("max_tokens")
        if spec.max_cost_usd is not None and self.cost > spec.max_cost_usd:
            crossed.append("max_cost_usd")
        due = None
        if not crossed:
            rates = self.burn.rates() if self.burn is not None else None
            cost_rate, token_rate = (None, None) if rates is None else rates
            calls, horizon = self.calls, spec.forecast_s
            tokens_cap = None if spec.max_tokens is None else float(spec.max_tokens)
            for kind, spent, cap, rate in (
                ("max_cost_usd", self.cost, spec.max_cost_usd, cost_rate),
                ("max_tokens", float(self.tokens), tokens_cap, token_rate),
            ):
                if due_now(spent=spent, cap=cap, rate=rate, calls=calls, horizon_s=horizon):
                    due = forecast(
                        kind=kind,
                        spent=spent,
                        cap=cap,
                        rate=rate,
                        calls=calls,
                        horizon_s=horizon,
                        at=self.last,
                    )
                    break
        return ServiceOutlook(service, self.cost, self.tokens, self.calls, "+".join(crossed), due)


class ServiceSpend:
    """Per service, the spend in its budget's window; see the module docstring."""

    #: The burn rate's time constant (see :class:`~policies._forecast.Burn`).
    tau_s: Final = DEFAULT_TAU_S

    def __init__(self, max_services: int = MAX_SERVICES) -> None:
        self.max_services = max_services
        self._windows: OrderedDict[str, tuple[float, _Window]] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._windows)

    def __contains__(self, service: object) -> bool:
        return service in self._windows

    def charge(
        self, service: str, spec: ServiceBudgetSpec, *, now: float, cost: float, tokens: int
    ) -> ServiceOutlook:
        """One LLM call of ``service`` at ``now``: the window after it, against ``spec``."""
        windows = self._windows
        found = windows.get(service)
        if found is None or found[0] != spec.window_s:  # new, or the policy's window changed
            while len(windows) >= self.max_services:
                windows.popitem(last=False)
                self.forgotten += 1
            window = _Window(spec.window_s, now)
            windows[service] = (spec.window_s, window)
        else:
            window = found[1]
            windows.move_to_end(service)
        window.expire(now, spec.window_s)
        window.add(now, max(0.0, cost), max(0, tokens), 1)
        return window.outlook(service, spec)

    def adopt(
        self,
        service: str,
        spec: ServiceBudgetSpec,
        *,
        buckets: list[tuple[float, float, int, int]],
        burn: tuple[float, float, float, float] | None,
    ) -> None:
        """``service``'s window is now ``buckets`` (bucket number, cost, tokens, calls; oldest
        first) and its rate ``burn`` (since, last, decayed cost, decayed tokens; None: no call
        yet), as counted elsewhere (a fleet's Redis); later charges add to them."""
        windows = self._windows
        if service not in windows:
            while len(windows) >= self.max_services:
                windows.popitem(last=False)
                self.forgotten += 1
        window = _Window(spec.window_s, 0.0)
        for slot, cost, tokens, count in buckets:
            window.buckets.append([slot, cost, float(tokens), float(count)])
            window.cost += cost
            window.tokens += tokens
            window.calls += count
        if burn is not None:
            since, last, cost_sum, token_sum = burn
            window.burn = Burn.restored(since, last, cost_sum, token_sum)
        windows[service] = (spec.window_s, window)
        windows.move_to_end(service)

    def forget(self) -> None:
        """Every service's window (what was adopted is no longer current)."""
        self._windows.clear()
