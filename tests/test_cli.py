"""The CLI verbs users test policies with: replay, explain, validate, schema."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from supervisor.cli.verbs import main
from supervisor.testing.fake_provider import FakeProvider, Reply
from tests.otlp_files import length_prefixed, to_otlp_json


@pytest.fixture(scope="module")
def recorded() -> Iterator[list[ExportTraceServiceRequest]]:
    """Requests as a real instrumented agent exports them: one per LLM call."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "replayed-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    requests: list[ExportTraceServiceRequest] = []
    try:
        with FakeProvider(default=Reply.text("ok")) as fake:
            fake.script(
                Reply.rate_limited(retry_after_s=1.5),
                Reply.quota_exhausted(),
                Reply.text("fine"),
                Reply.unauthorized(),
            )
            client = openai.OpenAI(base_url=fake.base_url, api_key="sk-test", max_retries=0)
            for _ in range(4):
                exporter.clear()
                with contextlib.suppress(openai.OpenAIError):
                    client.chat.completions.create(
                        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
                    )
                requests.append(encode_spans(exporter.get_finished_spans()))
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    yield requests


@pytest.fixture
def json_file(tmp_path: Path, recorded: list[ExportTraceServiceRequest]) -> Path:
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(to_otlp_json(r) for r in recorded) + "\n")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_jsonl_reports_each_failure_with_the_contract_fields(
    capsys: pytest.CaptureFixture[str], json_file: Path
) -> None:
    code, out, err = run_cli(capsys, "replay", str(json_file), "--output", "jsonl")

    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["class"], r["kind"], r["action"]) for r in rows] == [
        ("transient", "rate_limit", "retry"),
        ("permanent", "quota_exhausted", rows[1]["action"]),
        ("permanent", "auth", "fail_fast"),
    ]
    for row in rows:
        assert row["service"] == "replayed-agent"
        assert row["dependency"] == "openai:gpt-4o-mini"
        assert len(row["trace_id"]) == 32 and row["trace_id"] == row["trace_id"].lower()
        assert len(row["span_id"]) == 16
        assert row["rule"] and row["span_name"]
    assert rows[1]["action"] in {"fallback", "escalate"}


def test_replay_is_the_same_every_time_and_for_protobuf_input(
    capsys: pytest.CaptureFixture[str],
    json_file: Path,
    tmp_path: Path,
    recorded: list[ExportTraceServiceRequest],
) -> None:
    proto_file = tmp_path / "traces.pb"
    proto_file.write_bytes(length_prefixed(recorded))

    first = run_cli(capsys, "replay", str(json_file), "--output", "jsonl")
    second = run_cli(capsys, "replay", str(json_file), "--output", "jsonl")
    from_proto = run_cli(capsys, "replay", str(proto_file), "--output", "jsonl")

    assert first == second == from_proto
    assert first[1].count("\n") == 3


def test_replay_table_has_a_header_and_a_row_per_failure(
    capsys: pytest.CaptureFixture[str], json_file: Path
) -> None:
    code, out, _ = run_cli(capsys, "replay", str(json_file))

    lines = out.splitlines()
    assert code == 0
    assert lines[0].split()[:3] == ["TRACE_ID", "SPAN_ID", "SERVICE"]
    assert len(lines) == 4
    assert "rate_limit" in lines[1]


def test_replay_skips_a_bad_line_says_where_and_exits_1(
    capsys: pytest.CaptureFixture[str], json_file: Path, tmp_path: Path
) -> None:
    lines = json_file.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")

    code, out, err = run_cli(capsys, "replay", str(broken), "--output", "jsonl")

    assert code == 1
    assert "line 2" in err
    assert out.count("\n") == 3  # every good line still judged


def test_replay_of_a_truncated_protobuf_file_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, recorded: list[ExportTraceServiceRequest]
) -> None:
    data = length_prefixed(recorded)
    cut = tmp_path / "cut.pb"
    cut.write_bytes(data[:-5])

    code, out, err = run_cli(capsys, "replay", str(cut), "--output", "jsonl")

    assert code == 1
    assert "truncated" in err
    assert out.count("\n") == 2  # the fourth request (the 401) was cut off


def test_explain_names_the_rule_and_the_decision(
    capsys: pytest.CaptureFixture[str], json_file: Path
) -> None:
    replayed = run_cli(capsys, "replay", str(json_file), "--output", "jsonl")[1]
    first = json.loads(replayed.splitlines()[0])

    code, out, _ = run_cli(capsys, "explain", str(json_file), "--span", first["span_id"])

    assert code == 0
    assert f"failure at span {first['span_id']}" in out
    assert f"transient/rate_limit on openai:gpt-4o-mini by rule {first['rule']}" in out
    assert "decision     retry" in out


