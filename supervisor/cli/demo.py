"""``spanvisor demo``: a sidecar, two LangGraph agents and a faulty provider, live.

Everything runs on this machine, on loopback, on free ports, with its state in
a temporary directory removed at the end (``--keep`` keeps it):

* the sidecar, in this process (:class:`~supervisor.app.BackgroundSidecar`),
  with the built-in policy and a small demo policy on top of it;
* a fake OpenAI-compatible provider (:class:`FaultSchedule` in front of
  :class:`FakeProvider`), whose model calls the agents' tools and answers, and
  whose faults follow the story below;
* two processes of the LangGraph example agent (``examples/langgraph_agent.py``:
  SQLite checkpoints, OpenInference spans over OTLP, an effect ledger,
  commands by pull), ``ops-agent`` on ``gpt-4o`` and ``billing-agent`` on
  ``gpt-4.1-mini``, each running its threads (runs) of three steps.

The story, in the order it happens (both agents run at once):

* ``ops-1``: a 429 with ``retry-after`` and two 503s, retried after the wait;
* ``ops-2``: ``gpt-4o`` goes down; two retries, its breaker opens, the run
  switches to ``gpt-4o-mini``; ``ops-3`` starts on ``gpt-4o``, its call fails
  (a failed trial, when the breaker has gone half-open) and it switches at once:
  the breaker is every run's;
* ``ops-3``: the model calls the same tool with the same arguments over and
  over: the loop breaker sends guidance, then rewinds the run;
* ``ops-4``: ``gpt-4o`` is back; the breaker's trial calls close it;
* ``billing-1``: the agent is killed with SIGKILL right after a side effect
  (an e-mail sent, its tool span never ended) and started again with
  ``--resume``; the stall detector sends ``resume_run`` naming the unverified
  call, the ledger keeps the e-mail from going out twice; then a refund above
  the approval limit waits in LangGraph's ``interrupt()``, the sidecar
  escalates it and the demo approves it with ``spanvisor approvals approve``,
  as an operator would;
* ``billing-2``: a 401: permanent, the run is aborted.

The view (:mod:`supervisor.cli.demo_view`) reads the control API as an operator
would. The demo exits 0 when every part of the story happened, else 1 with
what did not; everything is bounded by one deadline and cleaned up on any exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.cli.demo_view import (
    Event,
    Facts,
    LineView,
    LiveView,
    Screen,
    Seen,
    View,
    Watcher,
    clean,
    summary,
)
from supervisor.forward.downstream import Downstream
from supervisor.logs import JsonFormatter
from supervisor.settings import load_settings
from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import Fault, FaultSchedule, Matcher, ProviderRequest
from supervisor.wiring import build_sidecar, resolve_downstream

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "langgraph_agent.py"

OPS, BILLING = "ops-agent", "billing-agent"
OPS_PREFIX, BILLING_PREFIX = "ops", "billing"
PRIMARY, FALLBACK, BILLING_MODEL = "gpt-4o", "gpt-4o-mini", "gpt-4.1-mini"
STEPS = 3
#: The story's runs: ops-1..4 and billing-1..2; ``--runs`` adds ops runs beyond these.
STORY_OPS_RUNS, BILLING_RUNS = 4, 2
MIN_RUNS = STORY_OPS_RUNS + BILLING_RUNS
MAX_RUNS = 20
#: The billing agent is killed right after its N-th side effect (billing-1's second e-mail).
CRASH_AFTER_EFFECTS = 2
REFUND_STEP, REFUND_AMOUNT = 2, 250
OPERATOR = "demo-operator"
OPERATOR_NOTE = "refund checked against the order"
#: Everything is over by then, or the demo says what did not happen.
DEADLINE_S = 150.0
#: A pause between an agent's runs, so that a person can follow the story.
RUN_GAP_S = 3.0
#: Most a finished span waits in the agent before it is exported.
EXPORT_DELAY_MS = 500
#: How long stopping agents that still run may take before they are killed.
STOP_GRACE_S = 8.0
#: Between redraws of the live screen and between polls of the API.
TICK_S = 0.5
#: After both agents have ended: how long the sidecar may take to finish what follows.
SETTLE_S = 15.0
#: How long the fake model takes to answer: a pace a person can follow (and a loop
#: slow enough for the sidecar to step in before LangGraph's recursion limit).
MODEL_DELAY_S = 0.6

_STEP = re.compile(r"Step (\d{1,4}) of ([A-Za-z0-9_.-]{1,64}):")
_REFUND = re.compile(r"refund order (\S{1,80}) \((\d{1,9}(?:\.\d{1,4})?) EUR\)")


# -- the fake model ---------------------------------------------------------------------------


def step_text(request: ProviderRequest) -> str:
    """The last turn the agent wrote (not a note from the supervisor)."""
    for message in reversed(request.messages):
        if message.get("role") == "user" and message.get("name") != "spanvisor":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def step_of(request: ProviderRequest) -> tuple[str, int] | None:
    """(run, step) the request belongs to, from the agent's step message."""
    found = _STEP.search(step_text(request))
    return (found.group(2), int(found.group(1))) if found else None


