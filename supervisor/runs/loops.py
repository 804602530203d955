"""Reasoning loops: the same call made again and again within a run's recent calls.

The same tool with the same arguments ``repeats`` times within the run's last
``window`` tool calls, or the same LLM output ``repeats`` times within its last
``window`` LLM calls, is one detection, reported at the first repeated call
(the second of them). A loop that goes on after it was reported (the agent
ignored the guidance) is reported again once the call has been made
``repeats - 1`` more times, at most :data:`MAX_LOOP_REPORTS` times per call,
each with its ``occurrence``: the loop breaker escalates from guidance to
rewinding the run to aborting it on these.

Calls are compared by a digest of their dependency and their encoded value
(an agent that repeats a call serializes it the same way each time), and
told apart by an ``instance``: the span id (a span re-sent by an exporter is
not a repeat) or, for an LLM call, its prompt's size (the same prompt
answered again is a retry, not a loop).
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_LOOP_REPORTS", "RecentCalls", "Repeat", "digest", "instance_of"]

#: How many times one looping call is reported in a run (guidance, rewind, abort).
MAX_LOOP_REPORTS: Final = 3
#: Distinct looping calls reported per run and kind (then new ones are not).
_MAX_REPORTED: Final = 256

#: (span id and name of the loop's first repeated call, occurrence)
Repeat = tuple[bytes, str, int]


class _Repeats:
    """A call seen more than once lately: its occurrences in the window."""

    __slots__ = ("first", "instances", "seqs")

    def __init__(self, seq: int, instance: int) -> None:
        #: Span id and name of the first repeat, once there is one in the window.
        self.first: tuple[bytes, str] | None = None
        self.seqs = [seq]
        self.instances = [instance]


class RecentCalls:
    """One run's recent calls of one kind (tool calls, or LLM outputs).

    Per digest, where the call was seen among the last ``window`` calls: a
    call seen once (the usual case) is a (sequence, instance) pair; one that
    repeats keeps its last ``repeats - 1`` occurrences. O(1) per call; entries
    out of the window are pruned when the table grows past a few windows.
    """

    __slots__ = ("_reported", "_seen", "seq")

    def __init__(self) -> None:
        #: Calls counted so far (re-sent spans are not counted).
        self.seq = 0
        self._seen: dict[int, tuple[int, int] | _Repeats] = {}
        #: digest -> (times reported, when last: Unix ns); made at the first report
        #: (most runs never loop, and a run's containers are what it costs to keep).
        self._reported: dict[int, tuple[int, int]] | None = None

    def clear(self) -> None:
        self.seq = 0
        self._seen.clear()
        self._reported = None

    def count(
        self,
        digest: int,
        instance: int,
        *,
        span_id: bytes,
        name: str,
        start_ns: int,
        now_ns: int,
        repeats: int,
        window: int,
    ) -> Repeat | None:
        """Count one call; where its loop's first repeat was, once it made ``repeats``.

        After a report, only calls that started after it count towards the
        next: calls made before the agent could be told (a backlog exported
        at once) are not evidence that it ignored what it was told.
        """
        reported = self._reported
        last = reported.get(digest) if reported is not None else None
        if last is not None and start_ns < last[1]:
            return None
        seen = self._seen
        seq = self.seq + 1
        found = seen.get(digest)
        if found is None:  # the usual case: a call not made lately
            if len(seen) >= 4 * window:
                self._seen = seen = {k: v for k, v in seen.items() if _last_seq(v) > seq - window}
            seen[digest] = (seq, instance)
            self.seq = seq
            return None
        if isinstance(found, tuple):
            if found[1] == instance:
                return None  # the same call again (a re-sent span): nothing changes
            entry = seen[digest] = _Repeats(*found)
        else:
            entry = found
            if instance in entry.instances:
                return None
        self.seq = seq
        while entry.seqs and entry.seqs[0] <= seq - window:
            del entry.seqs[0], entry.instances[0]
        if not entry.seqs:
            entry.first = None  # what was seen fell out of the window: start again
        elif entry.first is None:
            entry.first = (span_id, name)  # this call is the first repeat
        entry.seqs.append(seq)
        entry.instances.append(instance)
        occurrences = len(entry.seqs)
        if occurrences > max(1, repeats - 1):
            del entry.seqs[0], entry.instances[0]
        first = entry.first
        if occurrences < repeats or first is None:
            return None
        occurrence = 1 if last is None else last[0] + 1
        if reported is None:
            reported = self._reported = {}
        if occurrence > MAX_LOOP_REPORTS or (occurrence == 1 and len(reported) >= _MAX_REPORTED):
            return None
        reported[digest] = (occurrence, now_ns)
        seen[digest] = (seq, instance)  # count again from here
        return first[0], first[1], occurrence


def _last_seq(entry: tuple[int, int] | _Repeats) -> int:
    return entry[0] if isinstance(entry, tuple) else entry.seqs[-1]


def instance_of(span_id: bytes) -> int:
    """32 bits of a span id that tell its calls apart (a re-sent span keeps its id)."""
    return hash(span_id) & 0xFFFFFFFF


def digest(raw: bytes, dependency: str) -> int:
    """What a repeat is compared by: the call's dependency and value (its ends, when long).

    Two answers of the same length with the same first and last 256 bytes
    are the same answer in any loop worth reporting, and hashing a long
    answer whole cost microseconds per span.
    """
    if len(raw) <= 512:
        return hash((raw, dependency))
    return hash((len(raw), raw[:256], raw[-256:], dependency))
