"""The sidecar's own OTel metrics, exported over OTLP next to its own spans.

For now one instrument: ``spanvisor.breaker.transitions``, a counter of
circuit-breaker state changes with the dependency, the states and the
reason as attributes, so a dashboard or an alert can follow breakers without
reading the sidecar's API. A private ``MeterProvider`` (like the tracer's
private ``TracerProvider``) keeps the sidecar's metrics out of any global an
embedding program set.

Lifecycle: built with the sidecar; :meth:`SidecarMetrics.breaker_changed`
from the event loop; :meth:`SidecarMetrics.shutdown` once (flushes, bounded).
Never raises on the hot path: an SDK error is logged once and counted.
"""

from __future__ import annotations

import logging

from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource

from supervisor import __version__
from supervisor.forward.downstream import Downstream

log = logging.getLogger("spanvisor.metrics")

BREAKER_TRANSITIONS = "spanvisor.breaker.transitions"


class SidecarMetrics:
    """Counters of the sidecar's own doings; see the module for the lifecycle."""

    def __init__(
        self,
        downstream: Downstream | None,
        *,
        reader: MetricReader | None = None,
        export_interval_s: float = 15.0,
    ) -> None:
        readers: list[MetricReader] = []
        if reader is not None:
            readers.append(reader)
        else:
            exporter = _exporter(downstream)
            if exporter is not None:
                readers.append(
                    PeriodicExportingMetricReader(
                        exporter, export_interval_millis=export_interval_s * 1000
                    )
                )
        self._provider = MeterProvider(
            metric_readers=readers,
            resource=Resource.create({SERVICE_NAME: "spanvisor"}),
            shutdown_on_exit=False,
        )
        meter = self._provider.get_meter("spanvisor", __version__)
        self._transitions = meter.create_counter(
            BREAKER_TRANSITIONS,
            unit="{transition}",
            description="Circuit breaker state changes, by dependency, states and reason.",
        )
        self.errors = 0

    def breaker_changed(self, dependency: str, old: str, new: str, reason: str) -> None:
        try:
            self._transitions.add(
                1,
                {
                    "spanvisor.breaker.dependency": dependency[:512],
                    "spanvisor.breaker.from": old,
                    "spanvisor.breaker.to": new,
                    "spanvisor.breaker.reason": reason,
                },
            )
        except Exception:  # metrics must never break the sidecar
            self.errors += 1
            if self.errors == 1:
                log.exception("could not record a metric (logged once)")

    def shutdown(self, timeout_s: float) -> None:
        try:
            self._provider.shutdown(timeout_millis=max(1.0, timeout_s * 1000))
        except Exception:  # shutting down is best effort, bounded by the timeout
            log.exception("metrics shutdown failed")


def _exporter(downstream: Downstream | None) -> MetricExporter | None:
    """The OTLP metric exporter for ``downstream`` (``/v1/metrics`` beside ``/v1/traces``)."""
    if downstream is None:
        return None
    if downstream.protocol == "grpc":
        return GrpcMetricExporter(
            endpoint=downstream.grpc_target,
            insecure=downstream.grpc_insecure,
            headers=tuple(downstream.header_dict.items()),
            timeout=downstream.timeout_s,
        )
    url = downstream.http_url
    url = url[: -len("/v1/traces")] + "/v1/metrics" if url.endswith("/v1/traces") else url
    return HttpMetricExporter(
        endpoint=url, headers=downstream.header_dict, timeout=downstream.timeout_s
    )