def _run_number(run: str, prefix: str) -> int:
    head, _, number = run.rpartition("-")
    return int(number) if head == prefix and number.isdigit() else 0


def _has_note(request: ProviderRequest, kind: str) -> bool:
    marker = f"[spanvisor {kind}]"
    return any(
        m.get("name") == "spanvisor" and marker in str(m.get("content")) for m in request.messages
    )


class DemoModel:
    """The fake provider's model: one tool call per step, then a sentence saying it is done.

    ``loop`` names the (run, step) where it is stubborn: it calls the same tool
    with the same arguments again and again, guidance or not, until a rewind
    note tells it the approach failed. Its answers differ from step to step,
    as a real model's do, so only the scripted loop looks like one.
    """

    def __init__(self, loop: tuple[str, int]) -> None:
        self.loop = loop

    def __call__(self, request: ProviderRequest) -> Reply:
        where = step_of(request)
        run, step = where if where is not None else ("?", -1)
        last = request.messages[-1] if request.messages else {}
        if where == self.loop and not _has_note(request, "rewind"):
            # The same call whatever came back: a model going round in circles.
            arguments = {"to": "oncall@example.com", "subject": f"{run}: is item {step} done?"}
            return _slow(Reply.tool_call("send_email", arguments))
        asks = last.get("role") == "user" and last.get("name") != "spanvisor"
        if asks and request.offers_tool("send_email"):
            refund = _REFUND.search(step_text(request))
            if refund is not None and request.offers_tool("issue_refund"):
                refunded = {"order": refund.group(1), "amount": float(refund.group(2))}
                return _slow(Reply.tool_call("issue_refund", refunded))
            arguments = {"to": "oncall@example.com", "subject": f"{run}: item {step}"}
            return _slow(Reply.tool_call("send_email", arguments))
        result = str(last.get("content", "")) if last.get("role") == "tool" else ""
        if "already_sent" in result:
            done = "the e-mail had already gone out, so it was not sent again"
        elif "refunded" in result:
            done = "the refund is issued"
        elif "sent" in result:
            done = "the on-call team has the e-mail"
        elif _has_note(request, "rewind"):
            done = "the e-mail went out on the first try; I stop asking"
        else:
            done = "nothing more to do"
        return _slow(Reply.text(f"Step {step} of {run} is done: {done}."))


def _slow(reply: Reply) -> Reply:
    return dataclasses.replace(reply, delay_s=MODEL_DELAY_S)


class Outage:
    """``gpt-4o`` down: from ops-2's second step until ops-4 starts (a fault matcher).

    Called by the schedule under its lock for each ``gpt-4o`` request; records
    when the outage began and ended (``time.monotonic()``) and what it took.
    """

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.by_run: Counter[str] = Counter()

    def __call__(self, request: ProviderRequest) -> bool:
        if self.ended_at is not None:
            return False
        where = step_of(request)
        if self.started_at is None:
            if where != (f"{OPS_PREFIX}-2", 1):
                return False
            self.started_at = request.at
        elif where is not None and _run_number(where[0], OPS_PREFIX) >= STORY_OPS_RUNS:
            self.ended_at = request.at  # ops-4 finds gpt-4o answering again
            return False
        self.by_run[where[0] if where else "?"] += 1
        return True


def in_step(run: str, step: int, last_role: str) -> Matcher:
    """A fault matcher: requests of ``run``'s ``step`` whose last message has ``last_role``."""

    def matches(request: ProviderRequest) -> bool:
        return step_of(request) == (run, step) and request.last_role == last_role

    return matches


def schedule_faults(fake: FaultSchedule, *, ops_runs: int, seed: int) -> tuple[Outage, Fault]:
    """The story's faults (see the module), and seeded transient ones in any extra runs."""
    fake.burst(
        Reply.rate_limited(retry_after_s=1.5, model=PRIMARY),
        model=PRIMARY,
        when=in_step(f"{OPS_PREFIX}-1", 0, "tool"),
        name="429 rate limit",
    )
    fake.burst(
        Reply.server_error(503),
        2,
        model=PRIMARY,
        when=in_step(f"{OPS_PREFIX}-1", 1, "user"),
        name="503 unavailable",
    )
    outage = Outage()
    fault = fake.outage(PRIMARY, when=outage, start="first_request", name="gpt-4o outage")
    fake.burst(
        Reply.unauthorized(),
        model=BILLING_MODEL,
        when=in_step(f"{BILLING_PREFIX}-2", 1, "user"),
        name="401 unauthorized",
    )
    rng = random.Random(seed)  # noqa: S311 - which faults, not secrets
    for number in range(STORY_OPS_RUNS + 1, ops_runs + 1):
        pick = rng.choice(("none", "429", "503"))
        if pick == "none":
            continue
        reply = (
            Reply.rate_limited(retry_after_s=1.0, model=PRIMARY)
            if pick == "429"
            else Reply.server_error(503)
        )
        run, step = f"{OPS_PREFIX}-{number}", rng.randrange(STEPS)
        fake.burst(reply, model=PRIMARY, when=in_step(run, step, "user"), name=f"{pick} (seeded)")
    return outage, fault


