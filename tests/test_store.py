"""The store's contract, on SQLite files and PostgreSQL: what makes a decision reach its agent once.

Each test opens a store of its own (an SQLite file in ``tmp_path``, or a
fresh PostgreSQL schema: the tests taking ``path`` run on both) and drives it
with explicit times (``now``), as the dispatcher, the actor and the pull API do.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

import orjson
import pytest

from supervisor import records
from supervisor.act.store import CLAIM_S, ApprovalError, NewIncident, Store, StoredCommand
from supervisor.errors import ConfigError
from supervisor.records import Command, CommandType, command_key
from tests.postgres import fresh_schema

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
T0 = 1_000.0
PUSH = ("webhook", "command")


def make_command(
    span: str,
    *,
    step: str = "retry",
    kind: CommandType = CommandType.RETRY_STEP,
    service: str = "agent",
    not_before: float = T0,
    created_at: float = T0,
) -> Command:
    key = command_key(TRACE, span, "builtin.sdk.timeout", step)
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=kind,
        service=service,
        run_id="run-1",
        trigger_trace_id=TRACE,
        trigger_span_id=span,
        failure={"class": "transient", "kind": "timeout", "rule": "builtin.sdk.timeout"},
        params={"dependency": "tool:search", "reason": "timed out", "delay_s": 0.0},
        not_before=not_before,
        created_at=created_at,
    )


def make_incident(
    span: str,
    commands: Sequence[Command] = (),
    *,
    channel: str = "webhook",
    service: str = "agent",
    approval: dict[str, object] | None = None,
) -> NewIncident:
    return NewIncident(
        key=command_key(TRACE, span, "builtin.sdk.timeout"),
        trace_id=TRACE,
        span_id=span,
        rule="builtin.sdk.timeout",
        service=service,
        run_id="run-1",
        action="retry",
        body={"span_id": span, "action": "retry", "message": "Tool 'search' timed out"},
        commands=[(c, channel) for c in commands],
        approval=approval,
    )


def span(n: int) -> str:
    return f"{n:016x}"


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "spanvisor.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def path(request: pytest.FixtureRequest, sqlite_path: Path) -> Iterator[Path | str]:
    """Where a store is: an SQLite file, or a PostgreSQL URL (a fleet's shared store)."""
    if request.param == "sqlite":
        yield sqlite_path
        return
    with fresh_schema() as url:
        yield url


@pytest.fixture
def store(path: Path | str) -> Iterator[Store]:
    opened = Store.open(path)
    try:
        yield opened
    finally:
        opened.close()


def ids(commands: Sequence[StoredCommand]) -> list[str]:
    return [c.command.id for c in commands]


def status_of(store: Store, command: Command) -> str:
    found = store.command(command.id)
    assert found is not None
    return found.status


# -- incidents and their commands ---------------------------------------------


@pytest.mark.parametrize(
    "unix_s",
    [0.0, 1.7e9, 1_700_000_000.0004, 1_700_000_000.0005, 1_700_000_000.9996, 1_799_999_999.999],
)
def test_command_times_are_rfc3339_utc_to_the_millisecond_as_datetime_writes_them(
    unix_s: float,
) -> None:
    command = Command(
        id="cmd_1",
        idempotency_key=command_key("t" * 32, "s" * 16, "rule"),
        type=CommandType.RETRY_STEP,
        service="svc",
        run_id="run",
        trigger_trace_id="t" * 32,
        trigger_span_id="s" * 16,
        failure={},
        params={},
        not_before=unix_s,
        created_at=unix_s - 1.0,  # another second: the formatter remembers seconds
    )
    expected = [
        datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds")
        for t in (unix_s, unix_s - 1.0)
    ]
    body = command.to_json()
    assert [body["not_before"], body["created_at"]] == [e.replace("+00:00", "Z") for e in expected]


@pytest.mark.parametrize(
    ("unix_s", "text"),
    [
        (0.0, "1970-01-01T00:00:00.000Z"),
        (1_700_000_000.9996, "2023-11-14T22:13:20.999Z"),  # cut to the millisecond, not rounded
        (1_799_999_999.999, "2027-01-15T07:59:59.999Z"),
    ],
)
def test_command_times_read_as_rfc3339_utc(unix_s: float, text: str) -> None:
    assert records._rfc3339(unix_s) == text


def test_an_incident_is_stored_with_its_commands_and_they_come_back_as_sent(store: Store) -> None:
    pause = make_command(span(1), step="pause", kind=CommandType.PAUSE_RUN)
    resume = make_command(span(1), step="resume", kind=CommandType.RESUME_RUN, not_before=T0 + 30)
    incident = make_incident(span(1), [pause, resume])

    created = store.record([incident], T0)

    assert [(c.command.id, c.status, c.attempts) for c in created] == [
        (pause.id, "pending", 0),
        (resume.id, "pending", 0),
    ]
    found = store.incident(incident.key)
    assert found is not None
    assert (found.key, dict(found.body), found.created_at) == (
        incident.key,
        dict(incident.body),
        T0,
    )
    stored = store.command(resume.id)
    assert stored is not None
    assert (stored.command.to_json(), stored.channel, stored.next_attempt_at) == (
        resume.to_json(),
        "webhook",
        T0 + 30,
    )
    assert store.counts() == {"pending": 2, "leased": 0, "delivered": 0, "dead": 0}


def test_a_batch_that_fails_midway_stores_nothing_of_any_incident(store: Store) -> None:
    good = make_incident(span(1), [make_command(span(1))])
    # The second incident's command cannot be written (a NaN time has no
    # RFC 3339 form): it fails after the first incident and its command were.
    broken = make_incident(span(2), [make_command(span(2), not_before=float("nan"))])

    with pytest.raises(ValueError, match="NaN"):
        store.record([good, broken], T0)

    assert (
        store.incident(good.key),
        store.incident(broken.key),
        store.commands(),
    ) == (None, None, [])
    # Nothing of the failed batch is taken: the same incident can be stored later.
    created = store.record([good], T0 + 1)
    assert ids(created) == [make_command(span(1)).id]
    assert store.duplicates == 0


def test_the_same_incident_recorded_twice_makes_no_second_command(store: Store) -> None:
    first = make_incident(span(1), [make_command(span(1))])
    # An exporter re-sending the span: the same key, judged again later (even
    # with another delay, the incident is the same).
    again = make_incident(span(1), [make_command(span(1), step="other", not_before=T0 + 9)])

    assert len(store.record([first], T0)) == 1
    assert store.record([again], T0 + 5) == []
    assert store.record([first, first], T0 + 6) == []

    assert store.duplicates == 3
    assert ids(store.commands()) == [make_command(span(1)).id]
    assert len(store.incidents()) == 1


def test_the_same_incident_twice_in_one_batch_is_stored_once(store: Store) -> None:
    incident = make_incident(span(1), [make_command(span(1))])

    created = store.record([incident, incident], T0)

    assert len(created) == 1
    assert store.duplicates == 1
    assert store.counts()["pending"] == 1


def test_past_max_pending_a_new_command_is_stored_dead_with_the_reason(path: Path | str) -> None:
    store = Store.open(path, max_pending=2)
    try:
        commands = [make_command(span(n)) for n in range(4)]
        created = store.record([make_incident(span(0), [commands[0]])], T0)
        created += store.record(
            [make_incident(span(n), [commands[n]]) for n in (1, 2)], T0
        )  # the limit is reached inside one batch too

        assert [c.status for c in created] == ["pending", "pending", "dead"]
        overflowed = store.command(commands[2].id)
        assert overflowed is not None
        assert (
            overflowed.status,
            overflowed.last_error,
        ) == ("dead", "2 commands were already waiting")
        assert overflowed.finished_at is not None
        assert store.overflowed == 1
        assert ids(store.due(PUSH, T0 + 100, 10)) == [commands[0].id, commands[1].id]

        # Once one is delivered there is room again.
        store.delivered(commands[0].id, T0 + 1)
        created = store.record([make_incident(span(3), [commands[3]])], T0 + 2)
        assert [c.status for c in created] == ["pending"]
        assert store.overflowed == 1
    finally:
        store.close()


def test_a_leased_pull_command_counts_as_waiting_for_max_pending(path: Path | str) -> None:
    store = Store.open(path, max_pending=1)
    try:
        first, second = make_command(span(1)), make_command(span(2))
        store.record([make_incident(span(1), [first], channel="pull")], T0)
        assert len(store.lease("agent", T0, 30.0, 10)) == 1

        created = store.record([make_incident(span(2), [second], channel="pull")], T0)

        assert [(c.status, c.last_error) for c in created] == [
            ("dead", "1 commands were already waiting")
        ]
    finally:
        store.close()


def test_a_command_with_no_channel_is_stored_dead_with_a_clear_reason(store: Store) -> None:
    command = make_command(span(1), service="billing-agent")

    created = store.record(
        [make_incident(span(1), [command], channel="", service="billing-agent")], T0
    )

    assert [(c.status, c.last_error) for c in created] == [
        ("dead", "no delivery channel is configured for service 'billing-agent'")
    ]
    stored = store.command(command.id)
    assert stored is not None
    assert (stored.status, stored.attempts, stored.finished_at) == ("dead", 0, T0)
    assert store.due(("",), T0 + 1e6, 10) == []
    assert store.due(PUSH, T0 + 1e6, 10) == []
    assert store.overflowed == 0


# -- delivery: due, attempts, delivered, dead ----------------------------------


def test_due_lists_pending_commands_of_the_channels_whose_time_has_come_oldest_first(
    store: Store,
) -> None:
    late = make_command(span(1), not_before=T0 + 5)
    early = make_command(span(2), not_before=T0 + 1)
    middle = make_command(span(3), not_before=T0 + 3)
    by_command = make_command(span(4), not_before=T0 + 2)
    pulled = make_command(span(5), not_before=T0)
    store.record(
        [
            make_incident(span(1), [late]),
            make_incident(span(2), [early]),
            make_incident(span(3), [middle]),
            make_incident(span(4), [by_command], channel="command"),
            make_incident(span(5), [pulled], channel="pull"),
        ],
        T0,
    )

    assert store.due(PUSH, T0 + 0.999, 10) == []
    if not store.shared:  # one sidecar: what it reads is its own, again and again
        assert ids(store.due(PUSH, T0 + 4, 10)) == [early.id, by_command.id, middle.id]
        assert ids(store.due(PUSH, T0 + 4, 2)) == [early.id, by_command.id]
        assert ids(store.due(("webhook",), T0 + 5, 10)) == [early.id, middle.id, late.id]
        assert store.next_due_at(PUSH) == T0 + 1
    else:  # a fleet: what is due is claimed, and is not due again for CLAIM_S
        assert ids(store.due(PUSH, T0 + 4, 2)) == [early.id, by_command.id]
        assert ids(store.due(("webhook",), T0 + 5, 10)) == [middle.id, late.id]
        assert store.due(PUSH, T0 + 5, 10) == []
        assert store.next_due_at(PUSH) == T0 + 4 + CLAIM_S
        # The claim ran out (its sidecar died mid-attempt): another one may take them.
        assert set(ids(store.due(PUSH, T0 + 4 + CLAIM_S, 10))) == {early.id, by_command.id}
    assert store.next_due_at(("pull",)) == T0
    assert store.next_due_at(("nothing",)) is None


def test_a_failed_attempt_counts_and_makes_the_command_due_again_at_the_given_time(
    store: Store,
) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command])], T0)

    store.attempt_failed(command.id, "503 Service Unavailable", T0 + 10)

    stored = store.command(command.id)
    assert stored is not None
    assert (
        stored.status,
        stored.attempts,
        stored.last_error,
        stored.next_attempt_at,
    ) == ("pending", 1, "503 Service Unavailable", T0 + 10)
    assert store.due(PUSH, T0 + 9.9, 10) == []
    assert ids(store.due(PUSH, T0 + 10, 10)) == [command.id]
    assert store.next_due_at(PUSH) == T0 + 10 + (CLAIM_S if store.shared else 0)


