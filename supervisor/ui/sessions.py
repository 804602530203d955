"""The console's logins: random session ids kept here, each with its CSRF token.

The cookie holds a random id, never the API token: a stolen cookie dies at
logout or expiry, and the token is never written to a browser's disk. Ids
map to sessions in memory (a restart logs everyone out, which is the safe
way round), bounded: past ``max_sessions`` the oldest login is dropped.
Each session has its own CSRF token, which every form posts back.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["COOKIE", "Session", "Sessions"]

#: The cookie's name (Path=/ui, HttpOnly, SameSite=Strict, Secure).
COOKIE = "spanvisor_session"
#: Logins kept at once; a new one past this drops the oldest.
MAX_SESSIONS = 1024


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    csrf: str
    expires_at: float


class Sessions:
    """Logged-in sessions by id, expiring ``ttl_s`` after login."""

    def __init__(
        self,
        ttl_s: float,
        *,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self) -> Session:
        """A new login; the oldest is dropped when the table is full."""
        self._expire()
        while len(self._by_id) >= self.max_sessions:
            self._by_id.popitem(last=False)
        session = Session(
            id=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            expires_at=self._clock() + self.ttl_s,
        )
        self._by_id[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of this id (None: unknown, expired or logged out)."""
        if not session_id:
            return None
        found = self._by_id.get(session_id)
        if found is None:
            return None
        if found.expires_at <= self._clock():
            del self._by_id[session_id]
            return None
        return found

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._by_id.pop(session_id, None)

    def _expire(self) -> None:
        now = self._clock()
        # Oldest first: logins are added in time order and all live ttl_s.
        while self._by_id:
            oldest = next(iter(self._by_id.values()))
            if oldest.expires_at > now:
                break
            self._by_id.popitem(last=False)


def csrf_matches(session: Session, given: str | None) -> bool:
    """Whether a form's ``csrf`` is its session's (compared in constant time)."""
    return bool(given) and hmac.compare_digest(session.csrf.encode(), (given or "").encode())
