"""Acknowledged failures lost after ``kill -9`` at random moments under load.

    python bench/kill_acknowledged.py [--tree DIR] [--rounds 5] [--seed 1]

Each round starts a ``spanvisor run`` (the source tree ``--tree``, default
this one) on a fresh state directory, sends it requests of realistic spans
(half of them failing) from 8 threads, and kills it with SIGKILL at a random
moment 0.5 to 3 s into the load. A new process then starts on the same state.
Every failure in a request that was answered 200 must end as an incident: the
figure is how many did not, of how many were acknowledged. Which spans are
failures is what an in-process pipeline finds in the same requests.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/kill_acknowledged.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.harness import command_line
from bench.spans import make_requests
from policies import load_policy
from supervisor.judge.pipeline import Pipeline
from supervisor.testing.sidecar_process import SidecarProcess, wait_until

#: Every failure retried at once, with nothing (breaker, budget, backoff) in between.
POLICY = """\
version: 1
breakers: {enabled: false}
retry_budget: {enabled: false}
restart_intensity: {enabled: false}
policies:
  - name: retry_now
    match: {class: [transient, model, permanent, semantic]}
    action: retry
    max_attempts: 100
    wait: {type: fixed, seconds: 0}
    honour_retry_after: false
"""
REQUESTS, SPANS, RATE, SENDERS = 400, 100, 0.5, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rounds", type=int, default=5, help="kills (5)")
    parser.add_argument("--seed", type=int, default=1, help="of the kill moments and spans (1)")
    return parser.parse_args(argv)


def failures_by_request(payloads: list[bytes], policy: Path) -> list[set[tuple[str, str]]]:
    """Each request's failing spans, as a pipeline judging them in order finds them."""
    pipeline = Pipeline(load_policy(policy))
    now = time.time_ns()
    return [
        {(o.failure.trace_id, o.failure.span_id) for o in pipeline.process_payload(p, now)}
        for p in payloads
    ]


def stored(state: Path) -> set[tuple[str, str]]:
    with sqlite3.connect(f"file:{state}?mode=ro", uri=True) as db:
        return {(t, s) for t, s in db.execute("SELECT trace_id, span_id FROM incidents")}


def one_round(tree: Path, directory: Path, rng: random.Random, seed: int) -> tuple[int, int, float]:
    """(acknowledged failures, of them lost, the kill's moment in seconds)."""
    payloads = make_requests(REQUESTS, SPANS, failure_rate=RATE, seed=seed)
    (directory / "policy.yaml").write_text(POLICY, encoding="utf-8")
    expected = failures_by_request(payloads, directory / "policy.yaml")
    state = directory / "state.db"
    settings = {
        "host": "127.0.0.1",
        "state_path": str(state),
        "policy_poll_s": 0,
        "track_runs": False,
    }
    env = {"PYTHONPATH": str(tree)}
    first = SidecarProcess(settings, directory, policy=POLICY, name="first", env=env)
    first.start()
    acknowledged: list[int] = []
    lock = threading.Lock()
    kill_at = rng.uniform(0.5, 3.0)
    url = f"{first.otlp_endpoint}/v1/traces"

    def send(index: int) -> None:
        try:
            answer = httpx.post(
                url,
                content=payloads[index],
                headers={"Content-Type": "application/x-protobuf"},
                timeout=10,
                trust_env=False,
            )
        except httpx.HTTPError:
            return  # the process is gone
        if answer.status_code == 200:
            with lock:
                acknowledged.append(index)

    killer = threading.Timer(kill_at, lambda: first.process.send_signal(signal.SIGKILL))
    killer.start()
    with ThreadPoolExecutor(max_workers=SENDERS) as pool:
        list(pool.map(send, range(REQUESTS)))
    killer.join()
    first.kill()
    want = set().union(*(expected[i] for i in acknowledged)) if acknowledged else set()
    second = SidecarProcess(settings, directory, policy=POLICY, name="second", env=env)
    second.start()
    try:
        wait_until(lambda: want <= stored(state), 60, "every acknowledged failure stored")
    except AssertionError:
        pass  # lost: counted below
    finally:
        second.stop()
    return len(want), len(want - stored(state)), kill_at


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tree = args.tree.resolve()
    os.chdir(tree)  # `python -m supervisor.cli` imports from the working directory first
    rng = random.Random(args.seed)
    print(command_line())
    print(f"tree: {tree}; {REQUESTS} requests of {SPANS} spans, {SENDERS} senders")
    total = lost = 0
    for n in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="spanvisor-kill-") as tmp:
            acked, missing, at = one_round(tree, Path(tmp), rng, args.seed * 1000 + n)
        total += acked
        lost += missing
        print(f"round {n + 1}: killed at {at:.2f}s, {missing} lost of {acked} acknowledged")
    print(f"acknowledged failures lost after kill -9: {lost} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
