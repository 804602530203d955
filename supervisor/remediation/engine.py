"""The sidecar's side of remediation: remediate decisions dispatched to the durable runner.

:class:`Remediations` turns stored ``remediate`` decisions into requests for
the durable runner (:mod:`remediators.runner`), from the store writer's
thread, after the incident is stored. At start it re-dispatches recent
remediate incidents: one stored just before a crash was never started, and
the workflow id makes a repeat of a started one a no-op. What it builds on
lives beside it: the gateway remediators act through (:mod:`.gateway`), the
recoveries they wait for (:mod:`.recovery`), escalation notices
(:mod:`.notices`).

Lifecycle: built by :func:`supervisor.wiring.build_sidecar` with the actor and governor;
:meth:`Remediations.start` once the event loop runs (launches DBOS, which
resumes remediations left pending); :meth:`Remediations.close` at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from policies import Governor, Policy
from remediators.base import Trigger
from remediators.registry import RemediatorNotFound, allowed_tools, budget_of, resolve
from remediators.runner import (
    DurableRunner,
    RunnerSettings,
    build_request,
    redact_url,
    send_approval_answer,
)
from supervisor.act.actor import Actor
from supervisor.act.failure_log import outcome_json
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action
from supervisor.remediation.gateway import SidecarGateway
from supervisor.remediation.notices import slack_message
from supervisor.remediation.recovery import RecoveryWatch
from supervisor.settings import Settings

log = logging.getLogger("spanvisor.remediate")

__all__ = [
    "RecoveryWatch",
    "Remediations",
    "SidecarGateway",
    "database_url_for",
    "executor_id",
    "slack_message",
]

#: Remediate incidents looked at again at start (newest first).
_REDISPATCH_LIMIT = 1000


def database_url_for(settings: Settings) -> str | None:
    """The remediation database: the setting, else the fleet's database, else a SQLite file
    beside the state; None for none."""
    if settings.remediation_database_url:
        return settings.remediation_database_url
    if settings.database_url:  # a fleet: its remediations are shared with its incidents
        return settings.database_url
    if str(settings.state_path) == ":memory:":
        return None
    return f"sqlite:///{Path(settings.state_path).resolve().parent / 'remediations.sqlite'}"


class Remediations:
    """Dispatches ``remediate`` decisions to the durable runner; see the module."""

    def __init__(
        self,
        settings: Settings,
        actor: Actor,
        governor: Governor,
        policy: Callable[[], Policy],
        *,
        tracer: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._actor = actor
        self._governor = governor
        self._policy = policy
        self._tracer = tracer
        self._clock = clock
        self.database_url = database_url_for(settings)
        self.runner: DurableRunner | None = None
        self.watch = RecoveryWatch(self._notify_recovery)
        self.gateway: SidecarGateway | None = None
        #: Remediate decisions not dispatched: no database, unknown remediator.
        self.undispatched = 0
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed = False
        #: Why the runner could not start (for the control API), when it could not.
        self._failure = ""
        self._launching = False
        #: Sends answers while the runner is not up (one thread: answers are people's).
        self._answers: ThreadPoolExecutor | None = None

    @property
    def running(self) -> bool:
        return self.runner is not None

    def needed(self) -> bool:
        """Whether to start now: earlier remediations may be pending (a SQLite file exists,
        or the database is Postgres). Otherwise the first remediate decision starts it,
        so sidecars that never remediate never launch DBOS."""
        url = self.database_url
        if url is None:
            return False
        if not url.startswith("sqlite:///"):
            return True
        return Path(url.removeprefix("sqlite:///")).exists()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that commands are announced on (the sidecar's)."""
        self._loop = loop

    def start(
        self, loop: asyncio.AbstractEventLoop | None = None, *, redispatch: bool = True
    ) -> None:
        """Launch the runner (blocking: call it off the loop); raises ConfigError.

        Safe from several threads: the sidecar starts it in the background at
        start-up while the store writer may start it for a first decision;
        the second caller waits for the first.
        """
        self._launching = True
        try:
            with self._starting:
                self._start_locked(loop, redispatch=redispatch)
        finally:
            self._launching = False

    def start_in_background(self) -> None:
        """:meth:`start` for a background thread: a failure is logged and remembered."""
        try:
            self.start()
        except Exception as exc:  # the sidecar goes on; remediate decisions are counted
            self._failed = True  # not retried for every decision; a restart retries
            self._failure = str(exc)
            log.error("cannot start remediations: %s", exc)

    def _start_locked(self, loop: asyncio.AbstractEventLoop | None, *, redispatch: bool) -> None:
        loop = loop or self._loop
        if self.database_url is None or self.runner is not None or loop is None:
            return
        if self.database_url.startswith("sqlite:///"):
            Path(self.database_url.removeprefix("sqlite:///")).parent.mkdir(
                parents=True, exist_ok=True
            )
        self.gateway = SidecarGateway(
            self._actor,
            self._governor,
            self._policy,
            self.watch,
            loop,
            notify_url=self.settings.notify_url,
            notify_secret=self.settings.notify_secret,
        )
        runner = DurableRunner(
            self.gateway,
            RunnerSettings(
                database_url=self.database_url,
                executor_id=executor_id(self.settings),
                max_active=self.settings.max_active_remediations,
            ),
            tracer=self._tracer,
        )
        runner.start()
        self.runner = runner
        log.info("remediations ready", extra={"database": redact_url(self.database_url)})
        if redispatch:
            # In a fleet, this sidecar's own: another live sidecar starts its own, and a
            # dead one's are started by the sidecar that takes it over.
            self._redispatch(self.settings.instance() if self.settings.database_url else None)

    def close(self, timeout_s: float = 10.0) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close(timeout_s)
        answers, self._answers = self._answers, None
        if answers is not None:
            answers.shutdown(wait=True)  # an answer given is sent before the sidecar stops

    def dispatch(self, outcomes: Sequence[Outcome]) -> None:
        """Start a remediation for each ``remediate`` decision (store writer's thread)."""
        for outcome in outcomes:
            decision = outcome.decision
            if decision.action is not Action.REMEDIATE or decision.observe_only:
                continue
            failure = outcome.failure
            received = failure.received_ns / 1e9 if failure.received_ns else self._clock()
            self._start(self._request(outcome_json(outcome), received))

    def _start(self, request: dict[str, Any] | None) -> None:
        if request is None:
            return
        if self.runner is None and self.database_url is not None and not self._failed:
            try:  # the first remediate decision: launch now (this is the writer's thread)
                # No database before this: nothing can be pending (start re-dispatches
                # only when a sidecar starts on an existing one).
                self.start(redispatch=False)
            except Exception as exc:
                self._failed = True  # not again for every decision; a restart retries
                self._failure = str(exc)
                log.error("cannot start remediations: %s", exc)
        runner = self.runner
        if runner is None:
            with self._lock:
                self.undispatched += 1
            log.warning(
                "a remediation was decided but remediations are not running",
                extra={"remediation": request["id"]},
            )
            return
        runner.dispatch(request)

    def _request(self, failure: Mapping[str, Any], dispatched_at: float) -> dict[str, Any] | None:
        """The workflow input for a remediate decision, from its failure in ``replay`` form."""
        # What a detector found (repeats, unverified work) and the decision's parameters.
        decision_params: dict[str, Any] = {
            **dict(failure.get("details") or {}),
            **dict(failure.get("params") or {}),
        }
        name = str(decision_params.get("remediator", ""))
        policy = self._policy()
        spec = policy.remediator(name)
        try:
            if spec is None:
                raise RemediatorNotFound(f"remediator {name!r} is not defined by the policy")
            cls = resolve(spec.use)
        except RemediatorNotFound as exc:
            with self._lock:
                self.undispatched += 1
            log.error("cannot remediate: %s", exc, extra={"span_id": failure.get("span_id")})
            return None
        dependency = str(failure.get("dependency", ""))
        chain = policy.fallback_chain(dependency)
        if chain:
            decision_params["chain"] = list(chain)
        trigger = Trigger(
            trace_id=str(failure["trace_id"]),
            span_id=str(failure["span_id"]),
            service=str(failure.get("service", "")),
            run_id=str(failure.get("run_id", "")),
            failure_class=str(failure.get("class", "")),
            kind=str(failure.get("kind", "")),
            dependency=dependency,
            rule=str(failure.get("rule", "")),
            message=str(failure.get("message", "")),
            span_name=str(failure.get("span_name", "")),
            params=decision_params,
        )
        remediator_params = dict(spec.params)
        if spec.use == "llm":
            remediator_params.setdefault("base_url", self.settings.llm_base_url)
            remediator_params.setdefault("model", self.settings.llm_model)
        return build_request(
            trigger,
            remediator=name,
            use=spec.use,
            tools=allowed_tools(spec, cls),
            budget=budget_of(spec),
            params={k: v for k, v in remediator_params.items() if v is not None},
            verify_window_s=spec.verify_window_s,
            on_unresolved=spec.on_unresolved,
            dispatched_at=dispatched_at,
        )

    def _redispatch(self, judged_by: str | None = None) -> int:
        """Start remediate incidents stored before a crash but never started; how many.

        The store writer stores an incident, then dispatches; a kill between
        the two leaves an incident without its workflow. Workflow ids dedupe,
        so only the missing ones are started. ``judged_by``: only a (dead)
        sidecar's incidents.
        """
        found = self._actor.store.incidents_where(
            action=Action.REMEDIATE.value, judged_by=judged_by, limit=_REDISPATCH_LIMIT
        )
        runner = self.runner
        if not found or runner is None:
            return 0
        known = {w["id"] for w in runner.list(limit=_REDISPATCH_LIMIT * 2)}
        started = 0
        for incident in found:
            body = incident.body
            if body.get("observe_only") or not isinstance(body.get("params"), dict):
                continue
            if str(body["params"].get("remediation_id")) in known:
                continue
            log.warning(
                "starting a remediation stored but never started",
                extra={"incident": incident.key},
            )
            received = body.get("received_ns")
            at = received / 1e9 if isinstance(received, int) and received else incident.created_at
            self._start(self._request(body, at))
            started += 1
        return started

    def answered(self, approval: Mapping[str, Any]) -> None:
        """A person answered an approval; the remediation waiting for it is told.

        It may wait in another sidecar of the fleet (the one that ran it), which
        reads the message from the shared database. Without a runner here
        (still starting, or it could not start), the message is sent through
        DBOS's client on a thread of its own (:meth:`close` waits for it):
        dropped, the remediation would wait out its whole timeout.
        """
        remediation_id = approval.get("remediation_id")
        if not isinstance(remediation_id, str):
            return
        answer = {"approved": approval.get("status") == "approved", "id": approval.get("id")}
        runner = self.runner
        if runner is not None:
            runner.answer_approval(remediation_id, answer)
            return
        url = self.database_url
        if url is None:
            return
        with self._lock:
            if self._answers is None:
                self._answers = ThreadPoolExecutor(1, thread_name_prefix="spanvisor-answers")
            answers = self._answers
        answers.submit(self._send_answer, url, remediation_id, answer)

    def _send_answer(self, url: str, remediation_id: str, answer: dict[str, Any]) -> None:
        try:
            send_approval_answer(url, remediation_id, answer)
        except Exception as exc:  # the database away: the approval stays answered in the store
            log.error(
                "could not send an approval's answer to its remediation: %s",
                exc,
                extra={"remediation": remediation_id, "approval": answer.get("id")},
            )

    def resume_executor(self, executor: str, instance: str) -> int | None:
        """Take over a dead sidecar's remediations (a fleet's takeover); how many.

        Its pending workflows are resumed, and the remediations it stored but had
        not started when it died (:meth:`_redispatch`, for its incidents) are
        started here. None while the runner is not running: the takeover waits
        (or another sidecar does it). Blocking: call it off the loop.
        """
        runner = self.runner
        if runner is None:
            return None
        return runner.resume_executor(executor) + self._redispatch(judged_by=instance)

    def _notify_recovery(self, remediation_id: str, evidence: Mapping[str, Any]) -> None:
        if self.runner is not None:
            self.runner.notify_recovery(remediation_id, evidence)

    def state(self) -> tuple[str, str]:
        """What is the case, as a word and a sentence for people.

        ``running``; ``starting`` (launching the runner); ``idle`` (nothing
        decided yet: the runner starts at the first ``remediate`` decision);
        ``unused`` (the policy in force has no ``remediate`` action); ``failed``
        (it could not start); ``off`` (no database to keep them in).
        """
        if self.runner is not None:
            return "running", "remediations are running"
        if self.database_url is None:
            return "off", (
                "remediations are off on this sidecar: there is no database to keep them in"
                " (state_path is ':memory:' and remediation_database_url is unset)"
            )
        if self._failed:
            return "failed", (
                f"remediations could not start: {self._failure or 'see the log'}"
                " (the next start of the sidecar tries again)"
            )
        if self._launching:
            return "starting", "remediations are starting; ask again in a few seconds"
        if not self._policy().remediators_used:
            return "unused", (
                "no remediations: the policy in force has no `remediate` action"
                f" ({self._policy().source})"
            )
        return "idle", (
            "no remediation has been decided since this sidecar started; the runner"
            " starts at the first `remediate` decision"
        )

    def describe(self) -> dict[str, Any]:
        runner = self.runner
        state, why = self.state()
        return {
            "running": runner is not None,
            "state": state,
            "why": why,
            "database": redact_url(self.database_url) if self.database_url else None,
            "undispatched": self.undispatched,
            "watched": len(self.watch),
            **(runner.stats() if runner is not None else {}),
        }


def executor_id(settings: Settings) -> str:
    """The remediation executor's id: unique per sidecar when a fleet shares the database.

    DBOS recovers, at start, the unfinished workflows of its executor id: two
    sidecars with the default ``local`` on one database would each take over
    the other's.
    """
    if settings.database_url and settings.remediation_executor_id == "local":
        return settings.instance()
    return settings.remediation_executor_id
