"""The operator surface of run progress: ``GET /v1/runs`` and ``spanvisor runs``.

The routes run over a real :class:`~supervisor.api.control.Control` (an in-memory
store, a real governor) whose run tracker is a fake holding real
:class:`~supervisor.runs.RunView` objects; one test reads a real
:class:`~supervisor.runs.RunTracker` fed encoded spans. The fake tracker
refuses to be read off the event loop's thread, as the real one must not be
(the pipeline updates it there). The CLI is driven through ``main`` against
the app served by uvicorn on a real socket, as an operator's shell would
reach a sidecar.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.api.control import Control, RunsView
from supervisor.api.server import build_control_app
from supervisor.cli import operator_verbs
from supervisor.cli.output import format_duration, format_quantity, slo_lines
from supervisor.cli.verbs import main
from supervisor.normalize import read_spans
from supervisor.runs import RunTracker, RunView
from tests.test_remediations_api import _Served

TOKEN = "t0k3n"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG = "sess-checkout-0001-abcdef"
TRACE = "0af7651916cd43dd8448eb211c80319c"
COLUMNS = ["RUN", "SERVICE", "STATUS", "AGE", "IDLE", "SPANS", "LLM", "TOOLS", "ERR", "TOKENS"]
COLUMNS += ["RATE", "STEP"]


def _view(run_id: str, service: str, status: str, **fields: Any) -> RunView:
    values: dict[str, Any] = {
        "started_at": 1_000.0,
        "last_seen_at": 1_010.0,
        "idle_s": 0.0,
        "spans": 1,
        "llm_calls": 0,
        "tool_calls": 0,
        "errors": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "step": "",
        "spans_per_minute": 6.0,
        **fields,
    }
    return RunView(run_id=run_id, service=service, status=status, **values)


def _views() -> list[RunView]:
    """Four runs; ``last_seen_at`` orders them: the checkout run, then stalled, failing, ended."""
    return [
        _view(
            "r3",
            "checkout",
            "ended",
            started_at=100.0,
            last_seen_at=160.0,
            idle_s=90_000.0,
            spans=7,
            errors=0,
            step="",
        ),
        _view(
            LONG,
            "checkout",
            "running",
            started_at=5_000.0,
            last_seen_at=5_249.0,
            idle_s=3.4,
            spans=120,
            llm_calls=14,
            tool_calls=30,
            input_tokens=12_000,
            output_tokens=345,
            step="chat gpt-4o",
            spans_per_minute=28.63,
        ),
        _view(
            TRACE,
            "billing",
            "stalled",
            started_at=1_000.0,
            last_seen_at=8_000.0,
            idle_s=500.0,
            spans=40,
            llm_calls=5,
            tool_calls=12,
            input_tokens=900,
            output_tokens=50,
            step="execute_tool search_the_entire_knowledge_base_for_answers",
            spans_per_minute=0.34,
        ),
        _view(
            "r4",
            "checkout-eu",
            "failing",
            started_at=2_000.0,
            last_seen_at=3_000.0,
            idle_s=2_000.0,
            spans=9,
            errors=3,
            input_tokens=2_500_000,
            output_tokens=0,
            step="chat claude",
            spans_per_minute=250.0,
        ),
    ]


class FakeRuns:
    """``RunTracker``'s views over a list; refuses to be read off the event loop."""

    def __init__(self, views: list[RunView]) -> None:
        self.views = views
        self.asked: list[int] = []
        self.evicted = 2
        self.expired = 0

    def snapshot(
        self,
        limit: int = 100,
        now: float | None = None,
        *,
        before: tuple[float, str] | None = None,
        service: str | None = None,
        status: str | None = None,
    ) -> list[RunView]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise AssertionError("the run tracker was read off the event loop") from None
        self.asked.append(limit)
        found = sorted(self.views, key=lambda v: (v.last_seen_at, v.run_id), reverse=True)
        if before is not None:
            found = [v for v in found if (v.last_seen_at, v.run_id) < before]
        return [
            v
            for v in found
            if (service is None or v.service == service) and (status is None or v.status == status)
        ][:limit]

    def stats(self) -> dict[str, int]:
        return {"tracked": len(self.views), "evicted": self.evicted, "expired": self.expired}


