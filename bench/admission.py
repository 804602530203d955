"""Admission control against a provider's published limit: a fleet with and without it.

    python bench/admission.py [--runs 54] [--rpm 60] [--tpm 40000] [--latency-s 0.4]
                              [--headroom H] [--arms sdk,tenacity,breakers,...]
    python bench/admission.py --quick     # 12 runs at 20 rpm / 12,000 tpm: a smoke check

One workload, played once per **arm**, side by side in one invocation, each
against a fresh fake provider (:class:`~supervisor.testing.FakeProvider` with
a :class:`~supervisor.testing.PublishedLimit`: ``--rpm`` requests and
``--tpm`` tokens a minute per API key, OpenAI's buckets, full at the start)
and a fresh ``spanvisor run`` sidecar (its own Redis namespace):

* ``--runs`` runs (default 54) of three services with different demand
  (:data:`SERVICES`: a planner with few short calls, a researcher with many,
  a writer with long prompts and answers), alternately on two API keys
  (``team-a`` and ``team-b``, each with the published limit), all started at
  once on threads. A run makes its calls one after the other through the real
  ``openai`` SDK, instrumented by ``opentelemetry-instrumentation-openai-v2``
  whose spans the OpenTelemetry SDK exports (OTLP/HTTP) to the arm's sidecar.
  A run fails when one of its calls finally fails.
* The arms: ``sdk``, the SDK's own retries (``max_retries=2``, which honour
  ``retry-after``); ``tenacity``, ``max_retries=0`` under tenacity
  (``wait_random_exponential(multiplier=1, max=30)``,
  ``stop_after_attempt(6)``, on 429s, 5xx and connection errors);
  ``breakers``, ``guard(dependency)`` (the built-in policy: its breaker, its
  retry of 429s honouring Retry-After, its retry budget); ``admission``,
  ``guard(dependency, admit=True, credential=<key name>, tokens=<estimate>)``
  with the policy's ``admission`` section giving each key its published
  limit (and the policy's ``headroom``: admitted 5% below it by default,
  ``--headroom`` to set it; at 0 a few 429s are structural: the provider's
  buckets start when its first request arrives, a little after admission's,
  so at the very edge it is a few tokens short); ``admission-learned``, the same with no
  ceiling configured (the built-in 600 requests a minute, tokens not
  limited): the limit must be learned from 429s (its retries are not
  budgeted, or the built-in retry budget would end the runs first).
  Admission's waits are bounded by the arm's deadline (15 minutes), not
  by the guard's default 30 s.

The **ideal schedule** is the same workload under a perfect scheduler that
knows the limits: each key's calls go, first come first served, as soon as
both of its buckets hold them, each call taking the median time a successful
call took in this invocation (:func:`ideal_schedule`).

What is printed, per arm: calls that reached the provider, 429s it answered
(its own count) and their share, runs completed, each run's completion time
from the arm's start (median, p95) and the makespan, and each service's share
of the calls the provider accepted while all three services were still
asking (the capacity they contended for); why runs failed (the advice's reason);
the sidecar's ``/v1/stats`` admission counts. Then the goals, PASS or FAIL,
for ``admission``: at most 1% of calls refused,
every run completed, completion (median and p95) within 10% of the ideal
schedule's.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import logging
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/admission.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from bench.harness import command_line
from supervisor.client import SupervisorClient, guard
from supervisor.testing import FakeProvider, PublishedLimit, Reply
from supervisor.testing.provider_limits import request_tokens
from supervisor.testing.sidecar_process import SidecarProcess

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "gpt-4o"
DEPENDENCY = f"openai:{MODEL}"
KEYS = ("team-a", "team-b")
ARMS = ("sdk", "tenacity", "breakers", "admission", "admission-learned")
#: The arms the goals are for.
GOAL_ARMS = ("admission",)
#: The goals the issue sets for admission.
GOAL_REFUSED = 0.01
GOAL_RATIO = 1.10
#: The longest an arm may take; its unfinished runs then count as failed.
ARM_DEADLINE_S = 900.0


@dataclass(frozen=True, slots=True)
class Service:
    """One service's runs: how many calls, how long a prompt, how many tokens asked."""

    name: str
    calls: int
    prompt_chars: int
    max_tokens: int


#: Different demand, so that who gets the capacity shows.
SERVICES = (
    Service("planner", calls=3, prompt_chars=800, max_tokens=300),
    Service("researcher", calls=6, prompt_chars=1200, max_tokens=200),
    Service("writer", calls=4, prompt_chars=2000, max_tokens=600),
)


