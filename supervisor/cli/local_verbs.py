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

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies import Policy, json_schema, load_policy
from supervisor.api_access import CONFIG_ENV
from supervisor.cli.progress import Progress
from supervisor.errors import ConfigError
from supervisor.judge.replay import (
    BadRecord,
    jsonl_line,
    replay,
    span_count,
    table_header,
    table_row,
)
from supervisor.logs import configure_logging

log = logging.getLogger("spanvisor.cli")


def _policy(path: Path | None) -> Policy:
    return load_policy(path)


def _traces(path: Path) -> Path:
    """``path`` when it is a file that can be read; a ConfigError (exit 2) saying why not.

    Checked before anything is printed: no table header above the error.
    """
    try:
        with path.open("rb"):
            pass
    except FileNotFoundError:
        raise ConfigError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a file of recorded traces") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    return path


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
    path, policy, output = _traces(args.path), _policy(args.policy), args.output
    bad = 0
    out = sys.stdout
    progress = Progress(f"replay {path}")
    if output == "table":
        out.write(table_header() + "\n")

    def counted(request: ExportTraceServiceRequest) -> None:
        progress.add(spans=span_count(request))

    for item in replay(path, policy, on_request=counted):
        if isinstance(item, BadRecord):
            bad += 1
            print(f"spanvisor: {path}: {item.where}: {item.message}", file=sys.stderr)
            continue
        progress.add(failures=1)
        out.write((jsonl_line(item) if output == "jsonl" else table_row(item)) + "\n")
    out.flush()
    progress.done()
    return 1 if bad else 0


def explain(args: argparse.Namespace) -> int:
    """The policy's rules and decision policies in order, or why each failure in a file
    got its verdict."""
    policy = _policy(args.policy)
    if args.path is None:
        print(f"policy: {policy.source}")
        print("classification rules, first match wins:")
        for number, name in enumerate(policy.rules, start=1):
            print(f"  {number:3d}. {name}")
        print("decision policies, first match wins:")
        for number, (name, action) in enumerate(policy.decision_entries(), start=1):
            print(f"  {number:3d}. {name}  -> {action}")
        return 0
    path = _traces(args.path)
    wanted = args.span.lower() if args.span else None
    wanted_id = _span_id(wanted) if wanted else None
    seen: list[str] = []  # the span's name and service, once it is found in the file

    def look(request: ExportTraceServiceRequest) -> None:
        if wanted_id is None or seen:
            return
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    if span.span_id == wanted_id:
                        service = next(
                            (
                                a.value.string_value
                                for a in resource_spans.resource.attributes
                                if a.key == "service.name"
                            ),
                            "",
                        )
                        seen.append(f"{span.name!r}, service {service!r}")
                        return

    found = 0
    for item in replay(path, policy, on_request=look):
        if isinstance(item, BadRecord):
            print(f"spanvisor: {path}: {item.where}: {item.message}", file=sys.stderr)
            continue
        f, d = item.failure, item.decision
        if wanted and f.span_id != wanted and wanted not in f.attributed:
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
            "stream_began": ev.stream_began or None,
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
    if wanted and not found:
        if seen:
            # In the file, and judged: it showed no failure (or one the policy ignores).
            print(f"span {wanted} ({seen[0]}) did not fail: no verdict to explain")
            return 0
        print(f"spanvisor: no span {wanted} in {path}", file=sys.stderr)
        return 1
    return 0


def _span_id(text: str) -> bytes:
    """A span id as given to --span: 16 hex digits (8 bytes); ConfigError otherwise."""
    try:
        found = bytes.fromhex(text)
    except ValueError:
        found = b""
    if len(found) != 8:
        raise ConfigError(f"--span takes a span id of 16 hex digits, not {text!r}")
    return found


def schema() -> int:
    """The policy file's JSON Schema, for editors."""
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0
