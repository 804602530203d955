"""The run tracker: progress per run, reasoning loops and stalls, bounded."""

from __future__ import annotations

import json
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from policies import load_policy
from policies._detectors import DetectorSettings
from supervisor.judge.pipeline import Pipeline, detected_failure
from supervisor.normalize import read_spans
from supervisor.runs import Detection, RunTracker

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
_ids = iter(range(1, 1_000_000))


def _value(value: object) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(string_value=str(value))


def span(
    name: str,
    attributes: dict[str, object],
    *,
    trace: bytes = TRACE,
    parent: bool = True,
) -> Span:
    return Span(
        trace_id=trace,
        span_id=next(_ids).to_bytes(8, "big"),
        parent_span_id=b"\x00" * 7 + b"\x01" if parent else b"",
        name=name,
        start_time_unix_nano=1,
        end_time_unix_nano=2,
        attributes=[KeyValue(key=k, value=_value(v)) for k, v in attributes.items()],
    )


def payload(*spans: Span, service: str = "agent") -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(KeyValue(key="service.name", value=_value(service)))
    resource.scope_spans.add().spans.extend(spans)
    return request.SerializeToString()


def tool(name: str, arguments: dict[str, Any], **extra: object) -> Span:
    return span(
        f"execute_tool {name}",
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.arguments": json.dumps(arguments),
            **extra,
        },
    )


def llm(output: str = "", tool_calls: list[dict[str, Any]] | None = None, **extra: object) -> Span:
    message: dict[str, Any] = {"role": "assistant", "parts": []}
    if output:
        message["parts"].append({"type": "text", "content": output})
    for call in tool_calls or []:
        message["parts"].append({"type": "tool_call", **call})
    return span(
        "chat gpt-4o",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "gpt-4o",
            "gen_ai.usage.input_tokens": 100,
            "gen_ai.usage.output_tokens": 20,
            "gen_ai.output.messages": json.dumps([message]),
            **extra,
        },
    )


def feed(tracker: RunTracker, data: bytes, now: float = 1000.0) -> list[Detection]:
    found: list[Detection] = []
    for item in read_spans(data):
        tracker.observe(item, now, found)
    return found


def test_a_run_counts_its_spans_calls_and_tokens() -> None:
    tracker = RunTracker()
    feed(tracker, payload(llm("hi"), tool("search", {"q": "a"}), llm("done")))
    (view,) = tracker.snapshot(now=1005.0)
    assert (view.run_id, view.service, view.status) == (TRACE.hex(), "agent", "running")
    assert (view.spans, view.llm_calls, view.tool_calls) == (3, 2, 1)
    assert (view.input_tokens, view.output_tokens) == (200, 40)
    assert view.idle_s == 5.0 and view.step == "chat gpt-4o"


def test_spans_of_a_session_make_one_run_across_traces() -> None:
    tracker = RunTracker()
    other = bytes.fromhex("1" * 32)
    feed(tracker, payload(llm("a", **{"gen_ai.conversation.id": "conv-9"})))
    feed(tracker, payload(span("step", {"gen_ai.conversation.id": "conv-9"}, trace=other)))
    feed(tracker, payload(span("untagged child", {}, trace=other)))  # its trace named the session
    (view,) = tracker.snapshot()
    assert view.run_id == "conv-9" and view.spans == 3


def test_which_session_a_trace_is_in_is_remembered_for_recent_traces_and_bounded() -> None:
    tracker = RunTracker(max_runs=10)
    traces = [bytes([i + 1]) * 16 for i in range(25)]
    for i, trace in enumerate(traces):
        feed(tracker, payload(span("step", {"session.id": f"s-{i}"}, trace=trace)))
    remembered = {**tracker._sessions_before, **tracker._sessions}
    assert 5 <= len(remembered) <= 10 and traces[-1].hex() in remembered
    feed(tracker, payload(span("untagged child", {}, trace=traces[-1])))
    assert tracker.snapshot()[0].run_id == "s-24" and tracker.snapshot()[0].spans == 2


