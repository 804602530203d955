"""Remediation traces: ids fixed in advance, and the link to the triggering span.

A remediation's trace id is known before it starts (the decision span names
it) and its root span must keep the same ids when a restarted sidecar runs
the workflow again: a root that was never ended before the crash is then
exported once, complete. :class:`PresetIdGenerator` gives the next span the
ids set by :func:`preset_ids`, and random ones otherwise; the sidecar's own
tracer provider uses it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator

from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

__all__ = ["PresetIdGenerator", "preset_ids", "root_span_id"]

_NEXT: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "spanvisor_next_span_ids", default=None
)


def root_span_id(remediation_id: str) -> str:
    """The root span id (hex) of a remediation's trace."""
    return hashlib.sha256(f"root/{remediation_id}".encode()).hexdigest()[:16]


@contextlib.contextmanager
def preset_ids(trace_id: str, span_id: str) -> Iterator[None]:
    """The span started inside this block gets these ids (hex)."""
    token = _NEXT.set((int(trace_id, 16), int(span_id, 16)))
    try:
        yield
    finally:
        _NEXT.reset(token)


class PresetIdGenerator(IdGenerator):
    """Random ids, except for a span started inside :func:`preset_ids`."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        preset = _NEXT.get()
        return preset[0] if preset is not None else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        preset = _NEXT.get()
        return preset[1] if preset is not None else self._random.generate_span_id()
