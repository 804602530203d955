"""supervisor.client.pull against the sidecar's real control API on loopback.

The server is the real thing, minus the OTLP half: :func:`build_control_app`
over a real :class:`~supervisor.api.control.Control`, an in-memory
:class:`~supervisor.act.store.Store` and an :class:`~supervisor.act.actor.Actor` with a
pull channel, served by uvicorn on a free port. Commands are made the way the
sidecar makes them (:meth:`Actor.record` of a decided failure, on the server's
event loop, which wakes long polls), except the malformed ones, which are
written to the store by hand: the sidecar never makes one, but a command the
agent cannot read must not come back forever.

Waits are bounded by the visibility timeouts configured here (a few tenths of
a second); nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import NewIncident, Store, StoredCommand
from supervisor.api.control import Control
from supervisor.api.server import build_control_app
from supervisor.client import SeenCommands, SupervisorClientError
from supervisor.client.pull import Command, CommandPuller, MalformedCommand
from supervisor.judge.pipeline import Outcome
from supervisor.records import (
    Action,
    CommandType,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
)
from supervisor.records import Command as SidecarCommand
from supervisor.settings import AgentDelivery, PullChannel
from tests.postgres import fresh_schema

TOKEN = "pull-test-token-0123456789"
SERVICE = "pull-agent"
#: A second pull service, polling while SERVICE's commands wait.
OTHER = "other-agent"
#: Short, so redelivery is seen within a test; long enough for a lease-then-ack on a busy box.
VISIBILITY_S = 0.3
T = TypeVar("T")


# -- the served control API ----------------------------------------------------------


class Sidecar:
    """The control API on its own event loop thread; commands are added on that loop."""

    def __init__(
        self,
        *,
        port: int = 0,
        services: tuple[str, ...] = (SERVICE,),
        clock: Callable[[], float] = time.time,
        store: str = ":memory:",
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sidecar", daemon=True)
        self.thread.start()
        self.store = Store.open(store, instance_id="served")
        policy = load_policy()
        self.actor = Actor(
            self.store,
            {s: AgentDelivery(pull=PullChannel(visibility_s=VISIBILITY_S)) for s in services},
            clock=clock,  # when commands are made, approvals answered and expired
        )
        control = Control(
            store=self.store,
            actor=self.actor,
            governor=Governor(policy),
            policy=lambda: policy,
            failures=RecentFailures(10),
            stats=dict,
            ready=lambda: True,
            reload=lambda: {"reloaded": False},
        )
        app = build_control_app(token=TOKEN, control=control)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            http="h11",
        )
        self.server = uvicorn.Server(config)
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert not self.serving.done(), self.serving.exception()
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.005)  # polling with a deadline, not synchronising on time
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the server's loop: the store and the waiters are the loop's."""

        async def on_loop() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10)

    def add(self, *outcomes: Outcome) -> list[StoredCommand]:
        """Store the commands the decisions lead to and wake long polls, as the sidecar does."""
        return self.call(lambda: self.actor.record(list(outcomes)))

    def add_later(self, delay_s: float, *outcomes: Outcome) -> None:
        """Like :meth:`add`, ``delay_s`` from now, on the loop (while a poll is held)."""
        self.loop.call_soon_threadsafe(
            lambda: self.loop.call_later(delay_s, self.actor.record, list(outcomes))
        )

    def status(self, command_id: str) -> str:
        found = self.call(lambda: self.store.command(command_id))
        assert found is not None, command_id
        return found.status

    def stop(self) -> None:
        self.server.should_exit = True
        self.serving.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.store.close()


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    served = Sidecar()
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def puller(sidecar: Sidecar) -> Iterator[CommandPuller]:
    with CommandPuller(SERVICE, sidecar.url, TOKEN) as made:
        yield made


_spans = iter(range(1, 1_000_000))


def decided(
    action: Action,
    *,
    service: str = SERVICE,
    run_id: str = "run-1",
    params: dict[str, Any] | None = None,
) -> Outcome:
    """A failure of an LLM call (a span of its own) and the decision about it."""
    span = f"{next(_spans):016x}"
    failure = Failure(
        trace_id="ab" * 16,
        span_id=span,
        parent_span_id="",
        service=service,
        span_name="generation",
        run_id=run_id,
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind="unavailable",
        dependency="openai:gpt-4o",
        rule="builtin.http.unavailable",
        message="Error code: 503 - The server is overloaded; $(rm -rf /) is data",
        evidence=ErrorEvidence(status_error=True, http_status=503),
        received_ns=1,
    )
    return Outcome(failure, Decision(action=action, policy="test", params=params or {}))


