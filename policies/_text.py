"""Text cut short for one-line messages: outputs, values and patterns quoted in reports.

Span content is untrusted and policy patterns may be long; a message that
quotes either must stay one readable line.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_MESSAGE", "MAX_SHOWN_PATTERN", "short", "shown_pattern"]

#: Characters of quoted text in a message, by default.
MAX_MESSAGE: Final = 200
#: Characters of a pattern quoted in a message.
MAX_SHOWN_PATTERN: Final = 60


def short(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` if it fits in ``limit`` characters, else its start and ``...`` within them."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_pattern(pattern: str) -> str:
    """A pattern as quoted in messages: its first characters, then ``...`` if it goes on."""
    if len(pattern) <= MAX_SHOWN_PATTERN:
        return pattern
    return pattern[:MAX_SHOWN_PATTERN] + "..."
