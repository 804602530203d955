"""How the operator verbs print: tables, one remediation, runs and SLOs, JSON lines.

Span content (run ids, services, step names, messages) reaches the terminal
through :func:`one_line`, which shows control characters escaped and keeps it
to one line; durations, counts and ages are written for a person.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any


def print_jsonl(items: list[dict[str, Any]]) -> None:
    for entry in items:
        print(json.dumps(entry, sort_keys=True))


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [[one_line(c, 64) for c in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]
    for row in [header, *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def print_remediation(r: dict[str, Any]) -> None:
    """One remediation for a person: what started it, what it did, where its trace is."""
    request: dict[str, Any] = r.get("request") or {}
    trigger: dict[str, Any] = request.get("trigger") or {}
    outcome = f"  outcome {one_line(r['outcome'])}" if r.get("outcome") else ""
    print(f"remediation {one_line(r.get('id'))}  {one_line(r.get('status'))}{outcome}")
    if r.get("reason"):
        print(f"  reason       {one_line(r['reason'], 200)}")
    if r.get("error"):
        print(f"  error        {one_line(r['error'], 200)}")
    if request:
        tools = ", ".join(one_line(t) for t in request.get("tools") or []) or "none"
        print(
            f"  remediator   {one_line(request.get('remediator'))}"
            f" (uses {one_line(request.get('use'))}; tools: {tools})"
        )
        budget = request.get("budget") or {}
        if budget:
            print("  budget       " + "  ".join(f"{k}={one_line(v)}" for k, v in budget.items()))
        if request.get("on_unresolved"):
            print(
                f"  unresolved   {one_line(request['on_unresolved'])} after"
                f" {one_line(request.get('verify_window_s'))}s without recovery"
            )
    if trigger:
        print(
            f"  trigger      {one_line(trigger.get('class'))}/{one_line(trigger.get('kind'))}"
            f" on {one_line(trigger.get('dependency')) or '-'}"
            f" by rule {one_line(trigger.get('rule'))}"
        )
        print(
            f"               service {one_line(trigger.get('service'))}"
            f"  run {one_line(trigger.get('run_id'))}"
        )
        print(
            f"               span {one_line(trigger.get('span_id'))}"
            f" ({one_line(trigger.get('span_name'))})"
            f" in trace {one_line(trigger.get('trace_id'))}"
        )
        if trigger.get("message"):
            print(f'               message "{one_line(trigger["message"], 160)}"')
    created, updated = r.get("created_at"), r.get("updated_at")
    attempts = r.get("recovery_attempts") or 0  # DBOS counts the first start as one
    print(
        f"  started      {format_age(created)} ago, last change {format_age(updated)} ago"
        + (f", started {attempts} times (resumed after restarts)" if attempts > 1 else "")
    )
    steps: list[dict[str, Any]] = r.get("steps") or []
    print(f"steps ({len(steps)}):" if steps else "steps: none recorded yet")
    for step in steps:
        print(
            f"  {step.get('n', '?')!s:>3}  {one_line(step.get('name'), 40):40}  {step_result(step)}"
        )
    trace_id = r.get("trace_id") or request.get("trace_id")
    if trace_id:
        print(f"trace {one_line(trace_id)}")
        print(
            f"open trace {one_line(trace_id)} in Jaeger: the root span links to the triggering span"
        )


def step_result(step: dict[str, Any]) -> str:
    """A step's output, short: a tool call's value (or why it failed), else its JSON."""
    if step.get("error"):
        return "error: " + one_line(step["error"], 100)
    output = step.get("output")
    if isinstance(output, dict) and {"ok", "value"} <= output.keys():  # a tool call's result
        if output.get("refused"):
            return "refused: " + one_line(output.get("error"), 100)
        if not output.get("ok"):
            return "failed: " + one_line(output.get("error"), 100)
        output = output["value"]
    return one_line(json.dumps(output, sort_keys=True, default=str), 100)


def one_line(value: object, width: int = 80) -> str:
    """Span content for a terminal: control characters shown escaped, one line, clipped."""
    text = "" if value is None else str(value)
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_age(at: object) -> str:
    if not isinstance(at, (int, float)) or at <= 0:
        return "-"
    seconds = max(0.0, time.time() - at)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def slo_lines(slo: dict[str, Any]) -> list[str]:
    """One line per service: run success against its target, burn rates, duration, cost."""
    header = ["SERVICE", "RUNS", "SUCCESS", "TARGET", "BURN 5m/1h", "P95", "COST/RUN", ""]
    rows: list[list[str]] = []
    for service, status in sorted(slo.items()):
        if not isinstance(status, dict):
            continue
        runs = status.get("runs") or {}
        rate = (status.get("success_rate") or {}).get("long")
        burn = status.get("burn_rate") or {}
        cost = status.get("mean_cost_usd")
        rows.append(
            [
                one_line(service, 24),
                one_line(runs.get("long"), 10),
                "-" if not isinstance(rate, (int, float)) else f"{rate:.1%}",
                f"{status.get('success_target', 0):.1%}",
                f"{burn.get('short', 0):.1f}/{burn.get('long', 0):.1f}",
                format_duration((status.get("duration_s") or {}).get("p95")),
                "-" if not isinstance(cost, (int, float)) else f"${cost:.4f}",
                "BURNING" if status.get("fast_burn") else "",
            ]
        )
    return aligned(header, rows, right=range(1, 7)) if rows else []


def run_row(run: dict[str, Any]) -> list[str]:
    """One run's cells; span-derived text (id, service, step) with control characters escaped."""
    run_id = one_line(run.get("run_id"), 10_000)
    started, last_seen = run.get("started_at"), run.get("last_seen_at")
    idle = run.get("idle_s")
    # The age from the sidecar's own times, not this host's clock (which may differ).
    age: object = None
    if isinstance(started, (int, float)) and isinstance(last_seen, (int, float)):
        age = last_seen - started + (idle if isinstance(idle, (int, float)) else 0.0)
    tokens = [run.get("input_tokens"), run.get("output_tokens")]
    rate = run.get("spans_per_minute")
    return [
        run_id if len(run_id) <= 12 else run_id[:12] + "…",
        one_line(run.get("service"), 24) or "-",
        one_line(run.get("status"), 12),
        format_duration(age),
        format_duration(idle),
        one_line(run.get("spans"), 12),
        one_line(run.get("llm_calls"), 12),
        one_line(run.get("tool_calls"), 12),
        one_line(run.get("errors"), 12),
        format_quantity(sum(t for t in tokens if isinstance(t, int))),
        format_rate(rate),
        one_line(run.get("step"), 30) or "-",
    ]


