"""Judging in steps: a generator that yields between chunks of work, so a loop can run.

A request of 100,000 spans, 5,000 of them failing, takes a second to judge.
Done in one go on the event loop, ingest and the control API wait that long.
Written as a generator that yields after each chunk, the same work can be
driven a slice of time at a time by the app (other tasks run between
slices), or to the end in one go by :func:`drive` (tests, ``replay``).

Driven to the end with nothing else judging in between, a generator's result
is the one of the same work done without yields: the yields only mark where
a caller may pause.

A step may also yield a :class:`~concurrent.futures.Future`: work running in
another thread (a round trip to the fleet's Redis) that it needs done before
it goes on. The app awaits it, answering others meanwhile; :func:`drive`
waits for it. The step reads its result itself.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import wait
from typing import Any, Final, TypeVar

__all__ = ["CHUNK", "Steps", "chunks", "drive"]

T = TypeVar("T")

#: Work that yields between chunks and returns a ``T``. It yields None, or a
#: ``Future`` it waits for (typed Any: a bare ``yield`` is the usual step).
Steps = Generator[Any, None, T]

#: Items (spans, failures, outcomes) handled between two yields: a few
#: milliseconds of the costliest kind (a failure classified, attributed and
#: decided takes about 50 µs).
CHUNK: Final = 64


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to the end in one go; its result."""
    while True:
        try:
            waited = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if waited is not None:
            wait((waited,))


def chunks(items: Iterable[T], size: int = CHUNK) -> Iterator[list[T]]:
    """``items`` in lists of ``size`` (the last may be shorter), for a yield between each."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
