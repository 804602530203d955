"""Runs as a real agent's exporter sends them, to a real sidecar: ended stays ended.

The agent is the openai client, instrumented by ``opentelemetry-instrumentation-openai-v2``
(content capture off, its default), under an ``invoke_agent`` root span; its
spans go through the OpenTelemetry SDK's BatchSpanProcessor and OTLP/HTTP
exporter to a sidecar on loopback. The model answers 401 (a revoked key): the
failing call and its root span leave in one batch, the root failed by the
error or ending well (the agent caught it and gave up politely). The run has
ended; an hour later it is still ended, and it was told to abort, never
paused, resumed or asked of a person for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.judge.pipeline import Outcome
from supervisor.settings import load_settings
from supervisor.testing import FakeProvider, Reply
from supervisor.testing.sidecar_process import wait_until
from supervisor.wiring import build_sidecar


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[BackgroundSidecar]:
    settings = load_settings(
        overrides={
            "api_token": "tok",
            "token_file": str(tmp_path / "token"),
            "state_path": str(tmp_path / "state.db"),
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "agents": {"agent": {"pull": {}}},
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(), downstream=None))
    background.start()
    try:
        yield background
    finally:
        background.stop()


def on_loop(background: BackgroundSidecar, now: float) -> list[Outcome]:
    """The stall check at ``now``, on the sidecar's own loop (the tracker is its)."""

    async def check() -> list[Outcome]:
        return background.sidecar.check_stalls(now)

    return asyncio.run_coroutine_threadsafe(check(), background._loop).result(10)


@pytest.mark.parametrize("caught", [False, True], ids=["root-failed", "root-ok"])
def test_a_run_ended_by_a_revoked_key_is_never_stalled_paused_or_escalated(
    sidecar: BackgroundSidecar, caught: bool
) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    endpoint = f"http://127.0.0.1:{sidecar.ports.otlp_http}/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    instrumentor = OpenAIInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument(tracer_provider=provider)
    tracer = provider.get_tracer("agent")
    try:
        with FakeProvider() as fake:
            fake.script(Reply.unauthorized())
            client = openai.OpenAI(base_url=fake.base_url, api_key="sk-revoked", max_retries=0)
            with (
                pytest.raises(openai.AuthenticationError)
                if not caught
                else contextlib.nullcontext(),
                tracer.start_as_current_span(
                    "invoke_agent", attributes={"gen_ai.operation.name": "invoke_agent"}
                ) as root,
            ):
                try:
                    client.chat.completions.create(
                        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
                    )
                except openai.AuthenticationError:
                    if not caught:
                        raise
        provider.force_flush()  # the call and its root leave together
    finally:
        instrumentor.uninstrument()  # type: ignore[no-untyped-call]
        provider.shutdown()
    run_id = format(root.get_span_context().trace_id, "032x")
    store = sidecar.sidecar.store
    wait_until(lambda: store.incidents(10), 10, "the 401 judged and stored")

    assert on_loop(sidecar, time.time() + 3600) == []  # an hour later: no stall
    (run,) = [r for r in sidecar.sidecar.runs.snapshot() if r.run_id == run_id]
    assert run.status == "ended"
    types = {c.command.type.value for c in store.commands(limit=100)}
    assert types == {"abort_run"}  # never paused, resumed or retried
    assert store.approvals(status="pending") == []
