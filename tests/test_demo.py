"""``spanvisor demo`` tells its story on its own; its view never lets span text drive a terminal.

The slow test runs ``python -m supervisor.cli demo --no-live`` as a user would
(a sidecar in that process, two LangGraph agent processes, the fake provider
with its faults, the approval with the CLI) and reads the story from what it
prints: each fault classified as its kind, the decisions and the commands they
became, the breaker opening and closing, the remediations and their outcomes,
the crashed agent resumed with no side effect twice, the summary and the hint
for trace viewers. The fast tests feed the view span text full of terminal
control sequences and check that none of them reaches the output.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from supervisor.cli.demo import DEADLINE_S
from supervisor.cli.demo_summary import viewer_hint
from supervisor.cli.demo_view import (
    Event,
    Facts,
    LineView,
    LiveView,
    Screen,
    Seen,
    Watcher,
    clean,
    format_event,
    summary,
)
from supervisor.testing.otlp_recorder import OtlpRecorder, RecordedRequest

#: Sequences a hostile span could carry: clear the screen, retitle the window, a
#: hyperlink, a bell, a carriage return that overwrites the line, bidi overrides.
HOSTILE = (
    "\x1b[2J\x1b[H\x1b]0;pwned\x07"
    "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"
    "\rok\u202egnp.exe\u2028next\x9b31m\x00"
)


def visible(text: str) -> bool:
    """No control, format or line-separator character in ``text`` (a newline aside)."""
    return all(
        char == "\n" or unicodedata.category(char) not in ("Cc", "Cf", "Zl", "Zp", "Co", "Cn")
        for char in text
    )


# -- the whole demo (slow) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    """A span the trace viewer got, with its service."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]


def exported(requests: list[RecordedRequest]) -> list[Exported]:
    found = []
    for request in requests:
        for resource_spans in request.request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append(
                        Exported(
                            resource.get("service.name", ""),
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            {a.key: a.value.string_value for a in span.attributes},
                            [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        )
                    )
    return found


@dataclass
class DemoRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    leftovers: list[str]
    #: What a trace viewer at OTEL_EXPORTER_OTLP_ENDPOINT received.
    viewer: list[Exported]

    @property
    def flat(self) -> str:
        """The output with all whitespace runs as one space (the summary wraps its lines)."""
        return " ".join(self.stdout.split())

    def lines(self, kind: str, run: str = "") -> list[str]:
        """The event lines of ``kind`` (and ``run``), their text only."""
        pattern = re.compile(
            rf"^\[\s*[\d.]+s\] {re.escape(kind)}\s+{re.escape(run)}\s+(.*)$"
            if run
            else rf"^\[\s*[\d.]+s\] {re.escape(kind)}\s+(.*)$"
        )
        return [m.group(1) for line in self.stdout.splitlines() if (m := pattern.match(line))]

    def explain(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n{self.stdout}\n{self.stderr}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    tmp = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPANVISOR_"))}
    env["TMPDIR"] = str(tmp)  # the demo's state directory goes here, and must be gone after
    with OtlpRecorder() as viewer:
        # As the demo's hint says: a trace viewer's OTLP/HTTP endpoint in the environment.
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{viewer.http_port}"
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "demo", "--no-live"],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S + 60,
            check=False,
            env=env,
        )
        seconds = time.monotonic() - started
        received = exported(viewer.requests)
    return DemoRun(
        result.returncode,
        result.stdout,
        result.stderr,
        seconds,
        sorted(p.name for p in tmp.iterdir()),
        received,
    )


@pytest.mark.slow
def test_the_demo_completes_its_story_within_the_deadline_and_cleans_up(demo: DemoRun) -> None:
    assert demo.returncode == 0, demo.explain()
    assert demo.seconds < DEADLINE_S, demo.explain()
    assert "spanvisor demo: the story completed in" in demo.stdout, demo.explain()
    assert demo.leftovers == [], f"state left behind: {demo.leftovers}\n{demo.explain()}"
    # Line mode: one line per event, no screen control at all; nothing on stderr but warnings.
    assert "\x1b" not in demo.stdout
    assert "Traceback" not in demo.stderr, demo.explain()