def _control(runs: RunsView | None) -> Control:
    store = Store.open(":memory:")
    policy = load_policy(text="version: 1\npolicies: []\n")
    return Control(
        store=store,
        actor=Actor(store, {}),
        governor=Governor(policy),
        policy=lambda: policy,
        failures=RecentFailures(10),
        stats=lambda: {"pipeline": {"processed_spans": 7}},
        ready=lambda: True,
        reload=lambda: {"reloaded": False},
        runs=runs,
    )


def _app(runs: RunsView | None) -> FastAPI:
    return build_control_app(token=TOKEN, control=_control(runs))


@pytest.fixture
def runs() -> FakeRuns:
    return FakeRuns(_views())


@pytest.fixture
def client(runs: FakeRuns) -> TestClient:
    return TestClient(_app(runs))


def _ids(answer: dict[str, Any]) -> list[str]:
    return [r["run_id"] for r in answer["runs"]]


# -- the API ---------------------------------------------------------------------


def test_the_runs_route_needs_the_bearer_token(client: TestClient, runs: FakeRuns) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        answer = client.get("/v1/runs", headers=headers)
        assert (answer.status_code, answer.json()) == (
            401,
            {"error": "missing or wrong bearer token"},
        ), headers
    assert runs.asked == []
    described = client.get("/openapi.json").json()["paths"]["/v1/runs"]["get"]
    assert {p["name"] for p in described["parameters"]} == {"status", "service", "limit", "cursor"}


def test_runs_are_listed_most_recently_active_first(client: TestClient, runs: FakeRuns) -> None:
    answer = client.get("/v1/runs", headers=AUTH)

    assert answer.status_code == 200
    body = answer.json()
    assert body["tracking"] is True
    assert body["stats"] == {"tracked": 4, "evicted": 2, "expired": 0}
    assert _ids(body) == [TRACE, LONG, "r4", "r3"]
    assert body["runs"][1] == runs.views[1].to_json()
    assert body["runs"][1]["spans_per_minute"] == 28.63
    assert runs.asked == [101]  # one more than shown: whether there is a next page

    one = client.get("/v1/runs?limit=1", headers=AUTH).json()
    assert _ids(one) == [TRACE]
    assert runs.asked[-1] == 2


def test_runs_are_filtered_by_status_and_service_after_the_snapshot(
    client: TestClient, runs: FakeRuns
) -> None:
    def listed(query: str) -> list[str]:
        answer = client.get(f"/v1/runs?{query}", headers=AUTH)
        assert answer.status_code == 200, answer.json()
        return _ids(answer.json())

    assert listed("status=stalled") == [TRACE]
    assert listed("status=ENDED") == ["r3"]
    assert listed("service=checkout") == [LONG, "r3"]  # exact: not checkout-eu
    assert listed("service=checkout&status=running") == [LONG]
    assert listed("service=check") == []
    assert listed("service=checkout&limit=1") == [LONG]  # filtered, then cut to the limit
    assert runs.asked[-1] == 2  # the tracker filters as it walks: one more than shown
    assert listed("status=failing&limit=1000") == ["r4"]
    assert runs.asked[-1] == 1001


def test_bad_filters_and_limits_are_refused(client: TestClient, runs: FakeRuns) -> None:
    refused = client.get("/v1/runs?status=sleeping", headers=AUTH)
    assert (refused.status_code, refused.json()) == (
        400,
        {"error": "status must be one of running, failing, waiting, stalled, paused, ended"},
    )
    for bad in ("limit=0", "limit=1001", "limit=abc", "service=", "status=" + "x" * 40):
        answer = client.get(f"/v1/runs?{bad}", headers=AUTH)
        assert answer.status_code == 400, bad
        assert bad.split("=")[0] in answer.json()["error"], bad
    assert runs.asked == []  # refused before the tracker is read


def test_without_a_tracker_no_runs_are_tracked() -> None:
    client = TestClient(_app(None))

    listed = client.get("/v1/runs", headers=AUTH)
    assert (listed.status_code, listed.json()) == (
        200,
        {"runs": [], "tracking": False, "next_cursor": None},
    )
    filtered = client.get("/v1/runs?status=stalled&service=x", headers=AUTH)
    assert filtered.json() == {"runs": [], "tracking": False, "next_cursor": None}
    assert client.get("/v1/runs?status=sleeping", headers=AUTH).status_code == 400


def _value(value: str | int) -> AnyValue:
    return AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)


