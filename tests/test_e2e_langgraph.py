"""End to end with a LangGraph agent: OpenInference spans in, commands by pull, threads go on.

Real processes: a ``spanvisor run`` sidecar (one for the module, each
scenario's service on the pull channel), one or two processes of the example
``examples/langgraph_agent.py`` per scenario (LangGraph with a ``SqliteSaver``,
``ChatOpenAI``, OpenInference's LangChain instrumentation exporting OTLP/HTTP,
commands pulled and mapped by ``LangGraphAdapter``) and the ``spanvisor``
CLI that approves; in this process, the fake OpenAI-compatible provider
behind a :class:`FaultSchedule`, on loopback.

Each scenario has its own service and primary model, so no breaker sees
another's calls:

* transient (``gpt-4.1-mini``): a 429 with ``retry-after: 1`` after step 0's
  e-mail; ``retry_step`` comes a second later and the thread continues from
  its checkpoint (the e-mail is not sent again: the tool does not even run);
* crash (``gpt-4.1-nano``): the agent is killed with SIGKILL right after step
  1's e-mail went out, inside the tool; restarted with ``--resume``, it waits;
  the sidecar's stall detector (2 s for this service) sees the run silent
  and sends ``resume_run`` naming the unanswered ``send_email`` call; the
  thread continues from its checkpoint, the tool finds the e-mail in the
  ledger and does not send it again, and step 2 follows;
* outage (``gpt-4o``): every call fails with 503; after two retries the
  breaker opens and ``switch_fallback`` moves the thread to ``gpt-4o-mini``;
* approvals (``gpt-4.1``): a 401 is escalated, a person approves with the
  CLI and the thread continues; then a refund above the limit waits in
  ``interrupt()``, which the sidecar sees (a ``GraphInterrupt`` on the tool
  span, classified by this test's policy as ``approval_required``) and
  escalates; the approval reaches the thread as ``Command(resume=...)``.

The scenario fixtures run the processes and collect what happened; the tests
only assert, each with the agent's log and summary and the sidecar's log on
failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import FaultSchedule, Matcher, ProviderRequest
from supervisor.testing.sidecar_process import SidecarProcess, stop_process, tail, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "langgraph_agent.py"
TOKEN = "e2e-langgraph-token-0123456789"
SERVICES = {
    "transient": "e2e-lg-transient",
    "crash": "e2e-lg-crash",
    "outage": "e2e-lg-outage",
    "approvals": "e2e-lg-approvals",
}
MODELS = {
    "transient": "gpt-4.1-mini",
    "crash": "gpt-4.1-nano",
    "outage": "gpt-4o",
    "approvals": "gpt-4.1",
}
STALL_S = 2

POLICY = f"""\
version: 1
rules:
  # LangGraph's interrupt() raises GraphInterrupt through the tool, and
  # OpenInference records it on the tool's span: here, a request for a person.
  - name: e2e.langgraph_interrupt
    match: {{exception_type: GraphInterrupt}}
    class: semantic
    kind: approval_required
policies:
  - name: e2e.auth_needs_a_person
    match: {{kind: auth}}
    action: escalate
  - name: e2e.approval_required
    match: {{kind: approval_required}}
    action: escalate
  - name: e2e.rate_limit
    match: {{kind: rate_limit}}
    action: retry
    max_attempts: 4
    wait: {{type: fixed, seconds: 0.1}}
    honour_retry_after: true
    max_retry_after_s: 5
  - name: e2e.unavailable
    match: {{kind: unavailable}}
    action: retry
    max_attempts: 5
    wait: {{type: fixed, seconds: 0.2}}
    on_exhausted:
      action: fallback
      chain: {{"openai:gpt-4o": ["openai:gpt-4o", "openai:gpt-4o-mini"]}}
      on_exhausted: escalate
breakers:
  default: {{fail_max: 5, reset_timeout_s: 30}}
  dependencies:
    "openai:gpt-4o": {{fail_max: 3, reset_timeout_s: 60}}
