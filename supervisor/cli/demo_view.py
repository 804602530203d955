"""What ``spanvisor demo`` shows: its events, live on a terminal or as lines.

Why a module of its own: the demo's story (processes, faults, checks) and the
way it is shown change for different reasons, and the view is the one place
that writes to a terminal with escape sequences of its own.

* :class:`LineView` prints each event once, as one line (pipes, CI, tests).
* :class:`LiveView` redraws a compact screen on a terminal: the runs' table,
  the breakers, and the latest events (ANSI, standard library only).

The events come from :mod:`.demo_watch` (the control API) and the demo
itself; every piece of span text goes through :func:`~.demo_text.clean`.
"""

from __future__ import annotations

import shutil
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

# The watcher, the text and the summary were this module's: their names stay importable here.
from supervisor.cli.demo_summary import Facts, summary
from supervisor.cli.demo_text import Event, clean, format_event
from supervisor.cli.demo_text import text_field as _s
from supervisor.cli.demo_watch import Seen, Watcher

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

#: Events kept on the live screen.
LIVE_EVENTS = 14
#: Runs shown on the live screen.
LIVE_RUNS = 12

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
