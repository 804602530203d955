"""A run's spend, priced by a model table entry: the part of budgets on the span path.

Every LLM span with token usage adds to its run's :class:`RunSpend`. The
table that prices a call is :mod:`policies._model_table`, the budget it is
held to :class:`policies._schema_budgets.RunBudgetSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

from policies._forecast import Burn, Forecast, due_now, forecast
from policies._schema_budgets import RunBudgetSpec

__all__ = ["MAX_MODEL_NAME", "MAX_TOKENS_PER_CALL", "ModelInfo", "RunSpend", "clamp_tokens"]

#: Model names longer than this are not looked up (no real model name is).
MAX_MODEL_NAME: Final = 256
#: Tokens one call may report; larger figures are clamped (they are garbage anyway).
MAX_TOKENS_PER_CALL: Final = 1_000_000_000


class _Lookup(Protocol):
    def lookup(self, model: str) -> ModelInfo | None: ...


def clamp_tokens(value: int | None) -> int:
    """A reported token count made safe: None and negatives are 0, absurd figures clamped."""
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return 0
    return min(value, MAX_TOKENS_PER_CALL)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model table entry as matched: which glob, the window, the prices (or None)."""

    pattern: str
    context_window: int
    input_per_mtok: float | None
    output_per_mtok: float | None

    @property
    def priced(self) -> bool:
        return self.input_per_mtok is not None and self.output_per_mtok is not None

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float | None:
        """USD for one call's tokens; None when the model has no price."""
        if self.input_per_mtok is None or self.output_per_mtok is None:
            return None
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


