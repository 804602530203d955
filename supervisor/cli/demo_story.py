"""The story ``spanvisor demo`` tells: cast, scripted model, faults, policy, expectations.

The story itself, in words, is :mod:`supervisor.cli.demo`'s docstring; this
module is what makes it happen on the fake provider (:class:`DemoModel`,
:func:`schedule_faults`), the policy layered on the built-in one
(:data:`POLICY`), and the failures and commands the demo checks for
(:func:`check_seen`).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter

from supervisor.cli.demo_watch import Seen
from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import Fault, FaultSchedule, Matcher, ProviderRequest

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


def run_number(run: str, prefix: str) -> int:
    """The number of run ``prefix``-N (0 for a run of another prefix)."""
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
        elif where is not None and run_number(where[0], OPS_PREFIX) >= STORY_OPS_RUNS:
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
    # Two trials, both must succeed: the story's one failed trial re-opens it at once.
    "openai:{PRIMARY}": {{fail_max: 3, reset_timeout_s: 2, half_open_trials: 2}}
# A handful of retries in a few seconds is the demo's normal, not a retry storm.
retry_budget: {{ratio: 0.5, min_retries: 10, window_s: 10}}
detectors:
  services:
    # A crashed billing agent is noticed within seconds (the default is 10 minutes).
    {BILLING}: {{stalls: {{idle_seconds: 3}}}}
"""


# -- what the sidecar must be seen doing ------------------------------------------------------

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
