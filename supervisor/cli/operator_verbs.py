"""The operator verbs: what they ask a running sidecar's control API, and what they print.

``incidents``, ``approvals``, ``breakers``, ``remediations``, ``runs``
(``--watch``), ``commands`` and ``reload``, each through :func:`api`, which
finds the API's address and token (:mod:`supervisor.api_access`, as the
agent-side client does) and turns any refusal into a :class:`ConfigError`
(exit code 2) naming the sidecar asked, how its address was chosen and where
the token came from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any
from urllib.parse import quote

import httpx

from supervisor.api_access import resolve_access
from supervisor.cli.output import (
    aligned,
    format_age,
    one_line,
    print_jsonl,
    print_remediation,
    print_table,
    run_row,
    runs_footer,
    slo_lines,
)
from supervisor.errors import ConfigError

#: Clears a terminal and puts the cursor home: ``--watch`` redraws over its last table.
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def api(
    args: argparse.Namespace,
    method: str,
    path: str,
    *,
    params: dict[str, object] | None = None,
    body: dict[str, object] | None = None,
) -> dict[str, Any]:
    """Call the running sidecar's control API; ConfigError with its message on any refusal."""
    access = resolve_access(args.api, args.token, config=args.config)
    if not access.token:
        raise ConfigError(access.missing_token())
    try:
        response = httpx.request(
            method,
            f"{access.url}{path}",
            params={k: v for k, v in (params or {}).items() if v is not None},  # type: ignore[misc]
            json=body,
            headers={"Authorization": f"Bearer {access.token}"},
            timeout=10,
            trust_env=False,
        )
    except httpx.HTTPError as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ConfigError(access.unreachable(why)) from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": response.text[:200]}
    if not isinstance(answer, dict):
        answer = {"error": response.text[:200]}
    if response.status_code in (401, 403):
        raise ConfigError(access.refused(response.status_code, str(answer.get("error") or "")))
    if response.status_code != 200:
        raise ConfigError(
            f"{access.sidecar} answered {response.status_code}: {answer.get('error')}"
        )
    return answer


#: The most items the control API answers in one page.
PAGE_LIMIT = 1000


