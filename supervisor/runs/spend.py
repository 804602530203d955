"""A run's spend, context pressure and budget, charged one LLM call at a time."""

from __future__ import annotations

from typing import Final

from policies import DetectorSettings, ModelInfo, ModelTable, RunSpend
from supervisor.runs.detection import BUDGET_RULE, PRESSURE_RULE, Detection, detection_at
from supervisor.runs.state import RunState

__all__ = ["Charges"]

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
    ) -> None:
        """One LLM call's tokens: context pressure, then the run's spend against its budget."""
        models = self.models
        if models is None:
            return
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
        spend.add_known(run.model, info, prompt, completion)
        budget = settings.budget
        if budget is None:
            return
        crossed = spend.crossed(budget)
        if crossed is not None:
            found.append(
                detection_at(
                    run,
                    span_id,
                    dependency,
                    kind="budget_exceeded",
                    failure_class="permanent",
                    rule=BUDGET_RULE,
                    message=f"{crossed}: {spend.describe(budget)}",
                    details={"crossed": crossed, **spend.to_json()},
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