retry_budget: {{ratio: 0.5, min_retries: 20, window_s: 10}}
restart_intensity: {{max_actions: 10, period_s: 60}}
# The fake model answers every step alike, which is what a loop looks like;
# these scenarios are about other failures. Stalls: only the crash scenario's
# service is watched closely.
detectors:
  loops: {{enabled: false}}
  services:
    "{SERVICES["crash"]}": {{stalls: {{enabled: true, idle_seconds: {STALL_S}}}}}
"""

# -- the fake model ---------------------------------------------------------------------------


def step_text(request: ProviderRequest) -> str:
    """The last user turn the agent wrote (not a note from the supervisor)."""
    for message in reversed(request.messages):
        if message.get("role") == "user" and message.get("name") != "spanvisor":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def answer(request: ProviderRequest) -> Reply:
    """A model that does what the step asks with one tool call, then says it did."""
    last = request.messages[-1] if request.messages else {}
    asks = last.get("role") == "user" and last.get("name") != "spanvisor"
    text = step_text(request)
    if asks and request.offers_tool("send_email"):
        if "refund" in text:
            order = text.split("refund order ", 1)[1].split(" ", 1)[0]
            return Reply.tool_call("issue_refund", {"order": order, "amount": 250})
        return Reply.tool_call("send_email", {"to": "oncall@example.com", "subject": text[:60]})
    return Reply.text(f"Done: {text[:40]}")


def in_step(scenario: str, step: int, last_role: str) -> Matcher:
    """The requests of one step of the scenario's thread, at one point of it."""
    marker = f"Step {step} of {scenario}-1:"

    def matches(request: ProviderRequest) -> bool:
        return step_text(request).startswith(marker) and request.last_role == last_role

    return matches


# -- the sidecar ------------------------------------------------------------------------------


class Sidecar(SidecarProcess):
    def commands(self, scenario: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get(
            "/v1/commands/log", service=SERVICES[scenario], limit=1000
        )["commands"]
        return sorted(found, key=lambda c: c["created_at"])

    def incidents(self, scenario: str) -> list[dict[str, Any]]:
        found = self.get("/v1/incidents", limit=1000)["incidents"]
        return [i for i in found if i["service"] == SERVICES[scenario]]


@dataclass
class Stack:
    fake: FaultSchedule
    sidecar: Sidecar
    tmp: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e-langgraph")
    fake = FaultSchedule(answer=answer).start()
    settings = {
        "api_token": TOKEN,
        "drain_timeout_s": 5,
        "agents": {service: {"pull": {"visibility_s": 10}} for service in SERVICES.values()},
    }
    try:
        with Sidecar(settings, tmp, policy=POLICY) as sidecar:
            yield Stack(fake, sidecar, tmp)
    finally:
        fake.stop()


# -- agent processes --------------------------------------------------------------------------


@dataclass
class AgentRun:
    """One scenario's agent process(es) and what they left behind."""

    scenario: str
    folder: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    summary_path: Path
    returncode: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def effects_path(self) -> Path:
        return self.folder / "effects.jsonl"

    def effects(self) -> list[dict[str, Any]]:
        if not self.effects_path.exists():
            return []
        lines = self.effects_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def finish(self, timeout_s: float) -> AgentRun:
        """Wait for the process to exit (stop it after ``timeout_s``); read its summary."""
        try:
            self.returncode = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.notes["timed_out"] = f"still running after {timeout_s:g}s: stopped"
            self.stop()
        if self.summary_path.exists():
            self.summary = json.loads(self.summary_path.read_text(encoding="utf-8"))
        return self

    def stop(self) -> None:
        code = stop_process(self.process, 5)
        if self.returncode is None:
            self.returncode = code

    def thread(self) -> dict[str, Any]:
        [found] = self.summary.get("threads", [{}])
        return dict(found)


def start_agent(
    stack: Stack,
    scenario: str,
    *extra: str,
    steps: int = 2,
    log_name: str = "log",
    summary_name: str = "summary.json",
) -> AgentRun:
    folder = stack.tmp / scenario
    folder.mkdir(exist_ok=True)
    log_path, summary = folder / log_name, folder / summary_name
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "OPENAI_", "SPANVISOR_"))
        },
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
        f"--steps={steps}",
        f"--run-prefix={scenario}",
        f"--checkpoints={folder / 'checkpoints.sqlite'}",
        f"--effects={folder / 'effects.jsonl'}",
        f"--summary={summary}",
        f"--api={stack.sidecar.api}",
        "--command-timeout-s=15",
        "--pause-timeout-s=30",
        "--run-timeout-s=45",
        "--llm-timeout-s=5",
        "--poll-wait-s=1",
        "--export-delay-ms=50",
        *extra,
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return AgentRun(scenario, folder, process, log_path, summary)


