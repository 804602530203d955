"""Two store operations of the operator console, on SQLite files and PostgreSQL: incidents
counted by class and kind per time bucket (in SQL, bounded), and a dead letter put back
to pending (the same id and key, attempts from 0, who and when kept)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.act.store import NewIncident, RedeliveryError, Store
from supervisor.records import Command, CommandType, command_key
from tests.postgres import fresh_schema

TRACE = "0af7651916cd43dd8448eb211c80319c"
T0 = 1_700_000_000.0
HOSTILE = '<script>alert(1)</script>"onload='


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        opened = Store.open(tmp_path / "state.db", max_pending=3)
        yield opened
        opened.close()
        return
    with fresh_schema() as url:
        opened = Store.open(url, max_pending=3)
        try:
            yield opened
        finally:
            opened.close()


def incident(n: int, cls: str, kind: str, *, command: Command | None = None) -> NewIncident:
    span = f"{n:016x}"
    return NewIncident(
        key=command_key(TRACE, span, "rule"),
        trace_id=TRACE,
        span_id=span,
        rule="rule",
        service="agent",
        run_id="run-1",
        action="retry",
        body={"class": cls, "kind": kind, "span_id": span},
        commands=[(command, "webhook")] if command is not None else (),
    )


def command(n: int, *, service: str = "agent") -> Command:
    span = f"{n:016x}"
    key = command_key(TRACE, span, "rule", "retry")
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=CommandType.RETRY_STEP,
        service=service,
        run_id="run-1",
        trigger_trace_id=TRACE,
        trigger_span_id=span,
        failure={"class": "transient", "kind": "timeout"},
        params={},
        not_before=T0,
        created_at=T0,
    )


# -- counting ------------------------------------------------------------------


def test_incidents_are_counted_per_class_kind_and_bucket_in_the_window(store: Store) -> None:
    store.record([incident(1, "transient", "timeout")], T0 - 1.0)  # before the window
    store.record([incident(2, "transient", "timeout")], T0)  # the first bucket's start
    store.record([incident(3, "transient", "timeout")], T0 + 59.999)
    store.record([incident(4, "transient", "timeout")], T0 + 60.0)  # the second bucket
    store.record([incident(5, "permanent", HOSTILE)], T0 + 150.0)  # the third
    store.record([incident(6, "transient", "rate_limit")], T0 + 180.0)  # past the end

    counts = store.incident_counts(T0, 60.0, 3)

    assert [(s.failure_class, s.kind, s.counts) for s in counts.series] == [
        ("transient", "timeout", (2, 1, 0)),
        ("permanent", HOSTILE, (0, 0, 1)),
    ]
    assert (counts.total, counts.complete, counts.end) == (4, True, T0 + 180.0)
    assert counts.bucket_totals() == (2, 1, 1)


def test_an_empty_window_counts_nothing_and_incidents_without_a_class_count_as_blank(
    store: Store,
) -> None:
    assert store.incident_counts(T0, 60.0, 2).series == ()
    assert store.incident_counts(T0, 60.0, 2).bucket_totals() == (0, 0)
    store.record(
        [
            NewIncident(
                key="k" * 64,
                trace_id=TRACE,
                span_id="1" * 16,
                rule="rule",
                service="agent",
                run_id="run",
                action="retry",
                body={"message": "made before bodies named their class"},
            )
        ],
        T0,
    )
    [blank] = store.incident_counts(T0, 60.0, 2).series
    assert (blank.failure_class, blank.kind, blank.counts) == ("", "", (1, 0))


def test_a_count_reads_only_the_newest_rows_and_says_when_the_window_goes_past_them(
    store: Store,
) -> None:
    for n in range(10):
        store.record([incident(n, "transient", "timeout")], T0 + n)

    bounded = store.incident_counts(T0, 10.0, 1, max_rows=4)
    assert (bounded.total, bounded.complete) == (4, False)
    # The first row left unread is older than the window: nothing is missing.
    recent = store.incident_counts(T0 + 6.0, 4.0, 1, max_rows=4)
    assert (recent.total, recent.complete) == (4, True)


# -- re-delivery -------------------------------------------------------------------


def test_a_dead_letter_is_put_back_to_pending_with_its_id_and_key_and_who_asked(
    store: Store,
) -> None:
    dead = command(1)
    store.record([incident(1, "transient", "timeout", command=dead)], T0)
    store.attempt_failed(dead.id, "503", T0 + 1.0)
    store.dead(dead.id, "2 attempts: 500 Internal Server Error", T0 + 2.0)
    before = store.waiting

    again = store.redeliver(dead.id, channel_for=lambda s: "webhook", by="ops", now=T0 + 10.0)

    assert (again.status, again.attempts, again.next_attempt_at) == ("pending", 0, T0 + 10.0)
    assert (again.command.id, again.command.idempotency_key) == (dead.id, dead.idempotency_key)
    assert (again.redeliveries, again.redelivered_by, again.redelivered_at) == (1, "ops", T0 + 10.0)
    assert again.finished_at is None
    assert again.last_error == "2 attempts: 500 Internal Server Error"  # until an attempt says
    assert store.waiting == before + 1
    assert [c.command.id for c in store.due(("webhook",), T0 + 10.0, 10)] == [dead.id]


def test_only_a_dead_letter_can_be_redelivered(store: Store) -> None:
    live = command(1)
    store.record([incident(1, "transient", "timeout", command=live)], T0)
    channel = lambda service: "webhook"  # noqa: E731

    with pytest.raises(RedeliveryError) as unknown:
        store.redeliver("cmd_nope", channel_for=channel, by="ops", now=T0)
    assert unknown.value.why == "unknown"
    with pytest.raises(RedeliveryError) as pending:
        store.redeliver(live.id, channel_for=channel, by="ops", now=T0)
    assert pending.value.why == "not_dead"
    store.dead(live.id, "400 Bad Request", T0)
    store.redeliver(live.id, channel_for=channel, by="ops", now=T0)
    with pytest.raises(RedeliveryError) as twice:
        store.redeliver(live.id, channel_for=channel, by="ops", now=T0)
    assert twice.value.why == "not_dead"


def test_a_dead_letter_whose_service_has_no_channel_or_a_full_queue_stays_dead(
    store: Store,
) -> None:
    dead = command(9, service="ghost")
    store.record([incident(9, "transient", "timeout", command=dead)], T0)
    store.dead(dead.id, "gone", T0)

    with pytest.raises(RedeliveryError) as no_channel:
        store.redeliver(dead.id, channel_for=lambda s: "", by="ops", now=T0)
    assert no_channel.value.why == "no_channel"
    store.record([incident(n, "t", "k", command=command(n)) for n in (1, 2, 3)], T0)  # 3 wait
    with pytest.raises(RedeliveryError) as full:
        store.redeliver(dead.id, channel_for=lambda s: "webhook", by="ops", now=T0)
    assert full.value.why == "full"
    found = store.command(dead.id)
    assert found is not None and found.status == "dead" and found.redeliveries == 0


def test_a_shared_store_made_before_redeliveries_were_recorded_gets_their_columns() -> None:
    with fresh_schema() as url:
        earlier = Store.open(url)
        dead = command(1)
        earlier.record([incident(1, "transient", "timeout", command=dead)], T0)
        earlier.dead(dead.id, "gone", T0)
        for column in ("redeliveries", "redelivered_by", "redelivered_at"):
            earlier._db.execute(f"ALTER TABLE commands DROP COLUMN {column}")
        earlier.close()

        store = Store.open(url)
        try:
            again = store.redeliver(dead.id, channel_for=lambda s: "webhook", by="ops", now=T0)
        finally:
            store.close()
    assert (again.status, again.redeliveries, again.redelivered_by) == ("pending", 1, "ops")


def test_two_sidecars_of_a_fleet_asked_for_one_dead_letter_put_it_back_once() -> None:
    with fresh_schema() as url:
        a, b = Store.open(url, instance_id="sidecar-a"), Store.open(url, instance_id="sidecar-b")
        try:
            dead = command(1)
            a.record([incident(1, "transient", "timeout", command=dead)], T0)
            a.dead(dead.id, "gone", T0)
            b.redeliver(dead.id, channel_for=lambda s: "webhook", by="bob", now=T0 + 1)
            with pytest.raises(RedeliveryError) as late:
                a.redeliver(dead.id, channel_for=lambda s: "webhook", by="ann", now=T0 + 2)
            found = a.command(dead.id)
        finally:
            a.close()
            b.close()
    assert late.value.why == "not_dead"
    assert found is not None
    assert (found.status, found.redeliveries, found.redelivered_by) == ("pending", 1, "bob")
