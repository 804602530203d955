"""How the console renders a page: Jinja2 with autoescape, and the filters its pages use.

Autoescape is on for every template and nothing from a span is ever marked
safe: a span's text is text, wherever it is shown. Links are built here from
ids (each path part percent-encoded), never taken from span values.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import ChainableUndefined, Environment, FileSystemLoader

from supervisor.cli.output import format_duration

__all__ = ["TEMPLATES", "TONES", "environment"]

TEMPLATES = Path(__file__).parent / "templates"

#: How each state reads at a glance (a CSS class; the state's own word is always shown):
#: ok, warn (in progress, waiting), bad, info (over, neither good nor bad).
TONES = {
    # runs
    "running": "ok",
    "waiting": "warn",
    "paused": "warn",
    "failing": "bad",
    "stalled": "bad",
    "ended": "info",
    # breakers
    "closed": "ok",
    "half_open": "warn",
    "open": "bad",
    "isolated": "bad",
    # commands
    "delivered": "ok",
    "pending": "warn",
    "leased": "warn",
    "dead": "bad",
    # approvals
    "approved": "ok",
    "denied": "bad",
    "expired": "bad",
    # remediations
    "SUCCESS": "ok",
    "ERROR": "bad",
    "CANCELLED": "bad",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED": "bad",
}


def environment(clock: Callable[[], float] = time.time) -> Environment:
    """The templates' environment; ``clock`` is what "ago" counts from."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=True,
        # A field an older row lacks shows as nothing, not as an error page.
        undefined=ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["part"] = _part
    env.filters["when"] = _when
    env.filters["iso"] = _iso
    env.filters["ago"] = lambda at: _ago(at, clock())
    env.filters["duration"] = format_duration
    env.filters["cost"] = _cost
    env.filters["data"] = _data
    env.filters["tone"] = lambda state: TONES.get(str(state), "warn")
    return env


def _part(value: object) -> str:
    """One path segment of a console link: every reserved character encoded."""
    return quote(str(value), safe="")


def _iso(at: object) -> str:
    if isinstance(at, str):  # already RFC 3339 (a command's times)
        return at
    if not isinstance(at, (int, float)) or isinstance(at, bool) or at <= 0:
        return ""
    return datetime.datetime.fromtimestamp(at, tz=datetime.timezone.utc).isoformat()


def _when(at: object) -> str:
    """A time for a person, UTC to the second."""
    found = _iso(at)
    return found[:19].replace("T", " ") + " UTC" if len(found) >= 19 else found or "-"


def _ago(at: object, now: float) -> str:
    if not isinstance(at, (int, float)) or isinstance(at, bool) or at <= 0:
        return "-"
    return format_duration(now - at)


def _cost(run: dict[str, Any]) -> str:
    usd = run.get("cost_usd")
    if usd is None:
        return "-"
    return ("≥ " if run.get("cost_partial") else "") + f"${usd:.4f}"


def _data(value: object) -> str:
    """Structured data (params, a step's output) as indented JSON text."""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)
