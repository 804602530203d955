"""The ``spanvisor`` command line. Errors become exit codes here and only here.

Exit codes: 0 success; 1 the input was read but is invalid (a policy with
errors, a replay file with undecodable records); 2 usage or configuration
errors (a bad flag, a settings file that cannot be used, a port in use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from policies import Policy, json_schema, load_policy
from supervisor import __version__
from supervisor.addresses import (
    API_PORT_ENV,
    DEFAULT_API_PORT,
    DEFAULT_API_URL,
    LOOPBACK,
    api_url,
)
from supervisor.errors import ConfigError, PolicyError, SupervisorError
from supervisor.judge.replay import BadRecord, jsonl_line, replay, table_header, table_row
from supervisor.logs import configure_logging

log = logging.getLogger("spanvisor.cli")

EPILOG = """\
examples:
  spanvisor demo                           see it work against a fake provider
  spanvisor run --policy policy.yaml       run next to an agent (OTLP on 4317/4318)
  spanvisor replay traces.jsonl --output jsonl
  spanvisor validate policy.yaml
  spanvisor approvals approve apr_1234 --note "key rotated"
  spanvisor breakers isolate openai:gpt-4o
  spanvisor remediations show rem_3f2a9c0d1e4b5a6978877665
  spanvisor runs --watch                   a live table of the agents' runs
settings: every `run` flag is also a SPANVISOR_* variable (SPANVISOR_API_PORT, ...);
forwarded and own spans go to OTEL_EXPORTER_OTLP_ENDPOINT when it is set.
"""


#: Workflow states, as :data:`supervisor.api.control.REMEDIATION_STATUSES` (not imported: heavy).
REMEDIATION_STATUSES = (
    "PENDING",
    "ENQUEUED",
    "DELAYED",
    "SUCCESS",
    "ERROR",
    "CANCELLED",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
)

REMEDIATIONS_EPILOG = """\
examples:
  spanvisor remediations                        the latest 50, newest first
  spanvisor remediations --status PENDING       only those still running
  spanvisor remediations show rem_3f2a9c0d1e4b  its request, steps and trace id
  spanvisor remediations cancel rem_3f2a9c0d1e4b
  spanvisor remediations --json                 the API's answer, for scripts
status is the workflow's state (PENDING while it runs); outcome is what the remediation
concluded: succeeded, failed, escalated or refused. Remediations run only when the policy
has a `remediate` action and the sidecar keeps state in a file (not ':memory:').
"""


#: A run's statuses, as :data:`supervisor.api.control.RUN_STATUSES` (not imported: heavy).
RUN_STATUSES = ("running", "failing", "stalled", "ended")

RUNS_EPILOG = """\
examples:
  spanvisor runs                                the 100 most recently active runs
  spanvisor runs --watch                        redraw every 2 seconds until Ctrl-C
  spanvisor runs --watch 10 --status stalled    stalled runs, every 10 seconds
  spanvisor runs --service checkout-agent --limit 20
  spanvisor runs --json                         the API's answer, for scripts
columns: AGE is the time since the run's first span, IDLE since its last; TOKENS
counts input and output tokens; RATE is spans per minute while it was active; STEP
is the last LLM or tool call's span name. A status is one of:
  running  spans are arriving
  failing  the sidecar has reported failures in it
  stalled  no span for the service's idle_seconds while its root span is open
  ended    its root span ended
