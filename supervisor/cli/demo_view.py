"""What ``spanvisor demo`` shows: events read from the control API, live or as lines.

Why a module of its own: the demo's story (processes, faults, checks) and the
way it is shown change for different reasons, and the view is the one place
that writes span content to a terminal.

* :class:`Watcher` polls the sidecar's control API (the same answers an
  operator gets from ``spanvisor runs``, ``incidents``, ``commands``,
  ``remediations``, ``breakers``, ``approvals``) and turns what changed into
  :class:`Event` s: a failure classified, its decision, a command delivered, a
  remediation started or ended, a breaker changing state, an approval asked
  for or answered. It keeps what it saw for the demo's summary.
* :class:`LineView` prints each event once, as one line (pipes, CI, tests).
* :class:`LiveView` redraws a compact screen on a terminal: the runs' table,
  the breakers, and the latest events (ANSI, standard library only).

Span content is untrusted: error messages, run ids, span and tool names come
from the agent's spans (and, through them, from a model or a remote service).
Every string reaches the terminal through :func:`clean`, which makes control
characters visible as escapes and bounds the length, so no span can move the
cursor, clear the screen or retitle the window.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import unicodedata
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import httpx

__all__ = [
    "Event",
    "Facts",
    "LineView",
    "LiveView",
    "Screen",
    "Seen",
    "View",
    "Watcher",
    "clean",
    "format_event",
    "summary",
]

#: Longest piece of span text shown in one event (an error message, a reason).
MAX_TEXT = 110
#: Events kept on the live screen.
LIVE_EVENTS = 14
#: Runs shown on the live screen.
LIVE_RUNS = 12

# -- untrusted text ------------------------------------------------------------------------


def clean(value: object, limit: int = MAX_TEXT) -> str:
    """``value`` as text safe for a terminal: one line, no control characters, bounded.

    C0 and C1 controls, DEL, Unicode format characters (bidirectional
    overrides, zero-width joiners...) and line separators are shown as
    Python escapes (``\\x1b``, ``\\u202e``) rather than sent to the terminal;
    the result is cut to ``limit`` characters with ``...``.
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) > 4 * limit + 64:  # long span text: only its start can be shown anyway
        text = text[: 4 * limit + 64]
    out: list[str] = []
    for char in text:
        if char.isprintable():
            out.append(char)
        elif unicodedata.category(char) == "Zs":  # odd spaces: a plain one
            out.append(" ")
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    shown = "".join(out)
    if len(shown) > limit:
        shown = shown[: max(0, limit - 3)] + "..."
    return shown


