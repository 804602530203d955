"""The recoveries remediations wait for: which (run, dependency) successes to look for.

:class:`RecoveryWatch` is what the pipeline asks on the success path: the
dependencies some remediation waits to see succeed in a run. Only those
dependencies' successes are looked up, so spans pay nothing otherwise.

A run whose root span ended OK has recovered too, whatever it called last
(:data:`~supervisor.records.RUN_ENDED_OK`, watched beside the dependency).
The pipeline tells the watch of every such end (:meth:`RecoveryWatch.ended`),
and the watch remembers the last few thousand traces that ended: a short run
often sends its failing span and its root in one batch, so its end is seen
before the remediation for that failure starts watching.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from supervisor.records import RUN_ENDED_OK

_MAX_WATCHED: Final = 10_000
#: Traces whose end is remembered, per generation (two are kept: the older is
#: dropped whole when the newer fills). At a thousand traces a second that is
#: seconds of memory, more than a remediation takes to start after its failure.
_MAX_ENDED: Final = 4096


class RecoveryWatch:
    """(run, dependency) pairs that remediations wait to see succeed; see the module.

    ``dependencies`` and ``waiting`` are read by the pipeline without a
    lock (a set and a dict lookup); they are changed only under the lock.
    """

    def __init__(self, notify: Callable[[str, Mapping[str, Any]], None]) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self.dependencies: set[str] = set()
        #: (run, dependency) -> the remediations waiting for it to succeed.
        self.waiting: dict[tuple[str, str], set[str]] = {}
        self._keys_of: dict[str, list[tuple[str, str]]] = {}
        #: trace id -> its root span's id, for traces that ended OK lately (two generations).
        self._ended: dict[str, str] = {}
        self._ended_before: dict[str, str] = {}
        #: Watches refused because ``_MAX_WATCHED`` were already kept.
        self.overflow = 0

    def watch(self, runs: Sequence[str], dependency: str, remediation_id: str) -> None:
        """Wait for ``dependency`` to succeed, or the run to end OK, in any of ``runs``.

        A run (by its trace id) that ended OK lately is a recovery at once.
        """
        with self._lock:
            if len(self._keys_of) >= _MAX_WATCHED and remediation_id not in self._keys_of:
                self.overflow += 1
                return
            named = [run for run in dict.fromkeys(runs) if run]
            keys = [(run, what) for run in named for what in (dependency, RUN_ENDED_OK)]
            self._keys_of[remediation_id] = keys
            for key in keys:
                self.waiting.setdefault(key, set()).add(remediation_id)
            self.dependencies.add(dependency)
        for run in named:
            root = self._ended.get(run) or self._ended_before.get(run)
            if root is not None:
                self.unwatch(remediation_id)
                self._notify(
                    remediation_id, {"run": run, "dependency": RUN_ENDED_OK, "span_id": root}
                )
                return

    def unwatch(self, remediation_id: str) -> None:
        with self._lock:
            for key in self._keys_of.pop(remediation_id, []):
                waiting = self.waiting.get(key)
                if waiting is not None:
                    waiting.discard(remediation_id)
                    if not waiting:
                        del self.waiting[key]
            self.dependencies.intersection_update(
                dep for _, dep in self.waiting if dep != RUN_ENDED_OK
            )

    def succeeded(self, run: str, dependency: str, span_id: str) -> None:
        """A span of ``run`` shows ``dependency`` succeeding (from the pipeline's thread).

        Each waiting remediation is told once: later successes before it
        unwatches would only pile up messages nobody receives.
        """
        with self._lock:
            waiting = list(self.waiting.get((run, dependency), ()))
        for remediation_id in waiting:
            self.unwatch(remediation_id)
            self._notify(remediation_id, {"run": run, "dependency": dependency, "span_id": span_id})

    def ended(self, trace_id: str, run: str, span_id: str) -> None:
        """A root span of ``run`` (in trace ``trace_id``) ended OK (from the pipeline's thread).

        Remembered by trace (bounded), then told like a success to the
        remediations waiting for the run or the trace.
        """
        ended = self._ended
        if len(ended) >= _MAX_ENDED:
            self._ended_before = ended
            ended = self._ended = {}
        ended[trace_id] = span_id
        waiting = self.waiting
        if (run, RUN_ENDED_OK) in waiting:
            self.succeeded(run, RUN_ENDED_OK, span_id)
        if run != trace_id and (trace_id, RUN_ENDED_OK) in waiting:
            self.succeeded(trace_id, RUN_ENDED_OK, span_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys_of)