def retry(service: str = SERVICE) -> Outcome:
    return decided(Action.RETRY, service=service, params={"attempt": 1, "delay_s": 0})


# -- lease and ack ------------------------------------------------------------------------


def test_poll_leases_due_commands_and_ack_delivers_them(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    [stored_retry] = sidecar.add(retry())
    [stored_fallback] = sidecar.add(
        decided(Action.FALLBACK, run_id="run-2", params={"to": "openai:gpt-4o-mini"})
    )

    commands = puller.poll(wait_s=0)

    assert [c.id for c in commands] == [stored_retry.command.id, stored_fallback.command.id]
    first, second = commands
    expected = stored_retry.command
    assert (first.type, first.service, first.run_id) == ("retry_step", SERVICE, "run-1")
    assert first.idempotency_key == expected.idempotency_key
    assert (first.trigger_trace_id, first.trigger_span_id) == (
        expected.trigger_trace_id,
        expected.trigger_span_id,
    )
    assert first.failure["kind"] == "unavailable"
    assert first.failure["message"].endswith("$(rm -rf /) is data")  # data, kept verbatim
    assert first.params["attempt"] == 1
    # Times come as RFC 3339 (ms) and are read back as unix seconds.
    assert first.not_before == pytest.approx(expected.not_before, abs=0.001)
    assert first.created_at == pytest.approx(expected.created_at, abs=0.001)
    assert (second.type, second.run_id, second.params["to"]) == (
        "switch_fallback",
        "run-2",
        "openai:gpt-4o-mini",
    )
    with pytest.raises(TypeError):
        first.params["to"] = "x"  # type: ignore[index]  # read-only, as it came
    assert sidecar.status(first.id) == "leased"

    assert puller.poll(wait_s=0) == []  # leased: not handed out twice
    assert puller.ack(first) is True
    assert puller.ack(second.id) is True  # by id too
    assert sidecar.status(first.id) == sidecar.status(second.id) == "delivered"
    assert puller.ack(first) is False  # acknowledged already: the sidecar says 409
    assert puller.ack("cmd_never_made") is False  # 404


def test_a_long_poll_is_held_until_a_command_arrives(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    sidecar.add_later(0.3, retry())

    started = time.monotonic()
    [command] = puller.poll(wait_s=10)
    waited = time.monotonic() - started

    assert command.type == "retry_step"
    assert 0.25 <= waited < 3.0  # held by the sidecar, answered when the command came
    assert puller.ack(command) is True


def test_a_long_poll_on_a_fleet_s_store_is_answered_when_another_sidecar_stores_a_command() -> None:
    with fresh_schema() as url:
        served = Sidecar(store=url)
        other = Store.open(url, instance_id="other")
        try:
            actor = Actor(other, {SERVICE: AgentDelivery(pull=PullChannel())})
            timer = threading.Timer(0.3, lambda: actor.record([retry()]))
            timer.start()
            with CommandPuller(SERVICE, served.url, TOKEN) as puller:
                started = time.monotonic()
                [command] = puller.poll(wait_s=10)
                waited = time.monotonic() - started
                assert puller.ack(command) is True
            timer.join()
            stored = served.store.command(command.id)
        finally:
            other.close()
            served.stop()
    assert 0.25 <= waited < 2.0  # not the whole wait: nothing announces it on this sidecar
    assert stored is not None
    assert (stored.status, stored.judged_by, stored.delivered_by) == (
        "delivered",
        "other",
        "served",
    )


def test_a_long_poll_without_commands_ends_empty_after_its_wait(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    started = time.monotonic()
    assert puller.poll(wait_s=0.3) == []
    assert 0.25 <= time.monotonic() - started < 3.0


def test_limit_bounds_one_lease(sidecar: Sidecar) -> None:
    sidecar.add(retry(), retry(), retry())

    with CommandPuller(SERVICE, sidecar.url, TOKEN, limit=2) as puller:
        first = puller.poll(wait_s=0)
        rest = puller.poll(wait_s=0)

    assert (len(first), len(rest)) == (2, 1)
    assert not {c.id for c in first} & {c.id for c in rest}


def test_an_unacknowledged_command_is_handed_out_again_after_the_visibility_timeout(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    sidecar.add(retry())
    seen = SeenCommands()
    [leased] = puller.poll(wait_s=0)
    assert seen.first_time(leased.idempotency_key)
    assert puller.poll(wait_s=0) == []  # within its lease

    # No ack (the agent crashed, say): once the lease runs out it comes again,
    # within a long poll that outlasts the visibility timeout.
    [again] = puller.poll(wait_s=VISIBILITY_S * 1.5)

    assert (again.id, again.idempotency_key) == (leased.id, leased.idempotency_key)
    assert not seen.first_time(again.idempotency_key)  # how the agent drops it
    assert puller.ack(again) is True
    assert puller.poll(wait_s=VISIBILITY_S * 1.5) == []  # acknowledged: gone for good
    assert sidecar.status(leased.id) == "delivered"


def test_a_long_poll_is_answered_when_a_lease_runs_out(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    sidecar.add(retry())
    [leased] = puller.poll(wait_s=0)

    started = time.monotonic()
    [again] = puller.poll(wait_s=VISIBILITY_S * 5)

    assert again.id == leased.id
    assert time.monotonic() - started < VISIBILITY_S * 3


def test_a_long_poll_sleeps_while_another_service_has_a_command_nobody_fetches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SERVICE's command is due and nobody fetches it; OTHER's long poll must not
    # wake for it (it used to lease every 10 ms, ~100 times a second), yet must
    # still be answered when its own lease runs out.
    sidecar = Sidecar(services=(SERVICE, OTHER))
    try:
        [unfetched] = sidecar.add(retry())
        sidecar.add(retry(OTHER))
        leases: list[str] = []
        lease = sidecar.store.lease

        def counted(service: str, now: float, visibility_s: float, limit: int) -> Any:
            leases.append(service)
            return lease(service, now, visibility_s, limit)

        monkeypatch.setattr(sidecar.store, "lease", counted)
        with CommandPuller(OTHER, sidecar.url, TOKEN) as other:
            [mine] = other.poll(wait_s=0)
            assert other.ack(mine) is True

            leases.clear()
            started = time.monotonic()
            assert other.poll(wait_s=1.0) == []
            waited = time.monotonic() - started
            idle_leases = list(leases)

            [held] = sidecar.add(retry(OTHER))
            assert [c.id for c in other.poll(wait_s=0)] == [held.command.id]
            leases.clear()
            [again] = other.poll(wait_s=VISIBILITY_S * 5)  # answered when the lease runs out

        assert 0.9 <= waited < 3.0
        # A look, asleep for the whole wait, a last look (one more if woken a hair early).
        assert set(idle_leases) == {OTHER} and len(idle_leases) <= 3
        assert again.id == held.command.id
        # Asleep until the lease ran out, then the lease (one more if woken a hair early).
        assert set(leases) == {OTHER} and len(leases) <= 3
        assert sidecar.status(unfetched.command.id) == "pending"
    finally:
        sidecar.stop()


def test_an_ack_after_the_lease_ran_out_is_still_taken(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    # An agent slower than the visibility timeout: its ack still lands, and the
    # command is not handed out again after it.
    sidecar.add(retry())
    [leased] = puller.poll(wait_s=0)
    assert puller.poll(wait_s=VISIBILITY_S * 1.5) != []  # the lease ran out: handed out again

    assert puller.ack(leased) is True
    assert puller.poll(wait_s=VISIBILITY_S * 1.5) == []


def test_an_ack_with_fields_the_sidecar_does_not_know_is_taken(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    # What an agent in the field sent: refusing it (400) left every command leased,
    # then handed out again after each visibility timeout, for as long as the run lived.
    sidecar.add(retry())
    [leased] = puller.poll(wait_s=0)

    answer = httpx.post(
        f"{sidecar.url}/v1/commands/{leased.id}/ack",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"status": "accepted", "service": SERVICE, "agent": {"version": "1.4"}},
        timeout=5,
    )

    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": leased.id, "status": "delivered"}
    assert sidecar.status(leased.id) == "delivered"
    assert puller.poll(wait_s=VISIBILITY_S * 1.5) == []  # not handed out again


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"status": "accepted"}, "service"),  # the one field the ack needs is missing
        ({"service": 42}, "service"),
        ({"service": ""}, "service"),
        (["not", "an", "object"], "object"),
        ("accepted", "object"),
    ],
)
def test_a_malformed_ack_is_refused_with_a_clear_400(
    sidecar: Sidecar, puller: CommandPuller, body: object, says: str
) -> None:
    sidecar.add(retry())
    [leased] = puller.poll(wait_s=0)

    answer = httpx.post(
        f"{sidecar.url}/v1/commands/{leased.id}/ack",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json=body,
        timeout=5,
    )

    assert answer.status_code == 400
    assert says in answer.json()["error"].lower(), answer.text
    assert sidecar.status(leased.id) == "leased"
    not_json = httpx.post(
        f"{sidecar.url}/v1/commands/{leased.id}/ack",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        content=b"{status: accepted",
        timeout=5,
    )
    assert not_json.status_code == 400 and not_json.json()["error"]


def test_a_pulled_pause_says_how_long_it_lasts_and_what_happens_then(
    sidecar: Sidecar, puller: CommandPuller
) -> None:
    sidecar.add(
        decided(Action.FAIL_FAST, params={"breaker_reopens_in_s": 20.0, "breaker": "open"}),
        decided(Action.ESCALATE, run_id="run-2"),
    )

    commands = {(c.type, c.run_id): c for c in puller.poll(wait_s=0)}

    # The breaker's pause: due now; its resume_run waits in the sidecar until the deadline.
    assert set(commands) == {("pause_run", "run-1"), ("pause_run", "run-2")}
    pause = commands["pause_run", "run-1"]
    assert pause.pause is not None
    assert (pause.pause.timeout_s, pause.pause.on_timeout) == (20.0, "resume")
    assert (pause.params["timeout_s"], pause.params["on_timeout"]) == (20.0, "resume")
    held = commands["pause_run", "run-2"]
    assert held.pause is not None
    assert (held.pause.timeout_s, held.pause.on_timeout) == (3600.0, "abort")
    assert held.params["awaiting"] == "approval"
    [waiting] = sidecar.call(lambda: sidecar.store.commands(status="pending"))
    assert waiting.command.type is CommandType.RESUME_RUN
    assert waiting.command.params["after_pause"] == pause.id
    assert waiting.command.not_before == pytest.approx(pause.created_at + 20.0, abs=0.01)
    for command in commands.values():
        assert puller.ack(command) is True


def test_an_approval_answered_after_its_deadline_is_refused_by_the_api() -> None:
    # The escalation is made 90 s ago by the actor's clock; the API's own clock (which
    # hands out commands) is the real one, where the deadline has just come.
    now = [time.time() - 90.0]
    sidecar = Sidecar(clock=lambda: now[0])
    try:
        _answered_late(sidecar, now)
    finally:
        sidecar.stop()


def _answered_late(sidecar: Sidecar, now: list[float]) -> None:
    sidecar.add(decided(Action.ESCALATE, params={"pause_timeout_s": 90.0}))
    [approval] = sidecar.call(sidecar.store.approvals)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert approval.expires_at == pytest.approx(now[0] + 90.0)
    now[0] += 90.0
    puller = CommandPuller(SERVICE, sidecar.url, TOKEN)

    answer = httpx.post(
        f"{sidecar.url}/v1/approvals/{approval.id}/approve", headers=headers, timeout=5
    )
    assert answer.status_code == 409 and "expired" in answer.json()["error"]

    expired = sidecar.call(sidecar.actor.expire_approvals)
    assert [a.id for a in expired] == [approval.id]
    shown = httpx.get(f"{sidecar.url}/v1/approvals?status=expired", headers=headers, timeout=5)
    assert [a["id"] for a in shown.json()["approvals"]] == [approval.id]
    with puller:
        types = sorted(c.type for c in puller.poll(wait_s=0))
    assert types == ["abort_run", "pause_run"]


class Unplugged(httpx.BaseTransport):
    """Real HTTP to the sidecar, except while :attr:`down`: then the connection is refused."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.down = False
        self.refused: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            self.refused.append(f"{request.method} {request.url.path}")
            raise httpx.ConnectError("connection refused", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_an_ack_that_could_not_reach_the_sidecar_is_sent_before_the_next_lease(
    sidecar: Sidecar,
) -> None:
    # The sidecar restarts between a lease and its ack: the ack is kept, and the
    # next poll sends it before leasing, though the lease ran out meanwhile.
    wire = Unplugged()
    with CommandPuller(SERVICE, sidecar.url, TOKEN, transport=wire) as puller:
        [first, second] = sidecar.add(retry(), retry())
        leased = puller.poll(wait_s=0)
        assert {c.id for c in leased} == {first.command.id, second.command.id}
        wire.down = True
        assert [puller.ack(c) for c in leased] == [False, False]
        assert puller.poll(wait_s=0) == []  # still down: no lease tried after a failed ack
        assert len(wire.refused) == 3
        assert wire.refused[-1].endswith("/ack")
        wire.down = False

        assert puller.poll(wait_s=VISIBILITY_S * 1.5) == []  # not handed out again

        assert sidecar.status(first.command.id) == "delivered"
        assert sidecar.status(second.command.id) == "delivered"
        assert puller.acks_dropped == 0


def test_acks_kept_for_an_unreachable_sidecar_are_bounded_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("supervisor.client.pull.MAX_UNSENT_ACKS", 2)
    wire = Unplugged()
    wire.down = True
    with CommandPuller(
        SERVICE, f"http://127.0.0.1:{_free_port()}", TOKEN, transport=wire
    ) as puller:
        assert [puller.ack(f"cmd_{n}") for n in range(5)] == [False] * 5
        assert puller.acks_dropped == 3
        wire.refused.clear()
        assert puller.poll(wait_s=0) == []
        assert wire.refused == ["POST /v1/commands/cmd_3/ack"]  # the oldest kept, first


# -- what the agent cannot read ------------------------------------------------------------


def _stored_as_is(sidecar: Sidecar, command: SidecarCommand) -> None:
    """Store ``command`` on the pull channel without the checks the sidecar's planning gives."""
    incident = NewIncident(
        key=f"incident-{command.id}",
        trace_id=command.trigger_trace_id,
        span_id=command.trigger_span_id,
        rule="test",
        service=command.service,
        run_id=command.run_id if isinstance(command.run_id, str) else "",
        action="retry",
        body={},
        commands=[(command, "pull")],
    )

    def store() -> None:
        created = sidecar.store.record([incident], time.time())
        sidecar.actor.announce(created)

    sidecar.call(store)


def _sidecar_command(command_id: str, **changes: Any) -> SidecarCommand:
    now = time.time()
    fields: dict[str, Any] = {
        "id": command_id,
        "idempotency_key": f"key-{command_id}",
        "type": CommandType.RETRY_STEP,
        "service": SERVICE,
        "run_id": "run-1",
        "trigger_trace_id": "cd" * 16,
        "trigger_span_id": "ef" * 8,
        "failure": {},
        "params": {},
        "not_before": now,
        "created_at": now,
        **changes,
    }
    return SidecarCommand(**fields)


def test_malformed_commands_are_counted_logged_acknowledged_and_the_rest_delivered(
    sidecar: Sidecar, puller: CommandPuller, caplog: pytest.LogCaptureFixture
) -> None:
    # What the sidecar's own typed records can hold; a numeric run id is not one,
    # so from_json's own test covers it.
    _stored_as_is(sidecar, _sidecar_command("cmd_no_key", idempotency_key=""))
    [good] = sidecar.add(retry())

    with caplog.at_level(logging.WARNING, logger="spanvisor.client"):
        commands = puller.poll(wait_s=0)

    assert [c.id for c in commands] == [good.command.id]
    assert puller.malformed == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cmd_no_key" in warnings[0] and "'idempotency_key'" in warnings[0]
    # Acknowledged on the spot, so it does not come back after the visibility timeout.
    assert sidecar.status("cmd_no_key") == "delivered"
    assert puller.ack(commands[0]) is True
    assert puller.poll(wait_s=VISIBILITY_S * 1.5) == []
    assert puller.malformed == 1


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ([], "JSON object"),
        ({}, "'id'"),
        ({"id": "c", "idempotency_key": "k", "type": "retry_step"}, "'service'"),
        ({"id": "c", "idempotency_key": "k", "type": 3, "service": "s"}, "'type'"),
        ({"id": "c", "idempotency_key": "k", "type": "t", "service": "s", "run_id": 7}, "'run_id'"),
        (
            {"id": "c", "idempotency_key": "k", "type": "t", "service": "s", "params": []},
            "'params'",
        ),
        (
            {"id": "c", "idempotency_key": "k", "type": "t", "service": "s", "trigger": "x"},
            "'trigger'",
        ),
        (
            {"id": "c", "idempotency_key": "k", "type": "t", "service": "s", "not_before": "soon"},
            "RFC 3339",
        ),
    ],
)
def test_command_from_json_names_what_is_wrong(payload: object, field: str) -> None:
    with pytest.raises(MalformedCommand, match=field):
        Command.from_json(payload)