@pytest.mark.slow
def test_each_fault_is_classified_as_its_kind_at_its_dependency(demo: DemoRun) -> None:
    expected = [
        ("ops-1", "transient/rate_limit on openai:gpt-4o", "builtin.openai.rate_limit"),
        ("ops-1", "transient/unavailable on openai:gpt-4o", "builtin.http.unavailable"),
        ("ops-2", "transient/unavailable on openai:gpt-4o", "builtin.http.unavailable"),
        ("ops-3", "transient/unavailable on openai:gpt-4o", "builtin.http.unavailable"),
        ("ops-3", "model/reasoning_loop on tool:send_email", "builtin.detect.reasoning_loop"),
        ("billing-1", "transient/stall on", "builtin.detect.stall"),
        (
            "billing-1",
            "semantic/approval_required on tool:issue_refund",
            "builtin.langgraph.interrupt",
        ),
        ("billing-2", "permanent/auth on openai:gpt-4.1-mini", "builtin.provider.auth"),
    ]
    for run, what, rule in expected:
        found = [line for line in demo.lines("failure", run) if what in line]
        assert found, f"no '{what}' failure in {run}\n{demo.explain()}"
        assert all(f"rule {rule}:" in line for line in found), found
    # The rate limit's message, without the exception's module path; the stall's list.
    [limited] = [line for line in demo.lines("failure", "ops-1") if "rate_limit" in line]
    assert "OpenAIRateLimitError: Error code: 429" in limited
    [stall] = [line for line in demo.lines("failure", "billing-1") if "stall" in line]
    assert 'unverified work: send_email({"to": "oncall@example.com"' in stall
    assert len([x for x in demo.lines("failure", "ops-3") if "reasoning_loop" in x]) == 2


@pytest.mark.slow
def test_the_decisions_and_the_commands_that_carry_them(demo: DemoRun) -> None:
    def has(kind: str, run: str, text: str) -> bool:
        return any(text in line for line in demo.lines(kind, run))

    for kind, run, text in [
        ("decision", "ops-1", "retry in 1.5s (attempt 1 of 5 failed)  (policy builtin.rate_limit)"),
        ("command", "ops-1", "retry_step delivered (pull) (the server asked for 1.5s)"),
        ("decision", "ops-1", "(policy demo.primary_unavailable)"),
        ("decision", "ops-2", "revised: breaker of openai:gpt-4o is open: fallback"),
        ("command", "ops-2", "switch_fallback delivered (pull) to openai:gpt-4o-mini"),
        ("command", "ops-3", "switch_fallback delivered (pull) to openai:gpt-4o-mini"),
        ("decision", "ops-3", "remediate with loop_breaker"),
        ("command", "ops-3", "inject_guidance delivered (pull): You have called send_email"),
        ("command", "ops-3", "rewind_run delivered (pull) to before the loop on send_email"),
        ("decision", "billing-1", "remediate with resume_run  (policy builtin.stall)"),
        ("command", "billing-1", "resume_run delivered (pull) (unverified: send_email("),
        ("decision", "billing-1", "escalate: pause the run and ask a person"),
        ("command", "billing-1", "pause_run delivered"),
        ("command", "billing-1", "approval_result delivered (pull): approved by demo-operator"),
        ("decision", "billing-2", "fail fast: abort the run  (policy builtin.fail_fast)"),
        ("command", "billing-2", "abort_run delivered"),
    ]:
        assert has(kind, run, text), f"no {kind} '{text}' for {run}\n{demo.explain()}"
    # The provider saw the switch: ops-2 and ops-3 asked for the fallback model.
    for run in ("ops-2", "ops-3"):
        assert has("provider", run, "now asked for gpt-4o-mini (was gpt-4o)"), demo.explain()


@pytest.mark.slow
def test_the_breaker_opens_in_the_outage_and_closes_once_the_model_is_back(
    demo: DemoRun,
) -> None:
    breaker = demo.lines("breaker")
    assert any(line.startswith("openai:gpt-4o closed -> open") for line in breaker), breaker
    assert breaker[-1].startswith("openai:gpt-4o half_open -> closed"), breaker
    [down] = [line for line in demo.lines("provider") if "is down" in line]
    assert down == "gpt-4o is down: every request gets a 503", down
    [back] = [line for line in demo.lines("provider") if "is back after" in line]
    assert re.search(r"gpt-4o is back after [\d.]+s; 4 request\(s\) failed meanwhile", back), back


