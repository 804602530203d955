"""The end of ``spanvisor demo``: per run, what failed and what was done; counts; the viewers."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.cli.demo_text import clean
from supervisor.cli.demo_text import text_field as _s
from supervisor.cli.demo_watch import Seen


@dataclass(frozen=True)
class Facts:
    """What the summary needs that the API does not say (the demo knows it)."""

    elapsed: float
    #: Each run's report from its agent's summary (status, reason, models used).
    threads: Mapping[str, Mapping[str, Any]]
    #: Sort key of a run id (agent, then number).
    order: Callable[[str], Any]
    #: A note to put first in a run's line (what the demo did to it).
    notes: Mapping[str, str]
    outage: str
    effects: str
    services: tuple[str, ...]
    #: Where the spans were forwarded, when they were.
    downstream: str | None


def run_story(run: str, failures: list[dict[str, Any]], commands: list[dict[str, Any]]) -> str:
    """What happened in one run: each failure's kind and the commands it led to, in order."""
    steps: list[str] = []
    for failure in failures:
        if failure.get("run_id") != run:
            continue
        trace, span = failure.get("trace_id"), failure.get("span_id")
        sent = []
        for command in commands:
            trigger = command.get("trigger")
            if isinstance(trigger, dict) and (trigger.get("trace_id"), trigger.get("span_id")) == (
                trace,
                span,
            ):
                sent.append(_s(command, "type"))
        what = ", ".join(sent) if sent else f"{_s(failure, 'action')} (no command)"
        steps.append(f"{_s(failure, 'kind')} -> {what}")
    if not steps:
        return "no failure"
    merged: list[str] = []
    count = 0
    for index, step in enumerate(steps):
        count += 1
        if index + 1 < len(steps) and steps[index + 1] == step:
            continue
        merged.append(f"{step} (x{count})" if count > 1 else step)
        count = 0
    return "; ".join(merged)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{clean(k, 60)} {n}" for k, n in counter.most_common())


def summary(seen: Seen, facts: Facts) -> list[str]:
    """The end of the demo: per run, what failed and what was done; counts; the viewers."""
    failures = sorted(seen.failures.values(), key=lambda f: int(f.get("received_ns") or 0))
    commands = sorted(seen.commands.values(), key=lambda c: _s(c, "created_at"))
    lines = [f"\nsummary ({facts.elapsed:.1f}s)", "  runs"]
    runs = sorted({*facts.threads, *(_s(f, "run_id") for f in failures)}, key=facts.order)
    for run in runs:
        thread = facts.threads.get(run, {})
        status = _s(thread, "status") or "?"
        models = thread.get("models_used")
        used = " -> ".join(str(m) for m in models) if isinstance(models, list) else "-"
        told = run_story(run, failures, commands)
        if run in facts.notes:
            told = f"{facts.notes[run]}; {told}"
        reason = _s(thread, "reason")
        if status == "aborted" and reason and not reason.startswith("abort_run"):
            told = f"{told} ({reason})"
        lines.append(
            f"    {clean(run, 10):<10} {clean(status, 9):<9} {clean(used, 22):<22}"
            f" {clean(told, 400)}"
        )
    by_kind = Counter(f"{_s(f, 'class')}/{_s(f, 'kind')}" for f in failures)
    lines.append(f"  failures      {len(failures)} classified: {_counts(by_kind) or '-'}")
    lines.append(f"  decisions     {_counts(Counter(_s(f, 'action') for f in failures)) or '-'}")
    outcomes: Counter[str] = Counter()
    for rid, remediation in seen.remediations.items():
        name, _ = seen.remediation_of.get(rid, ("remediation", ""))
        outcomes[f"{name} {_s(remediation, 'outcome') or 'unfinished'}"] += 1
    lines.append(f"  remediations  {len(seen.remediations)}: {_counts(outcomes) or 'none'}")
    delivered = Counter(_s(c, "type") for c in commands if c.get("status") == "delivered")
    left = sum(1 for c in commands if c.get("status") != "delivered")
    lines.append(
        f"  commands      {sum(delivered.values())} delivered: {_counts(delivered) or '-'};"
        f" {left} not delivered"
    )
    approvals = list(seen.approvals.values())
    answered = Counter(
        f"{_s(a, 'status')} by {_s(a, 'answered_by')}"
        for a in approvals
        if a.get("status") != "pending"
    )
    pending = sum(1 for a in approvals if a.get("status") == "pending")
    lines.append(
        f"  approvals     {len(approvals)} asked: {_counts(answered) or 'none answered'}"
        + (f"; {pending} left pending" if pending else "")
    )
    by_breaker: dict[str, list[str]] = {}
    for at, dependency, _, new in seen.breaker_changes:
        by_breaker.setdefault(dependency, []).append(f"{_STATE_WORDS.get(new, new)} {at:.1f}s")
    changes = "; ".join(f"{clean(d, 40)} {', '.join(c)}" for d, c in by_breaker.items())
    lines.append(f"  breakers      {changes or 'no change'}")
    if facts.outage:
        lines.append(f"  outage        {facts.outage}")
    lines.append(f"  side effects  {facts.effects}")
    wrapped = [lines[0], lines[1]]
    for line in lines[2:]:
        # Runs' lines hang under their story; the others under their value.
        wrapped += wrap(line, 48 if line.startswith("    ") else 16)
    return [*wrapped, *viewer_hint(facts.services, facts.downstream)]