def test_the_same_tool_call_three_times_is_one_loop_at_the_first_repeat() -> None:
    tracker = RunTracker()
    calls = [tool("search", {"q": "weather"}) for _ in range(4)]
    other = tool("search", {"q": "news"})
    found = feed(tracker, payload(calls[0], other, calls[1], calls[2], calls[3]))
    (loop,) = found
    assert loop.span_id == calls[1].span_id.hex()  # the first repeated call
    assert (loop.dependency, loop.details["repeats"], loop.kind) == (
        "tool:search",
        3,
        "reasoning_loop",
    )
    assert loop.message.startswith("the same tool call 3 times")


def test_a_loop_that_goes_on_is_reported_again_three_times_at_most() -> None:
    tracker = RunTracker()
    calls = [tool("search", {"q": "weather"}) for _ in range(12)]
    found: list[Detection] = []
    for second, call in enumerate(calls):  # one call a second, each in its own batch
        now = 1000.0 + second
        call.start_time_unix_nano = int(now * 1e9) - 500_000_000
        found += feed(tracker, payload(call), now=now)
    # Reported at the 3rd call, then at the 5th and the 7th (2 more calls each), never
    # again; each report is placed at the first call after the previous one.
    assert [(d.span_id, d.details["occurrence"]) for d in found] == [
        (calls[1].span_id.hex(), 1),
        (calls[3].span_id.hex(), 2),
        (calls[5].span_id.hex(), 3),
    ]
    assert "still looping, report 3" in found[2].message


def test_calls_made_before_a_loop_was_reported_do_not_report_it_again() -> None:
    # A backlog (the agent's exporter after a sidecar restart) brings the whole loop
    # at once: the agent could not have been told yet, so it is one report, not three.
    tracker = RunTracker()
    calls = [tool("search", {"q": "weather"}) for _ in range(12)]
    (loop,) = feed(tracker, payload(*calls), now=1000.0)
    assert loop.details["occurrence"] == 1

    later = [tool("search", {"q": "weather"}) for _ in range(3)]
    for call in later:
        call.start_time_unix_nano = 1001 * 10**9
    (again,) = feed(tracker, payload(*later), now=1002.0)
    assert again.details["occurrence"] == 2


def test_a_loop_needs_its_repeats_within_the_window() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(loop_repeats=3, loop_window=4))
    same = {"q": "weather"}
    spans = [tool("search", same)]
    spans += [tool("search", {"q": str(n)}) for n in range(4)]  # pushes the first out
    spans += [tool("search", same), tool("search", same)]
    assert feed(tracker, payload(*spans)) == []


def test_tool_calls_and_llm_outputs_count_in_windows_of_their_own() -> None:
    # Each tool call below follows an LLM call: a window shared by both kinds would hold
    # two of the three repeats only, and miss the loop.
    tracker = RunTracker(settings=lambda s: DetectorSettings(loop_repeats=3, loop_window=3))
    spans = []
    for n in range(3):
        spans += [llm(f"thinking {n}"), tool("search", {"q": "weather"})]
    (loop,) = feed(tracker, payload(*spans))
    assert loop.dependency == "tool:search" and loop.span_id == spans[3].span_id.hex()


def test_the_same_llm_output_to_a_growing_context_is_a_loop() -> None:
    tracker = RunTracker()
    again = "I will check again."
    found = feed(
        tracker,
        payload(*(llm(again, **{"gen_ai.usage.input_tokens": n}) for n in (100, 180, 260))),
    )
    (loop,) = found
    assert loop.dependency == "openai:gpt-4o"
    assert loop.message.startswith("the same LLM output")


def test_the_same_answer_to_the_same_prompt_is_a_retry_not_a_loop() -> None:
    tracker = RunTracker()
    assert feed(tracker, payload(*(llm("I will check again.") for _ in range(4)))) == []


