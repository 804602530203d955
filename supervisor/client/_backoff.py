"""One attempt's wait from a tenacity schedule, for waits the client computes outside a loop.

The local policy advises a delay per failed attempt and the LangGraph
adapter's poll loop pauses after each quick empty poll; both take the length
from tenacity's own wait strategies rather than from arithmetic of their own.
"""

from __future__ import annotations

from typing import Final

from tenacity import RetryCallState, Retrying
from tenacity.wait import wait_base

#: Only a carrier for RetryCallState; never runs anything.
_CARRIER: Final = Retrying()


def wait_after(wait: wait_base, attempt: int) -> float:
    """The seconds ``wait`` gives after failed ``attempt`` (1-based)."""
    state = RetryCallState(retry_object=_CARRIER, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return float(wait(state))