def test_a_delivered_command_is_never_due_again_and_later_outcomes_do_not_change_it(
    store: Store,
) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command])], T0)
    store.attempt_failed(command.id, "TimeoutError: no answer within 5s", T0 + 1)

    store.delivered(command.id, T0 + 2)
    # A second report of the same delivery, a late failure, a late dead letter.
    store.delivered(command.id, T0 + 3)
    store.attempt_failed(command.id, "503", T0 + 4)
    store.dead(command.id, "400", T0 + 5)

    stored = store.command(command.id)
    assert stored is not None
    assert (stored.status, stored.attempts, stored.finished_at) == ("delivered", 2, T0 + 2)
    assert store.due(PUSH, T0 + 1e6, 10) == []
    assert store.next_due_at(PUSH) is None
    assert store.counts() == {"pending": 0, "leased": 0, "delivered": 1, "dead": 0}


def test_a_dead_command_is_never_due_again(store: Store) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command])], T0)

    store.dead(command.id, "400 Bad Request: unknown run", T0 + 1)
    store.attempt_failed(command.id, "503", T0 + 2)

    stored = store.command(command.id)
    assert stored is not None
    assert (
        stored.status,
        stored.attempts,
        stored.last_error,
        stored.finished_at,
    ) == ("dead", 1, "400 Bad Request: unknown run", T0 + 1)
    assert store.due(PUSH, T0 + 1e6, 10) == []
    assert store.next_due_at(PUSH) is None
    assert ids(store.commands(status="dead")) == [command.id]


