"""Opaque cursors for the control API's lists: ``?limit=N&cursor=...`` and ``next_cursor``.

Every list answers one page, newest first (breakers: by name), with
``next_cursor``: pass it back as ``cursor`` (with the same filters) for the
next page; ``null`` on the last one. A cursor is the sort key of the last
item shown (a store row id, a sequence number, a time and an id), so a page
starts exactly after it: rows added meanwhile never shift a later page (they
are newer than every cursor) and nothing is shown twice. A cursor names its
list, and one from another list is refused. Its content is no contract:
clients pass it back as they got it.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import cast

__all__ = ["CursorError", "Key", "decode_cursor", "encode_cursor"]

#: A list's sort key: a row id, or (time, id) and the like.
Key = tuple[int | float | str, ...]


class CursorError(ValueError):
    """A cursor this list did not give (mangled, or another list's)."""


def encode_cursor(list_name: str, key: Key) -> str:
    raw = json.dumps([list_name, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None, list_name: str, shape: tuple[type, ...]) -> Key | None:
    """The key in ``cursor`` (None for none), checked against ``list_name`` and ``shape``."""
    if cursor is None or cursor == "":
        return None
    problem = f"cursor {cursor[:40]!r} is not one the {list_name} list gave: pass next_cursor as is"
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        found = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (ValueError, UnicodeError, binascii.Error):
        raise CursorError(problem) from None
    if not isinstance(found, list) or len(found) != len(shape) + 1 or found[0] != list_name:
        raise CursorError(problem)
    key: list[int | float | str] = []
    for given, kind in zip(found[1:], shape, strict=True):
        # JSON writes 3.0 as 3.0, but a hand-made cursor may say 3: the same time.
        value = float(given) if kind is float and type(given) is int else given
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CursorError(problem)
        key.append(cast(int | float | str, value))
    return tuple(key)
