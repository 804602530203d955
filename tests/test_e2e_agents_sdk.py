"""End to end with the OpenAI Agents SDK: OpenInference spans in, commands over the pull channel.

Real processes: a ``spanvisor run`` sidecar (one for the module) whose settings
give each agent service a pull channel, and two processes of the example agent
``examples/agents_sdk_agent.py`` (a real ``agents.Agent`` with function tools,
``Runner.run`` on ``OpenAIChatCompletionsModel`` with ``max_retries=0``,
instrumented with ``openinference-instrumentation-openai-agents``, exporting
OTLP/HTTP to the sidecar, long-polling ``GET /v1/commands`` and acking). In
this process, a fake OpenAI-compatible provider behind a
:class:`FaultSchedule` chooses the faults by model and by what is asked.

* transient (``gpt-4.1-mini``): the run's first model call gets a 503; once
  the e-mail is sent, the next call gets a 429 with ``retry-after: 1``. The
  sidecar classifies both as transient and sends ``retry_step`` (the second
  not before the server's second is over); the agent takes the run up from
  the failed point each time and it completes;
* outage (``gpt-4o``): after the e-mail is sent the primary model answers 503
  to everything; the policy falls back at once, ``switch_fallback`` names
  ``openai:gpt-4o-mini``, the agent (``--retry-from start``) runs again from
  the start on it, and the replayed ``send_email`` is recognised, not sent;
* the sidecar's incidents have the right class, kind, dependency, action and
  run id (the ``session.id`` the agent put on every span), every command was
  acknowledged, and no e-mail went out twice.

The last tests need no processes: spans captured from the real SDK and
instrumentation (in memory) go through :func:`supervisor.normalize` and the
pipeline, pinning what the sidecar makes of them: one failure per failed model
call (the agent span above an OK ``turn`` span is attributed to it), and a
success in a later attempt of the session resets the step's attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from policies import load_policy
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.normalize import normalize_request
from supervisor.records import Role, SpanRecord
from supervisor.testing import FakeProvider
from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import FaultSchedule, Matcher, ProviderRequest, Served
from supervisor.testing.sidecar_process import SidecarProcess, stop_process, tail

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "agents_sdk_agent.py"
TOKEN = "e2e-sdk-api-token-0123456789"
SERVICES = {"transient": "sdk-transient", "outage": "sdk-outage"}
MODELS = {"transient": "gpt-4.1-mini", "outage": "gpt-4o"}
FALLBACK = "gpt-4o-mini"
RECIPIENT = "oncall@example.com"

POLICY = """\
version: 1
policies:
  # The primary model is down: move the run to the fallback at once.
  - name: e2e.outage_falls_back
    match: {kind: unavailable, dependency: "openai:gpt-4o"}
    action: fallback
    chain: {"openai:gpt-4o": ["openai:gpt-4o-mini"]}
  # The server's retry-after (1 s here) is the floor of the delay.
  - name: e2e.rate_limit
    match: {kind: rate_limit}
    action: retry
    max_attempts: 4
    wait: {type: fixed, seconds: 0.1}
    honour_retry_after: true
    max_retry_after_s: 5
  - name: e2e.unavailable
    match: {kind: unavailable}
    action: retry
    max_attempts: 4
    wait: {type: fixed, seconds: 0.2}