# -- the pull channel ----------------------------------------------------------


def test_a_leased_command_is_not_handed_out_again_until_its_visibility_runs_out(
    store: Store,
) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command], channel="pull")], T0)

    first = store.lease("agent", T0, 30.0, 10)
    assert [(c.command.id, c.status, c.attempts) for c in first] == [(command.id, "pending", 0)]
    leased = store.command(command.id)
    assert leased is not None
    assert (leased.status, leased.attempts) == ("leased", 1)

    assert store.lease("agent", T0 + 29.9, 30.0, 10) == []
    again = store.lease("agent", T0 + 30, 30.0, 10)
    assert ids(again) == [command.id]
    released = store.command(command.id)
    assert released is not None
    assert (released.status, released.attempts) == ("leased", 2)


def test_lease_hands_out_only_due_pull_commands_of_the_service(store: Store) -> None:
    mine = make_command(span(1))
    later = make_command(span(2), not_before=T0 + 60)
    other = make_command(span(3), service="other-agent")
    pushed = make_command(span(4))
    store.record(
        [
            make_incident(span(1), [mine], channel="pull"),
            make_incident(span(2), [later], channel="pull"),
            make_incident(span(3), [other], channel="pull", service="other-agent"),
            make_incident(span(4), [pushed], channel="webhook"),
        ],
        T0,
    )

    assert ids(store.lease("agent", T0, 300.0, 10)) == [mine.id]
    assert ids(store.lease("agent", T0 + 60, 300.0, 10)) == [later.id]
    assert ids(store.lease("other-agent", T0, 300.0, 10)) == [other.id]
    assert status_of(store, pushed) == "pending"