class RunSpend:
    """One run's spend so far: tokens, cost, and which budget kinds were reported.

    ``add`` is called for each LLM span of the run with its model and token
    usage. Tokens always count; cost counts only when the table prices the
    model, and a call with tokens but no price makes the cost ``partial`` (a
    lower bound). ``crossed`` says which budget kind the spend went above since
    the last time it was asked, so each kind is reported once per run.
    """

    __slots__ = (
        "_reported",
        "budget",
        "burn",
        "calls",
        "cost_usd",
        "input_tokens",
        "output_tokens",
        "unpriced_calls",
        "unpriced_models",
    )

    #: At most this many distinct unpriced model names are kept, for the message.
    MAX_UNPRICED_NAMES = 8

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Nothing spent: as new (a run tracker reuses one for the run it begins next)."""
        self.calls = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost_usd = 0.0
        #: Calls with tokens whose model has no price (unknown, or listed without one).
        self.unpriced_calls = 0
        # Made when first needed: most runs are priced and within budget.
        self.unpriced_models: list[str] | None = None
        self._reported: set[str] | None = None
        #: How fast it spends now (from its first call with usage), and the budget
        #: it was last held to (for :meth:`outlook`).
        self.burn: Burn | None = None
        self.budget: RunBudgetSpec | None = None

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def partial(self) -> bool:
        """Some tokens had no price: ``cost_usd`` is a lower bound."""
        return self.unpriced_calls > 0

    def add(
        self, model: str, input_tokens: int | None, output_tokens: int | None, table: _Lookup
    ) -> float | None:
        """Count one call; its cost in USD, or None when its model has no price.

        A call without token usage (both counts absent or 0) counts nothing.
        """
        tokens_in = clamp_tokens(input_tokens)
        tokens_out = clamp_tokens(output_tokens)
        if tokens_in == 0 and tokens_out == 0:
            return 0.0
        return self.add_known(model, table.lookup(model), tokens_in, tokens_out)

    def add_known(
        self, model: str, info: ModelInfo | None, tokens_in: int, tokens_out: int
    ) -> float | None:
        """:meth:`add` for a caller that looked the model up already (and checked the counts)."""
        self.calls += 1
        self.input_tokens += tokens_in
        self.output_tokens += tokens_out
        cost = None if info is None else info.cost_usd(tokens_in, tokens_out)
        if cost is None:
            self.unpriced_calls += 1
            name = model[:MAX_MODEL_NAME] if isinstance(model, str) else ""
            names = self.unpriced_models
            if names is None:
                names = self.unpriced_models = []
            if name not in names and len(names) < self.MAX_UNPRICED_NAMES:
                names.append(name)
            return None
        self.cost_usd += cost
        return cost

    def over(self, budget: RunBudgetSpec) -> tuple[str, ...]:
        """Every budget kind the spend is above now, reported or not."""
        found: list[str] = []
        if budget.max_tokens is not None and self.tokens > budget.max_tokens:
            found.append("max_tokens")
        if budget.max_cost_usd is not None and self.cost_usd > budget.max_cost_usd:
            found.append("max_cost_usd")
        return tuple(found)

    def crossed(self, budget: RunBudgetSpec) -> str | None:
        """The budget kinds newly crossed: ``"max_tokens"``, ``"max_cost_usd"``, or both
        joined by ``"+"``; None when nothing new was crossed. Each kind is reported once."""
        max_tokens, max_cost = budget.max_tokens, budget.max_cost_usd
        if (max_tokens is None or self.input_tokens + self.output_tokens <= max_tokens) and (
            max_cost is None or self.cost_usd <= max_cost
        ):
            return None  # under the budget: what every call but one finds
        reported = self._reported
        if reported is None:
            reported = self._reported = set()
        new = [kind for kind in self.over(budget) if kind not in reported]
        if not new:
            return None
        reported.update(new)
        return "+".join(new)

    def burned(self, at: float, cost: float | None, tokens: int) -> None:
        """The call just added ended ``at`` (seconds): its burn; the first one opens it."""
        if self.burn is None:
            self.burn = Burn(at)
        else:
            self.burn.add(at, cost or 0.0, tokens)

    def forecast_due(self, budget: RunBudgetSpec) -> Forecast | None:
        """A budget kind about to be crossed, once per run (see :mod:`policies._forecast`).

        None when nothing is due, or a forecast (or a crossing) of the run was
        reported already. Remembers ``budget`` for :meth:`outlook`.
        """
        self.budget = budget
        if self._reported or budget.forecast_s <= 0:
            return None
        rates = self.burn.rates() if self.burn is not None else None
        cost_rate, token_rate = (None, None) if rates is None else rates
        horizon, calls = budget.forecast_s, self.calls
        if not due_now(
            spent=self.cost_usd,
            cap=budget.max_cost_usd,
            rate=cost_rate,
            calls=calls,
            horizon_s=horizon,
        ) and not due_now(
            spent=self.tokens,
            cap=budget.max_tokens,
            rate=token_rate,
            calls=calls,
            horizon_s=horizon,
        ):
            return None  # what most calls find: nothing is made
        nearest = self.outlook()
        if nearest is None or not nearest.due:
            return None
        self._reported = {"forecast"}
        return nearest

    def outlook(self) -> Forecast | None:
        """Where the spend is headed against the last budget it was held to: the nearest
        cap, due ones first (None: no budget, or every cap crossed)."""
        budget = self.budget
        if budget is None:
            return None
        burn = self.burn
        rates = burn.rates() if burn is not None else None
        cost_rate, token_rate = (None, None) if rates is None else rates
        nearest: Forecast | None = None
        for kind, spent, cap, rate in (
            ("max_cost_usd", self.cost_usd, budget.max_cost_usd, cost_rate),
            ("max_tokens", float(self.tokens), budget.max_tokens, token_rate),
        ):
            seen = forecast(
                kind=kind,
                spent=spent,
                cap=None if cap is None else float(cap),
                rate=rate,
                calls=self.calls,
                horizon_s=budget.forecast_s,
                at=burn.last if burn is not None else None,
            )
            if seen is not None and (nearest is None or _sooner(seen, nearest)):
                nearest = seen
        return nearest

    def describe(self, budget: RunBudgetSpec | None = None) -> str:
        """One line for a failure message: spend against the budget's limits."""
        tokens = f"{self.tokens:,} tokens"
        if budget is not None and budget.max_tokens is not None:
            tokens += f" (max_tokens {budget.max_tokens:,})"
        cost = f"${self.cost_usd:.4f}"
        if budget is not None and budget.max_cost_usd is not None:
            cost += f" (max_cost_usd ${budget.max_cost_usd:g})"
        text = f"run spent {tokens} and {cost} over {self.calls} LLM calls"
        if self.partial:
            names = ", ".join(self.unpriced_models or ()) or "?"
            text += f"; cost partial: {self.unpriced_calls} calls of unpriced models ({names})"
        return text

    def to_json(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "tokens": self.tokens,
            "cost_usd": round(self.cost_usd, 6),
            "cost_partial": self.partial,
            "unpriced_calls": self.unpriced_calls,
        }


def _sooner(one: Forecast, other: Forecast) -> bool:
    """Whether ``one`` is the nearer cap: due before not due, then the sooner one."""
    if bool(one.due) != bool(other.due):
        return bool(one.due)
    if one.eta_s is None or other.eta_s is None:
        return other.eta_s is None and one.spent / one.cap > other.spent / other.cap
    return one.eta_s < other.eta_s
