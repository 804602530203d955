"""Two sidecars on one PostgreSQL store: one incident, one command, one approval per failure.

Each store below is a sidecar's (its own connection and instance id) on the
same fresh schema; threads make their transactions really overlap.
"""

from __future__ import annotations

import random
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TypeVar

import psycopg
import pytest
from pydantic import ValidationError

from remediators.dbos_database import search_path_schema
from supervisor.act.store import ApprovalError, Store, StoredCommand
from supervisor.errors import ConfigError, StoreUnavailable
from supervisor.remediation.engine import database_url_for, executor_id
from supervisor.settings import Settings
from tests.postgres import fresh_schema
from tests.test_store import PUSH, T0, make_command, make_incident, span

T = TypeVar("T")


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


@pytest.fixture
def pair(url: str) -> Iterator[tuple[Store, Store]]:
    a = Store.open(url, instance_id="sidecar-a")
    b = Store.open(url, instance_id="sidecar-b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def together(tasks: list[Callable[[], T]]) -> list[T]:
    """Run ``tasks`` on threads started at once; their results, or the first error."""
    start = threading.Barrier(len(tasks))
    results: list[T | None] = [None] * len(tasks)
    errors: list[BaseException] = []

    def run(n: int) -> None:
        start.wait()
        try:
            results[n] = tasks[n]()
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def test_the_same_failure_judged_by_two_sidecars_makes_one_incident_and_one_command(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    command = make_command(span(1))

    first = a.record([make_incident(span(1), [command])], T0)
    second = b.record([make_incident(span(1), [command])], T0 + 0.5)

    assert [c.command.id for c in first] == [command.id]
    assert second == []
    assert (a.duplicates, b.duplicates) == (0, 1)
    for store in (a, b):
        assert [i.key for i in store.incidents()] == [make_incident(span(1)).key]
        assert [c.command.id for c in store.commands()] == [command.id]
    incident = b.incident(make_incident(span(1)).key)
    stored = b.command(command.id)
    assert incident is not None and incident.judged_by == "sidecar-a"
    assert stored is not None and stored.judged_by == "sidecar-a"
    assert stored.delivered_by == ""


def test_batches_recorded_at_once_by_two_sidecars_store_each_failure_once(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    commands = [make_command(span(n)) for n in range(200)]
    incidents = [make_incident(span(n), [commands[n]]) for n in range(200)]
    shuffled = random.Random(7).sample(incidents, len(incidents))

    def record(store: Store, batch: list[object]) -> list[StoredCommand]:
        made: list[StoredCommand] = []
        for start in range(0, len(batch), 25):  # the store writer's batches
            made += store.record(batch[start : start + 25], T0)  # type: ignore[arg-type]
        return made

    made_a, made_b = together(
        [lambda: record(a, list(incidents)), lambda: record(b, list(shuffled))]
    )

    made = [c.command.id for c in made_a + made_b]
    assert sorted(made) == sorted(c.id for c in commands)  # each new once, in one sidecar
    assert a.duplicates + b.duplicates == 200
    assert len(a.incidents(limit=1000)) == 200
    assert Counter(c.judged_by for c in a.commands(limit=1000)) == {
        "sidecar-a": len(made_a),
        "sidecar-b": len(made_b),
    }


def test_pending_push_commands_claimed_by_racing_sidecars_are_each_delivered_once(
    url: str,
) -> None:
    stores = [Store.open(url, instance_id=f"sidecar-{n}") for n in range(4)]
    try:
        commands = [make_command(span(n)) for n in range(300)]
        stores[0].record([make_incident(span(n), [commands[n]]) for n in range(300)], T0)

        def deliver(store: Store) -> list[str]:
            sent: list[str] = []
            while claimed := store.due(PUSH, T0 + 1, 7):
                for stored in claimed:
                    sent.append(stored.command.id)  # the attempt: what the agent receives
                    store.delivered(stored.command.id, T0 + 2)
            return sent

        sent = together([lambda s=store: deliver(s) for store in stores])  # type: ignore[misc]

        everything = [command_id for by_one in sent for command_id in by_one]
        assert Counter(everything) == Counter(c.id for c in commands)  # each exactly once
        assert all(by_one for by_one in sent), "every sidecar took a share"
        rows = stores[1].commands(limit=1000)
        assert {c.status for c in rows} == {"delivered"}
        by = Counter(c.delivered_by for c in rows)
        assert by == {f"sidecar-{n}": len(sent[n]) for n in range(4)}
        assert stores[2].waiting == 0
    finally:
        for store in stores:
            store.close()


def test_a_claimed_command_is_due_for_no_other_sidecar_until_it_fails_or_the_claim_ends(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    command = make_command(span(1))
    a.record([make_incident(span(1), [command])], T0)

    assert [c.command.id for c in a.due(PUSH, T0, 10)] == [command.id]
    assert b.due(PUSH, T0 + 1, 10) == []
    a.attempt_failed(command.id, "503", T0 + 5)  # its outcome sets when it is next due
    assert [c.command.id for c in b.due(PUSH, T0 + 5, 10)] == [command.id]
    b.delivered(command.id, T0 + 6)
    stored = a.command(command.id)
    assert stored is not None
    assert (stored.status, stored.attempts, stored.delivered_by) == ("delivered", 2, "sidecar-b")


def test_pull_leases_taken_at_once_by_two_sidecars_hand_each_command_out_once(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    commands = [make_command(span(n)) for n in range(100)]
    a.record([make_incident(span(n), [commands[n]], channel="pull") for n in range(100)], T0)

    def fetch(store: Store) -> list[str]:
        got: list[str] = []
        while leased := store.lease("agent", T0 + 1, 30.0, 3):
            for stored in leased:
                got.append(stored.command.id)
                assert store.ack(stored.command.id, "agent", T0 + 2)
        return got

    got_a, got_b = together([lambda: fetch(a), lambda: fetch(b)])

    assert Counter(got_a + got_b) == Counter(c.id for c in commands)
    assert Counter(c.delivered_by for c in a.commands(limit=1000)) == {
        "sidecar-a": len(got_a),
        "sidecar-b": len(got_b),
    }


APPROVAL = {"kind": "escalate", "question": "Let the run go on?"}


def test_an_approval_answered_through_one_sidecar_is_answered_for_the_other(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    a.record([make_incident(span(1), approval=APPROVAL)], T0)
    b.record([make_incident(span(1), approval=APPROVAL)], T0)  # the same span, judged again
    (pending,) = b.approvals(status="pending")
    assert pending.judged_by == "sidecar-a"
    assert len(a.approvals()) == 1

    b.answer(pending.id, approved=True, by="oncall@example.com", note="ok", now=T0 + 10)

    seen = a.approval(pending.id)
    assert seen is not None
    assert (seen.status, seen.answered_by, seen.answered_on) == (
        "approved",
        "oncall@example.com",
        "sidecar-b",
    )
    assert a.pending_approvals() == (0, None)
    with pytest.raises(ApprovalError, match="already answered: approved"):
        a.answer(pending.id, approved=False, by="someone", note="", now=T0 + 11)


def test_two_answers_given_at_once_through_two_sidecars_only_one_counts(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    for n in range(20):
        a.record([make_incident(span(n), approval=APPROVAL)], T0)
    for found in a.approvals(limit=100):

        def answer(store: Store, approved: bool, approval_id: str = found.id) -> str:
            try:
                store.answer(approval_id, approved=approved, by=store.instance_id, note="", now=T0)
            except ApprovalError:
                return "refused"
            return "taken"

        results = together([lambda: answer(a, True), lambda: answer(b, False)])
        assert sorted(results) == ["refused", "taken"]
        final = b.approval(found.id)
        assert final is not None
        # The answer kept is the one that was taken, whole: status, who, and where.
        assert (final.status, final.answered_by, final.answered_on) in {
            ("approved", "sidecar-a", "sidecar-a"),
            ("denied", "sidecar-b", "sidecar-b"),
        }


def test_max_pending_bounds_what_waits_in_the_whole_fleet(url: str) -> None:
    a = Store.open(url, max_pending=2, instance_id="sidecar-a")
    b = Store.open(url, max_pending=2, instance_id="sidecar-b")
    try:
        a.record([make_incident(span(n), [make_command(span(n))]) for n in range(2)], T0)
        (late,) = b.record([make_incident(span(9), [make_command(span(9))])], T0)
        assert late.status == "dead"
        assert late.last_error == "2 commands were already waiting"
        assert b.waiting == a.waiting == 2
    finally:
        a.close()
        b.close()


def test_a_store_whose_connection_the_server_dropped_connects_again(url: str) -> None:
    name = f"drop-{uuid.uuid4().hex[:8]}"
    store = Store.open(url, instance_id=name)
    try:
        store.record([make_incident(span(1), [make_command(span(1))])], T0)
        with psycopg.connect(url, autocommit=True) as admin:
            (dropped,) = admin.execute(
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (f"spanvisor {name}",),
            ).fetchone()
        assert dropped == 1  # a server restart, a failover, an idle timeout
        # The call that meets the dropped connection fails (the store writer keeps its
        # batch and tries again; the dispatcher looks again); the next one connects.
        # It fails as the store's own error (the control API's 503), the driver's beneath.
        with pytest.raises(StoreUnavailable) as caught:
            store.record([make_incident(span(2), [make_command(span(2))])], T0)
        assert isinstance(caught.value.__cause__, psycopg.OperationalError)
        assert len(store.record([make_incident(span(2), [make_command(span(2))])], T0)) == 1
        assert len(store.incidents()) == 2
    finally:
        store.close()


def test_an_unreachable_database_is_a_clear_error_naming_it_without_its_password() -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(ConfigError) as caught:
        Store.open("postgresql://spanvisor:s3cret@127.0.0.1:1/fleet")
    assert "cannot connect to the store at database_url" in str(caught.value)
    assert "postgresql://spanvisor:***@127.0.0.1:1/fleet" in str(caught.value)
    assert "s3cret" not in str(caught.value)


# -- the settings: database_url, instance_id --------------------------------------------------


def test_database_url_takes_only_postgresql_urls() -> None:
    assert Settings(database_url="postgresql://db:5432/spanvisor").database_url
    with pytest.raises(ValidationError, match="database_url"):
        Settings(database_url="sqlite:///state.db")


def test_a_fleet_s_remediations_are_shared_too_or_the_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"remediation_database_url sqlite:///r\.sqlite is"):
        Settings(
            database_url="postgresql://db/spanvisor", remediation_database_url="sqlite:///r.sqlite"
        )
    fleet = Settings(database_url="postgresql://db/spanvisor", instance_id="sidecar-a")
    assert database_url_for(fleet) == "postgresql://db/spanvisor"
    # DBOS recovers its executor's workflows at start: one id per sidecar, not "local".
    assert executor_id(fleet) == "sidecar-a"
    assert executor_id(fleet.model_copy(update={"remediation_executor_id": "x"})) == "x"
    alone = Settings(state_path=":memory:", remediation_database_url="sqlite:///r.sqlite")
    assert executor_id(alone) == "local"


def test_an_instance_is_named_by_its_host_and_api_port_unless_named() -> None:
    assert Settings(api_port=7411).instance() == f"{socket.gethostname()}:7411"
    assert Settings(instance_id="pod-7").instance() == "pod-7"


def test_dbos_keeps_a_fleet_s_remediations_in_the_schema_its_url_names() -> None:
    named = "postgresql://db/spanvisor?options=-csearch_path%3Dfleet_a"
    assert search_path_schema(named) == "fleet_a"
    assert (
        search_path_schema("postgresql://db/spanvisor?options=-c%20search_path%3Dx,public") == "x"
    )
    assert search_path_schema("postgresql://db/spanvisor") is None  # DBOS's own: dbos
    assert search_path_schema("sqlite:///remediations.sqlite") is None
