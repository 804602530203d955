"""The run detectors' settings: per policy, with overrides per service.

``detectors:`` in a policy file sets loop and stall detection for every
service, and ``services:`` overrides them for services matching a glob (the
first matching glob wins, key by key: a service override that sets only
``stalls`` keeps the loop settings above it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies._cascade import CascadeSettings
from policies._glob import GlobSet
from policies._model_table import ModelTable
from policies._schema import (
    CascadesSpec,
    DetectorsSpec,
    LoopsSpec,
    ServiceDetectorsSpec,
    StallsSpec,
)
from policies._schema_budgets import (
    ContextPressureSpec,
    RunBudgetSpec,
    ServiceBudgets,
    ServiceBudgetSpec,
    SloSpec,
)

__all__ = ["DetectorSettings", "DetectorsSpec", "compile_detectors"]


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """What one service's runs are checked for (see :mod:`supervisor.runs`)."""

    loops: bool = True
    loop_repeats: int = 3
    loop_window: int = 20
    stalls: bool = True
    #: A fixed stall limit (None: from the service's rhythm, see supervisor.runs.rhythm).
    idle_seconds: float | None = None
    idle_multiple: float = 4.0
    min_idle_s: float = 30.0
    max_idle_s: float = 600.0
    #: Context pressure: the share of the model's window (None: not checked).
    pressure_share: float | None = 0.9
    #: The run budget (None: not checked).
    budget: RunBudgetSpec | None = None
    #: What all the service's runs may spend over a window (None: not checked).
    service_budget: ServiceBudgetSpec | None = None
    #: Re-anchoring: from this many steps (or minutes) on, every ``reanchor_every`` steps.
    reanchor_after: int | None = None
    reanchor_after_s: float | None = None
    reanchor_every: int = 10


class CompiledDetectors:
    """Settings by service, resolved once per service name by the caller's memo."""

    __slots__ = (
        "_base",
        "_service_budgets",
        "_services",
        "budget",
        "cascades",
        "models",
        "pressure",
        "slo",
    )

    def __init__(
        self,
        base: ServiceDetectorsSpec,
        services: list[tuple[GlobSet, ServiceDetectorsSpec]],
        *,
        pressure: ContextPressureSpec | None = None,
        budget: RunBudgetSpec | None = None,
        cascades: CascadesSpec | None = None,
        slo: SloSpec | None = None,
        service_budgets: ServiceBudgets | None = None,
    ) -> None:
        self._base = base
        #: Per service glob, what its runs may spend together (first match wins).
        self._service_budgets = [
            (GlobSet([glob]), spec) for glob, spec in (service_budgets or {}).items()
        ]
        #: The run SLO every service is held to (None: no SLOs).
        self.slo = slo
        spec = cascades or CascadesSpec()
        #: Cascade detection across runs (policies._cascade).
        self.cascades = CascadeSettings(
            enabled=spec.enabled,
            window_s=spec.window_s,
            min_failures=spec.min_failures,
            min_runs=spec.min_runs,
            min_error_rate=spec.min_error_rate,
        )
        self._services = services
        self.pressure = pressure or ContextPressureSpec()
        self.budget = budget or RunBudgetSpec()
        #: Context windows and prices: the built-in table under the policy's overrides.
        self.models = ModelTable.builtin(self.pressure.models)

    @property
    def shortest_idle_s(self) -> float:
        """The shortest silence that can be a stall in any service (inf: stalls off)."""
        specs = [self._base.stalls or StallsSpec()]
        specs += [spec.stalls for _, spec in self._services if spec.stalls is not None]
        return min(
            (
                s.min_idle_s if s.idle_seconds is None else s.idle_seconds
                for s in specs
                if s.enabled
            ),
            default=math.inf,
        )

    def for_service(self, service: str) -> DetectorSettings:
        loops, stalls = self._base.loops or LoopsSpec(), self._base.stalls or StallsSpec()
        anchor = self._base.reanchor
        for globs, spec in self._services:
            if globs(service):
                loops = spec.loops or loops
                stalls = spec.stalls or stalls
                anchor = spec.reanchor or anchor
                break
        anchoring = anchor is not None and anchor.enabled
        return DetectorSettings(
            loops=loops.enabled,
            loop_repeats=loops.repeats,
            loop_window=loops.window,
            stalls=stalls.enabled,
            idle_seconds=stalls.idle_seconds,
            idle_multiple=stalls.idle_multiple,
            min_idle_s=stalls.min_idle_s,
            max_idle_s=stalls.max_idle_s,
            pressure_share=self.pressure.share if self.pressure.enabled else None,
            budget=self.budget
            if self.budget.max_tokens is not None or self.budget.max_cost_usd is not None
            else None,
            reanchor_after=anchor.after_steps if anchor is not None and anchoring else None,
            reanchor_after_s=(
                anchor.after_minutes * 60
                if anchor is not None and anchoring and anchor.after_minutes
                else None
            ),
            reanchor_every=anchor.every_steps if anchor is not None else 10,
            service_budget=next(
                (spec for globs, spec in self._service_budgets if globs(service)), None
            ),
        )


def compile_detectors(
    spec: DetectorsSpec | None,
    base: DetectorsSpec | None,
    *,
    pressure: ContextPressureSpec | None = None,
    budget: RunBudgetSpec | None = None,
    slo: SloSpec | None = None,
    service_budgets: ServiceBudgets | None = None,
) -> CompiledDetectors:
    """The file's detectors over the base's (the built-in policy's), key by key."""
    chosen = spec or base or DetectorsSpec()
    merged = ServiceDetectorsSpec(
        loops=chosen.loops or (base.loops if base is not None else None),
        stalls=chosen.stalls or (base.stalls if base is not None else None),
        reanchor=chosen.reanchor or (base.reanchor if base is not None else None),
    )
    return CompiledDetectors(
        merged,
        [(GlobSet([glob]), s) for glob, s in chosen.services.items()],
        pressure=pressure,
        budget=budget,
        cascades=chosen.cascades or (base.cascades if base is not None else None),
        slo=slo,
        service_budgets=service_budgets,
    )
