"""A session's loops and budget seen whole by sidecars sharing a real Redis.

Two run trackers stand for two sidecars of a fleet, each fed part of one
session's spans (the spans of tests/test_runs.py, with a session and traces of
their own), and sharing the test Redis through the breakers' link
(:func:`~supervisor.shared_breakers.shared_breakers`), under a namespace of
their own. Redis hanging goes through a loopback proxy that never answers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from policies import Policy, load_policy
from policies._detectors import DetectorSettings
from supervisor.app import BackgroundSidecar
from supervisor.judge.pipeline import Pipeline
from supervisor.judge.steps import drive
from supervisor.normalize import read_spans
from supervisor.runs import Detection, RunTracker
from supervisor.runs.fleet import MAX_BACKLOG, FleetRuns
from supervisor.shared_breakers import RedisLink, shared_breakers
from tests.redis_server import REDIS, RedisProxy
from tests.test_runs import llm, payload, span, tool
from tests.test_shared_breakers import AUTH, _until
from tests.test_shared_breakers import sidecar as fleet_sidecar

URL = f"redis://{REDIS[0]}:{REDIS[1]}/0"
SESSION = "conv-42"
BUDGET = "version: 1\nrun_budget: {max_tokens: 300, action: abort_run}\n"


def trace(n: int) -> bytes:
    return bytes([n]) * 16


def in_session(item: Span, turn: int, session: str = SESSION) -> Span:
    """``item`` in trace ``turn`` of ``session`` (each turn of a chat is a trace)."""
    item.trace_id = trace(turn)
    item.attributes.append(KeyValue(key="session.id", value=AnyValue(string_value=session)))
    return item


def sidecar(
    namespace: str,
    *,
    url: str = URL,
    policy: Policy | None = None,
    settings: DetectorSettings | None = None,
    retry_s: float = 5.0,
    max_backlog: int = MAX_BACKLOG,
) -> tuple[RunTracker, FleetRuns, RedisLink]:
    """One sidecar's run tracker, its fleet counts and link, as the wiring builds them."""
    _, link = shared_breakers(
        url, namespace=namespace, timeout_s=0.25, retry_s=retry_s, required=False
    )
    fleet = FleetRuns(link, f"{namespace}:runs", max_backlog=max_backlog)
    return tracker(policy, settings, fleet), fleet, link


def tracker(
    policy: Policy | None = None,
    settings: DetectorSettings | None = None,
    fleet: FleetRuns | None = None,
) -> RunTracker:
    if policy is not None:
        return RunTracker(
            settings=policy.detectors.for_service, models=policy.detectors.models, fleet=fleet
        )
    fixed = settings or DetectorSettings()
    return RunTracker(settings=lambda service: fixed, fleet=fleet)


def batch(runs: RunTracker, *spans: Span, now: float = 1000.0) -> list[Detection]:
    """One request's spans observed, then shared, as the pipeline does."""
    found: list[Detection] = []
    for item in read_spans(payload(*spans)):
        runs.observe(item, now, found)
    runs.share(found)
    return found


def same(found: Detection) -> tuple[object, ...]:
    """What policies and the store see of a detection."""
    return (
        found.rule,
        found.kind,
        found.failure_class,
        found.run_id,
        found.span_id,
        found.span_name,
        found.dependency,
        found.message,
        dict(found.details),
    )


def at(item: Span, now: float) -> Span:
    """``item`` started half a second before ``now`` (after any report made before)."""
    item.start_time_unix_nano = int(now * 1e9) - 500_000_000
    return item


def weather(turn: int) -> Span:
    return in_session(tool("search", {"q": "weather"}), turn)


# -- loops --------------------------------------------------------------------------------