@pytest.mark.slow
def test_the_remediations_succeed_and_the_operator_approves_with_the_cli(demo: DemoRun) -> None:
    ended = [line for line in demo.lines("remediation") if " started " not in line]
    assert len([x for x in demo.lines("remediation", "ops-3") if " started " not in x]) == 2
    assert len([x for x in ended if "loop_breaker succeeded: the run recovered" in x]) == 2, ended
    assert len([x for x in ended if "resume_run succeeded: the run recovered" in x]) == 1, ended
    assert len(ended) == 3, ended
    [command] = [line for line in demo.lines("operator", "billing-1") if line.startswith("$ ")]
    assert re.match(
        r"\$ spanvisor approvals approve apr_[0-9a-f]+ --api http://127\.0\.0\.1:\d+"
        r" --by demo-operator --note 'refund checked against the order'",
        command,
    ), command
    approval_id = command.split()[4]
    assert any(
        line == f"{approval_id}: approved by demo-operator" for line in demo.lines("operator")
    ), demo.explain()


@pytest.mark.slow
def test_the_crashed_agent_is_resumed_and_no_side_effect_happens_twice(demo: DemoRun) -> None:
    agent = "\n".join(demo.lines("agent"))
    assert "fault injection: killed (SIGKILL) right after side effect #2" in agent
    assert "was killed by SIGKILL mid-step; starting it again with --resume" in agent
    assert "billing-agent (resumed) started" in agent
    [ledger] = demo.lines("ledger", "billing-1")
    assert "billing-1/step-1/send_email: unverified after a restart" in ledger
    assert "the ledger says it was done: not repeated" in ledger
    effects = re.search(r"side effects (\d+) executed, (\d+) duplicated", demo.flat)
    assert effects is not None, demo.explain()
    assert int(effects.group(1)) > 0
    assert effects.group(2) == "0"


@pytest.mark.slow
def test_the_summary_says_what_failed_what_was_done_and_what_recovered(demo: DemoRun) -> None:
    flat = demo.flat
    for text in [
        "ops-1 completed gpt-4o rate_limit -> retry_step; unavailable -> retry_step (x2)",
        "ops-2 completed gpt-4o -> gpt-4o-mini unavailable -> retry_step (x2);"
        " unavailable -> switch_fallback",
        "ops-3 completed gpt-4o -> gpt-4o-mini unavailable -> switch_fallback;"
        " reasoning_loop -> inject_guidance; reasoning_loop -> rewind_run",
        "ops-4 completed gpt-4o no failure",
        "billing-1 completed gpt-4.1-mini killed (SIGKILL) after its e-mail of step 1,"
        " restarted with --resume; stall -> resume_run;"
        " approval_required -> pause_run, approval_result",
        "billing-2 aborted gpt-4.1-mini auth -> abort_run",
        "remediations 3: loop_breaker succeeded 2, resume_run succeeded 1",
        "approvals 1 asked: approved by demo-operator 1",
        "0 not delivered",
        "breakers openai:gpt-4o opened",
        "calls reached it and failed (ops-2 3, ops-3 1)",
    ]:
        assert text in flat, f"summary without '{text}'\n{demo.explain()}"
    failures = re.search(r"failures (\d+) classified: ([^\n]*?) decisions", flat)
    assert failures is not None, demo.explain()
    for kind in ("rate_limit", "unavailable", "reasoning_loop", "stall", "auth"):
        assert f"/{kind} " in failures.group(2)
    decisions = re.search(r"decisions ([^\n]*?) remediations", flat)
    assert decisions is not None, demo.explain()
    for count in ("retry 5", "remediate 3", "fallback 2", "escalate 1", "fail_fast 1"):
        assert count in decisions.group(1), decisions.group(1)


