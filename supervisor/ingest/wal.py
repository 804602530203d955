"""The ingest log: what OTLP acknowledged survives ``kill -9`` until it is judged and stored.

A receiver answers 200 (gRPC: OK) only once the request is on disk: it
awaits :meth:`IngestLog.admit`, which appends the request's protobuf bytes to
the log, waits until a committer thread has ``fdatasync``-ed them, and only
then queues the batch for the pipeline. Requests that arrive while one sync
runs share the next (group commit), so the cost is one sync per round, not
per request, and the event loop never blocks on the disk. Logging before
queueing, not after, keeps the answer from waiting for the pipeline: the
sync's completion is handed to the loop, which may be busy judging the very
batch just queued.

An entry is released once the batch's outcomes are committed to the store
(:class:`Releases`, which the store writer's ``after_store`` tells), or at
once when the batch had none: a small release mark is written at once, with
whatever round is due (not synced on its own: a kill -9 keeps it, and a mark
lost to a power cut only means the entry is judged again).
At the next start the entries not released are replayed through the pipeline
before new spans; the store's idempotency keys make a failure judged twice
produce one incident and one command.

The whole request is logged, not only its failing spans: the bytes are
already in hand (filtering would mean walking the spans a second time on the
loop, before the answer), and replaying every span also restores the runs'
progress that loop and stall detection read.

**Format.** Segment files ``<first sequence number>.log`` in one directory,
each starting with :data:`MAGIC`, then records: ``length`` (u32), ``crc32``
(u32) of the body, and the body: sequence number (u64), received time
(i64 ns), transport (u8), the request's bytes; a release mark is a body
with transport 255 and no bytes, naming the entry released. Append-only: a segment is
never rewritten, only deleted once every entry in it is released (and a new
one is started past ``segment_bytes``). A process killed mid-write leaves a
record whose length or CRC does not match; reading stops there, and it is
counted. Segment files rather than SQLite: one sequential write and one sync
per round, a release costs no disk write, and no lock is shared with the
store's database.

**Bounds.** Entries not released take at most ``max_bytes`` on disk; past it
:meth:`IngestLog.logged` says no and the receiver throttles (503 /
UNAVAILABLE), since it must not acknowledge what it could not log. One entry
larger than the bound is admitted only when nothing else is held. A failed
write or sync (a full disk) also says no; it is counted and the next round
starts a new segment.

Thread-safety: :meth:`logged` and :meth:`take` on the event loop; :meth:`release`
from any thread (the store writer's); the committer is the only writer of files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

if TYPE_CHECKING:
    from supervisor.ingest.queue import Batch, Transport

__all__ = [
    "MAGIC",
    "IngestLog",
    "LogStats",
    "LoggedBatch",
    "NoLog",
    "Releases",
    "SpanLog",
    "read_segment",
]

log = logging.getLogger("spanvisor.ingest.log")

#: The first bytes of every segment file (format version 1).
MAGIC = b"SPVLOG1\n"
_HEAD = struct.Struct("<II")  # body length, crc32 of the body
_BODY = struct.Struct("<QqB")  # sequence number, received ns, transport
_TRANSPORTS: tuple[Transport, ...] = ("grpc", "http/protobuf", "http/json")
_SUFFIX = ".log"
#: The transport code of a release mark.
_RELEASE = 255
_sync = getattr(os, "fdatasync", os.fsync)


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    """One entry read back from the log: a request acknowledged and not yet released."""

    seq: int
    received_ns: int
    transport: Transport
    #: The ``ExportTraceServiceRequest`` as protobuf bytes.
    payload: bytes


@dataclass(frozen=True, slots=True)
class LogStats:
    """What the ingest log did since start (``/v1/stats`` → ``ingest_log``)."""

    enabled: bool
    #: Entries appended and synced (acknowledged), and their bytes.
    logged: int
    logged_bytes: int
    #: Syncs: each covers every entry that arrived meanwhile.
    commits: int
    released: int
    #: Entries found at start, not released before the stop, to replay.
    recovered: int
    replayed: int
    #: Requests refused because the log was full (throttled) or a write failed.
    refused_full: int
    write_errors: int
    #: Damaged tails skipped at start (a kill mid-write), and unreadable segment files.
    torn_tails: int
    bad_segments: int
    live_entries: int
    live_bytes: int
    max_bytes: int
    segments: int


class SpanLog(Protocol):
    """What the receivers and the pipeline worker need of a log (:class:`NoLog`: none)."""

    async def admit(self, batch: Batch, offer: Callable[[Batch], bool]) -> bool: ...

    def take(self, batch: Batch) -> int | None: ...

    def release(self, seq: int) -> None: ...


class NoLog:
    """No log (the state is in memory): every batch counts as logged, nothing is kept."""

    async def admit(self, batch: Batch, offer: Callable[[Batch], bool]) -> bool:
        return offer(batch)

    async def logged(self, batch: Batch) -> bool:
        return True

    def take(self, batch: Batch) -> int | None:
        return None

    def release(self, seq: int) -> None:
        return None

    def recovered(self) -> list[LoggedBatch]:
        return []

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None

    def replayed(self, count: int) -> None:
        return None

    def stats(self) -> LogStats:
        return LogStats(False, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


@dataclass(slots=True)
class _Segment:
    path: Path
    live: int = 0
    size: int = 0


@dataclass(slots=True)
class _Pending:
    seq: int
    record: bytes
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]


class IngestLog:
    """The log in one directory; see the module for what it guarantees and costs."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        segment_bytes: int = 16 * 1024 * 1024,
        sync: bool = True,
    ) -> None:
        if max_bytes < 1 or segment_bytes < 1:
            raise ValueError("max_bytes and segment_bytes must be >= 1")
        self.directory = directory
        self._max_bytes = max_bytes
        self._segment_bytes = segment_bytes
        self._sync = sync
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._segments: dict[int, _Segment] = {}  # by first sequence number, in order
        #: Every entry not released: its segment (None: not written yet) and size.
        self._entries: dict[int, tuple[int | None, int]] = {}
        self._released_early: set[int] = set()
        #: Release marks not written yet (the committer writes them at once).
        self._marks: list[int] = []
        self._by_batch: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._active: _Segment | None = None
        self._active_first = 0
        self._file: BinaryIO | None = None
        self._next_seq = 1
        self._live_bytes = 0
        self._recovered: list[LoggedBatch] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self._broken = False
        self._stats = dict.fromkeys(
            (
                "logged",
                "logged_bytes",
                "commits",
                "released",
                "recovered",
                "replayed",
                "refused_full",
                "write_errors",
                "torn_tails",
                "bad_segments",
            ),
            0,
        )
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._recover()

    # ------------------------------------------------------------ start-up

    def _recover(self) -> None:
        found: list[tuple[int, Path, list[LoggedBatch], int]] = []
        released: set[int] = set()
        for path in sorted(self.directory.glob(f"*{_SUFFIX}"), key=_first_seq):
            first = _first_seq(path)
            if first < 0:
                continue  # not ours
            entries, marks, torn = read_segment(path)
            released.update(marks)
            # Past every name too: a new segment never opens an existing file.
            self._next_seq = max([self._next_seq, first + 1, *(m + 1 for m in marks)])
            found.append((first, path, entries, torn))
        for first, path, all_entries, torn in found:
            self._next_seq = max([self._next_seq, *(e.seq + 1 for e in all_entries)])
            entries = [e for e in all_entries if e.seq not in released]
            if entries:  # the segment stays: its released entries are marked again
                self._marks += [e.seq for e in all_entries if e.seq in released]
            if torn == -1:
                self._stats["bad_segments"] += 1
                log.error("ingest log segment %s is not readable; left as is", path)
                continue
            if torn:
                self._stats["torn_tails"] += 1
                log.warning(
                    "ingest log segment %s ends in a damaged record (a stop mid-write); "
                    "the %d entries before it are read",
                    path,
                    len(all_entries),
                )
            if not entries:
                path.unlink(missing_ok=True)
                continue
            segment = _Segment(path, live=len(entries), size=path.stat().st_size)
            self._segments[first] = segment
            for entry in entries:
                size = _HEAD.size + _BODY.size + len(entry.payload)
                self._entries[entry.seq] = (first, size)
                self._live_bytes += size
            self._recovered.extend(entries)
        self._recovered.sort(key=lambda e: e.seq)
        self._stats["recovered"] = len(self._recovered)
        if self._recovered:
            log.info(
                "ingest log: acknowledged requests not judged before the stop will be replayed",
                extra={"entries": len(self._recovered), "bytes": self._live_bytes},
            )

    def recovered(self) -> list[LoggedBatch]:
        """The entries found at start, oldest first (handed out once)."""
        found, self._recovered = self._recovered, []
        return found

    def replayed(self, count: int) -> None:
        """Count entries replayed at start."""
        with self._lock:
            self._stats["replayed"] += count

    def start(self) -> None:
        """Start the committer thread."""
        self._thread = threading.Thread(
            target=self._commit_forever, name="spanvisor-ingest-log", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Sync what is pending, stop the committer, close the segment."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(10.0)
        with self._lock:
            self._close_file()

    # ------------------------------------------------------------ the event loop's side

    async def admit(self, batch: Batch, offer: Callable[[Batch], bool]) -> bool:
        """Log ``batch`` durably, then hand it on with ``offer`` (the ingest queue's).

        False when the log or ``offer`` refuses it (nothing is then kept): the
        receiver must throttle. True: the batch is durable and queued.
        """
        if not await self.logged(batch):
            return False
        if offer(batch):
            return True
        seq = self.take(batch)  # the queue is full: the client will send it again
        if seq is not None:
            self.release(seq)
        return False

    async def logged(self, batch: Batch) -> bool:
        """Append ``batch`` and wait for its sync: True once it is durable.

        False when the log is full or a write failed: the receiver must throttle.
        """
        size = _HEAD.size + _BODY.size + len(batch.raw_protobuf)
        loop = asyncio.get_running_loop()
        with self._wake:
            if self._closing or (self._entries and self._live_bytes + size > self._max_bytes):
                self._stats["refused_full"] += 1
                return False
            seq = self._next_seq
            self._next_seq += 1
            body = _BODY.pack(seq, batch.received_ns, _TRANSPORTS.index(batch.transport))
            body += batch.raw_protobuf
            record = _HEAD.pack(len(body), zlib.crc32(body)) + body
            future: asyncio.Future[bool] = loop.create_future()
            self._pending.append(_Pending(seq, record, loop, future))
            self._entries[seq] = (None, size)
            self._live_bytes += size
            self._by_batch[id(batch)] = seq
            self._wake.notify()
        ok = await future
        if not ok:
            self._by_batch.pop(id(batch), None)
        return ok

    def take(self, batch: Batch) -> int | None:
        """The entry of a batch the worker took (None: not logged); release it later."""
        return self._by_batch.pop(id(batch), None)

    def release(self, seq: int) -> None:
        """The batch's outcomes are stored: its entry may go (any thread)."""
        with self._lock:
            found = self._entries.get(seq)
            if found is None:
                return
            first, size = found
            self._marks.append(seq)
            self._wake.notify()  # written soon, so a restart does not judge it again
            if first is None:  # not written yet: dropped once it is
                self._released_early.add(seq)
                return
            self._drop(seq, first, size)

    def _drop(self, seq: int, first: int, size: int) -> None:
        """Forget an entry; delete its segment once nothing in it is held (lock held)."""
        del self._entries[seq]
        self._live_bytes -= size
        self._stats["released"] += 1
        segment = self._segments[first]
        segment.live -= 1
        if segment.live == 0 and segment is not self._active:
            del self._segments[first]
            segment.path.unlink(missing_ok=True)

    # ------------------------------------------------------------ the committer

    def _commit_forever(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._marks and not self._closing:
                    self._wake.wait()
                closing = self._closing and not self._pending
                round_, self._pending = self._pending, []
            if not round_:  # releases only: written (a kill -9 keeps them), not synced
                self._write([], sync=closing)
                if closing:
                    return
                continue
            ok = self._write(round_)
            for item in round_:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    item.loop.call_soon_threadsafe(_settle, item.future, ok)

    def _write(self, round_: list[_Pending], sync: bool = True) -> bool:
        """Append a round's records and the release marks so far, then sync once."""
        try:
            with self._lock:
                if not round_ and not self._marks:
                    return True
                if (
                    self._broken
                    or self._active is None
                    or (self._active.size >= self._segment_bytes)
                ):
                    self._rotate(round_[0].seq if round_ else self._next_seq)
                file = self._file
                segment = self._active
                marks, self._marks = self._marks, []
            assert file is not None and segment is not None
            data = b"".join(item.record for item in round_) + b"".join(map(_mark, marks))
            file.write(data)
            file.flush()
            if self._sync and sync:
                _sync(file.fileno())
        except OSError:
            with self._lock:
                self._broken = True
                self._stats["write_errors"] += 1
                for item in round_:
                    _, size = self._entries.pop(item.seq, (None, 0))
                    self._live_bytes -= size
                    self._released_early.discard(item.seq)
            log.exception("could not write the ingest log; requests are throttled")
            return False
        with self._lock:
            self._broken = False
            segment.size += len(data)
            self._stats["commits"] += bool(round_)
            first = self._active_first
            for item in round_:
                _, size = self._entries[item.seq]
                self._entries[item.seq] = (first, size)
                segment.live += 1
                self._stats["logged"] += 1
                self._stats["logged_bytes"] += len(item.record)
                if item.seq in self._released_early:
                    self._released_early.discard(item.seq)
                    self._drop(item.seq, first, size)
        return True

    def _rotate(self, first: int) -> None:
        """Start a new segment (lock held); the old one goes if nothing in it is held."""
        old = self._active
        self._close_file()
        if old is not None and old.live == 0:
            self._segments.pop(self._active_first, None)
            old.path.unlink(missing_ok=True)
        path = self.directory / f"{first:020d}{_SUFFIX}"
        file = path.open("ab")
        try:
            file.write(MAGIC)
            file.flush()
            if self._sync:
                _sync(file.fileno())
                _sync_directory(self.directory)
        except OSError:
            file.close()
            path.unlink(missing_ok=True)
            raise
        self._file = file
        self._active = _Segment(path, size=len(MAGIC))
        self._active_first = first
        self._segments[first] = self._active

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        self._active = None

    # ------------------------------------------------------------ state

    def stats(self) -> LogStats:
        with self._lock:
            return LogStats(
                enabled=True,
                **self._stats,
                live_entries=len(self._entries),
                live_bytes=self._live_bytes,
                max_bytes=self._max_bytes,
                segments=len(self._segments),
            )


def read_segment(path: Path) -> tuple[list[LoggedBatch], list[int], int]:
    """The whole records of one segment: entries, release marks, and how it ends.

    The last value is 0 (clean), 1 (a damaged or cut-off record ends it:
    what follows is skipped) or -1 (not a segment: wrong header or unreadable).
    """
    try:
        data = path.read_bytes()
    except OSError:
        return [], [], -1
    if not data.startswith(MAGIC):
        return [], [], -1 if len(data) >= len(MAGIC) or not MAGIC.startswith(data) else 0
    entries: list[LoggedBatch] = []
    marks: list[int] = []
    end = len(MAGIC)
    for record, stop in _records(data, len(MAGIC)):
        end = stop  # where the last whole record ends
        if isinstance(record, int):
            marks.append(record)
        else:
            entries.append(record)
    return entries, marks, int(end != len(data))


def _mark(seq: int) -> bytes:
    body = _BODY.pack(seq, 0, _RELEASE)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _records(data: bytes, offset: int) -> Iterator[tuple[LoggedBatch | int, int]]:
    total = len(data)
    while offset + _HEAD.size <= total:
        length, crc = _HEAD.unpack_from(data, offset)
        start = offset + _HEAD.size
        end = start + length
        if length < _BODY.size or end > total:
            return
        body = data[start:end]
        if zlib.crc32(body) != crc:
            return
        seq, received_ns, transport = _BODY.unpack_from(body)
        if transport == _RELEASE:
            yield seq, end
            offset = end
            continue
        if transport >= len(_TRANSPORTS):
            return
        yield LoggedBatch(seq, received_ns, _TRANSPORTS[transport], body[_BODY.size :]), end
        offset = end


def _first_seq(path: Path) -> int:
    stem = path.name[: -len(_SUFFIX)]
    return int(stem) if stem.isdigit() else -1


def _sync_directory(directory: Path) -> None:
    """Make a new file's name durable (POSIX: sync the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _settle(future: asyncio.Future[bool], ok: bool) -> None:
    if not future.done():
        future.set_result(ok)


class Releases:
    """Which ingest log entry each judged outcome came from, until the store has it.

    The store writer calls :meth:`stored` with every batch of outcomes it has
    committed (its ``after_store``); an entry is released once all of its
    outcomes are stored, at once when it had none. Outcomes are told apart by
    identity, which is unique while the writer holds them. Those the writer
    drops (its bound, a failing store) are told to :meth:`dropped`: their entry
    is never released, so it is replayed at the next start (held entries are
    bounded by the log's ``max_bytes``). Thread-safety: :meth:`expect` on the
    loop, :meth:`stored` and :meth:`dropped` on the writer's thread.
    """

    def __init__(self, log: SpanLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._entry_of: dict[int, int] = {}  # id(outcome) -> entry
        self._waiting: dict[int, int] = {}  # entry -> outcomes not stored yet

    def expect(self, seq: int, outcomes: Sequence[object]) -> None:
        """Entry ``seq`` is released once these outcomes are stored (now, if none)."""
        if not outcomes:
            self._log.release(seq)
            return
        with self._lock:
            for outcome in outcomes:
                self._entry_of[id(outcome)] = seq
            self._waiting[seq] = self._waiting.get(seq, 0) + len(outcomes)

    def stored(self, outcomes: Sequence[object]) -> None:
        """These outcomes are committed: release the entries now complete."""
        done: list[int] = []
        with self._lock:
            for outcome in outcomes:
                seq = self._entry_of.pop(id(outcome), None)
                if seq is None:
                    continue  # not from a logged batch (a stall, a replay's duplicate)
                left = self._waiting[seq] - 1
                if left:
                    self._waiting[seq] = left
                else:
                    del self._waiting[seq]
                    done.append(seq)
        for seq in done:
            self._log.release(seq)

    def dropped(self, outcomes: Sequence[object]) -> None:
        """These outcomes will never be stored: their entries stay held, to be replayed.

        Forgotten by identity now, so that a later outcome given the same
        ``id`` cannot count against an entry it does not belong to.
        """
        with self._lock:
            for outcome in outcomes:
                self._entry_of.pop(id(outcome), None)

    @property
    def pending(self) -> int:
        """Entries waiting for their outcomes to be stored."""
        return len(self._waiting)
