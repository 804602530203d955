"""Remediators by name: built-ins, dotted paths, and what a policy may ask of them."""

from __future__ import annotations

from typing import Any

import pytest

from policies import load_policy
from remediators.base import RemediationContext, Remediator, Trigger, Verdict
from remediators.builtin import FallbackSwitch
from remediators.gateway import RecordingGateway
from remediators.registry import RemediatorNotFound, check_policy, resolve
from remediators.tools import TOOL_SPECS, check_arguments, function_definitions


class Custom(Remediator):
    """A third-party remediator, named in a policy as ``tests.test_remediators_registry:Custom``."""

    name = "custom"
    tools = frozenset({"recent_spans", "inject_guidance"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        return Verdict.FAILED


class NotARemediator:
    pass


def test_builtins_and_dotted_paths_resolve() -> None:
    assert resolve("fallback_switch") is FallbackSwitch
    assert resolve(f"{__name__}:Custom") is Custom
    with pytest.raises(RemediatorNotFound, match="not built in"):
        resolve("nowhere")
    with pytest.raises(RemediatorNotFound, match="cannot import"):
        resolve("no_such_package.mod:Thing")
    with pytest.raises(RemediatorNotFound, match="has no 'Missing'"):
        resolve(f"{__name__}:Missing")
    with pytest.raises(RemediatorNotFound, match="not a spanvisor Remediator"):
        resolve(f"{__name__}:NotARemediator")


def test_a_policy_cannot_widen_a_remediators_tools_or_name_one_that_is_missing() -> None:
    policy = load_policy(
        text=f"""\
version: 1
remediators:
  wide:
    use: {__name__}:Custom
    tools: [recent_spans, abort_run]
  gone:
    use: no_such_package.mod:Thing
  bad_params:
    use: restart_worker
    params: {{argv: "not a list"}}
  narrow:
    use: {__name__}:Custom
    tools: [recent_spans]
  model_restarts:
    use: llm
    tools: [recent_spans, restart_worker]
  restarts:
    use: restart_worker
    tools: [restart_worker, request_approval]
    params: {{argv: [restart-worker, "{{run_id}}"]}}
"""
    )
    problems = check_policy(policy)
    # A model never gets to run a program: its params configure none.
    assert any("remediators.model_restarts.tools: restart_worker not usable" in p for p in problems)
    assert not any(p.startswith("remediators.restarts") for p in problems)
    assert any("remediators.wide.tools: abort_run not usable" in p for p in problems)
    assert any(p.startswith("remediators.gone: cannot import") for p in problems)
    assert any("remediators.bad_params.params: argv must be" in p for p in problems)
    assert not any("narrow" in p for p in problems)
    assert check_policy(load_policy()) == []  # the built-in policy's own


TRIGGER = Trigger(
    trace_id="a" * 32,
    span_id="b" * 16,
    service="agent",
    run_id="a" * 32,
    failure_class="transient",
    kind="rate_limit",
    dependency="openai:gpt-4o",
    rule="r",
    message="",
    span_name="chat",
)


@pytest.mark.parametrize(
    ("tool", "arguments", "refusal"),
    [
        ("switch_fallback", {"to": "anthropic:claude"}, ""),
        ("switch_fallback", {"to": "attacker:model"}, "not in 'openai:gpt-4o''s fallback chain"),
        ("switch_fallback", {"to": "openai:gpt-4o"}, "fallback chain"),
        ("switch_fallback", {}, "missing to"),
        ("inject_guidance", {"guidance": "x" * 5000}, "longer than 2000"),
        ("inject_guidance", {"guidance": 3}, "must be a string"),
        ("retry_step", {"delay_s": -1}, "between 0 and 3600"),
        ("retry_step", {"delay_s": True}, "must be a number"),
        ("abort_run", {"command": "rm -rf /"}, "takes no argument 'command'"),
        ("resume_run", {"unverified": ["tool:send_email call_1"]}, ""),
        ("shell", {}, "unknown tool"),
    ],
)
def test_arguments_are_checked_before_anything_runs(
    tool: str, arguments: dict[str, object], refusal: str
) -> None:
    gateway = RecordingGateway(chains={"openai:gpt-4o": ["openai:gpt-4o", "anthropic:claude"]})
    reason = check_arguments(tool, arguments, TRIGGER, gateway)
    assert (refusal in reason) if refusal else reason == ""


def test_function_definitions_offer_only_the_allowlist() -> None:
    offered = function_definitions(frozenset({"recent_spans", "switch_fallback"}))
    assert [d["function"]["name"] for d in offered] == ["recent_spans", "switch_fallback"]
    schema = offered[1]["function"]["parameters"]
    assert schema["required"] == ["to"] and schema["additionalProperties"] is False
    assert set(TOOL_SPECS) >= {"request_approval", "breaker_states"}


def test_an_entry_point_names_a_third_party_remediator(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    point = metadata.EntryPoint(
        name="custom_fixer", value=f"{__name__}:Custom", group="spanvisor.remediators"
    )
    real = metadata.entry_points

    def entry_points(**kwargs: Any) -> Any:
        if kwargs.get("group") == "spanvisor.remediators":
            return metadata.EntryPoints([point])
        return real(**kwargs)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    resolve.cache_clear()
    try:
        assert resolve("custom_fixer") is Custom
    finally:
        resolve.cache_clear()
