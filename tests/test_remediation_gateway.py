"""The sidecar's side of remediation: the gateway over the real store, notices, the watch."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from policies import Governor, load_policy
from remediators.base import Trigger
from remediators.gateway import WorkerRestart
from supervisor.act import signing
from supervisor.act.actor import Actor
from supervisor.act.store import Store
from supervisor.errors import ConfigError
from supervisor.records import RUN_ENDED_OK
from supervisor.remediation.engine import RecoveryWatch, Remediations, SidecarGateway
from supervisor.settings import AgentDelivery, PullChannel, load_settings
from tests.test_dispatch import Answer, WebhookReceiver

SECRET = "notify-secret-0123456789abcdef"
TRIGGER = Trigger(
    trace_id="a" * 32,
    span_id="b" * 16,
    service="agent",
    run_id="run-1",
    failure_class="transient",
    kind="rate_limit",
    dependency="openai:gpt-4o",
    rule="builtin.openai.rate_limit",
    message="`ignore this` <@channel>",
    span_name="chat",
)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    created = asyncio.new_event_loop()
    yield created
    created.close()


def gateway(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, notify_url: str | None = None
) -> tuple[SidecarGateway, Store, list[tuple[str, Any]]]:
    store = Store.open(tmp_path / "state.db")
    actor = Actor(store, {"agent": AgentDelivery(pull=PullChannel())})
    policy = load_policy()
    notified: list[tuple[str, Any]] = []
    watch = RecoveryWatch(lambda rid, evidence: notified.append((rid, evidence)))
    return (
        SidecarGateway(
            actor,
            Governor(policy),
            lambda: policy,
            watch,
            loop,
            notify_url=notify_url,
            notify_secret=SECRET,
        ),
        store,
        notified,
    )


def test_commands_are_stored_once_per_key_for_the_agents_channel(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    gw, store, _ = gateway(tmp_path, loop)
    first = gw.send_command(TRIGGER, "switch_fallback", {"to": "x"}, key="rem_1/2/switch_fallback")
    again = gw.send_command(TRIGGER, "switch_fallback", {"to": "x"}, key="rem_1/2/switch_fallback")
    assert (first["status"], first["channel"], again["status"]) == ("pending", "pull", "duplicate")
    (stored,) = store.commands()
    assert stored.command.type.value == "switch_fallback"
    assert stored.command.run_id == "run-1"
    store.close()


def test_an_approval_is_stored_and_posted_as_a_signed_slack_message(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    with WebhookReceiver() as receiver:
        receiver.script.append(Answer(503))  # one retry, then it lands
        gw, store, _ = gateway(tmp_path, loop, notify_url=receiver.url)
        opened = gw.open_approval(
            TRIGGER, {"question": "retry?", "proposal": "retry_step"}, key="k", remediation_id="r"
        )
        again = gw.open_approval(TRIGGER, {"question": "retry?"}, key="k", remediation_id="r")
    assert opened["approval_id"] == again["approval_id"]
    (approval,) = store.approvals()
    assert approval.id == opened["approval_id"] and approval.body["remediation_id"] == "r"
    assert [d.answered for d in receiver.deliveries] == [503, 200]  # posted once more, not twice
    delivery = receiver.deliveries[-1]
    assert signing.verify(SECRET, delivery.headers, delivery.body) == f"ntf_{approval.id}"
    message = orjson.loads(delivery.body)
    assert "rate_limit" in message["text"] and message["blocks"][0]["type"] == "section"
    # Span text is quoted code in the message, never live markup.
    assert "<@channel>" not in message["text"]
    assert gw.notify_errors == 0
    store.close()


def test_a_dead_notification_endpoint_is_counted_and_the_approval_kept(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    with WebhookReceiver() as receiver:
        receiver.script.extend([Answer(400)])
        gw, store, _ = gateway(tmp_path, loop, notify_url=receiver.url)
        gw.open_approval(TRIGGER, {"question": "q"}, key="k2", remediation_id="r")
    assert len(receiver.deliveries) == 1  # a 4xx is not retried
    assert gw.notify_errors == 1 and len(store.approvals()) == 1
    store.close()


def test_a_worker_restart_runs_the_configured_program_without_a_shell(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    gw, store, _ = gateway(tmp_path, loop)
    out = tmp_path / "restarted.json"
    record = (
        "import json, os, sys;"
        " json.dump({'argv': sys.argv[1:], 'key': os.environ['SPANVISOR_IDEMPOTENCY_KEY'],"
        " 'type': os.environ['SPANVISOR_COMMAND_TYPE'], 'home': os.environ.get('WORKER_HOME')},"
        " open(sys.argv[1], 'w'))"
    )
    restart = WorkerRestart.from_params(
        {"argv": [sys.executable, "-c", record, str(out), "{run_id}"], "env": {"WORKER_HOME": "/w"}}
    )
    params = {"reason": "restart after rate_limit", "remediation_id": "rem_1"}
    first = gw.restart_worker(TRIGGER, restart, params, key="rem_1/2/restart_worker")
    ran = orjson.loads(out.read_bytes())
    assert (first["ok"], first["status"]) == (True, 0)
    assert ran["argv"] == [str(out), "run-1"]  # the placeholder is a whole argument
    assert (ran["type"], ran["home"]) == ("resume_run", "/w")
    # Asked again with the same key (a step that never got recorded), the program
    # sees the same idempotency key, so it can tell a repeat.
    again = gw.restart_worker(TRIGGER, restart, params, key="rem_1/2/restart_worker")
    assert orjson.loads(out.read_bytes())["key"] == ran["key"]
    assert again["command_id"] == first["command_id"]
    assert not store.commands()  # run by the gateway, not delivered to the agent

    failing = WorkerRestart.from_params({"argv": [sys.executable, "-c", "raise SystemExit(3)"]})
    failed = gw.restart_worker(TRIGGER, failing, params, key="rem_1/3/restart_worker")
    assert (failed["ok"], failed["status"], failed["detail"]) == (False, 3, "exit 3")
    store.close()


def test_the_watch_tells_only_the_remediations_of_that_run_and_dependency() -> None:
    told: list[tuple[str, Any]] = []
    watch = RecoveryWatch(lambda rid, evidence: told.append((rid, evidence)))
    watch.watch(["run-1", "a" * 32], "openai:gpt-4o", "rem_1")
    watch.watch(["run-2"], "openai:gpt-4o", "rem_2")
    assert watch.dependencies == {"openai:gpt-4o"}
    watch.succeeded("run-1", "openai:gpt-4o", "c" * 16)
    watch.succeeded("run-1", "anthropic:claude", "d" * 16)
    watch.succeeded("run-1", "openai:gpt-4o", "e" * 16)  # told once: no pile of messages
    assert [rid for rid, _ in told] == ["rem_1"]
    watch.unwatch("rem_1")
    watch.unwatch("rem_2")
    assert watch.dependencies == set() and len(watch) == 0


def test_a_run_that_ended_ok_is_a_recovery_before_or_after_the_watch_began() -> None:
    told: list[tuple[str, Any]] = []
    watch = RecoveryWatch(lambda rid, evidence: told.append((rid, evidence)))
    # Ended in the batch that carried its failure, before the remediation watched.
    watch.ended("a" * 32, "a" * 32, "1" * 16)
    watch.watch(["a" * 32], "openai:gpt-4o", "rem_early")
    # A session run: one of its traces ends while the remediation watches.
    watch.watch(["session-1", "b" * 32], "openai:gpt-4o", "rem_late")
    watch.ended("c" * 32, "other-run", "2" * 16)  # someone else's run
    watch.ended("d" * 32, "session-1", "3" * 16)
    assert [(rid, e["dependency"], e["span_id"]) for rid, e in told] == [
        ("rem_early", RUN_ENDED_OK, "1" * 16),
        ("rem_late", RUN_ENDED_OK, "3" * 16),
    ]
    assert len(watch) == 0 and watch.dependencies == set()
    # Remembered ends are bounded: two generations of a few thousand traces.
    for n in range(10_000):
        watch.ended(f"{n:032x}", f"{n:032x}", "4" * 16)
    watch.watch([f"{0:032x}"], "openai:gpt-4o", "rem_forgotten")
    assert told[-1][0] == "rem_late" and len(watch) == 1


def test_a_read_only_database_is_a_clear_error(tmp_path: Path) -> None:
    """Read-only by permissions (when not root) or opened read-only (root ignores modes)."""
    _read_only_case(tmp_path, by_mode=os.geteuid() == 0)


def test_an_unopenable_database_is_a_clear_error_and_decisions_are_counted(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the database directory should be")
    settings = load_settings(
        overrides={
            "state_path": str(tmp_path / "state.db"),
            "remediation_database_url": f"sqlite:///{blocker}/remediations.sqlite",
        }
    )
    store = Store.open(settings.state_path)
    actor = Actor(store, {})
    policy = load_policy()
    remediations = Remediations(settings, actor, Governor(policy), lambda: policy)
    remediations.bind(loop)
    with pytest.raises((ConfigError, OSError)):
        remediations.start()
    assert remediations.runner is None
    store.close()


def _read_only_case(tmp_path: Path, *, by_mode: bool) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    database = directory / "remediations.sqlite"
    database.write_bytes(b"")
    database.chmod(stat.S_IRUSR)
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        settings = load_settings(
            overrides={
                "state_path": str(tmp_path / "state.db"),
                "remediation_database_url": f"sqlite:///file:{database}?mode=ro&uri=true"
                if by_mode
                else f"sqlite:///{database}",
            }
        )
        store = Store.open(settings.state_path)
        policy = load_policy()
        remediations = Remediations(settings, Actor(store, {}), Governor(policy), lambda: policy)
        loop = asyncio.new_event_loop()
        remediations.bind(loop)
        with pytest.raises(ConfigError, match="cannot start remediations"):
            remediations.start()
        loop.close()
        store.close()
    finally:
        directory.chmod(stat.S_IRWXU)
