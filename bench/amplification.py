"""Retry amplification during an outage: our policy and governor against naive retries.

When a dependency goes down, every client that retries multiplies the load on
it just when it can least take it. This is a deterministic, in-process
simulation (no sidecar process, no wall clock) of a fleet of agent runs
calling one dependency through an outage, comparing:

* **ours**: each failed call becomes a :class:`supervisor.records.Failure`,
  built as the pipeline builds one (the same classification rules on a span
  record with the same evidence, the attempt number counted per (run,
  dependency, kind) over the run's whole life), decided by the built-in
  policy (``policies.load_policy()``) and revised by
  :class:`policies.Governor` on the simulated clock. The governor
  is told every call outcome (``observe(dependency, ok)``) before it revises
  the decision on a failure, as the pipeline does. A run retries only when
  the answer is ``retry``, after ``params["delay_s"]`` simulated seconds;
* **naive**: every error retried with tenacity's ``stop_after_attempt(5)`` and
  ``wait_exponential(multiplier=1, max=30)`` (waits of 1, 2, 4, 8 s), the
  schedule most agents copy from tenacity's README. The stop and wait objects
  are tenacity's own, called on a ``RetryCallState`` at each failure.

The model, the same for both:

* ``--runs`` runs (default 50) each make one call to ``--dependency`` (default
  ``openai:gpt-4o``) every ``--interval`` seconds (default 2 s) for
  ``--duration`` simulated seconds (default 600); run ``i`` starts at
  ``i * interval / runs``, so the fleet's calls are evenly spread.
* During the outage (``--outage-start``, default 200 s, for ``--outage-length``,
  default 200 s) every call fails at once with an OpenAI 503 ("engine is
  currently overloaded"); outside it every call succeeds. Calls take no time.
* Runs keep their own step schedule: a step's call happens at its scheduled
  time whatever earlier steps are doing (the work arrives on the run's clock).
  A retry is an extra call of the same step, at failure time + delay. A step
  whose failure is not retried (fail_fast, escalate, budget or breaker said
  no, tenacity stopped) is given up, and the run carries on with its next
  scheduled call. Pauses (``pause_run``) and escalations to a person are not
  modelled as stopping the run, which favours the naive side: the fleet keeps
  calling at its full rate through the outage.
* Decisions take effect the moment the call fails (as with ``POST
  /v1/decide``); the delay is the decision's ``delay_s``.

That is an open loop, the load a fleet puts on a dependency when work keeps
arriving. A strictly sequential agent (its next step waits for the retries of
the last) is a closed loop: its own backoff pushes its schedule back, and both
sides would amplify less.

Figures, per side: calls made during the outage window (first and retried
attempts whose time falls in it) divided by the calls scheduled in the window
(what the fleet would make with no retries at all); the same over the whole
run; the retries; the steps that failed in the end (given up) and those a
retry saved. Goal: ours <= 1.3 during the outage (printed PASS/FAIL; the exit
code is 0 either way). The built-in policy without the governor is shown for
reference: it separates what the breaker and retry budget add from what the
per-run attempt count does alone.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/amplification.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tenacity import RetryCallState, Retrying, stop_after_attempt, wait_exponential

from bench.harness import BenchError, command_line, table
from policies import Governor, Policy, load_policy
from supervisor.normalize.evidence import build_evidence
from supervisor.records import Action, Failure, Role, SpanRecord

GOAL_RATIO = 1.3
_OVERLOADED = (
    "Error code: 503 - {'error': {'message': 'The engine is currently overloaded, please try "
    "again later', 'type': 'server_error', 'param': None, 'code': None}}"
)
_EXCEPTION = "openai.InternalServerError"
#: Events one simulation may process at most: every loop has a bound.
MAX_EVENTS = 10_000_000


class SimClock:
    """The simulated time, in seconds; the governor and its parts read it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Scenario:
    runs: int
    interval_s: float
    duration_s: float
    outage_start_s: float
    outage_end_s: float
    dependency: str
    steps_per_run: int  # 0: one run per agent for the whole simulation

    def in_outage(self, at: float) -> bool:
        """Whether a call at ``at`` falls in the outage (and so fails)."""
        return self.outage_start_s <= at < self.outage_end_s


@dataclass
class Result:
    """What one side did to the dependency."""

    name: str
    calls: int = 0
    calls_in_outage: int = 0
    scheduled: int = 0
    scheduled_in_outage: int = 0
    retries: int = 0
    retries_in_outage: int = 0
    steps_given_up: int = 0
    steps_saved: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    @property
    def outage_ratio(self) -> float:
        return self.calls_in_outage / self.scheduled_in_outage if self.scheduled_in_outage else 0.0

    @property
    def total_ratio(self) -> float:
        return self.calls / self.scheduled if self.scheduled else 0.0


#: What a side does when a call fails: the delay before retrying, or None to give up.
#: Arguments: run id, step number, 1-based attempt within the step, call number.
OnFailure = Callable[[str, int, int, int], float | None]


