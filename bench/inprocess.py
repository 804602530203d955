"""The span path run in process, as ``Sidecar.handle`` runs it, for benchmarks that look inside.

``bench/instructions.py`` counts its instructions under valgrind and
``bench/stages.py`` times its stages; both drive it through these two
functions, so they measure the same work. The store's write, which the
sidecar hands to a thread of its own, is made here, on the caller's thread,
where it is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.detectors import POLICY

SPANS_PER_REQUEST = 500


def make_sidecar(folder: Path, *, track: bool, tracked_runs: int) -> Any:
    """A sidecar with ``detectors.py``'s policy and its store in ``folder`` (not started)."""
    from policies import load_policy
    from supervisor.settings import load_settings
    from supervisor.wiring import build_sidecar

    policy = folder / "policy.yaml"
    policy.write_text(POLICY)
    settings = load_settings(
        None,
        {
            "state_path": str(folder / f"state-{track}.db"),
            "track_runs": track,
            "tracked_runs": tracked_runs,
        },
    )
    return build_sidecar(settings, load_policy(policy))


def _no_clock() -> float:
    return 0.0


def handle(
    sidecar: Any, payload: bytes, received_ns: int, clock: Callable[[], float] = _no_clock
) -> tuple[float, float, float, int]:
    """One request judged, reported and stored: (judge, report, store) by ``clock``, failures."""
    from supervisor.judge.steps import drive

    pipeline = sidecar.pipeline
    t0 = clock()
    outcomes, rest = pipeline.first_pass(payload, received_ns)
    t1 = clock()
    drive(sidecar._report(outcomes, received_ns))
    t2 = clock()
    later = pipeline.rest_pass(rest)
    t3 = clock()
    drive(sidecar._report(later, received_ns))
    t4 = clock()
    sidecar.actor.store_outcomes(outcomes + later)
    t5 = clock()
    sidecar.collector.between_batches()  # as the sidecar's worker does, outside the figures
    return (t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3), t5 - t4, len(outcomes) + len(later)
