"""``/metrics``: the sidecar's counters in the Prometheus text format.

Nothing here counts: :class:`SidecarCollector` reads, at scrape time, the
counters the stages already keep for ``/v1/stats`` (the ingest queue, the
ingest log, the recent failures, the dispatcher, the store, the breaker board,
the remediations), so ``/metrics`` and ``/v1/stats`` can never disagree. Names
follow Prometheus' conventions: a ``spanvisor_`` prefix, ``_total`` on
counters, seconds and bytes.

Labels stay bounded: transports, failure classes, actions, command statuses and
breaker states are closed sets; failure kinds are capped where they are counted
(:mod:`supervisor.act.failure_log`); breakers, one per dependency named in
spans, are shown one by one only for :data:`MAX_BREAKER_SERIES` dependencies
(those not closed first), and ``spanvisor_breaker_series_cut`` says how many
were left out (``spanvisor_breakers`` counts them all, by state).

A scrape runs on the event loop (the route is ``async``): the queue and the
breaker board are read where they are written. Its cost is that of
``/v1/stats``: a few counters, the breaker board's snapshot and one small
query for the pending approvals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policies import BreakerState, Governor
from supervisor import __version__
from supervisor.act.dispatch import Dispatcher
from supervisor.act.failure_log import RecentFailures
from supervisor.act.fleet import Fleet
from supervisor.act.store import Store
from supervisor.act.store_writer import StoreWriter
from supervisor.admission import Admitter
from supervisor.forward.breaker_report import BreakerReport
from supervisor.forward.relay import Forwarder
from supervisor.ingest.auth import ReceiverAuth
from supervisor.ingest.queue import IngestQueue
from supervisor.ingest.wal import IngestLog, NoLog
from supervisor.records import Action
from supervisor.remediation.engine import Remediations

if TYPE_CHECKING:
    from supervisor.shared_breakers import RedisLink

__all__ = ["CONTENT_TYPE", "MAX_BREAKER_SERIES", "MetricSources", "SidecarCollector", "exposition"]

#: What ``/metrics`` answers with: the Prometheus text format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Dependencies whose breaker state is shown one by one (4 series each).
MAX_BREAKER_SERIES = 100
#: How a remediation can end (``remediators.runner``'s outcomes), shown even at 0.
_REMEDIATION_OUTCOMES = ("succeeded", "failed", "escalated", "refused")
#: Why ingest refused a request outright (``IngestStats`` field for each reason).
_REFUSALS = {
    "decode_error": "decode_errors",
    "too_large": "too_large",
    "read_timeout": "read_timeouts",
    "internal_error": "internal_errors",
}


@dataclass(frozen=True, slots=True)
class MetricSources:
    """The sidecar's parts whose counters ``/metrics`` reads (the ones ``/v1/stats`` reads)."""

    queue: IngestQueue
    ingest_log: IngestLog | NoLog
    failures: RecentFailures
    dispatcher: Dispatcher
    store: Store
    writer: StoreWriter
    governor: Governor
    breakers: BreakerReport
    remediations: Remediations
    forwarder: Forwarder | None = None
    otlp_auth: ReceiverAuth | None = None
    #: The Redis the breakers share (None: they are this sidecar's own).
    breaker_link: RedisLink | None = None
    #: Heartbeats and takeovers (None: not a fleet, no series).
    fleet: Fleet | None = None
    #: Admission control's answers (None: no series).
    admitter: Admitter | None = None
    #: Wall clock, for the age of pending approvals (stored in wall-clock seconds).
    clock: Callable[[], float] = time.time


