"""A fleet's heartbeats and takeovers (:mod:`supervisor.act.fleet`) on a real PostgreSQL.

Each :class:`Fleet` below is one sidecar's (its own store connection and
instance id) on a fresh schema; time is a clock the test moves. What is
pinned: of sidecars racing to claim one dead sidecar exactly one wins; a live
sidecar is never claimed; one that beats again is alive again; a takeover
resumes the dead executor's remediations and makes its claimed commands due
now, and only those.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import load_policy
from policies._actions import Remediate
from supervisor.act.fleet import Fleet
from supervisor.act.store import CLAIM_S, Store
from supervisor.api.metrics import exposition
from supervisor.app import BackgroundSidecar
from supervisor.errors import ConfigError
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar
from tests.postgres import fresh_schema
from tests.test_api import _outcome
from tests.test_store import PUSH, make_command, make_incident, span
from tests.test_store_fleet import together
from tests.test_wiring import close

HEARTBEAT_S, DEAD_AFTER_S = 5.0, 30.0
T0 = 1_000_000.0


class Clock:
    """The time every sidecar of a test reads (what the database's clock gives otherwise)."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Resumed:
    """Stands for the durable runner: records whose remediations were resumed."""

    def __init__(self, found: int = 2, ready: bool = True) -> None:
        self.found = found
        self.ready = ready
        self.executors: list[str] = []

    def __call__(self, executor: str, instance: str) -> int | None:
        if not self.ready:
            return None
        self.executors.append(executor)
        return self.found


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Members:
    """Sidecars of one fleet, each with its own store; closed at the end."""

    def __init__(self, url: str, clock: Clock) -> None:
        self.url = url
        self.clock = clock
        self.stores: list[Store] = []

    def join(self, name: str, resume: Resumed | None = None) -> Fleet:
        store = Store.open(self.url, instance_id=name)
        self.stores.append(store)
        return Fleet(
            store,
            instance=name,
            executor_id=f"executor-{name}",
            heartbeat_s=HEARTBEAT_S,
            dead_after_s=DEAD_AFTER_S,
            resume=resume if resume is not None else Resumed(),
            clock=self.clock,
        )

    def close(self) -> None:
        for store in self.stores:
            store.close()


@pytest.fixture
def members(url: str, clock: Clock) -> Iterator[Members]:
    found = Members(url, clock)
    try:
        yield found
    finally:
        found.close()


def test_of_sidecars_racing_for_one_dead_sidecar_exactly_one_takes_it_over(
    members: Members, clock: Clock
) -> None:
    dead = members.join("sidecar-a")
    resumed = [Resumed() for _ in range(4)]
    racers = [members.join(f"sidecar-{n}", r) for n, r in enumerate(resumed)]
    dead.round()
    clock.now += DEAD_AFTER_S + 0.1
    for racer in racers:
        racer.beat(clock.now)

    taken = together([lambda r=r: [r.take_over(clock.now)] for r in racers])  # type: ignore[misc]

    winners = [found for [found] in taken if found]
    assert len(winners) == 1
    [[takeover]] = winners
    assert (takeover.instance, takeover.remediations) == ("sidecar-a", 2)
    assert takeover.silent_s == pytest.approx(DEAD_AFTER_S + 0.1)
    assert [e for r in resumed for e in r.executors] == ["executor-sidecar-a"]
    assert sum(r.takeovers for r in racers) == 1
    # Taken over once: no later round takes it again.
    clock.now += HEARTBEAT_S
    assert all(r.take_over(clock.now) == [] for r in racers)


def test_a_sidecar_that_beats_within_dead_after_is_never_claimed(
    members: Members, clock: Clock
) -> None:
    a, b = members.join("sidecar-a"), members.join("sidecar-b")
    a.round()
    clock.now += DEAD_AFTER_S  # exactly at the limit: still alive
    assert b.round() == []
    assert (b.alive, b.dead) == (2, 0)
    clock.now += DEAD_AFTER_S - 1
    a.round()  # a late beat, but a beat
    clock.now += DEAD_AFTER_S - 1
    assert b.round() == []
    assert b.claim(clock.now) is None
    assert b.takeovers == 0


def test_a_sidecar_never_claims_itself(members: Members, clock: Clock) -> None:
    a = members.join("sidecar-a")
    a.beat(clock.now)
    assert a.claim(clock.now + 10 * DEAD_AFTER_S) is None


def test_a_sidecar_taken_over_that_beats_again_is_alive_and_can_be_taken_over_again(
    members: Members, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = members.join("sidecar-a"), members.join("sidecar-b")
    a.round()
    clock.now += DEAD_AFTER_S + 1
    assert [t.instance for t in b.round()] == ["sidecar-a"]
    assert (b.alive, b.dead) == (1, 1)

    again = members.join("sidecar-a")  # started again under the same id
    with caplog.at_level(logging.INFO, logger="spanvisor.fleet"):
        again.round()
    assert "taken over while it was away" in caplog.text
    b.count(clock.now)
    assert (b.alive, b.dead) == (2, 0)
    assert b.claim(clock.now) is None

    clock.now += DEAD_AFTER_S + 1  # dead a second time: taken over a second time
    assert [t.instance for t in b.round()] == ["sidecar-a"]
    assert b.takeovers == 2


def test_a_sidecar_only_silent_past_dead_after_warns_when_it_beats_again(
    members: Members, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = members.join("sidecar-a"), members.join("sidecar-b")
    a.round()
    clock.now += DEAD_AFTER_S + 1
    b.round()
    with caplog.at_level(logging.WARNING, logger="spanvisor.fleet"):
        a.round()  # the same process: it was paused, not dead
    assert "did not beat for 31.0 s and was taken over by sidecar-b" in caplog.text


def test_a_takeover_makes_the_dead_sidecars_claimed_commands_due_now_and_only_those(
    members: Members, clock: Clock
) -> None:
    a, b = members.join("sidecar-a"), members.join("sidecar-b")
    claimed, failed, own = (make_command(span(n)) for n in (1, 2, 3))
    a.store.record([make_incident(span(n), [c]) for n, c in enumerate((claimed, failed, own))], T0)
    # a claims two commands: one attempt is under way when it dies, one failed before.
    assert {c.command.id for c in a.store.due(PUSH, T0, 2)} == {claimed.id, failed.id}
    a.store.attempt_failed(failed.id, "503", T0 + 600)  # its claim ended with the attempt
    assert [c.command.id for c in b.store.due(PUSH, T0, 10)] == [own.id]  # b's own claim
    assert a.store.command(claimed.id).delivered_by == "sidecar-a"  # type: ignore[union-attr]
    a.round()
    b.round()

    clock.now = T0 + DEAD_AFTER_S + 1  # well inside the claim of CLAIM_S
    assert clock.now < T0 + CLAIM_S
    [takeover] = b.round()

    assert (takeover.instance, takeover.commands) == ("sidecar-a", 1)
    assert [c.command.id for c in b.store.due(PUSH, clock.now, 10)] == [claimed.id]
    again = b.store.command(claimed.id)
    assert again is not None and again.delivered_by == "sidecar-b"  # b's claim now
    b.store.delivered(claimed.id, clock.now)
    assert b.commands_released == 1 and b.remediations_resumed == 2


def test_a_sidecar_that_cannot_resume_yet_gives_the_claim_back(
    members: Members, clock: Clock
) -> None:
    waiting = Resumed(ready=False)
    a, b, c = members.join("sidecar-a"), members.join("sidecar-b", waiting), members.join("c")
    a.round()
    clock.now += DEAD_AFTER_S + 1
    assert b.round() == []  # its remediations are starting: not now
    assert b.takeovers == 0
    assert [t.instance for t in c.round()] == ["sidecar-a"]  # another sidecar can


def test_the_default_clock_is_the_database_servers(members: Members) -> None:
    a = members.join("sidecar-a")
    server = Fleet(
        a.store,
        instance="sidecar-a",
        executor_id="executor",
        heartbeat_s=HEARTBEAT_S,
        dead_after_s=DEAD_AFTER_S,
        resume=Resumed(),
    )
    assert abs(server.now() - time.time()) < 5  # the same host's clock here
    assert server.round() == []
    assert (server.alive, server.dead) == (1, 0)


# -- settings and wiring ----------------------------------------------------------------


def test_dead_after_must_be_more_than_twice_the_heartbeat() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(overrides={"instance_heartbeat_s": 5, "instance_dead_after_s": 10})
    assert "instance_dead_after_s (10 s) must be more than twice instance_heartbeat_s (5 s)" in (
        str(refused.value)
    )
    found = load_settings(overrides={"instance_heartbeat_s": 1, "instance_dead_after_s": 2.5})
    assert (found.instance_heartbeat_s, found.instance_dead_after_s) == (1, 2.5)


def test_a_sidecar_on_sqlite_has_no_fleet(tmp_path: Path) -> None:
    settings = load_settings(
        overrides={
            "api_token": "tok",
            "token_file": str(tmp_path / "token"),
            "state_path": str(tmp_path / "state.db"),
        }
    )
    sidecar = build_sidecar(settings, load_policy())
    try:
        assert sidecar.fleet is None
        assert sidecar.stats()["fleet"] is None
        exposed = exposition(sidecar.metric_sources())().decode()
        assert "spanvisor_fleet" not in exposed
    finally:
        close(sidecar)


def test_a_sidecar_on_a_shared_store_has_a_fleet_named_by_its_instance(
    tmp_path: Path, url: str
) -> None:
    settings = load_settings(
        overrides={
            "api_token": "tok",
            "token_file": str(tmp_path / "token"),
            "state_path": str(tmp_path / "state.db"),
            "database_url": url,
            "instance_id": "sidecar-a",
            "instance_heartbeat_s": 1,
            "instance_dead_after_s": 4,
        }
    )
    sidecar = build_sidecar(settings, load_policy())
    gone = Store.open(url, instance_id="sidecar-gone")
    try:
        fleet = sidecar.fleet
        assert fleet is not None
        assert (fleet.instance, fleet.executor_id) == ("sidecar-a", "sidecar-a")
        dead = Fleet(
            gone,
            instance="sidecar-gone",
            executor_id="sidecar-gone",
            heartbeat_s=1,
            dead_after_s=4,
            resume=Resumed(),
        )
        dead.beat(fleet.now() - 60)
        # Its remediations are not running (never started here): the claim is given back.
        assert fleet.round() == []
        assert {k: v for k, v in sidecar.stats()["fleet"].items() if k != "heartbeat_s"} == {
            "instance": "sidecar-a",
            "alive": 1,
            "dead": 1,
            "takeovers": 0,
            "remediations_resumed": 0,
            "commands_released": 0,
            "dead_after_s": 4,
        }
        exposed = exposition(sidecar.metric_sources())().decode()
        assert "spanvisor_fleet_instances_alive 1.0" in exposed
        assert "spanvisor_fleet_instances_dead 1.0" in exposed
        assert "spanvisor_fleet_takeovers_total 0.0" in exposed
    finally:
        gone.close()
        close(sidecar)


REMEDIATE_POLICY = """\
version: 1
breakers: {enabled: false}
retry_budget: {enabled: false}
restart_intensity: {enabled: false}
remediators:
  later:
    use: retry_step
    params: {delay_s: 30}
    verify_window_s: 0
    on_unresolved: none
policies:
  - name: remediate_auth
    match: {kind: auth}
    action: remediate
    remediator: later
"""


def test_a_takeover_starts_the_remediations_a_dead_sidecar_stored_and_never_started(
    url: str, tmp_path: Path
) -> None:
    """The dead sidecar stored a remediate incident and died before dispatching it: no
    workflow exists for it, so resuming its executor finds nothing; the takeover starts it."""
    policy = load_policy(text=REMEDIATE_POLICY)
    failure = _outcome(Action.REMEDIATE).failure
    decision = Remediate("later").decide(failure, 1, "remediate_auth", False)
    gone = build_sidecar(
        load_settings(
            overrides={
                "state_path": str(tmp_path / "gone.db"),
                "database_url": url,
                "instance_id": "sidecar-gone",
            }
        ),
        policy,
    )
    try:
        gone.actor.store_outcomes([Outcome(failure, decision)])  # stored; never dispatched
    finally:
        close(gone)
    here = BackgroundSidecar(
        build_sidecar(
            load_settings(
                overrides={
                    "state_path": str(tmp_path / "here.db"),
                    "database_url": url,
                    "instance_id": "sidecar-a",
                }
            ),
            policy,
        )
    )
    here.start()
    try:
        remediations = here.sidecar.remediations
        deadline = time.monotonic() + 60
        while remediations.runner is None and time.monotonic() < deadline:
            time.sleep(0.1)  # DBOS launches in the background at start
        assert remediations.runner is not None
        assert remediations.resume_executor("sidecar-gone", "sidecar-gone") == 1
        rid = str(decision.params["remediation_id"])
        runner = remediations.runner
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and rid not in {w["id"] for w in runner.list(limit=10)}:
            time.sleep(0.05)  # dispatched to the runner's loop: started a moment later
        assert rid in {w["id"] for w in runner.list(limit=10)}
        # Started once: a second takeover round finds it known.
        assert remediations.resume_executor("sidecar-gone", "sidecar-gone") == 0
    finally:
        here.stop()