def test_a_silent_open_run_stalls_once_listing_unanswered_tool_calls() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(idle_seconds=60))
    asked = llm(
        tool_calls=[
            {"id": "c1", "name": "charge_card", "arguments": {"amount": 5}},
            {"id": "c2", "name": "send_email", "arguments": {"to": "a@b"}},
        ]
    )
    feed(tracker, payload(asked, tool("charge_card", {"amount": 5})), now=1000.0)
    assert tracker.stalled(now=1059.0) == []
    (stall,) = tracker.stalled(now=1061.0)
    assert stall.details["unverified"] == ("send_email({'to': 'a@b'})",) or stall.details[
        "unverified"
    ][0].startswith("send_email(")
    assert stall.span_id == "" or len(stall.span_id) == 16
    assert tracker.stalled(now=1200.0) == []  # once per silence
    (view,) = tracker.snapshot(now=1200.0)
    assert view.status == "stalled"
    feed(tracker, payload(tool("send_email", {"to": "a@b"})), now=1300.0)  # it moved again
    assert tracker.snapshot(now=1301.0)[0].status == "running"
    assert len(tracker.stalled(now=1400.0)) == 1


def test_a_run_whose_root_ended_does_not_stall() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(idle_seconds=60))
    feed(tracker, payload(llm("a"), span("agent run", {}, parent=False)), now=1000.0)
    assert tracker.stalled(now=5000.0) == []
    assert tracker.snapshot(now=5000.0)[0].status == "ended"


def test_a_run_told_to_retry_that_then_goes_silent_stalls() -> None:
    # The turn failed (its root span ended with the error) and the sidecar decided a
    # retry: an agent killed before acting on it leaves the run half done.
    policy = load_policy(text="version: 1\ndetectors:\n  stalls: {idle_seconds: 60}\n")
    tracker = RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models)
    pipeline = Pipeline(policy, runs=tracker)
    failed = llm(**{"error.type": "openai.RateLimitError"})
    failed.status.code = 2
    failed.status.message = (
        "Error code: 429 - {'error': {'code': 'rate_limit_exceeded', 'message':"
        " 'Rate limit reached. Please try again in 20s.'}}"
    )
    root = span("invoke_agent", {"gen_ai.operation.name": "invoke_agent"}, parent=False)
    root.start_time_unix_nano, root.end_time_unix_nano = 0, 3  # around the LLM call
    root.status.code = 2
    (outcome,) = pipeline.process_payload(payload(failed, root), received_ns=1000 * 10**9)
    assert outcome.decision.action.value == "retry"
    delay = outcome.decision.params["delay_s"]
    assert delay >= 20  # the provider's own delay, honoured

    # Idle time counts from when the retry may be delivered, not from the failure.
    assert tracker.stalled(now=1000.0 + delay + 59) == []
    (stall,) = tracker.stalled(now=1000.0 + delay + 61)
    assert stall.kind == "stall"


def test_a_failed_root_that_arrives_after_the_retry_was_decided_keeps_the_run_open() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(idle_seconds=60))
    feed(tracker, payload(llm("a")), now=1000.0)
    run_id = tracker.snapshot(now=1000.0)[0].run_id
    tracker.commanded(run_id, "retry_step", 1001.0, {})  # the LLM call failed: retry in 1 s
    root = span("agent run", {}, parent=False)
    root.status.code = 2
    found: list[Detection] = []
    for item in read_spans(payload(root)):  # the failed turn's root, in a later batch
        tracker.observe(item, 1000.5, found, repeats=False)

    (stall,) = tracker.stalled(now=1001.0 + 61)
    assert stall.run_id == run_id

    done = span("agent run", {}, parent=False)  # the retried turn ends well: run ended
    feed(tracker, payload(llm("b"), done), now=1100.0)
    assert tracker.stalled(now=5000.0) == []


def test_runs_are_bounded_and_what_goes_is_counted() -> None:
    tracker = RunTracker(max_runs=3, max_idle_s=100)
    for n in range(5):
        feed(tracker, payload(span("s", {}, trace=bytes([n + 1]) * 16)), now=1000.0 + n)
    assert len(tracker) == 3 and tracker.evicted == 2
    tracker.stalled(now=1103.5)  # the two oldest left are past max_idle_s
    assert tracker.stats() == {
        "tracked": 1,
        "evicted": 2,
        "expired": 2,
        "notices_dropped": 0,
        "budget_forecasts": 0,
        "service_budget_stops": 0,
        "service_budgets_tracked": 0,
    }