def test_explain_without_a_file_lists_the_rules_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "explain")

    assert code == 0
    rules, _, policies = out.partition("decision policies, first match wins:\n")
    assert "classification rules, first match wins:" in rules and "  1. " in rules
    assert policies, out  # the decision policies are listed too, with their actions
    entries = policies.splitlines()
    assert entries[0].lstrip().startswith("1. ") and " -> " in entries[0]
    assert all(" -> " in line for line in entries)


def test_validate_accepts_a_good_policy_and_lists_every_error_of_a_bad_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = Path(__file__).resolve().parent.parent / "config" / "policy.yaml"
    assert run_cli(capsys, "validate", str(good))[0] == 0

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nrules:\n  - name: r\n    match: {message: '(unclosed'}\n"
        "    class: transient\n    kind: timeout\n    surprise: 1\n"
    )
    code, _, err = run_cli(capsys, "validate", str(bad))

    assert code == 1
    assert f"{bad}:" in err
    assert "surprise" in err
    assert "(unclosed" in err or "regex" in err.lower() or "regular expression" in err.lower()


def test_schema_is_json_schema_for_the_policy_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "schema")

    schema = json.loads(out)
    assert code == 0
    assert schema["type"] == "object"
    assert "rules" in schema["properties"]


def test_replay_of_a_missing_file_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, "replay", str(tmp_path / "nope.jsonl"))

    assert code == 2
    assert "no such file" in err and "nope.jsonl" in err
    assert out == ""  # checked before the table's header is printed
    code, out, err = run_cli(capsys, "explain", str(tmp_path))
    assert (code, out) == (2, "")
    assert "is a directory" in err


def test_a_long_replay_says_how_far_it_got_on_stderr(
    capsys: pytest.CaptureFixture[str], json_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.cli import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line after every request
    code, out, err = run_cli(capsys, "replay", str(json_file), "--output", "jsonl")

    assert code == 0
    assert len(out.splitlines()) == 3  # stdout is the failures only
    lines = err.splitlines()
    assert len(lines) >= 4, err
    assert all(line.startswith(f"spanvisor: replay {json_file}: ") for line in lines)
    assert "3 failures" in lines[-1] and "spans/s" in lines[-1]


def test_a_replay_that_ends_quickly_prints_no_progress(
    capsys: pytest.CaptureFixture[str], json_file: Path
) -> None:
    code, _, err = run_cli(capsys, "replay", str(json_file))

    assert (code, err) == (0, "")


def test_explain_tells_a_span_that_did_not_fail_from_one_that_is_not_there(
    capsys: pytest.CaptureFixture[str], json_file: Path, recorded: list[ExportTraceServiceRequest]
) -> None:
    # The third call answered "fine": its span is in the file and did not fail.
    [ok] = [s for rs in recorded[2].resource_spans for ss in rs.scope_spans for s in ss.spans]
    code, out, err = run_cli(capsys, "explain", str(json_file), "--span", ok.span_id.hex())
    assert code == 0, err
    assert out.strip() == (
        f"span {ok.span_id.hex()} ('{ok.name}', service 'replayed-agent') did not fail:"
        " no verdict to explain"
    )

    code, out, err = run_cli(capsys, "explain", str(json_file), "--span", "00000000000000ff")
    assert (code, out) == (1, "")
    assert f"no span 00000000000000ff in {json_file}" in err

    code, _, err = run_cli(capsys, "explain", str(json_file), "--span", "xyz")
    assert code == 2 and "16 hex digits" in err


def test_progress_on_a_terminal_redraws_one_line_and_ends_it() -> None:
    import io

    from supervisor.cli.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    now = [0.0]
    screen = Terminal()
    progress = Progress("replay x", stream=screen, clock=lambda: now[0])
    progress.add(spans=10)  # before the first half second: nothing
    assert screen.getvalue() == ""
    now[0] = 0.6
    progress.add(spans=20, failures=1)
    now[0] = 1.2
    progress.add(spans=30)
    progress.done()

    lines = screen.getvalue().split("\r")
    assert lines[0] == "spanvisor: replay x: 30 spans, 1 failures, 0.6 s (50 spans/s)"
    assert lines[-1] == "spanvisor: replay x: 60 spans, 1 failures, 1.2 s (50 spans/s)\n"
