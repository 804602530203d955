"""OTLP trace receivers: gRPC and HTTP in, a bounded queue of batches out.

``codec`` decodes payloads and encodes the answers, ``validation`` removes the
spans no backend could store, ``messages`` says what is wrong with a payload,
``queue`` is the bounded hand-off downstream, ``http_receiver`` and
``grpc_receiver`` are the two endpoints.
"""

from __future__ import annotations

from supervisor.ingest.codec import Validation, decode_request, validate_spans
from supervisor.ingest.grpc_receiver import GrpcReceiver
from supervisor.ingest.http_receiver import build_otlp_http_app
from supervisor.ingest.queue import Batch, IngestQueue, IngestStats, QueueClosed, Transport

__all__ = [
    "Batch",
    "GrpcReceiver",
    "IngestQueue",
    "IngestStats",
    "QueueClosed",
    "Transport",
    "Validation",
    "build_otlp_http_app",
    "decode_request",
    "validate_spans",
]