def test_a_loop_over_three_traces_on_two_sidecars_is_found_once_as_one_sidecar_finds_it(
    namespace: str,
) -> None:
    policy = load_policy()
    a, b = (sidecar(namespace)[0] for _ in range(2))
    first, second = Pipeline(policy, runs=a), Pipeline(policy, runs=b)
    calls = [weather(turn) for turn in (1, 2, 3)]

    found = first.process_payload(payload(calls[0]), received_ns=1000 * 10**9)
    found += second.process_payload(payload(calls[1]), received_ns=1001 * 10**9)
    found += first.process_payload(payload(calls[2]), received_ns=1002 * 10**9)

    (loop,) = [o for o in found if o.failure.kind == "reasoning_loop"]
    alone = tracker()
    (expected,) = batch(alone, *(weather(turn) for turn in (1, 2, 3)))
    assert loop.failure.span_id == calls[1].span_id.hex()  # the first repeat, seen by b
    assert loop.failure.run_id == SESSION and loop.failure.rule == expected.rule
    assert (loop.failure.message, dict(loop.failure.details)) == (
        expected.message,
        dict(expected.details),
    )
    assert loop.decision.action.value != "none"  # the policy's loop breaker acts on it
    # Each sidecar alone sees two of the three calls at most: no loop.
    assert batch(tracker(), weather(1), weather(3)) == []


def test_a_loop_that_goes_on_across_sidecars_is_reported_three_times_at_most(
    namespace: str,
) -> None:
    (a, _, _), (b, _, _) = sidecar(namespace), sidecar(namespace)
    found: list[Detection] = []
    calls = [weather(turn) for turn in range(1, 13)]
    for n, call in enumerate(calls):  # one call a second, each sidecar in turn
        now = 1000.0 + n
        found += batch(a if n % 2 else b, at(call, now), now=now)
    assert [(d.span_id, d.details["occurrence"]) for d in found] == [
        (calls[1].span_id.hex(), 1),
        (calls[3].span_id.hex(), 2),
        (calls[5].span_id.hex(), 3),
    ]


def test_a_span_re_sent_to_another_sidecar_counts_once(namespace: str) -> None:
    (a, _, _), (b, _, _) = sidecar(namespace), sidecar(namespace)
    calls = [weather(1), weather(1), weather(2)]
    assert batch(a, calls[0], calls[1]) == []
    assert batch(b, calls[0], calls[1]) == []  # re-sent, after a rescale, to b
    (loop,) = batch(b, calls[2])  # a third call
    assert loop.span_id == calls[1].span_id.hex()
    assert batch(a, calls[2]) == []  # re-sent again: already counted and reported


def test_a_loop_found_by_one_sidecar_alone_is_still_reported_once(namespace: str) -> None:
    """Calls counted before the trace named its session were not shared: the sidecar's own
    count finds the loop, and the fleet remembers that it was reported."""
    (a, _, _), (b, _, _) = sidecar(namespace), sidecar(namespace)
    calls = [tool("search", {"q": "weather"}) for _ in range(3)]
    assert batch(a, calls[0], calls[1]) == []  # no session named yet: a run of one trace
    (loop,) = batch(a, llm("a", **{"session.id": SESSION}), calls[2])
    assert (loop.run_id, loop.span_id) == (SESSION, calls[1].span_id.hex())
    assert batch(b, in_session(tool("search", {"q": "weather"}), 1)) == []


def test_one_sidecar_with_the_fleet_finds_what_it_finds_without(namespace: str) -> None:
    shared, fleet, _ = sidecar(namespace, settings=DetectorSettings(loop_window=4))
    alone = tracker(settings=DetectorSettings(loop_window=4))
    runs: list[list[tuple[object, ...]]] = [[], []]
    for n in range(60):  # past 4 windows of distinct calls: pruned alike
        now = 1000.0 + n
        arguments = {"q": "weather"} if n % 3 else {"q": str(n)}
        answer = "I will check again." if n % 4 else f"step {n}"
        spans = [
            in_session(tool("search", arguments), n),
            in_session(llm(answer, **{"gen_ai.usage.input_tokens": 100 + n}), n),
        ]
        for item in spans:
            at(item, now)
        for runs_found, runs_of in zip(runs, (shared, alone), strict=True):
            runs_found += [same(d) for d in batch(runs_of, *spans, now=now)]
    assert runs[0] == runs[1] and len(runs[0]) == 6  # each kind: 3 reports at most
    assert fleet.shared == 60 and fleet.unshared == 0


