"""What the control API and the CLI can do to a running sidecar, without HTTP.

:mod:`supervisor.api.server` maps routes onto these methods, so every operation is
testable in process with real components (an in-memory store, a real
governor). Answers are JSON-ready; span content in them is data.

Lifecycle: built by the sidecar once its parts exist; methods run on the
sidecar's event loop (FastAPI's sync endpoints would use a thread pool, so
the routes are all ``async``). The remediation runner's methods block, so
the remediation operations await them on a worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar, cast

from policies import Governor, Policy
from supervisor.act.actor import Actor
from supervisor.act.store import ApprovalError, Store
from supervisor.act.store_rows import APPROVAL_STATUSES
from supervisor.api.inline import Question, decide
from supervisor.api.thread_cpu import thread_cpu
from supervisor.errors import ConfigError
from supervisor.records import REMEDIATION_STATUSES, RUN_STATUSES
from supervisor.settings import AgentDelivery, PullChannel

MAX_WAIT_S = 30.0
MAX_LIMIT = 1000

#: A remediation's id, as :func:`supervisor.records.remediation_ids` makes it.
REMEDIATION_ID = re.compile(r"^rem_[0-9a-f]{1,64}$")
#: States in which a remediation is over: nothing left to cancel.
FINISHED = frozenset({"SUCCESS", "ERROR", "CANCELLED"})
NOT_RUNNING = (
    "remediations are not running on this sidecar: the policy has no `remediate` action,"
    " or there is no state database (state_path is ':memory:')"
)


T = TypeVar("T")


class RemediationRunner(Protocol):
    """What the control API asks :class:`remediators.runner.DurableRunner`.

    Every method blocks (up to 10 s, waiting for the runner's thread) and
    raises ConfigError once the runner has stopped: call them off the loop.
    """

    def show(self, remediation_id: str) -> dict[str, Any] | None: ...

    def cancel(self, remediation_id: str) -> bool: ...

    def list(self, limit: int = 50, status: str | None = None) -> builtins.list[dict[str, Any]]: ...


class RemediationsView(Protocol):
    """What the control API reads of :class:`supervisor.remediation.engine.Remediations`."""

    @property
    def runner(self) -> RemediationRunner | None: ...

    def describe(self) -> dict[str, Any]: ...


class RunEntry(Protocol):
    """One run as the control API reads it (:class:`supervisor.runs.RunView`)."""

    @property
    def service(self) -> str: ...

    @property
    def status(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


class RunsView(Protocol):
    """What the control API reads of :class:`supervisor.runs.RunTracker`.

    The tracker belongs to the event loop's thread (the pipeline updates it
    there) and is not thread-safe: call these on the loop, never on a worker.
    """

    def snapshot(self, limit: int = 100, now: float | None = None) -> Sequence[RunEntry]: ...

    def stats(self) -> dict[str, int]: ...


class ControlError(ValueError):
    """A request the sidecar cannot do: the message says why (an API 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Control:
    """The operations of the control API; see the module."""

    store: Store
    actor: Actor
    governor: Governor
    policy: Callable[[], Policy]
    failures: Callable[[int], list[dict[str, Any]]]
    stats: Callable[[], dict[str, Any]]
    ready: Callable[[], bool]
    reload: Callable[[], dict[str, Any]]
    clock: Callable[[], float] = time.time
    #: What degrades the sidecar while it serves (readiness says; empty: nothing).
    degraded: Callable[[], list[str]] = list
    #: The sidecar's remediations (None: a control API without them, as in some tests).
    remediations: RemediationsView | None = None
    #: The sidecar's run tracker (None: runs are not tracked, as in some tests).
    runs: RunsView | None = None
    #: The body of ``/metrics`` (:func:`supervisor.api.metrics.exposition`; None: not served).
    exposition: Callable[[], bytes] | None = None

    def all_stats(self) -> dict[str, Any]:
        return self.stats()

    def metrics(self) -> bytes:
        """The counters of :meth:`all_stats`' stages, in the Prometheus text format."""
        if self.exposition is None:
            raise ControlError("this control API serves no metrics", 404)
        return self.exposition()

    def threads(self) -> dict[str, Any]:
        """CPU seconds of the process and of each of its threads (see :mod:`.thread_cpu`)."""
        return thread_cpu()

    # -- incidents and commands -------------------------------------------

    def incidents(self, limit: int) -> list[dict[str, Any]]:
        return [
            {"key": i.key, "created_at": i.created_at, **i.body}
            for i in self.store.incidents(_limit(limit))
        ]

    def incident(self, key: str) -> dict[str, Any]:
        found = self.store.incident(key)
        if found is None:
            raise ControlError(f"no incident {key!r}", 404)
        return {"key": found.key, "created_at": found.created_at, **found.body}

    def commands(
        self, *, status: str | None, service: str | None, limit: int
    ) -> list[dict[str, Any]]:
        if status is not None and status not in ("pending", "leased", "delivered", "dead"):
            raise ControlError("status must be pending, leased, delivered or dead")
        found = self.store.commands(status=status, service=service, limit=_limit(limit))
        return [c.to_json() for c in found]

    def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        return self.commands(status="dead", service=None, limit=limit)

    def _pull_settings(self, service: str) -> PullChannel:
        delivery: AgentDelivery | None = self.actor.agents.get(service) or self.actor.agents.get(
            "*"
        )
        if delivery is None or delivery.pull is None:
            raise ControlError(
                f"service {service!r} does not take commands by pull: configure"
                f" agents.{service}.pull in the settings",
                404,
            )
        return delivery.pull

    async def pull(self, service: str, *, wait_s: float, limit: int) -> list[dict[str, Any]]:
        """Lease due commands of ``service``, waiting up to ``wait_s`` for one (long poll).

        The wait ends early when a command for ``service`` is stored (notified) or
        one of its own commands comes due or has its lease run out (timed); other
        services' commands never wake it, so an idle poll is a few store calls.
        """
        if not service:
            raise ControlError("service is required")
        settings = self._pull_settings(service)
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ControlError(f"wait must be between 0 and {MAX_WAIT_S:g} seconds")
        deadline = time.monotonic() + wait_s
        while True:
            event = self.actor.waiters.event(service)
            leased = self.store.lease(service, self.clock(), settings.visibility_s, _limit(limit))
            if leased:
                return [c.to_json() for c in leased]
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            # A delayed command (not_before) becoming due and a lease running out are not
            # announced: sleep until the first of these for this service's own commands.
            next_at = self.store.next_lease_at(service)
            if next_at is not None:
                left = min(left, max(0.01, next_at - self.clock()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=left)

    def ack(self, command_id: str, service: str) -> dict[str, Any]:
        if not service:
            raise ControlError("service is required")
        if not self.store.ack(command_id, service, self.clock()):
            found = self.store.command(command_id)
            if found is None or found.command.service != service:
                raise ControlError(f"no command {command_id!r} for service {service!r}", 404)
            raise ControlError(
                f"command {command_id!r} is {found.status}, not waiting for an ack", 409
            )
        return {"id": command_id, "status": "delivered"}

    # -- approvals ----------------------------------------------------------

    def approvals(self, status: str | None, limit: int) -> list[dict[str, Any]]:
        if status is not None and status not in APPROVAL_STATUSES:
            raise ControlError("status must be one of " + ", ".join(APPROVAL_STATUSES))
        return [a.to_json() for a in self.store.approvals(status=status, limit=_limit(limit))]

    def approval(self, approval_id: str) -> dict[str, Any]:
        found = self.store.approval(approval_id)
        if found is None:
            raise ControlError(f"no approval request {approval_id!r}", 404)
        return found.to_json()

    def answer(self, approval_id: str, *, approved: bool, by: str, note: str) -> dict[str, Any]:
        try:
            return self.actor.answer(approval_id, approved=approved, by=by, note=note).to_json()
        except ApprovalError as exc:
            status = 404 if "no approval" in str(exc) else 409
            raise ControlError(str(exc), status) from None

    # -- breakers -------------------------------------------------------------

    def breakers(self) -> list[dict[str, Any]]:
        return [_breaker_json(asdict(i)) for i in self.governor.board.snapshot()]

    def breaker(self, dependency: str) -> dict[str, Any]:
        self.governor.breaker_state(dependency)  # moves an elapsed open breaker to half-open
        return _breaker_json(asdict(self.governor.board.info(dependency)))

    def isolate(self, dependency: str) -> dict[str, Any]:
        if not dependency:
            raise ControlError("dependency is required")
        if not self.governor.isolate(dependency):
            raise ControlError("too many breakers are tracked to isolate another one", 503)
        return self.breaker(dependency)

    def close_breaker(self, dependency: str) -> dict[str, Any]:
        if not dependency:
            raise ControlError("dependency is required")
        self.governor.close(dependency)
        return self.breaker(dependency)

    # -- remediations ----------------------------------------------------------

    def _remediations(self) -> RemediationsView | None:
        return self.remediations

    def _runner(self) -> RemediationRunner:
        remediations = self._remediations()
        runner = remediations.runner if remediations is not None else None
        if runner is None:
            raise ControlError(NOT_RUNNING, 409)
        return runner

    async def _ask(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the runner's methods block."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ConfigError as exc:
            raise ControlError(f"remediations are unavailable: {exc}", 503) from None
        except (TimeoutError, concurrent.futures.TimeoutError):  # one class from 3.11 on
            raise ControlError(
                "the remediation runner did not answer in time; try again", 503
            ) from None

    async def remediation_list(self, *, status: str | None, limit: int) -> dict[str, Any]:
        """Newest first; ``running`` false (and none listed) when remediations are off."""
        if status is not None:
            status = status.upper()
            if status not in REMEDIATION_STATUSES:
                raise ControlError("status must be one of " + ", ".join(REMEDIATION_STATUSES))
        limit = _limit(limit)
        remediations = self._remediations()
        runner = remediations.runner if remediations is not None else None
        if runner is None:
            return {"remediations": [], "running": False}
        found = await self._ask(runner.list, limit, status)
        return {"remediations": _jsonable(found), "running": True}

    async def remediation(self, remediation_id: str) -> dict[str, Any]:
        """One remediation with its request (the workflow input) and its recorded steps."""
        _check_remediation_id(remediation_id)
        runner = self._runner()
        found = await self._ask(runner.show, remediation_id)
        if found is None:
            raise ControlError(f"no remediation {remediation_id!r}", 404)
        return cast(dict[str, Any], _jsonable(found))

    async def cancel_remediation(self, remediation_id: str) -> dict[str, Any]:
        """Cancel a remediation still running: 404 when unknown, 409 when it is over."""
        _check_remediation_id(remediation_id)
        runner = self._runner()
        found = await self._ask(runner.show, remediation_id)
        if found is None:
            raise ControlError(f"no remediation {remediation_id!r}", 404)
        if found.get("status") in FINISHED:
            raise ControlError(_finished(remediation_id, found), 409)
        if not await self._ask(runner.cancel, remediation_id):
            # It finished (or vanished) between the look and the cancel.
            again = await self._ask(runner.show, remediation_id)
            if again is None:
                raise ControlError(f"no remediation {remediation_id!r}", 404)
            raise ControlError(_finished(remediation_id, again), 409)
        return {"cancelled": True, "id": remediation_id}

    # -- runs -------------------------------------------------------------------

    def run_list(self, *, status: str | None, service: str | None, limit: int) -> dict[str, Any]:
        """The most recently active runs first; ``tracking`` false (none listed) without a tracker.

        Synchronous on purpose: the tracker is the event loop's (see :class:`RunsView`).
        """
        if status is not None:
            status = status.lower()
            if status not in RUN_STATUSES:
                raise ControlError("status must be one of " + ", ".join(RUN_STATUSES))
        limit = _limit(limit)
        runs = self.runs
        if runs is None:
            return {"runs": [], "tracking": False}
        # The tracker has no filtered view: filtering happens after the snapshot.
        # With a filter, take the MAX_LIMIT most recently active runs (the bound on
        # the time spent on the loop), keep those that match, then cut to ``limit``:
        # a filter sees only those MAX_LIMIT runs. Without one, ``limit`` is enough.
        filtered = status is not None or service is not None
        views = runs.snapshot(limit=max(limit, MAX_LIMIT) if filtered else limit)
        found = [
            view.to_json()
            for view in views
            if (status is None or view.status == status)
            and (service is None or view.service == service)
        ][:limit]
        answer: dict[str, Any] = {"runs": found, "tracking": True, "stats": dict(runs.stats())}
        slo_status = getattr(runs, "slo_status", None)  # the tracker's SLOs, when it has them
        if callable(slo_status):
            answer["slo"] = slo_status()
        return answer

    # -- decisions --------------------------------------------------------------

    def decide(self, question: Question) -> dict[str, Any]:
        if not question.dependency:
            raise ControlError("dependency is required, e.g. openai:gpt-4o or tool:search")
        if not 1 <= question.attempt <= 1000:
            raise ControlError("attempt must be between 1 and 1000")
        return decide(self.policy(), self.governor, question)


def _breaker_json(info: dict[str, Any]) -> dict[str, Any]:
    state = info.get("state")
    return {**info, "state": getattr(state, "value", state)}


def _check_remediation_id(remediation_id: str) -> None:
    if not REMEDIATION_ID.fullmatch(remediation_id):  # match() takes "rem_1\n"
        raise ControlError(
            "a remediation id is rem_ and 1 to 64 lowercase hex digits, e.g. rem_3f2a9c"
        )


def _finished(remediation_id: str, found: dict[str, Any]) -> str:
    outcome = found.get("outcome")
    how = f"{found.get('status')}" + (f", outcome {outcome}" if outcome else "")
    return f"remediation {remediation_id!r} is already finished ({how}); nothing to cancel"


def _jsonable(value: Any) -> Any:
    """Workflow inputs and step outputs as plain JSON (anything else as its text)."""
    return json.loads(json.dumps(value, default=str))


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise ControlError(f"limit must be between 1 and {MAX_LIMIT}")
    return limit