def simulate(
    scenario: Scenario,
    name: str,
    on_failure: OnFailure,
    clock: SimClock,
    observe: Callable[[bool], None] | None = None,
) -> Result:
    """Run the fleet through the scenario; ``on_failure`` decides each failed call.

    Events are (time, sequence, agent, run id, step, attempt); the sequence
    number breaks ties in the order events were made, so the run is
    deterministic.
    """
    result = Result(name)
    events: list[tuple[float, int, int, str, int, int]] = []
    seq = 0
    for agent in range(scenario.runs):
        first = agent * scenario.interval_s / scenario.runs
        step = 0
        at = first
        while at < scenario.duration_s:
            run = _run_id(agent, step, scenario.steps_per_run)
            heapq.heappush(events, (at, seq, agent, run, step, 1))
            seq += 1
            result.scheduled += 1
            result.scheduled_in_outage += scenario.in_outage(at)
            step += 1
            at = first + step * scenario.interval_s
    processed = 0
    while events:
        processed += 1
        if processed > MAX_EVENTS:
            raise BenchError(f"more than {MAX_EVENTS:,} calls simulated; parameters too large")
        at, _, agent, run, step, attempt = heapq.heappop(events)
        clock.now = at
        ok = not scenario.in_outage(at)
        result.calls += 1
        result.calls_in_outage += scenario.in_outage(at)
        if attempt > 1:
            result.retries += 1
            result.retries_in_outage += scenario.in_outage(at)
        if observe is not None:
            observe(ok)
        if ok:
            result.steps_saved += attempt > 1
            continue
        delay = on_failure(run, step, attempt, seq)
        if delay is None:
            result.steps_given_up += 1
            continue
        heapq.heappush(events, (at + delay, seq, agent, run, step, attempt + 1))
        seq += 1
    return result


def _run_id(agent: int, step: int, steps_per_run: int) -> str:
    """A 32-hex-digit trace id per run, as a trace's run id is in the pipeline."""
    generation = step // steps_per_run if steps_per_run else 0
    return f"{agent:08x}{generation:08x}" + "5eed" * 4


class Ours:
    """Failures built and decided as the sidecar does, on the simulated clock."""

    def __init__(self, scenario: Scenario, policy: Policy, clock: SimClock, governed: bool) -> None:
        self.scenario = scenario
        self.policy = policy
        self.clock = clock
        self.governor = Governor(policy, clock=clock) if governed else None
        self.attempts: Counter[tuple[str, str, str]] = Counter()
        self.answers: Counter[str] = Counter()
        provider, _, model = scenario.dependency.partition(":")
        self.provider, self.model = provider, model

    def observe(self, ok: bool) -> None:
        if self.governor is not None:
            self.governor.observe(self.scenario.dependency, ok)

    def failure(self, run: str, call: int) -> Failure:
        """The Failure the pipeline would make of this call's failing span."""
        now_ns = int(self.clock.now * 1e9)
        evidence = build_evidence(
            status_error=True,
            status_message=_OVERLOADED,
            exception=(_EXCEPTION, _OVERLOADED),
            error_type="InternalServerError",
            http_status=503,
            grpc_code=None,
            finish_reasons=(),
            invalid_tool_calls=(),
            swallowed=None,
            attrs={},
            now_ns=now_ns,
        )
        record = SpanRecord(
            trace_id=run,
            span_id=f"{call:016x}",
            parent_span_id=run[:16],  # the run's agent span
            name=f"chat {self.model}",
            service="research-agent",
            kind=3,
            start_ns=now_ns,
            end_ns=now_ns,
            role=Role.LLM,
            dependency=self.scenario.dependency,
            provider=self.provider,
            model=self.model,
            error=evidence,
        )
        verdict = self.policy.classify(record)
        if verdict is None:
            raise BenchError("the policy did not classify a failing span")
        return Failure(
            trace_id=record.trace_id,
            span_id=record.span_id,
            parent_span_id=record.parent_span_id,
            service=record.service,
            span_name=record.name,
            run_id=record.run_id,
            role=record.role,
            failure_class=verdict.failure_class,
            kind=verdict.kind,
            dependency=verdict.dependency or record.dependency,
            rule=verdict.rule,
            message=f"{_EXCEPTION}: {_OVERLOADED}"[:300],
            evidence=evidence,
            received_ns=now_ns,
        )

    def on_failure(self, run: str, _step: int, _attempt: int, call: int) -> float | None:
        failure = self.failure(run, call)
        key = (failure.run_id, failure.dependency, failure.kind)
        self.attempts[key] += 1  # as the pipeline: failures of this kind in the run so far
        decision = self.policy.decide(failure, attempt=self.attempts[key])
        if self.governor is not None:
            decision = self.governor.review(failure, decision)
        self.answers[decision.action.value] += 1
        if decision.action is not Action.RETRY:
            return None
        delay = decision.params.get("delay_s", 0.0)
        return float(delay) if isinstance(delay, (int, float)) else 0.0


