"""The recovery benchmark: a fleet of long agent runs through faults, in six arms.

A fleet of LangGraph agent runs (``--runs`` runs of ``--steps`` steps, spread
over ``--workers`` worker processes; a step is one model call and one tool
call with a side effect) runs against a fake OpenAI-compatible provider that
injects, deterministically by ``--seed``:

* transient errors on about 5 % of calls (429 with ``retry-after``, 503);
* permanent errors on a few runs (401 on one, 404 ``model_not_found`` on
  another, per 100 runs): those runs cannot complete and are left out of the
  denominator; what counts there is the retries spent on them;
* one outage of the primary model (``gpt-4o``; every call answers 503) in the
  middle of the runs; the fallback (``gpt-4o-mini``) stays up;
* reasoning loops in some runs (1 in 20): at one step the model calls a
  read-only tool with the same arguments again and again until the
  conversation holds guidance; without it the run spins until LangGraph's
  recursion limit;
* worker processes killed (SIGKILL) mid-run, restarted after about a second
  (as systemd or Kubernetes would); in arms d and d+f, the sidecar killed once
  too and restarted on the same state.

Six arms, no recovery and five ways of recovering, run one after the other
with the same faults (``--arms``):

* ``a`` no recovery: the first failed step ends the run;
* ``b`` naive in-process retries: tenacity around every model call, every
  error retried (``stop_after_attempt(5)``, ``wait_exponential(multiplier=1, max=30)``);
* ``c`` LangGraph's default ``RetryPolicy()`` on both nodes;
* ``c+`` as ``c``, plus a restarted worker that resumes the runs its
  job table says were running, from its checkpointer;
* ``d`` spanvisor: a real ``spanvisor run`` with its built-in policy and what
  the deployment needs (see :func:`policy_text`); workers never retry on
  their own and do what the sidecar's commands say;
* ``d+f`` the same sidecar and workers, the built-in policy with one
  ``fallbacks:`` line (the fallback declared once) instead of restated entries.

Printed: a markdown table with the exact command line, the goals of arms d
and d+f checked one by one, and what happened around each fault. Saved: a PNG of the
completion over time of every arm (``--png``) and the raw results
(``--json``). Run from the repository root with the virtualenv active::

    python bench/recovery.py                  # the default scale, a few minutes
    python bench/recovery.py --quick          # 12 runs x 15 steps, about a minute
    python bench/recovery.py --runs 200 --steps 100 --tool-s 0.3   # a larger fleet
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

if __package__ in (None, ""):  # run as `python bench/recovery.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._recovery_procs import (
    Children,
    SidecarProcess,
    kill_now,
    start_worker,
)
from bench._recovery_provider import BenchProvider, Call
from bench._recovery_scenario import Scenario, build, read_lines
from bench.harness import BenchError, command_line, exit_cleanly_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICY = ROOT / "policies" / "default_policy.yaml"
ARMS = ("a", "b", "c", "c+", "d", "d+f")
#: The arms that run spanvisor (their workers are arm d's).
SPANVISOR_ARMS = ("d", "d+f")
ARM_NAMES = {
    "a": "(a) no recovery",
    "b": "(b) tenacity, retry everything",
    "c": "(c) LangGraph RetryPolicy()",
    "c+": "(c+) RetryPolicy + resume on restart",
    "d": "(d) spanvisor, default policy",
    "d+f": "(d+f) spanvisor, default policy + `fallbacks:` once",
}
GOALS = {"completion": 0.99, "duplicates": 0, "permanent_retries": 0, "amplification": 1.3}
#: How long the benchmark waits for every worker to be ready before an arm starts.
READY_TIMEOUT_S = 120.0
#: Remediations whose details are read from the sidecar at the end of arm d.
MAX_REMEDIATION_DETAILS = 300
#: Longest the sidecar's kill waits past its time for a pending command to exist.
PENDING_WAIT_S = 5.0
#: An arm ends when nothing happened (no model call, no run event) for this long.
QUIET_S = 30.0

# -- the policy arm d runs with ------------------------------------------------------


def _benchmark_clock(scenario: Scenario, stall_s: float, time_scale: float) -> str:
    """Stall detection and restart intensity on the benchmark's compressed clock."""
    period = 60.0 / time_scale
    builtin = yaml.safe_load(DEFAULT_POLICY.read_text(encoding="utf-8"))
    intensity = builtin.get("restart_intensity") or {}
    max_actions = int(intensity.get("max_actions", 10))
    built_in_period = float(intensity.get("period_s", 60))
    return f"""\
detectors:
  # Stall detection on the benchmark's clock: a step takes about
  # {scenario.tool_s:g} s here, not minutes. A run whose worker died mid-invocation
  # is silent; after {stall_s:g} s it is a stall (built in: 600 s).
  stalls: {{idle_seconds: {stall_s:g}}}
# Restart intensity on the benchmark's clock: its runs go {time_scale:g}x faster
# than real ones, so the built-in "{max_actions} corrective actions for one dependency
# of a run in {built_in_period:g} s" is {max_actions} in {period:g} s.
restart_intensity: {{max_actions: {max_actions}, period_s: {period:g}}}
"""