def test_a_run_evicted_in_the_middle_of_a_batch_is_not_counted_into() -> None:
    tracker = RunTracker(max_runs=2)
    a, b, c = (bytes([n]) * 16 for n in (1, 2, 3))
    # a's run is evicted by c's, then a's trace goes on in the same batch: a new run.
    feed(tracker, payload(*(span("s", {}, trace=t) for t in (a, b, c, a))))
    views = {view.run_id: view.spans for view in tracker.snapshot(now=1001.0)}
    assert views == {c.hex(): 1, a.hex(): 1}
    assert tracker.evicted == 2


def test_a_run_evicted_by_a_later_batch_leaves_nothing_to_the_new_run() -> None:
    policy = load_policy()
    tracker = RunTracker(
        settings=policy.detectors.for_service, models=policy.detectors.models, max_runs=1
    )
    a, b = (bytes([n]) * 16 for n in (1, 2))
    near = {"gen_ai.usage.input_tokens": 120_000}  # gpt-4o: context pressure
    search = {"q": "weather"}
    asked = [{"id": "c1", "name": "lookup", "arguments": {"x": 1}}]
    first = [tool("search", search), tool("search", search), llm("x", asked, **near)]
    for item in first:
        item.trace_id = a
    assert [d.kind for d in feed(tracker, payload(*first))] == ["context_overflow"]
    tracker.failed(a.hex())
    tracker.settle()

    second = [tool("search", search), llm("y", **near)]
    for item in second:
        item.trace_id = b
    # Two searches in a's run and one in b's are not three: b's tables start empty.
    assert [d.kind for d in feed(tracker, payload(*second))] == ["context_overflow"]
    tracker.settle()
    (view,) = tracker.snapshot(now=1001.0)
    assert (view.run_id, view.spans, view.tool_calls, view.llm_calls) == (b.hex(), 2, 1, 1)
    assert (view.errors, view.input_tokens, view.output_tokens) == (0, 120_000, 20)
    assert view.cost_usd == tracker.models.lookup("gpt-4o").cost_usd(120_000, 20)  # type: ignore[union-attr]
    assert tracker.stalled(now=5000.0)[0].details["unverified"] == ()  # a's request is gone
    assert tracker.stats()["evicted"] == 1


def test_the_pipeline_reports_a_loop_and_the_policy_sends_the_loop_breaker() -> None:
    policy = load_policy()
    pipeline = Pipeline(
        policy,
        runs=RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models),
    )
    calls = [tool("search", {"q": "weather"}) for _ in range(3)]
    outcomes = pipeline.process_payload(payload(*calls), received_ns=1_000_000_000_000)
    (outcome,) = outcomes
    failure, decision = outcome.failure, outcome.decision
    assert (failure.failure_class.value, failure.kind, failure.rule) == (
        "model",
        "reasoning_loop",
        "builtin.detect.reasoning_loop",
    )
    assert failure.span_id == calls[1].span_id.hex()
    assert failure.details["repeats"] == 3
    assert (decision.action.value, decision.params["remediator"]) == ("remediate", "loop_breaker")
    # The same detection again (an exporter re-sending) is not reported twice.
    assert pipeline.judge_detected([failure]) == []


