"""What the operator console reads and does through ``Control``: incidents counted per
class, kind and bucket; each breaker's changes over the last hours; and a dead letter
sent again, end to end, to a real webhook receiver that refused it the first time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.store import Store
from supervisor.api.control import Control, ControlError
from supervisor.app import BackgroundSidecar
from supervisor.forward.breaker_history import BreakerHistory
from supervisor.records import Action
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar
from tests.test_api import _Listed, _outcome
from tests.test_cli_operator import POLICY, _failures, _send, _until
from tests.test_dispatch import SECRET, Answer, WebhookReceiver

T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_control(
    clock: Clock, history: BreakerHistory | None = None
) -> tuple[Control, Actor, Governor]:
    store = Store.open(":memory:")
    policy = load_policy(text="version: 1\npolicies: []\n")
    governor = Governor(policy, on_breaker_change=history)
    actor = Actor(store, {}, clock=clock)
    control = Control(
        store=store,
        actor=actor,
        governor=governor,
        policy=lambda: policy,
        failures=_Listed([]),
        stats=dict,
        ready=lambda: True,
        reload=dict,
        clock=clock,
        breaker_history=history,
    )
    return control, actor, governor


def test_incidents_are_counted_in_buckets_that_fall_on_whole_hours() -> None:
    clock = Clock(T0 + 1800.0)  # half past an hour (T0 is 22:13:20 UTC)
    control, actor, _ = make_control(clock)
    for n, at in enumerate([T0 - 86_400.0, T0 - 7000.0, T0 + 1000.0, T0 + 1700.0]):
        clock.now = at
        actor.record([_outcome(Action.ESCALATE, span=f"{n + 1:016x}", kind="auth")])
    clock.now = T0 + 1800.0

    counts = asyncio.run(control.incident_counts())

    assert (counts.buckets, counts.bucket_s) == (24, 3600.0)
    assert counts.start % 3600 == 0 and counts.start <= clock.now < counts.end
    [series] = counts.series
    assert (series.failure_class, series.kind, series.total) == ("permanent", "auth", 3)
    assert series.counts[-1] == 2 and series.counts[-3] == 1  # this hour; two hours ago
    with pytest.raises(ControlError, match="buckets"):
        asyncio.run(control.incident_counts(buckets=0))
    with pytest.raises(ControlError, match="window"):
        asyncio.run(control.incident_counts(window_s=10.0))


def test_breaker_timelines_show_what_this_sidecar_saw_and_nothing_for_others() -> None:
    clock = Clock(T0)
    history = BreakerHistory(clock=clock)
    control, _, governor = make_control(clock, history)
    clock.now = T0 + 60
    assert governor.isolate("tool:search")
    clock.now = T0 + 120
    governor.close("tool:search")
    clock.now = T0 + 3600

    found = control.breaker_timelines(["tool:search", "tool:elsewhere"], window_s=7200.0)

    mine = found["tool:search"]
    assert [(t.old, t.new, t.reason) for t in mine.transitions] == [
        ("closed", "isolated", "isolated"),
        ("isolated", "closed", "closed_manually"),
    ]
    assert [s.state for s in mine.segments()] == ["unknown", "closed", "isolated", "closed"]
    other = found["tool:elsewhere"]  # not tracked here: nothing is known of its past
    assert [s.state for s in other.segments()] == ["unknown"]
    assert other.state == "closed"
    with pytest.raises(ControlError, match="window"):
        control.breaker_timelines(["x"], window_s=1.0)


# -- a dead letter sent again, end to end -------------------------------------------------


@contextmanager
def failing_once() -> Iterator[WebhookReceiver]:
    """A webhook receiver that answers 500 once, then 200s: the first command dies."""
    with WebhookReceiver() as running:
        running.script.append(Answer(500, body=b"not now"))
        yield running


@contextmanager
def dead_letter_sidecar(
    tmp_path: Path, receiver: WebhookReceiver, token: str
) -> Iterator[BackgroundSidecar]:
    """A sidecar whose agent takes commands by webhook, one attempt each (then dead)."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": token,
            "policy": str(policy_file),
            "state_path": str(tmp_path / "state" / "state.db"),
            "agents": {
                "agent": {"webhook": {"url": receiver.url, "secret": SECRET}, "max_attempts": 1}
            },
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    background.start()
    try:
        yield background
    finally:
        background.stop()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with failing_once() as running:
        yield running


@pytest.fixture
def sidecar(tmp_path: Path, receiver: WebhookReceiver) -> Iterator[BackgroundSidecar]:
    with dead_letter_sidecar(tmp_path, receiver, "operator-token") as running:
        yield running


def test_a_dead_letter_redelivered_is_sent_at_once_with_its_key_and_the_record_says_who(
    sidecar: BackgroundSidecar, receiver: WebhookReceiver
) -> None:
    store = sidecar.sidecar.store
    _send(sidecar, _failures(1))  # an escalation pauses the run: a command by webhook
    _until(lambda: store.commands(status="dead"))
    [dead] = store.commands(status="dead")
    assert dead.last_error == "1 attempts: 500 Internal Server Error: not now"
    api = f"http://127.0.0.1:{sidecar.ports.api}"
    auth = {"Authorization": "Bearer operator-token"}
    route = f"{api}/v1/dead-letters/{dead.command.id}/redeliver"

    assert httpx.post(route).status_code == 401
    unknown = httpx.post(f"{api}/v1/dead-letters/cmd_nope/redeliver", headers=auth)
    assert unknown.status_code == 404
    asked = time.monotonic()
    answer = httpx.post(route, headers=auth, json={"by": "ops"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["id"], body["status"], body["attempts"]) == (dead.command.id, "pending", 0)
    assert (body["redelivered_by"], body["redeliveries"]) == ("ops", 1)

    _until(lambda: len(receiver.acknowledged()) == 1)
    sent_in_s = receiver.seen()[-1].at - asked
    assert sent_in_s < 0.8  # woken, not found by the dispatcher's next look
    assert receiver.keys() == [dead.command.idempotency_key] * 2
    assert [d.message_id for d in receiver.seen()] == [dead.command.id] * 2
    _until(lambda: (store.command(dead.command.id) or dead).status == "delivered")
    again = httpx.post(route, headers=auth)
    assert again.status_code == 409
    assert "not a dead letter" in again.json()["error"]
    listed = httpx.get(f"{api}/v1/commands/log", headers=auth).json()["commands"]
    [record] = [c for c in listed if c["id"] == dead.command.id]
    assert (record["status"], record["redelivered_by"]) == ("delivered", "ops")
    assert record["redelivered_at"] is not None
    assert httpx.get(f"{api}/v1/dead-letters", headers=auth).json()["dead_letters"] == []
