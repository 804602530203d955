"""A run's spend, context pressure and budget, charged one LLM call at a time."""

from __future__ import annotations

from typing import Final

from policies import DetectorSettings, ModelInfo, ModelTable, RunSpend
from supervisor.runs.detection import BUDGET_RULE, PRESSURE_RULE, Detection, detection_at
from supervisor.runs.state import RunState

__all__ = ["Charges", "budget_crossed"]

#: Dependencies whose model table entry is remembered (then forgotten at once).
_MAX_MODELS_MEMO: Final = 4096


class Charges:
    """Prices calls by the policy's model table and reports what crosses a line.

    ``models`` None: no context pressure, no budgets, no cost.
    """

    def __init__(self, models: ModelTable | None) -> None:
        self.models = models
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
    ) -> float | None:
        """One LLM call's tokens: context pressure, then the run's spend against its budget.

        A budget crossing goes to ``over`` when given (a run the fleet counts:
        see :mod:`.fleet`), else to ``found``. Returns the call's cost (None:
        its model has no price, or there is no model table).
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
        return cost

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