def diagnostics(stack: Stack, *agents: AgentRun) -> str:
    parts = []
    for agent in agents:
        parts += [
            f"--- agent {agent.scenario} ({agent.log_path.name}): exit {agent.returncode},"
            f" notes {json.dumps(agent.notes, default=str)[:2000]}",
            tail(agent.log_path, 60),
            "--- its summary",
            json.dumps(agent.summary, indent=1)[:5000],
        ]
    served = [
        f"#{s.request.number} {s.request.model} {s.request.last_role}->{s.status} {s.fault}"
        for s in stack.fake.served
        if s.request.model
    ]
    return "\n".join(
        [
            *parts,
            "--- fake provider (last 30 requests)",
            "\n".join(served[-30:]),
            "--- sidecar log (tail)",
            tail(stack.sidecar.log_path, 40),
        ]
    )


@contextlib.contextmanager
def explained(stack: Stack, *agents: AgentRun) -> Iterator[None]:
    """Append the agents' and the sidecar's side of the story to a failed assertion."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n\n{diagnostics(stack, *agents)}") from None


def approve(stack: Stack, approval_id: str, note: str) -> tuple[int, str, str]:
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "approvals",
            "approve",
            approval_id,
            "--api",
            stack.sidecar.api,
            "--token",
            TOKEN,
            "--by",
            "e2e-test",
            "--note",
            note,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return cli.returncode, cli.stdout.strip(), cli.stderr.strip()


def by_key(effects: list[dict[str, Any]]) -> Counter[str]:
    return Counter(str(e["key"]) for e in effects)


# -- the scenarios (processes run here; the tests below only assert) -------------------------


@pytest.fixture(scope="module")
def transient(stack: Stack) -> AgentRun:
    stack.fake.burst(
        Reply.rate_limited(retry_after_s=1.0, model=MODELS["transient"]),
        model=MODELS["transient"],
        when=in_step("transient", 0, "tool"),
        name="429-after-email",
    )
    return start_agent(stack, "transient").finish(timeout_s=40)


@dataclass
class CrashRun:
    first: AgentRun
    second: AgentRun
    effects_at_crash: list[dict[str, Any]]


@pytest.fixture(scope="module")
def crash(stack: Stack) -> CrashRun:
    first = start_agent(stack, "crash", "--crash-after-effects=2", steps=3, log_name="log-1")
    first.finish(timeout_s=30)
    at_crash = first.effects()
    # The operator (or the orchestrator) starts the agent again; it knows nothing
    # about which thread to go on with until the sidecar says.
    second = start_agent(stack, "crash", "--resume", steps=3, log_name="log-2")
    second.finish(timeout_s=40)
    return CrashRun(first, second, at_crash)


@pytest.fixture(scope="module")
def outage(stack: Stack) -> AgentRun:
    stack.fake.outage(MODELS["outage"], duration_s=600, name="gpt-4o-outage")
    return start_agent(stack, "outage").finish(timeout_s=40)


@pytest.fixture(scope="module")
def approvals(stack: Stack) -> AgentRun:
    model = MODELS["approvals"]
    stack.fake.burst(
        Reply.unauthorized(), model=model, when=in_step("approvals", 0, "user"), name="401"
    )
    agent = start_agent(stack, "approvals", "--refund-step=1", "--refund-amount=250")
    service = SERVICES["approvals"]
    answered: list[dict[str, Any]] = []
    try:
        with explained(stack, agent):
            for note in ("API key rotated", "refund ok"):

                def pending() -> dict[str, Any] | None:
                    found = stack.sidecar.get("/v1/approvals", status="pending")["approvals"]
                    return next(
                        (
                            a
                            for a in found
                            if a["service"] == service
                            and a["id"] not in {x["id"] for x in answered}
                        ),
                        None,
                    )

                approval = wait_until(pending, 25, f"an approval request ({note})")
                approval["cli"] = approve(stack, approval["id"], note)
                answered.append(approval)
    finally:
        agent.notes["approvals"] = answered
        agent.finish(timeout_s=30)
    return agent


# -- (a) a 429, retried from the checkpoint ----------------------------------------------------


def test_a_rate_limited_call_is_retried_after_retry_after_from_the_checkpoint(
    stack: Stack, transient: AgentRun
) -> None:
    with explained(stack, transient):
        assert transient.returncode == 0
        thread = transient.thread()
        assert (thread["thread_id"], thread["status"]) == ("transient-1", "completed")
        assert [(f["step"], f["status_code"]) for f in thread["failures"]] == [(0, 429)]
        [retry] = thread["commands"]
        assert (retry["type"], retry["action"]) == ("retry_step", "continue")
        # The server asked for 1 s: the sidecar held the command until then (counted
        # from the failing span's end, a little before the exception left the graph).
        assert 0.9 <= retry["after_failure_s"] < 5.0
        assert [s["attempts"] for s in thread["steps"]] == [2, 1]

        [logged] = stack.sidecar.commands("transient")
        assert (logged["type"], logged["status"], logged["run_id"]) == (
            "retry_step",
            "delivered",
            "transient-1",
        )
        assert logged["params"]["retry_after_s"] == 1
        [incident] = stack.sidecar.incidents("transient")
        assert (incident["kind"], incident["dependency"], incident["run_id"]) == (
            "rate_limit",
            "openai:gpt-4.1-mini",
            "transient-1",
        )
        # Continued from the checkpoint after the tool's result: the tool did not run
        # again, and the retried request carried the e-mail's result.
        assert by_key(transient.effects()) == {
            "transient-1/step-0/send_email": 1,
            "transient-1/step-1/send_email": 1,
        }
        assert transient.summary["effects"]["deduplicated"] == 0
        served = [s for s in stack.fake.served if s.request.model == MODELS["transient"]]
        [limited] = [s for s in served if s.fault == "429-after-email"]
        retried = next(s for s in served if s.request.number > limited.request.number)
        assert retried.request.body["messages"] == limited.request.body["messages"]
        assert retried.request.wall - limited.request.wall >= 1.0


# -- (b) killed after a side effect, resumed by the sidecar ----------------------------------------


def test_a_killed_agent_is_resumed_by_the_sidecar_without_repeating_the_side_effect(
    stack: Stack, crash: CrashRun
) -> None:
    first, second = crash.first, crash.second
    with explained(stack, first, second):
        assert first.returncode == -signal.SIGKILL
        assert [e["key"] for e in crash.effects_at_crash] == [
            "crash-1/step-0/send_email",
            "crash-1/step-1/send_email",
        ]
        assert second.returncode == 0
        thread = second.thread()
        assert (thread["thread_id"], thread["status"], thread["adopted"]) == (
            "crash-1",
            "completed",
            True,
        )
        # The first command the restarted agent got was the sidecar's resume_run,
        # naming the e-mail whose tool span never came.
        resume = thread["commands"][0]
        assert (resume["type"], resume["action"]) == ("resume_run", "continue")
        [unverified] = thread["unverified"]
        assert unverified.startswith("send_email(")
        assert "Step 1 of crash-1" in unverified
        [stall] = [i for i in stack.sidecar.incidents("crash") if i["kind"] == "stall"]
        assert stall["run_id"] == "crash-1"
        [logged] = [c for c in stack.sidecar.commands("crash") if c["type"] == "resume_run"]
        assert logged["params"]["unverified"] == [unverified]
        assert logged["status"] == "delivered"

        # Nothing happened twice: the re-run tool found step 1's e-mail in the ledger.
        assert by_key(second.effects()) == {
            "crash-1/step-0/send_email": 1,
            "crash-1/step-1/send_email": 1,
            "crash-1/step-2/send_email": 1,
        }
        assert second.summary["effects"] == {
            "path": str(second.effects_path),
            "performed": 1,
            "deduplicated": 1,
        }
        # The thread went on from its checkpoint (step 1's tool call), then did step 2.
        assert [(s["step"], s["attempts"]) for s in thread["steps"]] == [(1, 1), (2, 1)]
        assert "already sent" in second.log_path.read_text(encoding="utf-8")


# -- (c) an outage: the breaker opens, the thread falls back ------------------------------------


def test_an_outage_moves_the_thread_to_the_fallback_model(stack: Stack, outage: AgentRun) -> None:
    with explained(stack, outage):
        assert outage.returncode == 0
        thread = outage.thread()
        assert thread["status"] == "completed"
        assert thread["models_used"] == ["gpt-4o", "gpt-4o-mini"]
        # A switch that comes while the failing invocation still runs is deferred
        # ("none"), then applied by the adapter when that invocation ends.
        kinds = [(c["type"], c["action"]) for c in thread["commands"] if not c["deferred"]]
        assert kinds[-1] == ("switch_fallback", "continue")
        assert set(kinds[:-1]) <= {("retry_step", "continue")}
        [switch] = [c for c in stack.sidecar.commands("outage") if c["type"] == "switch_fallback"]
        assert (switch["params"]["to"], switch["params"]["breaker"]) == (
            "openai:gpt-4o-mini",
            "open",
        )
        # The provider saw the thread move: gpt-4o until the switch, gpt-4o-mini after.
        mine = [s for s in stack.fake.served if "outage-1" in step_text(s.request)]
        models = [s.request.model for s in mine]
        switched = models.index("gpt-4o-mini")
        assert set(models[:switched]) == {"gpt-4o"}
        assert all(s.status == 503 for s in mine[:switched])
        assert set(models[switched:]) == {"gpt-4o-mini"}
        assert by_key(outage.effects()) == {
            "outage-1/step-0/send_email": 1,
            "outage-1/step-1/send_email": 1,
        }


# -- (d) approvals: an escalated 401, then an interrupt() ----------------------------------------


def test_escalations_are_approved_with_the_cli_and_the_thread_resumes(
    stack: Stack, approvals: AgentRun
) -> None:
    with explained(stack, approvals):
        first, second = approvals.notes["approvals"]
        assert (first["what"]["kind"], second["what"]["kind"]) == ("auth", "approval_required")
        assert second["what"]["dependency"] == "tool:issue_refund"
        for approval in (first, second):
            assert approval["run_id"] == "approvals-1"
            returncode, stdout, stderr = approval["cli"]
            assert (returncode, stderr) == (0, "")
            assert stdout == f"{approval['id']}: approved by e2e-test"

        assert approvals.returncode == 0
        thread = approvals.thread()
        assert thread["status"] == "completed"
        assert [(c["type"], c["action"]) for c in thread["commands"]] == [
            ("pause_run", "wait"),
            ("approval_result", "continue"),
            ("pause_run", "wait"),
            ("approval_result", "continue"),
        ]
        assert [(f["step"], f["status_code"]) for f in thread["failures"]] == [(0, 401)]
        assert [s["interrupts"] for s in thread["steps"]] == [0, 1]
        # The refund happened once, after the approval, with the person's note.
        [refund] = [e for e in approvals.effects() if e["effect"] == "issue_refund"]
        assert (refund["key"], refund["amount"], refund["order"]) == (
            "approvals-1/step-1/issue_refund",
            250,
            "approvals-1-1",
        )
        answered_at = max(
            a["answered_at"]
            for a in stack.sidecar.get("/v1/approvals")["approvals"]
            if a["id"] == second["id"]
        )
        assert refund["at"] >= answered_at - 0.01
        refund_results = [
            m
            for s in stack.fake.served
            for m in s.request.messages
            if m.get("role") == "tool" and "refunded" in str(m.get("content"))
        ]
        assert refund_results
        assert by_key(approvals.effects()) == {
            "approvals-1/step-0/send_email": 1,
            "approvals-1/step-1/issue_refund": 1,
        }
