"""The ingest log (supervisor.ingest.wal): append, group commit, release, replay, torn tails."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from policies import load_policy
from supervisor.errors import ConfigError
from supervisor.ingest import wal as wal_module
from supervisor.ingest.queue import Batch
from supervisor.ingest.wal import MAGIC, IngestLog, NoLog, Releases, read_segment
from supervisor.settings import Settings
from supervisor.testing.sidecar_process import wait_until
from supervisor.wiring import build_sidecar


def batch(payload: bytes, received_ns: int = 1) -> Batch:
    return Batch(
        request=None,
        raw_protobuf=payload,
        received_ns=received_ns,
        transport="http/protobuf",
        span_count=1,
    )


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


async def log_all(wal: IngestLog, batches: list[Batch]) -> list[bool]:
    return list(await asyncio.gather(*(wal.logged(b) for b in batches)))


def test_logged_entries_are_on_disk_and_come_back_at_the_next_open(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()
    sent = [batch(f"request {i}".encode(), received_ns=i) for i in range(50)]
    assert asyncio.run(log_all(wal, sent)) == [True] * 50
    stats = wal.stats()
    assert stats.logged == 50
    assert 1 <= stats.commits <= 50  # group commit: one sync covers what arrived meanwhile
    assert stats.live_entries == 50
    # No close: as after kill -9, the next open finds every acknowledged entry.
    again = IngestLog(tmp_path, max_bytes=1 << 20)
    found = again.recovered()
    assert [e.payload for e in found] == [b.raw_protobuf for b in sent]
    assert [e.received_ns for e in found] == list(range(50))
    assert {e.transport for e in found} == {"http/protobuf"}
    assert again.stats().recovered == 50
    assert again.recovered() == []  # handed out once
    wal.close()


def test_concurrent_requests_share_syncs(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 24)
    wal.start()
    assert all(asyncio.run(log_all(wal, [batch(b"x" * 100) for _ in range(500)])))
    assert wal.stats().commits < 500
    wal.close()


def test_released_entries_are_not_replayed_once_their_segment_is_deleted(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20, segment_bytes=64)
    wal.start()

    async def scenario() -> None:
        for i in range(6):
            b = batch(b"y" * 40 + bytes([i]))
            assert await wal.logged(b)
            seq = wal.take(b)
            assert seq is not None
            if i < 4:
                wal.release(seq)

    asyncio.run(scenario())
    stats = wal.stats()
    assert stats.released == 4
    assert stats.live_entries == 2
    # Each record fills a segment: the released ones' files are gone.
    assert len(segments(tmp_path)) == 2
    found = IngestLog(tmp_path, max_bytes=1 << 20).recovered()
    assert [e.payload[-1] for e in found] == [4, 5]
    wal.close()


def test_a_release_before_the_sync_is_kept_until_written_and_then_dropped(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)

    async def scenario() -> None:
        b = batch(b"early")
        waiting = asyncio.ensure_future(wal.logged(b))
        await asyncio.sleep(0)  # registered, not written: the committer is not started
        seq = wal.take(b)
        assert seq is not None
        wal.release(seq)
        wal.start()
        assert await waiting

    asyncio.run(scenario())
    assert wal.stats().released == 1
    assert wal.stats().live_entries == 0
    wal.close()


def test_a_full_log_refuses_so_the_receiver_throttles(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=300)
    wal.start()
    results = asyncio.run(log_all(wal, [batch(b"z" * 100) for _ in range(4)]))
    assert results[:2] == [True, True]
    assert results[2:] == [False, False]
    assert wal.stats().refused_full == 2
    wal.close()


def test_one_entry_over_the_bound_is_admitted_when_nothing_else_is_held(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=10)
    wal.start()
    assert asyncio.run(log_all(wal, [batch(b"big" * 100)])) == [True]
    wal.close()


@pytest.mark.parametrize("cut", [1, 5, 12, 30])
def test_a_torn_tail_is_skipped_and_counted(tmp_path: Path, cut: int) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()
    assert all(asyncio.run(log_all(wal, [batch(f"entry {i}".encode() * 3) for i in range(3)])))
    wal.close()
    (path,) = segments(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])  # a kill in the middle of the last record
    again = IngestLog(tmp_path, max_bytes=1 << 20)
    found = again.recovered()
    assert [e.payload for e in found] == [f"entry {i}".encode() * 3 for i in range(2)]
    assert again.stats().torn_tails == 1


def test_a_corrupt_record_ends_its_segment(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()
    assert all(asyncio.run(log_all(wal, [batch(b"a" * 20), batch(b"b" * 20)])))
    wal.close()
    (path,) = segments(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the second record's body: its CRC fails
    path.write_bytes(bytes(data))
    entries, marks, torn = read_segment(path)
    assert [e.payload for e in entries] == [b"a" * 20]
    assert (marks, torn) == ([], 1)


def test_a_foreign_file_is_left_alone_and_counted(tmp_path: Path) -> None:
    (tmp_path / "00000000000000000001.log").write_bytes(b"not a log file at all")
    (tmp_path / "notes.log").write_bytes(b"ignored: not a segment name")
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    assert wal.recovered() == []
    assert wal.stats().bad_segments == 1
    wal.start()
    assert asyncio.run(log_all(wal, [batch(b"new")])) == [True]  # in a segment of its own
    wal.close()
    assert (tmp_path / "00000000000000000001.log").read_bytes() == b"not a log file at all"


def test_new_entries_go_to_a_new_segment_after_recovery(tmp_path: Path) -> None:
    first = IngestLog(tmp_path, max_bytes=1 << 20)
    first.start()
    assert all(asyncio.run(log_all(first, [batch(b"old")])))
    first.close()
    second = IngestLog(tmp_path, max_bytes=1 << 20)
    (old,) = second.recovered()
    second.start()

    async def scenario() -> None:
        b = batch(b"new")
        assert await second.logged(b)
        assert second.take(b) == old.seq + 1  # sequence numbers go on

    asyncio.run(scenario())
    assert len(segments(tmp_path)) == 2
    second.release(old.seq)  # replayed and stored: its segment goes
    assert len(segments(tmp_path)) == 1
    assert second.stats().live_bytes > 0
    second.close()
    assert [e.payload for e in IngestLog(tmp_path, max_bytes=1 << 20).recovered()] == [b"new"]


def test_a_write_error_refuses_and_the_next_round_uses_a_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()
    assert all(asyncio.run(log_all(wal, [batch(b"before")])))
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def sync(fd: int) -> None:
        if failures:
            raise failures.pop()
        os.fsync(fd)

    monkeypatch.setattr(wal_module, "_sync", sync)
    assert asyncio.run(log_all(wal, [batch(b"refused")])) == [False]
    stats = wal.stats()
    assert (stats.write_errors, stats.live_entries) == (1, 1)
    assert asyncio.run(log_all(wal, [batch(b"after")])) == [True]
    wal.close()
    assert len(segments(tmp_path)) == 2
    found = [e.payload for e in IngestLog(tmp_path, max_bytes=1 << 20).recovered()]
    # What was refused may be found too (written, not synced): judged again, harmlessly.
    assert found[0] == b"before" and found[-1] == b"after"


def test_segment_files_start_with_the_magic(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()
    assert all(asyncio.run(log_all(wal, [batch(b"m")])))
    wal.close()
    (path,) = segments(tmp_path)
    assert path.read_bytes().startswith(MAGIC)


def test_no_log_acknowledges_everything_and_keeps_nothing() -> None:
    nothing = NoLog()
    assert asyncio.run(nothing.logged(batch(b"x")))
    assert nothing.take(batch(b"x")) is None
    assert not nothing.stats().enabled


def test_release_marks_keep_released_entries_from_being_replayed(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()

    async def scenario() -> list[int]:
        sent = [batch(bytes([i]) * 10) for i in range(4)]
        assert await log_all(wal, sent) == [True] * 4
        seqs = [wal.take(b) for b in sent]
        wal.release(seqs[0])
        wal.release(seqs[2])
        assert await wal.logged(batch(b"later"))  # the marks go with the next round
        return [s for s in seqs if s is not None]

    seqs = asyncio.run(scenario())
    # Not closed (kill -9): the entries released before the last round are not replayed.
    again = IngestLog(tmp_path, max_bytes=1 << 20)
    assert [e.seq for e in again.recovered()] == [seqs[1], seqs[3], seqs[3] + 1]
    # The segment stays (it holds live entries): its released ones are marked again.
    again.start()
    again.close()
    third = IngestLog(tmp_path, max_bytes=1 << 20)
    assert [e.seq for e in third.recovered()] == [seqs[1], seqs[3], seqs[3] + 1]
    wal.close()


def test_an_unusable_log_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "state.db.ingest-log").write_text("a file where the directory goes")
    policy = load_policy()
    settings = Settings(state_path=tmp_path / "state.db", token_file=tmp_path / "token")
    with pytest.raises(ConfigError, match="cannot open the ingest log"):
        build_sidecar(settings, policy)


class Recorded:
    """A log that records what is released."""

    def __init__(self) -> None:
        self.released: list[int] = []

    async def admit(self, batch: Batch, offer: Callable[[Batch], bool]) -> bool:
        return offer(batch)

    def take(self, batch: Batch) -> int | None:
        return None

    def release(self, seq: int) -> None:
        self.released.append(seq)


def test_an_entry_is_released_once_every_outcome_of_it_is_stored() -> None:
    log = Recorded()
    releases = Releases(log)
    a, b, c, stall = object(), object(), object(), object()
    releases.expect(1, [a, b])
    releases.expect(2, [c])
    releases.expect(3, [])  # no failures: released at once
    assert log.released == [3]
    releases.stored([a, stall])  # a stall's outcome is no entry's
    assert log.released == [3]
    releases.stored([c, b])  # batches stored together
    assert sorted(log.released) == [1, 2, 3]
    assert releases.pending == 0


def test_outcomes_never_stored_keep_their_entry() -> None:
    log = Recorded()
    releases = Releases(log)
    releases.expect(7, [object()])  # dropped by the writer: never stored
    assert (log.released, releases.pending) == ([], 1)


@dataclass
class SameId:
    """An outcome as ``Releases`` tells them apart: by ``id``, here chosen."""

    ident: int


def test_a_dropped_outcome_is_forgotten_so_a_later_one_cannot_release_its_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CPython reuses the id of a freed object: an outcome the writer dropped, then
    # freed, shares its id with a later one, which must not release the entry.
    import supervisor.ingest.wal as wal

    monkeypatch.setattr(wal, "id", lambda o: o.ident, raising=False)
    log = Recorded()
    releases = Releases(log)
    releases.expect(7, [SameId(1)])
    releases.dropped([SameId(1)])  # the store writer's bound: never stored
    releases.stored([SameId(1)])  # a later outcome (a stall) with the same id
    assert (log.released, releases.pending) == ([], 1)


def test_a_release_is_written_at_once_so_a_kill_right_after_does_not_replay_it(
    tmp_path: Path,
) -> None:
    wal = IngestLog(tmp_path, max_bytes=1 << 20)
    wal.start()

    async def scenario() -> int:
        b = batch(b"judged and stored")
        assert await wal.logged(b)
        seq = wal.take(b)
        assert seq is not None
        return seq

    seq = asyncio.run(scenario())
    wal.release(seq)  # no request follows: the mark is written by itself
    wait_until(
        lambda: any(seq in read_segment(path)[1] for path in segments(tmp_path)), 5, "the mark"
    )
    wal.close()