class SidecarCollector(Collector):
    """Reads :class:`MetricSources` at each scrape; see the module."""

    def __init__(self, sources: MetricSources) -> None:
        self._s = sources

    def collect(self) -> Iterator[Metric]:
        yield from self._build()
        yield from self._ingest()
        yield from self._judging()
        yield from self._commands()
        yield from self._breakers()
        yield from self._remediations()
        yield from self._fleet()
        yield from self._admission()
        yield from self._forward()

    def _build(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "spanvisor_build_info",
            "The running spanvisor's version (always 1).",
            labels=["version"],
        )
        info.add_metric([__version__], 1)
        yield info

    def _ingest(self) -> Iterator[Metric]:
        queue = self._s.queue
        received = _counter(
            "spanvisor_spans_received",
            "Spans acknowledged and queued for judging, by OTLP transport.",
            ["transport"],
        )
        rejected = _counter(
            "spanvisor_spans_rejected",
            "Spans dropped by validation (bad trace or span id), by OTLP transport.",
            ["transport"],
        )
        for transport, spans in queue.spans_by_transport().items():
            received.add_metric([transport], spans.accepted)
            rejected.add_metric([transport], spans.rejected)
        yield received
        yield rejected
        stats = queue.stats()
        yield _counter(
            "spanvisor_ingest_throttled_requests",
            "Export requests answered 'retry later' (a bound of the ingest queue or log was"
            " reached); the exporter sends them again.",
            value=stats.throttled_batches,
        )
        yield _counter(
            "spanvisor_ingest_throttled_spans",
            "Spans in the throttled export requests.",
            value=stats.throttled_spans,
        )
        refused = _counter(
            "spanvisor_ingest_refused_requests",
            "Export requests refused and not to be sent again: undecodable, too large, body"
            " too slow, an error of the sidecar's, or a missing or wrong token.",
            ["reason"],
        )
        for reason, field in _REFUSALS.items():
            refused.add_metric([reason], getattr(stats, field))
        auth = self._s.otlp_auth
        refused.add_metric(["unauthorized"], auth.refused if auth is not None else 0)
        yield refused
        yield _gauge(
            "spanvisor_ingest_queue_batches",
            "Export requests waiting to be judged.",
            stats.queued_batches,
        )
        yield _gauge(
            "spanvisor_ingest_queue_spans",
            "Spans queued or being judged.",
            stats.queued_spans,
        )
        yield _gauge(
            "spanvisor_ingest_queue_bytes",
            "Bytes ingest holds: queued or judged requests and bodies being decoded.",
            stats.queued_bytes,
        )
        yield _gauge(
            "spanvisor_ingest_queue_max_bytes",
            "The bound on spanvisor_ingest_queue_bytes (setting ingest_queue_bytes).",
            queue.max_bytes,
        )
        log = self._s.ingest_log.stats()
        yield _gauge(
            "spanvisor_ingest_log_bytes",
            "Bytes of acknowledged requests the ingest log holds until their outcomes are"
            " stored (0 when the log is off).",
            log.live_bytes,
        )
        yield _gauge(
            "spanvisor_ingest_log_max_bytes",
            "The bound on spanvisor_ingest_log_bytes; past it, ingest throttles.",
            log.max_bytes,
        )
        yield _counter(
            "spanvisor_ingest_log_written_bytes",
            "Bytes appended and synced to the ingest log.",
            value=log.logged_bytes,
        )

    def _judging(self) -> Iterator[Metric]:
        failures = self._s.failures
        by_kind = _counter(
            "spanvisor_failures",
            f"Failures reported, by class and kind (kinds past the first"
            f" {failures.by_kind.capacity} count as 'other').",
            ["class", "kind"],
        )
        for (cls, kind), n in failures.by_kind.items():
            by_kind.add_metric([cls, kind], n)
        yield by_kind
        yield _counter(
            "spanvisor_failure_kinds_cut",
            "Failures counted as kind 'other' because too many kinds were seen.",
            value=failures.by_kind.cut,
        )
        decisions = _counter(
            "spanvisor_decisions",
            "Decisions made on reported failures, by action; observe_only: computed and"
            " reported, not delivered.",
            ["action", "observe_only"],
        )
        counted = dict(failures.by_action)
        for action in Action:
            for observe_only in (False, True):
                n = counted.get((action.value, observe_only), 0)
                decisions.add_metric([action.value, str(observe_only).lower()], n)
        yield decisions
        health = self._s.writer.health()
        yield _counter(
            "spanvisor_store_dropped_failures",
            "Judged failures dropped while the store refused writes (the kept ones were at"
            " their bound).",
            value=health.dropped_failures,
        )
        yield _gauge(
            "spanvisor_store_failing",
            "1 while the store refuses writes (decisions are still made and delivered).",
            int(health.failing_since is not None),
        )

    def _commands(self) -> Iterator[Metric]:
        stats = self._s.dispatcher.stats()
        yield _counter(
            "spanvisor_commands_delivered",
            "Commands delivered over a push channel (webhook, command).",
            value=stats.delivered,
        )
        yield _counter(
            "spanvisor_command_retries",
            "Push deliveries that failed and were planned again after a backoff.",
            value=stats.failed_attempts,
        )
        yield _counter(
            "spanvisor_commands_dead_lettered",
            "Push deliveries given up on (refused, out of attempts, or no channel for the"
            " service); commands stored dead at once are in spanvisor_commands.",
            value=stats.dead_lettered,
        )
        yield _counter(
            "spanvisor_commands_overflowed",
            "Commands stored dead at once because too many were already waiting"
            " (setting max_pending_commands).",
            value=self._s.store.overflowed,
        )
        yield _gauge(
            "spanvisor_command_deliveries_in_flight",
            "Push deliveries under way.",
            stats.in_flight,
        )
        stored = GaugeMetricFamily(
            "spanvisor_commands",
            "Stored commands by status, every channel (pull too), within the retention;"
            " counted every few seconds.",
            labels=["status"],
        )
        for status, n in self._s.store.counts().items():
            stored.add_metric([status], n)
        yield stored
        pending, oldest = self._s.store.pending_approvals()
        yield _gauge(
            "spanvisor_approvals_pending",
            "Approval requests waiting for a person's answer.",
            pending,
        )
        age = 0.0 if oldest is None else max(0.0, self._s.clock() - oldest)
        yield _gauge(
            "spanvisor_approval_oldest_pending_age_seconds",
            "How long the oldest unanswered approval request has waited (0: none waits).",
            age,
        )

    def _breakers(self) -> Iterator[Metric]:
        snapshot = self._s.governor.board.snapshot()  # sorted by dependency
        by_state = dict.fromkeys((s.value for s in BreakerState), 0)
        for info in snapshot:
            by_state[info.state.value] += 1
        count = GaugeMetricFamily(
            "spanvisor_breakers", "Tracked circuit breakers, by state.", labels=["state"]
        )
        for name, n in by_state.items():
            count.add_metric([name], n)
        yield count
        shown = sorted(snapshot, key=lambda b: b.state is BreakerState.CLOSED)
        shown = shown[:MAX_BREAKER_SERIES]
        states = GaugeMetricFamily(
            "spanvisor_breaker_state",
            "1 for the state each dependency's circuit breaker is in, 0 for the others"
            f" (at most {MAX_BREAKER_SERIES} dependencies, those not closed first).",
            labels=["dependency", "state"],
        )
        for info in shown:
            for state in BreakerState:
                states.add_metric([info.dependency, state.value], int(info.state is state))
        yield states
        yield _gauge(
            "spanvisor_breaker_series_cut",
            "Tracked breakers left out of spanvisor_breaker_state (over its limit).",
            len(snapshot) - len(shown),
        )
        transitions = _counter(
            "spanvisor_breaker_transitions",
            "Circuit breaker state changes, by states (the OTLP metric"
            " spanvisor.breaker.transitions has the dependency too).",
            ["from", "to"],
        )
        for (old, new), n in sorted(self._s.breakers.transitions.items()):
            transitions.add_metric([old, new], n)
        yield transitions
        link = self._s.breaker_link
        if link is not None:
            shared = link.stats()
            yield _gauge(
                "spanvisor_breaker_redis_up",
                "1 while the breakers' shared Redis answers, 0 while they use local state.",
                int(shared.reachable),
            )
            yield _counter(
                "spanvisor_breaker_redis_outages",
                "Times the breakers' Redis stopped answering.",
                value=shared.outages,
            )

    def _remediations(self) -> Iterator[Metric]:
        described = self._s.remediations.describe()
        finished = _counter(
            "spanvisor_remediations_finished",
            "Remediations ended, by outcome.",
            ["outcome"],
        )
        for outcome in _REMEDIATION_OUTCOMES:
            finished.add_metric([outcome], int(described.get(outcome, 0)))
        yield finished
        yield _counter(
            "spanvisor_remediations_dispatched",
            "Remediations started for 'remediate' decisions.",
            value=int(described.get("dispatched", 0)),
        )
        yield _gauge(
            "spanvisor_remediations_active",
            "Remediations running now.",
            int(described.get("active", 0)),
        )

    def _admission(self) -> Iterator[Metric]:
        admitter = self._s.admitter
        if admitter is None:
            return
        stats = admitter.stats()
        answers = _counter(
            "spanvisor_admissions", "Answers of POST /v1/admit, by answer.", ["answer"]
        )
        answers.add_metric(["go"], stats.admitted)
        answers.add_metric(["wait"], stats.refused)
        yield answers
        refusals = _counter(
            "spanvisor_admission_refusals",
            "Refused admissions, by why (limit, priority, share, paused).",
            ["why"],
        )
        for why, count in stats.refused_by.items():
            refusals.add_metric([why], count)
        yield refusals
        yield _counter(
            "spanvisor_admissions_local",
            "Admission answers from this sidecar's own bucket (Redis away or not configured).",
            value=stats.answered_locally,
        )
        yield _counter(
            "spanvisor_admission_throttles",
            "429s (rate_limit failures) that lowered a model's admission limit.",
            value=stats.throttles,
        )

    def _fleet(self) -> Iterator[Metric]:
        fleet = self._s.fleet
        if fleet is None:  # not a fleet: no series
            return
        yield _gauge(
            "spanvisor_fleet_instances_alive",
            "Sidecars of the fleet whose heartbeat is recent (this one included).",
            fleet.alive,
        )
        yield _gauge(
            "spanvisor_fleet_instances_dead",
            "Sidecars of the fleet without a heartbeat for instance_dead_after_s.",
            fleet.dead,
        )
        yield _counter(
            "spanvisor_fleet_takeovers",
            "Dead sidecars whose work this sidecar took over.",
            value=fleet.takeovers,
        )
        yield _counter(
            "spanvisor_fleet_remediations_resumed",
            "Dead sidecars' pending remediations this sidecar resumed.",
            value=fleet.remediations_resumed,
        )
        yield _counter(
            "spanvisor_fleet_commands_released",
            "Dead sidecars' claimed commands this sidecar made due again.",
            value=fleet.commands_released,
        )

    def _forward(self) -> Iterator[Metric]:
        forwarder = self._s.forwarder
        if forwarder is None:  # no downstream: nothing is relayed, no series
            return
        stats = forwarder.stats()
        yield _counter(
            "spanvisor_forward_spans",
            "Spans relayed to the downstream collector.",
            value=stats.forwarded_spans,
        )
        yield _counter(
            "spanvisor_forward_dropped_spans",
            "Spans not relayed: the relay queue was full, the downstream refused them or"
            " stayed unreachable, or the sidecar stopped.",
            value=stats.dropped_spans,
        )
        yield _gauge(
            "spanvisor_forward_queue_bytes",
            "Bytes waiting to be relayed (or in flight).",
            stats.queued_bytes,
        )


def exposition(sources: MetricSources) -> Callable[[], bytes]:
    """The body of ``/metrics`` for one sidecar: its counters and its process's.

    A registry of its own, never the global one: a program (or a test) may run
    several sidecars, and an embedding program's metrics are not the sidecar's.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(sources))
    registry.register(ProcessCollector(registry=None))
    return lambda: generate_latest(registry)


def _counter(
    name: str, documentation: str, labels: list[str] | None = None, value: float | None = None
) -> CounterMetricFamily:
    """A counter family (``_total`` is added to ``name``)."""
    return CounterMetricFamily(name, documentation, value=value, labels=labels)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
