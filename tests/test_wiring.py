"""The sidecar's parts as the wiring builds them: connected at construction, refused early."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from policies import load_policy
from supervisor.app import Sidecar
from supervisor.errors import ConfigError
from supervisor.records import Action
from supervisor.settings import Settings, load_settings
from supervisor.wiring import build_sidecar
from tests.test_api import _outcome

STALL_AFTER = "version: 1\ndetectors:\n  stalls: {{idle_seconds: {idle}}}\n"


def settings(tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "api_token": "tok",
        "token_file": str(tmp_path / "token"),
        "state_path": str(tmp_path / "state.db"),
        "agents": {"agent": {"pull": {}}},
    }
    values.update(overrides)
    return load_settings(overrides=values)


def close(sidecar: Sidecar) -> None:
    """What a sidecar built but never started holds: its store and its exporters."""
    sidecar.metrics.shutdown(1)
    sidecar.tracer.shutdown(1)
    sidecar.store.close()


@pytest.fixture
def built(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = build_sidecar(settings(tmp_path), load_policy())
    try:
        yield sidecar
    finally:
        close(sidecar)


def test_the_pipeline_is_given_the_run_tracker_and_the_recovery_watch(built: Sidecar) -> None:
    assert built.pipeline.runs is built.runs
    assert built.pipeline.recovery is built.remediations.watch
    assert built.pipeline.governor is built.governor


def test_without_run_tracking_the_pipeline_has_no_tracker(tmp_path: Path) -> None:
    sidecar = build_sidecar(settings(tmp_path, track_runs=False), load_policy())
    try:
        assert sidecar.pipeline.runs is None
        assert sidecar.pipeline.recovery is sidecar.remediations.watch
    finally:
        close(sidecar)


def test_an_answered_approval_is_told_to_the_remediations(
    built: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    told: list[dict[str, Any]] = []
    monkeypatch.setattr(built.remediations, "answered", told.append)
    built.actor.store_outcomes([_outcome(Action.ESCALATE)])
    [pending] = built.store.approvals(status="pending")

    built.actor.answer(pending.id, approved=True, by="ops", note="")

    assert [(t["id"], t["status"]) for t in told] == [(pending.id, "approved")]


def test_a_reloaded_policy_reaches_the_parts_that_read_it_at_each_use(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(STALL_AFTER.format(idle=60))
    sidecar = build_sidecar(settings(tmp_path, policy=str(policy_file)), load_policy(policy_file))
    try:
        assert sidecar.runs.settings_for("agent").idle_seconds == 60
        policy_file.write_text(STALL_AFTER.format(idle=30))

        assert sidecar.reload_policy()["reloaded"] is True

        assert sidecar.runs.settings_for("agent").idle_seconds == 30
        assert sidecar.policy is sidecar.policy_in_force() is sidecar.pipeline.policy
        assert sidecar.governor.policy is sidecar.policy
    finally:
        close(sidecar)


@pytest.mark.parametrize(
    ("overrides", "policy_text", "message"),
    [
        ({"api_host": "0.0.0.0", "api_token": None}, "version: 1\n", "beyond loopback"),
        (
            {},
            "version: 1\nremediators:\n  fix: {use: no_such_remediator}\npolicies:\n"
            "  - {name: r, match: {kind: timeout}, action: remediate, remediator: fix}\n",
            "names remediators that cannot run",
        ),
    ],
)
def test_settings_it_cannot_run_with_are_refused_before_anything_is_written(
    tmp_path: Path, overrides: dict[str, object], policy_text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_sidecar(settings(tmp_path, **overrides), load_policy(text=policy_text))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
