"""The verbs that need no running sidecar: run one, and check, replay or explain a policy.

``run`` starts the sidecar in this process until SIGTERM or Ctrl-C;
``validate``, ``replay``, ``explain`` and ``schema`` read a policy file (and
recorded traces) and print what it makes of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from policies import Policy, json_schema, load_policy
from supervisor.api_access import CONFIG_ENV
from supervisor.judge.replay import BadRecord, jsonl_line, replay, table_header, table_row
from supervisor.logs import configure_logging

log = logging.getLogger("spanvisor.cli")


def _policy(path: Path | None) -> Policy:
    return load_policy(path)


def run_sidecar(args: argparse.Namespace) -> int:
    """``spanvisor run``: the sidecar in this process until SIGTERM or Ctrl-C (SIGHUP reloads)."""
    from supervisor.settings import load_settings
    from supervisor.wiring import build_sidecar, resolve_downstream  # heavy: only for `run`

    overrides = {
        key: getattr(args, key)
        for key in (
            "host",
            "otlp_grpc_port",
            "otlp_http_port",
            "api_host",
            "api_port",
            "observe_only",
            "log_level",
            "policy",
        )
    }
    # The settings file: --config, else SPANVISOR_CONFIG, which the clients read too.
    settings = load_settings(args.config or os.environ.get(CONFIG_ENV) or None, overrides)
    configure_logging(settings.log_level)
    policy = load_policy(settings.policy)
    downstream = resolve_downstream(settings)

    async def serve() -> None:
        sidecar = build_sidecar(settings, policy, downstream=downstream)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, sidecar.reload_policy)
        await sidecar.start()
        sidecar.collector.take_over()
        if settings.api_token is None:
            log.info("control API token written", extra={"token_file": str(settings.token_file)})
        await stop.wait()
        log.info("shutting down")
        await sidecar.shutdown()

    asyncio.run(serve())
    return 0


def validate(args: argparse.Namespace) -> int:
    """The policy file's errors, the remediators' included: 1 when there are any."""
    policy = load_policy(args.path)
    from remediators.registry import check_policy  # imports the remediators named

    problems = check_policy(policy)
    if problems:
        print(f"spanvisor: the policy has {len(problems)} error(s):", file=sys.stderr)
        for problem in problems:
            print(f"  {args.path}: {problem}", file=sys.stderr)
        return 1
    print(f"{args.path}: ok ({len(policy.rules)} classification rules in effect)")
    return 0


def replay_traces(args: argparse.Namespace) -> int:
    """Each failure in recorded traces and its decision; 1 when a record could not be read."""
    path, policy, output = args.path, _policy(args.policy), args.output
    bad = 0
    out = sys.stdout
    if output == "table":
        out.write(table_header() + "\n")
    for item in replay(path, policy):
        if isinstance(item, BadRecord):
            bad += 1
            print(f"spanvisor: {path}: {item.where}: {item.message}", file=sys.stderr)
            continue
        out.write((jsonl_line(item) if output == "jsonl" else table_row(item)) + "\n")
    out.flush()
    return 1 if bad else 0


def explain(args: argparse.Namespace) -> int:
    """The policy's rules in order, or why each failure in a file got its verdict."""
    policy = _policy(args.policy)
    if args.path is None:
        print(f"policy: {policy.source}")
        print("classification rules, first match wins:")
        for number, name in enumerate(policy.rules, start=1):
            print(f"  {number:3d}. {name}")
        return 0
    found = 0
    for item in replay(args.path, policy):
        if isinstance(item, BadRecord):
            print(f"spanvisor: {args.path}: {item.where}: {item.message}", file=sys.stderr)
            continue
        f, d = item.failure, item.decision
        if args.span and f.span_id != args.span.lower():
            continue
        found += 1
        ev = f.evidence
        print(f"failure at span {f.span_id} ({f.span_name!r}, service {f.service!r})")
        print(f"  trace        {f.trace_id}   run {f.run_id}")
        print(f"  evidence     {f.message}")
        fields = {
            "status": "ERROR" if ev.status_error else "OK",
            "exception": ev.exception_type,
            "http": ev.http_status,
            "grpc": ev.grpc_code,
            "provider_code": ev.provider_code,
            "error.type": ev.error_type,
            "finish_reasons": ",".join(ev.finish_reasons),
            "retry_after_s": ev.retry_after_s,
            "swallowed": ev.swallowed or None,
        }
        shown = "  ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", ()))
        print(f"               {shown}")
        verdict = f"{f.failure_class.value}/{f.kind} on {f.dependency or '-'}"
        print(f"  verdict      {verdict} by rule {f.rule}")
        if f.attributed:
            print(f"  attributed   ancestors that only propagated it: {', '.join(f.attributed)}")
        params = ", ".join(f"{k}={v!s}" for k, v in d.params.items())
        print(f"  decision     {d.action.value} ({params}) by policy {d.policy}")
        if d.reason:
            print(f"  why          {d.reason}")
        print()
    if args.span and not found:
        print(f"spanvisor: no failure at span {args.span} in {args.path}", file=sys.stderr)
        return 1
    return 0


def schema() -> int:
    """The policy file's JSON Schema, for editors."""
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0