def test_the_viewer_hint_runs_jaeger_with_docker_or_without() -> None:
    hint = "\n".join(viewer_hint(("ops-agent",), None))
    assert "docker run --rm -p 16686:16686 -p 4318:4318 jaegertracing/all-in-one" in hint
    assert "without Docker: ./jaeger, from github.com/jaegertracing/jaeger/releases" in hint


@pytest.mark.slow
def test_the_demo_says_how_to_see_the_same_in_a_trace_viewer(demo: DemoRun) -> None:
    out = demo.stdout
    assert "see the same in a trace viewer" in out
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo" in out
    assert "jaegertracing/all-in-one" in out
    assert "PHOENIX_GRPC_PORT=14317 phoenix serve" in out
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:6006 spanvisor demo" in out
    assert "This time every span went to http://127.0.0.1:" in demo.flat


@pytest.mark.slow
def test_the_viewer_gets_the_agents_spans_with_each_decision_under_its_failing_span(
    demo: DemoRun,
) -> None:
    agents = {(s.trace_id, s.span_id): s for s in demo.viewer if s.service != "spanvisor"}
    assert {s.service for s in agents.values()} == {"ops-agent", "billing-agent"}
    decisions = [s for s in demo.viewer if s.name == "spanvisor.decide"]
    failures = re.search(r"failures (\d+) classified", demo.flat)
    assert failures is not None
    assert len(decisions) == int(failures.group(1)), [d.attributes for d in decisions]
    for decision in decisions:
        # A child of the failing span, in the agent's trace, which the viewer has too.
        parent = agents.get((decision.trace_id, decision.parent_span_id))
        assert parent is not None, decision
        assert decision.attributes["spanvisor.failure.kind"], decision.attributes
    kinds = {d.attributes["spanvisor.failure.kind"] for d in decisions}
    assert {"rate_limit", "unavailable", "reasoning_loop", "stall", "auth"} <= kinds
    roots = [s for s in demo.viewer if s.name.startswith("spanvisor.remediate ")]
    assert sorted(s.name for s in roots) == [
        "spanvisor.remediate loop_breaker",
        "spanvisor.remediate loop_breaker",
        "spanvisor.remediate resume_run",
    ]
    for root in roots:
        # A trace of its own, linked to the span that caused it.
        assert root.parent_span_id == "" and len(root.links) == 1, root
        assert root.links[0] in agents, root


# -- the view and hostile span text (fast) --------------------------------------------------------


def test_clean_shows_control_characters_as_escapes_and_bounds_the_length() -> None:
    shown = clean(HOSTILE, 1000)
    assert visible(shown)
    for escape in ("\\x1b[2J", "\\x07", "\\x0d", "\\u202e", "\\u2028", "\\x9b", "\\x00"):
        assert escape in shown
    assert clean("é ok\u00a0too") == "é ok too"  # printable text stays; odd spaces are spaces
    long = clean("x" * 500, 40)
    assert (len(long), long[-3:]) == (40, "...")


def test_line_mode_prints_hostile_span_text_as_one_visible_line() -> None:
    out = io.StringIO()
    view = LineView(out)
    view.event(Event(1.5, "failure", HOSTILE[:20], f"transient/unavailable: {HOSTILE}"))
    printed = out.getvalue()
    assert printed.count("\n") == 1 and printed.endswith("\n")
    assert visible(printed), repr(printed)
    assert "\x1b" not in printed and "\r" not in printed
    assert printed.startswith("[   1.5s] failure ")


def _api(routes: dict[str, dict[str, Any]]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=routes.get(request.url.path, {}))

    return httpx.Client(base_url="http://sidecar.test", transport=httpx.MockTransport(handle))