def test_a_stall_becomes_a_resume_run_remediation_per_service_settings() -> None:
    policy = load_policy(
        text="""\
version: 1
detectors:
  stalls: {idle_seconds: 600}
  services:
    "batch-*": {stalls: {idle_seconds: 30}}
"""
    )
    tracker = RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models)
    pipeline = Pipeline(policy, runs=tracker)
    pipeline.process_payload(payload(llm("a"), service="batch-7"), received_ns=10**12)
    pipeline.process_payload(payload(llm("b"), service="web"), received_ns=10**12)
    (stall,) = tracker.stalled(now=1000.0 + 31)
    assert stall.service == "batch-7"
    (outcome,) = pipeline.judge_detected([detected_failure(stall, 10**12)])
    assert (outcome.failure.kind, outcome.failure.failure_class.value) == ("stall", "transient")
    assert outcome.decision.params["remediator"] == "resume_run"
    assert "no span for 31 s" in outcome.failure.message


def test_a_re_sent_batch_is_not_a_loop() -> None:
    tracker = RunTracker()
    batch = payload(tool("search", {"q": "weather"}), tool("search", {"q": "weather"}))
    assert feed(tracker, batch) == []
    assert feed(tracker, batch) == []  # the exporter sent it again: the same two calls
    assert feed(tracker, batch) == []
    assert len(feed(tracker, payload(tool("search", {"q": "weather"})))) == 1  # a third call


def test_context_pressure_is_predicted_once_per_run() -> None:
    policy = load_policy()
    tracker = RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models)
    near = {"gen_ai.usage.input_tokens": 120_000}  # gpt-4o: a 128k window, share 0.9
    found = feed(tracker, payload(llm("a"), llm("b", **near), llm("c", **near)))
    (pressure,) = found
    assert (pressure.kind, pressure.failure_class, pressure.rule) == (
        "context_overflow",
        "model",
        "builtin.detect.context_pressure",
    )
    assert pressure.details["context_window"] == 128_000
    assert "120,000 input tokens are 94%" in pressure.message


def test_a_run_over_its_budget_is_stopped_once() -> None:
    policy = load_policy(text="version: 1\nrun_budget: {max_tokens: 300, action: abort_run}\n")
    pipeline = Pipeline(
        policy,
        runs=RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models),
    )
    outcomes = pipeline.process_payload(
        payload(llm("a"), llm("b"), llm("c"), llm("d")), received_ns=10**12
    )
    (over,) = [o for o in outcomes if o.failure.kind == "budget_exceeded"]
    assert over.failure.failure_class.value == "permanent"
    assert over.failure.details["tokens"] == 360  # 3 calls of 120 crossed 300
    assert "max_tokens" in over.failure.message
    assert over.decision.action.value == "fail_fast"  # the budget's action: abort the run


def test_a_long_run_is_re_anchored_on_its_first_input_every_k_steps() -> None:
    policy = load_policy(
        text="""\
version: 1
detectors:
  reanchor: {after_steps: 3, every_steps: 2}
"""
    )
    pipeline = Pipeline(
        policy,
        runs=RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models),
    )
    objective = json.dumps(
        [{"role": "user", "parts": [{"type": "text", "content": "Refund order 1234."}]}]
    )
    first = llm("thinking", **{"gen_ai.input.messages": objective})
    steps = [first] + [tool("lookup", {"n": n}) for n in range(5)]
    outcomes = pipeline.process_payload(payload(*steps), received_ns=10**12)
    anchors = [o for o in outcomes if o.failure.kind == "goal_drift"]
    assert [a.failure.details["steps"] for a in anchors] == [3, 5]
    assert anchors[0].failure.details["objective"] == "Refund order 1234."
    assert anchors[0].decision.params["remediator"] == "reanchor"
    # Off unless a policy sets it.
    plain_policy = load_policy()
    plain = Pipeline(plain_policy, runs=RunTracker(settings=plain_policy.detectors.for_service))
    assert [
        o for o in plain.process_payload(payload(*steps), 10**12) if o.failure.kind == "goal_drift"
    ] == []
    # Nothing of the first input is kept where it cannot be used, and it is kept bounded.
    [kept] = plain.runs._runs.values()
    assert kept.objective == ""
    huge = llm("thinking", **{"gen_ai.input.messages": "x" * 100_000})
    huge.trace_id = b"\x02" * 16  # another run
    pipeline.process_payload(payload(huge), received_ns=10**12)
    assert {len(run.objective or "") for run in pipeline.runs._runs.values()} == {18, 2000}


