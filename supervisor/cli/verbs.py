"""The ``spanvisor`` command line: verbs and flags; errors become exit codes here and only here.

Exit codes: 0 success; 1 the input was read but is invalid (a policy with
errors, a replay file with undecodable records); 2 usage or configuration
errors (a bad flag, a settings file that cannot be used, a port in use).

The verbs themselves live beside this module: :mod:`.local_verbs` (``run``,
``validate``, ``replay``, ``explain``, ``schema``), :mod:`.operator_verbs`
(those that talk to a running sidecar's control API), :mod:`.output` (how
those print) and :mod:`.demo`.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from supervisor import __version__
from supervisor.addresses import API_PORT_ENV, DEFAULT_API_PORT, DEFAULT_API_URL, LOOPBACK
from supervisor.api_access import (
    API_HOST_ENV,
    API_URL_ENV,
    CONFIG_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
)
from supervisor.cli import init_verb, local_verbs, operator_verbs
from supervisor.cli.operator_verbs import CLEAR_SCREEN
from supervisor.errors import ConfigError, PolicyError, SupervisorError
from supervisor.records import REMEDIATION_STATUSES, RUN_STATUSES

# CLEAR_SCREEN was defined here before the operator verbs moved: still importable from here.
__all__ = ["CLEAR_SCREEN", "build_parser", "main"]

EPILOG = """\
examples:
  spanvisor demo                           see it work against a fake provider
  spanvisor run --policy policy.yaml       run next to an agent (OTLP on 4317/4318)
  spanvisor replay traces.jsonl --output jsonl
  spanvisor init policy.yaml               a commented starting policy
  spanvisor validate policy.yaml
  spanvisor approvals approve apr_1234 --note "key rotated"
  spanvisor breakers isolate openai:gpt-4o
  spanvisor remediations show rem_3f2a9c0d1e4b5a6978877665
  spanvisor runs --watch                   a live table of the agents' runs
settings: every `run` flag is also a SPANVISOR_* variable (SPANVISOR_API_PORT, ...);
forwarded and own spans go to OTEL_EXPORTER_OTLP_ENDPOINT when it is set.
the operator verbs (incidents ... reload) find the sidecar by --api, SPANVISOR_API_URL,
SPANVISOR_API_HOST/SPANVISOR_API_PORT or the settings file (SPANVISOR_CONFIG); see
`spanvisor runs --help`.
"""

#: How the operator verbs find the sidecar and its token (supervisor.api_access).
ADDRESS_NOTE = (
    "\n"
    + textwrap.fill(
        f"which sidecar: --api URL, else {API_URL_ENV}, else the sidecar's own api_host and"
        f" api_port ({API_HOST_ENV}/{API_PORT_ENV}, else the settings file named by --config or"
        f" {CONFIG_ENV}), else {DEFAULT_API_URL}. The token: --token, else {TOKEN_ENV}, else"
        f" api_token in the settings file, else the token file the sidecar writes at start"
        f" ({TOKEN_FILE_ENV}, else token_file in the settings file, else ~/.spanvisor/api-token)."
        " Errors name the sidecar asked, how its address was chosen and where the token came from.",
        width=86,
    )
    + "\n"
)


def _examples(*lines: str, notes: str = "") -> str:
    """A verb's epilog: its examples, then what else its --help should say."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines) + notes


