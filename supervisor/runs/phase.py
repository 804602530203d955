"""Where a run is in its life: open, waiting, paused, ended. The one place that says so.

Every question about a run's state is answered here, from two kinds of event:
the spans the run sends (:func:`span_seen`) and the commands the sidecar
sends it (:func:`commanded`, :func:`command_dead`); a pause's deadline is
the third (:func:`due`). The detectors ask (:func:`may_stall`,
:func:`idle_since`); the judging asks (:func:`awaiting_person`).

=========  ===================================================================
open       a turn is under way: its root span has not arrived
waiting    the sidecar told the run to go on (retry, resume, fallback, an
           approval granted) and when (``go_on_at``): silence from then is a
           stall, earlier silence is the backoff the sidecar asked for
paused     the sidecar paused the run (``paused_for``: a person, a remediation)
           until ``paused_until``; then ``on_timeout`` says what follows
           (``resume``: waiting; ``abort``: ended, failed). Never a stall; only
           the person's answer, the deadline or a command moves it on
ended      the turn's root span arrived (``failed`` when it was in error and
           nothing told the run to go on), or the run was aborted
=========  ===================================================================

A turn that ended stays ended: a span of its trace that arrives later (an
exporter's batches come in any order, a request's spans in any order) is
counted but reopens nothing. Only a command that tells the run to go on does
(an agent that caught the error may be waiting for the sidecar's verdict), and
a span of a new trace in the same session opens the session's next turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from supervisor.runs.state import RunState

__all__ = [
    "ENDED",
    "GO_ON",
    "OPEN",
    "PAUSED",
    "WAITING",
    "awaiting_person",
    "command_dead",
    "commanded",
    "due",
    "idle_since",
    "may_stall",
    "span_seen",
    "status",
]

OPEN: Final = "open"
WAITING: Final = "waiting"
PAUSED: Final = "paused"
ENDED: Final = "ended"

#: Commands that tell a run to go on (at the command's ``not_before``).
GO_ON: Final = frozenset({"retry_step", "resume_run", "switch_fallback", "rewind_run"})
#: A pause with no deadline of its own lasts this long (every pause has a deadline).
DEFAULT_PAUSE_S: Final = 3600.0
#: Turns remembered per run as ended (a session's run has one trace per turn).
_MAX_ENDED_TRACES: Final = 16


def span_seen(run: RunState, trace: bytes, *, root: bool, failed: bool, now: float) -> bool:
    """A span of ``trace`` arrived at ``now``; returns whether it ended the turn.

    ``root``: the span is its trace's root; ``failed``: it is in error.
    """
    ended = run.ended_traces
    if not root:
        if ended is not None and trace in ended:
            return False  # a late span of a turn that ended: counted, reopens nothing
        if run.phase == ENDED:
            run.phase = OPEN  # a new trace: the session's next turn
            run.failed = False
        elif run.phase == WAITING and now >= run.go_on_at:
            run.phase = OPEN  # it went on, as told
        return False
    if ended is None:
        ended = run.ended_traces = {}
    before = ended.get(trace)
    if before is None and len(ended) >= _MAX_ENDED_TRACES:
        del ended[next(iter(ended))]
    ended[trace] = not failed
    if run.phase == ENDED and before is (not failed):
        return False  # the same root again (an exporter sent it twice)
    if failed and run.phase in (WAITING, PAUSED):
        return False  # told to go on (or paused) already: the decision stands
    _end(run, failed=failed, now=now)
    return True


def commanded(
    run: RunState, kind: str, not_before: float, params: Mapping[str, object], now: float
) -> None:
    """The sidecar sent the run a command of type ``kind``; the run's state follows it.

    Applying the same command twice changes nothing (the pipeline applies the
    commands it plans, and the store announces them again once stored).
    """
    if kind in GO_ON:
        if run.phase == PAUSED and run.paused_for == "approval" and kind != "resume_run":
            return  # only the person's answer (or the deadline) ends this pause
        run.phase = WAITING
        run.go_on_at = max(run.go_on_at, not_before)
        run.stalled = False
    elif kind == "pause_run":
        timeout = params.get("timeout_s")
        seconds = (
            float(timeout)
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
            else DEFAULT_PAUSE_S
        )
        until = not_before + seconds
        if run.phase == PAUSED and run.paused_until >= until:
            return
        run.phase = PAUSED
        run.paused_until = until
        on_timeout = params.get("on_timeout")
        run.on_timeout = on_timeout if on_timeout in ("resume", "abort") else "abort"
        awaiting = params.get("awaiting")
        run.paused_for = awaiting if isinstance(awaiting, str) and awaiting else "sidecar"
        run.stalled = False
    elif kind == "abort_run":
        if run.phase != ENDED:
            _end(run, failed=True, now=now)
    elif kind == "approval_result":
        if params.get("approved") is True:
            run.phase = WAITING
            run.go_on_at = max(run.go_on_at, not_before)
            run.paused_until = 0.0
            run.stalled = False
        elif run.phase != ENDED:
            _end(run, failed=True, now=now)


def command_dead(run: RunState, kind: str, now: float) -> None:
    """A command could not be delivered: the run will not do what it said."""
    if kind not in GO_ON or run.phase != WAITING:
        return
    run.go_on_at = 0.0
    ended = run.ended_traces
    if ended is not None and run.trace in ended:
        _end(run, failed=not ended[run.trace], now=now)  # its turn had ended: nothing follows
    else:
        run.phase = OPEN


def due(run: RunState, now: float) -> bool:
    """A paused run whose deadline passed takes its stated outcome; whether it did."""
    if run.phase != PAUSED or now < run.paused_until:
        return False
    if run.on_timeout == "resume":
        run.phase = WAITING
        run.go_on_at = run.paused_until
    else:
        _end(run, failed=True, now=now)
    return True


def may_stall(run: RunState) -> bool:
    """Whether silence from the run can be a stall: it is open or was told to go on."""
    return (run.phase in (OPEN, WAITING)) and not run.stalled


def idle_since(run: RunState) -> float:
    """When the run's current silence began: its last span, or when it was told to go on."""
    if run.phase == WAITING and run.go_on_at > run.last_seen:
        return run.go_on_at
    return run.last_seen


def status(run: RunState, now: float, idle_limit: float | None) -> str:
    """How a run is listed: ended, paused, stalled, waiting, failing or running.

    ``idle_limit``: the silence after which it is stalled (None: stalls off).
    """
    if run.phase in (ENDED, PAUSED):
        return run.phase
    if run.stalled or (idle_limit is not None and now - idle_since(run) >= idle_limit):
        return "stalled"
    if run.phase == WAITING:
        return WAITING
    return "failing" if run.errors else "running"


def awaiting_person(run: RunState) -> bool:
    """Whether the run is paused until a person answers (or the pause's deadline)."""
    return run.phase == PAUSED and run.paused_for == "approval"


def _end(run: RunState, *, failed: bool, now: float) -> None:
    run.phase = ENDED
    run.failed = failed
    run.go_on_at = 0.0
    run.paused_until = 0.0
    run.ended_at = now
    run.stalled = False
