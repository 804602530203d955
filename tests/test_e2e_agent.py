"""End to end with a real agent process: spans in, decisions, commands by webhook, the run goes on.

Real processes: a ``spanvisor run`` sidecar (one for the module), one process
of the example agent ``examples/webhook_agent.py`` per scenario (the ``openai``
SDK instrumented with ``opentelemetry-instrumentation-openai-v2``, exporting
OTLP/HTTP to the sidecar, taking commands on a signed webhook) and the
``spanvisor`` CLI that approves; in this process, a fake OpenAI-compatible
provider behind a :class:`FaultSchedule` injects the faults by model and by
what is asked, over real HTTP on loopback.

Each scenario runs its own agent process under its own service name (each
with its webhook in the sidecar's settings) and its own primary model, so
breakers of one scenario do not see another's calls:

* transient (``gpt-4.1-mini``): a 429 with ``retry-after: 1`` right after step
  0 sent its e-mail, then a burst of two 503s after step 1's; retried after
  the advised delays, the run completes;
* auth (``gpt-4.1``): a 401 in step 1 is escalated; the run pauses, the test
  approves with the CLI, ``approval_result`` reaches the agent, the run
  resumes and completes;
* outage (``gpt-4o``): the model's next four requests fail with 503; its
  breaker opens, runs move to ``gpt-4o-mini``; later runs try the primary
  again and, after the reset timeout, their successes half-open and close
  the breaker;
* and no e-mail is sent twice though steps were replayed (the agent's effects
  file, keyed by run id and step, is counted).

The scenario fixtures run the processes and collect what happened; the tests
only assert, each with the agent's summary and the sidecar's log tail on failure.
"""

from __future__ import annotations

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

import httpx
import pytest