def aligned(header: list[str], rows: list[list[str]], *, right: range) -> list[str]:
    """The table's lines: columns two spaces apart, those in ``right`` right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]


def runs_footer(listed: int, stats: dict[str, Any]) -> str:
    """``12 runs of 340 tracked; 5 evicted, 80 expired``: how much the table covers."""
    gone = [f"{stats[k]} {k}" for k in ("evicted", "expired") if stats.get(k)]
    runs = "run" if listed == 1 else "runs"
    return f"{listed} {runs} of {stats['tracked']} tracked" + (
        f"; {', '.join(gone)}" if gone else ""
    )


def format_duration(seconds: object) -> str:
    """Seconds for a person: 3s, 4m12s, 2h05m, 3d04h (``-`` when unknown)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or math.isnan(seconds):
        return "-"
    whole = int(max(0.0, min(float(seconds), 1e12)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3_600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3_600}h{whole % 3_600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3_600:02d}h"


def format_quantity(n: int) -> str:
    """A count for a person: 950, 12.3k, 4.1M, 2.0G."""
    if n < 1_000:
        return str(n)
    for size, unit in ((1_000, "k"), (1_000_000, "M")):
        if round(n / size, 1) < 1_000:
            return f"{n / size:.1f}{unit}"
    return f"{n / 1_000_000_000:.1f}G"


def format_rate(per_minute: object) -> str:
    if not isinstance(per_minute, (int, float)) or isinstance(per_minute, bool):
        return "-"
    return f"{per_minute:.1f}" if per_minute < 100 else f"{per_minute:.0f}"