def test_runs_of_one_trace_are_not_shared(namespace: str, direct: Any) -> None:
    runs, fleet, _ = sidecar(namespace)
    (loop,) = batch(runs, *(tool("search", {"q": "weather"}) for _ in range(3)))
    assert loop.kind == "reasoning_loop"
    assert (fleet.shared, fleet.unshared) == (0, 0)
    assert list(direct.scan_iter(match=f"{namespace}:*")) == []


# -- budgets ------------------------------------------------------------------------------


def test_a_budget_crossed_by_the_fleet_total_is_reported_once(namespace: str) -> None:
    policy = load_policy(text=BUDGET)
    (a, _, _), (b, _, _) = sidecar(namespace, policy=policy), sidecar(namespace, policy=policy)
    calls = [in_session(llm(f"answer {n}"), n) for n in range(5)]  # 120 tokens each

    found = batch(a, calls[0]) + batch(b, calls[1])
    assert found == []
    (over,) = batch(a, calls[2])  # 360 tokens fleet-wide; 240 here
    assert (over.kind, over.rule, over.span_id) == (
        "budget_exceeded",
        "builtin.detect.run_budget",
        calls[2].span_id.hex(),
    )
    assert over.details["tokens"] == 360 and over.details["calls"] == 3
    assert over.message.startswith("max_tokens: run spent 360 tokens")
    assert batch(b, calls[3]) + batch(a, calls[4]) == []  # once fleet-wide
    # The same calls on one sidecar alone: the same report (after its own forecast,
    # which a session the fleet counts does not get).
    forecast, alone = batch(tracker(policy), *(in_session(llm(f"answer {n}"), n) for n in range(3)))
    assert (forecast.kind, forecast.details["tokens"]) == ("budget_forecast", 240)
    assert (alone.message, dict(alone.details)) == (over.message, dict(over.details))


def test_spend_made_while_redis_hung_joins_the_fleet_total_when_it_answers(
    namespace: str, proxy: RedisProxy, direct: Any
) -> None:
    policy = load_policy(text=BUDGET)
    a, a_fleet, link = sidecar(namespace, url=proxy.url, policy=policy, retry_s=0.3)
    b, _, _ = sidecar(namespace, policy=policy)
    proxy.set("hang")
    started = time.monotonic()
    assert batch(a, in_session(llm("one"), 1), in_session(llm("two"), 1)) == []  # 240 here
    assert batch(a, in_session(llm("three"), 2)) != []  # 360 here: reported by a alone
    assert time.monotonic() - started < 1.0  # one timeout, then the link does not ask
    assert a_fleet.unshared == 2 and not link.stats().reachable

    proxy.set("forward")
    time.sleep(0.35)  # the link asks Redis again after retry_s
    assert batch(b, in_session(llm("four"), 3)) == []  # 120 fleet-wide: a's not sent yet
    assert batch(a, in_session(llm("five"), 4)) == []  # a's 360 join: crossed, reported
    (key,) = direct.scan_iter(match=f"{namespace}:runs:*:spend")
    assert int(direct.hget(key, "in")) + int(direct.hget(key, "out")) == 600
    assert batch(b, in_session(llm("six"), 5)) == []  # reported once, by a while away


# -- Redis away ---------------------------------------------------------------------------


def test_redis_hanging_keeps_loops_found_here_and_bounded(
    namespace: str, proxy: RedisProxy
) -> None:
    runs, fleet, link = sidecar(namespace, url=proxy.url)
    proxy.set("hang")
    started = time.monotonic()
    (loop,) = batch(runs, *(weather(turn) for turn in (1, 2, 3)))  # found here, as alone
    assert batch(runs, at(weather(4), 1001.0), now=1001.0) == []
    (again,) = batch(runs, at(weather(5), 1002.0), at(weather(6), 1002.0), now=1002.0)
    assert time.monotonic() - started < 1.0  # one timeout; then the link does not ask
    assert (loop.details["occurrence"], again.details["occurrence"]) == (1, 2)
    assert fleet.unshared == 3 and link.stats().outages == 1