def _span(
    request: ExportTraceServiceRequest, name: str, span_id: int, parent: int, **attrs: str | int
) -> None:
    scope = request.resource_spans[0].scope_spans[0]
    span = scope.spans.add(
        trace_id=bytes.fromhex(TRACE),
        span_id=span_id.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"",
        name=name,
    )
    span.attributes.extend(
        KeyValue(key=k.replace("__", "."), value=_value(v)) for k, v in attrs.items()
    )


def test_a_real_tracker_is_listed_as_it_counts() -> None:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(KeyValue(key="service.name", value=_value("agent")))
    resource.scope_spans.add()
    llm = {
        "gen_ai__system": "openai",
        "gen_ai__request__model": "gpt-4o",
        "gen_ai__operation__name": "chat",
        "gen_ai__conversation__id": "conv-7",
    }
    _span(request, "chat gpt-4o", 2, 1, **llm, gen_ai__usage__input_tokens=1200)
    _span(request, "execute_tool search", 3, 1, gen_ai__operation__name="execute_tool",
          gen_ai__tool__name="search")  # fmt: skip
    _span(request, "chat gpt-4o", 4, 1, **llm, gen_ai__usage__output_tokens=34)
    tracker = RunTracker(clock=lambda: 1_030.0)
    for n, item in enumerate(read_spans(request.SerializeToString())):
        tracker.observe(item, 1_000.0 + 10 * n, [])
    client = TestClient(_app(tracker))

    body = client.get("/v1/runs", headers=AUTH).json()

    assert body["stats"] == {
        "tracked": 1,
        "evicted": 0,
        "expired": 0,
        "notices_dropped": 0,
        "budget_forecasts": 0,
        "service_budget_stops": 0,
        "service_budgets_tracked": 0,
    }
    [run] = body["runs"]
    assert run == {
        "run_id": "conv-7",
        "service": "agent",
        "status": "running",
        "started_at": 1_000.0,
        "last_seen_at": 1_020.0,
        "idle_s": 10.0,
        "spans": 3,
        "llm_calls": 2,
        "tool_calls": 1,
        "errors": 0,
        "input_tokens": 1200,
        "output_tokens": 34,
        "step": "chat gpt-4o",
        "spans_per_minute": 9.0,
        "cost_usd": None,  # a tracker without the model table prices nothing
        "cost_partial": False,
        "forecast": None,  # no budget
    }
    assert client.get("/v1/runs?status=ended", headers=AUTH).json()["runs"] == []
    assert _ids(client.get("/v1/runs?service=agent", headers=AUTH).json()) == ["conv-7"]


# -- the CLI, over a real socket ---------------------------------------------------


@pytest.fixture
def server(runs: FakeRuns) -> Iterator[_Served]:
    served = _Served(_app(runs))
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def served(server: _Served) -> list[str]:
    return server.remote


def _rows(out: str) -> tuple[list[str], list[list[str]], str]:
    """The table's header, its rows (cells two spaces apart) and the footer line."""
    lines = out.splitlines()
    cells = [[c.strip() for c in line.split("  ") if c.strip()] for line in lines[1:-1]]
    return lines[0].split(), cells, lines[-1]