--status and --service filter the 1000 most recently active runs. Run ids longer than
12 characters are shortened: --json and --output jsonl show them whole.
"""

#: Clears a terminal and puts the cursor home: ``--watch`` redraws over its last table.
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spanvisor",
        description="A reliability sidecar for AI agents: reads their OpenTelemetry spans, "
        "classifies every failure and decides what to do about it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spanvisor {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="COMMAND", required=True)

    run = verbs.add_parser("run", help="run the sidecar (OTLP receivers and control API)")
    run.add_argument("--config", type=Path, help="settings file (YAML); see config/spanvisor.yaml")
    run.add_argument("--policy", type=Path, help="policy file (YAML); default: the built-in policy")
    run.add_argument("--host", help="address for the OTLP receivers (default 127.0.0.1)")
    run.add_argument("--grpc-port", type=int, dest="otlp_grpc_port", help="OTLP gRPC port (4317)")
    run.add_argument("--http-port", type=int, dest="otlp_http_port", help="OTLP HTTP port (4318)")
    run.add_argument("--api-host", help=f"address for the control API (default {LOOPBACK})")
    run.add_argument("--api-port", type=int, help=f"control API port ({DEFAULT_API_PORT})")
    run.add_argument(
        "--observe",
        action="store_true",
        default=None,
        dest="observe_only",
        help="compute, log and trace decisions without delivering them",
    )
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    validate = verbs.add_parser("validate", help="check a policy file; exit 1 with every error")
    validate.add_argument("path", type=Path)

    rep = verbs.add_parser(
        "replay", help="classify the failures in recorded traces (OTLP/JSON lines or protobuf)"
    )
    rep.add_argument(
        "path", type=Path, help="OTLP/JSON lines, or 4-byte length-prefixed OTLP protobuf"
    )
    rep.add_argument("--policy", type=Path, help="policy file; default: the built-in policy")
    rep.add_argument("--output", choices=["table", "jsonl"], default="table")

    explain = verbs.add_parser(
        "explain", help="show the policy's rules, or why each failure in a file got its verdict"
    )
    explain.add_argument("path", type=Path, nargs="?", help="recorded traces, as for replay")
    explain.add_argument("--policy", type=Path, help="policy file; default: the built-in policy")
    explain.add_argument("--span", help="only the failure at this span id (hex)")

    verbs.add_parser("schema", help="print the policy file's JSON Schema (for editors)")

    _add_demo(verbs)

    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--api", default=None, help=f"control API URL (default {DEFAULT_API_URL})")
    remote.add_argument(
        "--token", default=None, help="API token (default: SPANVISOR_API_TOKEN or the token file)"
    )
    remote.add_argument("--output", choices=["table", "jsonl"], default="table")

    incidents = verbs.add_parser(
        "incidents", parents=[remote], help="list recent failures of a running sidecar"
    )
    incidents.add_argument("--limit", type=int, default=50)

    approvals = verbs.add_parser(
        "approvals", parents=[remote], help="list approval requests, or approve / deny one"
    )
    approvals.add_argument("answer", nargs="?", choices=["list", "approve", "deny"], default="list")
    approvals.add_argument("id", nargs="?", help="the approval request's id (approve, deny)")
    approvals.add_argument("--status", choices=["pending", "approved", "denied"])
    approvals.add_argument("--by", default=os.environ.get("USER", "cli"), help="who answers")
    approvals.add_argument("--note", default="", help="why, for the record")

    breakers = verbs.add_parser(
        "breakers", parents=[remote], help="list circuit breakers, or isolate / close one"
    )
    breakers.add_argument("act", nargs="?", choices=["list", "isolate", "close"], default="list")
    breakers.add_argument("dependency", nargs="?", help="e.g. openai:gpt-4o (isolate, close)")

    _add_remediations(verbs, remote)
    _add_runs(verbs, remote)

    commands = verbs.add_parser(
        "commands", parents=[remote], help="list commands sent to agents (--dead: dead letters)"
    )
    commands.add_argument("--dead", action="store_true", help="only dead letters")
    commands.add_argument("--service")
    commands.add_argument("--limit", type=int, default=50)

    verbs.add_parser(
        "reload", parents=[remote], help="make a running sidecar reload its policy file"
    )
    return parser


def _add_demo(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The demo verb: its description says what the story shows, so --help is the tour."""
    demo = verbs.add_parser(
        "demo",
        help="watch the sidecar supervise two LangGraph agents against a faulty fake provider",
        description="Runs, on loopback and on free ports: the sidecar (in this process), two\n"
        "LangGraph example agents and a fake LLM provider whose faults tell a story: 429s\n"
        "and 503s, an outage of the primary model, a reasoning loop, an agent killed and\n"
        "resumed, a refund an operator approves, a 401. Shows it live (a line per event\n"
        "when not on a terminal), then a summary. Exits 0 when every part of the story\n"
        "happened, 1 with what did not; everything is stopped and removed at the end.",
        epilog="to see the same in Jaeger (OTLP/HTTP on 4318, UI on 16686):\n"
        "  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo\n"
        "the demo's sidecar forwards every span there, and sends its own.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--runs",
        type=int,
        default=6,
        help="agent runs in all (6 to 20, default 6: the story's; more add runs to the ops"
        " agent, with seeded transient faults)",
    )
    demo.add_argument(
        "--seed", type=int, default=7, help="seed of the faults in the runs beyond the story's"
    )
    demo.add_argument(
        "--no-live",
        action="store_false",
        dest="live",
        default=None,
        help="print each event as a line, no live screen (the default when not on a terminal)",
    )
    demo.add_argument(
        "--keep", action="store_true", help="keep the demo's state directory (logs, ledgers)"
    )


