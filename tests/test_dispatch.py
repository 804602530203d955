"""The dispatcher against a real webhook receiver on 127.0.0.1, over a real SQLite file.

The receiver is a threaded HTTP server whose answers each test scripts (200,
503 with Retry-After, 500, 400, silence). The dispatcher runs with a fake
clock: a test advances it and calls ``wake()``, so backoffs and ``not_before``
delays cost no real time. Waits poll the store with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from supervisor.act import signing
from supervisor.act.actuators.webhook import WebhookActuator
from supervisor.act.dispatch import PUSH_CHANNELS, Dispatcher, actuator_table
from supervisor.act.store import NewIncident, Store, StoredCommand
from supervisor.records import Command, CommandType, command_key
from supervisor.testing.loopback import LoopbackHTTPServer, LoopbackServer

SECRET = "whsec_" + "ZGlzcGF0Y2gtdGVzdHMtc2VjcmV0LTEyMzQ1Ng=="
TRACE = "5b8efff798038103d269b633813fc60c"
T0 = 1_700_000_000.0

# -- a scriptable webhook receiver (also used by test_exactly_once) -------------


@dataclass(frozen=True)
class Answer:
    """What the receiver answers one request: a status, or silence for ``hang_s``."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b'{"ok": true}'
    hang_s: float = 0.0


@dataclass
class Delivery:
    """One request as the receiver saw it, and what it answered."""

    headers: dict[str, str]  # lower-cased names
    body: bytes
    #: When it arrived (time.monotonic()).
    at: float = field(default_factory=time.monotonic)
    #: The status written back; None while hanging or when the client was gone.
    answered: int | None = None

    @property
    def key(self) -> str:
        return self.headers.get("idempotency-key", "")

    @property
    def message_id(self) -> str:
        return self.headers.get(signing.ID_HEADER, "")

    def json(self) -> Any:
        return json.loads(self.body)


Respond = Callable[[Delivery], Answer]


class _Handler(BaseHTTPRequestHandler):
    server: LoopbackHTTPServer[WebhookReceiver]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output quiet

    def do_POST(self) -> None:
        receiver = self.server.context
        length = int(self.headers.get("Content-Length") or 0)
        delivery = Delivery(
            {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(length)
        )
        answer = receiver.arrived(delivery)
        if answer.hang_s:
            receiver.release.wait(answer.hang_s)
        try:
            self.send_response(answer.status)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)
            self.wfile.flush()
        except OSError:
            return  # the client gave up (a timeout) or died (kill -9)
        receiver.answered(delivery, answer.status)


class WebhookReceiver:
    """An agent's webhook endpoint on a free port; ``respond`` decides each answer.

    By default it answers the scripted answers in turn (``script``), then 200.
    Every request is recorded in arrival order, with the status written back.
    """

    def __init__(self, respond: Respond | None = None) -> None:
        self.script: deque[Answer] = deque()
        self._respond = respond or self._scripted
        self.deliveries: list[Delivery] = []
        self.release = threading.Event()  # ends every hang at once (teardown)
        self._lock = threading.Lock()
        self._http = LoopbackServer(_Handler, self, name="webhook-receiver", poll_interval_s=0.01)

    @property
    def url(self) -> str:
        return f"{self._http.url}/hooks/spanvisor"

    def __enter__(self) -> WebhookReceiver:
        self._http.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release.set()  # ends every hang; no handler thread outlives the test
        self._http.stop(10)

    def _scripted(self, delivery: Delivery) -> Answer:
        return self.script.popleft() if self.script else Answer(200)

    def arrived(self, delivery: Delivery) -> Answer:
        with self._lock:
            self.deliveries.append(delivery)
            return self._respond(delivery)

    def answered(self, delivery: Delivery, status: int) -> None:
        with self._lock:
            delivery.answered = status

    def seen(self) -> list[Delivery]:
        with self._lock:
            return list(self.deliveries)

    def keys(self) -> list[str]:
        return [d.key for d in self.seen()]

    def acknowledged(self) -> set[str]:
        """Idempotency keys the receiver answered 2xx (the answer was written)."""
        return {d.key for d in self.seen() if d.answered is not None and d.answered < 300}