# The fake model gives every run the same answers: not a reasoning loop.
detectors: {loops: {enabled: false}}
"""

# -- the fake provider and the sidecar --------------------------------------------------------


def _email(request: ProviderRequest) -> dict[str, Any]:
    return {"to": RECIPIENT, "subject": request.last_user_text[:60]}


def _model_answer(request: ProviderRequest) -> Reply:
    """A model that e-mails once per user turn, then says it did (as ``tool_then_text``)."""
    if request.offers_tool("send_email") and request.last_role == "user":
        return Reply.tool_call("send_email", _email(request))
    return Reply.text(f"Told the on-call team ({request.last_user_text[:30]}).")


@dataclass
class Stack:
    fake: FaultSchedule
    sidecar: SidecarProcess
    tmp: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e-agents-sdk")
    fake = FaultSchedule(answer=_model_answer).start()
    settings = {
        "api_token": TOKEN,
        "drain_timeout_s": 5,
        "agents": {service: {"pull": {"visibility_s": 10}} for service in SERVICES.values()},
    }
    try:
        with SidecarProcess(settings, tmp, policy=POLICY) as sidecar:
            yield Stack(fake, sidecar, tmp)
    finally:
        fake.stop()


# -- agent processes ---------------------------------------------------------------------


@dataclass
class AgentRun:
    """One agent process and what it left behind."""

    scenario: str
    process: subprocess.Popen[bytes]
    summary_path: Path
    effects_path: Path
    log_path: Path
    returncode: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    effects: list[dict[str, Any]] = field(default_factory=list)

    def finish(self, deadline: float) -> AgentRun:
        """Wait for the agent to exit (stop it at ``deadline``) and read what it wrote."""
        try:
            self.returncode = self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # It writes its summary on the way out.
            self.returncode = stop_process(self.process, 5)
        if self.summary_path.exists():
            self.summary = json.loads(self.summary_path.read_text(encoding="utf-8"))
        if self.effects_path.exists():
            lines = self.effects_path.read_text(encoding="utf-8").splitlines()
            self.effects = [json.loads(line) for line in lines if line.strip()]
        return self

    @property
    def run(self) -> dict[str, Any]:
        [only] = self.summary["runs"]
        found: dict[str, Any] = only
        return found


def start_agent(stack: Stack, scenario: str, *extra: str) -> AgentRun:
    folder = stack.tmp / scenario
    folder.mkdir()
    summary, effects, log_path = folder / "summary.json", folder / "effects.jsonl", folder / "log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))},
        "OPENAI_BASE_URL": stack.fake.base_url,
        "OPENAI_API_KEY": "sk-fake",
        "OTEL_EXPORTER_OTLP_ENDPOINT": stack.sidecar.otlp_endpoint,
        "OTEL_SERVICE_NAME": SERVICES[scenario],
        "SPANVISOR_API_TOKEN": TOKEN,
    }
    argv = [
        sys.executable,
        str(AGENT),
        f"--model={MODELS[scenario]}",
        "--runs=1",
        f"--run-prefix={scenario}",
        f"--spanvisor-url={stack.sidecar.api}",
        "--poll-wait-s=1",
        f"--effects={effects}",
        f"--summary={summary}",
        "--command-timeout-s=15",
        "--run-timeout-s=30",
        "--llm-timeout-s=5",
        "--export-delay-ms=50",
        *extra,
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return AgentRun(scenario, process, summary, effects, log_path)


def in_run(scenario: str, last_role: str) -> Matcher:
    """Requests of the scenario's run whose last message has ``last_role``."""
    marker = f"Run {scenario}-1:"

    def matches(request: ProviderRequest) -> bool:
        return request.last_user_text.startswith(marker) and request.last_role == last_role

    return matches


def served_to(stack: Stack, scenario: str) -> list[Served]:
    marker = f"Run {scenario}-1:"
    return [s for s in stack.fake.served if s.request.last_user_text.startswith(marker)]


def diagnostics(stack: Stack, agent: AgentRun) -> str:
    served = [
        f"#{s.request.number} {s.request.model} {s.request.last_role}->{s.status} {s.fault}"
        for s in served_to(stack, agent.scenario)
    ]
    return "\n".join(
        [
            f"--- agent {agent.scenario}: exit {agent.returncode}",
            tail(agent.log_path, 60),
            "--- agent summary",
            json.dumps(agent.summary, indent=1)[:6000],
            "--- fake provider",
            "\n".join(served),
            "--- sidecar log (tail)",
            tail(stack.sidecar.log_path, 40),
        ]
    )


@contextlib.contextmanager
def explained(stack: Stack, agent: AgentRun) -> Iterator[None]:
    """Append the agent's and the sidecar's side of the story to a failed assertion."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n\n{diagnostics(stack, agent)}") from None


@pytest.fixture(scope="module")
def agents(stack: Stack) -> dict[str, AgentRun]:
    """Both scenarios, their agents running side by side (the processes run here only)."""
    fake = stack.fake
    transient = MODELS["transient"]
    fake.burst(
        Reply.server_error(503), model=transient, when=in_run("transient", "user"), name="503"
    )
    fake.burst(
        Reply.rate_limited(retry_after_s=1.0, model=transient),
        model=transient,
        when=in_run("transient", "tool"),
        name="429-after-email",
    )
    # The primary model goes down once the e-mail is out, and stays down.
    outage = fake.outage(
        MODELS["outage"], when=in_run("outage", "tool"), start="now", name="gpt-4o-outage"
    )
    started = [
        start_agent(stack, "transient"),
        start_agent(stack, "outage", "--retry-from=start"),
    ]
    deadline = time.monotonic() + 35
    try:
        return {agent.scenario: agent.finish(deadline) for agent in started}
    finally:
        outage.end()


def _acted(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The commands the run acted on (the others were stale, ignored or late)."""
    return [c for c in run["commands"] if c["acted"] in ("retried", "switched", "aborted")]


