"""The built-in remediators, each against a context with the runner's rules."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from remediators.base import Remediator, Trigger, Verdict
from remediators.builtin import (
    CompactContext,
    Escalate,
    FallbackSwitch,
    LoopBreaker,
    RestartWorker,
    RetryStep,
    Rewind,
)
from remediators.gateway import RecordingGateway
from remediators.testing import FakeContext

DEP = "openai:gpt-4o"


def trigger(**params: Any) -> Trigger:
    return Trigger(
        trace_id="a" * 32,
        span_id="b" * 16,
        service="agent",
        run_id="run-7",
        failure_class="transient",
        kind="rate_limit",
        dependency=DEP,
        rule="r",
        message="429",
        span_name="chat gpt-4o",
        params=params,
    )


def run(remediator: Remediator, ctx: FakeContext) -> Verdict:
    return asyncio.run(remediator.run(ctx))


def context(remediator: type[Remediator], gateway: RecordingGateway, **params: Any) -> FakeContext:
    return FakeContext(trigger(**params), gateway, remediator.tools)


def sent(gateway: RecordingGateway) -> list[tuple[str, dict[str, Any]]]:
    return [(c["command"], c["params"]) for c in gateway.commands.values()]


def test_retry_step_backs_off_durably_then_asks_for_the_retry() -> None:
    gateway = RecordingGateway()
    ctx = context(RetryStep, gateway, delay_s=7.5)
    assert run(RetryStep({}), ctx) is Verdict.ACTED
    assert ctx.waited == [("sleep", 7.5)]  # the decision's backoff, kept by the runner
    assert [name for name, _ in sent(gateway)] == ["retry_step"]
    assert run(RetryStep({"delay_s": 99999}), context(RetryStep, gateway)) is Verdict.ACTED
    assert RetryStep.check_params({"delay_s": -1}) == ["delay_s must be a number >= 0, not -1"]


def test_fallback_switch_skips_open_breakers_and_asks_when_none_is_left() -> None:
    chain = [DEP, "anthropic:claude", "mistral:large"]
    gateway = RecordingGateway(
        chains={DEP: chain}, breakers=[{"dependency": "anthropic:claude", "state": "open"}]
    )
    assert run(FallbackSwitch({}), context(FallbackSwitch, gateway, chain=chain)) is Verdict.ACTED
    assert sent(gateway)[0][1]["to"] == "mistral:large"

    spent = RecordingGateway(chains={DEP: [DEP]})
    ctx = context(FallbackSwitch, spent, chain=[DEP])
    assert run(FallbackSwitch({}), ctx) is Verdict.ESCALATED
    assert not spent.commands and len(spent.approvals) == 1


def test_loop_breaker_guides_then_rewinds_then_aborts_as_the_loop_goes_on() -> None:
    rungs = []
    for occurrence in (1, 2, 3):
        gateway = RecordingGateway()
        ctx = context(
            LoopBreaker, gateway, repeated_call="search_web", repeats=5, occurrence=occurrence
        )
        ctx = FakeContext(
            dataclasses.replace(ctx.trigger, dependency="tool:search_web"),
            gateway,
            LoopBreaker.tools,
        )
        verdict = run(LoopBreaker({}), ctx)
        ((command, params),) = sent(gateway)
        rungs.append((occurrence, command, verdict))
        if command == "inject_guidance":
            assert "search_web 5 times" in params["guidance"]
        if command == "rewind_run":
            assert params["tool"] == "search_web"
            assert "different approach" in params["summary"]
    assert rungs == [
        (1, "inject_guidance", Verdict.ACTED),
        (2, "rewind_run", Verdict.ACTED),
        (3, "abort_run", Verdict.FAILED),
    ]


def test_loop_breaker_rewinds_an_llm_repeating_itself_by_its_repeated_turns() -> None:
    gateway = RecordingGateway()
    ctx = context(LoopBreaker, gateway, repeated_call="chat gpt-4o", repeats=4, occurrence=2)
    assert run(LoopBreaker({}), ctx) is Verdict.ACTED
    ((command, params),) = sent(gateway)
    assert command == "rewind_run" and params["steps_back"] == 4 and "tool" not in params


def test_rewind_goes_back_with_why_the_result_failed_verification() -> None:
    gateway = RecordingGateway()
    ctx = context(Rewind, gateway)
    assert run(Rewind({"steps_back": 2}), ctx) is Verdict.ACTED
    ((command, params),) = sent(gateway)
    assert command == "rewind_run" and params["steps_back"] == 2
    assert "failed verification (429)" in params["summary"]
    assert Rewind.check_params({"steps_back": 0}) == [
        "steps_back must be an integer between 1 and 100"
    ]


def test_escalate_pauses_asks_with_context_and_applies_the_default_on_timeout() -> None:
    gateway = RecordingGateway()
    ctx = context(Escalate, gateway)
    assert run(Escalate({"timeout_s": 5, "on_timeout": "abort_run"}), ctx) is Verdict.ESCALATED
    assert [name for name, _ in sent(gateway)] == ["pause_run", "abort_run"]
    (approval,) = gateway.approvals.values()
    body = approval["body"]
    assert "run-7" in body["question"] and "rate_limit" in body["question"]
    assert body["on_approve"] and body["on_deny"]

    answered = RecordingGateway()
    ctx = context(Escalate, answered)
    ctx.answer = {"approved": True}
    assert run(Escalate({}), ctx) is Verdict.ESCALATED
    assert [name for name, _ in sent(answered)] == ["pause_run"]  # the answer goes to the agent
    assert Escalate.check_params({"on_timeout": "explode"})


def test_restart_worker_asks_the_gateway_to_run_its_argv_within_intensity() -> None:
    params = {"argv": ["/usr/local/bin/restart-worker", "--", "{run_id}"], "timeout_s": 5}
    gateway = RecordingGateway(restarts_left=1)
    ctx = FakeContext(trigger(), gateway, RestartWorker.tools, params=params)
    assert run(RestartWorker(params), ctx) is Verdict.ACTED
    # The remediator runs nothing itself: the gateway gets the configured program,
    # placeholders as written (it fills them in), under the call's idempotency key.
    (restart,) = gateway.restarts
    assert (restart["argv"], restart["timeout_s"], restart["run_id"]) == (
        ["/usr/local/bin/restart-worker", "--", "{run_id}"],
        5.0,
        "run-7",
    )
    assert restart["key"] == "rem_test/2/restart_worker"
    assert restart["params"]["remediation_id"] == "rem_test"
    assert [call[0] for call in ctx.calls] == ["restart_worker"]
    # The intensity is spent: a person is asked instead of restarting again.
    again = FakeContext(trigger(), gateway, RestartWorker.tools, params=params)
    assert run(RestartWorker(params), again) is Verdict.ESCALATED
    assert len(gateway.restarts) == 1 and len(gateway.approvals) == 1


def test_restart_worker_fails_when_the_program_fails_and_is_refused_unconfigured() -> None:
    params = {"argv": ["restart.sh"]}
    failing = RecordingGateway(restart_exit=3)
    ctx = FakeContext(trigger(), failing, RestartWorker.tools, params=params)
    assert run(RestartWorker(params), ctx) is Verdict.FAILED
    assert ctx.logs == ["restart command failed: exit 3"]
    # Narrowed out of the allowlist, or with no command configured, nothing runs.
    narrowed = RecordingGateway()
    tools = RestartWorker.tools - {"restart_worker"}
    ctx = FakeContext(trigger(), narrowed, tools, params=params)
    assert run(RestartWorker(params), ctx) is Verdict.FAILED
    unconfigured = FakeContext(trigger(), narrowed, RestartWorker.tools)
    assert run(RestartWorker({}), unconfigured) is Verdict.FAILED
    (_, _, refused) = unconfigured.calls[0]
    assert refused.refused and "no restart command" in refused.error
    assert not narrowed.restarts
    assert RestartWorker.check_params({"argv": "restart.sh"}) == [
        "argv must be a non-empty list of strings"
    ]
    assert RestartWorker.check_params({"argv": ["restart.sh", "--run={run_id}"]})
    assert RestartWorker.check_params(params) == []


def test_compact_context_asks_the_agent_to_compact() -> None:
    gateway = RecordingGateway()
    assert run(CompactContext({"target_tokens": 8000}), context(CompactContext, gateway)) is (
        Verdict.ACTED
    )
    ((name, params),) = sent(gateway)
    assert (name, params["target_tokens"]) == ("compact_context", 8000)
