"""Policy-file models of the money and time checks: context pressure, run budgets, SLOs.

``context_pressure``, ``run_budget`` and ``slo`` in a policy file, and the
packaged model table (``model_tables.yaml``) that gives each model its context
window and list prices. Models only: :mod:`policies._model_table`,
:mod:`policies._spend` and :mod:`policies._slo` run them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from policies._schema_fields import Glob, Version, _set, _Strict

__all__ = [
    "MAX_PRICE_PER_MTOK",
    "MAX_SLO_WINDOW_S",
    "MAX_WINDOW_TOKENS",
    "ContextPressureSpec",
    "ModelInfoSpec",
    "ModelOverrides",
    "ModelTableFile",
    "RunBudgetSpec",
    "ServiceBudgetSpec",
    "ServiceBudgets",
    "SloSpec",
]

MAX_WINDOW_TOKENS = 100_000_000
MAX_PRICE_PER_MTOK = 100_000.0
MAX_SLO_WINDOW_S = 30 * 86_400.0


class ModelInfoSpec(_Strict):
    """One model's context window and list prices (USD per million tokens).

    Prices come together or not at all: a model without them (self-hosted,
    experimental, unknown) still has a window for context pressure, and its
    calls make a run's cost *partial*. A self-hosted model that costs nothing
    is ``input_per_mtok: 0, output_per_mtok: 0``.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"allOf": [_set("input_per_mtok"), _set("output_per_mtok")]},
                {"not": {"anyOf": [_set("input_per_mtok"), _set("output_per_mtok")]}},
            ]
        }
    )

    context_window: int = Field(
        gt=0, le=MAX_WINDOW_TOKENS, description="Input tokens the model accepts, in all."
    )
    input_per_mtok: float | None = Field(
        default=None, ge=0, le=MAX_PRICE_PER_MTOK, description="USD per 1M input tokens."
    )
    output_per_mtok: float | None = Field(
        default=None, ge=0, le=MAX_PRICE_PER_MTOK, description="USD per 1M output tokens."
    )

    @model_validator(mode="after")
    def _prices_together(self) -> ModelInfoSpec:
        if (self.input_per_mtok is None) != (self.output_per_mtok is None):
            raise ValueError("give both input_per_mtok and output_per_mtok, or neither")
        return self


ModelOverrides = Annotated[dict[Glob, ModelInfoSpec], Field(max_length=256)]


class ModelTableFile(_Strict):
    """The packaged ``model_tables.yaml``: ordered globs over model names, first match wins."""

    version: Version
    models: Annotated[dict[Glob, ModelInfoSpec], Field(min_length=1, max_length=1000)]


class ContextPressureSpec(_Strict):
    """Predict a context overflow: an LLM call's input tokens reach ``share`` of the window.

    ``models`` overrides or extends the built-in model table (windows *and*
    prices, so it also serves run budgets and SLO costs): its globs are tried
    before the built-in ones, in order, first match wins.
    """

    enabled: bool = True
    share: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Fraction of the context window whose use counts as pressure (0 < share <= 1).",
    )
    models: ModelOverrides = Field(
        default_factory=dict,
        description="Model-name glob -> {context_window, input_per_mtok, output_per_mtok};"
        " tried before the built-in table, first match wins.",
    )


_FORECAST_S = Field(
    default=60.0,
    ge=0,
    le=86_400,
    description="Act before the cap: when the recent burn rate reaches it within this many"
    " seconds, or one more call of the average cost would cross it; 0: only once crossed.",
)


class RunBudgetSpec(_Strict):
    """What one run may spend before it is stopped: ``permanent / budget_exceeded``.

    A budget is crossed when the run's spend goes *above* the limit (a run
    that spends exactly ``max_tokens`` is within it). Unset limits are not
    checked; with neither set there is no budget. Cost is counted only for
    models the table prices; tokens of the others still count.

    Before it is crossed, a *forecast* (``permanent / budget_forecast``, once
    per run) gets the same action when the cap is ``forecast_s`` away at the
    run's recent burn rate, or one more call of its average cost would cross it
    (:mod:`policies._forecast`); the crossing stays reported as a backstop.
    """

    max_tokens: int | None = Field(
        default=None, gt=0, le=10**12, description="Input plus output tokens per run."
    )
    max_cost_usd: float | None = Field(default=None, gt=0, le=1_000_000, description="USD per run.")
    action: Literal["escalate", "abort_run"] = Field(
        default="escalate", description="What a crossed or forecast budget leads to."
    )
    forecast_s: float = _FORECAST_S


