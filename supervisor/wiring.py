"""Builds a sidecar: every part from the settings and the policy, in dependency order.

:func:`build_sidecar` is the one place where the parts meet. Each is built
with what it needs passed to its constructor; the finished set
(:class:`~supervisor.app.SidecarParts`) goes to :class:`~supervisor.app.Sidecar`,
which only runs it. Building opens the state database and may write the
token file, but binds no port and starts no thread or task: that is
:meth:`Sidecar.start <supervisor.app.Sidecar.start>`.

The parts that follow a policy reload read it through one
:class:`~supervisor.policy_in_force.PolicyInForce`, never through the sidecar.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pybreaker
from opentelemetry.sdk.metrics.export import MetricReader

from policies import AdmissionSpec, Governor, Policy, WindowCounter
from remediators.registry import check_policy
from supervisor.act.actor import Actor
from supervisor.act.actuators import Actuator
from supervisor.act.actuators.command import CommandActuator
from supervisor.act.actuators.webhook import WebhookActuator
from supervisor.act.dispatch import Dispatcher, actuator_table
from supervisor.act.failure_log import RecentFailures
from supervisor.act.fleet import Fleet
from supervisor.act.store import Store, StoredCommand
from supervisor.act.store_writer import StoreWriter
from supervisor.admission import Admitter
from supervisor.admission.capacity import AdmissionCapacity
from supervisor.admission.config import admitter_for
from supervisor.api.server import ensure_token
from supervisor.app import Sidecar, SidecarParts
from supervisor.collector import Collector
from supervisor.errors import ConfigError
from supervisor.forward.breaker_report import BreakerReport
from supervisor.forward.downstream import Downstream, downstream_from_env
from supervisor.forward.metrics import SidecarMetrics
from supervisor.forward.relay import Forwarder
from supervisor.forward.telemetry import DecisionTracer
from supervisor.ingest.auth import BearerMiddleware, GrpcBearerInterceptor, ReceiverAuth
from supervisor.ingest.grpc_receiver import GrpcReceiver
from supervisor.ingest.http_receiver import build_otlp_http_app
from supervisor.ingest.queue import IngestQueue
from supervisor.ingest.wal import IngestLog, NoLog, Releases
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.policy_in_force import PolicyInForce
from supervisor.remediation.engine import Remediations, executor_id
from supervisor.runs import RunTracker
from supervisor.runs.journal import RunJournal
from supervisor.settings import LOOPBACK, AgentDelivery, Settings

if TYPE_CHECKING:
    from supervisor.runs.fleet import FleetRuns
    from supervisor.shared_breakers import RedisLink

_log = logging.getLogger("spanvisor.wiring")


def build_sidecar(
    settings: Settings,
    policy: Policy,
    *,
    downstream: Downstream | None = None,
    tracer: DecisionTracer | None = None,
    metric_reader: MetricReader | None = None,
) -> Sidecar:
    """A sidecar ready to :meth:`~supervisor.app.Sidecar.start`.

    ``downstream``: where spans, own spans and metrics go (None: nowhere;
    :func:`resolve_downstream` reads it from the settings). ``tracer`` and
    ``metric_reader`` replace the own-span tracer and the metrics' exporter
    (tests read what they record). Raises ConfigError, before the state
    database is opened, for settings it cannot run with.
    """
    # Refused before anything is opened or written.
    _check_api_exposure(settings)
    _check_otlp_exposure(settings)
    _check_remediators(policy)
    breaker_storage, breaker_link = _shared_breakers(settings)
    actuators = _actuators(settings.agents)

    in_force = PolicyInForce(policy)
    queue = IngestQueue(
        settings.ingest_queue_batches,
        settings.ingest_queue_spans,
        settings.ingest_queue_bytes,
    )
    # What OTLP acknowledged, on disk until judged and stored (replayed at start).
    ingest_log = _ingest_log(settings)
    tracer = tracer if tracer is not None else DecisionTracer(downstream)
    metrics = SidecarMetrics(downstream, reader=metric_reader)
    breakers = BreakerReport(tracer, metrics)
    admitter = _admitter(policy.limits.admission, breaker_link, settings)
    governor = Governor(
        policy,
        on_breaker_change=breakers,
        max_runs=settings.tracked_runs,
        breaker_storage=breaker_storage,
        shared_counts=_shared_counts(settings, breaker_link),
        # Resumes and retries of a dependency spaced at the rate admission allows it.
        capacity=AdmissionCapacity(admitter, lambda: in_force().limits.admission.enabled),
    )
    runs = RunTracker(
        settings=in_force.detectors_for,
        models=policy.detectors.models,
        slo=policy.detectors.slo,
        max_runs=settings.tracked_runs,
        fleet=_fleet_runs(settings, breaker_link),
    )
    # Every LLM span teaches admission too (its tokens, its provider's rate-limit
    # headers), not only the 429s.
    runs.llm_calls = admitter.llm_call
    runs.stall_horizon_s = policy.detectors.shortest_idle_s  # as a reload sets it
    token = ensure_token(settings.api_token, settings.token_file)
    otlp_auth = ReceiverAuth(settings.otlp_token) if settings.otlp_token else None
    otlp_http = build_otlp_http_app(
        queue,
        max_body_bytes=settings.max_body_bytes,
        retry_after_s=settings.retry_after_s,
        read_timeout_s=settings.http_read_timeout_s,
        ingest_log=ingest_log,
    )
    if otlp_auth is not None:
        otlp_http.add_middleware(BearerMiddleware, auth=otlp_auth)

    store = Store.open(
        settings.database_url or settings.state_path,
        max_pending=settings.max_pending_commands,
        retention_s=settings.retention_s,
        instance_id=settings.instance(),
    )
    dispatcher = Dispatcher(
        store,
        actuator_table(actuators),
        max_attempts=functools.partial(_max_attempts, settings.agents),
    )
    actor = Actor(
        store,
        settings.agents,
        wake_push=dispatcher.wake,
        on_commands=functools.partial(_tell_runs, runs),
    )
    dispatcher.on_dead = functools.partial(_tell_runs_dead, runs)
    # The open runs a restart must not forget, beside the store's tables (under its lock).
    journal = RunJournal.open(settings.state_path) if _on_disk(settings.state_path) else None
    runs.journaling = journal is not None
    remediations = Remediations(settings, actor, governor, in_force, tracer=tracer.tracer)
    # The one cycle: remediations act through the actor (their commands and approval
    # requests), and the actor must tell them of each answered approval, which a
    # remediation may be waiting for. So the actor is built first, and told here.
    actor.on_answer = lambda approval: remediations.answered(approval.to_json())
    pipeline = Pipeline(
        policy,
        seen_capacity=settings.seen_failure_spans,
        runs_capacity=settings.tracked_runs,
        observe_only=settings.observe_only,
        governor=governor,
        runs=runs if settings.track_runs else None,
        recovery=remediations.watch,
    )
    releases = Releases(ingest_log)
    writer = StoreWriter(
        actor,
        after_store=functools.partial(_after_store, releases, remediations),
        on_drop=releases.dropped,
        min_commit_interval_s=settings.store_commit_interval_s,
        max_retained_failures=settings.store_retain_failures,
        max_retained_bytes=settings.store_retain_bytes,
    )
    # A failing store keeps judged failures; before they reach its bound, ingest throttles.
    queue.hold_while(writer.pressure)
    forwarder = (
        Forwarder(
            downstream,
            max_queue_batches=settings.forward_queue_batches,
            max_queue_bytes=settings.forward_queue_bytes,
            max_attempts=settings.forward_max_attempts,
        )
        if downstream is not None
        else None
    )
    return Sidecar(
        SidecarParts(
            settings=settings,
            policy=in_force,
            downstream=downstream,
            queue=queue,
            ingest_log=ingest_log,
            releases=releases,
            grpc=GrpcReceiver(
                queue,
                host=settings.host,
                port=settings.otlp_grpc_port,
                max_body_bytes=settings.max_body_bytes,
                retry_after_s=settings.retry_after_s,
                interceptors=[GrpcBearerInterceptor(otlp_auth)] if otlp_auth is not None else (),
                ingest_log=ingest_log,
            ),
            otlp_http=otlp_http,
            otlp_auth=otlp_auth,
            pipeline=pipeline,
            runs=runs,
            journal=journal,
            governor=governor,
            breakers=breakers,
            admitter=admitter,
            store=store,
            actuators=actuators,
            dispatcher=dispatcher,
            actor=actor,
            remediations=remediations,
            writer=writer,
            forwarder=forwarder,
            tracer=tracer,
            metrics=metrics,
            failures=RecentFailures(settings.recent_failures),
            collector=Collector(),
            token=token,
            breaker_link=breaker_link,
            fleet=_fleet(settings, store, remediations),
        )
    )


def _fleet(settings: Settings, store: Store, remediations: Remediations) -> Fleet | None:
    """Heartbeats and takeovers, when the store is shared by a fleet (PostgreSQL)."""
    if not store.shared:
        return None
    return Fleet(
        store,
        instance=settings.instance(),
        executor_id=executor_id(settings),
        heartbeat_s=settings.instance_heartbeat_s,
        dead_after_s=settings.instance_dead_after_s,
        resume=remediations.resume_executor,
    )


def resolve_downstream(settings: Settings) -> Downstream | None:
    """The settings' explicit downstream, else the standard ``OTEL_*`` variables."""
    configured = settings.downstream
    if configured is None:
        return downstream_from_env(os.environ)
    return Downstream(
        endpoint=configured.endpoint,
        protocol=configured.protocol,
        headers=tuple(configured.headers.items()),
        timeout_s=configured.timeout_s,
        insecure=True,
        compression=configured.compression,
    )


