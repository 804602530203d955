"""Fakes shipped with the package so tests and the demo never need the internet.

:mod:`supervisor.testing.fake_provider` is an OpenAI/Anthropic-compatible LLM
server on loopback that the real SDKs talk to; the HTTP fakes share the
lifecycle of :class:`supervisor.testing.loopback.LoopbackServer`.
"""

from __future__ import annotations

from supervisor.testing.fake_provider import (
    FakeProvider,
    FaultPlan,
    KeyCounts,
    PublishedLimit,
    RecordedRequest,
    Reply,
    ToolCall,
)

__all__ = [
    "FakeProvider",
    "FaultPlan",
    "KeyCounts",
    "PublishedLimit",
    "RecordedRequest",
    "Reply",
    "ToolCall",
]