def test_a_loop_split_between_three_sidecars_while_redis_was_away_is_reported_once(
    namespace: str, proxy: RedisProxy
) -> None:
    """Each sidecar sees one of the three calls while Redis is away; each catches up at its
    next batch, of other runs, and the last to do so reports the loop."""
    fleet = [sidecar(namespace, url=proxy.url, retry_s=0.1) for _ in range(3)]
    calls = [weather(turn) for turn in (1, 2, 3)]
    proxy.set("drop")
    for n, ((runs, runs_fleet, _), call) in enumerate(zip(fleet, calls, strict=True)):
        assert batch(runs, at(call, 1000.0 + n), now=1000.0 + n) == []
        assert (runs_fleet.unshared, runs_fleet.backlog) == (1, 1)

    proxy.set("forward")
    time.sleep(0.15)  # the links ask Redis again after retry_s
    other = [
        tool("lookup", {"q": "a run of one trace"}),
        in_session(tool("lookup", {"q": "another session"}), 9, session="conv-7"),
        in_session(llm("unrelated"), 10, session="conv-8"),
    ]
    found = [
        batch(runs, at(item, 1010.0), now=1010.0)
        for (runs, _, _), item in zip(fleet, other, strict=True)
    ]

    assert [len(f) for f in found] == [0, 0, 1]  # reported by the sidecar that completed it
    (loop,) = found[2]
    (expected,) = batch(tracker(), *(weather(turn) for turn in (1, 2, 3)))
    assert (loop.kind, loop.run_id, loop.span_id) == (
        "reasoning_loop",
        SESSION,
        calls[1].span_id.hex(),
    )
    assert (loop.rule, loop.message, dict(loop.details)) == (
        expected.rule,
        expected.message,
        dict(expected.details),
    )
    assert [f.backlog for _, f, _ in fleet] == [0, 0, 0]
    # Reported once fleet-wide: the same calls re-sent anywhere report nothing more.
    assert batch(fleet[0][0], *calls, now=1011.0) == []


def test_a_loop_reported_here_while_redis_was_away_is_not_reported_again_by_the_fleet(
    namespace: str, proxy: RedisProxy
) -> None:
    a, a_fleet, _ = sidecar(namespace, url=proxy.url, retry_s=0.1)
    b, _, _ = sidecar(namespace, url=proxy.url, retry_s=0.1)
    proxy.set("drop")
    (loop,) = batch(a, *(weather(turn) for turn in (1, 2, 3)))  # found here, as alone
    assert loop.details["occurrence"] == 1 and a_fleet.backlog == 1

    proxy.set("forward")
    time.sleep(0.15)
    # The fleet counts a's three calls and finds the loop a reported: not again.
    assert batch(a, tool("lookup", {"q": "a run of one trace"}), now=1001.0) == []
    assert a_fleet.backlog == 0
    # Its next occurrence, on b, is the second.
    assert batch(b, at(weather(4), 1002.0), now=1002.0) == []
    (again,) = batch(b, at(weather(5), 1003.0), now=1003.0)
    assert again.details["occurrence"] == 2


def test_a_sidecar_that_gets_no_batch_sends_its_backlog_between_batches(
    namespace: str, proxy: RedisProxy
) -> None:
    a, a_fleet, a_link = sidecar(namespace, url=proxy.url, retry_s=0.1)
    b, _, _ = sidecar(namespace, url=proxy.url, retry_s=0.1)
    calls = [weather(turn) for turn in (1, 2, 3)]
    proxy.set("drop")
    assert batch(a, calls[0], calls[1]) == []  # two calls: no loop here
    found: list[Detection] = []
    a.share_backlog(found)  # the link rests after its failure: not asked
    assert (a_fleet.backlog, a_link.stats().errors) == (1, 1)

    proxy.set("forward")
    time.sleep(0.15)
    a.share_backlog(found)  # the app's every second: sent, without waiting
    drive(a.share_end_steps(found))  # answered (the next batch, or second, collects it)
    assert found == [] and a_fleet.backlog == 0
    (loop,) = batch(b, at(calls[2], 1001.0), now=1001.0)  # the third call, on b
    assert loop.span_id == calls[1].span_id.hex()