def test_next_lease_at_is_the_first_due_time_or_lease_end_of_the_service_s_own_pull_commands(
    store: Store,
) -> None:
    held = make_command(span(1))
    later = make_command(span(2), not_before=T0 + 60)
    other = make_command(span(3), service="other-agent")
    pushed = make_command(span(4), not_before=T0 - 5)
    store.record(
        [
            make_incident(span(1), [held], channel="pull"),
            make_incident(span(2), [later], channel="pull"),
            make_incident(span(3), [other], channel="pull", service="other-agent"),
            make_incident(span(4), [pushed], channel="webhook"),
        ],
        T0,
    )
    assert store.next_lease_at("agent") == T0  # due now: ``held``
    assert store.next_lease_at("nobody") is None

    store.lease("agent", T0, 30.0, 10)
    # ``held`` is leased until T0 + 30; ``later`` is due at T0 + 60; the other
    # service's due command and the push command do not count.
    assert store.next_lease_at("agent") == T0 + 30
    assert ids(store.lease("agent", T0 + 30, 30.0, 10)) == [held.id]  # the lease ran out
    assert store.next_lease_at("agent") == T0 + 60
    assert store.ack(held.id, "agent", T0 + 31)
    store.dead(later.id, "gone", T0 + 31)
    assert store.next_lease_at("agent") is None
    assert store.next_lease_at("other-agent") == T0


