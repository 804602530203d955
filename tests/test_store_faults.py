"""Storage faults degrade, they do not drop: a full disk keeps judged failures, then stores them.

The disk is made full for real: SQLite's ``max_page_count`` (the store's own
quota, answered with ``SQLITE_FULL``, "database or disk is full", exactly as a
full file system is) and, where the tests may mount one, a tiny tmpfs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from policies import load_policy
from supervisor.act.actor import Actor
from supervisor.act.store import Store
from supervisor.act.store_writer import Backoff, StoreWriter
from supervisor.app import BackgroundSidecar
from supervisor.ingest.queue import Batch, IngestQueue
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action
from supervisor.settings import AgentDelivery, PullChannel
from supervisor.wiring import build_sidecar
from tests.test_api import _outcome
from tests.test_app import settings
from tests.test_ingest_receivers import EXPORT_METHOD

FULL_ERROR = "database or disk is full"


def _disk(store: Store, *, full: bool) -> None:
    """Give the store no room beyond what it holds (full), or room again."""
    with store._lock:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count={pages if full else 1_000_000_000}")


def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def _batches(count: int, size: int) -> list[list[Outcome]]:
    return [
        [_outcome(Action.RETRY, span=f"{b:08x}{n:08x}") for n in range(size)] for b in range(count)
    ]


def _stored_spans(store: Store) -> list[str]:
    with store._lock:
        rows = store._db.execute("SELECT span_id FROM incidents ORDER BY rowid").fetchall()
    return [row[0] for row in rows]


class _Running:
    """A writer on a loop of its own thread, as the sidecar runs it."""

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> StoreWriter:
        self.writer.start(self.loop)
        return self.writer

    def __exit__(self, *_: object) -> None:
        self.writer.close(10.0)
        self.loop.close()


def test_failures_judged_while_the_disk_is_full_are_kept_and_stored_once_when_it_comes_back(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "state.db")
    writer = StoreWriter(Actor(store, {}), backoff=Backoff(0.005, 0.05))
    batches = _batches(30, 100)  # 3,000 failures, as in the report
    _disk(store, full=True)
    with _Running(writer):
        for batch in batches:
            writer.put(batch)
        _until(lambda: writer.health().waiting_failures == 3000)
        health = writer.health()
        assert health.failing_since is not None and FULL_ERROR in health.last_error
        # Per failure, not per batch: each refused try counts its 100-failure batches.
        assert health.failed_attempts >= 100 and health.failed_attempts % 100 == 0
        assert health.dropped_failures == 0
        reason = writer.degraded()
        assert reason is not None and reason.startswith("store failing since ")
        assert "3000 judged failures wait to be stored" in reason
        _until(lambda: writer.errors > 6000)  # retried meanwhile, still refused
        assert _stored_spans(store) == []

        _disk(store, full=False)
        _until(lambda: writer.health().waiting_failures == 0)
        assert writer.degraded() is None and writer.health().failing_since is None
    expected = [o.failure.span_id for batch in batches for o in batch]
    assert _stored_spans(store) == expected  # all, in order, once each
    assert (writer.stored, store.duplicates) == (3000, 0)
    store.close()


def test_what_is_kept_is_bounded_and_what_is_dropped_is_counted_per_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(tmp_path / "state.db")
    writer = StoreWriter(Actor(store, {}), max_retained_failures=250, backoff=Backoff(0.005, 0.05))
    batches = _batches(5, 100)
    _disk(store, full=True)
    with _Running(writer):
        for batch in batches:
            writer.put(batch)
        _until(lambda: writer.health().dropped_failures == 300)
        assert writer.health().waiting_failures == 200
        assert "judged failures dropped" in caplog.text
        _disk(store, full=False)
        _until(lambda: writer.health().waiting_failures == 0)
    # The oldest are kept (in order); those beyond the bound were refused, not stored late.
    assert _stored_spans(store) == [o.failure.span_id for b in batches[:2] for o in b]
    store.close()


def test_a_commit_the_disk_refuses_leaves_the_store_usable_and_counts_nothing(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "state.db")
    actor = Actor(store, {"*": AgentDelivery(pull=PullChannel())})
    _disk(store, full=True)
    for _ in range(2):  # the second would fail differently if the first left a transaction
        with pytest.raises(Exception, match=FULL_ERROR):
            actor.store_outcomes(_batches(1, 200)[0])
    assert (store.waiting, store.duplicates) == (0, 0)
    _disk(store, full=False)
    actor.store_outcomes(_batches(1, 200)[0])
    assert (store.waiting, store.duplicates, len(_stored_spans(store))) == (200, 0, 200)
    store.close()


def test_ingest_throttles_once_the_kept_failures_pass_the_threshold(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    writer = StoreWriter(Actor(store, {}), max_retained_failures=400, backoff=Backoff(0.005, 0.05))
    ingest = IngestQueue(max_batches=100, max_spans=100_000)
    ingest.hold_while(writer.pressure)
    request = Batch(ExportTraceServiceRequest(), b"", 0, "grpc", 1)
    _disk(store, full=True)
    with _Running(writer):
        assert ingest.offer(request)
        writer.put(_batches(1, 199)[0])
        _until(lambda: writer.health().waiting_failures == 199)
        assert ingest.offer(request)  # below half the bound: accepted
        writer.put([_outcome(Action.RETRY, span="ff" * 8)])
        _until(lambda: writer.health().waiting_failures == 200)
        assert not ingest.offer(request)  # half the bound: throttled, nothing dropped
        assert ingest.stats().throttled_batches == 1 and writer.health().dropped_failures == 0
        _disk(store, full=False)
        _until(lambda: writer.health().waiting_failures == 0)
        assert ingest.offer(request)
    store.close()


def _failing_request(first: int, count: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    spans = resource.scope_spans.add().spans
    for n in range(first, first + count):
        span = spans.add()
        span.trace_id = n.to_bytes(16, "big")
        span.span_id = (n + 1).to_bytes(8, "big")
        span.name = "ChatCompletion"
        span.attributes.extend(
            [
                KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")),
                KeyValue(key="llm.provider", value=AnyValue(string_value="openai")),
                KeyValue(key="llm.model_name", value=AnyValue(string_value="gpt-4o")),
            ]
        )
        span.status.code = Status.STATUS_CODE_ERROR
        span.status.message = "APITimeoutError: Request timed out."
    return request.SerializeToString()


@pytest.mark.slow
def test_a_sidecar_on_a_full_disk_is_degraded_throttles_ingest_and_stores_everything_later(
    tmp_path: Path,
) -> None:
    sidecar = build_sidecar(
        settings(tmp_path, state_path=str(tmp_path / "state.db"), store_retain_failures=400),
        load_policy(),
    )
    background = BackgroundSidecar(sidecar)
    ports = background.start()
    api = f"http://127.0.0.1:{ports.api}"
    otlp = f"http://127.0.0.1:{ports.otlp_http}/v1/traces"
    auth = {"Authorization": "Bearer tok"}
    try:
        assert httpx.get(f"{api}/readyz").status_code == 200
        _disk(sidecar.store, full=True)
        accepted = 0
        throttled: httpx.Response | None = None
        for n in range(40):  # 50 failures each: the threshold (200 kept) comes first
            answer = httpx.post(
                otlp,
                content=_failing_request(n * 50, 50),
                headers={"Content-Type": "application/x-protobuf"},
            )
            if answer.status_code == 503:
                throttled = answer
                break
            assert answer.status_code == 200
            accepted += 50
            # The judging is asynchronous: let the kept count catch up with ingest.
            _until(lambda n=n: sidecar.writer.health().waiting_failures >= (n + 1) * 50)
        assert throttled is not None and throttled.headers["Retry-After"] == "1"
        assert accepted == 200
        with (
            grpc.insecure_channel(f"127.0.0.1:{ports.otlp_grpc}") as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            channel.unary_unary(EXPORT_METHOD)(_failing_request(5_000, 1), timeout=5)
        error = refused.value
        assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(error.trailing_metadata() or ())
        info = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
        assert info.retry_delay.seconds == 1
        ready = httpx.get(f"{api}/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "degraded"
        assert ready.json()["degraded"][0].startswith("store failing since ")
        live = httpx.get(f"{api}/healthz")  # liveness: a restart would not free the disk
        assert live.status_code == 200 and live.json()["status"] == "degraded"
        store_stats = httpx.get(f"{api}/v1/stats", headers=auth).json()["delivery"]["store"]
        assert store_stats["failing"] and store_stats["waiting_failures"] == accepted
        assert store_stats["dropped_failures"] == 0

        _disk(sidecar.store, full=False)
        _until(lambda: httpx.get(f"{api}/readyz").status_code == 200)
        assert len(_stored_spans(sidecar.store)) == accepted  # each acknowledged one, once
        answer = httpx.post(
            otlp,
            content=_failing_request(10_000, 1),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert answer.status_code == 200
    finally:
        background.stop()


@contextlib.contextmanager
def _tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_real_full_file_system_then_room_again(tmp_path: Path) -> None:
    with _tiny_tmpfs(tmp_path / "disk", "8m") as disk:
        store = Store.open(disk / "state.db")
        writer = StoreWriter(Actor(store, {}), backoff=Backoff(0.005, 0.05))
        filler = disk / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as fh:
            while True:  # until the file system says ENOSPC
                fh.write(b"\0" * 4096)
                fh.flush()
        batches = _batches(20, 100)
        with _Running(writer):
            for batch in batches:
                writer.put(batch)
            _until(lambda: writer.health().waiting_failures == 2000)
            assert writer.health().waiting_failures == 2000
            assert writer.degraded() is not None
            filler.unlink()  # room again
            _until(lambda: writer.health().waiting_failures == 0)
        assert _stored_spans(store) == [o.failure.span_id for b in batches for o in b]
        store.close()


def test_the_delay_between_tries_doubles_up_to_its_bound_and_starts_again_after_success() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next_delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == 0.1


def test_retries_wait_for_the_delay_on_the_injected_clock(tmp_path: Path) -> None:
    now = [0.0]
    store = Store.open(tmp_path / "state.db")
    writer = StoreWriter(
        Actor(store, {}),
        clock=lambda: now[0],
        backoff=Backoff(1000.0, 1000.0),
        min_commit_interval_s=0,
    )
    _disk(store, full=True)
    with _Running(writer):
        writer.put(_batches(1, 10)[0])
        _until(lambda: writer.health().waiting_failures == 10)
        tried = writer.errors
        _disk(store, full=False)
        writer.put([_outcome(Action.RETRY, span="ee" * 8)])  # wakes the writer: kept, not tried
        _until(lambda: writer.health().waiting_failures == 11)
        assert writer.errors == tried and _stored_spans(store) == []
        now[0] = 1000.0  # the delay is over on the writer's clock
        writer.put([_outcome(Action.RETRY, span="ef" * 8)])
        _until(lambda: writer.health().waiting_failures == 0)
    assert len(_stored_spans(store)) == 12
    store.close()