# -- (a) transient failures --------------------------------------------------------------


def test_transient_failures_are_retried_over_the_pull_channel_and_the_run_completes(
    stack: Stack, agents: dict[str, AgentRun]
) -> None:
    agent = agents["transient"]
    with explained(stack, agent):
        assert agent.returncode == 0
        run = agent.run
        assert (run["status"], run["models_used"]) == ("completed", [MODELS["transient"]])
        assert [(f["error"], f["status_code"]) for f in run["failures"]] == [
            ("InternalServerError", 503),
            ("RateLimitError", 429),
        ]
        assert [a["from"] for a in run["attempts"]] == ["start", "failed_point", "failed_point"]
        assert [a["outcome"] for a in run["attempts"]] == ["failed", "failed", "completed"]

        unavailable, rate_limited = _acted(run)
        assert (unavailable["type"], unavailable["acted"]) == ("retry_step", "retried")
        assert (unavailable["failure_class"], unavailable["failure_kind"]) == (
            "transient",
            "unavailable",
        )
        assert unavailable["params"]["delay_s"] == 0.2
        assert unavailable["trigger_trace_id"] == run["attempts"][0]["trace_id"]
        assert 0.2 <= unavailable["after_failure_s"] < 5

        assert (rate_limited["type"], rate_limited["acted"]) == ("retry_step", "retried")
        assert (rate_limited["failure_class"], rate_limited["failure_kind"]) == (
            "transient",
            "rate_limit",
        )
        # The server asked for 1 s: the sidecar kept the command until then.
        assert rate_limited["params"]["retry_after_s"] == 1
        assert rate_limited["params"]["delay_s"] == 1.0
        assert 1.0 <= rate_limited["after_failure_s"] < 6
        assert rate_limited["trigger_trace_id"] == run["attempts"][1]["trace_id"]

        # Taken up from the failed point: the retry after the 429 resent the tool's
        # result, it did not ask for the e-mail again.
        served = served_to(stack, "transient")
        assert [(s.request.last_role, s.status) for s in served] == [
            ("user", 503),
            ("user", 200),
            ("tool", 429),
            ("tool", 200),
        ]
        assert {s.request.model for s in served} == {MODELS["transient"]}
        assert agent.summary["pull"]["error"] == ""
        assert agent.summary["pull"]["malformed"] == 0


# -- (b) an outage of the primary model ----------------------------------------------------


def test_an_outage_of_the_primary_model_moves_the_run_to_the_fallback(
    stack: Stack, agents: dict[str, AgentRun]
) -> None:
    agent = agents["outage"]
    with explained(stack, agent):
        assert agent.returncode == 0
        run = agent.run
        assert run["status"] == "completed"
        assert run["models_used"] == [MODELS["outage"], FALLBACK]
        assert [(f["model"], f["status_code"]) for f in run["failures"]] == [("gpt-4o", 503)]
        [switch] = _acted(run)
        assert (switch["type"], switch["acted"]) == ("switch_fallback", "switched")
        assert switch["params"]["to"] == f"openai:{FALLBACK}"
        assert (switch["failure_kind"], switch["failure_dependency"]) == (
            "unavailable",
            "openai:gpt-4o",
        )
        assert switch["after_failure_s"] < 5  # a fallback is due at once
        assert [(a["model"], a["from"]) for a in run["attempts"]] == [
            ("gpt-4o", "start"),
            (FALLBACK, "start"),
        ]

        # The provider's log: the fallback model answered the rest of the run.
        served = served_to(stack, "outage")
        assert [(s.request.model, s.request.last_role, s.status, s.fault) for s in served] == [
            ("gpt-4o", "user", 200, ""),
            ("gpt-4o", "tool", 503, "gpt-4o-outage"),
            (FALLBACK, "user", 200, ""),
            (FALLBACK, "tool", 200, ""),
        ]


