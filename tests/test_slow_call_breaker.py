"""Slow-call-rate breakers: a dependency that answers, too slowly, is opened like a failing one."""

from __future__ import annotations

import itertools

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from policies._breakers import BreakerBoard, BreakerChange, BreakerSettings, BreakerState
from policies._governor import Governor
from supervisor.judge.pipeline import Pipeline
from supervisor.records import Action

DEP = "openai:gpt-4o"
S = 1_000_000_000  # ns


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def slow_board(
    slow_call_s: float | None = 2.0, rate: float = 0.5, min_calls: int = 4
) -> tuple[BreakerBoard, Clock, list[BreakerChange]]:
    clock = Clock()
    changes: list[BreakerChange] = []
    settings = BreakerSettings(
        fail_max=3,
        reset_timeout_s=10.0,
        success_threshold=1,
        slow_call_s=slow_call_s,
        slow_call_rate=rate,
        min_calls=min_calls,
    )
    return BreakerBoard(settings, clock=clock, on_change=changes.append), clock, changes


# -- the board ---------------------------------------------------------------------------


def test_the_share_of_slow_calls_among_the_last_calls_opens_the_breaker() -> None:
    board, _, changes = slow_board()
    assert board.record_durations(DEP, [0.1, 2.5, 0.2]) is BreakerState.CLOSED  # fewer than 4
    assert board.record_durations(DEP, [1.9]) is BreakerState.CLOSED  # 1 slow of the last 4
    assert board.record_durations(DEP, [2.0]) is BreakerState.OPEN  # 2.5, 0.2, 1.9, 2.0: half
    assert [(c.old, c.new, c.reason) for c in changes] == [
        (BreakerState.CLOSED, BreakerState.OPEN, "slow_calls")
    ]
    assert board.info(DEP).reopens_at == pytest.approx(110.0)


def test_slow_calls_that_left_the_window_no_longer_count() -> None:
    board, _, changes = slow_board(rate=0.75)
    board.record_durations(DEP, [5.0, 5.0, 0.1, 0.1, 5.0, 0.1, 0.1, 5.0])
    assert board.state(DEP) is BreakerState.CLOSED  # never 3 slow among 4 in a row
    assert changes == []


def test_without_slow_call_s_durations_count_for_nothing() -> None:
    board, _, changes = slow_board(slow_call_s=None)
    assert board.record_durations(DEP, [60.0] * 20) is BreakerState.CLOSED
    assert changes == []


def test_a_breaker_opened_by_slow_calls_recovers_like_any_other() -> None:
    board, clock, changes = slow_board()
    board.record_durations(DEP, [3.0] * 4)
    assert board.record_durations(DEP, [3.0] * 4) is BreakerState.OPEN  # not counted while open
    clock.now += 10
    assert board.state(DEP) is BreakerState.HALF_OPEN
    board.record(DEP, True)
    assert board.state(DEP) is BreakerState.CLOSED
    # The share starts afresh: three fast calls and one slow do not re-open it.
    assert board.record_durations(DEP, [0.1, 0.1, 0.1, 3.0]) is BreakerState.CLOSED
    assert [c.reason for c in changes] == ["slow_calls", "reset_timeout", "trial_succeeded"]


@pytest.mark.parametrize(
    "kwargs",
    [{"slow_call_s": 0.0}, {"slow_call_rate": 0.0}, {"slow_call_rate": 1.5}, {"min_calls": 0}],
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**kwargs)  # type: ignore[arg-type]


# -- from the policy file to the pipeline ------------------------------------------------

POLICY = """\
version: 1
policies:
  - name: rt
    match: {kind: unavailable}
    action: retry
    max_attempts: 10
    wait: {type: fixed, seconds: 1}
breakers:
  default: {fail_max: 5, reset_timeout_s: 30}
  dependencies:
    "openai:*": {slow_call_s: 2, slow_call_rate: 0.5, min_calls: 4}
"""

_ids = itertools.count(1)


def _llm_span(seconds: float, *, model: str = "gpt-4o", error: str = "") -> Span:
    start = 1_700_000_000 * S
    attributes = {
        "openinference.span.kind": "LLM",
        "llm.provider": "openai",
        "llm.model_name": model,
    }
    return Span(
        trace_id=(1).to_bytes(16, "big"),
        span_id=next(_ids).to_bytes(8, "big"),
        name="ChatCompletion",
        start_time_unix_nano=start,
        end_time_unix_nano=start + int(seconds * S),
        attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attributes.items()],
        status=Status(code=Status.STATUS_CODE_ERROR, message=error) if error else Status(),
    )


def _request(*spans: Span) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    return request


def test_the_policy_file_sets_slow_calls_per_dependency() -> None:
    limits = load_policy(text=POLICY).limits
    assert limits.times_calls
    assert limits.breaker_for(DEP).slow_call_s == 2
    assert limits.breaker_for("tool:search").slow_call_s is None
    assert not load_policy(text="version: 1\n").limits.times_calls


def test_slow_successes_in_spans_open_the_breaker_and_divert_the_next_failure() -> None:
    policy = load_policy(text=POLICY)
    changes: list[BreakerChange] = []
    governor = Governor(policy, clock=Clock(), on_breaker_change=changes.append)
    pipeline = Pipeline(policy, governor=governor)

    pipeline.process(_request(*(_llm_span(s) for s in (0.5, 3.0, 0.4))), received_ns=1)
    assert governor.board.state(DEP) is BreakerState.CLOSED
    # The tool and the other model are fast; two slow calls of the last four of gpt-4o.
    outcomes = pipeline.process(
        _request(
            _llm_span(0.1, model="gpt-4o-mini"),
            _llm_span(2.5),
            _llm_span(8.0, error="APIConnectionError: Connection error."),
        ),
        received_ns=2,
    )

    assert [(c.dependency, c.new, c.reason) for c in changes] == [
        (DEP, BreakerState.OPEN, "slow_calls")
    ]
    assert governor.board.state("openai:gpt-4o-mini") is BreakerState.CLOSED
    governor.observe_durations([("tool:search", 60 * S)] * 20)  # no slow_call_s for tools
    assert "tool:search" not in [info.dependency for info in governor.board.snapshot()]
    (outcome,) = outcomes
    assert outcome.decision.action is Action.FAIL_FAST  # no retry against an open breaker
    assert outcome.decision.params["breaker"] == "open"


def test_without_slow_call_settings_no_duration_is_kept() -> None:
    policy = load_policy(text="version: 1\n")
    governor = Governor(policy, clock=Clock())
    pipeline = Pipeline(policy, governor=governor)
    pipeline.process(_request(*(_llm_span(60.0) for _ in range(20))), received_ns=1)
    assert governor.board.state(DEP) is BreakerState.CLOSED
    assert pipeline._durations == []