def test_a_store_made_before_the_pull_indexes_gets_them_when_opened(sqlite_path: Path) -> None:
    path = sqlite_path
    Store.open(path).close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("DROP INDEX commands_pull_pending")
        db.execute("DROP INDEX commands_pull_leased")
        db.commit()

    Store.open(path).close()

    with contextlib.closing(sqlite3.connect(path)) as db:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        # What a long poll asks runs on them, not on a scan of other services' commands.
        plan = " ".join(
            r[3]
            for r in db.execute(
                "EXPLAIN QUERY PLAN SELECT MIN(next_attempt_at) FROM commands WHERE service = ?"
                " AND status = 'pending' AND channel = 'pull'",
                ("agent",),
            )
        )
    assert {"commands_pull_pending", "commands_pull_leased"} <= names
    assert "commands_pull_pending" in plan


#: The tables as a store made before instances were recorded had them (approvals without
#: their deadline columns either: those came one release earlier still).
EARLIER_SCHEMA = """
CREATE TABLE incidents (key TEXT PRIMARY KEY, trace_id TEXT NOT NULL, span_id TEXT NOT NULL,
    rule TEXT NOT NULL, service TEXT NOT NULL, run_id TEXT NOT NULL, action TEXT NOT NULL,
    body TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE commands (id TEXT PRIMARY KEY, key TEXT NOT NULL, incident_key TEXT NOT NULL,
    service TEXT NOT NULL, type TEXT NOT NULL, channel TEXT NOT NULL, status TEXT NOT NULL,
    body TEXT NOT NULL, not_before REAL NOT NULL, next_attempt_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, lease_until REAL, last_error TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL, finished_at REAL);
CREATE TABLE approvals (id TEXT PRIMARY KEY, incident_key TEXT NOT NULL UNIQUE,
    service TEXT NOT NULL, run_id TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
    created_at REAL NOT NULL, answered_at REAL, answered_by TEXT NOT NULL DEFAULT '',
    note TEXT NOT NULL DEFAULT '');
"""


def test_a_store_made_by_an_earlier_release_keeps_its_rows_and_records_instances(
    sqlite_path: Path,
) -> None:
    old = make_command(span(1))
    sqlite_path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(sqlite_path)) as db:
        db.executescript(EARLIER_SCHEMA)
        db.execute(
            "INSERT INTO incidents VALUES (?, ?, ?, 'rule', 'agent', 'run-1', 'retry', '{}', ?)",
            (make_incident(span(1)).key, TRACE, span(1), T0),
        )
        db.execute(
            "INSERT INTO commands VALUES (?, ?, ?, 'agent', 'retry_step', 'webhook', 'pending',"
            " ?, ?, ?, 0, NULL, '', ?, NULL)",
            (
                old.id,
                old.idempotency_key,
                make_incident(span(1)).key,
                orjson.dumps(old.to_json()).decode(),
                T0,
                T0,
                T0,
            ),
        )
        db.commit()

    store = Store.open(sqlite_path, instance_id="sidecar-a")
    try:
        new = make_command(span(2))
        store.record([make_incident(span(2), [new], approval={"question": "go on?"})], T0)
        store.delivered(old.id, T0 + 1)
        kept, made = store.command(old.id), store.command(new.id)
        (approval,) = store.approvals()
        store.answer(approval.id, approved=True, by="oncall", note="", now=T0 + 2)
        answered = store.approval(approval.id)
        judged = {i.key: i.judged_by for i in store.incidents()}
    finally:
        store.close()
    assert kept is not None and made is not None and answered is not None
    assert (kept.status, kept.judged_by, kept.delivered_by) == ("delivered", "", "sidecar-a")
    assert (made.status, made.judged_by) == ("pending", "sidecar-a")
    assert judged == {make_incident(span(1)).key: "", make_incident(span(2)).key: "sidecar-a"}
    assert (answered.judged_by, answered.answered_on) == ("sidecar-a", "sidecar-a")


