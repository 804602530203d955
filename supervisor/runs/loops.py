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

import hashlib
from typing import Final

__all__ = [
    "MAX_LOOP_REPORTS",
    "MAX_REPORTED",
    "RecentCalls",
    "Repeat",
    "digest",
    "instance_of",
    "stable_digest",
]

#: How many times one looping call is reported in a run (guidance, rewind, abort).
MAX_LOOP_REPORTS: Final = 3
#: Distinct looping calls reported per run and kind (then new ones are not).
MAX_REPORTED: Final = 256

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

    Per digest, where the call was seen among the last ``window`` calls. A call
    seen once (the usual case) is two integers, its sequence number and its
    instance, in two tables keyed alike: a run is made and dropped every few
    spans of a busy sidecar, and every object it holds is allocated, traversed
    by the garbage collector and freed with it. A call that repeats keeps its
    last ``repeats - 1`` occurrences (:class:`_Repeats`). O(1) per call; entries
    out of the window are pruned when the tables grow past a few windows.
    """

    __slots__ = ("_instance", "_repeats", "_reported", "_seq", "seq")

    def __init__(self) -> None:
        #: Calls counted so far (re-sent spans are not counted).
        self.seq = 0
        #: digest -> sequence number and instance of its one sighting in the window.
        self._seq: dict[int, int] = {}
        self._instance: dict[int, int] = {}
        #: digest -> its sightings, for calls seen more than once (made when first needed).
        self._repeats: dict[int, _Repeats] | None = None
        #: digest -> (times reported, when last: Unix ns); made at the first report.
        self._reported: dict[int, tuple[int, int]] | None = None

    def __len__(self) -> int:
        """Distinct calls remembered."""
        return len(self._seq) + len(self._repeats or ())

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
        seq = self.seq + 1
        entry = self._repeats.get(digest) if self._repeats is not None else None
        if entry is None:
            seen_at = self._seq.get(digest)
            if seen_at is None:  # the usual case: a call not made lately
                if len(self) >= 4 * window:
                    self._prune(seq - window)
                self._seq[digest] = seq
                self._instance[digest] = instance
                self.seq = seq
                return None
            if self._instance[digest] == instance:
                return None  # the same call again (a re-sent span): nothing changes
            entry = _Repeats(seen_at, self._instance.pop(digest))
            del self._seq[digest]
            if self._repeats is None:
                self._repeats = {}
            self._repeats[digest] = entry
        elif instance in entry.instances:
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
        if occurrence > MAX_LOOP_REPORTS or (occurrence == 1 and len(reported) >= MAX_REPORTED):
            return None
        reported[digest] = (occurrence, now_ns)
        # Count again from here: a loop that goes on is reported after as many repeats.
        if self._repeats is not None:
            del self._repeats[digest]
        self._seq[digest] = seq
        self._instance[digest] = instance
        return first[0], first[1], occurrence

    def _prune(self, oldest: int) -> None:
        """Forget the calls last seen at or before the sequence number ``oldest``."""
        for digest in [d for d, at in self._seq.items() if at <= oldest]:
            del self._seq[digest], self._instance[digest]
        if self._repeats:
            for digest in [d for d, e in self._repeats.items() if e.seqs[-1] <= oldest]:
                del self._repeats[digest]


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


def stable_digest(raw: bytes, dependency: str) -> str:
    """:func:`digest` as every process computes it (``hash`` is salted per process): what
    sidecars sharing a run's calls compare (see :mod:`supervisor.runs.fleet`)."""
    found = hashlib.blake2b(dependency.encode("utf-8", "surrogatepass"), digest_size=8)
    if len(raw) <= 512:
        found.update(b"\x00" + raw)
    else:
        found.update(len(raw).to_bytes(8, "big") + raw[:256] + raw[-256:])
    return found.hexdigest()