def test_span_text_from_the_api_reaches_neither_the_lines_nor_the_live_screen() -> None:
    failure = {
        "trace_id": "ab" * 16,
        "span_id": "cd" * 8,
        "run_id": f"run-{HOSTILE}",
        "class": "transient",
        "kind": "unavailable",
        "dependency": f"openai:{HOSTILE}",
        "rule": "builtin.http.unavailable",
        "action": "retry",
        "policy": "builtin.transient_io",
        "params": {"delay_s": 0.5, "attempt": 1, "max_attempts": 4},
        "reason": f"transient/unavailable; revised: {HOSTILE}",
        "message": f"openai.InternalServerError: Error code: 503 - {HOSTILE}",
        "received_ns": 1,
    }
    run = {"run_id": f"run-{HOSTILE}", "service": HOSTILE, "status": "failing", "step": HOSTILE}
    command = {
        "id": "cmd_1",
        "type": "switch_fallback",
        "run_id": HOSTILE,
        "status": "delivered",
        "channel": "pull",
        "created_at": "2026-01-01T00:00:00.000Z",
        "params": {"to": HOSTILE},
        "trigger": {"trace_id": "ab" * 16, "span_id": "cd" * 8},
    }
    client = _api(
        {
            "/v1/failures": {"failures": [failure]},
            "/v1/runs": {"runs": [run]},
            "/v1/commands/log": {"commands": [command]},
            "/v1/breakers": {"breakers": [{"dependency": HOSTILE, "state": "open"}]},
            "/v1/approvals": {"approvals": []},
            "/v1/remediations": {"remediations": []},
        }
    )
    events = Watcher(client, lambda: 2.0).poll()
    assert [e.kind for e in events] == ["failure", "decision", "breaker", "command"]
    out = io.StringIO()
    view = LineView(out)
    for event in events:
        view.event(event)
    assert visible(out.getvalue()), out.getvalue()
    assert "InternalServerError: Error code: 503" in out.getvalue()  # the module path dropped

    live = LiveView(io.StringIO())
    for event in events:
        live.event(event)
    screen = Screen(
        elapsed=3.0,
        title="spanvisor demo",
        lines=["sidecar"],
        runs=[run],
        steps={run["run_id"]: HOSTILE},
        breakers=[{"dependency": HOSTILE, "state": "open", "failures": 3}],
    )
    rows = live.render(screen, width=120)
    styling = re.compile(r"\x1b\[[0-9;]*m")  # the view's own colours, nothing else
    for row in rows:
        bare = styling.sub("", row)
        assert visible(bare), repr(row)
        assert len(bare) <= 120, bare
    drawn = "\n".join(rows)
    assert "\x07" not in drawn and "\x1b]" not in drawn and "\x1b[2J" not in drawn


def test_format_event_fits_a_width() -> None:
    line = format_event(Event(10.0, "command", "ops-1", "retry_step " + "x" * 300), width=80)
    assert len(line) == 80 and line.endswith("...")


def test_the_summary_tells_each_run_in_order_and_fits_the_width() -> None:
    seen = Seen()
    for number, (kind, action) in enumerate([("unavailable", "retry"), ("auth", "fail_fast")]):
        seen.failures[("t", f"s{number}", "r")] = {
            "trace_id": "t",
            "span_id": f"s{number}",
            "run_id": "ops-2",
            "class": "transient",
            "kind": kind,
            "action": action,
            "received_ns": number,
        }
        command = "retry_step" if action == "retry" else "abort_run"
        seen.commands[f"c{number}"] = {
            "type": command,
            "status": "delivered",
            "created_at": f"2026-01-01T00:00:0{number}Z",
            "trigger": {"trace_id": "t", "span_id": f"s{number}"},
        }
    seen.breaker_changes += [(1.0, "openai:gpt-4o", "closed", "open")]
    facts = Facts(
        elapsed=12.0,
        threads={
            "ops-10": {"status": "completed", "models_used": ["gpt-4o"]},
            "ops-2": {"status": "aborted", "reason": "abort_run: auth", "models_used": ["gpt-4o"]},
        },
        order=lambda run: int(run.rpartition("-")[2]),
        notes={"ops-2": "a note " * 12},
        outage="",
        effects="3 executed, 0 duplicated",
        services=("ops-agent",),
        downstream=None,
    )
    lines = summary(seen, facts)
    flat = " ".join(" ".join(lines).split())
    assert "ops-2 aborted gpt-4o a note" in flat
    assert "unavailable -> retry_step; auth -> abort_run ops-10 completed" in flat
    assert "breakers openai:gpt-4o opened 1.0s" in flat
    assert all(len(line) <= 100 for line in lines), [x for x in lines if len(x) > 100]