def test_ack_marks_the_command_delivered_only_for_its_own_service(store: Store) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command], channel="pull")], T0)
    store.lease("agent", T0, 30.0, 10)

    assert store.ack(command.id, "other-agent", T0 + 1) is False
    assert status_of(store, command) == "leased"
    assert store.ack("cmd_unknown", "agent", T0 + 1) is False

    assert store.ack(command.id, "agent", T0 + 2) is True
    stored = store.command(command.id)
    assert stored is not None
    assert (stored.status, stored.finished_at) == ("delivered", T0 + 2)
    assert store.ack(command.id, "agent", T0 + 3) is False  # acknowledged once
    assert store.lease("agent", T0 + 1e6, 30.0, 10) == []


def test_ack_does_not_apply_to_a_push_command(store: Store) -> None:
    command = make_command(span(1))
    store.record([make_incident(span(1), [command], channel="webhook")], T0)

    assert store.ack(command.id, "agent", T0 + 1) is False
    assert status_of(store, command) == "pending"


def test_expire_pull_dead_letters_pull_commands_nobody_fetched_within_the_ttl(
    store: Store,
) -> None:
    stale = make_command(span(1))
    fresh = make_command(span(2), not_before=T0 + 50)
    pushed = make_command(span(3))
    store.record(
        [
            make_incident(span(1), [stale], channel="pull"),
            make_incident(span(2), [fresh], channel="pull"),
            make_incident(span(3), [pushed], channel="webhook"),
        ],
        T0,
    )

    assert store.expire_pull(T0 + 99.9, 100.0) == 0
    assert store.expire_pull(T0 + 100, 100.0) == 1

    expired = store.command(stale.id)
    assert expired is not None
    assert (expired.status, expired.finished_at) == ("dead", T0 + 100)
    # The wording is being reworked in store.py; the reason must say it was not fetched.
    assert expired.last_error.startswith("not fetched"), expired.last_error
    assert (status_of(store, fresh), status_of(store, pushed)) == ("pending", "pending")
    assert ids(store.lease("agent", T0 + 100, 30.0, 10)) == [fresh.id]


def test_a_lease_that_ran_out_unacknowledged_expires_with_the_ttl_like_an_unfetched_command(
    store: Store,
) -> None:
    # Regression: expire_pull used to skip 'leased' rows, so a command whose agent
    # died between fetch and ack stayed leased for ever (never expired nor pruned,
    # counted against max_pending) and went out, stale, whenever the service polled.
    command = make_command(span(1))
    store.record([make_incident(span(1), [command], channel="pull")], T0)
    store.lease("agent", T0, 30.0, 10)  # the agent fetched it, then died before its ack

    assert store.expire_pull(T0 + 29, 10.0) == 0  # still within its lease
    assert store.expire_pull(T0 + 7 * 86_400, 3600.0) == 1

    assert status_of(store, command) == "dead"
    assert store.lease("agent", T0 + 7 * 86_400, 30.0, 10) == []


# -- approvals -------------------------------------------------------------------


PROPOSAL = {"what": {"kind": "auth"}, "proposal": {"command": "retry_step", "params": {}}}


