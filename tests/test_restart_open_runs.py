"""A sidecar killed with ``kill -9`` and started again still finds the stalls of its runs.

A real ``spanvisor run`` process takes spans from the OpenTelemetry SDK
(its BatchSpanProcessor and OTLP/HTTP exporter): one run whose agent
asked for a tool and then went silent (its worker crashed), one run that
ended. The sidecar is killed, and started again on the same state file:
the silent run's stall is still found, with the tool call whose effect is
unverified, and the run that ended is never reported.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from supervisor.testing.sidecar_process import SidecarProcess, wait_until

pytestmark = pytest.mark.slow

POLICY = "version: 1\ndetectors:\n  stalls: {idle_seconds: 3}\n"
ASKED = [
    {
        "role": "assistant",
        "parts": [
            {"type": "tool_call", "id": "c1", "name": "charge_card", "arguments": {"amount": 5}}
        ],
    }
]


def journaled(state: Path) -> set[str]:
    """The run ids in the state database's journal of open runs."""
    if not state.exists():
        return set()
    db = sqlite3.connect(state)
    try:
        return {row[0] for row in db.execute("SELECT run_id FROM open_runs")}
    except sqlite3.OperationalError:
        return set()
    finally:
        db.close()


def stalls(sidecar: SidecarProcess) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = sidecar.get("/v1/incidents", limit=100)["incidents"]
    return [i for i in found if i.get("kind") == "stall"]


def test_a_stall_that_spans_a_kill_and_a_restart_is_found(tmp_path: Path) -> None:
    sidecar = SidecarProcess({"agents": {"agent": {"pull": {}}}}, tmp_path, policy=POLICY)
    sidecar.start()
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{sidecar.otlp_endpoint}/v1/traces"))
        )
        tracer = provider.get_tracer("agent")
        crashed = tracer.start_span("invoke_agent crashed")  # never ends: its worker died
        with tracer.start_as_current_span(
            "chat gpt-4o",
            context=trace.set_span_in_context(crashed),
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.output.messages": json.dumps(ASKED),
            },
        ):
            pass
        with (
            tracer.start_as_current_span("invoke_agent finished"),
            tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat"}),
        ):
            pass
        provider.force_flush()
        crashed_run = format(crashed.get_span_context().trace_id, "032x")
        state = Path(sidecar.settings["state_path"])
        wait_until(lambda: crashed_run in journaled(state), 10, "the open run journaled")
        assert len(journaled(state)) == 1  # the run that ended is not kept

        sidecar.kill()  # kill -9: nothing drained, nothing flushed
        sidecar.start()

        wait_until(lambda: stalls(sidecar), 15, "a stall found after the restart")
        (stall,) = stalls(sidecar)
        assert stall["run_id"] == crashed_run
        assert "charge_card" in stall["message"]
        provider.shutdown()
    finally:
        sidecar.stop()