#: Shortest token accepted where a network, not just this host, can try it: 16
#: random characters are beyond guessing at any rate a server answers.
MIN_TOKEN_CHARS = 16


def _check_api_exposure(settings: Settings) -> None:
    if _is_loopback(settings.api_host):
        return
    if not settings.api_token:
        raise ConfigError(
            f"the control API would listen on {settings.api_host}, beyond loopback, without"
            " a token: set SPANVISOR_API_TOKEN (or api_token in the settings file)"
        )
    if len(settings.api_token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"the control API would listen on {settings.api_host}, beyond loopback, with a"
            f" {len(settings.api_token)}-character token: use at least {MIN_TOKEN_CHARS}"
            " random characters (e.g. python -c 'import secrets;"
            " print(secrets.token_urlsafe(32))')"
        )


def _check_otlp_exposure(settings: Settings) -> None:
    """OTLP drives commands to agents: beyond loopback only with a token, or by explicit choice."""
    token = settings.otlp_token
    if token is not None and len(token) < MIN_TOKEN_CHARS and not _is_loopback(settings.host):
        raise ConfigError(
            f"the OTLP receivers would listen on {settings.host}, beyond loopback, with a"
            f" {len(token)}-character otlp_token: use at least {MIN_TOKEN_CHARS} random"
            " characters"
        )
    if token or _is_loopback(settings.host):
        return
    if not settings.otlp_unauthenticated:
        raise ConfigError(
            f"the OTLP receivers would listen on {settings.host}, beyond loopback, without"
            " authentication, and the spans they accept drive commands to agents: set"
            " SPANVISOR_OTLP_TOKEN (or otlp_token in the settings file; exporters then send"
            " 'Authorization: Bearer <token>', e.g. OTEL_EXPORTER_OTLP_HEADERS="
            "'Authorization=Bearer <token>'), or otlp_unauthenticated: true if the network"
            " authenticates senders itself"
        )
    _log.warning(
        "the OTLP receivers listen on %s, beyond loopback, without authentication"
        " (otlp_unauthenticated is set): anyone who can reach them can drive commands",
        settings.host,
    )