class ServiceBudgetSpec(_Strict):
    """What all runs of one service may spend over a sliding window (one sidecar's count).

    Counted per service name (a glob's services each have their own cap). When
    the window's spend is forecast to reach a cap (as a run budget's
    ``forecast_s``) or has crossed it, every run of the service gets ``action``
    at its next LLM call, once per run, until the window's spend falls back.
    """

    max_tokens: int | None = Field(
        default=None, gt=0, le=10**15, description="Input plus output tokens in the window."
    )
    max_cost_usd: float | None = Field(
        default=None, gt=0, le=1_000_000_000, description="USD in the window."
    )
    window_s: float = Field(
        default=86_400.0, ge=60, le=MAX_SLO_WINDOW_S, description="The sliding window, seconds."
    )
    action: Literal["escalate", "abort_run"] = Field(
        default="escalate", description="What the service's runs get when the cap is near."
    )
    forecast_s: float = _FORECAST_S

    @model_validator(mode="after")
    def _some_cap(self) -> ServiceBudgetSpec:
        if self.max_tokens is None and self.max_cost_usd is None:
            raise ValueError("give max_tokens, max_cost_usd or both")
        return self


#: ``service_budgets:``: service glob -> its budget; the first matching glob wins.
ServiceBudgets = Annotated[dict[Glob, ServiceBudgetSpec], Field(max_length=256)]


class SloSpec(_Strict):
    """A service's run SLO, judged over a short and a long sliding window.

    A run is *good* when it succeeded and, where they are set, took no longer
    than ``max_duration_s`` and cost no more than ``max_cost_usd_per_run``. The
    SLO is that a share ``success_target`` of runs are good; its error budget is
    ``1 - success_target``.

    The *burn rate* of a window is how fast it spends that budget: the share of
    bad runs divided by the budget, ``(1 - success) / (1 - target)``. A burn
    rate of 1 spends the budget exactly over the SLO period; 14.4 spends 2 % of a
    30-day budget in one hour, the "fast burn" threshold of Google's SRE
    workbook (chapter "Alerting on SLOs"), paired there with a 1-hour long window
    and a 5-minute short one, the defaults here.

    The alert is the workbook's multi-window rule: burning fast means *both*
    windows burn above ``burn_alert``. The long window says the budget is really
    going; the short one says it is still going now, so the condition clears
    within minutes of a recovery instead of an hour later. ``min_runs`` keeps a
    quiet service from burning on one failed run out of one: the long window
    needs that many runs before it can burn at all.

    ``burn_alert`` must be below ``1 / (1 - success_target)``, the burn rate of
    a window where every run is bad, or the alert could never fire (with a 0.9
    target the highest burn rate is 10, below the default 14.4).
    """

    success_target: float = Field(
        default=0.95, gt=0, lt=1, description="Share of runs that must be good (0 < target < 1)."
    )
    max_duration_s: float | None = Field(
        default=None, gt=0, le=MAX_SLO_WINDOW_S, description="A run longer than this is bad."
    )
    max_cost_usd_per_run: float | None = Field(
        default=None, gt=0, le=1_000_000, description="A run that costs more is bad."
    )
    short_window_s: float = Field(default=300.0, ge=60, le=86_400)
    long_window_s: float = Field(default=3600.0, ge=60, le=MAX_SLO_WINDOW_S)
    burn_alert: float = Field(
        default=14.4,
        gt=0,
        le=1000,
        description="Burn rate above which both windows must be to burn fast (14.4: Google SRE).",
    )
    min_runs: int = Field(
        default=10, ge=1, le=1_000_000, description="Runs the long window needs to burn at all."
    )

    @model_validator(mode="after")
    def _coherent(self) -> SloSpec:
        if self.long_window_s <= self.short_window_s:
            raise ValueError(
                f"long_window_s ({self.long_window_s:g}) must be longer than"
                f" short_window_s ({self.short_window_s:g})"
            )
        ceiling = 1.0 / (1.0 - self.success_target)
        if self.burn_alert >= ceiling:
            raise ValueError(
                f"burn_alert {self.burn_alert:g} can never be reached: with success_target"
                f" {self.success_target:g} the highest burn rate is {ceiling:.4g}"
            )
        return self