def listed(
    args: argparse.Namespace, path: str, key: str, params: dict[str, object] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Items of the list at ``path``: ``--limit`` of them (following pages past the API's
    1,000 a page) or, with ``--all``, every one; and the last page's answer.

    When more are left, stderr says so (stdout stays the list, for scripts).
    """
    wanted: int | None = None if getattr(args, "all", False) else args.limit
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        size = PAGE_LIMIT if wanted is None else min(PAGE_LIMIT, wanted - len(items))
        answer = api(args, "GET", path, params={**(params or {}), "limit": size, "cursor": cursor})
        items += answer.get(key) or []
        cursor = answer.get("next_cursor")
        if not cursor or (wanted is not None and len(items) >= wanted):  # (the API refuses < 1)
            break
    if cursor:
        print(
            f"spanvisor: the first {len(items)} shown; more with --limit N or --all",
            file=sys.stderr,
        )
    return items, answer


def incidents(args: argparse.Namespace) -> int:
    """The stored incidents, newest first: what the store kept, across restarts."""
    failures, _ = listed(args, "/v1/incidents", "incidents")
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


def approvals(args: argparse.Namespace) -> int:
    if args.answer in ("approve", "deny"):
        if not args.id:
            raise ConfigError(f"approvals {args.answer} needs the request's id")
        answered = api(
            args,
            "POST",
            f"/v1/approvals/{quote(args.id, safe='')}/{args.answer}",
            body={"by": args.by, "note": args.note},
        )
        print(f"{answered['id']}: {answered['status']} by {answered['answered_by']}")
        return 0
    found, _ = listed(args, "/v1/approvals", "approvals", {"status": args.status})
    if args.output == "jsonl":
        print_jsonl(found)
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


def breakers(args: argparse.Namespace) -> int:
    if args.act in ("isolate", "close"):
        if not args.dependency:
            raise ConfigError(f"breakers {args.act} needs a dependency, e.g. openai:gpt-4o")
        path = f"/v1/breakers/{quote(args.dependency, safe=':')}/{args.act}"
        changed = api(args, "POST", path)
        print(f"{changed['dependency']}: {changed['state']}")
        return 0
    found, answer = listed(args, "/v1/breakers", "breakers")
    if answer.get("why"):  # a local list where a fleet's was meant (Redis away): said aside
        print(f"spanvisor: {answer['why']}", file=sys.stderr)
    if args.output == "jsonl":
        print_jsonl(found)
        return 0
    print(f"{'DEPENDENCY':40}  {'STATE':9}  {'FAILURES':8}  REOPENS IN")
    now = time.time()
    for b in found:
        reopens = b.get("reopens_at")
        due = "" if reopens is None else f"{max(0.0, reopens - now):.0f}s"
        print(f"{b['dependency'][:40]:40}  {b['state']:9}  {b['failures']:8}  {due}")
    return 0


def remediations(args: argparse.Namespace) -> int:
    if args.act in ("show", "cancel"):
        if not args.id:
            raise ConfigError(
                f"remediations {args.act} needs the remediation's id (see `spanvisor remediations`)"
            )
        path = f"/v1/remediations/{quote(args.id, safe='')}"
        if args.act == "cancel":
            answer = api(args, "POST", f"{path}/cancel")
            if args.json:
                print(json.dumps(answer, indent=2, sort_keys=True))
            else:
                state = "cancelled" if answer.get("cancelled") else "not cancelled"
                print(f"{answer.get('id', args.id)}: {state}")
            return 0
        shown = api(args, "GET", path)
        if args.json:
            print(json.dumps(shown, indent=2, sort_keys=True))
        else:
            print_remediation(shown)
        return 0
    if args.id:
        raise ConfigError("remediations list takes no id: use `remediations show ID`")
    found, answer = listed(args, "/v1/remediations", "remediations", {"status": args.status})
    if args.json:
        print(json.dumps({**answer, "remediations": found}, indent=2, sort_keys=True))
        return 0
    if args.output == "jsonl":
        print_jsonl(found)
        return 0
    if not answer.get("running", True):
        # What is the case, as the sidecar says it: not started yet, no `remediate`
        # action in the policy, no database, or a start that failed.
        print(one_line(answer.get("why") or "remediations are not running on this sidecar", 300))
        return 0
    if not found:
        print("no remediations" + (f" in state {args.status}" if args.status else ""))
        return 0
    # The list answer names no remediator today; show the column once it does.
    named = [r.get("remediator") or (r.get("request") or {}).get("remediator") for r in found]
    header = [
        "ID",
        "STATUS",
        "OUTCOME",
        *(["REMEDIATOR"] if any(named) else []),
        "INSTANCE",  # which sidecar runs it (a fleet shares one list)
        "AGE",
        "TRACE",
    ]
    rows = [
        [
            r.get("id"),
            r.get("status"),
            r.get("outcome") or "-",
            *([name or "-"] if any(named) else []),
            r.get("executor_id") or "-",
            format_age(r.get("created_at")),
            r.get("trace_id") or "-",
        ]
        for r, name in zip(found, named, strict=True)
    ]
    print_table(header, rows)
    return 0


def runs(args: argparse.Namespace) -> int:
    """``spanvisor runs``: one table, or ``--watch``: one every N seconds until Ctrl-C."""
    params: dict[str, object] = {
        "status": args.status,
        "service": args.service,
        "limit": args.limit,
    }
    if args.watch is None:
        found, last = listed(args, "/v1/runs", "runs", params)
        _print_runs(args, {**last, "runs": found}, fit_screen=False)
        return 0
    # Redraw in place on a terminal; anywhere else (a file, a pipe), append each
    # table after a blank line. JSON is a stream of answers, one a line, never cleared.
    redraw = sys.stdout.isatty() and not args.json and args.output == "table"
    shown = 0
    try:
        while True:
            try:
                answer: dict[str, Any] | None = api(args, "GET", "/v1/runs", params=params)
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
        print_jsonl(found)
        return
    if not answer.get("tracking", True):
        print("this sidecar does not track runs")
        return
    stats: dict[str, Any] = answer.get("stats") or {}
    if not found:
        wanted = [f"status {args.status}"] if args.status else []
        wanted += [f"service {one_line(args.service)}"] if args.service else []
        print("no runs" + (" with " + " and ".join(wanted) if wanted else ""))
    else:
        header = ["RUN", "SERVICE", "STATUS", "AGE", "IDLE", "SPANS", "LLM", "TOOLS", "ERR"]
        header += ["TOKENS", "RATE", "STEP"]
        rows = [run_row(run) for run in found]
        more = 0
        if fit_screen:
            room = max(1, shutil.get_terminal_size().lines - 4)  # title, header, footer, prompt
            if len(rows) > room:
                rows, more = rows[: room - 1], len(rows) - (room - 1)
        for line in aligned(header, rows, right=range(3, 11)):
            print(line)
        if more:
            print(f"… and {more} more: narrow with --status, --service or --limit")
    if isinstance(stats.get("tracked"), int):
        print(runs_footer(len(found), stats))
    slo = answer.get("slo")
    if isinstance(slo, dict) and slo:
        print()
        for line in slo_lines(slo):
            print(line)


def commands(args: argparse.Namespace) -> int:
    if args.dead:
        found, _ = listed(args, "/v1/dead-letters", "dead_letters")
    else:
        found, _ = listed(args, "/v1/commands/log", "commands", {"service": args.service})
    if args.output == "jsonl":
        print_jsonl(found)
        return 0
    print(f"{'ID':28}  {'TYPE':16}  {'STATUS':9}  {'SERVICE':16}  {'TRIES':5}  LAST ERROR")
    for c in found:
        print(
            f"{c['id']:28}  {c['type']:16}  {c['status']:9}  {c['service'][:16]:16}  "
            f"{c['attempts']:5}  {c['last_error'][:60]}"
        )
    return 0


def reload(args: argparse.Namespace) -> int:
    """Make the sidecar reload its policy file; 1 when it could not."""
    answer = api(args, "POST", "/v1/policy/reload")
    if not answer.get("reloaded"):
        print(f"spanvisor: policy not reloaded: {answer.get('error')}", file=sys.stderr)
        return 1
    print(f"policy reloaded from {answer.get('source')}")
    return 0
