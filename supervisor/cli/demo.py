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

The watcher (:mod:`.demo_watch`) reads the control API as an operator would,
and the view (:mod:`.demo_view`) shows what it reads. The demo exits 0 when
every part of the story happened, else 1 with what did not; everything is
bounded by one deadline and cleaned up on any exit.

This module is one idea, one run of the demo from set-up to summary (the loop
that gathers news, plays the operator, restarts the killed agent, then checks
the story); what it runs lives beside it: the story's model, faults, policy
and expectations in :mod:`.demo_story`, the agent processes in
:mod:`.demo_agents`, the summary in :mod:`.demo_summary`.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from supervisor.cli.demo_agents import AGENT, AgentProcess, agent_env, agent_events, missing_modules
from supervisor.cli.demo_story import (
    BILLING,
    BILLING_MODEL,
    BILLING_PREFIX,
    BILLING_RUNS,
    CRASH_AFTER_EFFECTS,
    FALLBACK,
    MAX_RUNS,
    MIN_RUNS,
    OPS,
    OPS_PREFIX,
    POLICY,
    PRIMARY,
    REFUND_AMOUNT,
    REFUND_STEP,
    STEPS,
    DemoModel,
    Outage,
    check_seen,
    run_number,
    schedule_faults,
    step_of,
)
from supervisor.cli.demo_summary import Facts, summary
from supervisor.cli.demo_text import Event, clean
from supervisor.cli.demo_view import LineView, LiveView, Screen, View
from supervisor.cli.demo_watch import Watcher
from supervisor.forward.downstream import Downstream
from supervisor.logs import JsonFormatter
from supervisor.settings import load_settings
from supervisor.testing.fault_schedule import Fault, FaultSchedule
from supervisor.wiring import build_sidecar, resolve_downstream

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
            self.env = agent_env(fake.base_url, ports.otlp_http, self.token)
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
            for event in agent_events(agent, self.clock()):
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
                    run_number(run, run.rpartition("-")[0]),
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


def _settled(watcher: Watcher) -> bool:
    """Every remediation has an outcome and every command has been taken."""
    seen = watcher.seen
    unfinished = [r for r in seen.remediations.values() if not r.get("outcome")]
    waiting = [c for c in seen.commands.values() if c.get("status") in ("pending", "leased")]
    return not unfinished and not waiting


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
    missing = missing_modules()
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