def _is_loopback(host: str) -> bool:
    return host in (LOOPBACK, "localhost", "::1") or host.startswith("127.")


def _check_remediators(policy: Policy) -> None:
    problems = check_policy(policy)
    if problems:
        raise ConfigError(
            f"the policy {policy.source} names remediators that cannot run: " + "; ".join(problems)
        )


def _on_disk(path: object) -> bool:
    return str(path) != ":memory:"


def _ingest_log(settings: Settings) -> IngestLog | NoLog:
    """The ingest log in ``<state_path>.ingest-log``, beside the state database.

    None (NoLog) when the state is in memory or ``ingest_log_bytes`` is 0.
    """
    if not _on_disk(settings.state_path) or not settings.ingest_log_bytes:
        return NoLog()
    directory = Path(f"{settings.state_path}.ingest-log")
    try:
        return IngestLog(directory, max_bytes=settings.ingest_log_bytes)
    except OSError as exc:
        raise ConfigError(f"cannot open the ingest log in {directory}: {exc}") from exc


def _after_store(
    releases: Releases, remediations: Remediations, outcomes: Sequence[Outcome]
) -> None:
    """Stored: the ingest log may let their requests go; remediations may start."""
    releases.stored(outcomes)
    remediations.dispatch(outcomes)


def _tell_runs(runs: RunTracker, created: Sequence[StoredCommand]) -> None:
    """Every stored command moves its run on (one with no channel to go by does not)."""
    for stored in created:
        command = stored.command
        runs.notice(
            command.run_id,
            command.type.value,
            command.not_before,
            command.params,
            dead=stored.status == "dead",
        )