# -- the dispatcher's world: a fake clock, a real store, a real actuator ---------


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class WatchedStore(Store):
    """A real store that remembers every ``due()`` answer: when the dispatcher looked
    and what it found, so a test can tell that a command was *not* due."""

    looks: list[tuple[float, list[str]]]

    def due(self, channels: Sequence[str], now: float, limit: int) -> list[StoredCommand]:
        found = super().due(channels, now, limit)
        self.looks.append((now, [c.command.id for c in found]))
        return found


def open_store(path: Path) -> WatchedStore:
    store = WatchedStore.open(path)
    assert isinstance(store, WatchedStore)
    store.looks = []
    return store


def make_command(n: int, *, service: str = "agent", not_before: float = T0) -> Command:
    span = f"{n:016x}"
    key = command_key(TRACE, span, "builtin.sdk.timeout", "retry")
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=CommandType.RETRY_STEP,
        service=service,
        run_id=f"run-{n}",
        trigger_trace_id=TRACE,
        trigger_span_id=span,
        failure={"class": "transient", "kind": "timeout", "rule": "builtin.sdk.timeout"},
        params={"dependency": "tool:search", "reason": "Tool 'search' timed out", "delay_s": 0},
        not_before=not_before,
        created_at=T0,
    )


def record(store: Store, *commands: Command) -> None:
    store.record(
        [
            NewIncident(
                key=command_key(TRACE, c.trigger_span_id, "builtin.sdk.timeout"),
                trace_id=TRACE,
                span_id=c.trigger_span_id,
                rule="builtin.sdk.timeout",
                service=c.service,
                run_id=c.run_id,
                action="retry",
                body={"span_id": c.trigger_span_id},
                commands=[(c, "webhook")],
            )
            for c in commands
        ],
        T0,
    )


def stored(store: Store, command: Command) -> StoredCommand:
    found = store.command(command.id)
    assert found is not None
    return found


async def eventually(predicate: Callable[[], Any], what: str, timeout_s: float = 5.0) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.005)