def test_an_approval_is_answered_once(store: Store) -> None:
    incident = make_incident(span(1), [make_command(span(1), step="pause")], approval=PROPOSAL)
    store.record([incident], T0)
    store.record([incident], T0 + 1)  # judged again: no second request

    pending = store.approvals(status="pending")
    assert [(a.id, a.incident_key, a.status) for a in pending] == [
        (f"apr_{incident.key[:24]}", incident.key, "pending")
    ]
    approval_id = pending[0].id

    answered = store.answer(
        approval_id, approved=True, by="oncall@example.com", note="go", now=T0 + 2
    )
    assert (
        answered.status,
        answered.answered_by,
        answered.note,
        answered.answered_at,
    ) == ("approved", "oncall@example.com", "go", T0 + 2)

    with pytest.raises(ApprovalError) as second:
        store.answer(approval_id, approved=False, by="someone-else", note="", now=T0 + 3)
    assert f"approval request {approval_id!r} was already answered: approved" == str(second.value)
    with pytest.raises(ApprovalError) as unknown:
        store.answer("apr_nope", approved=True, by="x", note="", now=T0 + 3)
    assert str(unknown.value) == "no approval request 'apr_nope'"

    kept = store.approval(approval_id)
    assert kept is not None
    assert (kept.status, kept.answered_by) == ("approved", "oncall@example.com")
    assert store.approvals(status="pending") == []


def test_commands_added_after_an_incident_are_deduplicated_by_their_key(store: Store) -> None:
    incident = make_incident(span(1), [make_command(span(1), step="pause")], approval=PROPOSAL)
    store.record([incident], T0)
    result = make_command(span(1), step="approval_result", kind=CommandType.APPROVAL_RESULT)

    first = store.add_commands(incident.key, [(result, "webhook")])
    second = store.add_commands(incident.key, [(result, "webhook")])
    unrouted = make_command(span(1), step="unrouted", kind=CommandType.APPROVAL_RESULT)
    dead = store.add_commands(incident.key, [(unrouted, "")])

    assert (ids(first), second) == ([result.id], [])
    assert [(c.status, c.last_error) for c in dead] == [
        ("dead", "no delivery channel is configured for service 'agent'")
    ]
    assert len(store.commands()) == 3


def test_every_planned_command_is_named_by_its_key_which_is_what_deduplicates_it() -> None:
    """The commands table has no index on ``key``: its primary key, the id, is the key's."""
    from supervisor.act.commands import approval_result, plan_commands
    from supervisor.records import Action, Decision, ErrorEvidence, Failure, FailureClass, Role

    failure = Failure(
        trace_id=TRACE,
        span_id=span(7),
        parent_span_id="",
        service="agent",
        span_name="chat gpt-4o",
        run_id="run-1",
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind="rate_limit",
        dependency="openai:gpt-4o",
        rule="builtin.openai.rate_limit",
        message="429",
        evidence=ErrorEvidence(status_error=True),
        received_ns=0,
    )
    decisions = [
        Decision(Action.RETRY, "p", {"delay_s": 1.0}),
        Decision(Action.FALLBACK, "p", {"to": "anthropic:claude"}),
        Decision(Action.FAIL_FAST, "p", {"breaker_reopens_in_s": 30.0}),
        Decision(Action.FAIL_FAST, "p"),
        Decision(Action.ESCALATE, "p"),
    ]
    planned = [c for d in decisions for c in plan_commands(failure, d, T0)]
    planned.append(
        approval_result(
            {"trace_id": TRACE, "span_id": span(7), "rule": failure.rule},
            approval_id="apr_1",
            incident="incident-1",
            approved=True,
            by="oncall@example.com",
            note="",
            proposal_body={"where": {"service": "agent", "run_id": "run-1"}},
            now=T0,
        )
    )
    assert len(planned) == 7  # fail_fast with a breaker: pause and resume
    for command in planned:
        assert command.id == "cmd_" + command.idempotency_key[:24]


# -- housekeeping and durability -------------------------------------------------