def wrap(line: str, indent: int, width: int = 100) -> list[str]:
    """``line`` in lines of ``width``, continued at ``indent``, broken after "; " or ", "
    when it can be (a run's story stays readable: one failure and its commands a line)."""
    out: list[str] = []
    current, placed = line[:indent], False
    for part in re.split(r"(?<=[;,]) ", line[indent:]):
        if placed and len(current) + 1 + len(part) > width:
            out.append(current)
            current, placed = " " * indent, False
        current += f" {part}" if placed else part
        placed = True
    out.append(current)
    # A part longer than a line on its own: plain wrapping, at the same indent.
    return [
        piece
        for row in out
        for piece in (
            textwrap.wrap(row, width, subsequent_indent=" " * indent, break_on_hyphens=False)
            if len(row) > width
            else [row]
        )
    ]


#: Width of the summary's lines.
WIDTH = 100
_STATE_WORDS = {"open": "opened", "half_open": "half-open", "closed": "closed"}


def viewer_hint(services: tuple[str, ...], downstream: str | None) -> list[str]:
    """How to see the same in Jaeger or Phoenix: the exact commands."""
    names = ", ".join(services)
    lines = [
        "\nsee the same in a trace viewer",
        "  Each failing span gets a spanvisor.decide child (class, kind, rule, action); each",
        "  remediation is a trace of its own, spanvisor.remediate <name>, linked to that span.",
    ]
    if downstream is not None:
        lines.append(
            f"  This time every span went to {clean(downstream, 200)}: open services {names} there"
            " (and spanvisor, for the remediations)."
        )
    return [
        *lines,
        "  Jaeger:  docker run --rm -p 16686:16686 -p 4318:4318 jaegertracing/all-in-one",
        "           (without Docker: ./jaeger, from github.com/jaegertracing/jaeger/releases)",
        "           OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo",
        f"           then open http://127.0.0.1:16686 (services {names}, spanvisor)",
        "  Phoenix: PHOENIX_GRPC_PORT=14317 phoenix serve     (UI and OTLP/HTTP on :6006)",
        "           OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:6006 spanvisor demo",
        "           then open http://127.0.0.1:6006",
        "  The demo's sidecar takes free ports, so 4317/4318 stay the viewer's (PHOENIX_GRPC_PORT",
        "  moves Phoenix's gRPC off 4317, which a `spanvisor run` beside it needs).",
    ]