from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import (
    FaultSchedule,
    Matcher,
    ProviderRequest,
    tool_then_text,
)
from supervisor.testing.sidecar_process import (
    SidecarProcess,
    free_port,
    stop_process,
    tail,
    wait_until,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "webhook_agent.py"
SECRET = "e2e-webhook-secret-0123456789"
TOKEN = "e2e-api-token-0123456789"
SERVICES = {"transient": "e2e-transient", "auth": "e2e-auth", "outage": "e2e-outage"}
#: The outage scenario's breaker (kept in step with POLICY below).
RESET_TIMEOUT_S = 1.5

POLICY = f"""\
version: 1
policies:
  # A 401 will not fix itself: a person rotates the key and approves the retry.
  - name: e2e.auth_needs_a_person
    match: {{kind: auth}}
    action: escalate
  # The server's retry-after (1 s in the test) is the floor of the delay.
  - name: e2e.rate_limit
    match: {{kind: rate_limit}}
    action: retry
    max_attempts: 4
    wait: {{type: fixed, seconds: 0.1}}
    honour_retry_after: true
    max_retry_after_s: 5
  # 503s: retry soon; the chain is where an open breaker sends the run.
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
    "openai:gpt-4o": {{fail_max: 3, reset_timeout_s: {RESET_TIMEOUT_S}, success_threshold: 2}}
retry_budget: {{ratio: 0.5, min_retries: 20, window_s: 10}}
restart_intensity: {{max_actions: 10, period_s: 60}}
# The fake provider gives every step the same answer, which is what a reasoning
# loop looks like to the run detectors; these scenarios are about other failures.
detectors: {{loops: {{enabled: false}}}}
"""

# -- the sidecar and the fake provider ----------------------------------------------------


class Sidecar(SidecarProcess):
    def breaker_changes(self, dependency: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.log_events()
            if e.get("event") == "breaker" and e.get("dependency") == dependency
        ]


@dataclass
class Stack:
    fake: FaultSchedule
    sidecar: Sidecar
    tmp: Path
    webhook_ports: dict[str, int]


def _answer_text(request: ProviderRequest) -> str:
    return f"Told the on-call team ({request.last_user_text[:40]})."


def _email(request: ProviderRequest) -> dict[str, Any]:
    return {"to": "oncall@example.com", "subject": request.last_user_text[:60]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e-agent")
    fake = FaultSchedule(answer=tool_then_text("send_email", _email, _answer_text)).start()
    ports = {name: free_port() for name in SERVICES}
    settings = {
        "api_token": TOKEN,
        "drain_timeout_s": 5,
        "agents": {
            service: {
                "webhook": {
                    "url": f"http://127.0.0.1:{ports[name]}/commands",
                    "secret": SECRET,
                    "timeout_s": 2,
                },
                "max_attempts": 5,
            }
            for name, service in SERVICES.items()
        },
    }
    try:
        with Sidecar(settings, tmp, policy=POLICY) as sidecar:
            yield Stack(fake, sidecar, tmp, ports)
    finally:
        fake.stop()


# -- agent processes ----------------------------------------------------------------------


@dataclass
class AgentRun:
    """One agent process and what it left behind."""

    scenario: str
    port: int
    process: subprocess.Popen[bytes]
    summary_path: Path
    effects_path: Path
    log_path: Path
    returncode: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    effects: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def status(self) -> list[dict[str, Any]]:
        """The agent's ``GET /status``: what each run is doing now."""
        try:
            answer = httpx.get(f"http://127.0.0.1:{self.port}/status", timeout=1, trust_env=False)
            runs: list[dict[str, Any]] = answer.json()["runs"]
            return runs
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def finish(self, timeout_s: float) -> AgentRun:
        """Wait for the agent to exit (stop it after ``timeout_s``) and read what it wrote."""
        try:
            self.returncode = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.notes["timed_out"] = f"still running after {timeout_s:g}s: stopped"
        finally:
            self.stop()
        if self.summary_path.exists():
            self.summary = json.loads(self.summary_path.read_text(encoding="utf-8"))
        if self.effects_path.exists():
            lines = self.effects_path.read_text(encoding="utf-8").splitlines()
            self.effects = [json.loads(line) for line in lines if line.strip()]
        return self

    def stop(self) -> None:
        """SIGTERM (the agent writes its summary on the way out), then kill; bounded."""
        code = stop_process(self.process, 5)
        if self.returncode is None:
            self.returncode = code

    def runs(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.summary.get("runs", [])
        return found


def start_agent(
    stack: Stack,
    scenario: str,
    *,
    model: str,
    runs: int,
    steps: int,
    run_gap_s: float = 0.0,
) -> AgentRun:
    folder = stack.tmp / scenario
    folder.mkdir()
    summary, effects, log_path = folder / "summary.json", folder / "effects.jsonl", folder / "log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))},
        "OPENAI_BASE_URL": stack.fake.base_url,
        "OPENAI_API_KEY": "sk-fake",
        "OTEL_EXPORTER_OTLP_ENDPOINT": stack.sidecar.otlp_endpoint,
        "OTEL_SERVICE_NAME": SERVICES[scenario],
        "AGENT_WEBHOOK_SECRET": SECRET,
    }
    argv = [
        sys.executable,
        str(AGENT),
        f"--model={model}",
        f"--runs={runs}",
        f"--steps={steps}",
        f"--run-prefix={scenario}",
        f"--run-gap-s={run_gap_s}",
        f"--webhook-port={stack.webhook_ports[scenario]}",
        f"--effects={effects}",
        f"--summary={summary}",
        "--command-timeout-s=15",
        "--pause-timeout-s=30",
        "--run-timeout-s=45",
        "--llm-timeout-s=5",
        "--export-delay-ms=50",
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return AgentRun(scenario, stack.webhook_ports[scenario], process, summary, effects, log_path)


def diagnostics(stack: Stack, agent: AgentRun) -> str:
    served = [
        f"#{s.request.number} {s.request.model} {s.request.last_role}->{s.status} {s.fault}"
        for s in stack.fake.served
        if s.request.model
    ]
    return "\n".join(
        [
            f"--- agent {agent.scenario}: exit {agent.returncode}, notes {agent.notes}",
            tail(agent.log_path, 60),
            "--- agent summary",
            json.dumps(agent.summary, indent=1)[:6000],
            "--- fake provider (last 40 requests)",
            "\n".join(served[-40:]),
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


def in_step(scenario: str, step: int, model: str, last_role: str) -> Matcher:
    """Matches the requests of one step of the scenario's first run, at one point of it."""
    marker = f"Step {step} of run {scenario}-1:"

    def matches(request: ProviderRequest) -> bool:
        return (
            request.model == model
            and request.last_user_text.startswith(marker)
            and request.last_role == last_role
        )

    return matches


# -- the scenarios (processes run here; tests below only assert) --------------------------


@pytest.fixture(scope="module")
def transient(stack: Stack) -> AgentRun:
    model = "gpt-4.1-mini"
    # After step 0's tool result (the e-mail is sent): one 429 asking for 1 s.
    stack.fake.burst(
        Reply.rate_limited(retry_after_s=1.0, model=model),
        model=model,
        when=in_step("transient", 0, model, "tool"),
        name="429-after-email",
    )
    # After step 1's tool result: a burst of two 503s.
    stack.fake.burst(
        Reply.server_error(503),
        count=2,
        model=model,
        when=in_step("transient", 1, model, "tool"),
        name="503-burst",
    )
    agent = start_agent(stack, "transient", model=model, runs=1, steps=3)
    return agent.finish(timeout_s=40)


@pytest.fixture(scope="module")
def auth(stack: Stack) -> AgentRun:
    model = "gpt-4.1"
    stack.fake.burst(
        Reply.unauthorized(), model=model, when=in_step("auth", 1, model, "user"), name="401"
    )
    agent = start_agent(stack, "auth", model=model, runs=1, steps=2)
    service = SERVICES["auth"]
    try:
        with explained(stack, agent):

            def pending() -> dict[str, Any] | None:
                found = stack.sidecar.get("/v1/approvals", status="pending")["approvals"]
                return next((a for a in found if a["service"] == service), None)

            approval = wait_until(pending, 20, "an approval request for the 401")
            agent.notes["approval"] = approval
            agent.notes["status_before"] = wait_until(
                lambda: [r for r in agent.status() if r["state"] == "paused"],
                10,
                "the agent to say its run is paused",
            )
            agent.notes["requests_before_approval"] = sum(
                1 for s in stack.fake.served if s.request.model == model
            )
            cli = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "supervisor.cli",
                    "approvals",
                    "approve",
                    approval["id"],
                    "--api",
                    stack.sidecar.api,
                    "--token",
                    TOKEN,
                    "--by",
                    "e2e-test",
                    "--note",
                    "API key rotated",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            agent.notes["cli"] = (cli.returncode, cli.stdout.strip(), cli.stderr.strip())
    finally:
        agent.finish(timeout_s=30)
    return agent


@dataclass
class OutageRun:
    agent: AgentRun
    #: Breaker states the test saw in ``GET /v1/breakers``: while watching, then at the end.
    states_seen: list[str]
    outage_end_wall: float | None
    outage_hits: int


def _gpt4o_breaker(stack: Stack) -> str:
    found = stack.sidecar.get("/v1/breakers")["breakers"]
    return next((b["state"] for b in found if b["dependency"] == "openai:gpt-4o"), "closed")


@pytest.fixture(scope="module")
def outage(stack: Stack) -> OutageRun:
    down = stack.fake.outage("gpt-4o", requests=4, name="gpt-4o-outage")
    # Six runs 0.4 s apart: the first meets the outage and trips the breaker, the
    # second meets it open, the later ones find gpt-4o back; the last starts more
    # than the reset timeout after the breaker opened, so its calls are trials.
    agent = start_agent(stack, "outage", model="gpt-4o", runs=6, steps=2, run_gap_s=0.4)
    states: list[str] = []
    deadline = time.monotonic() + 45
    try:
        # Watch the breaker, as an operator's dashboard would, until it opens; then
        # stop looking, so that only the agent's own calls move it on (reading an
        # open breaker after its reset timeout would half-open it).
        while agent.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                state = _gpt4o_breaker(stack)
                if not states or states[-1] != state:
                    states.append(state)
                if state == "open":
                    break
            time.sleep(0.05)
    finally:
        agent.finish(timeout_s=max(1.0, deadline - time.monotonic()))
    states.append(_gpt4o_breaker(stack))
    hits = [s.request.wall for s in stack.fake.served if s.fault == "gpt-4o-outage"]
    return OutageRun(agent, states, max(hits) if hits else None, down.hits)


# -- (a) transient failures -----------------------------------------------------------------


def test_transient_failures_are_retried_after_the_advised_delay_and_the_run_completes(
    stack: Stack, transient: AgentRun
) -> None:
    with explained(stack, transient):
        assert transient.returncode == 0
        [run] = transient.runs()
        assert (run["status"], run["models_used"]) == ("completed", ["gpt-4.1-mini"])
        assert [(f["step"], f["status_code"]) for f in run["failures"]] == [
            (0, 429),
            (1, 503),
            (1, 503),
        ]
        assert [s["attempts"] for s in run["steps"]] == [2, 3, 1]
        commands = run["commands"]
        assert [(c["type"], c["acted"]) for c in commands] == [("retry_step", "retried")] * 3

        rate_limited, *unavailable = commands
        # The server asked for 1 s: the sidecar kept the command until then.
        assert rate_limited["failure_kind"] == "rate_limit"
        assert rate_limited["params"]["retry_after_s"] == 1
        assert rate_limited["params"]["delay_s"] == 1.0
        assert 1.0 <= rate_limited["after_failure_s"] < 4.0
        for retry in unavailable:
            assert retry["failure_kind"] == "unavailable"
            assert retry["params"]["delay_s"] == 0.2
            assert 0.2 <= retry["after_failure_s"] < 3.0

        service = SERVICES["transient"]
        log = stack.sidecar.get("/v1/commands/log", service=service)["commands"]
        assert sorted((c["type"], c["status"]) for c in log) == [("retry_step", "delivered")] * 3
        incidents = [
            i for i in stack.sidecar.get("/v1/incidents")["incidents"] if i["service"] == service
        ]
        assert sorted((i["kind"], i["action"], i["dependency"]) for i in incidents) == [
            ("rate_limit", "retry", "openai:gpt-4.1-mini"),
            ("unavailable", "retry", "openai:gpt-4.1-mini"),
            ("unavailable", "retry", "openai:gpt-4.1-mini"),
        ]
        assert {i["run_id"] for i in incidents} == {run["run_id"]}
        assert transient.summary["webhook"]["rejected"] == 0


# -- (b) a permanent failure, approved by a person ---------------------------------------------


def test_a_permanent_failure_is_escalated_approved_with_the_cli_and_the_run_resumes(
    stack: Stack, auth: AgentRun
) -> None:
    with explained(stack, auth):
        approval = auth.notes["approval"]
        assert approval["what"]["kind"] == "auth"
        assert approval["proposal"]["command"] == "retry_step"
        returncode, stdout, stderr = auth.notes["cli"]
        assert (returncode, stderr) == (0, "")
        assert stdout == f"{approval['id']}: approved by e2e-test"

        assert auth.returncode == 0
        [run] = auth.runs()
        assert run["status"] == "completed"
        assert run["run_id"] == approval["run_id"]
        assert [(f["step"], f["status_code"]) for f in run["failures"]] == [(1, 401)]
        pause, result = run["commands"]
        assert (pause["type"], pause["params"]["awaiting"]) == ("pause_run", "approval")
        assert (result["type"], result["params"]["approved"], result["acted"]) == (
            "approval_result",
            True,
            "retried",
        )
        [answered] = [
            a for a in stack.sidecar.get("/v1/approvals")["approvals"] if a["id"] == approval["id"]
        ]
        assert (answered["status"], answered["answered_by"], answered["note"]) == (
            "approved",
            "e2e-test",
            "API key rotated",
        )
        # The run waited for the person: the answer reached it after the approval
        # (the sidecar's clock; the agent's wall time is rounded to ms), and
        # nothing was asked of the model in between.
        assert result["received_wall"] >= answered["answered_at"] - 0.01
        requests = [s for s in stack.fake.served if s.request.model == "gpt-4.1"]
        after_401 = [s for s in requests if s.request.number > _number_of(requests, "401")]
        assert after_401
        assert all(s.request.wall >= result["received_wall"] - 0.01 for s in after_401)
        assert len(requests) - len(after_401) == auth.notes["requests_before_approval"]
        assert [s["attempts"] for s in run["steps"]] == [1, 2]
        log = stack.sidecar.get("/v1/commands/log", service=SERVICES["auth"])["commands"]
        assert sorted((c["type"], c["status"]) for c in log) == [
            ("approval_result", "delivered"),
            ("pause_run", "delivered"),
        ]


def _number_of(served: list[Any], fault: str) -> int:
    [found] = [s.request.number for s in served if s.fault == fault]
    return int(found)


# -- (c) an outage, the breaker and the fallback ------------------------------------------------


def test_an_outage_opens_the_breaker_moves_runs_to_the_fallback_then_the_breaker_closes(
    stack: Stack, outage: OutageRun
) -> None:
    agent = outage.agent
    with explained(stack, agent):
        assert agent.returncode == 0
        runs = agent.runs()
        assert [r["status"] for r in runs] == ["completed"] * 6
        assert outage.outage_hits == 4

        # Run 1 meets the outage: two retries, then the third failure trips the
        # breaker and the decision becomes a fallback; the rest of the run is on mini.
        first = runs[0]
        assert [(c["type"], c["acted"]) for c in first["commands"]] == [
            ("retry_step", "retried"),
            ("retry_step", "retried"),
            ("switch_fallback", "switched"),
        ]
        switch = first["commands"][-1]
        assert (switch["params"]["to"], switch["params"]["breaker"]) == (
            "openai:gpt-4o-mini",
            "open",
        )
        assert [s["models"] for s in first["steps"]] == [["gpt-4o", "gpt-4o-mini"], ["gpt-4o-mini"]]

        # Run 2 starts on gpt-4o again, fails once, and is sent to mini at once.
        second = runs[1]
        assert [(c["type"], c["params"].get("to")) for c in second["commands"]] == [
            ("switch_fallback", "openai:gpt-4o-mini")
        ]
        # No retry first and no backoff: a fallback command is due at once.
        assert second["commands"][0]["after_failure_s"] < 3.0
        assert second["models_used"] == ["gpt-4o", "gpt-4o-mini"]
        assert [s["model"] for s in second["steps"]] == ["gpt-4o-mini", "gpt-4o-mini"]

        # The provider is back: later runs stay on the primary model.
        for later in runs[2:]:
            assert (later["models_used"], later["failures"]) == (["gpt-4o"], [])

        # The breaker: opened by failures, half-opened after the reset timeout,
        # closed by the trial calls that succeeded after the outage.
        # (A run slowed down enough to meet the outage after the reset timeout
        # would add a failed trial: half_open -> open, then a new reset timeout.)
        changes = stack.sidecar.breaker_changes("openai:gpt-4o")
        moves = [(c["from"], c["to"], c["reason"]) for c in changes]
        assert moves[0] == ("closed", "open", "failures")
        assert moves[-2:] == [
            ("open", "half_open", "reset_timeout"),
            ("half_open", "closed", "trial_succeeded"),
        ]
        assert set(moves[1:-2]) <= {
            ("open", "half_open", "reset_timeout"),
            ("half_open", "open", "trial_failed"),
        }
        opened, half_opened, closed = changes[-3]["ts"], changes[-2]["ts"], changes[-1]["ts"]
        assert half_opened - opened >= RESET_TIMEOUT_S - 0.01
        assert outage.outage_end_wall is not None
        assert closed > outage.outage_end_wall
        assert outage.states_seen[-2:] == ["open", "closed"]
        [breaker] = [
            b
            for b in stack.sidecar.get("/v1/breakers")["breakers"]
            if b["dependency"] == "openai:gpt-4o"
        ]
        assert (breaker["state"], breaker["failures"]) == ("closed", 0)
        assert stack.sidecar.get("/v1/stats")["breakers"]["changes"] >= 3

        service = SERVICES["outage"]
        incidents = [
            i for i in stack.sidecar.get("/v1/incidents")["incidents"] if i["service"] == service
        ]
        assert sorted((i["kind"], i["action"]) for i in incidents) == [
            ("unavailable", "fallback"),
            ("unavailable", "fallback"),
            ("unavailable", "retry"),
            ("unavailable", "retry"),
        ]


# -- (d) side effects happen once ---------------------------------------------------------------


def test_no_side_effect_happens_twice_although_steps_were_replayed(
    stack: Stack, transient: AgentRun, auth: AgentRun, outage: OutageRun
) -> None:
    for agent, replays in ((transient, 3), (auth, 0), (outage.agent, 0)):
        with explained(stack, agent):
            steps = [s for run in agent.runs() for s in run["steps"]]
            expected = {
                f"{run['run_id']}/step-{s['step']}/send_email"
                for run in agent.runs()
                for s in run["steps"]
            }
            counts = Counter(record["key"] for record in agent.effects)
            assert set(counts) == expected
            assert set(counts.values()) == {1}
            assert len(steps) == len(expected)
            # Replayed steps ran the tool again and were recognised, not sent again.
            assert agent.summary["effects"]["deduplicated"] == replays
            assert agent.summary["effects"]["sent"] == len(expected)
            replayed = [e for s in steps for e in s["effects"] if not e["first_time"]]
            assert len(replayed) == replays
