"""A run's spend, context pressure and budget, charged one LLM call at a time."""

from __future__ import annotations

from typing import Final

from policies import (
    SERVICE_BUDGET_RULE,
    DetectorSettings,
    Forecast,
    ModelInfo,
    ModelTable,
    RunSpend,
    ServiceSpend,
)
from supervisor.runs.detection import BUDGET_RULE, PRESSURE_RULE, Detection, detection_at
from supervisor.runs.fleet_services import FleetServices
from supervisor.runs.state import RunState

__all__ = ["Charges", "budget_crossed", "budget_forecast"]

#: Dependencies whose model table entry is remembered (then forgotten at once).
_MAX_MODELS_MEMO: Final = 4096


class Charges:
    """Prices calls by the policy's model table and reports what crosses a line.

    ``models`` None: no context pressure, no budgets, no cost. ``services``:
    each service's spend over its budget's window (kept when the table changes),
    this sidecar's; ``fleet``: the fleet's, which decides while it has a current
    view of the service (see :mod:`.fleet_services`).
    """

    def __init__(
        self,
        models: ModelTable | None,
        services: ServiceSpend | None = None,
        fleet: FleetServices | None = None,
    ) -> None:
        self.models = models
        self.services = ServiceSpend() if services is None else services
        self.fleet = fleet
        #: Runs stopped by a forecast of their own budget, and by their service's budget.
        self.forecasts = 0
        self.service_stops = 0
        #: dependency -> its table entry: the table's own lookup takes a lock and
        #: tries several spellings, once per run otherwise.
        self._known: dict[str, ModelInfo | None] = {}

    def charge(
        self,
        run: RunState,
        span_id: bytes,
        dependency: str,
        prompt: int,
        completion: int,
        *,
        settings: DetectorSettings,
        found: list[Detection],
        over: list[Detection] | None = None,
        at: float | None = None,
        now: float = 0.0,
    ) -> float | None:
        """One LLM call's tokens: context pressure, then the run's spend against its budget
        and its service's.

        A budget crossing goes to ``over`` when given (a run the fleet counts:
        see :mod:`.fleet`), else to ``found``, with the forecast (from ``at``:
        when the call ended), which a run the fleet counts does not get; a
        service's budget's stop too (the fleet then reports it once for the
        run, whichever sidecars see it). ``now``: the wall clock, for the
        service's window (the fleet's buckets are the wall clock's). Returns the
        call's cost (None: its model has no price, or there is no model table).
        """
        models = self.models
        if models is None:
            return None
        if dependency != run.model:  # a run calls the same model, most of the time
            run.model, run.model_info = dependency, self._info(models, dependency)
        info = run.model_info
        share = settings.pressure_share
        if (
            info is not None
            and share is not None
            and not run.pressured
            and prompt >= share * info.context_window
        ):
            run.pressured = True  # once per run: every later call would say the same
            window = info.context_window
            model = dependency.partition(":")[2]
            found.append(
                detection_at(
                    run,
                    span_id,
                    dependency,
                    kind="context_overflow",
                    failure_class="model",
                    rule=PRESSURE_RULE,
                    message=f"{prompt:,} input tokens are {prompt / window:.0%} of {model}'s"
                    f" {window:,}-token context window",
                    details={
                        "input_tokens": prompt,
                        "context_window": window,
                        "share": round(prompt / window, 4),
                    },
                )
            )
        spend = run.spend
        if spend is None:
            spend = run.spend = RunSpend()
        # The dependency names the model in the list of unpriced ones (provider:model).
        cost = spend.add_known(run.model, info, prompt, completion)
        if at is not None and settings.budget is not None:  # a rate only a forecast reads
            spend.burned(at, cost, prompt + completion)
        if settings.service_budget is not None:
            self._service(
                run,
                span_id,
                dependency,
                cost=cost,
                tokens=prompt + completion,
                settings=settings,
                now=now,
                found=found if over is None else over,
            )
        budget = settings.budget
        if budget is None:
            return cost
        crossed = spend.crossed(budget)
        if crossed is not None:
            (found if over is None else over).append(
                budget_crossed(
                    run,
                    span_id=span_id,
                    dependency=dependency,
                    crossed=crossed,
                    spend=spend,
                    settings=settings,
                )
            )
        elif over is None and (due := spend.forecast_due(budget)) is not None:
            # A session the fleet counts is forecast nowhere: this sidecar sees part of
            # its spend and its rate, and the fleet's crossing is the one that holds.
            self.forecasts += 1
            found.append(
                budget_forecast(run, span_id=span_id, dependency=dependency, due=due, spend=spend)
            )
        return cost

    def _service(
        self,
        run: RunState,
        span_id: bytes,
        dependency: str,
        *,
        cost: float | None,
        tokens: int,
        settings: DetectorSettings,
        now: float,
        found: list[Detection],
    ) -> None:
        """The call in its service's window: while the service's cap is near or crossed,
        each of its runs is reported once, at its next LLM call."""
        spec = settings.service_budget
        assert spec is not None
        outlook = self.services.charge(run.service, spec, now=now, cost=cost or 0.0, tokens=tokens)
        fleet = self.fleet
        if fleet is not None:  # the fleet's count decides while it is current
            shared = fleet.charge(run.service, spec, now=now, cost=cost or 0.0, tokens=tokens)
            if shared is not None:
                outlook = shared
        if not outlook.stop or run.service_stopped:
            return
        run.service_stopped = True
        self.service_stops += 1
        found.append(
            detection_at(
                run,
                span_id,
                dependency,
                kind="budget_exceeded" if outlook.crossed else "budget_forecast",
                failure_class="permanent",
                rule=SERVICE_BUDGET_RULE,
                message=outlook.describe(spec),
                details=outlook.to_json(),
            )
        )

    def _info(self, models: ModelTable, dependency: str) -> ModelInfo | None:
        known = self._known
        if dependency in known:
            return known[dependency]
        info = models.lookup(dependency.partition(":")[2])
        if len(known) >= _MAX_MODELS_MEMO:
            known.clear()
        known[dependency] = info
        return info


def budget_crossed(
    run: RunState,
    *,
    span_id: bytes,
    dependency: str,
    crossed: str,
    spend: RunSpend,
    settings: DetectorSettings,
) -> Detection:
    """``run``'s ``spend`` went over its settings' budget (``crossed``: which kinds)."""
    budget = settings.budget
    return detection_at(
        run,
        span_id,
        dependency,
        kind="budget_exceeded",
        failure_class="permanent",
        rule=BUDGET_RULE,
        message=f"{crossed}: {spend.describe(budget)}",
        details={"crossed": crossed, **spend.to_json()},
    )


def budget_forecast(
    run: RunState, *, span_id: bytes, dependency: str, due: Forecast, spend: RunSpend
) -> Detection:
    """``run``'s ``spend`` will reach its budget soon (``due`` says which cap, how soon)."""
    return detection_at(
        run,
        span_id,
        dependency,
        kind="budget_forecast",
        failure_class="permanent",
        rule=BUDGET_RULE,
        message=f"{due.describe()}: {spend.describe()}",
        details={"forecast": due.to_json(), **spend.to_json()},
    )