# -- (c) what the sidecar made of it --------------------------------------------------------


def test_the_sidecar_classified_the_failures_and_every_command_was_acknowledged(
    stack: Stack, agents: dict[str, AgentRun]
) -> None:
    incidents = stack.sidecar.get("/v1/incidents")["incidents"]
    for scenario, expected in (
        (
            "transient",
            [
                ("transient", "rate_limit", "openai:gpt-4.1-mini", "retry"),
                ("transient", "unavailable", "openai:gpt-4.1-mini", "retry"),
            ],
        ),
        ("outage", [("transient", "unavailable", "openai:gpt-4o", "fallback")]),
    ):
        agent = agents[scenario]
        with explained(stack, agent):
            service = SERVICES[scenario]
            # Only the model calls' own failures: the agent span that repeats each
            # (above an OK turn span) is attributed to it.
            mine = [i for i in incidents if i["service"] == service]
            llm = [i for i in mine if i["role"] == "llm"]
            assert len(llm) == len(mine), mine
            assert sorted((i["class"], i["kind"], i["dependency"], i["action"]) for i in llm) == (
                expected
            )
            assert {i["span_name"] for i in llm} == {"generation"}
            # The run id is the session.id the agent put on every span, not a trace id.
            assert {i["run_id"] for i in llm} == {agent.run["run_id"]}
            failed_traces = {f["trace_id"] for f in agent.run["failures"]}
            assert {i["trace_id"] for i in llm} == failed_traces

            log = stack.sidecar.get("/v1/commands/log", service=service)["commands"]
            assert log and {(c["channel"], c["status"]) for c in log} == {("pull", "delivered")}
            assert {c["run_id"] for c in log} == {agent.run["run_id"]}
            # All acknowledged by the agent: acted on, or dropped as about an earlier
            # attempt, or (arriving after the run ended) as about no current run.
            assert agent.summary["pull"]["acked"] == len(log)
    assert stack.sidecar.get("/v1/dead-letters")["dead_letters"] == []


def test_no_side_effect_happened_twice(stack: Stack, agents: dict[str, AgentRun]) -> None:
    for scenario, replays in (("transient", 0), ("outage", 1)):
        agent = agents[scenario]
        with explained(stack, agent):
            run = agent.run
            counts = Counter(record["key"] for record in agent.effects)
            assert len(counts) == 1 and set(counts.values()) == {1}
            [key] = counts
            assert key.startswith(f"{run['run_id']}/send_email/")
            assert agent.effects[0]["arguments"]["to"] == RECIPIENT
            # The outage run started over on the fallback: its model asked for the same
            # e-mail again (with a new tool call id), and the ledger recognised it.
            assert [e["first_time"] for e in run["effects"]] == [True] + [False] * replays
            assert len({e["tool_call_id"] for e in run["effects"]}) == 1 + replays
            assert agent.summary["effects"] == {
                "path": str(agent.effects_path),
                "sent": 1,
                "deduplicated": replays,
            }


# -- the spans themselves, captured in memory -------------------------------------------------


@dataclass
class Captured:
    spans: list[ReadableSpan]
    errors: list[BaseException]

    def records(self) -> list[SpanRecord]:
        return normalize_request(encode_spans(self.spans))