# -- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened, as the demo tells it.

    ``kind`` is the demo's own word (``failure``, ``decision``, ``command``...);
    ``run`` and ``text`` may hold span content and are cleaned when shown.
    """

    at: float
    kind: str
    run: str
    text: str


def format_event(event: Event, width: int | None = None) -> str:
    """One event as one line: ``[  12.3s] failure     ops-1      text``; cleaned, bounded."""
    line = (
        f"[{event.at:6.1f}s] {clean(event.kind, 11):<11} {clean(event.run, 10):<10} "
        f"{clean(event.text, 4 * MAX_TEXT)}"
    )
    if width is not None and len(line) > width:
        line = line[: max(0, width - 3)] + "..."
    return line


# -- reading the control API ---------------------------------------------------------------


def _s(found: Mapping[str, Any], key: str, default: str = "") -> str:
    value = found.get(key, default)
    return value if isinstance(value, str) else default if value is None else str(value)


#: A dotted module path before an exception's name: ``a.b.RateLimitError: ...``.
_DOTTED = re.compile(r"^(?:[A-Za-z_]\w{0,80}\.){1,12}(?=[A-Za-z_]\w{0,80}:)")


def short_message(message: str) -> str:
    """An error message without the module path of its exception type (the name stays)."""
    return _DOTTED.sub("", message, count=1)


def _decision_text(failure: Mapping[str, Any]) -> str:
    """A decision in a few words: what, its main parameters, the entry, what revised it."""
    found = failure.get("params")
    params: Mapping[str, Any] = found if isinstance(found, dict) else {}
    action = _s(failure, "action")
    delay, attempt, most = params.get("delay_s"), params.get("attempt"), params.get("max_attempts")
    if action == "retry" and isinstance(delay, (int, float)):
        count = f" (attempt {attempt} of {most} failed)" if attempt and most else ""
        what = f"retry in {delay:.1f}s{count}"
    elif action == "fallback":
        what = f"fall back to {params.get('to', '?')}"
    elif action == "remediate":
        what = f"remediate with {params.get('remediator', '?')}"
    elif action == "fail_fast":
        what = "fail fast: abort the run"
    elif action == "escalate":
        what = "escalate: pause the run and ask a person"
    else:
        what = action
    text = f"{what}  (policy {_s(failure, 'policy')})"
    # The governor's revisions follow the policy's own reason after "; ".
    _, _, revised = _s(failure, "reason").partition("; ")
    return f"{text}; revised: {revised}" if revised else text


def command_detail(command: Mapping[str, Any]) -> str:
    """What a command carries that matters to a reader (its target, its list, its answer)."""
    found = command.get("params")
    params: Mapping[str, Any] = found if isinstance(found, dict) else {}
    kind = _s(command, "type")
    if kind == "switch_fallback":
        return f" to {params.get('to', '?')}"
    if kind == "resume_run":
        unverified = params.get("unverified") or []
        listed = ", ".join(str(u) for u in unverified) if isinstance(unverified, list) else ""
        return f" (unverified: {listed or 'none'})"
    if kind == "retry_step" and isinstance(params.get("retry_after_s"), (int, float)):
        return f" (the server asked for {params['retry_after_s']:g}s)"
    if kind == "inject_guidance":
        return f": {params.get('guidance', '')}"
    if kind == "rewind_run":
        target = params.get("tool") or f"{params.get('steps_back', '?')} steps back"
        return f" to before the loop on {target}"
    if kind == "approval_result":
        verdict = "approved" if params.get("approved") is True else "denied"
        return f": {verdict} by {params.get('answered_by', '?')} ({params.get('note', '')})"
    if kind in ("abort_run", "pause_run"):
        why = params.get("reason") or params.get("awaiting") or ""
        return f" ({why})" if why else ""
    return ""


@dataclass
class Seen:
    """Everything the watcher has read, by id (the summary's material)."""

    failures: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    commands: dict[str, dict[str, Any]] = field(default_factory=dict)
    remediations: dict[str, dict[str, Any]] = field(default_factory=dict)
    approvals: dict[str, dict[str, Any]] = field(default_factory=dict)
    breakers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: (seconds since start, dependency, old state, new state), as observed.
    breaker_changes: list[tuple[float, str, str, str]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: The remediator and run of each remediation, from the decisions that started them.
    remediation_of: dict[str, tuple[str, str]] = field(default_factory=dict)


class Watcher:
    """Polls the control API and reports what changed since the last poll as events.

    Each poll makes a handful of bounded GETs (``limit`` is capped by the API);
    a request that fails is skipped until the next poll. The clock gives the
    seconds since the demo started.
    """

    def __init__(self, client: httpx.Client, clock: Callable[[], float]) -> None:
        self.client = client
        self.clock = clock
        self.seen = Seen()
        self.errors = 0

    def _get(self, path: str, key: str, **params: Any) -> list[dict[str, Any]] | None:
        try:
            response = self.client.get(path, params=params)
            response.raise_for_status()
            found = response.json().get(key)
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return None
        return [f for f in found if isinstance(f, dict)] if isinstance(found, list) else None

    def poll(self) -> list[Event]:
        """One round of GETs; the events of what changed, in cause-and-effect order."""
        now = self.clock()
        events: list[Event] = []
        failures = self._get("/v1/failures", "failures", limit=1000)
        if failures is not None:
            events += self._failures(failures, now)
        breakers = self._get("/v1/breakers", "breakers")
        if breakers is not None:
            events += self._breakers(breakers, now)
        approvals = self._get("/v1/approvals", "approvals", limit=200)
        if approvals is not None:
            events += self._approvals(approvals, now)
        remediations = self._get("/v1/remediations", "remediations", limit=200)
        started, ended = ([], []) if remediations is None else self._remediations(remediations, now)
        events += started
        commands = self._get("/v1/commands/log", "commands", limit=1000)
        if commands is not None:
            events += self._commands(commands, now)
        events += ended
        runs = self._get("/v1/runs", "runs", limit=100)
        if runs is not None:
            self.seen.runs = runs
        return events

    def _failures(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for failure in sorted(found, key=lambda f: int(f.get("received_ns") or 0)):
            key = (_s(failure, "trace_id"), _s(failure, "span_id"), _s(failure, "rule"))
            if key in self.seen.failures:
                continue
            self.seen.failures[key] = failure
            run = _s(failure, "run_id")
            params = failure.get("params")
            if isinstance(params, dict) and isinstance(params.get("remediation_id"), str):
                self.seen.remediation_of[params["remediation_id"]] = (
                    str(params.get("remediator", "?")),
                    run,
                )
            events.append(
                Event(
                    now,
                    "failure",
                    run,
                    f"{_s(failure, 'class')}/{_s(failure, 'kind')} on"
                    f" {_s(failure, 'dependency') or _s(failure, 'span_name')}"
                    f"  rule {_s(failure, 'rule')}: {clean(short_message(_s(failure, 'message')))}",
                )
            )
            events.append(Event(now, "decision", run, _decision_text(failure)))
        return events

    def _breakers(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for breaker in found:
            dependency = _s(breaker, "dependency")
            state = _s(breaker, "state")
            before = self.seen.breakers.get(dependency)
            self.seen.breakers[dependency] = breaker
            old = _s(before, "state") if before is not None else "closed"
            if state == old:
                continue
            self.seen.breaker_changes.append((now, dependency, old, state))
            what = {
                "open": "runs that call it move to a fallback",
                "half_open": "the next calls are trials",
                "closed": "the trial calls succeeded: healthy again",
                "isolated": "isolated by an operator",
            }.get(state, state)
            if (old, state) == ("half_open", "open"):
                what = "a trial call failed: open again"
            events.append(Event(now, "breaker", "", f"{dependency} {old} -> {state}: {what}"))
        return events

    def _approvals(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for approval in sorted(found, key=lambda a: float(a.get("created_at") or 0)):
            approval_id = _s(approval, "id")
            before = self.seen.approvals.get(approval_id)
            self.seen.approvals[approval_id] = approval
            status = _s(approval, "status")
            run = _s(approval, "run_id")
            if before is None:
                raw = approval.get("what")
                what: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
                proposal = approval.get("proposal")
                proposed = _s(proposal, "command") if isinstance(proposal, dict) else proposal
                events.append(
                    Event(
                        now,
                        "approval",
                        run,
                        f"{approval_id} asks a person: {_s(what, 'kind')} on"
                        f" {_s(what, 'dependency')}; on approval: {proposed or '?'}",
                    )
                )
            if status != "pending" and (before is None or _s(before, "status") == "pending"):
                events.append(
                    Event(
                        now,
                        "approval",
                        run,
                        f"{approval_id} {status} by {_s(approval, 'answered_by')}"
                        f" ({_s(approval, 'note')})",
                    )
                )
        return events

    def _remediations(
        self, found: list[dict[str, Any]], now: float
    ) -> tuple[list[Event], list[Event]]:
        started: list[Event] = []
        ended: list[Event] = []
        for remediation in sorted(found, key=lambda r: float(r.get("created_at") or 0)):
            rid = _s(remediation, "id")
            before = self.seen.remediations.get(rid)
            self.seen.remediations[rid] = remediation
            name, run = self.seen.remediation_of.get(rid, ("remediation", ""))
            if before is None:
                started.append(Event(now, "remediation", run, f"{name} started ({rid})"))
            outcome = _s(remediation, "outcome")
            if outcome and (before is None or not _s(before, "outcome")):
                reason = _s(remediation, "reason")
                ended.append(
                    Event(now, "remediation", run, f"{name} {outcome}: {reason or '-'} ({rid})")
                )
        return started, ended

    def _commands(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for command in sorted(found, key=lambda c: _s(c, "created_at")):
            command_id = _s(command, "id")
            before = self.seen.commands.get(command_id)
            self.seen.commands[command_id] = command
            status = _s(command, "status")
            if status not in ("delivered", "dead"):
                continue
            if before is not None and _s(before, "status") == status:
                continue
            verb = "delivered" if status == "delivered" else "dead-lettered"
            events.append(
                Event(
                    now,
                    "command",
                    _s(command, "run_id"),
                    f"{_s(command, 'type')} {verb} ({_s(command, 'channel')})"
                    + command_detail(command),
                )
            )
        return events


# -- views -------------------------------------------------------------------------------------


@dataclass
class Screen:
    """What the live screen shows besides the events."""

    elapsed: float
    title: str
    lines: list[str]
    runs: list[dict[str, Any]]
    #: The agent's step in each run, as the provider last saw it asked ("2/3").
    steps: Mapping[str, str]
    breakers: Iterable[dict[str, Any]]


class View(Protocol):
    """Where the demo's events go."""

    def event(self, event: Event) -> None: ...

    def tick(self, screen: Screen) -> None: ...

    def close(self) -> None: ...


class LineView:
    """Each event once, as one line, as it happens; no redraws (pipes, CI, tests)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout

    def event(self, event: Event) -> None:
        print(format_event(event), file=self.out, flush=True)

    def tick(self, screen: Screen) -> None:
        return

    def close(self) -> None:
        return


_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
_COLOURS = {
    "failure": "\x1b[31m",
    "decision": "\x1b[33m",
    "command": "\x1b[36m",
    "remediation": "\x1b[35m",
    "breaker": "\x1b[1;31m",
    "approval": "\x1b[1;33m",
    "operator": "\x1b[1;32m",
    "agent": "\x1b[34m",
    "provider": "\x1b[1;31m",
}
_STATUS_COLOURS = {"failing": "\x1b[31m", "stalled": "\x1b[1;31m", "running": "\x1b[32m"}


class LiveView:
    """A compact screen redrawn in place on a terminal (ANSI; standard library only).

    The cursor is hidden while the screen is live and shown again by
    :meth:`close`, which also leaves the last screen in place for the summary
    below it.
    """

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.events: deque[Event] = deque(maxlen=LIVE_EVENTS)
        self._started = False

    def event(self, event: Event) -> None:
        self.events.append(event)

    def tick(self, screen: Screen) -> None:
        width = max(60, shutil.get_terminal_size((100, 30)).columns - 1)
        rows = self.render(screen, width)
        if not self._started:
            self.out.write("\x1b[?25l\x1b[2J")  # hide the cursor, clear once
            self._started = True
        # Home, then each line over the old one (no flicker), then clear what is left.
        self.out.write("\x1b[H" + "".join(f"{row}\x1b[K\n" for row in rows) + "\x1b[J")
        self.out.flush()

    def render(self, screen: Screen, width: int) -> list[str]:
        """The screen's lines, styled, each at most ``width`` visible characters."""

        def fit(text: str) -> str:
            return text if len(text) <= width else text[: width - 3] + "..."

        title = f"{screen.title}   {screen.elapsed:5.1f}s   (Ctrl-C stops and cleans up)"
        rows = [f"{_BOLD}{fit(title)}{_RESET}"]
        rows += [f"{_DIM}{fit(line)}{_RESET}" for line in screen.lines]
        rows.append("")
        header = (
            f"{'RUN':<12} {'AGENT':<14} {'STATUS':<8} {'STEP':>5} {'LLM':>4} {'TOOLS':>5}"
            f" {'TOKENS':>7} {'ERR':>4} {'IDLE':>6}  LAST CALL"
        )
        rows.append(f"{_BOLD}{fit(header)}{_RESET}")
        for run in sorted(screen.runs, key=lambda r: _s(r, "run_id"))[:LIVE_RUNS]:
            run_id = _s(run, "run_id")
            status = _s(run, "status")
            tokens = int(run.get("input_tokens") or 0) + int(run.get("output_tokens") or 0)
            line = (
                f"{clean(run_id, 12):<12} {clean(_s(run, 'service'), 14):<14} {status:<8}"
                f" {clean(screen.steps.get(run_id, '-'), 5):>5} {int(run.get('llm_calls') or 0):>4}"
                f" {int(run.get('tool_calls') or 0):>5} {tokens:>7}"
                f" {int(run.get('errors') or 0):>4}"
                f" {float(run.get('idle_s') or 0):>5.1f}s  {clean(_s(run, 'step'), 30)}"
            )
            colour = _STATUS_COLOURS.get(status, "")
            rows.append(f"{colour}{fit(line)}{_RESET}" if colour else fit(line))
        if not screen.runs:
            rows.append(f"{_DIM}(no run has sent a span yet){_RESET}")
        states = [
            f"{clean(_s(b, 'dependency'), 40)} {_s(b, 'state')}"
            for b in screen.breakers
            if _s(b, "state") != "closed" or int(b.get("failures") or 0)
        ]
        rows.append("")
        rows.append(fit("breakers: " + (", ".join(states) if states else "all closed")))
        rows.append("")
        rows.append(f"{_BOLD}latest events{_RESET}")
        for event in self.events:
            line = format_event(event, width)
            colour = _COLOURS.get(event.kind, "")
            rows.append(f"{colour}{line}{_RESET}" if colour else line)
        return rows

    def close(self) -> None:
        if self._started:
            self.out.write("\x1b[?25h\n")  # the cursor back
            self.out.flush()


# -- the summary ---------------------------------------------------------------------------------


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
        "           OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo",
        f"           then open http://127.0.0.1:16686 (services {names}, spanvisor)",
        "  Phoenix: PHOENIX_GRPC_PORT=14317 phoenix serve     (UI and OTLP/HTTP on :6006)",
        "           OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:6006 spanvisor demo",
        "           then open http://127.0.0.1:6006",
        "  The demo's sidecar takes free ports, so 4317/4318 stay the viewer's (PHOENIX_GRPC_PORT",
        "  moves Phoenix's gRPC off 4317, which a `spanvisor run` beside it needs).",
    ]