def test_ended_runs_roll_up_into_slos_that_policies_can_match() -> None:
    policy = load_policy(
        text="""\
version: 1
slo: {success_target: 0.9, short_window_s: 60, long_window_s: 600, burn_alert: 5, min_runs: 3}
policies:
  - name: no_optional_retries_while_burning
    match: {kind: rate_limit, slo_burning: true}
    action: fail_fast
"""
    )
    clock = [1000.0]
    runs = RunTracker(
        settings=policy.detectors.for_service,
        models=policy.detectors.models,
        slo=policy.detectors.slo,
        clock=lambda: clock[0],
    )
    pipeline = Pipeline(policy, runs=runs)
    for n in range(4):  # four runs fail: their key was revoked
        trace = bytes([n + 1]) * 16
        failing = llm("")
        failing.trace_id = trace
        failing.status.code = 2
        failing.status.message = "AuthenticationError: Error code: 401 - invalid_api_key"
        root = span("agent run", {}, trace=trace, parent=False)
        root.status.code = 2
        pipeline.process_payload(payload(failing, root), received_ns=10**12)
    for n in range(2):  # two runs end well, one after a context-pressure prediction
        trace = bytes([n + 5]) * 16
        answered = llm("done", **{"gen_ai.usage.input_tokens": 127_000 if n else 10})
        answered.trace_id = trace
        root = span("agent run", {}, trace=trace, parent=False)
        pipeline.process_payload(payload(answered, root), received_ns=10**12)
    assert "agent" not in runs.slo_status()  # an end counts once it stayed an end
    clock[0] += 10
    runs.stalled()
    status = runs.slo_status()["agent"]
    assert status["runs"]["long"] == 6
    assert round(status["success_rate"]["long"], 3) == round(2 / 6, 3)
    assert runs.burning("agent") and status["fast_burn"] is True
    limited = llm("")
    limited.trace_id = bytes([9]) * 16
    limited.status.code = 2
    limited.status.message = "RateLimitError: Error code: 429 - rate_limit_exceeded"
    (outcome,) = pipeline.process_payload(payload(limited), received_ns=10**12)
    assert outcome.failure.slo_burning is True
    assert (outcome.decision.policy, outcome.decision.action.value) == (
        "no_optional_retries_while_burning",
        "fail_fast",
    )


def test_a_clock_going_back_or_leaping_ahead_neither_crashes_nor_stalls_wrongly() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(idle_seconds=60), max_idle_s=3600)
    feed(tracker, payload(llm("a")), now=1000.0)
    assert tracker.stalled(now=900.0) == []  # the clock went back: nothing is idle
    feed(tracker, payload(llm("b")), now=950.0)  # a span received "earlier" than the last
    assert tracker.snapshot(now=950.0)[0].idle_s == 0.0
    (stall,) = tracker.stalled(now=1100.0)
    assert stall.details["idle_s"] == 150.0
    assert tracker.stalled(now=10**9) == []  # a leap ahead: the run expires, counted
    assert tracker.stats()["expired"] == 1