def test_command_from_json_takes_the_minimum_and_ignores_extra_fields() -> None:
    command = Command.from_json(
        {
            "id": "c",
            "idempotency_key": "k",
            "type": "resume_run",
            "service": "s",
            "status": "leased",  # the pull answer adds the stored command's state
            "not_before": "2026-01-02T03:04:05.678Z",
        }
    )
    assert (command.run_id, command.trigger_trace_id, dict(command.params)) == ("", "", {})
    assert command.not_before == pytest.approx(1767323045.678)
    assert command.created_at is None


# -- a sidecar that is not there, or says no -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sidecar_that_is_down_gives_no_commands_and_one_warning_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _free_port()
    with (
        caplog.at_level(logging.INFO, logger="spanvisor.client"),
        CommandPuller(SERVICE, f"http://127.0.0.1:{port}", TOKEN, timeout_s=1) as puller,
    ):
        started = time.monotonic()
        assert [puller.poll(wait_s=5) for _ in range(3)] == [[], [], []]
        assert puller.ack("cmd_whatever") is False
        assert time.monotonic() - started < 3  # refused at once: no waiting on a dead port
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "cannot pull commands" in warnings[0].getMessage()
        assert f"127.0.0.1:{port}" in warnings[0].getMessage()

        caplog.clear()
        sidecar = Sidecar(port=port)
        try:
            [stored] = sidecar.add(retry())
            [command] = puller.poll(wait_s=0)
            assert command.id == stored.command.id
            assert puller.ack(command) is True
        finally:
            sidecar.stop()
        assert [r.getMessage() for r in caplog.records] == [
            # the ack kept while it was down, sent first: the sidecar never knew it
            "ack of cmd_whatever not taken: HTTP 404",
            f"pulling commands from spanvisor at http://127.0.0.1:{port} again",
        ]


