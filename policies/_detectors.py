"""The run detectors' settings: per policy, with overrides per service.

``detectors:`` in a policy file sets loop and stall detection for every
service, and ``services:`` overrides them for services matching a glob (the
first matching glob wins, key by key: a service override that sets only
``stalls`` keeps the loop settings above it).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies._glob import GlobSet
from policies._schema import DetectorsSpec, LoopsSpec, ServiceDetectorsSpec, StallsSpec

__all__ = ["DetectorSettings", "DetectorsSpec", "compile_detectors"]


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """What one service's runs are checked for (see :mod:`supervisor.runs`)."""

    loops: bool = True
    loop_repeats: int = 3
    loop_window: int = 20
    stalls: bool = True
    idle_seconds: float = 600.0


class CompiledDetectors:
    """Settings by service, resolved once per service name by the caller's memo."""

    __slots__ = ("_base", "_services")

    def __init__(
        self,
        base: ServiceDetectorsSpec,
        services: list[tuple[GlobSet, ServiceDetectorsSpec]],
    ) -> None:
        self._base = base
        self._services = services

    def for_service(self, service: str) -> DetectorSettings:
        loops, stalls = self._base.loops or LoopsSpec(), self._base.stalls or StallsSpec()
        for globs, spec in self._services:
            if globs(service):
                loops = spec.loops or loops
                stalls = spec.stalls or stalls
                break
        return DetectorSettings(
            loops=loops.enabled,
            loop_repeats=loops.repeats,
            loop_window=loops.window,
            stalls=stalls.enabled,
            idle_seconds=stalls.idle_seconds,
        )


def compile_detectors(spec: DetectorsSpec | None, base: DetectorsSpec | None) -> CompiledDetectors:
    """The file's detectors over the base's (the built-in policy's), key by key."""
    chosen = spec or base or DetectorsSpec()
    merged = ServiceDetectorsSpec(
        loops=chosen.loops or (base.loops if base is not None else None),
        stalls=chosen.stalls or (base.stalls if base is not None else None),
    )
    return CompiledDetectors(merged, [(GlobSet([glob]), s) for glob, s in chosen.services.items()])
