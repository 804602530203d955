"""Inline decision latency: ``POST /v1/decide`` round trips over loopback.

An agent that caught an error asks the sidecar what to do before it retries,
so the answer sits on the agent's error path: it must be fast compared with
the call that failed. This starts ``spanvisor run``, warms up, then asks
``--requests`` questions (default 5,000 after 500 of warm-up) one after the
other from one keep-alive httpx client, and reports the round-trip
percentiles as the agent sees them: client serialisation, loopback, uvicorn,
FastAPI validation, bearer-token check, classification, policy decision,
governor review, JSON answer. Sequential, so the figure is latency, not
throughput; ``--concurrency N`` adds a run with N clients side by side
(latency under contention, and the rate they reached).

The questions are a fixed, shuffled mix of what agents really catch: OpenAI
429 ``rate_limit_exceeded`` with "Please try again in 1.5s", 503 overloaded,
Anthropic 529 ``overloaded_error``, SDK timeouts, 401 wrong key, tool errors
(``TimeoutError``, ``ConnectionRefusedError``, an unexplained ``ValueError``)
and a plain HTTP 503. For scale, ``GET /healthz`` (no auth, no body, no
decision) is timed the same way: the floor of the HTTP stack itself.

Goal: p99 < 5 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/decide.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.harness import (
    LOOPBACK,
    BenchError,
    Sidecar,
    add_sidecar_arguments,
    command_line,
    percentile,
    running_sidecar,
    sidecar_env,
    table,
)

GOAL_P99_MS = 5.0
#: A median keep-alive round trip above this is the Nagle / delayed-ACK stall.
STALL_S = 0.030

_RATE_LIMIT = (
    "Error code: 429 - {'error': {'message': 'Rate limit reached for gpt-4o in organization "
    "org-4kTjQ2sLr8WmN0pXc6bV on tokens per min (TPM): Limit 30000, Used 29114, Requested "
    "1630. Please try again in 1.5s. Visit https://platform.openai.com/account/rate-limits "
    "to learn more.', 'type': 'tokens', 'param': None, 'code': 'rate_limit_exceeded'}}"
)
_OVERLOADED_503 = (
    "Error code: 503 - {'error': {'message': 'The engine is currently overloaded, please try "
    "again later', 'type': 'server_error', 'param': None, 'code': None}}"
)
_OVERLOADED_529 = (
    "Error code: 529 - {'type': 'error', 'error': {'type': 'overloaded_error', "
    "'message': 'Overloaded'}}"
)
_WRONG_KEY = (
    "Error code: 401 - {'error': {'message': 'Incorrect API key provided: sk-proj-****abcd. "
    "You can find your API key at https://platform.openai.com/account/api-keys.', "
    "'type': 'invalid_request_error', 'param': None, 'code': 'invalid_api_key'}}"
)

#: (weight, question without service/run/attempt): the mix, in percent.
MIX: tuple[tuple[int, dict[str, Any]], ...] = (
    (
        30,
        {
            "dependency": "openai:gpt-4o",
            "exception_type": "openai.RateLimitError",
            "message": _RATE_LIMIT,
            "status_code": 429,
        },
    ),
    (
        15,
        {
            "dependency": "openai:gpt-4o",
            "exception_type": "openai.InternalServerError",
            "message": _OVERLOADED_503,
            "status_code": 503,
        },
    ),
    (
        10,
        {
            "dependency": "anthropic:claude-sonnet-4-20250514",
            "exception_type": "anthropic.OverloadedError",
            "message": _OVERLOADED_529,
            "status_code": 529,
        },
    ),
    (
        15,
        {
            "dependency": "openai:gpt-4o-mini",
            "exception_type": "openai.APITimeoutError",
            "message": "Request timed out.",
        },
    ),
    (
        5,
        {
            "dependency": "openai:gpt-4o",
            "exception_type": "openai.AuthenticationError",
            "message": _WRONG_KEY,
            "status_code": 401,
        },
    ),
    (
        10,
        {
            "dependency": "tool:web_search",
            "exception_type": "TimeoutError",
            "message": "Tool 'web_search' timed out after 30.0 seconds",
        },
    ),
    (
        5,
        {
            "dependency": "tool:get_order",
            "exception_type": "ConnectionRefusedError",
            "message": "[Errno 111] Connection refused",
        },
    ),
    (
        5,
        {
            "dependency": "tool:query_metrics",
            "exception_type": "ValueError",
            "message": "unsupported range step '15x' in query_range",
        },
    ),
    (
        5,
        {
            "dependency": "http:api.stripe.com",
            "message": "Server error '503 Service Unavailable' for url "
            "'https://api.stripe.com/v1/refunds'",
            "status_code": 503,
        },
    ),
)
SERVICES = ("research-agent", "support-agent")


def questions(count: int, seed: int, runs: int = 200) -> list[bytes]:
    """``count`` JSON bodies drawn from :data:`MIX` (exact proportions, shuffled).

    Each names one of ``runs`` runs and an attempt of 1-3, as agents do; the
    bodies are encoded once, here, so the timed loop sends bytes.
    """
    rng = random.Random(seed)
    total = sum(weight for weight, _ in MIX)
    picked: list[dict[str, Any]] = []
    for weight, question in MIX:
        picked.extend([question] * round(count * weight / total))
    while len(picked) < count:
        picked.append(MIX[0][1])
    del picked[count:]
    rng.shuffle(picked)
    bodies = []
    for index, question in enumerate(picked):
        run = rng.randrange(runs)
        body = {
            **question,
            "service": SERVICES[run % len(SERVICES)],
            "run_id": f"run-{seed}-{run:04d}",
            "attempt": 1 + index % 3,
        }
        bodies.append(json.dumps(body, separators=(",", ":")).encode())
    return bodies


@dataclass
class Timed:
    """Round trips of one phase, and what came back."""

    latencies_s: list[float] = field(default_factory=list)
    #: From sending to the answer's status line and headers, which the
    #: sidecar writes once the decision is made (the body is written after).
    headers_s: list[float] = field(default_factory=list)
    actions: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0


def _client(sidecar: Sidecar) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://{LOOPBACK}:{sidecar.api_port}",
        headers={"Authorization": f"Bearer {sidecar.token}", "Content-Type": "application/json"},
        timeout=10.0,
        trust_env=False,
    )


def ask_all(client: httpx.Client, bodies: Sequence[bytes], deadline: float, out: Timed) -> None:
    """POST each body in turn; record each round trip and the action answered."""
    perf = time.perf_counter
    for body in bodies:
        if time.monotonic() > deadline:
            raise BenchError("the deadline passed before every question was answered")
        started = perf()
        with client.stream("POST", "/v1/decide", content=body) as response:
            headers = perf()
            payload = response.read()
        elapsed = perf() - started
        if response.status_code != 200:
            raise BenchError(f"/v1/decide answered {response.status_code}: {payload[:300]!r}")
        out.latencies_s.append(elapsed)
        out.headers_s.append(headers - started)
        out.actions[json.loads(payload)["action"]] += 1


def health_floor(client: httpx.Client, count: int, deadline: float) -> list[float]:
    """Round trips of ``GET /healthz``: the HTTP stack with no auth and no decision."""
    perf = time.perf_counter
    out = []
    for _ in range(count):
        if time.monotonic() > deadline:
            raise BenchError("the deadline passed while timing /healthz")
        started = perf()
        response = client.get("/healthz")
        out.append(perf() - started)
        if response.status_code != 200:
            raise BenchError(f"/healthz answered {response.status_code}")
    return out


def sequential(sidecar: Sidecar, bodies: Sequence[bytes], deadline: float) -> Timed:
    timed = Timed()
    with _client(sidecar) as client:
        started = time.monotonic()
        ask_all(client, bodies, deadline, timed)
        timed.wall_s = time.monotonic() - started
    return timed


def concurrent(sidecar: Sidecar, bodies: Sequence[bytes], threads: int, deadline: float) -> Timed:
    """``threads`` keep-alive clients, each asking its share of ``bodies`` in turn."""
    parts = [Timed() for _ in range(threads)]
    errors: list[BaseException] = []
    clients = [_client(sidecar) for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def worker(index: int) -> None:
        try:
            start.wait(timeout=30)
            ask_all(clients[index], bodies[index::threads], deadline, parts[index])
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    try:
        for thread in workers:
            thread.start()
        start.wait(timeout=30)
        started = time.monotonic()
        for thread in workers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        wall = time.monotonic() - started
    finally:
        for client in clients:
            client.close()
    if any(thread.is_alive() for thread in workers):
        raise BenchError("sending threads did not finish before the deadline")
    if errors:
        raise errors[0]
    total = Timed(wall_s=wall)
    for part in parts:
        total.latencies_s.extend(part.latencies_s)
        total.headers_s.extend(part.headers_s)
        total.actions.update(part.actions)
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Figures are client round trips (perf_counter around each request), in ms.",
    )
    parser.add_argument("--requests", type=int, default=5_000, help="measured questions (5000)")
    parser.add_argument("--warmup", type=int, default=500, help="questions first, not timed (500)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="also run the questions again from N clients at once (1: sequential only)",
    )
    parser.add_argument(
        "--floor", type=int, default=200, help="GET /healthz round trips, for scale (200)"
    )
    parser.add_argument("--seed", type=int, default=7, help="shuffles the mix (7)")
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the whole run may take (600)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if min(args.requests, args.concurrency, args.floor) < 1 or args.warmup < 0:
        parser.error("--requests, --concurrency and --floor must be >= 1, --warmup >= 0")
    if not 0 < args.timeout <= 3600:
        parser.error("--timeout must be in (0, 3600] seconds")
    return args


def _warn_if_stalled(latencies: Sequence[float], requests: int) -> None:
    """Say at once why the run will be slow when every round trip waits for a delayed ACK."""
    if latencies and percentile(latencies, 0.5) > STALL_S:
        estimate = requests * percentile(latencies, 0.5)
        print(
            f"warm-up round trips take {percentile(latencies, 0.5) * 1000:.0f} ms (p50): the"
            f" measured part will take about {estimate:.0f} s",
            flush=True,
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _row(name: str, latencies: Sequence[float], rate: str) -> list[str]:
    return [
        name,
        f"{len(latencies):,}",
        _ms(percentile(latencies, 0.5)),
        _ms(percentile(latencies, 0.99)),
        _ms(percentile(latencies, 0.999)),
        _ms(max(latencies)),
        rate,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    warm = questions(args.warmup, seed=args.seed + 1)
    bodies = questions(args.requests, seed=args.seed)
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="spanvisor-bench-decide-") as state:
        env = {"SPANVISOR_STATE_PATH": str(Path(state) / "state.db"), **args.sidecar_env}
        try:
            with running_sidecar(env) as sidecar:
                with _client(sidecar) as client:
                    warmed = Timed()
                    ask_all(client, warm, deadline, warmed)
                    _warn_if_stalled(warmed.latencies_s, args.requests + args.floor)
                    floor = health_floor(client, args.floor, deadline)
                seq = sequential(sidecar, bodies, deadline)
                conc = (
                    concurrent(sidecar, bodies, args.concurrency, deadline)
                    if args.concurrency > 1
                    else None
                )
                stats = sidecar.stats()
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
    p99 = percentile(seq.latencies_s, 0.99) * 1000
    rate = f"{len(bodies) / seq.wall_s:,.0f}"
    rows = [
        _row("POST /v1/decide, sequential", seq.latencies_s, rate),
        _row("  same, until headers", seq.headers_s, "-"),
    ]
    if conc is not None:
        name = f"POST /v1/decide, {args.concurrency} clients"
        rows.append(_row(name, conc.latencies_s, f"{len(conc.latencies_s) / conc.wall_s:,.0f}"))
        rows.append(_row("  same, until headers", conc.headers_s, "-"))
    rows.append(_row("GET /healthz (HTTP floor)", floor, "-"))
    print()
    print(
        f"{args.requests:,} questions after {args.warmup:,} of warm-up, keep-alive httpx"
        " clients over loopback; round trips in ms"
    )
    print(table(["", "requests", "p50", "p99", "p99.9", "max", "req/s"], rows))
    print()
    mix = ", ".join(f"{name} {count:,}" for name, count in seq.actions.most_common())
    print(f"answers (sequential run): {mix}")
    print(
        f"sidecar governor: retry budget denials {stats['retry_budget']['denied']:,},"
        f" restart-intensity escalations {stats['restart_intensity']['escalated']:,}"
        " (no spans are sent, so the budget sees no calls: min_retries per window only)"
    )
    if percentile(floor, 0.5) > STALL_S:
        print(
            "note: ~40 ms on every keep-alive round trip, /healthz included, is the"
            " Nagle / delayed-ACK stall: the answer is written in two segments on a"
            " socket without TCP_NODELAY (see bench/README.md)"
        )
    verdict = "yes" if p99 < GOAL_P99_MS else "NO"
    print(f"goal p99 < {GOAL_P99_MS:g} ms (sequential round trip): {verdict} ({p99:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