def test_the_stall_timer_stops_at_the_first_recent_run_and_finds_the_same_stalls() -> None:
    def tracker_fed(asked: list[str]) -> RunTracker:
        def settings(service: str) -> DetectorSettings:
            asked.append(service)  # one service per run: which runs the timer looked at
            return DetectorSettings(idle_seconds=60)

        tracker = RunTracker(settings=settings, max_idle_s=600)
        for i, at in enumerate((100.0, 1000.0, 1030.0, 1050.0)):
            trace = bytes([i + 1]) * 16
            feed(tracker, payload(span("step", {}, trace=trace), service=f"s{i}"), now=at)
        tracker.reset_settings()
        asked.clear()
        return tracker

    asked_scanned: list[str] = []
    asked_bounded: list[str] = []
    scanned, bounded = tracker_fed(asked_scanned), tracker_fed(asked_bounded)
    bounded.stall_horizon_s = 60

    def stalls(tracker: RunTracker, now: float) -> list[str]:
        return [d.run_id for d in tracker.stalled(now)]

    assert stalls(bounded, 1065.0) == stalls(scanned, 1065.0) == [(b"\x02" * 16).hex()]
    assert asked_scanned == ["s1", "s2", "s3"] and asked_bounded == ["s1"]  # it stopped at s2
    for now in (1095.0, 1200.0):
        assert stalls(bounded, now) == stalls(scanned, now)
    assert (
        bounded.stats()
        == scanned.stats()
        == {
            "tracked": 3,
            "evicted": 0,
            "expired": 1,
            "notices_dropped": 0,
            "budget_forecasts": 0,
            "service_budget_stops": 0,
            "service_budgets_tracked": 0,
        }
    )
    # The clock went back: runs seen "in the future" are passed over, not taken as recent.
    feed(bounded, payload(span("step", {}, trace=b"\x09" * 16)), now=500.0)
    (stall,) = bounded.stalled(now=561.0)
    assert stall.run_id == (b"\x09" * 16).hex()


def test_the_shortest_idle_time_is_over_every_service_with_stalls_on() -> None:
    policy = load_policy(
        text="""
version: 1
detectors:
  stalls: {idle_seconds: 300}
  services:
    "batch-*": {stalls: {idle_seconds: 30, enabled: false}}
    "chat-*": {stalls: {idle_seconds: 45}}
"""
    )
    assert policy.detectors.shortest_idle_s == 45
    off = load_policy(text="version: 1\ndetectors: {stalls: {enabled: false}}\n")
    assert off.detectors.shortest_idle_s == float("inf")


def test_a_run_of_100_000_spans_keeps_bounded_state() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(loop_window=20))
    spans = [tool("search", {"q": n}) for n in range(2_000)]
    for start in range(0, 100_000, 2_000):
        feed(tracker, payload(*spans))  # re-sent 50 times: the same 2,000 calls
        if start == 0:
            spans = [tool("search", {"q": f"{start}-{n}"}) for n in range(2_000)]
    run = next(iter(tracker._runs.values()))
    assert run.spans == 100_000
    assert run.tools is not None and len(run.tools) <= 4 * 20
    assert len(run.tools_since_llm or ()) <= 64


def test_a_trace_reused_by_an_unrelated_service_is_counted_not_crashed() -> None:
    tracker = RunTracker()
    feed(tracker, payload(llm("a"), service="agent"))
    feed(tracker, payload(tool("x", {}), service="billing"))  # the same trace id
    (view,) = tracker.snapshot()
    assert (view.service, view.spans) == ("agent", 2)  # the run keeps its first service


def test_spans_seen_before_their_trace_named_its_session_join_the_session_run() -> None:
    tracker = RunTracker(settings=lambda s: DetectorSettings(idle_seconds=600))
    feed(tracker, payload(span("GET /search", {})), now=1000.0)  # no session yet
    feed(tracker, payload(llm("a", **{"gen_ai.conversation.id": "conv-9"})), now=1000.0)
    (view,) = tracker.snapshot()
    assert (view.run_id, view.spans, view.llm_calls) == ("conv-9", 2, 1)
    feed(tracker, payload(llm("b", **{"gen_ai.conversation.id": "conv-9"})), now=1600.0)
    assert tracker.stalled(now=1601.0) == []  # no leftover trace-keyed run to stall


def test_a_loop_begun_before_the_trace_named_its_session_is_found_in_the_session_run() -> None:
    """The trace's run becomes the session's with what it held: its calls count."""
    tracker = RunTracker()
    calls = [tool("search", {"q": "weather"}) for _ in range(3)]
    assert feed(tracker, payload(calls[0], calls[1])) == []  # no session named yet
    (loop,) = feed(tracker, payload(llm("a", **{"gen_ai.conversation.id": "conv-9"}), calls[2]))
    assert (loop.span_id, loop.run_id) == (calls[1].span_id.hex(), "conv-9")
    assert len(tracker) == 1
