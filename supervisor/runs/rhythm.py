"""How long a silence is a stall, from each service's own rhythm.

An interactive agent sends spans every few seconds; a batch job may wait
minutes on one model call. One fixed ``idle_seconds`` either notices the
first late or harasses the second, so by default the limit is a multiple of
the longest silence seen between a run's requests, between a floor and a
ceiling (policy ``detectors.stalls``: ``idle_multiple``, ``min_idle_s``,
``max_idle_s``). The longest silence is the run's own, or its service's
usual long one (the second longest of the last few dozen, so one stall
that came back does not raise everyone's limit), whichever is longer. A
policy that sets ``idle_seconds`` fixes the number.

A silence counts only while a run is open: the backoff the sidecar asked
for, or a pause, says nothing of the agent's rhythm.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from policies import DetectorSettings

__all__ = ["MIN_GAP_S", "Rhythm", "idle_limit"]

#: Silences shorter than this are one export split in several requests, not a rhythm.
MIN_GAP_S: Final = 0.5
#: Silences remembered per service, and services remembered.
_KEEP: Final = 64
_MAX_SERVICES: Final = 1024
#: With nothing seen yet of a service's rhythm, the floor times this.
_UNKNOWN_FACTOR: Final = 4.0


class Rhythm:
    """The recent silences of each service's runs (bounded; the pipeline's thread only)."""

    def __init__(self) -> None:
        self._gaps: dict[str, deque[float]] = {}
        self._long: dict[str, float] = {}

    def gap(self, service: str, seconds: float) -> None:
        """A run of ``service`` was silent for ``seconds`` between two requests."""
        gaps = self._gaps.get(service)
        if gaps is None:
            if len(self._gaps) >= _MAX_SERVICES:
                self._gaps.clear()
                self._long.clear()
            gaps = self._gaps[service] = deque(maxlen=_KEEP)
        gaps.append(seconds)
        self._long.pop(service, None)

    def long_gap(self, service: str) -> float:
        """The service's usual long silence (0: none seen)."""
        found = self._long.get(service)
        if found is None:
            gaps = self._gaps.get(service)
            if not gaps:
                return 0.0
            ranked = sorted(gaps, reverse=True)
            found = self._long[service] = ranked[1] if len(ranked) > 1 else ranked[0]
        return found


def idle_limit(settings: DetectorSettings, run_gap: float, service_gap: float) -> float:
    """The silence after which a run with these silences is stalled (see the module)."""
    if settings.idle_seconds is not None:
        return settings.idle_seconds
    known = max(run_gap, service_gap)
    if known <= 0:
        guess = settings.min_idle_s * _UNKNOWN_FACTOR
        return min(settings.max_idle_s, guess)
    return min(settings.max_idle_s, max(settings.min_idle_s, settings.idle_multiple * known))
