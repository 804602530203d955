"""The sidecar's side of remediation: dispatch, the gateway, recovery watching, notices.

* :class:`Remediations` turns stored ``remediate`` decisions into requests for
  the durable runner (:mod:`remediators.runner`), from the store writer's
  thread, after the incident is stored. At start it re-dispatches recent
  remediate incidents: one stored just before a crash was never started, and
  the workflow id makes a repeat of a started one a no-op.
* :class:`SidecarGateway` is the only way remediators act (commands through
  the store and the deliverers, approvals through the store, worker restarts
  through a command actuator) and read (recent failures of the run, incident
  history, breaker states).
* :class:`RecoveryWatch` is what the pipeline asks on the success path: the
  dependencies some remediation waits to see succeed in a run. Only those
  dependencies' successes are looked up, so spans pay nothing otherwise.

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
from pathlib import Path
from typing import Any

import httpx
import orjson
import tenacity

from policies import Governor, Policy
from remediators.base import Trigger
from remediators.gateway import WorkerRestart
from remediators.registry import RemediatorNotFound, allowed_tools, budget_of, resolve
from remediators.runner import DurableRunner, RunnerSettings, build_request, redact_url
from supervisor.act.actor import Actor
from supervisor.act.actuators import DeliveryResult
from supervisor.act.actuators.command import CommandActuator
from supervisor.act.failure_log import outcome_json
from supervisor.act.signing import signature_headers
from supervisor.act.store import StoredCommand
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action, Command, CommandType, command_key
from supervisor.settings import Settings

log = logging.getLogger("spanvisor.remediate")

__all__ = [
    "RecoveryWatch",
    "Remediations",
    "SidecarGateway",
    "database_url_for",
    "slack_message",
]

#: Remediate incidents looked at again at start (newest first).
_REDISPATCH_LIMIT = 1000
_MAX_WATCHED = 10_000


def database_url_for(settings: Settings) -> str | None:
    """The remediation database: the setting, else a SQLite file beside the state; None for none."""
    if settings.remediation_database_url:
        return settings.remediation_database_url
    if str(settings.state_path) == ":memory:":
        return None
    return f"sqlite:///{Path(settings.state_path).resolve().parent / 'remediations.sqlite'}"


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


class SidecarGateway:
    """The runner's :class:`~remediators.gateway.Gateway` over the sidecar's parts."""

    def __init__(
        self,
        actor: Actor,
        governor: Governor,
        policy: Callable[[], Policy],
        watch: RecoveryWatch,
        loop: asyncio.AbstractEventLoop,
        *,
        notify_url: str | None = None,
        notify_secret: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._actor = actor
        self._governor = governor
        self._policy = policy
        self._watch = watch
        self._loop = loop
        self._notify_url = notify_url
        self._notify_secret = notify_secret
        self._clock = clock
        #: Notifications that could not be posted (the approval is stored all the same).
        self.notify_errors = 0

    def _announce(self, created: list[StoredCommand]) -> None:
        if created and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._actor.announce, created)

    def _command(
        self, trigger: Trigger, command: CommandType, params: Mapping[str, Any], key: str
    ) -> Command:
        """The command a remediation's call makes; its idempotency key derives from ``key``."""
        now = self._clock()
        digest = command_key(trigger.trace_id, trigger.span_id, trigger.rule, key)
        delay = params.get("delay_s", 0)
        wait = float(delay) if isinstance(delay, (int, float)) and delay > 0 else 0.0
        return Command(
            id=f"cmd_{digest[:24]}",
            idempotency_key=digest,
            type=command,
            service=trigger.service,
            run_id=trigger.run_id,
            trigger_trace_id=trigger.trace_id,
            trigger_span_id=trigger.span_id,
            failure=_summary(trigger),
            params=dict(params),
            not_before=now + wait,
            created_at=now,
        )

    def send_command(
        self, trigger: Trigger, command: str, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        built = self._command(trigger, CommandType(command), params, key)
        channel = self._actor.channel_for(trigger.service)
        created = self._actor.store.add_commands(_incident_of(trigger), [(built, channel)])
        self._announce(created)
        status = created[0].status if created else "duplicate"
        return {"command_id": built.id, "type": command, "status": status, "channel": channel}

    def open_approval(
        self, trigger: Trigger, body: Mapping[str, Any], *, key: str, remediation_id: str
    ) -> dict[str, Any]:
        digest = command_key(trigger.trace_id, trigger.span_id, trigger.rule, key)
        approval_id = f"apr_{digest[:24]}"
        request = {
            "what": _summary(trigger),
            "where": {
                "service": trigger.service,
                "run_id": trigger.run_id,
                "trace_id": trigger.trace_id,
                "span_id": trigger.span_id,
                "span_name": trigger.span_name,
            },
            "proposal": {
                "command": str(body.get("proposal") or "retry_step"),
                "params": {"remediation_id": remediation_id},
            },
            "why": str(body.get("question", ""))[:2000],
            "on_approve": str(body.get("on_approve") or "the proposed command is sent")[:2000],
            "on_deny": str(body.get("on_deny") or "the run should abort")[:2000],
            "remediation_id": remediation_id,
        }
        fresh = self._actor.store.open_approval(
            approval_id,
            incident_key=f"{_incident_of(trigger)}#{digest[:12]}",
            service=trigger.service,
            run_id=trigger.run_id,
            body=request,
            now=self._clock(),
        )
        if fresh:
            log.warning(
                "approval requested by a remediation",
                extra={"approval": approval_id, "remediation": remediation_id},
            )
            self._post_notice(approval_id, request)
        return {"approval_id": approval_id, "status": "pending"}

    def _post_notice(self, approval_id: str, request: Mapping[str, Any]) -> None:
        """Post the escalation to ``notify_url``: signed, retried on 5xx/429/network errors."""
        if not self._notify_url:
            return
        body = orjson.dumps(slack_message(approval_id, request))
        headers = {"Content-Type": "application/json"}
        if self._notify_secret:
            # One message id for every attempt: the receiver can drop repeats.
            headers.update(signature_headers(self._notify_secret, f"ntf_{approval_id}", body))
        try:
            for attempt in tenacity.Retrying(
                stop=tenacity.stop_after_attempt(3),
                wait=tenacity.wait_random_exponential(multiplier=0.2, max=2),
                retry=tenacity.retry_if_exception(_worth_retrying),
                reraise=True,
            ):
                with attempt:
                    httpx.post(
                        self._notify_url, content=body, headers=headers, timeout=5.0
                    ).raise_for_status()
        except httpx.HTTPError as exc:
            self.notify_errors += 1
            log.warning(
                "could not post an escalation notice (the approval is stored): %s",
                exc,
                extra={"approval": approval_id},
            )

    def recent_spans(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        found = self._actor.store.incidents_where(run_id=trigger.run_id, limit=limit)
        return [_public(incident.body) for incident in found]

    def incident_history(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        found = self._actor.store.incidents_where(run_id=trigger.run_id, limit=limit)
        return [{"created_at": incident.created_at, **_public(incident.body)} for incident in found]

    def breaker_states(self) -> list[dict[str, Any]]:
        return [
            {"dependency": b.dependency, "state": b.state.value, "failures": b.failures}
            for b in self._governor.board.snapshot()
        ]

    def fallback_chain(self, dependency: str) -> Sequence[str] | None:
        return self._policy().fallback_chain(dependency)

    def restart_allowed(self, trigger: Trigger) -> tuple[bool, str]:
        if self._governor.intensity.allow(trigger.run_id or trigger.trace_id):
            return True, ""
        return False, "the run's restart intensity is spent"

    def restart_worker(
        self, trigger: Trigger, restart: WorkerRestart, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        """Run the restart program once, through a command actuator of its own, on this thread.

        A ``resume_run`` command is what the program gets (``SPANVISOR_COMMAND``
        and the placeholders); it is not stored or delivered to the agent. A
        sidecar killed while the program runs runs it again when the
        remediation resumes (the step was not recorded), with the same
        idempotency key, so the program can tell.
        """
        command = self._command(trigger, CommandType.RESUME_RUN, params, key)
        result = asyncio.run(_run_once(restart.actuator(), command))
        log.info(
            "worker restart ran",
            extra={
                "remediation": params.get("remediation_id"),
                "run_id": trigger.run_id,
                "delivered": result.delivered,
                "detail": result.detail,
            },
        )
        return {
            "ok": result.delivered,
            "detail": result.detail,
            "status": result.status,
            "command_id": command.id,
        }

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        self._watch.watch([trigger.run_id, trigger.trace_id], trigger.dependency, remediation_id)

    def unwatch(self, remediation_id: str) -> None:
        self._watch.unwatch(remediation_id)


async def _run_once(actuator: CommandActuator, command: Command) -> DeliveryResult:
    await actuator.start()
    try:
        return await actuator.deliver(command)
    finally:
        await actuator.close()


def _worth_retrying(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, httpx.TransportError)


def slack_message(approval_id: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """An escalation as Slack's incoming-webhook JSON (``text`` plus ``blocks``).

    Span text is shown as quoted code, never as markup a reader could mistake
    for the sidecar's own words.
    """
    what = request.get("what", {})
    where = request.get("where", {})
    summary = (
        f"spanvisor needs a decision: {what.get('kind', '?')} ({what.get('class', '?')})"
        f" on {what.get('dependency') or where.get('span_name', '?')}"
    )
    detail = (
        f"*service* {where.get('service', '')}  *run* {where.get('run_id', '')}\n"
        f"*why* {_code(str(request.get('why', '')))}\n"
        f"*approve*: {request.get('on_approve', '')}\n*deny*: {request.get('on_deny', '')}\n"
        f"`spanvisor approvals approve {approval_id}` or `... deny {approval_id}`"
    )
    return {
        "text": summary,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": summary}},
            {"type": "section", "text": {"type": "mrkdwn", "text": detail[:2900]}},
        ],
        "spanvisor": {"approval_id": approval_id, **dict(request)},
    }


def _code(text: str) -> str:
    return "`" + text.replace("`", "'")[:500] + "`"


def _summary(trigger: Trigger) -> dict[str, Any]:
    return {
        "class": trigger.failure_class,
        "kind": trigger.kind,
        "dependency": trigger.dependency,
        "rule": trigger.rule,
        "message": trigger.message,
        "span_name": trigger.span_name,
    }


def _incident_of(trigger: Trigger) -> str:
    return command_key(trigger.trace_id, trigger.span_id, trigger.rule)


def _public(body: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("trace_id", "span_id", "span_name", "class", "kind", "dependency", "rule", "message")
    return {k: body.get(k) for k in keep if k in body}


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
        with self._starting:
            self._start_locked(loop, redispatch=redispatch)

    def start_in_background(self) -> None:
        """:meth:`start` for a background thread: a failure is logged and remembered."""
        try:
            self.start()
        except Exception as exc:  # the sidecar goes on; remediate decisions are counted
            self._failed = True  # not retried for every decision; a restart retries
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
                executor_id=self.settings.remediation_executor_id,
                max_active=self.settings.max_active_remediations,
            ),
            tracer=self._tracer,
        )
        runner.start()
        self.runner = runner
        log.info("remediations ready", extra={"database": redact_url(self.database_url)})
        if redispatch:
            self._redispatch()

    def close(self, timeout_s: float = 10.0) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close(timeout_s)

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

    def _redispatch(self) -> None:
        """Start remediate incidents stored before a crash but never started.

        The store writer stores an incident, then dispatches; a kill between
        the two leaves an incident without its workflow. Workflow ids dedupe,
        so only the missing ones are started.
        """
        found = self._actor.store.incidents_where(
            action=Action.REMEDIATE.value, limit=_REDISPATCH_LIMIT
        )
        runner = self.runner
        if not found or runner is None:
            return
        known = {w["id"] for w in runner.list(limit=_REDISPATCH_LIMIT * 2)}
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

    def answered(self, approval: Mapping[str, Any]) -> None:
        """A person answered an approval; the remediation waiting for it is told."""
        remediation_id = approval.get("remediation_id")
        if isinstance(remediation_id, str) and self.runner is not None:
            self.runner.answer_approval(
                remediation_id,
                {"approved": approval.get("status") == "approved", "id": approval.get("id")},
            )

    def _notify_recovery(self, remediation_id: str, evidence: Mapping[str, Any]) -> None:
        if self.runner is not None:
            self.runner.notify_recovery(remediation_id, evidence)

    def describe(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "running": runner is not None,
            "database": redact_url(self.database_url) if self.database_url else None,
            "undispatched": self.undispatched,
            "watched": len(self.watch),
            **(runner.stats() if runner is not None else {}),
        }