def test_a_backlog_beyond_its_bounds_drops_and_counts(namespace: str, proxy: RedisProxy) -> None:
    runs, fleet, _ = sidecar(
        namespace, url=proxy.url, settings=DetectorSettings(loop_window=4), max_backlog=1
    )
    proxy.set("drop")
    distinct = [in_session(tool("search", {"q": str(n)}), 1) for n in range(6)]
    assert batch(runs, *distinct) == []  # a window's worth kept: the last 4
    assert (fleet.backlog, fleet.backlog_dropped, fleet.backlog_calls_dropped) == (1, 0, 2)
    other = [in_session(tool("search", {"q": str(n)}), 2, session="conv-7") for n in range(2)]
    assert batch(runs, *other) == []  # a second run: beyond max_backlog
    assert (fleet.backlog, fleet.backlog_dropped, fleet.backlog_calls_dropped) == (1, 1, 4)
    stats = runs.stats()
    assert (stats["fleet_backlog"], stats["fleet_backlog_calls_dropped"]) == (1, 4)


def test_the_pipeline_judges_a_loop_alone_while_redis_hangs(
    namespace: str, proxy: RedisProxy
) -> None:
    runs, fleet, _ = sidecar(namespace, url=proxy.url)
    pipeline = Pipeline(load_policy(), runs=runs)
    proxy.set("hang")
    started = time.monotonic()
    outcomes = pipeline.process_payload(
        payload(*(weather(turn) for turn in (1, 2, 3))), received_ns=1000 * 10**9
    )
    assert time.monotonic() - started < 1.0
    (loop,) = [o for o in outcomes if o.failure.kind == "reasoning_loop"]
    assert loop.failure.run_id == SESSION and fleet.unshared == 1


def test_span_shapes_from_tests_runs_build_sessions(namespace: str) -> None:
    """The helper's spans name their session as instrumentations do (a span attribute)."""
    runs, _, _ = sidecar(namespace)
    batch(runs, in_session(span("step", {}), 1), in_session(span("step", {}), 2))
    (view,) = runs.snapshot()
    assert (view.run_id, view.spans) == (SESSION, 2)


# -- two sidecars, as wired -------------------------------------------------------------


@pytest.mark.slow
def test_two_sidecars_sharing_redis_report_a_session_loop_split_between_them_once(
    tmp_path: Path, namespace: str
) -> None:
    first = fleet_sidecar(tmp_path / "a", URL, namespace)
    second = fleet_sidecar(tmp_path / "b", URL, namespace)
    try:
        calls = [weather(turn) for turn in (1, 2, 3)]
        for running, call, counted in zip((first, second, first), calls, (1, 1, 2), strict=True):
            sent = httpx.post(
                f"http://127.0.0.1:{running.ports.otlp_http}/v1/traces",
                content=payload(call),
                headers={"Content-Type": "application/x-protobuf"},
            )
            assert sent.status_code == 200
            # Each request judged before the next is sent: the calls reach Redis in order.
            _until(lambda r=running, n=counted: _tool_calls(r) == n)

        def loops(running: BackgroundSidecar) -> list[dict[str, Any]]:
            api = f"http://127.0.0.1:{running.ports.api}/v1/failures"
            failures = httpx.get(api, headers=AUTH).json()["failures"]
            return [f for f in failures if f["kind"] == "reasoning_loop"]

        _until(lambda: loops(first) != [])
        (loop,) = loops(first)
        assert loop["span_id"] == calls[1].span_id.hex() and loop["run_id"] == SESSION
        assert loops(second) == []
    finally:
        first.stop()
        second.stop()


def _tool_calls(running: BackgroundSidecar) -> int:
    api = f"http://127.0.0.1:{running.ports.api}/v1/runs"
    runs = httpx.get(api, headers=AUTH).json()["runs"]
    return sum(r["tool_calls"] for r in runs if r["run_id"] == SESSION)
