"""What the runner needs from the sidecar: the actuator interface and a read-only view.

Remediators never touch the store, the receivers or the pipeline. The sidecar
(:mod:`supervisor.remediation.gateway`) implements this protocol over them; tests use
:class:`RecordingGateway`, a fake with the same behaviour kept in memory.

Every method is synchronous and safe to call from the runner's tool
threads; all but :meth:`Gateway.restart_worker` are short (a SQLite
transaction at most), and that one is bounded by its program's time limit.
Methods that act take an idempotency ``key``: the runner derives it from the
remediation and the call's position, and records each call's result as a
durable step, so a call repeated after a crash creates nothing new and a
replayed remediation does not act again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from remediators.base import Trigger
from supervisor.act.actuators.command import CommandActuator

__all__ = ["Gateway", "RecordingGateway", "WorkerRestart"]


@dataclass(frozen=True, slots=True)
class WorkerRestart:
    """The program that restarts a run's worker, as a remediator's policy ``params`` give it.

    ``argv`` (required; ``{run_id}``, ``{service}``... placeholders as whole
    arguments, run without a shell), ``timeout_s`` (default 60), ``env``. It
    comes from the policy only: a tool's arguments, which a model may choose,
    never name a program.
    """

    argv: tuple[str, ...]
    timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> WorkerRestart:
        """The restart the params configure; ValueError saying what is wrong."""
        argv = params.get("argv")
        if not isinstance(argv, list) or not argv:
            raise ValueError("argv must be a non-empty list of strings")
        env = params.get("env") or {}
        if not isinstance(env, dict):
            raise ValueError("env must be a mapping of strings")
        timeout = params.get("timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError("timeout_s must be a number")
        restart = cls(tuple(argv), float(timeout), MappingProxyType(dict(env)))
        restart.actuator()  # the actuator's own checks: placeholders, NUL bytes, env names
        return restart

    def actuator(self) -> CommandActuator:
        """A command actuator that runs this program (ValueError when it cannot)."""
        return CommandActuator(argv=self.argv, timeout_s=self.timeout_s, env=self.env)


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

    def restart_worker(
        self, trigger: Trigger, restart: WorkerRestart, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        """Run ``restart`` once for the trigger's run, as a ``resume_run`` command; what it did.

        ``ok``, ``detail`` (the exit and the output's tail), ``status`` (the exit
        code) and ``command_id``. The program sees ``key``'s command idempotency
        key, the same on every call with that key.
        """
        ...

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        """Tell the remediation when the run's later spans show the failed part succeeding.

        Or the run ending OK (its root span), lately or from now on. Called when
        the remediation starts, before its first command, and undone when it ends.
        """
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
    #: The exit code the restart program is taken to return.
    restart_exit: int = 0
    commands: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Every restart asked for, in order; a repeated key is a second run, as it is
    #: for the real program (the runner's durable steps are what keep it to one).
    restarts: list[dict[str, Any]] = field(default_factory=list)
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

    def restart_worker(
        self, trigger: Trigger, restart: WorkerRestart, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        asked = {
            "argv": list(restart.argv),
            "timeout_s": restart.timeout_s,
            "env": dict(restart.env),
            "params": dict(params),
            "key": key,
            "run_id": trigger.run_id,
        }
        with self._lock:
            self.restarts.append(asked)
        return {
            "ok": self.restart_exit == 0,
            "detail": f"exit {self.restart_exit}",
            "status": self.restart_exit,
            "command_id": f"cmd_{key[:24]}",
        }

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        with self._lock:
            self.watched[remediation_id] = trigger

    def unwatch(self, remediation_id: str) -> None:
        with self._lock:
            self.watched.pop(remediation_id, None)
