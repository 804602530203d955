"""A remediation's verdict covers everything since it started, not only what follows its last word.

A real sidecar in this process (OTLP/HTTP, the pipeline, the store, DBOS on
SQLite), the ``llm`` remediator against a fake OpenAI-compatible endpoint
whose last reply, the model's summary, is held until the test lets it go (the
injectable delay: a model slow to write its summary), and an agent in a
process of its own: the real ``openai`` SDK against a second fake provider,
instrumented with ``opentelemetry-instrumentation-openai-v2``, its spans
under an ``invoke_agent`` root and exported by the OTel SDK's
``BatchSpanProcessor`` over OTLP/HTTP. The agent flushes at each step (what
the processor does by itself a few seconds later), so every step's spans
reach the sidecar while the model is still answering.

* the agent's retry succeeds while the model writes its summary: recovered;
* the agent's run ends OK while the model writes its summary: recovered;
* the run ended OK in the same batch as its failure, before the remediation
  started: recovered too, at once, and the model is not asked to act on it.

Before the fix each of these waited out the verification window after the
model's last word, saw nothing, and escalated the healthy run to a person.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.settings import load_settings
from supervisor.testing import FakeProvider, Reply
from supervisor.testing.fault_schedule import FaultSchedule, ProviderRequest
from supervisor.wiring import build_sidecar

pytestmark = pytest.mark.slow

AGENT_MODEL = "gpt-4o-mini"
#: Longest the model's summary is held: past it the test fails, it never hangs.
HOLD_S = 30.0

AGENT = textwrap.dedent(
    """\
    import sys

    import openai
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    otlp, base_url, service, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp)))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    client = openai.OpenAI(base_url=base_url, api_key="sk-fake", max_retries=0)
    tracer = provider.get_tracer("agent")

    def ask():
        return client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Summarise the ticket."}]
        )

    def step(name):
        # The test says when each step happens; the spans so far go out first.
        provider.force_flush()
        print(name, flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(3)

    with tracer.start_as_current_span(
        "invoke_agent support", attributes={"gen_ai.operation.name": "invoke_agent"}
    ):
        try:
            ask()
        except openai.InternalServerError:
            pass
        if "failed" in steps:
            step("failed")
        if "retry" in steps:
            ask()
            step("retried")
    provider.force_flush()
    print("ended", flush=True)
    provider.shutdown()
    """
)


class Model:
    """The remediator's model: ``retry_step``, then a summary held until :meth:`release`."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.gate = threading.Event()
        self.holding = False

    def answer(self, request: ProviderRequest) -> Reply:
        if request.last_role != "tool":
            return Reply.tool_call("retry_step", {"reason": "the provider answered 503"})
        if self.holding:
            self.held.set()
            self.gate.wait(HOLD_S)  # the model is still writing its summary
        return Reply.text("Asked the agent to retry the step.")

    def hold(self) -> None:
        self.held.clear()
        self.gate.clear()
        self.holding = True

    def release(self) -> None:
        self.gate.set()


@dataclass
class Rig:
    sidecar: BackgroundSidecar
    model: Model
    agent_provider: FakeProvider
    otlp: str
    tmp: Path

    def agent(self, service: str, steps: str) -> subprocess.Popen[str]:
        self.agent_provider.reset()  # what an earlier agent left unasked
        self.agent_provider.script(Reply.server_error(503), Reply.text("Here is the summary."))
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                AGENT,
                self.otlp,
                self.agent_provider.base_url,
                service,
                steps,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.tmp,
        )

    def processed(self) -> int:
        return self.sidecar.sidecar.pipeline.stats().processed_spans

    def remediation(self, service: str) -> dict[str, Any]:
        """The service's one remediation, once it has finished."""
        runner = self.sidecar.sidecar.remediations.runner

        def finished() -> dict[str, Any] | None:
            if runner is None:
                return None
            for summary in runner.list(limit=50):
                view = runner.show(summary["id"])
                if view is None or view.get("status") in ("PENDING", "ENQUEUED"):
                    continue
                if view["request"]["trigger"]["service"] == service:
                    return view
            return None

        return _until(finished, timeout_s=20.0)

    def approvals(self, service: str) -> list[Any]:
        return [a for a in self.sidecar.sidecar.store.approvals() if a.service == service]