@dataclass(frozen=True, slots=True)
class Run:
    number: int
    service: Service
    key: str

    def params(self, step: int) -> dict[str, Any]:
        """The chat completion request of the run's ``step``-th call."""
        head = f"{self.service.name} run {self.number} step {step}: "
        text = head + "x" * max(0, self.service.prompt_chars - len(head))
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.service.max_tokens,
        }

    @property
    def tokens(self) -> int:
        return request_tokens(self.params(0))


def plan_runs(n: int) -> list[Run]:
    """``n`` runs, the services in turn, the keys alternating within each service."""
    return [
        Run(i, SERVICES[i % len(SERVICES)], KEYS[(i // len(SERVICES)) % len(KEYS)])
        for i in range(n)
    ]


# -- the ideal schedule -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ideal:
    """The ideal schedule: each run's completion, and when each call went (and whose)."""

    done: dict[int, float]
    accepted_at: list[tuple[float, str]]


def ideal_schedule(runs: Sequence[Run], rpm: int, tpm: int, latency_s: float) -> Ideal:
    """Each run's completion time under a perfect scheduler that knows the limits.

    Per key (keys do not share limits): the calls ready first go first, each
    as soon as the key's request and token buckets (full at the start,
    refilling continuously, as the provider's) hold it; a run's next call is
    ready ``latency_s`` after its previous one went.
    """
    done: dict[int, float] = {}
    went: list[tuple[float, str]] = []
    for key in {r.key for r in runs}:
        mine = [r for r in runs if r.key == key]
        requests, tokens, at = float(rpm), float(tpm), 0.0
        ready = [(0.0, r.number, 0) for r in mine]
        by_number = {r.number: r for r in mine}
        heapq.heapify(ready)
        while ready:
            when, number, step = heapq.heappop(ready)
            run = by_number[number]
            need = min(float(run.tokens), float(tpm))
            start = max(when, at)
            requests = min(rpm, requests + (start - at) * rpm / 60)
            tokens = min(tpm, tokens + (start - at) * tpm / 60)
            wait = max((1 - requests) * 60 / rpm, (need - tokens) * 60 / tpm, 0.0)
            start += wait
            requests, tokens = requests + wait * rpm / 60 - 1, tokens + wait * tpm / 60 - need
            at = start
            went.append((start + latency_s, run.service.name))  # answered, as tallied
            if step + 1 < run.service.calls:
                heapq.heappush(ready, (start + latency_s, number, step + 1))
            else:
                done[number] = start + latency_s
    return Ideal(done, went)


# -- one arm -------------------------------------------------------------------


@dataclass
class Tally:
    """What the arm's runs saw, under a lock (runs are threads)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    accepted: Counter[str] = field(default_factory=Counter)
    #: (seconds from the arm's start, service) of each call the provider accepted.
    accepted_at: list[tuple[float, str]] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, timing each successful attempt (not the waits between attempts)."""

        def call(**params: Any) -> Any:
            started = time.monotonic()
            answer = fn(**params)
            with self.lock:
                self.durations.append(time.monotonic() - started)
            return answer

        return call


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    runs: int
    ended: dict[int, float]
    failed: dict[int, str]
    accepted: int
    refused: int
    #: 429s for want of requests, of tokens.
    refused_by: tuple[int, int]
    service_calls: dict[str, int]
    #: Each service's accepted calls while all of them were still asking.
    contended_calls: dict[str, int]
    durations: list[float]
    admission_stats: dict[str, Any]

    @property
    def refused_share(self) -> float:
        calls = self.accepted + self.refused
        return self.refused / calls if calls else 0.0


def policy(arm: str, rpm: int, tpm: int, headroom: float | None) -> str:
    """The built-in policy, plus each key's published limit for admission (and ``headroom``,
    None: the policy's default)."""
    if arm in GOAL_ARMS:
        room = "" if headroom is None else f", headroom: {headroom:g}"
        keys = "\n".join(
            f'    "{DEPENDENCY}@{key}": {{rpm: {rpm}, tpm: {tpm}{room}}}' for key in KEYS
        )
        return f"version: 1\nadmission:\n  enabled: true\n  keys:\n{keys}\n"
    if arm == "admission-learned":
        # The built-in retry budget (20% of the calls) would fail the runs at the first
        # burst of 429s, before anything is learned: here retries are not budgeted.
        return (
            "version: 1\nadmission: {enabled: true}\n"
            "retry_budget: {ratio: 1.0, min_retries: 100000, window_s: 10}\n"
        )
    return "version: 1\n"


def caller(
    arm: str, run: Run, oai: openai.OpenAI, sidecar: SupervisorClient, tally: Tally
) -> Callable[[dict[str, Any]], Any]:
    """How one run makes one call in ``arm``."""
    create = tally.timed(oai.chat.completions.create)
    if arm == "sdk":
        return lambda params: create(**params)
    if arm == "tenacity":
        retrying = Retrying(
            wait=wait_random_exponential(multiplier=1, max=30),
            stop=stop_after_attempt(6),
            retry=retry_if_exception_type(
                (openai.RateLimitError, openai.InternalServerError, openai.APIConnectionError)
            ),
            reraise=True,
        )
        return lambda params: retrying(create, **params)
    if arm == "breakers":
        plain = guard(DEPENDENCY, client=sidecar, run_id=f"run-{run.number}")
        return lambda params: plain.call(create, **params)
    admitted = guard(
        DEPENDENCY,
        client=sidecar,
        run_id=f"run-{run.number}",
        admit=True,
        credential=run.key,
        tokens=run.tokens,
        max_admit_wait_s=ARM_DEADLINE_S,
    )
    return lambda params: admitted.call(create, **params)


def play_arm(
    arm: str,
    runs: Sequence[Run],
    *,
    rpm: int,
    tpm: int,
    latency_s: float,
    headroom: float | None,
    directory: Path,
) -> ArmResult:
    """One arm: a fresh provider and sidecar, every run on its own thread, then the counts."""
    limit = PublishedLimit(rpm=rpm, tpm=tpm)
    reply = Reply(content="Done.", finish_reason="stop", delay_s=latency_s)
    namespace = f"admission-bench-{uuid.uuid4().hex[:8]}"
    settings = {
        "host": "127.0.0.1",
        "breaker_redis_url": REDIS_URL,
        "breaker_redis_namespace": namespace,
        "policy_poll_s": 0,
    }
    home = directory / arm
    home.mkdir()
    with contextlib.ExitStack() as stack:
        provider = stack.enter_context(FakeProvider(default=reply, limit=limit, max_requests=64))
        sidecar = SidecarProcess(
            settings,
            home,
            policy=policy(arm, rpm, tpm, headroom),
            env={"PYTHONPATH": str(ROOT)},
            name=arm,
            startup_timeout_s=60,
        )
        stack.enter_context(sidecar)
        stack.callback(forget_redis_keys, namespace)
        tracing = stack.enter_context(instrumented(sidecar.otlp_endpoint))
        retries = 2 if arm == "sdk" else 0
        clients = {
            key: openai.OpenAI(
                base_url=provider.base_url,
                api_key=f"sk-fake-{key}",
                max_retries=retries,
                timeout=60,
            )
            for key in KEYS
        }
        advisers = {
            s.name: SupervisorClient(
                sidecar.api, sidecar.token, service=s.name, timeout_s=5.0, recheck_s=0.5
            )
            for s in SERVICES
        }
        for oai in clients.values():
            stack.callback(oai.close)
        for adviser in advisers.values():
            stack.callback(adviser.close)
        tracer = tracing.get_tracer("admission-bench")
        tally = Tally()
        started = time.monotonic()

        def one(run: Run) -> None:
            call = caller(arm, run, clients[run.key], advisers[run.service.name], tally)
            with tracer.start_as_current_span(
                f"invoke_agent {run.service.name}",
                attributes={"gen_ai.operation.name": "invoke_agent"},
            ):
                for step in range(run.service.calls):
                    try:
                        call(run.params(step))
                    except Exception as exc:  # a failed run, counted
                        with tally.lock:
                            tally.failed[run.number] = why_failed(exc)
                        return
                    with tally.lock:
                        tally.accepted[run.service.name] += 1
                        tally.accepted_at.append((time.monotonic() - started, run.service.name))
            with tally.lock:
                tally.ended[run.number] = time.monotonic() - started

        threads = [
            threading.Thread(target=one, args=(r,), name=f"run-{r.number}", daemon=True)
            for r in runs
        ]
        for thread in threads:
            thread.start()
        deadline = started + ARM_DEADLINE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stats = judged_stats(tracing, sidecar)
        with tally.lock:
            for run in runs:
                if run.number not in tally.ended and run.number not in tally.failed:
                    tally.failed[run.number] = "unfinished"
            counts = provider.limit_counts()
            return ArmResult(
                arm,
                len(runs),
                dict(tally.ended),
                dict(tally.failed),
                sum(c.accepted for c in counts.values()),
                sum(c.refused for c in counts.values()),
                (
                    sum(c.refused_requests for c in counts.values()),
                    sum(c.refused_tokens for c in counts.values()),
                ),
                dict(tally.accepted),
                contended(tally.accepted_at),
                list(tally.durations),
                stats,
            )


def judged_stats(tracing: TracerProvider, sidecar: SidecarProcess) -> dict[str, Any]:
    """The sidecar's admission stats once it has judged every span the arm exported."""
    tracing.force_flush()
    deadline = time.monotonic() + 10
    while True:
        stats = sidecar.get("/v1/stats")
        received = stats["ingest"]["accepted_spans"] - stats["ingest"]["rejected_spans"]
        pipeline = stats["pipeline"]
        # Spans count as processed before their failures are reported (and a 429 taught).
        reported = stats["decisions"]["latency_ms"]["count"] >= pipeline["failures"]
        done = pipeline["processed_spans"] >= received and reported
        if done or time.monotonic() > deadline:
            found = stats.get("admission", {})
            return found if isinstance(found, dict) else {}
        time.sleep(0.1)


def why_failed(exc: Exception) -> str:
    """The exception's type and, when spanvisor advised, the advice's last reason, no counts."""
    notes = getattr(exc, "__notes__", None) or [""]
    reason = notes[-1].rsplit("; ", 1)[-1]
    reason = re.sub(r"\b\d+(\.\d+)?s\b", "#s", re.sub(r"\s*\([^)]*\)", "", reason))
    return f"{type(exc).__name__} ({reason})" if reason else type(exc).__name__


@contextlib.contextmanager
def instrumented(otlp_endpoint: str) -> Iterator[TracerProvider]:
    """The openai SDK instrumented, its spans exported to ``otlp_endpoint``; flushed at the end."""
    tracing = TracerProvider(resource=Resource.create({"service.name": "admission-bench"}))
    tracing.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp_endpoint}/v1/traces"))
    )
    instrumentor = OpenAIInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument(tracer_provider=tracing)
    try:
        yield tracing
    finally:
        instrumentor.uninstrument()
        tracing.shutdown()


def forget_redis_keys(namespace: str) -> None:
    """Remove what the arm wrote under its own namespace (Redis is shared)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=3)
    try:
        keys = list(client.scan_iter(match=f"{namespace}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# -- the figures -----------------------------------------------------------------


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


@dataclass(frozen=True, slots=True)
class Completion:
    median: float
    p95: float
    makespan: float

    @classmethod
    def of(cls, times: Sequence[float]) -> Completion:
        if not times:
            return cls(float("nan"), float("nan"), float("nan"))
        return cls(statistics.median(times), p95(times), max(times))


def contended(accepted_at: Sequence[tuple[float, str]]) -> dict[str, int]:
    """Each service's accepted calls up to the last call of the service that ended first:
    the capacity all of them were asking for (every service had calls left until then)."""
    last: dict[str, float] = {}
    for at, service in accepted_at:
        last[service] = max(at, last.get(service, 0.0))
    if len(last) < len(SERVICES):
        return {}
    end = min(last.values())
    return dict(Counter(service for at, service in accepted_at if at <= end))


def shares(calls: dict[str, int]) -> str:
    total = sum(calls.values()) or 1
    return " ".join(f"{s.name[:5]} {calls.get(s.name, 0) / total:4.0%}" for s in SERVICES)


def report(
    results: Sequence[ArmResult], ideal: Ideal, runs: Sequence[Run]
) -> list[tuple[str, bool]]:
    """Print the table; return the goals with whether each was met."""
    best = Completion.of(list(ideal.done.values()))
    ideal_shares = contended(ideal.accepted_at)
    demand = Counter({s.name: 0 for s in SERVICES})
    for run in runs:
        demand[run.service.name] += run.service.calls
    header = (
        f"{'arm':<18} {'calls':>5} {'429s':>5} {'refused':>8} {'runs ok':>8} "
        f"{'median s':>9} {'p95 s':>7} {'makespan':>9}  share while contended"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        c = Completion.of(list(r.ended.values()))
        print(
            f"{r.arm:<18} {r.accepted + r.refused:>5} {r.refused:>5} {r.refused_share:>8.1%} "
            f"{len(r.ended):>3}/{r.runs:<4} {c.median:>9.1f} {c.p95:>7.1f} {c.makespan:>9.1f}  "
            f"{shares(r.contended_calls)}"
        )
    total_calls = sum(demand.values())
    print(
        f"{'ideal schedule':<18} {total_calls:>5} {0:>5} {0:>8.1%} {len(runs):>3}/{len(runs):<4} "
        f"{best.median:>9.1f} {best.p95:>7.1f} {best.makespan:>9.1f}  {shares(ideal_shares)}"
    )
    for r in results:
        if r.refused:
            print(f"  {r.arm}: 429s for requests {r.refused_by[0]}, for tokens {r.refused_by[1]}")
        if r.failed:
            why = Counter(r.failed.values())
            print(f"  {r.arm}: failed runs: " + ", ".join(f"{n} {k}" for k, n in why.items()))
        if r.admission_stats:
            stats = {
                k: r.admission_stats.get(k)
                for k in ("admitted", "refused", "answered_locally", "throttles")
            }
            print(f"  {r.arm}: sidecar /v1/stats admission: {stats}")
    goals: list[tuple[str, bool]] = []
    for r in results:
        if r.arm not in GOAL_ARMS:
            continue
        c = Completion.of(list(r.ended.values()))
        goals += [
            (
                f"{r.arm}: calls refused by the provider {r.refused_share:.2%} <= 1%",
                r.refused_share <= GOAL_REFUSED,
            ),
            (f"{r.arm}: runs completed {len(r.ended)}/{r.runs}", not r.failed),
            (
                f"{r.arm}: median completion {c.median:.1f} s = "
                f"{c.median / best.median:.2f} x ideal ({best.median:.1f} s) <= {GOAL_RATIO:.2f}",
                c.median / best.median <= GOAL_RATIO,
            ),
            (
                f"{r.arm}: p95 completion {c.p95:.1f} s = "
                f"{c.p95 / best.p95:.2f} x ideal ({best.p95:.1f} s) <= {GOAL_RATIO:.2f}",
                c.p95 / best.p95 <= GOAL_RATIO,
            ),
        ]
    print()
    for text, met in goals:
        print(f"{'PASS' if met else 'FAIL'}  {text}")
    return goals


def play(
    arms: Sequence[str],
    n_runs: int,
    rpm: int,
    tpm: int,
    latency_s: float,
    headroom: float | None = None,
) -> tuple[list[ArmResult], Ideal, list[Run], float]:
    """Every arm in turn on the same workload; the ideal schedule; the call latency it used."""
    runs = plan_runs(n_runs)
    results = []
    with tempfile.TemporaryDirectory(prefix="spanvisor-admission-") as tmp:
        for arm in arms:
            print(f"... {arm}", file=sys.stderr, flush=True)
            results.append(
                play_arm(
                    arm,
                    runs,
                    rpm=rpm,
                    tpm=tpm,
                    latency_s=latency_s,
                    headroom=headroom,
                    directory=Path(tmp),
                )
            )
    durations = [d for r in results for d in r.durations]
    latency = statistics.median(durations) if durations else latency_s
    return results, ideal_schedule(runs, rpm, tpm, latency), runs, latency


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--runs", type=int, default=54, help="runs in the fleet (default 54)")
    parser.add_argument("--rpm", type=int, default=60, help="published requests/min per key")
    parser.add_argument("--tpm", type=int, default=40_000, help="published tokens/min per key")
    parser.add_argument("--latency-s", type=float, default=0.4, help="the provider's answer time")
    parser.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="the admission arm's headroom below the published limit (default: the policy's, 0.05)",
    )
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    parser.add_argument("--quick", action="store_true", help="12 runs, 20 rpm, 12,000 tpm")
    args = parser.parse_args(argv)
    # The instrumentation sets an attribute the SDK will not take on failed calls; say it once.
    logging.getLogger("opentelemetry.attributes").setLevel(logging.ERROR)
    if args.quick:
        args.runs, args.rpm, args.tpm = 12, 20, 12_000
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown or args.runs < 1:
        parser.error(f"unknown arms {sorted(unknown)}" if unknown else "--runs must be >= 1")
    print(command_line())
    print(
        f"{args.runs} runs ({', '.join(f'{s.name}: {s.calls} calls' for s in SERVICES)}), "
        f"keys {', '.join(KEYS)}, each {args.rpm} requests and {args.tpm} tokens a minute"
    )
    started = time.monotonic()
    results, ideal, runs, latency = play(
        arms, args.runs, args.rpm, args.tpm, args.latency_s, args.headroom
    )
    print(
        f"median call {latency * 1000:.0f} ms (the ideal schedule's); bench took "
        f"{time.monotonic() - started:.0f} s\n"
    )
    goals = report(results, ideal, runs)
    return 0 if all(met for _, met in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