# -- the demo's policy ------------------------------------------------------------------------

POLICY = f"""\
# spanvisor demo: layered on the built-in policy. Only what this deployment needs;
# the demo compresses minutes into seconds, hence the short breaker and stall times.
# (LangGraph's interrupt() is the built-in policy's: builtin.langgraph.interrupt escalates it.)
version: 1
policies:
  # gpt-4o down: retry with backoff, then its fallback chain (the built-in has none).
  - name: demo.primary_unavailable
    match: {{kind: [timeout, connection, unavailable], dependency: "openai:{PRIMARY}"}}
    action: retry
    max_attempts: 4
    wait: {{type: exponential, multiplier: 0.25, max: 2, jitter: full}}
    honour_retry_after: true
    max_retry_after_s: 10
    on_exhausted:
      action: fallback
      chain: {{"openai:{PRIMARY}": ["openai:{PRIMARY}", "openai:{FALLBACK}"]}}
      on_exhausted: escalate
breakers:
  dependencies:
    "openai:{PRIMARY}": {{fail_max: 3, reset_timeout_s: 2}}
# A handful of retries in a few seconds is the demo's normal, not a retry storm.
retry_budget: {{ratio: 0.5, min_retries: 10, window_s: 10}}
detectors:
  services:
    # A crashed billing agent is noticed within seconds (the default is 10 minutes).
    {BILLING}: {{stalls: {{idle_seconds: 3}}}}
"""


# -- agent processes --------------------------------------------------------------------------