def _tell_runs_dead(runs: RunTracker, stored: StoredCommand) -> None:
    command = stored.command
    runs.notice(command.run_id, command.type.value, command.not_before, command.params, dead=True)


def _max_attempts(agents: Mapping[str, AgentDelivery], service: str) -> int:
    found = agents.get(service) or agents.get("*")
    return found.max_attempts if found is not None else 1


def _actuators(agents: Mapping[str, AgentDelivery]) -> dict[str, Actuator]:
    """One actuator per service with a push channel (webhook or command)."""
    built: dict[str, Actuator] = {}
    for service, delivery in agents.items():
        if delivery.webhook is not None:
            hook = delivery.webhook
            built[service] = WebhookActuator(
                url=hook.url,
                secret=hook.resolved_secret(),
                timeout_s=hook.timeout_s,
                headers=hook.headers,
            )
        elif delivery.command is not None:
            run = delivery.command
            built[service] = CommandActuator(argv=run.argv, timeout_s=run.timeout_s, env=run.env)
    return built


def _shared_counts(settings: Settings, link: RedisLink | None) -> WindowCounter | None:
    """Retry budgets, restart intensity and cascades counted by the fleet, in the breakers' Redis.

    The same link (one client, one breaker of its own, one "Redis up" metric).
    """
    if link is None:
        return None
    from supervisor.shared_counts import RedisWindowCounter  # needs the `fleet` extra

    return RedisWindowCounter(link, settings.breaker_redis_namespace)


def _shared_breakers(
    settings: Settings,
) -> tuple[Callable[[str], pybreaker.CircuitBreakerStorage] | None, RedisLink | None]:
    """Breaker storage shared through Redis (so a fleet shares its breakers), and its link."""
    url = settings.breaker_redis_url
    if url is None:
        return None, None
    try:
        from supervisor.shared_breakers import shared_breakers  # needs the `fleet` extra
    except ImportError as exc:
        raise ConfigError(
            "breaker_redis_url needs the redis package: pip install 'spanvisor[fleet]'"
        ) from exc
    storage, link = shared_breakers(
        url,
        namespace=settings.breaker_redis_namespace,
        timeout_s=settings.breaker_redis_timeout_s,
        retry_s=settings.breaker_redis_retry_s,
        required=settings.breaker_redis_required,
    )
    return storage, link


def _fleet_runs(settings: Settings, link: RedisLink | None) -> FleetRuns | None:
    """Sessions' loops and budgets counted fleet-wide, through the breakers' Redis link."""
    if link is None:
        return None
    from supervisor.runs.fleet import FleetRuns  # needs the `fleet` extra, as the link did

    return FleetRuns(link, f"{settings.breaker_redis_namespace}:runs")


def _admitter(spec: AdmissionSpec, link: RedisLink | None, settings: Settings) -> Admitter:
    """The admitter, its buckets and learned limits in the breakers' Redis (same link)
    when the fleet has one."""
    if link is None:
        return admitter_for(spec)
    from supervisor.admission.shared import RedisBucket  # needs the `fleet` extra
    from supervisor.admission.shared_learning import RedisLearning

    namespace = settings.breaker_redis_namespace
    return admitter_for(spec, RedisBucket(link, namespace), learning=RedisLearning(link, namespace))
