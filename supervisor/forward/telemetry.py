"""The sidecar's own spans: one ``spanvisor.decide`` span per decision.

A decision span is a child of the span that failed (same trace, parent = the
failing span), so a trace viewer shows the failure and what the sidecar made
of it side by side. The tracer owns a private ``TracerProvider``, never the
global one: the sidecar must not trace its own ingest path, and
auto-instrumentation must neither pick it up nor be picked up by it.

:meth:`DecisionTracer.emit` is on the hot path: it never blocks (the batch
processor exports from its own thread) and never raises (errors are logged
once and counted). :meth:`~DecisionTracer.force_flush` and
:meth:`~DecisionTracer.shutdown` block the caller for at most ``timeout_s``;
call them through ``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from grpc import Compression as GrpcCompression
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import AttributeValue

from remediators.tracing import PresetIdGenerator
from supervisor import __version__
from supervisor.errors import ConfigError
from supervisor.forward.downstream import Downstream
from supervisor.records import AttrValue, Decision, Failure

log = logging.getLogger("spanvisor.telemetry")

SPAN_NAME: Final = "spanvisor.decide"
BREAKER_SPAN_NAME: Final = "spanvisor.breaker"
#: Longest failure message or reason put on a span (characters).
MAX_TEXT: Final = 1024
_TRACE_ID: Final = re.compile(r"[0-9a-fA-F]{32}")
_SPAN_ID: Final = re.compile(r"[0-9a-fA-F]{16}")
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)


@dataclass(frozen=True, slots=True)
class TracerStats:
    """``emitted`` decision spans; ``errors``: decisions whose span could not be made."""

    emitted: int
    errors: int


class DecisionTracer:
    """Emits ``spanvisor.decide`` spans through a private SDK pipeline.

    ``exporter`` wins over ``downstream`` (tests pass an
    ``InMemorySpanExporter``); with neither, spans are made but not exported.
    """

    def __init__(
        self,
        downstream: Downstream | None,
        *,
        service_name: str = "spanvisor",
        exporter: SpanExporter | None = None,
        schedule_delay_s: float = 1.0,
    ) -> None:
        self._provider = TracerProvider(
            sampler=ALWAYS_ON,
            # Remediation traces have ids fixed in advance (remediators.tracing).
            id_generator=PresetIdGenerator(),
            resource=Resource.create({SERVICE_NAME: service_name}),
            shutdown_on_exit=False,
        )
        chosen = exporter if exporter is not None else _otlp_exporter(downstream)
        #: Where decision spans go, ended (None: made, not exported).
        self._processor: SpanProcessor | None = None
        if chosen is not None:
            timeout_ms = 1000 * (downstream.timeout_s if downstream is not None else 10.0)
            self._processor = BatchSpanProcessor(
                chosen,
                max_queue_size=2048,
                schedule_delay_millis=schedule_delay_s * 1000,
                max_export_batch_size=512,
                export_timeout_millis=timeout_ms,
            )
            self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("spanvisor", __version__)
        self._scope = InstrumentationScope("spanvisor", __version__)
        self._ids = self._provider.id_generator
        self._lock = threading.Lock()
        self._emitted = 0
        self._errors = 0
        self._error_logged = False
        self._shut = False

    @property
    def tracer(self) -> trace.Tracer:
        """The tracer for the sidecar's other own spans (remediations), same pipeline."""
        return self._tracer

    def emit(self, failure: Failure, decision: Decision) -> str:
        """Record the decision as a child of the failing span; its span id (hex), or ``""``.

        Never raises: a failure whose ids are not valid hex, or any error in
        the SDK, is logged once and counted in ``stats().errors``.
        """
        try:
            if not (_TRACE_ID.fullmatch(failure.trace_id) and _SPAN_ID.fullmatch(failure.span_id)):
                raise ValueError("the failure's trace_id/span_id are not 32/16 hex digits")
            parent = SpanContext(
                trace_id=int(failure.trace_id, 16),
                span_id=int(failure.span_id, 16),
                is_remote=True,
                trace_flags=_SAMPLED,
            )
            if not parent.is_valid:
                raise ValueError("the failure's trace_id/span_id are all zeros")
            # Made ended, as the SDK's span would be on end(), without what a live span
            # needs (sampler, context, lock, limits): a decision has no duration and no
            # children, and this was most of the cost of a decision in the sidecar.
            span_id = self._ids.generate_span_id()
            now = time.time_ns()
            span = ReadableSpan(
                SPAN_NAME,
                context=SpanContext(
                    parent.trace_id, span_id, is_remote=False, trace_flags=_SAMPLED
                ),
                parent=parent,
                resource=self._provider.resource,
                attributes=decision_attributes(failure, decision),
                kind=SpanKind.INTERNAL,
                start_time=now,
                end_time=now,
                instrumentation_scope=self._scope,
            )
            if self._processor is not None:
                self._processor.on_end(span)
        except Exception as exc:
            self._count_error(exc, failure)
            return ""
        with self._lock:
            self._emitted += 1
        return format(span_id, "016x") if span_id else ""

    def emit_breaker_change(
        self, dependency: str, old: str, new: str, reason: str, failures: int
    ) -> None:
        """Record a breaker's state change as a ``spanvisor.breaker`` span (a trace of its own).

        Never raises; errors are counted like :meth:`emit`'s.
        """
        try:
            span = self._tracer.start_span(
                BREAKER_SPAN_NAME,
                context=trace.set_span_in_context(trace.INVALID_SPAN),
                kind=SpanKind.INTERNAL,
                attributes={
                    "spanvisor.breaker.dependency": dependency[:512],
                    "spanvisor.breaker.from": old,
                    "spanvisor.breaker.to": new,
                    "spanvisor.breaker.reason": reason,
                    "spanvisor.breaker.failures": failures,
                },
            )
            span.end()
        except Exception as exc:
            with self._lock:
                self._errors += 1
            if not self._error_logged:
                self._error_logged = True
                log.warning("could not record a breaker span (logged once): %s", exc)
            return
        with self._lock:
            self._emitted += 1

    def force_flush(self, timeout_s: float) -> bool:
        """Export what is buffered; False when ``timeout_s`` passed first."""
        result: list[bool] = []
        done = _run_bounded(
            lambda: result.append(self._provider.force_flush(int(timeout_s * 1000))),
            timeout_s,
            "spanvisor-tracer-flush",
        )
        return done and bool(result) and result[0]

    def shutdown(self, timeout_s: float) -> None:
        """Export what is buffered and stop; returns within ``timeout_s`` (idempotent)."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
        if not _run_bounded(self._provider.shutdown, timeout_s, "spanvisor-tracer-shutdown"):
            log.warning(
                "own-span exporter did not shut down in time; unsent decision spans are lost",
                extra={"timeout_s": timeout_s},
            )

    def stats(self) -> TracerStats:
        with self._lock:
            return TracerStats(emitted=self._emitted, errors=self._errors)

    def _count_error(self, exc: Exception, failure: Failure) -> None:
        with self._lock:
            self._errors += 1
            first = not self._error_logged
            self._error_logged = True
        if first:
            log.warning(
                "could not emit a decision span (logged once; see stats)",
                extra={
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace_id": str(failure.trace_id)[:64],
                    "span_id": str(failure.span_id)[:32],
                },
            )


def decision_attributes(failure: Failure, decision: Decision) -> dict[str, AttributeValue]:
    """The ``spanvisor.*`` attributes of a decision span."""
    attributes: dict[str, AttributeValue] = {
        "spanvisor.failure.class": failure.failure_class.value,
        "spanvisor.failure.kind": failure.kind,
        "spanvisor.failure.dependency": failure.dependency,
        "spanvisor.failure.message": failure.message[:MAX_TEXT],
        "spanvisor.rule": failure.rule,
        "spanvisor.action": decision.action.value,
        "spanvisor.policy": decision.policy,
        "spanvisor.run_id": failure.run_id,
        "spanvisor.service": failure.service,
        "spanvisor.observe_only": decision.observe_only,
    }
    if decision.reason:
        attributes["spanvisor.reason"] = decision.reason[:MAX_TEXT]
    remediation_trace = decision.params.get("remediation_trace_id")
    if isinstance(remediation_trace, str):
        # Where the fix is: the remediation's own trace, whose root links back here.
        attributes["spanvisor.remediation.trace_id"] = remediation_trace
    attributes.update(flatten_params(decision.params))
    return attributes


def flatten_params(params: Mapping[str, AttrValue]) -> dict[str, AttributeValue]:
    """``spanvisor.decision.<name>`` for each scalar parameter.

    Not ``spanvisor.action.<name>``: ``spanvisor.action`` is an attribute
    itself, and a name that is also a namespace cannot be searched in viewers
    that store attributes as a tree (Phoenix), as OTel's naming rules warn.
    Scalars are str, bool, int and float; a sequence of scalars of one type
    (a fallback chain) is kept as an OTel array attribute. Mappings, bytes,
    None and mixed sequences are left out: they are not attribute values.
    """
    flat: dict[str, AttributeValue] = {}
    for name, value in params.items():
        converted = _attribute_value(value)
        if converted is not None:
            flat[f"spanvisor.decision.{name}"] = converted
    return flat


def _attribute_value(value: AttrValue) -> AttributeValue | None:
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        items = list(value)
        if not items:
            return None
        if all(isinstance(item, str) for item in items):
            return [str(item)[:MAX_TEXT] for item in items]
        if all(isinstance(item, bool) for item in items):
            return [item for item in items if isinstance(item, bool)]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return [item for item in items if isinstance(item, int)]
        if all(isinstance(item, float) for item in items):
            return [item for item in items if isinstance(item, float)]
    return None


def _otlp_exporter(downstream: Downstream | None) -> SpanExporter | None:
    """The SDK's own OTLP exporter for ``downstream``, or None without one."""
    if downstream is None:
        return None
    try:
        if downstream.protocol == "grpc":
            return GrpcExporter(
                endpoint=downstream.grpc_target,
                insecure=downstream.grpc_insecure,
                headers=tuple(downstream.header_dict.items()),
                timeout=downstream.timeout_s,
                compression=(
                    GrpcCompression.Gzip
                    if downstream.compression == "gzip"
                    else GrpcCompression.NoCompression
                ),
            )
        return HttpExporter(
            endpoint=downstream.http_url,
            headers=downstream.header_dict,
            timeout=downstream.timeout_s,
            compression=(
                HttpCompression.Gzip
                if downstream.compression == "gzip"
                else HttpCompression.NoCompression
            ),
        )
    except Exception as exc:
        raise ConfigError(f"cannot build the OTLP exporter for own spans: {exc}") from exc


def _run_bounded(fn: Callable[[], object], timeout_s: float, name: str) -> bool:
    """Run a blocking SDK call in a daemon thread; False if it outlives ``timeout_s``.

    The SDK's flush and shutdown wait on the exporter's own timeout and
    retries; this is what makes ours a real bound.
    """
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # reported below, on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if errors:
        log.warning("own-span exporter call failed", exc_info=errors[0])
        return False
    return not thread.is_alive()