def test_the_cli_shows_runs_as_a_table(
    served: list[str], runs: FakeRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", *served]) == 0
    header, rows, footer = _rows(capsys.readouterr().out)

    assert header == COLUMNS
    assert rows == [
        [TRACE[:12] + "…", "billing", "stalled", "2h05m", "8m20s", "40", "5", "12", "0",
         "950", "0.3", runs.views[2].step[:29] + "…"],
        ["sess-checkou…", "checkout", "running", "4m12s", "3s", "120", "14", "30", "0",
         "12.3k", "28.6", "chat gpt-4o"],
        ["r4", "checkout-eu", "failing", "50m00s", "33m20s", "9", "0", "0", "3", "2.5M",
         "250", "chat claude"],
        ["r3", "checkout", "ended", "1d01h", "1d01h", "7", "0", "0", "0", "0", "6.0", "-"],
    ]  # fmt: skip
    assert len(rows[0][-1]) == 30
    assert footer == "4 runs of 4 tracked; 2 evicted"


def test_the_cli_table_right_aligns_the_numbers(
    served: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", *served]) == 0
    lines = capsys.readouterr().out.splitlines()

    end = lines[0].index("SPANS") + len("SPANS")
    for line, spans in zip(lines[1:], ["40", "120", "9", "7"], strict=False):
        assert line[end - len(spans) - 1 : end + 1] == f" {spans} ", line


def test_the_cli_filters_and_says_when_nothing_matches(
    served: list[str], runs: FakeRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", "--status", "RUNNING", "--service", "checkout", *served]) == 0
    _, rows, footer = _rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["sess-checkou…"]
    assert footer == "1 run of 4 tracked; 2 evicted"

    assert main(["runs", "--limit", "2", *served]) == 0
    assert [r[0] for r in _rows(capsys.readouterr().out)[1]] == [TRACE[:12] + "…", "sess-checkou…"]

    assert main(["runs", "--status", "stalled", "--service", "nope", *served]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "no runs with status stalled and service nope",
        "0 runs of 4 tracked; 2 evicted",
    ]

    assert main(["runs", "--limit", "0", *served]) == 2
    assert "400" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["runs", "--status", "sleeping", *served])
    assert refused.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_the_cli_prints_json_for_scripts(
    served: list[str], runs: FakeRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", "--json", *served]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["tracking"] is True and answer["stats"]["tracked"] == 4
    assert _ids(answer) == [TRACE, LONG, "r4", "r3"]  # whole ids

    assert main(["runs", "--output", "jsonl", "--status", "failing", *served]) == 0
    [only] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert only == runs.views[3].to_json()


def test_the_cli_escapes_control_characters_from_spans(
    served: list[str], runs: FakeRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    runs.views[:] = [
        _view(
            "\x1b]0;pwned\x07",
            "svc\x1b[31m",
            "running",
            step="chat\nrm -rf / \x1b[2J",
            last_seen_at=9_999.0,
        )
    ]

    assert main(["runs", *served]) == 0
    out = capsys.readouterr().out

    assert "\x1b" not in out and "\x07" not in out
    row = out.splitlines()[1]
    assert row.startswith("\\x1b]0;pwned… ")  # escaped, then shortened to 12 + …
    assert "svc\\x1b[31m" in row and "chat\\nrm -rf / \\x1b[2J" in row
    assert len(out.splitlines()) == 3  # a newline in a step cannot add a line

    assert main(["runs", "--service", "svc\x1b[31m", "--status", "ended", *served]) == 0
    assert capsys.readouterr().out.startswith("no runs with status ended and service svc\\x1b[31m")


def test_the_cli_watches_in_a_pipe_with_successive_tables(
    served: list[str],
    runs: FakeRuns,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        runs.views.pop(0)  # the ended run expires between the two tables

    monkeypatch.setattr(operator_verbs, "_pause", pause)

    assert main(["runs", "--watch", "--iterations", "2", *served]) == 0
    out = capsys.readouterr().out

    assert pauses == [2.0]  # the default interval, and none after the last table
    assert "\x1b" not in out  # not a terminal: nothing is cleared
    first, second = out.split("\n\n")
    for table, shown in ((first, 4), (second, 3)):
        lines = table.splitlines()
        assert lines[0].startswith("runs at ") and lines[0].endswith(", every 2s (Ctrl-C to stop)")
        assert lines[1].split() == COLUMNS
        assert len(lines) == 2 + shown + 1
        assert lines[-1] == f"{shown} runs of {shown} tracked; 2 evicted"
    assert "r3" in first and "r3" not in second

    assert main(["runs", "--watch", "0.5", "--iterations", "3", "--json", *served]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(a["runs"]) for a in answers] == [3, 2, 1]
    assert pauses[1:] == [0.5, 0.5]


def test_the_cli_watches_on_a_terminal_by_redrawing(
    served: list[str],
    runs: FakeRuns,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(operator_verbs, "_pause", lambda seconds: None)

    assert main(["runs", "--watch", "5", "--iterations", "2", *served]) == 0
    out = capsys.readouterr().out

    frames = [frame.splitlines() for frame in out.split(operator_verbs.CLEAR_SCREEN)]
    assert frames[0] == [] and len(frames) == 3  # each table starts on a cleared screen
    assert frames[1][1:] == frames[2][1:] and len(frames[1]) == 2 + 4 + 1
    assert frames[1][0].endswith("every 5s (Ctrl-C to stop)")
    assert frames[1][1].split() == COLUMNS

    # A table taller than the terminal is cut to fit, and says how much is left out.
    runs.views.extend(_view(f"extra-{n}", "agent", "running") for n in range(20))
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: os.terminal_size((120, 10)))
    assert main(["runs", "--watch", "--iterations", "1", *served]) == 0
    lines = capsys.readouterr().out.removeprefix(operator_verbs.CLEAR_SCREEN).splitlines()
    assert len(lines) == 9  # title, header, 5 runs, what is left out, footer (and the cursor)
    assert lines[-2] == "… and 19 more: narrow with --status, --service or --limit"
    assert lines[-1] == "24 runs of 24 tracked; 2 evicted"


def test_a_watch_outlives_a_restarting_sidecar_and_ends_on_ctrl_c(
    server: _Served,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 1:
            server.stop()  # the sidecar goes away after the first table
        if len(pauses) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(operator_verbs, "_pause", pause)

    assert main(["runs", "--watch", "1", *server.remote]) == 0
    frames = capsys.readouterr().out.split("\n\n")

    assert len(frames) == 3
    assert frames[0].splitlines()[1].split() == COLUMNS
    for frame in frames[1:]:
        problem = frame.splitlines()[1]
        assert problem.startswith("spanvisor: cannot reach the control API")
        assert problem.endswith("; trying again every 1s")

    # Unreachable from the start (a wrong address or token): an error, not a watch.
    closed = ["--api", "http://127.0.0.1:9", "--token", "x"]
    assert main(["runs", "--watch", "--iterations", "3", *closed]) == 2
    captured = capsys.readouterr()
    assert "cannot reach the control API" in captured.err and captured.out == ""
    assert len(pauses) == 3


def test_the_cli_says_when_runs_are_not_tracked(capsys: pytest.CaptureFixture[str]) -> None:
    served = _Served(_app(None))
    try:
        assert main(["runs", *served.remote]) == 0
        assert capsys.readouterr().out == "this sidecar does not track runs\n"
    finally:
        served.stop()


def test_the_cli_refuses_bad_intervals(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--watch", "0"], ["--watch", "abc"], ["--watch", "nan"], ["--iterations", "0"]):
        with pytest.raises(SystemExit) as refused:
            main(["runs", *bad])
        assert refused.value.code == 2, bad
        assert "runs: error: argument" in capsys.readouterr().err, bad


def test_durations_and_counts_read_at_a_glance() -> None:
    durations = {
        0: "0s",
        0.9: "0s",
        3: "3s",
        59.99: "59s",
        60: "1m00s",
        252: "4m12s",
        3_599: "59m59s",
        3_600: "1h00m",
        7_500: "2h05m",
        86_399: "23h59m",
        86_400: "1d00h",
        90_000: "1d01h",
        -5: "0s",
        None: "-",
        "3": "-",
        True: "-",
        float("nan"): "-",
    }
    assert {k: format_duration(k) for k in durations} == durations
    counts = {0: "0", 950: "950", 999: "999", 1_000: "1.0k", 12_345: "12.3k"}
    counts |= {999_949: "999.9k", 999_950: "1.0M", 2_500_000: "2.5M", 3_000_000_000: "3.0G"}
    assert {n: format_quantity(n) for n in counts} == counts


def test_the_cli_help_explains_the_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["runs", "--help"])
    assert stopped.value.code == 0
    text = capsys.readouterr().out
    for needed in ("--watch", "SECONDS", "--status", "--service", "--limit", "--json", "stalled"):
        assert needed in text, needed
    assert "spanvisor runs --watch" in text and "Ctrl-C" in text
    assert "--iterations" not in text  # for the tests only
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "runs" in capsys.readouterr().out


def test_slo_lines_show_each_service_against_its_target() -> None:
    lines = slo_lines(
        {
            "agent": {
                "runs": {"short": 3, "long": 40},
                "success_rate": {"short": 0.5, "long": 0.875},
                "success_target": 0.95,
                "burn_rate": {"short": 10.0, "long": 2.5},
                "fast_burn": False,
                "duration_s": {"p50": 20.0, "p95": 95.0},
                "mean_cost_usd": 0.0123,
            },
            "batch\x1b[2J": {"runs": {"long": 5}, "success_rate": {}, "fast_burn": True},
        }
    )
    assert lines[0].split() == [
        "SERVICE", "RUNS", "SUCCESS", "TARGET", "BURN", "5m/1h", "P95", "COST/RUN",
    ]  # fmt: skip
    assert "87.5%" in lines[1] and "10.0/2.5" in lines[1] and "$0.0123" in lines[1]
    assert "BURNING" in lines[2] and "\x1b" not in lines[2]
