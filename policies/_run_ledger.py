"""Every open run's spend, in one bounded map (run id -> :class:`RunSpend`)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from policies._model_table import ModelTable
from policies._spend import RunSpend

__all__ = ["RunLedger"]


class RunLedger:
    """A bounded map of run id -> :class:`RunSpend`.

    Lifecycle: a run gets a ``RunSpend`` on its first ``add``; ``forget`` drops
    it when the run is over and returns its final spend (for the SLO's cost per
    run). Bounded: at most ``max_runs`` runs; a new run beyond that evicts the
    least recently active one (counted in ``evictions``), whose spend starts
    again from zero if it comes back, so its budget may be reported again.

    ``table`` is read on every ``add``; a policy reload may replace it.
    Thread-safety: meant for one thread; every method holds a lock all the same.
    """

    def __init__(self, table: ModelTable, *, max_runs: int = 10_000) -> None:
        if not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs!r}")
        self.table = table
        self.max_runs = max_runs
        self._runs: OrderedDict[str, RunSpend] = OrderedDict()
        self._lock = threading.Lock()
        #: Runs evicted to make room (least recently active first).
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._runs)

    def add(
        self, run_id: str, model: str, input_tokens: int | None, output_tokens: int | None
    ) -> RunSpend:
        """Count one LLM call of ``run_id``; the run's spend after it."""
        with self._lock:
            runs = self._runs
            spend = runs.get(run_id)
            if spend is None:
                spend = runs[run_id] = RunSpend()
                if len(runs) > self.max_runs:
                    runs.popitem(last=False)
                    self.evictions += 1
            else:
                runs.move_to_end(run_id)
            spend.add(model, input_tokens, output_tokens, self.table)
            return spend

    def get(self, run_id: str) -> RunSpend | None:
        """``run_id``'s spend (does not change recency)."""
        with self._lock:
            return self._runs.get(run_id)

    def forget(self, run_id: str) -> RunSpend | None:
        """Drop ``run_id`` (the run is over); its final spend, if it had one."""
        with self._lock:
            return self._runs.pop(run_id, None)