def policy_text(scenario: Scenario, stall_s: float, time_scale: float, arm: str = "d") -> str:
    """What the deployment adds to the built-in policy for the benchmark, and why.

    Arm d: the built-in retry entries for rate limits and transient I/O are
    restated with the one thing the built-in file leaves empty, their fallback
    chain; every other value is read from the built-in file, so they stay its
    own. Arm d+f: the same chain as one ``fallbacks:`` line, which every
    decision that falls back follows. Both: the benchmark's clock.
    """
    primary, fallback = f"openai:{scenario.primary}", f"openai:{scenario.fallback}"
    clock = _benchmark_clock(scenario, stall_s, time_scale)
    if arm == "d+f":
        return f"""\
version: 1
# Layered on the built-in policy (policies/default_policy.yaml): the fallback,
# declared once. The built-in retries end in a fallback without a chain, which
# follows it; so do an open breaker and a spent retry budget.
fallbacks:
  "{primary}": ["{fallback}"]
{clock}"""
    builtin = yaml.safe_load(DEFAULT_POLICY.read_text(encoding="utf-8"))
    restated = []
    for found in builtin["policies"]:
        if found["name"] not in ("builtin.rate_limit", "builtin.transient_io"):
            continue
        entry = dict(found, name=found["name"].replace("builtin.", "bench."))
        entry["on_exhausted"] = dict(found["on_exhausted"], chain={primary: [fallback]})
        restated.append(entry)
    if len(restated) != 2:
        raise BenchError("the built-in policy no longer has builtin.rate_limit/transient_io")
    entries = yaml.safe_dump(restated, sort_keys=False, default_flow_style=None, width=96)
    return f"""\
version: 1
# Layered on the built-in policy (policies/default_policy.yaml): its rules and
# decisions apply unchanged, but for what the deployment must say itself.
#
# The fallback chain. The built-in policy names none: its rate-limit and
# transient-I/O entries fall back, once their retries are spent, along the
# policy's fallbacks (none: so, escalate), and an open breaker can only pause
# runs. Here they are restated as they are built in, with {primary} -> {fallback}
# as their chain; the governor also takes this chain when {primary}'s breaker
# opens (its first entry whose chain covers the dependency).
policies:
{textwrap.indent(entries, "  ")}
{clock}"""


# -- one arm ---------------------------------------------------------------------------


@dataclass
class CrashRecord:
    worker: int
    killed_at: float
    restarted_at: float
    in_flight: list[str]