REMEDIATIONS_EPILOG = """\
examples:
  spanvisor remediations                        the latest 50, newest first
  spanvisor remediations --status PENDING       only those still running
  spanvisor remediations show rem_3f2a9c0d1e4b  its request, steps and trace id
  spanvisor remediations cancel rem_3f2a9c0d1e4b
  spanvisor remediations --json                 the API's answer, for scripts
status is the workflow's state (PENDING while it runs); outcome is what the remediation
concluded: succeeded, failed, escalated or refused. With none listed, the answer says why:
the runner starts at the first `remediate` decision (idle until then), and remediations
need a policy with a `remediate` action and state kept in a file (not ':memory:').
"""


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
  waiting  the sidecar told it to go on (retry, resume, fallback) and when
  stalled  silent for longer than its service's rhythm allows (or idle_seconds)
           while open or told to go on
  paused   the sidecar paused it (for a person's answer, or a breaker) until a deadline
  ended    its root span ended, or it was aborted
--status and --service filter every tracked run. Run ids longer than
12 characters are shortened: --json and --output jsonl show them whole.
"""


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

    run = _verb(
        verbs,
        "run",
        "run the sidecar (OTLP receivers and control API)",
        _examples(
            "spanvisor run                               built-in policy, loopback ports",
            "spanvisor run --policy policy.yaml --config spanvisor.yaml",
            "SPANVISOR_API_PORT=4400 spanvisor run --observe",
            notes="every flag is also a SPANVISOR_* variable (SPANVISOR_HOST, SPANVISOR_API_PORT,\n"
            "SPANVISOR_LOG_LEVEL, ...); flags win over variables, variables over the settings\n"
            "file, the file over defaults. Spans are forwarded to OTEL_EXPORTER_OTLP_ENDPOINT.\n",
        ),
        description="Runs the sidecar in this process until SIGTERM or Ctrl-C: OTLP receivers\n"
        "(gRPC 4317, HTTP 4318) that judge the agents' spans, and the control API (4320)\n"
        "the operator verbs and agents ask. SIGHUP reloads the policy file.",
    )
    run.add_argument(
        "--config",
        type=Path,
        help=f"settings file (YAML; default: {CONFIG_ENV}); see config/spanvisor.yaml",
    )
    run.add_argument("--policy", type=Path, help="policy file (YAML); default: the built-in policy")
    run.add_argument(
        "--host",
        help="address for the OTLP receivers (default 127.0.0.1; beyond loopback needs otlp_token)",
    )
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
    run.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much the sidecar logs, as JSON lines on standard error (default INFO)",
    )

    init_verb.add_parser(verbs)

    validate = _verb(
        verbs,
        "validate",
        "check a policy file; exit 1 with every error",
        _examples(
            "spanvisor validate policy.yaml",
            notes="prints each error with its file, line and field path; checks the remediators\n"
            "the policy names too. Exit 0: valid; 1: errors.\n",
        ),
    )
    validate.add_argument("path", type=Path, help="the policy file (YAML)")

    rep = _verb(
        verbs,
        "replay",
        "classify the failures in recorded traces (OTLP/JSON lines or protobuf)",
        _examples(
            "spanvisor replay traces.jsonl",
            "spanvisor replay traces.jsonl --policy policy.yaml --output jsonl | jq .kind",
            notes="traces.jsonl as the OTel Collector's file exporter writes it. Nothing is sent\n"
            "to agents. Exit 1 when a record could not be read (each is named on stderr).\n",
        ),
    )
    rep.add_argument(
        "path", type=Path, help="OTLP/JSON lines, or 4-byte length-prefixed OTLP protobuf"
    )
    rep.add_argument("--policy", type=Path, help="policy file; default: the built-in policy")
    rep.add_argument(
        "--output",
        choices=["table", "jsonl"],
        default="table",
        help="table for a person (default), or jsonl: one JSON object per failure",
    )

    explain = _verb(
        verbs,
        "explain",
        "show the policy's rules, or why each failure in a file got its verdict",
        _examples(
            "spanvisor explain --policy policy.yaml      the classification rules, in order",
            "spanvisor explain traces.jsonl --span b7ad6b7169203331",
        ),
    )
    explain.add_argument("path", type=Path, nargs="?", help="recorded traces, as for replay")
    explain.add_argument("--policy", type=Path, help="policy file; default: the built-in policy")
    explain.add_argument("--span", help="only the failure at this span id (hex)")

    _verb(
        verbs,
        "schema",
        "print the policy file's JSON Schema (for editors)",
        _examples(
            "spanvisor schema > spanvisor-policy.schema.json",
            notes="then, with the YAML language server, the policy file's first line:\n"
            "  # yaml-language-server: $schema=spanvisor-policy.schema.json\n",
        ),
    )

    _add_demo(verbs)

    sidecar = _remote_options()
    remote = argparse.ArgumentParser(add_help=False, parents=[sidecar])
    remote.add_argument(
        "--output",
        choices=["table", "jsonl"],
        default="table",
        help="table for a person (default), or jsonl: one JSON object a line, for scripts",
    )

    incidents = _verb(
        verbs,
        "incidents",
        "list the incidents a running sidecar stored, and their decisions",
        _examples(
            "spanvisor incidents                          the latest 50",
            "spanvisor incidents --all                    every one kept, page after page",
            "spanvisor incidents --limit 200 --output jsonl",
            notes=ADDRESS_NOTE,
        ),
        parents=[remote],
    )
    incidents.add_argument(
        "--limit", type=int, default=50, help="show at most this many, newest first (default 50)"
    )

    approvals = _verb(
        verbs,
        "approvals",
        "list approval requests, or approve / deny one",
        _examples(
            "spanvisor approvals --status pending",
            'spanvisor approvals approve apr_1234 --note "key rotated"',
            "spanvisor approvals deny apr_1234 --by alice",
            notes=ADDRESS_NOTE,
        ),
        parents=[remote],
    )
    approvals.add_argument(
        "answer",
        nargs="?",
        choices=["list", "approve", "deny"],
        default="list",
        help="list (the default), approve ID or deny ID",
    )
    approvals.add_argument("id", nargs="?", help="the approval request's id (approve, deny)")
    approvals.add_argument(
        "--status",
        choices=["pending", "approved", "denied", "expired"],
        help="list only the requests in this state",
    )
    approvals.add_argument(
        "--by", default=os.environ.get("USER", "cli"), help="who answers (default: $USER)"
    )
    approvals.add_argument("--note", default="", help="why, for the record")

    breakers = _verb(
        verbs,
        "breakers",
        "list circuit breakers, or isolate / close one",
        _examples(
            "spanvisor breakers",
            "spanvisor breakers isolate openai:gpt-4o     stop calls to it until closed",
            "spanvisor breakers close openai:gpt-4o",
            notes=ADDRESS_NOTE,
        ),
        parents=[remote],
    )
    breakers.add_argument(
        "act",
        nargs="?",
        choices=["list", "isolate", "close"],
        default="list",
        help="list (the default), isolate DEPENDENCY or close DEPENDENCY",
    )
    breakers.add_argument("dependency", nargs="?", help="e.g. openai:gpt-4o (isolate, close)")

    _add_remediations(verbs, remote)
    _add_runs(verbs, remote)

    commands = _verb(
        verbs,
        "commands",
        "list commands sent to agents (--dead: dead letters)",
        _examples(
            "spanvisor commands --service checkout-agent",
            "spanvisor commands --dead --output jsonl",
            notes=ADDRESS_NOTE,
        ),
        parents=[remote],
    )
    commands.add_argument("--dead", action="store_true", help="only dead letters")
    commands.add_argument(
        "--service", help="only the commands for this service (its exact name; not with --dead)"
    )
    commands.add_argument(
        "--limit", type=int, default=50, help="show at most this many, newest first (default 50)"
    )

    for listing, limit in ((incidents, None), (approvals, 100), (breakers, 1000), (commands, None)):
        _add_paging(listing, limit=limit)

    _verb(
        verbs,
        "reload",
        "make a running sidecar reload its policy file",
        _examples(
            "spanvisor reload",
            "spanvisor reload --api http://10.0.0.5:4320",
            notes="a policy with errors is refused (exit 1, its errors on stderr) and the one in\n"
            "effect is kept. SIGHUP to `spanvisor run` does the same.\n" + ADDRESS_NOTE,
        ),
        parents=[sidecar],
    )
    return parser


def _verb(
    verbs: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    examples: str,
    *,
    description: str = "",
    parents: Sequence[argparse.ArgumentParser] = (),
) -> argparse.ArgumentParser:
    """A verb whose --help says what it does (``summary`` unless ``description``) and shows how."""
    return verbs.add_parser(
        name,
        parents=list(parents),
        help=summary,
        description=description or f"{summary[0].upper()}{summary[1:]}.",
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _remote_options() -> argparse.ArgumentParser:
    """--api, --token, --config: how every operator verb names the sidecar it asks."""
    sidecar = argparse.ArgumentParser(add_help=False)
    sidecar.add_argument(
        "--api",
        default=None,
        metavar="URL",
        help=f"the control API's URL (default: {API_URL_ENV}, else {API_HOST_ENV}/"
        f"{API_PORT_ENV} or the settings file's api_host/api_port, else {DEFAULT_API_URL})",
    )
    sidecar.add_argument(
        "--token",
        default=None,
        help=f"the API token (default: {TOKEN_ENV}, else api_token in the settings file, else"
        f" the token file: {TOKEN_FILE_ENV}, token_file in the settings file, or"
        " ~/.spanvisor/api-token)",
    )
    sidecar.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the sidecar's settings file, for its api_host, api_port, api_token and token_file"
        f" (default: {CONFIG_ENV})",
    )
    return sidecar


def _add_paging(verb: argparse.ArgumentParser, *, limit: int | None = None) -> None:
    """``--all`` for a list verb, and ``--limit`` (default ``limit``) when it has none yet."""
    if limit is not None:
        verb.add_argument(
            "--limit", type=int, default=limit, help=f"list at most this many (default {limit})"
        )
    verb.add_argument(
        "--all", action="store_true", help="list every one, page after page (ignores --limit)"
    )


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
        epilog=_examples(
            "spanvisor demo",
            "spanvisor demo --runs 12 --seed 3 --no-live   more runs, a line per event",
            notes="to see the same in Jaeger (OTLP/HTTP on 4318, UI on 16686):\n"
            "  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo\n"
            "the demo's sidecar forwards every span there, and sends its own.",
        ),
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
        epilog=REMEDIATIONS_EPILOG + ADDRESS_NOTE,
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
    _add_paging(remediations)
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
        epilog=RUNS_EPILOG + ADDRESS_NOTE,
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
    runs.add_argument("--limit", type=int, default=100, help="show at most this many (default 100)")
    _add_paging(runs)
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
    except sqlite3.DatabaseError as exc:  # damage found after the store's check at open
        print(
            f"spanvisor: a database failed: {exc}. If it is damaged: stop spanvisor, check"
            " it with sqlite3 FILE 'PRAGMA integrity_check', move it aside and rebuild it"
            " with sqlite3 FILE.damaged .recover | sqlite3 FILE (see 'A damaged state"
            " database' in docs/operations.md)",
            file=sys.stderr,
        )
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
        return local_verbs.run_sidecar(args)
    if verb == "init":
        return init_verb.init(args)
    if verb == "validate":
        return local_verbs.validate(args)
    if verb == "replay":
        return local_verbs.replay_traces(args)
    if verb == "explain":
        return local_verbs.explain(args)
    if verb == "schema":
        return local_verbs.schema()
    if verb == "demo":
        from supervisor.cli.demo import run_demo  # the demo pulls in the example agent's needs

        return run_demo(runs=args.runs, seed=args.seed, live=args.live, keep=args.keep)
    if verb == "incidents":
        return operator_verbs.incidents(args)
    if verb == "approvals":
        return operator_verbs.approvals(args)
    if verb == "breakers":
        return operator_verbs.breakers(args)
    if verb == "remediations":
        return operator_verbs.remediations(args)
    if verb == "runs":
        return operator_verbs.runs(args)
    if verb == "commands":
        return operator_verbs.commands(args)
    if verb == "reload":
        return operator_verbs.reload(args)
    raise AssertionError(f"unhandled verb {verb}")  # argparse rejects unknown verbs


if __name__ == "__main__":
    sys.exit(main())