def _until(check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _read_line(agent: subprocess.Popen[str]) -> str:
    assert agent.stdout is not None
    line = agent.stdout.readline().strip()
    if not line:
        assert agent.stderr is not None
        raise AssertionError(f"the agent stopped: {agent.wait(10)} {agent.stderr.read()[-2000:]}")
    return line


def _go(agent: subprocess.Popen[str]) -> None:
    assert agent.stdin is not None
    agent.stdin.write("go\n")
    agent.stdin.flush()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("verdicts")
    model = Model()
    with (
        FaultSchedule(answer=model.answer) as remediator_model,
        FakeProvider() as agent_provider,
    ):
        policy_file = tmp / "policy.yaml"
        policy_file.write_text(
            textwrap.dedent(
                f"""\
                version: 1
                remediators:
                  fixer:
                    use: llm
                    tools: [retry_step, recent_spans]
                    params: {{base_url: "{remediator_model.base_url}", model: fixer, max_turns: 3}}
                    verify_window_s: 1
                    on_unresolved: escalate
                policies:
                  - name: verdicts.remediate_unavailable
                    match: {{kind: unavailable, dependency: "openai:{AGENT_MODEL}"}}
                    action: remediate
                    remediator: fixer
                """
            )
        )
        services = ("retried", "ended", "ended-first")
        settings = load_settings(
            overrides={
                "otlp_grpc_port": 0,
                "otlp_http_port": 0,
                "api_port": 0,
                "api_token": "verdicts-token-0123456789",
                "state_path": str(tmp / "state.db"),
                "policy": str(policy_file),
                "agents": {service: {"pull": {}} for service in services},
            }
        )
        background = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
        ports = background.start()
        try:
            yield Rig(
                background,
                model,
                agent_provider,
                f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
                tmp,
            )
        finally:
            model.release()
            background.stop()


def test_a_run_that_recovers_while_the_model_writes_its_summary_has_recovered(rig: Rig) -> None:
    rig.model.hold()
    with rig.agent("retried", "failed,retry") as agent:
        assert _read_line(agent) == "failed"  # its 503 is at the sidecar
        assert rig.model.held.wait(HOLD_S)  # retry_step sent; the summary is being written
        seen = rig.processed()
        _go(agent)
        assert _read_line(agent) == "retried"  # its successful retry is at the sidecar
        _until(lambda: rig.processed() > seen)  # and through the pipeline
        rig.model.release()
        _go(agent)
        assert _read_line(agent) == "ended"
    view = rig.remediation("retried")
    assert (view["outcome"], view["reason"]) == ("succeeded", "the run recovered")
    assert rig.approvals("retried") == []  # nobody is asked about a healthy run
    sent = rig.sidecar.sidecar.store.commands(service="retried")
    assert [c.command.type.value for c in sent] == ["retry_step"]


def test_a_run_that_ends_ok_while_the_model_writes_its_summary_has_recovered(rig: Rig) -> None:
    rig.model.hold()
    with rig.agent("ended", "failed") as agent:
        assert _read_line(agent) == "failed"
        assert rig.model.held.wait(HOLD_S)
        seen = rig.processed()
        _go(agent)  # the agent answers without the model: its root span ends OK
        assert _read_line(agent) == "ended"
        _until(lambda: rig.processed() > seen)
        rig.model.release()
    view = rig.remediation("ended")
    assert (view["outcome"], view["reason"]) == ("succeeded", "the run ended OK")
    assert rig.approvals("ended") == []


def test_a_run_that_ended_ok_before_its_remediation_started_has_recovered(rig: Rig) -> None:
    # The failing call and the root span leave in one batch: the run's end is
    # judged before the failure's remediation even starts.
    rig.model.holding = False
    with rig.agent("ended-first", "") as agent:
        assert _read_line(agent) == "ended"
    view = rig.remediation("ended-first")
    assert (view["outcome"], view["reason"]) == ("succeeded", "the run ended OK")
    assert rig.approvals("ended-first") == []
    # Nothing is sent to a run that had ended: the model was not even asked.
    assert rig.sidecar.sidecar.store.commands(service="ended-first") == []
