"""What the runner needs from the sidecar: the actuator interface and a read-only view.

Remediators never touch the store, the receivers or the pipeline. The sidecar
(:mod:`supervisor.remediation`) implements this protocol over them; tests use
:class:`RecordingGateway`, a fake with the same behaviour kept in memory.

Every method is synchronous and short (a SQLite transaction at most) and
safe to call from the runner's thread. Methods that create something take
an idempotency ``key``: the runner derives it from the remediation and the
call's position, so a call repeated after a crash creates nothing new.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from remediators.base import Trigger

__all__ = ["Gateway", "RecordingGateway"]


class Gateway(Protocol):
    def send_command(
        self, trigger: Trigger, command: str, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        """Store an agent command (``retry_step``, ...) for delivery; what was stored."""
        ...

    def open_approval(
        self, trigger: Trigger, body: Mapping[str, Any], *, key: str, remediation_id: str
    ) -> dict[str, Any]:
        """Open an approval request for a person (and notify); its ``approval_id``."""
        ...

    def recent_spans(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        """The run's recent spans the sidecar saw (failures and spans watched since)."""
        ...

    def incident_history(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        """Earlier incidents of the same run or dependency, newest first."""
        ...

    def breaker_states(self) -> list[dict[str, Any]]: ...

    def fallback_chain(self, dependency: str) -> Sequence[str] | None:
        """The policy's chain that ``dependency`` belongs to, or None."""
        ...

    def restart_allowed(self, trigger: Trigger) -> tuple[bool, str]:
        """Whether restart intensity allows one more restart of this run, and why not."""
        ...

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        """Tell the remediation when the run's later spans show the failed part succeeding."""
        ...

    def unwatch(self, remediation_id: str) -> None: ...


@dataclass
class RecordingGateway:
    """An in-memory :class:`Gateway` for tests: records what a remediation asked for.

    Commands and approvals are keyed like the real store, so a repeated key
    adds nothing; ``chains`` and ``breakers`` are what the read tools return.
    """

    chains: dict[str, list[str]] = field(default_factory=dict)
    breakers: list[dict[str, Any]] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    restarts_left: int = 3
    commands: dict[str, dict[str, Any]] = field(default_factory=dict)
    approvals: dict[str, dict[str, Any]] = field(default_factory=dict)
    watched: dict[str, Trigger] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def send_command(
        self, trigger: Trigger, command: str, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        with self._lock:
            stored = self.commands.setdefault(
                key, {"command": command, "params": dict(params), "run_id": trigger.run_id}
            )
        return {"command_id": f"cmd_{key[:24]}", "type": stored["command"], "status": "pending"}

    def open_approval(
        self, trigger: Trigger, body: Mapping[str, Any], *, key: str, remediation_id: str
    ) -> dict[str, Any]:
        approval_id = f"apr_{key[:24]}"
        with self._lock:
            self.approvals.setdefault(approval_id, {"body": dict(body), "by": remediation_id})
        return {"approval_id": approval_id, "status": "pending"}

    def recent_spans(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        return self.spans[-limit:]

    def incident_history(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        return []

    def breaker_states(self) -> list[dict[str, Any]]:
        return list(self.breakers)

    def fallback_chain(self, dependency: str) -> Sequence[str] | None:
        return self.chains.get(dependency)

    def restart_allowed(self, trigger: Trigger) -> tuple[bool, str]:
        with self._lock:
            if self.restarts_left <= 0:
                return False, "restart intensity exceeded"
            self.restarts_left -= 1
        return True, ""

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        with self._lock:
            self.watched[remediation_id] = trigger

    def unwatch(self, remediation_id: str) -> None:
        with self._lock:
            self.watched.pop(remediation_id, None)