class Harness:
    """A started dispatcher over ``store`` with one webhook actuator for service ``agent``."""

    def __init__(
        self,
        store: WatchedStore,
        receiver: WebhookReceiver,
        *,
        max_attempts: int = 8,
        timeout_s: float = 5.0,
        concurrency: int = 16,
        backoff_max_s: float = 1.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self.receiver = receiver
        self.clock = clock or Clock()
        self.actuator = WebhookActuator(url=receiver.url, secret=SECRET, timeout_s=timeout_s)
        self.dispatcher = Dispatcher(
            store,
            actuator_table({"agent": self.actuator}),
            max_attempts=lambda service: max_attempts,
            backoff_max_s=backoff_max_s,
            concurrency=concurrency,
            clock=self.clock,
        )

    async def __aenter__(self) -> Harness:
        await self.actuator.start()
        self.dispatcher.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.dispatcher.shutdown(1.0)
        await self.actuator.close()

    async def advance(self, seconds: float) -> float:
        """Move the clock on, wake the dispatcher and wait until it has looked at that time."""
        assert isinstance(self.clock, Clock), "only a fake clock can be moved"
        self.clock.now += seconds
        target = self.clock.now
        self.dispatcher.wake()
        await eventually(
            lambda: any(now >= target for now, _ in self.store.looks), f"a look at t={target}"
        )
        return target

    async def attempts(self, command: Command, n: int) -> StoredCommand:
        """Wait until ``n`` attempts of ``command`` are recorded (and none is in flight)."""

        def done() -> StoredCommand | None:
            found = stored(self.store, command)
            idle = self.dispatcher.stats().in_flight == 0
            return found if found.attempts >= n and idle else None

        result: StoredCommand = await eventually(done, f"{n} attempts of {command.id}")
        return result


@pytest.fixture
def store(tmp_path: Path) -> Iterator[WatchedStore]:
    opened = open_store(tmp_path / "state.db")
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as running:
        yield running


# -- the tests ---------------------------------------------------------------------


def test_a_due_command_is_posted_once_signed_with_its_idempotency_key_then_recorded_delivered(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    command = make_command(1)
    record(store, command)

    async def scenario() -> StoredCommand:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            return await h.attempts(command, 1)

    result = asyncio.run(scenario())

    assert (result.status, result.attempts, result.last_error) == ("delivered", 1, "")
    [delivery] = receiver.seen()
    assert delivery.key == command.idempotency_key
    assert signing.verify(SECRET, delivery.headers, delivery.body) == command.id
    assert delivery.json() == command.to_json()
    assert delivery.headers["content-type"] == "application/json"
    assert store.due(PUSH_CHANNELS, T0 + 1e6, 10) == []


def test_a_503_with_retry_after_is_retried_no_sooner_than_asked_then_delivered(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    receiver.script.append(Answer(503, {"Retry-After": "7"}, b"busy"))
    command = make_command(1)
    record(store, command)

    async def scenario() -> tuple[StoredCommand, StoredCommand, list[str]]:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            failed = await h.attempts(command, 1)
            looked = await h.advance(6.9)
            found_early = [ids for now, ids in store.looks if now == looked]
            await h.advance(0.1)
            delivered = await h.attempts(command, 2)
            assert (h.dispatcher.stats().delivered, h.dispatcher.stats().failed_attempts) == (1, 1)
            return failed, delivered, [i for ids in found_early for i in ids]

    failed, delivered, found_early = asyncio.run(scenario())

    assert (failed.status, failed.attempts, failed.last_error) == (
        "pending",
        1,
        "503 Service Unavailable: busy",
    )
    assert failed.next_attempt_at == T0 + 7  # the receiver's Retry-After beats a 1 s backoff
    assert found_early == []  # at T0 + 6.9 the dispatcher found nothing due
    assert (delivered.status, delivered.attempts) == ("delivered", 2)
    assert receiver.keys() == [command.idempotency_key] * 2
    assert [d.message_id for d in receiver.seen()] == [command.id] * 2
    assert receiver.seen()[0].body == receiver.seen()[1].body


def test_a_receiver_that_always_fails_dead_letters_the_command_after_max_attempts(
    store: WatchedStore,
) -> None:
    command = make_command(1)
    record(store, command)

    async def scenario(receiver: WebhookReceiver) -> StoredCommand:
        async with Harness(store, receiver, max_attempts=3) as h:
            h.dispatcher.wake()
            for n in (1, 2):
                assert (await h.attempts(command, n)).status == "pending"
                await h.advance(1.0)  # past any backoff (capped at 1 s here)
            dead = await h.attempts(command, 3)
            await h.advance(3600.0)
            assert h.dispatcher.stats().dead_lettered == 1
            return dead

    with WebhookReceiver(lambda d: Answer(500, body=b"database is down")) as receiver:
        dead = asyncio.run(scenario(receiver))
        seen = receiver.keys()

    assert (dead.status, dead.attempts, dead.last_error) == (
        "dead",
        3,
        "3 attempts: 500 Internal Server Error: database is down",
    )
    assert dead.finished_at is not None
    assert seen == [command.idempotency_key] * 3  # and no fourth, even an hour later
    assert [c.command.id for c in store.commands(status="dead")] == [command.id]


def test_a_400_dead_letters_the_command_at_once(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    receiver.script.append(Answer(400, body=b'{"error": "unknown run"}'))
    command = make_command(1)
    record(store, command)

    async def scenario() -> StoredCommand:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            dead = await h.attempts(command, 1)
            await h.advance(3600.0)
            return dead

    dead = asyncio.run(scenario())

    assert (dead.status, dead.attempts, dead.last_error) == (
        "dead",
        1,
        '400 Bad Request: {"error": "unknown run"}',
    )
    assert receiver.keys() == [command.idempotency_key]


def test_a_hanging_receiver_times_out_and_the_command_is_sent_again(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    receiver.script.append(Answer(200, hang_s=5.0))  # answers only after the sender gave up
    command = make_command(1)
    record(store, command)

    async def scenario() -> tuple[StoredCommand, StoredCommand]:
        async with Harness(store, receiver, timeout_s=0.3) as h:
            h.dispatcher.wake()
            timed_out = await h.attempts(command, 1)
            await h.advance(1.0)
            return timed_out, await h.attempts(command, 2)

    timed_out, delivered = asyncio.run(scenario())

    assert (timed_out.status, timed_out.last_error) == (
        "pending",
        "TimeoutError: no answer within 0.3s",
    )
    assert (delivered.status, delivered.attempts) == ("delivered", 2)
    assert receiver.keys() == [command.idempotency_key] * 2


def test_a_command_is_not_delivered_before_its_not_before(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    command = make_command(1, not_before=T0 + 30)
    record(store, command)

    async def scenario() -> tuple[int, StoredCommand]:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            await h.advance(0.0)
            await h.advance(29.9)
            early = len(receiver.seen())
            await h.advance(0.1)
            return early, await h.attempts(command, 1)

    early, delivered = asyncio.run(scenario())

    assert early == 0
    assert [ids for now, ids in store.looks if now < T0 + 30 and ids] == []
    assert delivered.status == "delivered"
    assert receiver.keys() == [command.idempotency_key]
    assert receiver.seen()[0].json()["not_before"] == "2023-11-14T22:13:50.000Z"


def test_a_command_for_a_service_with_no_actuator_is_dead_lettered_with_the_reason(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    command = make_command(1, service="billing-agent")
    record(store, command)

    async def scenario() -> StoredCommand:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            return await h.attempts(command, 1)

    dead = asyncio.run(scenario())

    assert (dead.status, dead.last_error) == (
        "dead",
        "no delivery channel is configured for service 'billing-agent'",
    )
    assert receiver.seen() == []


def test_many_due_commands_are_each_delivered_exactly_once(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    commands = [make_command(n) for n in range(40)]
    record(store, *commands)

    async def scenario() -> None:
        async with Harness(store, receiver, concurrency=4) as h:
            h.dispatcher.wake()
            await eventually(
                lambda: len(store.commands(status="delivered")) == len(commands),
                "every command delivered",
            )
            await h.advance(3600.0)

    asyncio.run(scenario())

    assert sorted(receiver.keys()) == sorted(c.idempotency_key for c in commands)
    assert [stored(store, c).attempts for c in commands] == [1] * len(commands)


def test_a_delivery_cut_short_by_shutdown_is_sent_again_by_the_next_dispatcher(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    receiver.script.append(Answer(200, hang_s=5.0))
    command = make_command(1)
    path = tmp_path / "state.db"
    first = open_store(path)
    record(first, command)

    async def cut_short() -> StoredCommand:
        async with Harness(first, receiver) as h:
            h.dispatcher.wake()
            await eventually(receiver.seen, "the first attempt to arrive")
            await h.dispatcher.shutdown(0.05)  # the attempt in flight is cancelled
            return stored(first, command)

    try:
        interrupted = asyncio.run(cut_short())
    finally:
        first.close()

    second = open_store(path)

    async def resumed() -> StoredCommand:
        async with Harness(second, receiver) as h:
            h.dispatcher.wake()
            return await h.attempts(command, 1)

    try:
        delivered = asyncio.run(resumed())
    finally:
        second.close()

    assert (interrupted.status, interrupted.attempts) == ("pending", 0)
    assert (delivered.status, delivered.attempts) == ("delivered", 1)
    assert receiver.keys() == [command.idempotency_key] * 2
    assert receiver.seen()[0].body == receiver.seen()[1].body


def test_while_a_delivery_hangs_the_dispatcher_does_not_poll_the_store_in_a_tight_loop(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    # Regression: an attempt in flight is still 'pending' and past due, so the loop
    # found it due, clamped its wait to 1 ms and re-queried the store ~350 times
    # during a 0.5 s answer.
    receiver.script.append(Answer(200, hang_s=0.5))
    command = make_command(1)
    record(store, command)

    async def scenario() -> int:
        async with Harness(store, receiver) as h:
            h.dispatcher.wake()
            await eventually(receiver.seen, "the attempt to arrive")
            before = len(store.looks)
            await h.attempts(command, 1)  # ~0.5 s with nothing else to do
            return len(store.looks) - before

    looks = asyncio.run(scenario())

    assert looks <= 10


class UnreachableStore(WatchedStore):
    """A store whose reads fail while ``failing`` (a database server that is down)."""

    failing = True

    def due(self, channels: Sequence[str], now: float, limit: int) -> list[StoredCommand]:
        if self.failing:
            self.looks.append((now, []))
            raise OSError("connection refused")
        return super().due(channels, now, limit)


def test_a_store_that_fails_every_read_is_logged_once_then_once_when_it_reads_again(
    tmp_path: Path, receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    store = UnreachableStore.open(tmp_path / "state.db")
    assert isinstance(store, UnreachableStore)
    store.looks = []
    command = make_command(1)
    record(store, command)

    async def scenario() -> StoredCommand:
        async with Harness(store, receiver) as h:
            for _ in range(5):
                await h.advance(1.0)
            store.failing = False
            await h.advance(1.0)
            return await h.attempts(command, 1)

    with caplog.at_level(logging.INFO, logger="spanvisor.dispatch"):
        try:
            delivered = asyncio.run(scenario())
        finally:
            store.close()

    assert delivered.status == "delivered"
    said = [r for r in caplog.records if "due commands" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        ("ERROR", "could not read due commands; trying again every second"),
        ("WARNING", "due commands are read again"),
    ]
    assert getattr(said[1], "failed_reads", 0) >= 5  # every failed pass, counted


def test_a_failed_attempt_is_retried_when_its_backoff_ends_not_at_the_next_idle_wake(
    store: WatchedStore, receiver: WebhookReceiver
) -> None:
    receiver.script.append(Answer(503, body=b"busy"))  # no Retry-After: the backoff decides
    command = make_command(1, not_before=time.time())
    record(store, command)

    async def scenario() -> StoredCommand:
        # The real clock: what is pinned is how soon, in real time, the loop notices.
        async with Harness(store, receiver, backoff_max_s=0.05, clock=time.time) as h:
            h.dispatcher.wake()
            return await h.attempts(command, 2)

    delivered = asyncio.run(scenario())

    first, second = receiver.seen()
    assert delivered.status == "delivered"
    assert second.at - first.at < 0.5  # the backoff is at most 0.05 s


def test_attempts_beyond_an_agents_eight_slots_wait_unsent_and_lose_no_attempt(
    store: WatchedStore,
) -> None:
    """A stalled agent holds eight attempts; a ninth waits its turn outside its own timeout."""
    commands = [make_command(n) for n in range(9)]
    record(store, *commands)

    async def scenario(receiver: WebhookReceiver) -> tuple[int, int]:
        async with Harness(store, receiver, timeout_s=5.0) as h:
            h.dispatcher.wake()
            await eventually(
                lambda: h.dispatcher.stats().in_flight == 9 and len(receiver.seen()) >= 8,
                "nine attempts in flight",
            )
            await asyncio.sleep(0.3)  # far longer than a request to 127.0.0.1 takes
            in_flight, sent = h.dispatcher.stats().in_flight, len(receiver.seen())
            receiver.release.set()  # let the held requests be answered
            await eventually(lambda: h.dispatcher.stats().in_flight == 0, "the attempts to end")
            return in_flight, sent

    with WebhookReceiver(lambda d: Answer(200, hang_s=10.0)) as receiver:  # a stalled agent
        in_flight, sent = asyncio.run(scenario(receiver))

    assert (in_flight, sent) == (9, 8)
    stored = [store.command(c.id) for c in commands]
    assert [(s.status, s.attempts) for s in stored if s is not None] == [("delivered", 1)] * 9