def test_a_refused_token_raises_on_poll_and_on_ack(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    [stored] = sidecar.add(retry())
    with (
        CommandPuller(SERVICE, sidecar.url, "wrong-token") as wrong,
        pytest.raises(SupervisorClientError, match="refused the API token"),
    ):
        wrong.poll(wait_s=0)
    with (
        CommandPuller(SERVICE, sidecar.url, "wrong-token") as wrong,
        pytest.raises(SupervisorClientError, match="401"),
    ):
        wrong.ack(stored.command.id)
    # No token anywhere (no variable, no token file): refused the same way.
    monkeypatch.delenv("SPANVISOR_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with CommandPuller(SERVICE, sidecar.url) as none, pytest.raises(SupervisorClientError):
        none.poll(wait_s=0)
    assert sidecar.status(stored.command.id) == "pending"  # nothing was leased


def test_a_service_without_a_pull_channel_gets_nothing_and_a_warning_that_says_why(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="spanvisor.client"),
        CommandPuller("not-configured", sidecar.url, TOKEN) as puller,
    ):
        assert puller.poll(wait_s=0) == []
        assert puller.poll(wait_s=0) == []
    [warning] = [r.getMessage() for r in caplog.records]
    assert "HTTP 404" in warning and "agents.not-configured.pull" in warning


def test_a_wait_out_of_bounds_is_clamped_not_sent(sidecar: Sidecar) -> None:
    seen: list[httpx.Request] = []
    transport = httpx.HTTPTransport()

    class Recording(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return transport.handle_request(request)

        def close(self) -> None:
            transport.close()

    [stored] = sidecar.add(retry())
    with CommandPuller(SERVICE, sidecar.url, TOKEN, transport=Recording()) as puller:
        # A command is due, so even the 30 s poll answers at once.
        [command] = puller.poll(wait_s=1e9)
        assert command.id == stored.command.id
        assert puller.poll(wait_s=-5) == []
        assert puller.poll(wait_s=math.nan) == []
    assert [r.url.params["wait"] for r in seen] == ["30", "0", "0"]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="service"):
        CommandPuller("")
    for limit in (0, 101):
        with pytest.raises(ValueError, match="limit"):
            CommandPuller("s", limit=limit)