def _add_remediations(
    verbs: argparse._SubParsersAction[argparse.ArgumentParser], remote: argparse.ArgumentParser
) -> None:
    """The ``remediations`` verb: list, show ID, cancel ID."""
    remediations = verbs.add_parser(
        "remediations",
        parents=[remote],
        help="list remediations, or show / cancel one",
        description="Remediations the sidecar runs for `remediate` decisions: list them\n"
        "(newest first), show one (its request, each recorded step and its trace), or\n"
        "cancel one still running.",
        epilog=REMEDIATIONS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    remediations.add_argument(
        "act",
        nargs="?",
        choices=["list", "show", "cancel"],
        default="list",
        help="list (the default), show ID or cancel ID",
    )
    remediations.add_argument(
        "id", nargs="?", help="the remediation's id, e.g. rem_3f2a9c0d1e4b (show, cancel)"
    )
    remediations.add_argument(
        "--status",
        type=str.upper,
        choices=REMEDIATION_STATUSES,
        metavar="STATUS",
        help="list only remediations in this workflow state: " + ", ".join(REMEDIATION_STATUSES),
    )
    remediations.add_argument(
        "--limit", type=int, default=50, help="list at most this many (default 50)"
    )
    remediations.add_argument(
        "--json", action="store_true", help="print the control API's JSON answer as is"
    )


def _add_runs(
    verbs: argparse._SubParsersAction[argparse.ArgumentParser], remote: argparse.ArgumentParser
) -> None:
    """The ``runs`` verb: a table of the runs' progress, once or ``--watch``."""
    runs = verbs.add_parser(
        "runs",
        parents=[remote],
        help="a live table of the agents' runs: progress, rate, idle time and status",
        description="The agents' runs a running sidecar tracks (a trace, or the session it\n"
        "names), most recently active first: what each has done, how fast, how long it\n"
        "has been quiet and whether it is running, failing, stalled or ended.",
        epilog=RUNS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runs.add_argument(
        "--status",
        type=str.lower,
        choices=RUN_STATUSES,
        metavar="STATUS",
        help="only runs in this status: " + ", ".join(RUN_STATUSES),
    )
    runs.add_argument("--service", help="only the runs of this service (its exact name)")
    runs.add_argument(
        "--limit", type=int, default=100, help="show at most this many, 1 to 1000 (default 100)"
    )
    runs.add_argument(
        "--json", action="store_true", help="print the control API's JSON answer as is"
    )
    runs.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    runs.add_argument("--iterations", type=_count, default=None, help=argparse.SUPPRESS)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= seconds <= 86_400:  # also refuses nan
        raise argparse.ArgumentTypeError("the interval must be between 0.1 and 86400 seconds")
    return seconds


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except PolicyError as exc:
        print(f"spanvisor: the policy has {len(exc.issues)} error(s):", file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue}", file=sys.stderr)
        return 1 if args.verb == "validate" else 2
    except (ConfigError, SupervisorError) as exc:
        print(f"spanvisor: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `spanvisor replay ... | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0
    except OSError as exc:
        print(f"spanvisor: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    verb = args.verb
    if verb == "run":
        return _run(args)
    if verb == "validate":
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
    if verb == "replay":
        return _replay(args.path, _policy(args.policy), args.output)
    if verb == "explain":
        return _explain(args)
    if verb == "schema":
        print(json.dumps(json_schema(), indent=2, sort_keys=True))
        return 0
    if verb == "demo":
        from supervisor.cli.demo import run_demo  # the demo pulls in the example agent's needs

        return run_demo(runs=args.runs, seed=args.seed, live=args.live, keep=args.keep)
    if verb == "incidents":
        return _incidents(args)
    if verb == "approvals":
        return _approvals(args)
    if verb == "breakers":
        return _breakers(args)
    if verb == "remediations":
        return _remediations(args)
    if verb == "runs":
        return _runs(args)
    if verb == "commands":
        return _commands(args)
    if verb == "reload":
        answer = _api(args, "POST", "/v1/policy/reload")
        if not answer.get("reloaded"):
            print(f"spanvisor: policy not reloaded: {answer.get('error')}", file=sys.stderr)
            return 1
        print(f"policy reloaded from {answer.get('source')}")
        return 0
    raise AssertionError(f"unhandled verb {verb}")  # argparse rejects unknown verbs


def _policy(path: Path | None) -> Policy:
    return load_policy(path)


def _run(args: argparse.Namespace) -> int:
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
    settings = load_settings(args.config, overrides)
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


def _replay(path: Path, policy: Policy, output: str) -> int:
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


def _explain(args: argparse.Namespace) -> int:
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


def _api(
    args: argparse.Namespace,
    method: str,
    path: str,
    *,
    params: dict[str, object] | None = None,
    body: dict[str, object] | None = None,
) -> dict[str, Any]:
    """Call the running sidecar's control API; ConfigError with its message on any refusal."""
    api = args.api or api_url(os.environ.get(API_PORT_ENV, DEFAULT_API_PORT))
    token = args.token or os.environ.get("SPANVISOR_API_TOKEN") or _token_from_file()
    if not token:
        raise ConfigError(
            "no API token: pass --token, set SPANVISOR_API_TOKEN or run on the sidecar's host"
        )
    try:
        response = httpx.request(
            method,
            f"{api.rstrip('/')}{path}",
            params={k: v for k, v in (params or {}).items() if v is not None},  # type: ignore[misc]
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
            trust_env=False,
        )
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach the control API at {api}: {exc}") from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": response.text[:200]}
    if response.status_code != 200:
        raise ConfigError(f"control API answered {response.status_code}: {answer.get('error')}")
    return answer  # type: ignore[no-any-return]


def _print_jsonl(items: list[dict[str, Any]]) -> None:
    for entry in items:
        print(json.dumps(entry, sort_keys=True))


def _approvals(args: argparse.Namespace) -> int:
    if args.answer in ("approve", "deny"):
        if not args.id:
            raise ConfigError(f"approvals {args.answer} needs the request's id")
        answered = _api(
            args,
            "POST",
            f"/v1/approvals/{quote(args.id, safe='')}/{args.answer}",
            body={"by": args.by, "note": args.note},
        )
        print(f"{answered['id']}: {answered['status']} by {answered['answered_by']}")
        return 0
    found = _api(args, "GET", "/v1/approvals", params={"status": args.status})["approvals"]
    if args.output == "jsonl":
        _print_jsonl(found)
        return 0
    print(f"{'ID':28}  {'STATUS':8}  {'SERVICE':16}  {'RUN':20}  WHAT / PROPOSAL")
    for a in found:
        what = a.get("what", {})
        proposed = a.get("proposal", {}).get("command", "")
        print(
            f"{a['id']:28}  {a['status']:8}  {a['service'][:16]:16}  {a['run_id'][:20]:20}  "
            f"{what.get('class', '')}/{what.get('kind', '')} on {what.get('dependency', '')}"
            f" -> {proposed}"
        )
    return 0


def _breakers(args: argparse.Namespace) -> int:
    if args.act in ("isolate", "close"):
        if not args.dependency:
            raise ConfigError(f"breakers {args.act} needs a dependency, e.g. openai:gpt-4o")
        path = f"/v1/breakers/{quote(args.dependency, safe=':')}/{args.act}"
        changed = _api(args, "POST", path)
        print(f"{changed['dependency']}: {changed['state']}")
        return 0
    found = _api(args, "GET", "/v1/breakers")["breakers"]
    if args.output == "jsonl":
        _print_jsonl(found)
        return 0
    print(f"{'DEPENDENCY':40}  {'STATE':9}  {'FAILURES':8}  REOPENS IN")
    for b in found:
        print(
            f"{b['dependency'][:40]:40}  {b['state']:9}  {b['failures']:8}  {b['reopens_at'] or ''}"
        )
    return 0


def _remediations(args: argparse.Namespace) -> int:
    if args.act in ("show", "cancel"):
        if not args.id:
            raise ConfigError(
                f"remediations {args.act} needs the remediation's id (see `spanvisor remediations`)"
            )
        path = f"/v1/remediations/{quote(args.id, safe='')}"
        if args.act == "cancel":
            answer = _api(args, "POST", f"{path}/cancel")
            if args.json:
                print(json.dumps(answer, indent=2, sort_keys=True))
            else:
                state = "cancelled" if answer.get("cancelled") else "not cancelled"
                print(f"{answer.get('id', args.id)}: {state}")
            return 0
        shown = _api(args, "GET", path)
        if args.json:
            print(json.dumps(shown, indent=2, sort_keys=True))
        else:
            _print_remediation(shown)
        return 0
    if args.id:
        raise ConfigError("remediations list takes no id: use `remediations show ID`")
    answer = _api(
        args, "GET", "/v1/remediations", params={"status": args.status, "limit": args.limit}
    )
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return 0
    found: list[dict[str, Any]] = answer.get("remediations", [])
    if args.output == "jsonl":
        _print_jsonl(found)
        return 0
    if not answer.get("running", True):
        print(
            "remediations are not running on this sidecar: the policy has no `remediate`"
            " action, or there is no state database (state_path is ':memory:')"
        )
        return 0
    if not found:
        print("no remediations" + (f" in state {args.status}" if args.status else ""))
        return 0
    # The list answer names no remediator today; show the column once it does.
    named = [r.get("remediator") or (r.get("request") or {}).get("remediator") for r in found]
    header = ["ID", "STATUS", "OUTCOME", *(["REMEDIATOR"] if any(named) else []), "AGE", "TRACE"]
    rows = [
        [
            r.get("id"),
            r.get("status"),
            r.get("outcome") or "-",
            *([name or "-"] if any(named) else []),
            _age(r.get("created_at")),
            r.get("trace_id") or "-",
        ]
        for r, name in zip(found, named, strict=True)
    ]
    _print_table(header, rows)
    return 0


def _print_table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [[_one_line(c, 64) for c in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]
    for row in [header, *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _print_remediation(r: dict[str, Any]) -> None:
    """One remediation for a person: what started it, what it did, where its trace is."""
    request: dict[str, Any] = r.get("request") or {}
    trigger: dict[str, Any] = request.get("trigger") or {}
    outcome = f"  outcome {_one_line(r['outcome'])}" if r.get("outcome") else ""
    print(f"remediation {_one_line(r.get('id'))}  {_one_line(r.get('status'))}{outcome}")
    if r.get("reason"):
        print(f"  reason       {_one_line(r['reason'], 200)}")
    if r.get("error"):
        print(f"  error        {_one_line(r['error'], 200)}")
    if request:
        tools = ", ".join(_one_line(t) for t in request.get("tools") or []) or "none"
        print(
            f"  remediator   {_one_line(request.get('remediator'))}"
            f" (uses {_one_line(request.get('use'))}; tools: {tools})"
        )
        budget = request.get("budget") or {}
        if budget:
            print("  budget       " + "  ".join(f"{k}={_one_line(v)}" for k, v in budget.items()))
        if request.get("on_unresolved"):
            print(
                f"  unresolved   {_one_line(request['on_unresolved'])} after"
                f" {_one_line(request.get('verify_window_s'))}s without recovery"
            )
    if trigger:
        print(
            f"  trigger      {_one_line(trigger.get('class'))}/{_one_line(trigger.get('kind'))}"
            f" on {_one_line(trigger.get('dependency')) or '-'}"
            f" by rule {_one_line(trigger.get('rule'))}"
        )
        print(
            f"               service {_one_line(trigger.get('service'))}"
            f"  run {_one_line(trigger.get('run_id'))}"
        )
        print(
            f"               span {_one_line(trigger.get('span_id'))}"
            f" ({_one_line(trigger.get('span_name'))})"
            f" in trace {_one_line(trigger.get('trace_id'))}"
        )
        if trigger.get("message"):
            print(f'               message "{_one_line(trigger["message"], 160)}"')
    created, updated = r.get("created_at"), r.get("updated_at")
    attempts = r.get("recovery_attempts") or 0  # DBOS counts the first start as one
    print(
        f"  started      {_age(created)} ago, last change {_age(updated)} ago"
        + (f", started {attempts} times (resumed after restarts)" if attempts > 1 else "")
    )
    steps: list[dict[str, Any]] = r.get("steps") or []
    print(f"steps ({len(steps)}):" if steps else "steps: none recorded yet")
    for step in steps:
        print(
            f"  {step.get('n', '?')!s:>3}  {_one_line(step.get('name'), 40):40}"
            f"  {_step_result(step)}"
        )
    trace_id = r.get("trace_id") or request.get("trace_id")
    if trace_id:
        print(f"trace {_one_line(trace_id)}")
        print(
            f"open trace {_one_line(trace_id)} in Jaeger: the root span links to the"
            " triggering span"
        )


def _step_result(step: dict[str, Any]) -> str:
    """A step's output, short: a tool call's value (or why it failed), else its JSON."""
    if step.get("error"):
        return "error: " + _one_line(step["error"], 100)
    output = step.get("output")
    if isinstance(output, dict) and {"ok", "value"} <= output.keys():  # a tool call's result
        if output.get("refused"):
            return "refused: " + _one_line(output.get("error"), 100)
        if not output.get("ok"):
            return "failed: " + _one_line(output.get("error"), 100)
        output = output["value"]
    return _one_line(json.dumps(output, sort_keys=True, default=str), 100)


def _one_line(value: object, width: int = 80) -> str:
    """Span content for a terminal: control characters shown escaped, one line, clipped."""
    text = "" if value is None else str(value)
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _age(at: object) -> str:
    if not isinstance(at, (int, float)) or at <= 0:
        return "-"
    seconds = max(0.0, time.time() - at)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _runs(args: argparse.Namespace) -> int:
    """``spanvisor runs``: one table, or ``--watch``: one every N seconds until Ctrl-C."""
    params: dict[str, object] = {
        "status": args.status,
        "service": args.service,
        "limit": args.limit,
    }
    if args.watch is None:
        _print_runs(args, _api(args, "GET", "/v1/runs", params=params), fit_screen=False)
        return 0
    # Redraw in place on a terminal; anywhere else (a file, a pipe), append each
    # table after a blank line. JSON is a stream of answers, one a line, never cleared.
    redraw = sys.stdout.isatty() and not args.json and args.output == "table"
    shown = 0
    try:
        while True:
            try:
                answer: dict[str, Any] | None = _api(args, "GET", "/v1/runs", params=params)
                problem = ""
            except ConfigError as exc:
                if not shown:
                    raise  # a wrong token or address: say so and stop
                answer, problem = None, str(exc)  # the sidecar restarting: keep trying
            if redraw:
                sys.stdout.write(CLEAR_SCREEN)
            elif shown and not args.json and args.output == "table":
                print()
            if args.json or args.output == "jsonl":
                if answer is not None:
                    _print_runs(args, answer, fit_screen=False)
                else:
                    print(f"spanvisor: {problem}", file=sys.stderr)
            else:
                every = f"{args.watch:g}s"
                print(f"runs at {time.strftime('%H:%M:%S')}, every {every} (Ctrl-C to stop)")
                if answer is not None:
                    _print_runs(args, answer, fit_screen=redraw)
                else:
                    print(f"spanvisor: {problem}; trying again every {every}")
            sys.stdout.flush()
            shown += 1
            if args.iterations is not None and shown >= args.iterations:
                return 0
            _pause(args.watch)
    except KeyboardInterrupt:  # how a watch ends
        if redraw:
            print()
        return 0


def _pause(seconds: float) -> None:
    """Between two ``--watch`` tables (a seam for the tests)."""
    time.sleep(seconds)


def _print_runs(args: argparse.Namespace, answer: dict[str, Any], *, fit_screen: bool) -> None:
    """The answer of ``GET /v1/runs``: as JSON, JSON lines or a table for a person.

    ``fit_screen`` (a terminal being redrawn): the table is cut to the screen's height.
    """
    if args.json:
        if args.watch is not None:
            print(json.dumps(answer, sort_keys=True))
        else:
            print(json.dumps(answer, indent=2, sort_keys=True))
        return
    found: list[dict[str, Any]] = answer.get("runs", [])
    if args.output == "jsonl":
        _print_jsonl(found)
        return
    if not answer.get("tracking", True):
        print("this sidecar does not track runs")
        return
    stats: dict[str, Any] = answer.get("stats") or {}
    if not found:
        wanted = [f"status {args.status}"] if args.status else []
        wanted += [f"service {_one_line(args.service)}"] if args.service else []
        print("no runs" + (" with " + " and ".join(wanted) if wanted else ""))
    else:
        header = ["RUN", "SERVICE", "STATUS", "AGE", "IDLE", "SPANS", "LLM", "TOOLS", "ERR"]
        header += ["TOKENS", "RATE", "STEP"]
        rows = [_run_row(run) for run in found]
        more = 0
        if fit_screen:
            room = max(1, shutil.get_terminal_size().lines - 4)  # title, header, footer, prompt
            if len(rows) > room:
                rows, more = rows[: room - 1], len(rows) - (room - 1)
        for line in _aligned(header, rows, right=range(3, 11)):
            print(line)
        if more:
            print(f"… and {more} more: narrow with --status, --service or --limit")
    if isinstance(stats.get("tracked"), int):
        print(_runs_footer(len(found), stats))
    slo = answer.get("slo")
    if isinstance(slo, dict) and slo:
        print()
        for line in _slo_lines(slo):
            print(line)


def _slo_lines(slo: dict[str, Any]) -> list[str]:
    """One line per service: run success against its target, burn rates, duration, cost."""
    header = ["SERVICE", "RUNS", "SUCCESS", "TARGET", "BURN 5m/1h", "P95", "COST/RUN", ""]
    rows: list[list[str]] = []
    for service, status in sorted(slo.items()):
        if not isinstance(status, dict):
            continue
        runs = status.get("runs") or {}
        rate = (status.get("success_rate") or {}).get("long")
        burn = status.get("burn_rate") or {}
        cost = status.get("mean_cost_usd")
        rows.append(
            [
                _one_line(service, 24),
                _one_line(runs.get("long"), 10),
                "-" if not isinstance(rate, (int, float)) else f"{rate:.1%}",
                f"{status.get('success_target', 0):.1%}",
                f"{burn.get('short', 0):.1f}/{burn.get('long', 0):.1f}",
                _duration((status.get("duration_s") or {}).get("p95")),
                "-" if not isinstance(cost, (int, float)) else f"${cost:.4f}",
                "BURNING" if status.get("fast_burn") else "",
            ]
        )
    return _aligned(header, rows, right=range(1, 7)) if rows else []


def _run_row(run: dict[str, Any]) -> list[str]:
    """One run's cells; span-derived text (id, service, step) with control characters escaped."""
    run_id = _one_line(run.get("run_id"), 10_000)
    started, last_seen = run.get("started_at"), run.get("last_seen_at")
    idle = run.get("idle_s")
    # The age from the sidecar's own times, not this host's clock (which may differ).
    age: object = None
    if isinstance(started, (int, float)) and isinstance(last_seen, (int, float)):
        age = last_seen - started + (idle if isinstance(idle, (int, float)) else 0.0)
    tokens = [run.get("input_tokens"), run.get("output_tokens")]
    rate = run.get("spans_per_minute")
    return [
        run_id if len(run_id) <= 12 else run_id[:12] + "…",
        _one_line(run.get("service"), 24) or "-",
        _one_line(run.get("status"), 12),
        _duration(age),
        _duration(idle),
        _one_line(run.get("spans"), 12),
        _one_line(run.get("llm_calls"), 12),
        _one_line(run.get("tool_calls"), 12),
        _one_line(run.get("errors"), 12),
        _quantity(sum(t for t in tokens if isinstance(t, int))),
        _rate(rate),
        _one_line(run.get("step"), 30) or "-",
    ]


def _aligned(header: list[str], rows: list[list[str]], *, right: range) -> list[str]:
    """The table's lines: columns two spaces apart, those in ``right`` right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]


def _runs_footer(listed: int, stats: dict[str, Any]) -> str:
    """``12 runs of 340 tracked; 5 evicted, 80 expired``: how much the table covers."""
    gone = [f"{stats[k]} {k}" for k in ("evicted", "expired") if stats.get(k)]
    runs = "run" if listed == 1 else "runs"
    return f"{listed} {runs} of {stats['tracked']} tracked" + (
        f"; {', '.join(gone)}" if gone else ""
    )


def _duration(seconds: object) -> str:
    """Seconds for a person: 3s, 4m12s, 2h05m, 3d04h (``-`` when unknown)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or math.isnan(seconds):
        return "-"
    whole = int(max(0.0, min(float(seconds), 1e12)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3_600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3_600}h{whole % 3_600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3_600:02d}h"


def _quantity(n: int) -> str:
    """A count for a person: 950, 12.3k, 4.1M, 2.0G."""
    if n < 1_000:
        return str(n)
    for size, unit in ((1_000, "k"), (1_000_000, "M")):
        if round(n / size, 1) < 1_000:
            return f"{n / size:.1f}{unit}"
    return f"{n / 1_000_000_000:.1f}G"


def _rate(per_minute: object) -> str:
    if not isinstance(per_minute, (int, float)) or isinstance(per_minute, bool):
        return "-"
    return f"{per_minute:.1f}" if per_minute < 100 else f"{per_minute:.0f}"


def _commands(args: argparse.Namespace) -> int:
    if args.dead:
        found = _api(args, "GET", "/v1/dead-letters", params={"limit": args.limit})["dead_letters"]
    else:
        params = {"service": args.service, "limit": args.limit}
        found = _api(args, "GET", "/v1/commands/log", params=params)["commands"]
    if args.output == "jsonl":
        _print_jsonl(found)
        return 0
    print(f"{'ID':28}  {'TYPE':16}  {'STATUS':9}  {'SERVICE':16}  {'TRIES':5}  LAST ERROR")
    for c in found:
        print(
            f"{c['id']:28}  {c['type']:16}  {c['status']:9}  {c['service'][:16]:16}  "
            f"{c['attempts']:5}  {c['last_error'][:60]}"
        )
    return 0


def _incidents(args: argparse.Namespace) -> int:
    failures = _api(args, "GET", "/v1/failures", params={"limit": args.limit})["failures"]
    if args.output == "jsonl":
        for entry in failures:
            print(json.dumps(entry, sort_keys=True))
        return 0
    print(f"{'CLASS':9}  {'KIND':18}  {'DEPENDENCY':28}  {'ACTION':9}  {'SERVICE':16}  SPAN")
    for e in failures:
        print(
            f"{e['class']:9}  {e['kind']:18}  {e['dependency'][:28]:28}  {e['action']:9}  "
            f"{e['service'][:16]:16}  {e['span_name'][:40]}"
        )
    return 0


def _token_from_file() -> str | None:
    from supervisor.settings import load_settings

    try:
        path = load_settings().token_file
        return path.read_text(encoding="utf-8").strip() or None
    except (OSError, ConfigError):
        return None


if __name__ == "__main__":
    sys.exit(main())
