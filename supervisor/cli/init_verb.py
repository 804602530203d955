"""``spanvisor init``: write a commented starting policy that ``spanvisor validate`` accepts.

The file holds only the knobs worth changing first (fallbacks, retries,
breakers, stalls, restart intensity, how long an escalation waits), each
with its built-in value and a comment: a policy file is layered on top of
the built-in policy, so everything it leaves out stays built in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["STARTER_POLICY", "add_parser", "init"]

DEFAULT_PATH = Path("spanvisor-policy.yaml")

STARTER_POLICY = """\
# spanvisor policy (format version 1), written by `spanvisor init`.
#
# Layered ON TOP of the built-in policy (policies/default_policy.yaml in the
# package): rules and decisions here are tried first, and everything this file
# leaves out stays built in. The values below are the built-in ones unless a
# comment says otherwise: change what your fleet needs, delete the rest.
#   spanvisor validate THIS_FILE     every problem, with its path and line
#   spanvisor schema                 the JSON Schema, for an editor
#   spanvisor run --policy THIS_FILE
version: 1

# Fallbacks, declared once: model or dependency (glob) -> ordered alternatives.
# Every decision that wants a fallback follows them: retries spent on a rate
# limit or an outage, an open breaker, a spent retry budget. Without one, an
# open breaker pauses the run and resumes it when the breaker half-opens.
# Write dependencies as the sidecar names them: "openai:gpt-4o", "tool:search".
fallbacks: {}
#  "openai:gpt-4o": ["openai:gpt-4o-mini", "anthropic:claude-haiku-4-5"]

# Decisions, tried before the built-in ones (first match wins). Names must not
# start with "builtin.". Two examples, as built in but for what they say:
policies:
  # Timeouts, dropped connections, 5xx: retried after at least 1 s (full jitter
  # up to 2 s, then 4 s, 8 s), then the fallbacks above, then a person.
  - name: my.transient_io
    match: {kind: [timeout, connection, unavailable]}
    action: retry
    max_attempts: 4
    wait: {type: exponential, multiplier: 2, min: 1, max: 30, jitter: full}
    on_exhausted: {action: fallback, on_exhausted: escalate}

  # What a person is asked about waits at most timeout_s; then on_timeout:
  # abort (the run is aborted) or resume (it goes on as if approved).
  - name: my.content_policy
    match: {kind: content_policy}
    action: escalate
    timeout_s: 3600
    on_timeout: abort

# A circuit breaker per dependency, shared by every run. Only transient
# failures count (429, 5xx, timeouts): a 401 or a 404 never opens it.
breakers:
  default:
    fail_max: 5              # transient failures in a row open it
    reset_timeout_s: 30      # then it stays open this long
    success_threshold: 2     # successful trial calls that close it again
    half_open_trials: 3      # trial calls admitted; runs paused behind it resume
    resume_spread_s: 30      # a few at first, the others over this window

# Retries of a dependency: at most this share of its calls in the window.
retry_budget: {ratio: 0.2, min_retries: 3, window_s: 10}

# A step that keeps failing: more than max_actions corrective actions for the
# same dependency in one run within period_s are escalated to a person.
restart_intensity:
  max_actions: 10
  period_s: 60
  timeout_s: 3600            # how long that escalation's pause waits
  on_timeout: abort

detectors:
  # A run silent for idle_multiple times the longest silence seen between its
  # (or its service's) spans, within min_idle_s..max_idle_s, is a stall
  # (resume_run). idle_seconds: N fixes the limit instead.
  stalls: {idle_multiple: 4, min_idle_s: 30, max_idle_s: 600}
  # The same tool call 3 times within the run's last 20 calls is a loop.
  loops: {repeats: 3, window: 20}
"""


def add_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``init`` verb and its help."""
    parser = verbs.add_parser(
        "init",
        help="write a commented starting policy file (validates as written)",
        description="Writes a starting policy: the knobs worth changing first (fallbacks,\n"
        "retries, breakers, restart intensity, how long an escalation waits, stall\n"
        "detection), each with its built-in value and a comment. The file is layered\n"
        "on the built-in policy, so whatever it leaves out stays built in.",
        epilog="examples:\n"
        f"  spanvisor init                      writes ./{DEFAULT_PATH}\n"
        "  spanvisor init policy.yaml --force  overwrites policy.yaml\n"
        "  spanvisor init - | less             prints it\n"
        "then: spanvisor validate policy.yaml; spanvisor run --policy policy.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path",
        nargs="?",
        default=str(DEFAULT_PATH),
        help=f"where to write it ('-': standard output; default ./{DEFAULT_PATH})",
    )
    parser.add_argument("--force", action="store_true", help="overwrite the file if it exists")


def init(args: argparse.Namespace) -> int:
    """Write the starting policy; 2 when the file exists and ``--force`` was not given."""
    if args.path == "-":
        sys.stdout.write(STARTER_POLICY)
        return 0
    path = Path(args.path)
    if path.exists() and not args.force:
        print(f"spanvisor: {path} exists; --force overwrites it", file=sys.stderr)
        return 2
    path.write_text(STARTER_POLICY, encoding="utf-8")
    print(f"wrote {path}; check it with: spanvisor validate {path}", file=sys.stderr)
    return 0
