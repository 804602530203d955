"""The recoveries remediations wait for: which (run, dependency) successes to look for.

:class:`RecoveryWatch` is what the pipeline asks on the success path: the
dependencies some remediation waits to see succeed in a run. Only those
dependencies' successes are looked up, so spans pay nothing otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_MAX_WATCHED = 10_000


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
        #: Watches refused because ``_MAX_WATCHED`` were already kept.
        self.overflow = 0

    def watch(self, runs: Sequence[str], dependency: str, remediation_id: str) -> None:
        with self._lock:
            if len(self._keys_of) >= _MAX_WATCHED and remediation_id not in self._keys_of:
                self.overflow += 1
                return
            keys = [(run, dependency) for run in dict.fromkeys(runs) if run]
            self._keys_of[remediation_id] = keys
            for key in keys:
                self.waiting.setdefault(key, set()).add(remediation_id)
            self.dependencies.add(dependency)

    def unwatch(self, remediation_id: str) -> None:
        with self._lock:
            for key in self._keys_of.pop(remediation_id, []):
                waiting = self.waiting.get(key)
                if waiting is not None:
                    waiting.discard(remediation_id)
                    if not waiting:
                        del self.waiting[key]
            self.dependencies.intersection_update(dep for _, dep in self.waiting)

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

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys_of)