@dataclass
class AgentProcess:
    """One process of the example agent: its argv, its log, its JSON summary."""

    service: str
    label: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    summary_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log_offset: int = 0
    _partial: bytes = b""

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log_file:
            # A session of its own: Ctrl-C reaches the demo, which stops the agent itself.
            self.process = subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def terminate(self) -> None:
        """SIGTERM: the agent stops its threads and writes its summary."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the agent to exit, then SIGKILL it; bounded."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)

    def new_lines(self) -> list[str]:
        """Complete lines the agent logged since the last call (bounded per call)."""
        try:
            with self.log_path.open("rb") as log_file:
                log_file.seek(self._log_offset)
                chunk = log_file.read(256 * 1024)
        except OSError:
            return []
        self._log_offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > 64 * 1024:
            self._partial = b""
        return [line.decode("utf-8", "replace") for line in lines]

    def summary(self) -> dict[str, Any]:
        try:
            found = json.loads(self.summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


#: Lines of the agents' own logs worth showing, and the word for them.
_AGENT_LINES = (
    (re.compile(r"unverified after a restart; the ledger says"), "ledger"),
    (re.compile(r"thread \S+: (completed|aborted) in"), "agent"),
    (re.compile(r"fault injection: killed"), "agent"),
    (re.compile(r"waiting for a person's approval"), "agent"),
)


def _agent_events(agent: AgentProcess, at: float) -> list[Event]:
    events = []
    for line in agent.new_lines():
        text = line.removeprefix("langgraph-agent: ").strip()
        for pattern, kind in _AGENT_LINES:
            if pattern.search(text):
                run = (
                    text.split("thread ", 1)[1].split(" ", 1)[0].rstrip(":")
                    if "thread " in text
                    else ""
                )
                if kind == "ledger":
                    run = text.split("/", 1)[0]
                events.append(Event(at, kind, run, f"{agent.service}: {text}"))
                break
    return events


# -- the demo ---------------------------------------------------------------------------------


@dataclass
class Story:
    """What the demo saw with its own eyes (the watcher saw the rest)."""

    #: The first billing agent's exit code (-9: killed as planned); None while it runs.
    crash_code: int | None = None
    resumed: AgentProcess | None = None
    approved: list[str] = field(default_factory=list)
    approve_failed: list[str] = field(default_factory=list)
    #: Each run's model as the provider last saw it, and each model's requests by run.
    models_seen: dict[str, str] = field(default_factory=dict)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    steps: dict[str, str] = field(default_factory=dict)
    last_served: int = 0
    outage_told: int = 0
    deadline_hit: bool = False
    elapsed: float = 0.0


class Demo:
    """One run of the demo; see the module. Not reusable."""

    def __init__(self, *, runs: int, seed: int, live: bool, keep: bool, out: TextIO) -> None:
        self.ops_runs = runs - BILLING_RUNS
        self.seed = seed
        self.keep = keep
        self.out = out
        self.live = live
        self.view: View = LiveView(out) if live else LineView(out)
        self.story = Story()
        self.started = time.monotonic()
        self.agents: dict[str, AgentProcess] = {}
        self.first_billing: AgentProcess | None = None
        self.operator: tuple[str, subprocess.Popen[bytes]] | None = None
        self.fake: FaultSchedule | None = None
        self.answered: set[str] = set()
        self.tmp = Path()
        self.api = ""
        self.token = ""
        self.env: dict[str, str] = {}

    def clock(self) -> float:
        return time.monotonic() - self.started

    def say(self, kind: str, run: str, text: str) -> None:
        self.view.event(Event(self.clock(), kind, run, text))

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    # -- set-up and tear-down --------------------------------------------------------------

    def run(self) -> int:
        self.tmp = Path(tempfile.mkdtemp(prefix="spanvisor-demo-"))
        try:
            return self._run()
        finally:
            if self.keep:
                self.print(f"\nthe demo's state is kept in {self.tmp}")
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _run(self) -> int:
        tmp = self.tmp
        self.token = secrets.token_urlsafe(24)
        policy_path = tmp / "policy.yaml"
        policy_path.write_text(POLICY, encoding="utf-8")
        settings = load_settings(
            overrides={
                "host": "127.0.0.1",
                "api_host": "127.0.0.1",
                "otlp_grpc_port": 0,
                "otlp_http_port": 0,
                "api_port": 0,
                "api_token": self.token,
                "token_file": str(tmp / "api-token"),
                "state_path": str(tmp / "state.db"),
                "remediation_database_url": f"sqlite:///{tmp / 'remediations.sqlite'}",
                "policy": str(policy_path),
                "observe_only": False,
                "drain_timeout_s": 5,
                "log_level": "INFO",
                "agents": {
                    OPS: {"pull": {"visibility_s": 30}},
                    BILLING: {"pull": {"visibility_s": 30}},
                },
            }
        )
        _log_to(tmp / "sidecar.log")
        downstream = resolve_downstream(settings)
        fake = self.fake = FaultSchedule(answer=DemoModel(loop=(f"{OPS_PREFIX}-3", 1)))
        outage, fault = schedule_faults(fake, ops_runs=self.ops_runs, seed=self.seed)
        sidecar = BackgroundSidecar(
            build_sidecar(settings, load_policy(policy_path), downstream=downstream)
        )
        fake.start()
        problems: list[str] = []
        try:
            ports = sidecar.start()
            self.api = f"http://127.0.0.1:{ports.api}"
            self.env = _agent_env(fake.base_url, ports.otlp_http, self.token)
            with httpx.Client(
                base_url=self.api,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=5.0,
                trust_env=False,
            ) as client:
                watcher = Watcher(client, self.clock)
                self._preamble(ports.otlp_http, fake.base_url, downstream)
                try:
                    self._start_agents()
                    self._loop(watcher, fake, outage, fault, ports.otlp_http)
                finally:
                    self.view.close()
                    self._stop_processes()
                problems = self._check(watcher, outage)
                self._summary(watcher, outage, downstream)
        finally:
            self._stop_processes()
            sidecar.stop()
            fake.stop()
        if problems:
            self.print("\nspanvisor demo: the story did not go as expected:")
            for problem in problems:
                self.print(f"  - {clean(problem, 300)}")
            for agent in self._all_agents():
                self.print(f"--- the last lines of {agent.label}'s log:")
                self.print("\n".join(clean(line, 300) for line in agent.tail().splitlines()))
            return 1
        self.print(f"\nspanvisor demo: the story completed in {self.story.elapsed:.1f}s.")
        return 0

    def _all_agents(self) -> list[AgentProcess]:
        found = [a for a in (self.agents.get(OPS), self.first_billing) if a is not None]
        return [*found, *([self.story.resumed] if self.story.resumed is not None else [])]

    def _stop_processes(self) -> None:
        """Stop what still runs (an interruption, the deadline): all at once, bounded."""
        if self.operator is not None:
            _, process = self.operator
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)
        running = [agent for agent in self._all_agents() if agent.poll() is None]
        if running and self.fake is not None:
            # The provider first: a reply it is about to send would meet a closed socket.
            self.fake.stop()
        for agent in running:
            agent.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for agent in running:
            agent.wait_or_kill(max(0.1, deadline - time.monotonic()))

    def _preamble(self, http_port: int, base_url: str, downstream: Downstream | None) -> None:
        if self.live:
            return
        lines = [
            "spanvisor demo: a sidecar, two LangGraph agents and a fake LLM provider with faults",
            f"  sidecar   OTLP/HTTP 127.0.0.1:{http_port}, control API {self.api} (this process)",
            f"  provider  a fake OpenAI-compatible API at {base_url}",
            f"  agents    {OPS}: runs ops-1..ops-{self.ops_runs} on {PRIMARY} (fallback"
            f" {FALLBACK}); {BILLING}: runs billing-1..billing-{BILLING_RUNS} on {BILLING_MODEL};"
            f" {STEPS} steps a run",
            "  policy    the built-in one, plus a fallback chain, breaker and retry budget for"
            f" {PRIMARY} at the demo's time scale, and a 3 s stall time for {BILLING}",
            "  story     ops-1 429 + 503s | ops-2, ops-3 gpt-4o outage | ops-3 reasoning loop |"
            " ops-4 gpt-4o back | billing-1 SIGKILL, --resume, refund approval | billing-2 401",
        ]
        if downstream is not None:
            lines.insert(
                2, f"            forwarding every span, and its own, to {downstream.endpoint}"
            )
        for line in lines:
            for part in textwrap.wrap(line, 100, subsequent_indent=" " * 12) or [line]:
                self.print(part)
        self.print()

    def _start_agents(self) -> None:
        ops = self.agents[OPS] = self._agent(OPS, self.ops_runs, []).start()
        self.say("agent", "", f"{OPS} started (pid {ops.pid}): runs ops-1..ops-{self.ops_runs}")
        first = self._agent(BILLING, BILLING_RUNS, [f"--crash-after-effects={CRASH_AFTER_EFFECTS}"])
        self.first_billing = self.agents[BILLING] = first.start()
        self.say(
            "agent",
            "",
            f"{BILLING} started (pid {first.pid}): runs billing-1..billing-{BILLING_RUNS};"
            f" fault injection: SIGKILL right after its side effect #{CRASH_AFTER_EFFECTS}",
        )

    def _agent(
        self, service: str, runs: int, extra: list[str], *, resume: bool = False
    ) -> AgentProcess:
        name = OPS_PREFIX if service == OPS else BILLING_PREFIX
        folder = self.tmp / name
        folder.mkdir(exist_ok=True)
        suffix = "-resumed" if resume else ""
        summary = folder / f"summary{suffix}.json"
        argv = [
            sys.executable,
            str(AGENT),
            f"--service={service}",
            f"--model={PRIMARY if service == OPS else BILLING_MODEL}",
            f"--runs={runs}",
            f"--steps={STEPS}",
            f"--run-prefix={name}",
            f"--run-gap-s={RUN_GAP_S}",
            f"--checkpoints={folder / 'checkpoints.sqlite'}",
            f"--effects={folder / 'effects.jsonl'}",
            f"--summary={summary}",
            f"--api={self.api}",
            f"--refund-step={REFUND_STEP if service == BILLING else -1}",
            f"--refund-amount={REFUND_AMOUNT}",
            "--command-timeout-s=20",
            "--pause-timeout-s=60",
            "--run-timeout-s=100",
            "--llm-timeout-s=10",
            "--poll-wait-s=1",
            # Spans are exported within half a second (OTel's default is 5 s). Not sooner: a
            # command that reaches the agent while its failed step is still unwinding is
            # not applied (see the report on LangGraphAdapter's running threads).
            f"--export-delay-ms={EXPORT_DELAY_MS}",
            *extra,
            *(["--resume"] if resume else []),
        ]
        return AgentProcess(
            service,
            f"{service}{' (resumed)' if resume else ''}",
            argv,
            {**self.env, "OTEL_SERVICE_NAME": service},
            folder / f"log{suffix}.txt",
            summary,
        )

    # -- the loop -------------------------------------------------------------------------------

    def _loop(
        self, watcher: Watcher, fake: FaultSchedule, outage: Outage, fault: Fault, http_port: int
    ) -> None:
        deadline = self.started + DEADLINE_S
        settle_until: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                self.story.deadline_hit = True
                self.say("demo", "", f"the deadline ({DEADLINE_S:g}s) has passed: stopping")
                break
            self._gather(watcher, fake, outage, fault)
            self._operate(watcher)
            self._lifecycle()
            ended = self.story.crash_code is not None and all(
                a.poll() is not None for a in self._all_agents()
            )
            if ended and settle_until is None:
                settle_until = now + SETTLE_S
            if settle_until is not None and (_settled(watcher) or now >= settle_until):
                self._gather(watcher, fake, outage, fault)  # the last word of each
                break
            self.view.tick(self._screen(watcher, http_port))
            time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
        self.story.elapsed = self.clock()

    def _gather(self, watcher: Watcher, fake: FaultSchedule, outage: Outage, fault: Fault) -> None:
        """One round of news, causes first: the provider, the sidecar, then the agents."""
        self._outage_events(outage, fault)
        for event in watcher.poll():
            self.view.event(event)
        self._provider_events(fake)
        for agent in self._all_agents():
            for event in _agent_events(agent, self.clock()):
                self.view.event(event)

    def _screen(self, watcher: Watcher, http_port: int) -> Screen:
        states = []
        for agent in self._all_agents():
            code = agent.poll()
            state = "running" if code is None else "killed" if code < 0 else f"exit {code}"
            states.append(f"{agent.label} pid {agent.pid} {state}")
        return Screen(
            elapsed=self.clock(),
            title="spanvisor demo",
            lines=[
                f"sidecar OTLP/HTTP 127.0.0.1:{http_port}, control API {self.api}",
                f"agents  {'; '.join(states)}",
            ],
            runs=watcher.seen.runs,
            steps=self.story.steps,
            breakers=watcher.seen.breakers.values(),
        )

    def _outage_events(self, outage: Outage, fault: Fault) -> None:
        """The provider's outage beginning and ending (before what the sidecar made of it)."""
        story = self.story
        if outage.started_at is not None and story.outage_told == 0:
            story.outage_told = 1
            self.say("provider", "", f"{PRIMARY} is down: every request gets a 503")
        if outage.ended_at is not None and story.outage_told == 1:
            story.outage_told = 2
            length = outage.ended_at - (outage.started_at or outage.ended_at)
            self.say(
                "provider",
                "",
                f"{PRIMARY} is back after {length:.1f}s; {fault.hits} request(s) failed meanwhile",
            )

    def _provider_events(self, fake: FaultSchedule) -> None:
        """Each run's step and model as the provider sees them; a model change is an event."""
        story = self.story
        for served in fake.served:
            request = served.request
            if request.number <= story.last_served:
                continue
            story.last_served = request.number
            where = step_of(request)
            if where is None:
                continue
            run, step = where
            story.steps[run] = f"{step + 1}/{STEPS}"
            story.requests[(request.model, run)] += 1
            before = story.models_seen.get(run)
            story.models_seen[run] = request.model
            if before is not None and before != request.model:
                self.say("provider", run, f"now asked for {request.model} (was {before})")

    def _operate(self, watcher: Watcher) -> None:
        """The operator: approves each refund the sidecar escalates, with the CLI, one at a time."""
        if self.operator is not None:
            approval_id, process = self.operator
            code = process.poll()
            if code is None:
                return
            self.operator = None
            output = (process.stdout.read() if process.stdout else b"").decode("utf-8", "replace")
            if code == 0:
                self.story.approved.append(approval_id)
                self.say("operator", "", output.strip() or f"{approval_id}: approved")
            else:
                self.story.approve_failed.append(approval_id)
                self.say("operator", "", f"the CLI failed ({code}): {output.strip()}")
        for approval in watcher.seen.approvals.values():
            approval_id = str(approval.get("id", ""))
            what = approval.get("what")
            kind = what.get("kind") if isinstance(what, dict) else None
            if (
                approval.get("status") != "pending"
                or approval_id in self.answered
                or kind != "approval_required"
            ):
                continue
            self.answered.add(approval_id)
            args = ["approvals", "approve", approval_id, "--api", self.api]
            args += ["--by", OPERATOR, "--note", OPERATOR_NOTE]
            self.say(
                "operator",
                str(approval.get("run_id", "")),
                f"$ {shlex.join(['spanvisor', *args])}   (token in SPANVISOR_API_TOKEN)",
            )
            process = subprocess.Popen(  # noqa: S603 - our own CLI, a fixed argv
                [sys.executable, "-m", "supervisor.cli", *args],
                env={**self.env, "SPANVISOR_API_TOKEN": self.token},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.operator = (approval_id, process)
            return

    def _lifecycle(self) -> None:
        """Once the first billing agent has been killed, start it again with ``--resume``."""
        first = self.first_billing
        if first is None or self.story.crash_code is not None:
            return
        code = first.poll()
        if code is None:
            return
        self.story.crash_code = code
        if code != -signal.SIGKILL:
            self.say("agent", "", f"{BILLING} ended with {code} before it was killed")
            return
        self.say(
            "agent",
            f"{BILLING_PREFIX}-1",
            f"{BILLING} (pid {first.pid}) was killed by SIGKILL mid-step; starting it again"
            " with --resume, as an orchestrator would",
        )
        resumed = self.story.resumed = self._agent(BILLING, BILLING_RUNS, [], resume=True)
        self.agents[BILLING] = resumed.start()
        self.say("agent", "", f"{resumed.label} started (pid {resumed.pid})")

    # -- what happened -----------------------------------------------------------------------

    def _threads(self) -> dict[str, dict[str, Any]]:
        """Each run's report from the agents' summaries (the resumed process's for billing)."""
        found: dict[str, dict[str, Any]] = {}
        for agent in self._all_agents():
            for thread in agent.summary().get("threads", []):
                if isinstance(thread, dict) and isinstance(thread.get("thread_id"), str):
                    found[thread["thread_id"]] = thread
        return found

    def _ledgers(self) -> Counter[str]:
        """Side effects by key, in both agents' ledgers."""
        keys: Counter[str] = Counter()
        for name in (OPS_PREFIX, BILLING_PREFIX):
            path = self.tmp / name / "effects.jsonl"
            with contextlib.suppress(OSError):
                for line in path.read_text(encoding="utf-8").splitlines():
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        keys[str(json.loads(line)["key"])] += 1
        return keys

    def _check(self, watcher: Watcher, outage: Outage) -> list[str]:
        """Every part of the story that did not happen, in words (empty: it all did)."""
        problems: list[str] = []
        if self.story.deadline_hit:
            problems.append(f"the demo did not finish within its deadline of {DEADLINE_S:g}s")
        threads = self._threads()
        expected = {f"{OPS_PREFIX}-{n}": "completed" for n in range(1, self.ops_runs + 1)}
        expected |= {f"{BILLING_PREFIX}-1": "completed", f"{BILLING_PREFIX}-2": "aborted"}
        for run, status in expected.items():
            thread = threads.get(run)
            if thread is None:
                problems.append(f"{run} has no report: its agent did not finish")
            elif thread.get("status") != status:
                problems.append(
                    f"{run} {thread.get('status')} ({thread.get('reason') or '-'}),"
                    f" where it should have {status}"
                )
        problems += check_seen(watcher.seen)
        if outage.started_at is None:
            problems.append(f"the {PRIMARY} outage never began")
        if not self.story.requests.get((FALLBACK, f"{OPS_PREFIX}-2")):
            problems.append(f"the provider never saw {OPS_PREFIX}-2 ask for {FALLBACK}")
        if self.story.crash_code != -signal.SIGKILL:
            problems.append(
                f"the billing agent was not killed as planned ({self.story.crash_code})"
            )
        keys = self._ledgers()
        twice = sorted(k for k, n in keys.items() if n > 1)
        if twice:
            problems.append(f"side effects happened twice: {', '.join(twice)}")
        if keys.get(f"{BILLING_PREFIX}-1/step-1/send_email") != 1:
            problems.append("billing-1's e-mail of step 1 is not in the ledger exactly once")
        resumed = self.story.resumed.summary() if self.story.resumed is not None else {}
        if not (resumed.get("effects") or {}).get("deduplicated"):
            problems.append("the resumed billing agent's ledger refused no repeat")
        if not self.story.approved:
            problems.append("no refund was approved by the operator")
        if self.story.approve_failed:
            problems.append(f"approving failed for {', '.join(self.story.approve_failed)}")
        return problems

    def _summary(self, watcher: Watcher, outage: Outage, downstream: Downstream | None) -> None:
        """The summary (:func:`~supervisor.cli.demo_view.summary`) with what only the demo knows."""
        notes: dict[str, str] = {}
        if self.story.crash_code == -signal.SIGKILL:
            notes[f"{BILLING_PREFIX}-1"] = (
                "killed (SIGKILL) after its e-mail of step 1, restarted with --resume"
            )
        outage_line = ""
        if outage.started_at is not None:
            end = outage.ended_at if outage.ended_at is not None else time.monotonic()
            by_run = ", ".join(f"{run} {n}" for run, n in sorted(outage.by_run.items()))
            fallback = sum(n for (model, _), n in self.story.requests.items() if model == FALLBACK)
            outage_line = (
                f"{PRIMARY} down {end - outage.started_at:.1f}s: {sum(outage.by_run.values())}"
                f" calls reached it and failed ({by_run}); {fallback} calls went to"
                f" {FALLBACK} instead"
            )
        keys = self._ledgers()
        refused = {
            agent.label: agent.summary().get("effects", {}).get("deduplicated", 0)
            for agent in self._all_agents()
            if agent.summary()
        }
        duplicated = sum(n - 1 for n in keys.values() if n > 1)
        effects_line = (
            f"{sum(keys.values())} executed, {duplicated} duplicated; the effect ledgers refused"
            f" {sum(refused.values())} repeat(s): "
            + ", ".join(f"{label} {n}" for label, n in refused.items())
            + " (the loop's calls; the e-mail the crash left unverified)"
        )
        order = {OPS_PREFIX: 0, BILLING_PREFIX: 1}
        for line in summary(
            watcher.seen,
            Facts(
                elapsed=self.story.elapsed,
                threads=self._threads(),
                order=lambda run: (
                    order.get(run.rpartition("-")[0], 2),
                    _run_number(run, run.rpartition("-")[0]),
                ),
                notes=notes,
                outage=outage_line,
                effects=effects_line,
                services=(OPS, BILLING),
                downstream=downstream.endpoint if downstream is not None else None,
            ),
        ):
            self.print(line)


#: (run, kind) of each failure the story must show classified.
EXPECTED_FAILURES = (
    (f"{OPS_PREFIX}-1", "rate_limit"),
    (f"{OPS_PREFIX}-1", "unavailable"),
    (f"{OPS_PREFIX}-2", "unavailable"),
    (f"{OPS_PREFIX}-3", "reasoning_loop"),
    (f"{BILLING_PREFIX}-1", "stall"),
    (f"{BILLING_PREFIX}-1", "approval_required"),
    (f"{BILLING_PREFIX}-2", "auth"),
)
#: (run, type) of each command the story must show delivered.
EXPECTED_COMMANDS = (
    (f"{OPS_PREFIX}-1", "retry_step"),
    (f"{OPS_PREFIX}-2", "switch_fallback"),
    (f"{OPS_PREFIX}-3", "inject_guidance"),
    (f"{OPS_PREFIX}-3", "rewind_run"),
    (f"{BILLING_PREFIX}-1", "resume_run"),
    (f"{BILLING_PREFIX}-1", "approval_result"),
    (f"{BILLING_PREFIX}-2", "abort_run"),
)


def check_seen(seen: Seen) -> list[str]:
    """What the sidecar should have shown and did not: failures, commands, breaker, remediations."""
    problems: list[str] = []
    kinds = {(str(f.get("run_id")), str(f.get("kind"))) for f in seen.failures.values()}
    problems += [
        f"no {kind} failure was classified in {run}"
        for run, kind in EXPECTED_FAILURES
        if (run, kind) not in kinds
    ]
    delivered = {
        (str(c.get("run_id")), str(c.get("type")))
        for c in seen.commands.values()
        if c.get("status") == "delivered"
    }
    problems += [
        f"no {kind} command was delivered to {run}"
        for run, kind in EXPECTED_COMMANDS
        if (run, kind) not in delivered
    ]
    resumes = [
        c
        for c in seen.commands.values()
        if c.get("type") == "resume_run" and c.get("run_id") == f"{BILLING_PREFIX}-1"
    ]
    if resumes and not any((c.get("params") or {}).get("unverified") for c in resumes):
        problems.append("resume_run named no unverified tool call")
    changes = [(d, old, new) for _, d, old, new in seen.breaker_changes]
    primary = f"openai:{PRIMARY}"
    if (primary, "closed", "open") not in changes:
        problems.append(f"the breaker of {primary} never opened")
    elif not any(d == primary and new == "closed" for d, _, new in changes):
        problems.append(f"the breaker of {primary} opened but did not close again")
    if not seen.remediations:
        problems.append("no remediation ran")
    for rid, remediation in seen.remediations.items():
        name, run = seen.remediation_of.get(rid, ("remediation", "?"))
        if remediation.get("outcome") != "succeeded":
            problems.append(
                f"{name} in {run} ({rid}) ended {remediation.get('outcome') or 'not yet'}:"
                f" {remediation.get('reason') or '-'}"
            )
    return problems


def _settled(watcher: Watcher) -> bool:
    """Every remediation has an outcome and every command has been taken."""
    seen = watcher.seen
    unfinished = [r for r in seen.remediations.values() if not r.get("outcome")]
    waiting = [c for c in seen.commands.values() if c.get("status") in ("pending", "leased")]
    return not unfinished and not waiting


def _clean_env() -> dict[str, str]:
    """This environment without what would steer a child elsewhere (the user's own OTLP...)."""
    prefixes = ("OTEL_", "SPANVISOR_", "OPENAI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    if "OTEL_RESOURCE_ATTRIBUTES" in os.environ:  # e.g. Phoenix's project name: kept
        env["OTEL_RESOURCE_ATTRIBUTES"] = os.environ["OTEL_RESOURCE_ATTRIBUTES"]
    return env


def _agent_env(base_url: str, http_port: int, token: str) -> dict[str, str]:
    """An agent's environment: the fake provider, the sidecar's OTLP/HTTP port, its token."""
    env = _clean_env()
    loopback = "127.0.0.1,localhost"
    path = env.get("PYTHONPATH")
    return {
        **env,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        "NO_PROXY": f"{loopback},{env['NO_PROXY']}" if env.get("NO_PROXY") else loopback,
        "no_proxy": f"{loopback},{env['no_proxy']}" if env.get("no_proxy") else loopback,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "sk-demo",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "SPANVISOR_API_TOKEN": token,
    }


def _log_to(path: Path) -> None:
    """The sidecar's log lines go to a file: the terminal is the view's."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    for name in ("spanvisor", "dbos"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _missing_modules() -> list[str]:
    """What the example agent needs that is not installed (the ``demo`` extra)."""
    import importlib.util

    needed = (
        "langgraph",
        "langgraph.checkpoint.sqlite",
        "langchain_openai",
        "openinference.instrumentation.langchain",
    )
    missing = []
    for name in needed:
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            missing.append(name)
    return missing


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: processes stopped, state removed


def run_demo(
    *,
    runs: int = MIN_RUNS,
    seed: int = 7,
    live: bool | None = None,
    keep: bool = False,
    out: TextIO | None = None,
) -> int:
    """Run the demo (see the module); 0 when the whole story happened, 1 if not, 2 on usage."""
    stream = out if out is not None else sys.stdout
    if not AGENT.exists():
        print(
            f"spanvisor demo: the example agent is not at {AGENT}; run the demo from a checkout"
            " of the spanvisor repository (pip install -e '.[demo]').",
            file=sys.stderr,
        )
        return 2
    missing = _missing_modules()
    if missing:
        print(
            f"spanvisor demo: the example agent needs {', '.join(missing)}:"
            " pip install -e '.[demo]'",
            file=sys.stderr,
        )
        return 2
    if not MIN_RUNS <= runs <= MAX_RUNS:
        print(
            f"spanvisor demo: --runs must be between {MIN_RUNS} (the story's runs) and {MAX_RUNS}",
            file=sys.stderr,
        )
        return 2
    if live is None:
        live = stream.isatty()
    reconfigure = getattr(stream, "reconfigure", None)
    if callable(reconfigure):
        with contextlib.suppress(ValueError, OSError):
            reconfigure(errors="replace")  # span text in a terminal that is not UTF-8
    demo = Demo(runs=runs, seed=seed, live=live, keep=keep, out=stream)
    previous = signal.getsignal(signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGTERM, _interrupted)
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("\nspanvisor demo: interrupted; every process stopped, state removed", file=stream)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
