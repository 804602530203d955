"""Span text made safe for a terminal, and the events ``spanvisor demo`` tells.

Span content is untrusted: error messages, run ids, span and tool names come
from the agent's spans (and, through them, from a model or a remote service).
Every string the demo shows reaches the terminal through :func:`clean`, which
makes control characters visible as escapes and bounds the length, so no span
can move the cursor, clear the screen or retitle the window.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Longest piece of span text shown in one event (an error message, a reason).
MAX_TEXT = 110


def text_field(found: Mapping[str, Any], key: str, default: str = "") -> str:
    """``found[key]`` as text (an API answer's field): ``default`` when absent or null."""
    value = found.get(key, default)
    return value if isinstance(value, str) else default if value is None else str(value)


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