def _capture(*replies: Reply, runs: int, session: str = "run-under-test") -> Captured:
    """Run the SDK agent ``runs`` times (one session) against the scripted fake provider."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_trace_processors,
    )
    from openinference.instrumentation import using_session
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "sdk-capture"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_trace_processors([])  # nothing for OpenAI's tracing backend, nothing to restore
    instrumentor = OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=provider)

    @function_tool
    def send_email(to: str, subject: str) -> str:
        """Send an e-mail."""
        return "sent"

    errors: list[BaseException] = []

    async def go(base_url: str) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-fake", max_retries=0)
        model = OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client)
        agent = Agent(name="oncall-notifier", instructions="Be brief.", tools=[send_email])
        config = RunConfig(model=model, trace_include_sensitive_data=True)
        try:
            for _ in range(runs):
                try:
                    with using_session(session):
                        await Runner.run(agent, "Tell on-call.", run_config=config)
                except openai.APIError as exc:
                    errors.append(exc)
        finally:
            await client.close()

    try:
        with FakeProvider() as fake:
            fake.script(*replies)
            asyncio.run(go(fake.base_url))
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    return Captured(list(exporter.get_finished_spans()), errors)


def _call_then(reply: Reply) -> tuple[Reply, ...]:
    return (Reply.tool_call("send_email", {"to": RECIPIENT, "subject": "backup"}), reply)


def test_openinference_agents_spans_normalize_to_roles_dependencies_and_errors() -> None:
    captured = _capture(
        *_call_then(Reply.text("Done.")),
        *_call_then(Reply.rate_limited(retry_after_s=1.5, model="gpt-4o")),
        Reply.server_error(503),
        runs=3,
    )
    assert [type(e).__name__ for e in captured.errors] == ["RateLimitError", "InternalServerError"]
    records = captured.records()
    by_role = Counter(r.role for r in records)
    # Per run: the workflow (AGENT) and its CHAIN span, the agent (AGENT), a turn
    # (CHAIN) per model call, the generations (LLM) and the tool (TOOL).
    assert by_role[Role.LLM] == 5 and by_role[Role.TOOL] == 2
    assert {r.run_id for r in records} == {"run-under-test"}  # session.id, not the trace

    llm = [r for r in records if r.role is Role.LLM]
    assert {(r.name, r.dependency) for r in llm} == {("generation", "openai:gpt-4o")}
    first = llm[0]
    assert (first.provider, first.model, first.error) == ("openai", "gpt-4o", None)
    assert first.input_tokens is not None and first.output_tokens is not None
    assert "Done." in {r.output_text for r in llm}
    tools = [r for r in records if r.role is Role.TOOL]
    assert {(t.name, t.dependency, t.tool_name, t.error) for t in tools} == {
        ("send_email", "tool:send_email", "send_email", None)
    }
    agent_spans = [r for r in records if r.role is Role.AGENT and r.name == "oncall-notifier"]
    assert len(agent_spans) == 3

    failed = [r for r in llm if r.error is not None]
    assert [r.error.http_status for r in failed if r.error] == [429, 503]
    rate, down = (r.error for r in failed)
    assert rate is not None and down is not None
    # What the SDK writes: status ERROR "Error getting response: {'error': '<str(exc)>'}",
    # no exception event, no error.type: the evidence comes from the text.
    assert rate.status_error and rate.status_message.startswith("Error getting response: ")
    assert "Error code: 429" in rate.status_message
    assert (rate.exception_type, rate.error_type) == ("", "")
    assert (rate.provider_code, rate.retry_after_s) == ("rate_limit_exceeded", 1.5)
    assert "Error code: 503" in down.status_message

    policy = load_policy()
    verdicts = [policy.classify(r) for r in failed]
    assert [(v.failure_class.value, v.kind, v.rule) for v in verdicts if v] == [
        ("transient", "rate_limit", "builtin.openai.rate_limit"),
        ("transient", "unavailable", "builtin.http.unavailable"),
    ]


def _outcomes(captured: Captured) -> list[Outcome]:
    """The pipeline over the spans, one OTLP request per trace (as a batch exporter sends)."""
    pipeline = Pipeline(load_policy())
    outcomes: list[Outcome] = []
    traces: dict[int, list[ReadableSpan]] = {}
    for span in captured.spans:
        traces.setdefault(span.context.trace_id, []).append(span)
    for spans in traces.values():
        outcomes += pipeline.process(encode_spans(spans), time.time_ns())
    return outcomes


def test_a_failed_model_call_is_one_failure_not_two() -> None:
    captured = _capture(Reply.server_error(503), runs=1)

    outcomes = _outcomes(captured)

    assert [(o.failure.span_name, o.failure.role) for o in outcomes] == [("generation", Role.LLM)]


def test_a_success_in_a_later_attempt_of_the_session_resets_the_retry_count() -> None:
    # Attempt 1 fails at once (503). Attempt 2, a new SDK trace in the same session,
    # gets one answer (the tool call), then a 429: the 429 is the first failure since
    # the model last answered, so its retry is attempt 1.
    captured = _capture(Reply.server_error(503), *_call_then(Reply.rate_limited(1.0)), runs=2)

    outcomes = [o for o in _outcomes(captured) if o.failure.role is Role.LLM]

    assert [(o.failure.kind, o.decision.params.get("attempt")) for o in outcomes] == [
        ("unavailable", 1),
        ("rate_limit", 1),
    ]