@dataclass
class ArmRun:
    """What one arm left behind: the raw material of its figures."""

    arm: str
    t0: float
    ended_at: float
    calls: list[Call]
    events: list[dict[str, Any]]
    effects: list[dict[str, Any]]
    crashes: list[CrashRecord]
    lost: set[str]
    sidecar_killed_at: float | None = None
    sidecar_restarted_at: float | None = None
    #: ids of the commands pending in the sidecar when it was killed
    pending_at_kill: list[str] = field(default_factory=list)
    sidecar: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _arm_events(folder: Path, workers: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for index in range(workers):
        found.extend(read_lines(folder / f"events-w{index}.jsonl"))
    found.sort(key=lambda r: float(r.get("t", 0.0)))
    return found


def _terminal(events: Iterable[dict[str, Any]]) -> dict[str, str]:
    state: dict[str, str] = {}
    for record in events:
        if record.get("ev") in ("done", "failed", "aborted") and record.get("run"):
            state.setdefault(str(record["run"]), str(record["ev"]))
    return state


def _in_flight(folder: Path, worker: int) -> list[str]:
    """The runs the worker's job table shows started and not ended."""
    started: set[str] = set()
    ended: set[str] = set()
    for record in read_lines(folder / f"events-w{worker}.jsonl"):
        run = str(record.get("run") or "")
        if record.get("ev") in ("start", "resumed"):
            started.add(run)
        elif record.get("ev") in ("done", "failed", "aborted"):
            ended.add(run)
    return sorted(started - ended)


def run_arm(arm: str, scenario: Scenario, root: Path, args: argparse.Namespace, say: Any) -> ArmRun:
    """One arm: the provider, the sidecar (d), the workers, the crash schedule; then collect."""
    folder = root / arm.replace("+", "plus")
    folder.mkdir(parents=True)
    (folder / "scenario.json").write_text(scenario.dumps(), encoding="utf-8")
    children = Children()
    provider = BenchProvider(scenario, t0=0.0).start()
    sidecar: SidecarProcess | None = None
    run: ArmRun | None = None
    try:
        if arm in SPANVISOR_ARMS:
            policy = folder / "policy.yaml"
            policy.write_text(
                policy_text(scenario, args.stall_s, args.time_scale, arm), encoding="utf-8"
            )
            sidecar = SidecarProcess(folder, policy, children, extra_env=args.sidecar_env)
            sidecar.start()
        workers = {
            i: start_worker(
                children,
                arm=_worker_arm(arm),
                index=i,
                incarnation=0,
                folder=folder,
                provider_url=provider.base_url,
                sidecar=sidecar,
                export_delay_ms=args.export_delay_ms,
            )
            for i in range(scenario.workers)
        }
        _wait_ready(folder, scenario.workers, workers)
        t0 = time.time() + 0.5
        provider.t0 = t0
        (folder / "go.json").write_text(json.dumps({"t0": t0}), encoding="utf-8")
        run = ArmRun(arm, t0, 0.0, [], [], [], [], set())
        _drive(arm, scenario, folder, args, children, provider, sidecar, workers, run, say)
    finally:
        if sidecar is not None and run is not None:
            run.sidecar = _sidecar_view(sidecar, scenario.workers)
        children.stop_all()
        provider.stop()
    run.calls = provider.snapshot()
    run.events = _arm_events(folder, scenario.workers)
    for index in range(scenario.workers):
        run.effects.extend(read_lines(folder / f"ledger-w{index}.jsonl"))
    if provider.unparsed:
        run.notes.append(f"{provider.unparsed} request(s) the fake could not read")
    return run


def _worker_arm(arm: str) -> str:
    """The workers' arm: every spanvisor arm runs arm d's workers."""
    return "d" if arm in SPANVISOR_ARMS else arm


def _wait_ready(folder: Path, count: int, workers: dict[int, Any]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        ready = {
            int(r["w"])
            for i in range(count)
            for r in read_lines(folder / f"events-w{i}.jsonl")
            if r.get("ev") == "worker_ready"
        }
        if len(ready) == count:
            return
        for index, process in workers.items():
            if process.poll() is not None:
                log = (folder / f"worker-w{index}.log").read_text(errors="replace")[-3000:]
                raise BenchError(f"worker {index} exited with {process.returncode}:\n{log}")
        time.sleep(0.1)
    raise BenchError(f"the workers were not ready within {READY_TIMEOUT_S:g} s")


def _drive(
    arm: str,
    scenario: Scenario,
    folder: Path,
    args: argparse.Namespace,
    children: Children,
    provider: BenchProvider,
    sidecar: SidecarProcess | None,
    workers: dict[int, Any],
    run: ArmRun,
    say: Any,
) -> None:
    """The arm's timeline: crashes and restarts on schedule, until every run has ended."""
    t0 = run.t0
    nominal = scenario.steps * (scenario.tool_s + 0.03)
    hard_deadline = t0 + max(4 * nominal, nominal + 120) + scenario.outage_s
    crashes = sorted(scenario.crashes, key=lambda c: c.at_s)
    pending_restarts: list[tuple[float, int, CrashRecord]] = []
    incarnations = dict.fromkeys(workers, 0)
    sidecar_due = t0 + scenario.sidecar_kill_s if sidecar is not None else None
    sidecar_back_due: float | None = None
    sidecar_starting = False
    resumable = arm in ("c+", *SPANVISOR_ARMS)
    last_activity = time.time()
    last_seen = (0, 0)
    runs = set(scenario.run_ids())
    while True:
        now = time.time()
        while crashes and now >= t0 + crashes[0].at_s:
            crash = crashes.pop(0)
            process = workers[crash.worker]
            kill_now(process)
            killed_at = time.time()
            in_flight = _in_flight(folder, crash.worker)
            record = CrashRecord(crash.worker, killed_at, 0.0, in_flight)
            run.crashes.append(record)
            if not resumable:
                run.lost.update(in_flight)  # nothing will ever drive them again
            pending_restarts.append((killed_at + scenario.restart_delay_s, crash.worker, record))
            say(
                f"  [{arm}] t={killed_at - t0:5.1f}s worker {crash.worker} killed,"
                f" {len(in_flight)} run(s) in flight"
            )
        for due, index, record in list(pending_restarts):
            if now >= due:
                pending_restarts.remove((due, index, record))
                incarnations[index] += 1
                workers[index] = start_worker(
                    children,
                    arm=_worker_arm(arm),
                    index=index,
                    incarnation=incarnations[index],
                    folder=folder,
                    provider_url=provider.base_url,
                    sidecar=sidecar,
                    export_delay_ms=args.export_delay_ms,
                )
                record.restarted_at = time.time()
        if sidecar is not None and sidecar_due is not None and now >= sidecar_due:
            # Killed when a command is pending (decided, not yet handed out: a retry
            # waiting for its backoff), so that exactly-once is put to the test;
            # at most PENDING_WAIT_S after the scheduled time.
            pending = _pending_commands(sidecar, scenario.workers)
            if not pending and now < sidecar_due + PENDING_WAIT_S:
                time.sleep(0.05)
                continue
            sidecar.kill()
            run.sidecar_killed_at = time.time()
            run.pending_at_kill = pending
            sidecar_due = None
            sidecar_back_due = run.sidecar_killed_at + scenario.restart_delay_s
            say(f"  [{arm}] t={run.sidecar_killed_at - t0:5.1f}s sidecar killed (SIGKILL)")
        if sidecar is not None and sidecar_back_due is not None and now >= sidecar_back_due:
            sidecar_back_due = None
            sidecar.launch()
            sidecar_starting = True
        if sidecar is not None and sidecar_starting and sidecar.healthy():
            sidecar_starting = False
            run.sidecar_restarted_at = time.time()
            back = run.sidecar_restarted_at - t0
            say(f"  [{arm}] t={back:5.1f}s sidecar healthy again, same state")
        events = _arm_events(folder, scenario.workers)
        ended = _terminal(events)
        activity = (len(events), len(provider.calls))
        if activity != last_seen:
            last_seen, last_activity = activity, now
        settled = runs <= set(ended) | run.lost
        if (
            settled
            and not crashes
            and not pending_restarts
            and sidecar_due is None
            and sidecar_back_due is None
        ):
            break
        if now > hard_deadline:
            run.notes.append(f"stopped at the hard deadline ({hard_deadline - t0:.0f} s)")
            break
        if (
            now - last_activity > QUIET_S
            and not crashes
            and sidecar_due is None
            and not pending_restarts
        ):
            run.notes.append(f"stopped after {QUIET_S:g} s without any activity")
            break
        time.sleep(0.1)
    run.ended_at = time.time()


def _pending_commands(sidecar: SidecarProcess, workers: int) -> list[str]:
    """Ids of the commands the sidecar holds, decided but not yet handed out."""
    found: list[str] = []
    for index in range(workers):
        try:
            answer = sidecar.get("/v1/commands/log", status="pending", service=f"recovery-w{index}")
        except Exception:  # not answering: nothing known to be pending
            continue
        found.extend(str(c.get("id")) for c in answer.get("commands", []))
    return found


def _sidecar_view(sidecar: SidecarProcess, workers: int) -> dict[str, Any]:
    """What the sidecar says it did (its API; empty if it cannot be reached)."""
    view: dict[str, Any] = {"starts": sidecar.starts}
    try:
        view["stats"] = sidecar.get("/v1/stats")
        log: list[dict[str, Any]] = []
        for index in range(workers):
            found = sidecar.get("/v1/commands/log", service=f"recovery-w{index}", limit=1000)
            log.extend(found.get("commands", []))
        view["commands"] = log
        view["incidents"] = sidecar.get("/v1/incidents", limit=1000).get("incidents", [])
        view["approvals"] = sidecar.get("/v1/approvals").get("approvals", [])
        listed = sidecar.get("/v1/remediations", limit=1000).get("remediations", [])
        detailed = []
        for item in listed[:MAX_REMEDIATION_DETAILS]:
            found = sidecar.get(f"/v1/remediations/{item['id']}")
            request = found.get("request") or {}
            trigger = request.get("trigger") or {}
            detailed.append(
                item
                | {
                    "remediator": request.get("remediator"),
                    "run_id": trigger.get("run_id"),
                    "kind": trigger.get("kind"),
                    "steps": [s.get("name") for s in found.get("steps") or []],
                }
            )
        view["remediations"] = detailed
    except Exception as exc:  # the figures say what could not be read
        view["error"] = f"{type(exc).__name__}: {exc}"[:300]
    view["breaker_changes"] = [
        {k: e.get(k) for k in ("ts", "dependency", "from", "to", "reason")}
        for e in sidecar.log_events()
        if e.get("event") == "breaker"
    ]
    return view


# -- figures ---------------------------------------------------------------------------


@dataclass
class Figures:
    """One arm's row of the table, and the details behind it."""

    arm: str
    recoverable: int
    completed: int
    completed_unrecoverable: int
    duplicates: int
    effects: int
    permanent_retries: int
    outage_calls: int
    outage_logical: int
    outage_hit: int
    outage_recovered: int
    outage_ttr: list[float]
    crash_hit: int
    crash_recovered: int
    crash_ttr: list[float]
    llm_calls: int
    llm_needed: int
    wall_s: float
    outcomes: dict[str, int]
    failure_reasons: dict[str, int]
    completions: list[float]
    commands: dict[str, int] = field(default_factory=dict)
    command_duplicates: int = 0
    #: Recoverable runs left paused for a person (escalated) that never completed.
    lost_to_escalation: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def completion(self) -> float:
        return self.completed / self.recoverable if self.recoverable else 0.0

    @property
    def amplification(self) -> float:
        return self.outage_calls / self.outage_logical if self.outage_logical else 0.0

    @property
    def extra_calls(self) -> int:
        return self.llm_calls - self.llm_needed


def figures(scenario: Scenario, run: ArmRun) -> Figures:
    """The arm's figures from what the provider, the ledger and the job tables recorded."""
    t0 = run.t0
    ended = _terminal(run.events)
    recoverable = [r for r in scenario.run_ids() if scenario.recoverable(r)]
    done = {r for r, ev in ended.items() if ev == "done"}
    completions = sorted(
        float(e["t"]) - t0
        for e in run.events
        if e.get("ev") == "done" and scenario.recoverable(str(e["run"]))
    )
    # Side effects: a key executed twice is a duplicate.
    keys = Counter(str(e["key"]) for e in run.effects)
    duplicates = sum(n - 1 for n in keys.values() if n > 1)
    # Retries spent on permanent errors: every call a doomed run makes after its first one.
    permanent_retries = 0
    for bad in scenario.permanent:
        mine = [c for c in run.calls if c.run == bad]
        first = next((c.t for c in mine if c.fault in ("auth", "not_found")), None)
        if first is not None:
            permanent_retries += sum(1 for c in mine if c.t > first)
    # The outage: calls to the primary in its window, and the logical calls they were.
    start, end = t0 + scenario.outage_start_s, t0 + scenario.outage_end_s
    in_window = [c for c in run.calls if c.model == scenario.primary and start <= c.t < end]
    logical = {(c.run, c.turn) for c in in_window}
    # Time to recovery after the outage: from a run's first failed call in the
    # window to its next successful call (any model).
    by_run: dict[str, list[Call]] = defaultdict(list)
    for call in run.calls:
        by_run[call.run].append(call)
    outage_ttr: list[float] = []
    hit = 0
    for name, calls in by_run.items():
        first_hit = next((c.t for c in calls if c.fault == "outage"), None)
        if first_hit is None or not scenario.recoverable(name):
            continue
        hit += 1
        back = next((c.t for c in calls if c.t > first_hit and c.ok), None)
        if back is not None:
            outage_ttr.append(back - first_hit)
    # Time to recovery after a crash: from the kill to the run's next successful call.
    crash_ttr: list[float] = []
    crash_hit = 0
    for crash in run.crashes:
        for name in crash.in_flight:
            if not scenario.recoverable(name):
                continue
            crash_hit += 1
            back = next((c.t for c in by_run.get(name, []) if c.t > crash.killed_at and c.ok), None)
            if back is not None:
                crash_ttr.append(back - crash.killed_at)
    # Extra model calls: all calls, less the ones the progress made needed
    # (one per step whose effect happened, one more for a run's final answer).
    steps_done = {(str(e["run"]), int(e["step"])) for e in run.effects}
    needed = len(steps_done) + len(done)
    outcomes = Counter(
        ended.get(r, "lost" if r in run.lost else "unfinished") for r in scenario.run_ids()
    )
    reasons = Counter(
        _reason_class(str(e.get("reason", "")))
        for e in run.events
        if e.get("ev") in ("failed", "aborted")
    )
    command_events = [e for e in run.events if e.get("ev") == "command"]
    escalated = {
        str(e.get("run"))
        for e in run.events
        if e.get("ev") == "directive" and "awaiting approval" in str(e.get("reason", ""))
    }
    return Figures(
        arm=run.arm,
        recoverable=len(recoverable),
        completed=len(done & set(recoverable)),
        completed_unrecoverable=len(done - set(recoverable)),
        duplicates=duplicates,
        effects=len(run.effects),
        permanent_retries=permanent_retries,
        outage_calls=len(in_window),
        outage_logical=len(logical),
        outage_hit=hit,
        outage_recovered=len(outage_ttr),
        outage_ttr=outage_ttr,
        crash_hit=crash_hit,
        crash_recovered=len(crash_ttr),
        crash_ttr=crash_ttr,
        llm_calls=len(run.calls),
        llm_needed=needed,
        wall_s=run.ended_at - t0,
        outcomes=dict(outcomes),
        failure_reasons=dict(reasons),
        completions=completions,
        commands=dict(Counter(str(e.get("type")) for e in command_events)),
        command_duplicates=sum(1 for e in command_events if e.get("duplicate")),
        lost_to_escalation=len((escalated & set(recoverable)) - done),
        notes=list(run.notes),
    )


def _reason_class(reason: str) -> str:
    """A failure reason without its details, for counting."""
    for marker in (
        "RateLimitError",
        "InternalServerError",
        "AuthenticationError",
        "NotFoundError",
        "recursion limit",
        "no command",
        "approval denied",
        "abort_run",
        "worker error",
    ):
        if marker in reason:
            return marker
    return reason.split(":", 1)[0][:60] or "abort_run"


def _ttr(values: Sequence[float], recovered: int, hit: int) -> str:
    if not hit:
        return "no run hit"
    if not values:
        return f"none of {hit} recovered"
    return f"{statistics.median(values):.1f} / {max(values):.1f} s ({recovered}/{hit})"


def markdown_table(rows: Sequence[Figures], baseline: Figures | None) -> str:
    header = [
        "arm",
        "runs completed / recoverable",
        "side effects duplicated",
        "retries on permanent errors",
        "calls to the primary in the outage (per logical call)",
        "same, / arm (a)",
        "runs lost to escalation",
        "time to recovery after the outage: median / max (runs back / hit)",
        "after a worker crash",
        "LLM calls (extra over the minimum)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for f in rows:
        versus_a = (
            f"{f.outage_calls / baseline.outage_calls:.2f}x"
            if baseline is not None and baseline.outage_calls
            else "n/a"
        )
        cells = [
            ARM_NAMES[f.arm],
            f"{f.completed}/{f.recoverable} ({100 * f.completion:.1f}%)",
            f"{f.duplicates}",
            f"{f.permanent_retries}",
            f"{f.outage_calls} ({f.amplification:.2f}x)",
            versus_a,
            f"{f.lost_to_escalation}",
            _ttr(f.outage_ttr, f.outage_recovered, f.outage_hit),
            _ttr(f.crash_ttr, f.crash_recovered, f.crash_hit),
            f"{f.llm_calls} (+{f.extra_calls}, {100 * f.extra_calls / max(1, f.llm_needed):.0f}%)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


DEFINITIONS = """\
Definitions: *recoverable* = every run but the ones given a permanent error (401, 404);
*completed* = the run's last step done and its final answer given. *Duplicated* = a
side-effect key (run, step) executed more than once (the ledger is the service's record).
*Retries on permanent errors* = calls a run with a permanent error made after its first
one. *Calls in the outage* = calls to the primary model whose arrival falls in the
outage window; *per logical call* divides by the distinct (run, turn) calls among them,
i.e. what the same fleet would have sent with no retries; */ arm (a)* divides by arm
(a)'s count (arm a stops runs at their first failure, so fewer of its runs are alive to
call). *Lost to escalation*: recoverable runs paused for a person (an escalation;
nobody answers in the benchmark) that never completed. *Time to recovery*: outage:
from a run's first failed call in the window to its next successful call (any model);
crash: from the SIGKILL to the run's next successful call; median / max over the runs
that came back, and how many did of those hit.
*LLM calls*: all calls the provider received; the minimum is one per step whose effect
happened plus one per final answer (the progress actually made)."""


def goal_lines(d: Figures, run: ArmRun) -> list[str]:
    """Arm d's goals, each PASS or FAIL, with the figure."""
    checks = [
        (
            f"at least {100 * GOALS['completion']:.0f}% of recoverable runs complete",
            d.completion >= GOALS["completion"],
            f"{d.completed}/{d.recoverable} = {100 * d.completion:.1f}%",
        ),
        ("no duplicated side effect", d.duplicates == 0, f"{d.duplicates} duplicated"),
        (
            "no retry of a permanent error",
            d.permanent_retries == 0,
            f"{d.permanent_retries} retries",
        ),
        (
            "no recoverable run lost to escalation",
            d.lost_to_escalation == 0,
            f"{d.lost_to_escalation} lost",
        ),
        (
            f"outage amplification at most {GOALS['amplification']:g}x",
            0 < d.amplification <= GOALS["amplification"],
            f"{d.amplification:.2f}x per logical call",
        ),
    ]
    return [f"- {what}: {'PASS' if ok else 'FAIL'} ({figure})" for what, ok, figure in checks]


def what_happened(scenario: Scenario, run: ArmRun, f: Figures) -> list[str]:
    """Around each fault: what the arm did (for the report under the table)."""
    t0 = run.t0
    out = [f"{ARM_NAMES[run.arm]}: outcomes {dict(sorted(f.outcomes.items()))}"]
    if f.failure_reasons:
        out.append(f"  failures by reason: {dict(sorted(f.failure_reasons.items()))}")
    for crash in run.crashes:
        back = crash.restarted_at - t0 if crash.restarted_at else float("nan")
        out.append(
            f"  worker {crash.worker} killed at {crash.killed_at - t0:.1f} s with"
            f" {len(crash.in_flight)} run(s) in flight; restarted at {back:.1f} s"
        )
    if run.sidecar_killed_at is not None:
        killed = run.sidecar_killed_at
        back = run.sidecar_restarted_at or float("nan")
        received = Counter(str(e.get("id")) for e in run.events if e.get("ev") == "command")
        held = run.pending_at_kill
        once = sum(1 for c in held if received[c] == 1)
        twice = sum(1 for c in held if received[c] > 1)
        after = sum(1 for e in run.events if e.get("ev") == "command" and float(e["t"]) >= back)
        out.append(
            f"  sidecar killed at {killed - t0:.1f} s with {len(held)} command(s) pending,"
            f" healthy again at {back - t0:.1f} s: of those, {once} delivered once, {twice}"
            f" more than once, {len(held) - once - twice} never; {after} command(s) received"
            f" after the restart; commands received twice in all: {f.command_duplicates}"
        )
    if f.commands:
        out.append(f"  commands received: {dict(sorted(f.commands.items()))}")
    stats = run.sidecar.get("stats") or {}
    if stats:
        out.append(
            f"  sidecar: processed spans {stats.get('pipeline', {}).get('processed_spans')},"
            f" failures {stats.get('pipeline', {}).get('failures')}"
        )
    changes = run.sidecar.get("breaker_changes") or []
    if changes:
        moves = ", ".join(
            f"{c['dependency']} {c['from']}->{c['to']} at {float(c['ts']) - t0:.1f}s"
            for c in changes[:8]
        )
        out.append(f"  breakers: {moves}")
    remediations = run.sidecar.get("remediations") or []
    if remediations:
        states = Counter(
            f"{r.get('remediator')} {str(r.get('outcome') or r.get('status')).lower()}"
            for r in remediations
        )
        out.append(f"  remediations at the end: {dict(sorted(states.items()))}")
    approvals = run.sidecar.get("approvals") or []
    if approvals:
        kinds = Counter(str((a.get("what") or {}).get("kind")) for a in approvals)
        out.append(f"  approvals requested (nobody answers in the benchmark): {dict(kinds)}")
    ended = _terminal(run.events)
    for name in scenario.run_ids():
        if name in ended or name in run.lost:
            continue
        mine = [e for e in run.events if e.get("run") == name]
        last = next((e for e in reversed(mine) if e.get("ev") == "directive"), None)
        said = (
            f"its last directive {last.get('type')} -> {last.get('action')} ({last.get('reason')})"
            if last is not None
            else "no directive"
        )
        what = mine[-1].get("ev") if mine else "never started"
        out.append(f"  unfinished {name}: last event {what}; {said}")
    for note in f.notes:
        out.append(f"  note: {note}")
    return out


def plot(
    scenario: Scenario, runs: Sequence[ArmRun], rows: Sequence[Figures], path: Path, title: str
) -> None:
    """Completion over time per arm (top) and the runs not given up (bottom).

    The outage is shaded, the worker crashes and the sidecar's crash marked.
    A run is given up when it fails, is aborted, or dies with its worker with
    nothing to resume it; a run left waiting counts as not given up.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 7), dpi=110, sharex=True, height_ratios=(3, 2)
    )
    last = [max((c.t for c in r.calls), default=r.t0) - r.t0 for r in runs]
    end = max(last, default=1.0) + 3.0
    colours = {
        "a": "tab:gray",
        "b": "tab:orange",
        "c": "tab:purple",
        "c+": "tab:brown",
        "d+f": "tab:cyan",
    }
    for run, f in zip(runs, rows, strict=True):
        colour = colours.get(run.arm, "tab:green")
        label = f"{ARM_NAMES[run.arm]}: {100 * f.completion:.0f}%"
        xs = [0.0, *f.completions, end]
        ys = [0.0, *[(i + 1) / f.recoverable for i in range(len(f.completions))]]
        top.step(xs, [*ys, ys[-1]], where="post", label=label, color=colour, linewidth=2)
        lost = sorted(_given_up(scenario, run))
        xs = [0.0, *lost, end]
        ys = [1.0, *[1 - (i + 1) / f.recoverable for i in range(len(lost))]]
        bottom.step(xs, [*ys, ys[-1]], where="post", color=colour, linewidth=2)
    for axis in (top, bottom):
        axis.axvspan(
            scenario.outage_start_s,
            scenario.outage_end_s,
            color="tab:red",
            alpha=0.12,
            label="primary model outage" if axis is top else None,
        )
        for i, crash in enumerate(scenario.crashes):
            axis.axvline(
                crash.at_s,
                color="black",
                linestyle="--",
                linewidth=1,
                label="worker killed" if axis is top and i == 0 else None,
            )
        if any(r.sidecar_killed_at is not None for r in runs):
            axis.axvline(
                scenario.sidecar_kill_s,
                color="tab:green",
                linestyle=":",
                linewidth=1.5,
                label="sidecar killed (arm d)" if axis is top else None,
            )
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    top.set_xlim(0, end)
    top.set_ylabel("recoverable runs completed")
    bottom.set_ylabel("recoverable runs not given up")
    bottom.set_xlabel("seconds since the fleet started")
    top.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    top.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _given_up(scenario: Scenario, run: ArmRun) -> list[float]:
    """When each recoverable run was given up (failed, aborted, or lost with its worker)."""
    when: dict[str, float] = {}
    for event in run.events:
        name = str(event.get("run") or "")
        if event.get("ev") in ("failed", "aborted") and scenario.recoverable(name):
            when.setdefault(name, float(event["t"]) - run.t0)
    for crash in run.crashes:
        for name in crash.in_flight:
            if name in run.lost and scenario.recoverable(name):
                when.setdefault(name, crash.killed_at - run.t0)
    return list(when.values())


# -- the command line --------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arms run one after the other, with the same faults. See bench/README.md.",
    )
    parser.add_argument("--runs", type=int, default=40, help="runs in the fleet (40)")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (60)")
    parser.add_argument("--workers", type=int, default=4, help="agent worker processes (4)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the faults (7)")
    parser.add_argument(
        "--arms",
        default="a,b,c,c+,d,d+f",
        help="arms to run, in order: a,b,c,c+,d,d+f (all)",
    )
    parser.add_argument(
        "--tool-s", type=float, default=0.45, help="seconds a step's tool takes: the pace (0.45)"
    )
    parser.add_argument(
        "--outage-s",
        type=float,
        help="length of the primary model's outage (default: 25%% of a run's nominal length)",
    )
    parser.add_argument(
        "--stall-s", type=float, default=3.0, help="arm d: stall idle_seconds (3; built-in 600)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=12.0,
        help="arm d: how much faster than real runs the benchmark's go (12): restart"
        " intensity's 60 s period is divided by it",
    )
    parser.add_argument(
        "--export-delay-ms",
        type=int,
        default=100,
        help="spanvisor arms: the workers' BatchSpanProcessor schedule delay (100; the"
        " SDK's default is 5000: spans then reach the sidecar up to 5 s after the call,"
        " which is what retries race against in an outage)",
    )
    parser.add_argument("--png", type=Path, default=Path("bench/recovery.png"), help="plot path")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--keep", type=Path, help="keep every arm's files (logs, ledgers) here")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="SPANVISOR_KEY=VALUE",
        help="arm d: a sidecar setting over the benchmark's, repeatable"
        " (e.g. SPANVISOR_MAX_BODY_BYTES=67108864)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="12 runs x 15 steps on 3 workers (about a minute)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.workers, args.tool_s = 12, 15, 3, 1.6
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms takes a comma-separated subset of {','.join(ARMS)}")
    args.arm_list = arms
    args.sidecar_env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("SPANVISOR_"):
            parser.error(f"--env takes SPANVISOR_KEY=VALUE, got {item!r}")
        args.sidecar_env[key] = value
    if not 2 <= args.workers <= 32:
        parser.error("--workers must be between 2 and 32 (two are killed)")
    if args.steps < 5 or args.runs < 4:
        parser.error("--steps must be at least 5 and --runs at least 4")
    if args.runs > 2000 or args.steps > 1000:
        parser.error("at most 2000 runs of 1000 steps")
    if not 0.01 <= args.tool_s <= 10:
        parser.error("--tool-s must be between 0.01 and 10")
    if not 1 <= args.export_delay_ms <= 60_000:
        parser.error("--export-delay-ms must be between 1 and 60000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    cmd = command_line()
    print(cmd, flush=True)
    nominal = args.steps * (args.tool_s + 0.03)
    outage = args.outage_s if args.outage_s is not None else round(max(3.0, 0.25 * nominal), 1)
    try:
        scenario = build(
            seed=args.seed,
            runs=args.runs,
            steps=args.steps,
            workers=args.workers,
            tool_s=args.tool_s,
            outage_s=outage,
        )
    except ValueError as exc:
        print(f"recovery: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.runs} runs x {args.steps} steps on {args.workers} workers; nominal run"
        f" {nominal:.0f} s; outage of {scenario.primary} at {scenario.outage_start_s:g}-"
        f"{scenario.outage_end_s:g} s; workers killed at"
        f" {', '.join(f'{c.at_s:g} s (w{c.worker})' for c in scenario.crashes)}; sidecar killed"
        f" at {scenario.sidecar_kill_s:g} s (arm d); permanent errors on"
        f" {len(scenario.permanent)} run(s), loops in {len(scenario.loops)}",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="spanvisor-recovery-"))
    runs: list[ArmRun] = []
    started = time.monotonic()
    try:
        for arm in args.arm_list:
            print(f"arm {ARM_NAMES[arm]} ...", flush=True)
            arm_started = time.monotonic()
            runs.append(run_arm(arm, scenario, root, args, lambda m: print(m, flush=True)))
            print(f"  done in {time.monotonic() - arm_started:.0f} s", flush=True)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep is not None:
            shutil.copytree(root, args.keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    took = time.monotonic() - started
    rows = [figures(scenario, r) for r in runs]
    baseline = next((f for f in rows if f.arm == "a"), None)
    print()
    print(cmd)
    print()
    print(markdown_table(rows, baseline))
    print()
    print(DEFINITIONS)
    print()
    print(f"wall time {took:.0f} s for {len(runs)} arm(s)")
    for run, f in zip(runs, rows, strict=True):
        for line in what_happened(scenario, run, f):
            print(line)
    for run, f in zip(runs, rows, strict=True):
        if f.arm in SPANVISOR_ARMS:
            print()
            print(f"arm ({f.arm}) goals:")
            for line in goal_lines(f, run):
                print(line)
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        title = f"{args.runs} runs x {args.steps} steps, seed {args.seed}: {cmd}"
        plot(scenario, runs, rows, args.png, title)
        print(f"plot: {args.png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(raw_results(cmd, scenario, runs, rows), indent=1), encoding="utf-8"
        )
        print(f"raw results: {args.json}")
    return 0


def raw_results(
    cmd: str, scenario: Scenario, runs: Sequence[ArmRun], rows: Sequence[Figures]
) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for run, f in zip(runs, rows, strict=True):
        arms[run.arm] = {
            "figures": {
                **{k: v for k, v in f.__dict__.items() if k not in ("outage_ttr", "crash_ttr")},
                "completion": f.completion,
                "amplification": f.amplification,
                "extra_calls": f.extra_calls,
                "outage_ttr_s": f.outage_ttr,
                "crash_ttr_s": f.crash_ttr,
            },
            "crashes": [
                c.__dict__
                | {"killed_at": c.killed_at - run.t0, "restarted_at": c.restarted_at - run.t0}
                for c in run.crashes
            ],
            "sidecar_killed_at": None
            if run.sidecar_killed_at is None
            else run.sidecar_killed_at - run.t0,
            "sidecar_restarted_at": None
            if run.sidecar_restarted_at is None
            else run.sidecar_restarted_at - run.t0,
            "calls": [
                [round(c.t - run.t0, 3), c.run, c.turn, c.step, c.model, c.attempt, c.fault]
                for c in run.calls
            ],
            "events": [e | {"t": round(float(e["t"]) - run.t0, 3)} for e in run.events],
            "pending_at_kill": run.pending_at_kill,
            "lost": sorted(run.lost),
            "notes": run.notes,
            "sidecar": run.sidecar,
        }
    return {"command": cmd, "scenario": scenario.to_json(), "arms": arms}


if __name__ == "__main__":
    sys.exit(main())