class Naive:
    """tenacity's stop and wait objects, asked at each failed attempt of a step."""

    def __init__(self, attempts: int) -> None:
        self.stop = stop_after_attempt(attempts)
        self.wait = wait_exponential(multiplier=1, max=30)
        self.retrying = Retrying(stop=self.stop, wait=self.wait)

    def on_failure(self, _run: str, _step: int, attempt: int, _call: int) -> float | None:
        state = RetryCallState(retry_object=self.retrying, fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        if self.stop(state):
            return None
        return float(self.wait(state))


def run_ours(scenario: Scenario, policy: Policy, governed: bool) -> Result:
    clock = SimClock()
    ours = Ours(scenario, policy, clock, governed)
    name = "ours: policy + governor" if governed else "policy alone (reference)"
    result = simulate(scenario, name, ours.on_failure, clock, ours.observe)
    result.answers = ours.answers
    governor = ours.governor
    if governor is not None:
        budget = governor.budget.denied
        escalated = governor.intensity.denied
        result.notes.append(
            f"retry budget denials {budget:,}, restart-intensity escalations {escalated:,}"
        )
    return result


def run_naive(scenario: Scenario, attempts: int) -> Result:
    naive = Naive(attempts)
    name = f"naive: tenacity, {attempts} attempts"
    return simulate(scenario, name, naive.on_failure, SimClock())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Deterministic: the same arguments always give the same figures.",
    )
    parser.add_argument("--runs", type=int, default=50, help="agent runs in the fleet (50)")
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between a run's calls (2)"
    )
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds (600)")
    parser.add_argument(
        "--outage-start", type=float, default=200.0, help="second the outage starts (200)"
    )
    parser.add_argument("--outage-length", type=float, default=200.0, help="seconds it lasts (200)")
    parser.add_argument(
        "--dependency", default="openai:gpt-4o", help="provider:model called (openai:gpt-4o)"
    )
    parser.add_argument(
        "--naive-attempts", type=int, default=5, help="tenacity stop_after_attempt (5)"
    )
    parser.add_argument(
        "--steps-per-run",
        type=int,
        default=0,
        help="a fleet member starts a new run (fresh run id, fresh attempt counts) after"
        " this many steps; 0: one run each for the whole simulation (0)",
    )
    parser.add_argument(
        "--policy", type=Path, help="policy file layered on the built-in one (default: none)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.naive_attempts < 1 or args.steps_per_run < 0:
        parser.error("--runs and --naive-attempts must be >= 1, --steps-per-run >= 0")
    if not 0 < args.interval <= args.duration <= 86_400:
        parser.error("need 0 < --interval <= --duration <= 86400")
    if args.duration / args.interval * args.runs > 2_000_000:
        parser.error("more than 2,000,000 scheduled calls: fewer runs or a longer interval")
    if args.outage_start < 0 or args.outage_length <= 0:
        parser.error("--outage-start must be >= 0 and --outage-length > 0")
    if args.outage_start + args.outage_length > args.duration:
        parser.error("the outage must end within --duration")
    if ":" not in args.dependency:
        parser.error("--dependency is provider:model, e.g. openai:gpt-4o")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    scenario = Scenario(
        runs=args.runs,
        interval_s=args.interval,
        duration_s=args.duration,
        outage_start_s=args.outage_start,
        outage_end_s=args.outage_start + args.outage_length,
        dependency=args.dependency,
        steps_per_run=args.steps_per_run,
    )
    started = time.perf_counter()
    try:
        policy = load_policy(args.policy)
        results = [
            run_ours(scenario, policy, governed=True),
            run_naive(scenario, args.naive_attempts),
            run_ours(scenario, policy, governed=False),
        ]
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    took = time.perf_counter() - started
    per_run = f"{args.steps_per_run} steps" if args.steps_per_run else "the whole simulation"
    print()
    print(
        f"{args.runs} runs x 1 call every {args.interval:g} s to {args.dependency} for"
        f" {args.duration:g} s (a run lasts {per_run}); outage (503 overloaded)"
        f" {scenario.outage_start_s:g}-{scenario.outage_end_s:g} s;"
        f" simulated in {took:.1f} s"
    )
    rows = []
    for r in results:
        rows.append(
            [
                r.name,
                f"{r.calls_in_outage:,}",
                f"{r.scheduled_in_outage:,}",
                f"{r.outage_ratio:.3f}",
                f"{r.retries_in_outage:,}",
                f"{r.calls:,}",
                f"{r.total_ratio:.3f}",
                f"{r.steps_given_up:,}",
                f"{r.steps_saved:,}",
            ]
        )
    print(
        table(
            [
                "",
                "calls in outage",
                "without retries",
                "ratio",
                "retries in outage",
                "calls, whole run",
                "ratio",
                "steps given up",
                "saved by a retry",
            ],
            rows,
        )
    )
    print()
    for r in results:
        if r.answers or r.notes:
            answers = ", ".join(f"{k} {v:,}" for k, v in r.answers.most_common())
            extra = "; ".join(r.notes)
            print(f"{r.name}: answers {answers}" + (f"; {extra}" if extra else ""))
    ours = results[0]
    verdict = "PASS" if ours.outage_ratio <= GOAL_RATIO else "FAIL"
    print(
        f"ours during the outage: {ours.outage_ratio:.3f} calls per call without retries"
        f" (goal <= {GOAL_RATIO:g}): {verdict};"
        f" naive: {results[1].outage_ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
