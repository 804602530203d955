"""The open-runs memory benchmark (``bench/runs_memory.py``): its load, and a tiny smoke run.

The smoke run checks that the script runs end to end against real sidecars
and prints its table and verdict, not what the figures are: RSS depends on
the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import runs_memory  # noqa: E402 - needs the path above

NUMBER = r"[\d,]+(?:\.\d+)?"
SESSIONS = ("gen_ai.conversation.id", "session.id")


def _spans(payload: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(payload)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def _attrs(span: Span) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in span.attributes}


def _run(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANVISOR_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "bench/runs_memory.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_templates_hold_open_runs_with_llm_and_tool_spans() -> None:
    templates = runs_memory.make_templates(4, 5)

    assert len(templates) == 4
    for template in templates:
        spans = _spans(template.payload)
        assert len(spans) == template.spans
        assert len({s.trace_id for s in spans}) == template.runs == 5
        assert all(s.parent_span_id for s in spans)  # no root: every run stays open
    every = [_attrs(s) for t in templates for s in _spans(t.payload)]
    assert any("gen_ai.usage.input_tokens" in a or "llm.token_count.prompt" in a for a in every)
    assert any("gen_ai.tool.call.arguments" in a or "tool.name" in a for a in every)


def test_copies_get_fresh_traces_and_sessions_one_session_per_run() -> None:
    (template,) = runs_memory.make_templates(1, 6)

    first, second = (_spans(runs_memory.fresh_copy(template, i)) for i in (0, 1))

    for spans in (first, second):
        sessions: dict[bytes, set[str]] = {}
        for span in spans:
            for key in SESSIONS:
                if key in _attrs(span):
                    sessions.setdefault(span.trace_id, set()).add(_attrs(span)[key])
        assert all(len(names) == 1 for names in sessions.values())
        assert len({name for names in sessions.values() for name in names}) == len(sessions)
    assert not {s.trace_id for s in first} & {s.trace_id for s in second}
    assert not {s.span_id for s in first} & {s.span_id for s in second}
    names = [
        {_attrs(s).get(k) for s in spans for k in SESSIONS} - {None} for spans in (first, second)
    ]
    assert names[0] and not names[0] & names[1]
    assert runs_memory.RUN_MARK not in runs_memory.fresh_copy(template, 0)


def test_without_sessions_no_span_names_one() -> None:
    templates = runs_memory.make_templates(2, 5, sessions=False)

    for template in templates:
        for span in _spans(template.payload):
            assert not set(_attrs(span)) & set(runs_memory.SESSION_KEYS)


def test_llm_answers_and_tool_arguments_are_not_repeated_and_not_truncated() -> None:
    templates = runs_memory.make_templates(8, 10)

    for template in templates:
        seen: set[str] = set()
        for span in _spans(template.payload):
            attrs = _attrs(span)
            for key in ("gen_ai.tool.call.arguments", "llm.output_messages.0.message.content"):
                if key in attrs:
                    assert attrs[key] not in seen
                    seen.add(attrs[key])
            if "gen_ai.output.messages" in attrs:
                (message,) = json.loads(attrs["gen_ai.output.messages"])
                assert message["finish_reason"] not in runs_memory.UNTRUNCATED
            for kv in span.attributes:
                if kv.key == "gen_ai.response.finish_reasons":
                    reasons = {v.string_value for v in kv.value.array_value.values}
                    assert not reasons & set(runs_memory.UNTRUNCATED)


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        runs_memory.parse_args(["--phases", "2,1"])
    with pytest.raises(SystemExit):
        runs_memory.parse_args(["--env", "SPANVISOR_TRACKED_RUNS=5"])
    args = runs_memory.parse_args(["--tracked-runs", "50", "--phases", "1,2.5"])
    assert (args.tracked_runs, args.phase_list) == (50, [1.0, 2.5])


def test_help_explains_the_script() -> None:
    done = _run("--help", timeout=60)

    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--tracked-runs" in done.stdout


@pytest.mark.slow
def test_a_tiny_run_prints_the_table_and_a_verdict() -> None:
    done = _run(
        "--tracked-runs", "150", "--phases", "1,2", "--pool", "4", "--runs-per-request", "5",
        "--settle", "0.2", "--no-sessions",
    )  # fmt: skip

    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("python bench/runs_memory.py --tracked-runs 150")
    assert "tracking on :" in out and "tracking off:" in out
    row = rf"\s+150\s+{NUMBER}\s+150\s+0\s+{NUMBER}\s+{NUMBER}\s+[+-]{NUMBER}\s+-?{NUMBER}"
    assert re.search(row, out), out
    full = rf"\s+300\s+{NUMBER}\s+150\s+150\s+{NUMBER}\s+{NUMBER}\s+[+-]{NUMBER}\s+-?{NUMBER}"
    assert re.search(full, out), out
    assert re.search(r"last 2 phases spread [\d.]+% .*: (PASS|FAIL)", out), out
    assert '"runs":{"tracked":150,"evicted":150' in out