def test_prune_drops_old_finished_rows_and_keeps_pending_work(path: Path | str) -> None:
    store = Store.open(path, retention_s=100.0)
    try:
        delivered, dead, waiting, recent = (make_command(span(n)) for n in range(1, 5))
        store.record(
            [
                make_incident(span(1), [delivered]),
                make_incident(span(2), [dead]),
                make_incident(span(3), [waiting]),
                make_incident(span(5), [], approval=PROPOSAL),  # pending approval
                make_incident(span(6), [], approval=PROPOSAL),  # answered approval
                make_incident(span(7), []),  # nothing to deliver
            ],
            T0,
        )
        store.record([make_incident(span(4), [recent])], T0 + 150)
        store.delivered(delivered.id, T0 + 1)
        store.dead(dead.id, "400", T0 + 1)
        store.delivered(recent.id, T0 + 151)
        store.answer(
            f"apr_{make_incident(span(6)).key[:24]}", approved=False, by="ops", note="", now=T0 + 1
        )

        removed = store.prune(T0 + 200)

        # delivered + dead commands, the answered approval, and the incidents
        # of spans 1, 2, 6 and 7.
        assert removed == 7
        assert set(ids(store.commands())) == {waiting.id, recent.id}
        assert status_of(store, waiting) == "pending"
        assert {i.body["span_id"] for i in store.incidents()} == {span(3), span(4), span(5)}
        assert [(a.status, a.incident_key) for a in store.approvals()] == [
            ("pending", make_incident(span(5)).key)
        ]
        assert ids(store.due(PUSH, T0 + 200, 10)) == [waiting.id]
    finally:
        store.close()


def test_a_reopened_store_sees_everything_committed_before_it_was_closed(path: Path | str) -> None:
    delivered, failed, leased, dead = (make_command(span(n)) for n in range(1, 5))
    first = Store.open(path)
    try:
        first.record(
            [
                make_incident(span(1), [delivered]),
                make_incident(span(2), [failed]),
                make_incident(span(3), [leased], channel="pull"),
                make_incident(span(4), [dead], approval=PROPOSAL),
            ],
            T0,
        )
        first.delivered(delivered.id, T0 + 1)
        first.attempt_failed(failed.id, "503 Service Unavailable", T0 + 20)
        first.lease("agent", T0 + 2, 30.0, 10)
        first.dead(dead.id, "400 Bad Request", T0 + 3)
        approval_id = first.approvals()[0].id
        first.answer(approval_id, approved=True, by="ops", note="ok", now=T0 + 4)
        before = [c.to_json() for c in first.commands()]
    finally:
        first.close()

    second = Store.open(path)
    try:
        assert before == [c.to_json() for c in second.commands()]
        assert second.counts() == {"pending": 1, "leased": 1, "delivered": 1, "dead": 1}
        assert ids(second.due(PUSH, T0 + 20, 10)) == [failed.id]
        assert second.due(PUSH, T0 + 19, 10) == []
        assert ids(second.lease("agent", T0 + 32, 30.0, 10)) == [leased.id]
        reopened = second.approval(approval_id)
        assert reopened is not None
        assert (
            reopened.status,
            reopened.answered_by,
            reopened.note,
        ) == ("approved", "ops", "ok")
        assert len(second.incidents()) == 4
        # The keys survive the reopen: the same spans judged again add nothing.
        again = [make_incident(span(n), [make_command(span(n))]) for n in range(1, 5)]
        assert second.record(again, T0 + 5) == []
        assert second.duplicates == 4
        assert len(second.commands()) == 4
    finally:
        second.close()


def test_open_creates_missing_directories_and_reports_an_unusable_path(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b" / "state.db"
    Store.open(nested).close()
    assert nested.is_file()

    with pytest.raises(ConfigError) as refused:
        Store.open(tmp_path)  # a directory, not a database file
    assert str(refused.value).startswith(f"cannot open the store at {tmp_path}: ")


def test_a_second_sidecar_cannot_open_a_store_in_use(tmp_path: Path) -> None:
    first = Store.open(tmp_path / "state.db")
    try:
        with pytest.raises(ConfigError, match="another spanvisor is using the store"):
            Store.open(tmp_path / "state.db")
    finally:
        first.close()
    Store.open(tmp_path / "state.db").close()  # free again once the first closed
