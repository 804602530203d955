"""Admission's learned rates pace the governor's resumes and retries (supervisor side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies import Governor, load_policy
from supervisor.admission.capacity import AdmissionCapacity
from supervisor.admission.config import admitter_for
from supervisor.admission.key import admission_key
from supervisor.records import Action
from supervisor.wiring import build_sidecar
from tests.test_app import settings
from tests.test_governor import failure
from tests.test_pacer import RETRIES
from tests.test_shared_counts import Clock

POLICY = (
    RETRIES
    + """\
admission:
  default: {rpm: 6000, headroom: 0}
  keys:
    "openai:gpt-4o": {rpm: 60, headroom: 0}
    "openai:gpt-4o@team-a": {rpm: 120, headroom: 0}
"""
)


def test_the_capacity_is_the_keys_learned_rate() -> None:
    policy = load_policy(text=POLICY)
    clock = Clock(1000.0)
    admitter = admitter_for(policy.limits.admission, clock=clock)
    enabled = [True]
    capacity = AdmissionCapacity(admitter, lambda: enabled[0])
    assert capacity("openai:gpt-4o") == 60
    assert capacity("openai:gpt-4o@team-a") == 120  # a breaker keyed by credential
    assert capacity("openai:gpt-4o-mini") == 6000
    admitter.throttled("openai:gpt-4o")  # a 429: every key of the model learns it
    assert capacity("openai:gpt-4o") == pytest.approx(42)
    assert capacity("openai:gpt-4o@team-a") == pytest.approx(84)
    assert capacity("search") is None  # not provider:model
    assert capacity("openai:gpt-4o@sk-abc") is None  # never a secret as a key
    assert capacity("") is None
    enabled[0] = False
    assert capacity("openai:gpt-4o") is None


def test_a_rate_is_known_only_once_the_policy_or_the_provider_says_it() -> None:
    """The built-in default is a guess: no pacing by it. A key of the policy's own, a
    published limit or a 429 make the rate known."""
    keys = '{"openai:gpt-4o": {rpm: 60, headroom: 0}}'
    policy = load_policy(text=f"version: 1\nadmission: {{keys: {keys}}}\n")
    admitter = admitter_for(policy.limits.admission, clock=Clock(1000.0))
    capacity = AdmissionCapacity(admitter, lambda: True)
    assert capacity("openai:gpt-4o") == 60
    assert capacity("openai:gpt-4o-mini") is None
    assert capacity("anthropic:claude-sonnet-4") is None
    admitter.throttled("anthropic:claude-sonnet-4")
    # The built-in ceiling, less its 5% headroom, after one 429: 600 x 0.95 x 0.7.
    assert capacity("anthropic:claude-sonnet-4") == pytest.approx(399)


def test_the_headroom_keeps_admission_under_the_ceiling() -> None:
    """5% below a key's ceiling by default: the provider counts on its own clock, so a
    fleet admitted at exactly the limit meets 429s at the edge of its bucket."""
    policy = load_policy(text='version: 1\nadmission: {keys: {"openai:gpt-4o": {rpm: 60}}}\n')
    admitter = admitter_for(policy.limits.admission, clock=Clock(1000.0))
    assert AdmissionCapacity(admitter, lambda: True)("openai:gpt-4o") == pytest.approx(57)
    key = admission_key("openai:gpt-4o", None)
    answers = [admitter.admit(key).go for _ in range(58)]
    assert answers.count(True) == 57  # the bucket holds a minute at 57 a minute


def test_retries_are_spaced_at_the_learned_rate() -> None:
    policy = load_policy(text=POLICY)
    admitter = admitter_for(policy.limits.admission, clock=Clock(1000.0))
    governor = Governor(
        policy, clock=Clock(1000.0), capacity=AdmissionCapacity(admitter, lambda: True)
    )
    admitter.throttled("openai:gpt-4o")  # 60 -> 42 rpm: one call every 60/42 s

    def delays(dependency: str) -> list[float]:
        out = []
        for n in range(5):
            f = failure(run=f"{dependency}-{n}", dependency=dependency)
            decision = governor.review(f, policy.decide(f, attempt=1))
            assert decision.action is Action.RETRY
            out.append(float(str(decision.params["delay_s"])))
        return out

    assert delays("openai:gpt-4o") == [round(1 + n * 60 / 42, 3) for n in range(5)]
    # Its own slots, at its own ceiling (120), lowered by the model's 429 too (84).
    assert delays("openai:gpt-4o@team-a") == [round(1 + n * 60 / 84, 3) for n in range(5)]


def test_a_built_sidecar_paces_by_its_admitter(tmp_path: Path) -> None:
    """The wiring hands the governor the admitter's rates, once it knows one: the
    built-in ceiling (600 rpm) is a guess, so it paces nothing until a 429 teaches
    it; a reload disabling admission stops the pacing (read at each question)."""
    sidecar = build_sidecar(settings(tmp_path), load_policy())
    try:
        pacer = sidecar.governor.pacer
        assert pacer.interval("openai:gpt-4o") is None
        sidecar.admitter.throttled("openai:gpt-4o")
        assert pacer.interval("openai:gpt-4o") == pytest.approx(60 / 399)
        assert pacer.interval("openai:gpt-4o@team-a") == pytest.approx(60 / 399)
        assert pacer.interval("openai:gpt-4o-mini") is None
        assert pacer.interval("search") is None
        off = load_policy(text="version: 1\nadmission: {enabled: false}\n")
        sidecar.policy_in_force.replace(off)
        assert pacer.interval("openai:gpt-4o") is None
    finally:
        sidecar.metrics.shutdown(1)
        sidecar.tracer.shutdown(1)
        sidecar.store.close()


def test_an_answer_is_remembered_until_the_admitter_learns_or_a_second_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = load_policy(text=POLICY)
    clock = Clock(1000.0)
    admitter = admitter_for(policy.limits.admission, clock=clock)
    capacity = AdmissionCapacity(admitter, lambda: True, clock=clock)
    asked: list[object] = []
    rpm = admitter.rpm
    monkeypatch.setattr(admitter, "rpm", lambda key: asked.append(key) or rpm(key))
    assert capacity("openai:gpt-4o") == 60
    clock.now += 0.5
    assert capacity("openai:gpt-4o") == 60
    assert len(asked) == 1  # remembered
    admitter.throttled("openai:gpt-4o")  # learned: asked again at once
    assert capacity("openai:gpt-4o") == pytest.approx(42)
    clock.now += 60.0  # a quiet window gives 5% back: seen once the memo is a second old
    assert capacity("openai:gpt-4o") == pytest.approx(45)
