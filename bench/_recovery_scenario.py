"""The recovery benchmark's scenario: which runs, which faults, and the fake model's answers.

One :class:`Scenario` is built from the command line in ``bench/recovery.py``
and handed, as JSON, to the fake provider process and to every agent worker,
so that all of them agree on it. Everything in it is a pure function of the
seed and the sizes, and the fake model's answer to a request is a pure
function of the scenario, the request and the time since the arm started:
every arm meets the same faults at the same logical calls.

What a request is, logically: the agent's system message names the run and
its *turn* (how many model answers the run's checkpointed state holds), so a
retry of a call, by whatever mechanism (tenacity, a LangGraph ``RetryPolicy``,
spanvisor's ``retry_step``, a resume after a crash), is the same logical call
``(run, turn)`` with a higher attempt number. Transient faults are drawn per
attempt from a hash of ``(seed, run, turn, attempt)``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: What the agent's system message carries; the fake parses it back.
HEADER = "bench-run: {run}; turn: {turn}; steps: {steps}"
_HEADER_RE = re.compile(r"bench-run: (?P<run>[\w.-]+); turn: (?P<turn>\d+); steps: (?P<steps>\d+)")
#: The side-effecting tool: one call per step, its effect keyed by (run, step).
STEP_TOOL = "do_step"
#: The read-only tool a looping model calls again and again with the same arguments.
LOOP_TOOL = "check_status"
_STEP_DONE_RE = re.compile(r"^step (\d+) done")
_STATUS_RE = re.compile(r"^status of order-(\d+):")
#: A user message that starts so is the run's task.
TASK_PREFIX = "Run "
#: A user message that starts so is guidance (the LangGraph adapter's notes); other
#: notes (unverified calls after a resume) are not.
GUIDANCE_PREFIXES = ("[spanvisor guidance]", "[guidance]")


def unit_hash(*parts: object) -> float:
    """A number in [0, 1) from the parts, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class Crash:
    """A worker process killed (SIGKILL) at ``at_s`` after the arm started."""

    at_s: float
    worker: int


@dataclass(frozen=True)
class Scenario:
    """Sizes, faults and schedule of one benchmark (the same for every arm)."""

    seed: int
    runs: int
    steps: int
    workers: int
    #: Seconds the side-effecting tool takes (the pace of a step; the model answers at once).
    tool_s: float
    #: Share of the tool's time that comes after the effect (waiting for the service's reply).
    after_effect: float
    transient_rate: float
    retry_after_s: float
    outage_start_s: float
    outage_s: float
    crashes: tuple[Crash, ...]
    sidecar_kill_s: float
    restart_delay_s: float
    primary: str = "gpt-4o"
    fallback: str = "gpt-4o-mini"
    #: run id -> (status, first step failing): 401 (auth) or 404 (model not found)
    permanent: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: run id -> the step at which the model starts looping
    loops: Mapping[str, int] = field(default_factory=dict)
    #: Runs start spread over this many seconds (a fleet does not start in one instant).
    stagger_s: float = 1.0

    # -- identity ------------------------------------------------------------------

    def run_ids(self) -> list[str]:
        return [run_id(i) for i in range(self.runs)]

    def worker_of(self, run: str) -> int:
        return run_index(run) % self.workers

    def runs_of(self, worker: int) -> list[str]:
        return [r for r in self.run_ids() if self.worker_of(r) == worker]

    def start_offset(self, run: str) -> float:
        """Seconds after the arm's start at which ``run`` starts."""
        return self.stagger_s * run_index(run) / max(1, self.runs)

    def recoverable(self, run: str) -> bool:
        """Whether the run can complete at all: every run but the permanently failing ones."""
        return run not in self.permanent

    @property
    def outage_end_s(self) -> float:
        return self.outage_start_s + self.outage_s

    def in_outage(self, rel_s: float) -> bool:
        return self.outage_start_s <= rel_s < self.outage_end_s

    def min_llm_calls(self) -> int:
        """Model calls a fault-free fleet makes: one per step, plus the final answer."""
        return self.runs * (self.steps + 1)

    # -- JSON ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["permanent"] = {k: list(v) for k, v in self.permanent.items()}
        data["loops"] = dict(self.loops)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Scenario:
        values = dict(data)
        values["crashes"] = tuple(Crash(**c) for c in values.get("crashes", ()))
        values["permanent"] = {k: (int(v[0]), int(v[1])) for k, v in values["permanent"].items()}
        values["loops"] = {k: int(v) for k, v in values["loops"].items()}
        return cls(**values)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def run_id(index: int) -> str:
    return f"run-{index:04d}"


def run_index(run: str) -> int:
    return int(run.rsplit("-", 1)[1])


def build(
    *,
    seed: int,
    runs: int,
    steps: int,
    workers: int,
    tool_s: float,
    outage_s: float,
    transient_rate: float = 0.05,
    retry_after_s: float = 1.0,
    restart_delay_s: float = 1.0,
    llm_s: float = 0.03,
) -> Scenario:
    """The scenario for these sizes: faults placed by the seed, events by the nominal length.

    The nominal length of a run is ``steps`` times the time a step takes
    without faults (the tool's time plus about ``llm_s`` of model call and
    framework). Events are placed in it: worker 0 killed at 15 %, the outage
    from 30 % (``outage_s`` long), worker 1 killed a second after the outage,
    the sidecar killed 9 s after that (arm d).
    """
    rng = random.Random(seed)
    ids = [run_id(i) for i in range(runs)]
    order = list(ids)
    rng.shuffle(order)
    each = max(1, runs // 100)  # "a few runs" fail for good: 1 per kind per 100 runs
    n_loops = max(1, runs // 20)
    if runs < 2 * each + n_loops + 1:
        raise ValueError(
            f"--runs {runs} is too few for the fault mix (need {2 * each + n_loops + 1})"
        )
    first_bad = max(1, steps // 10)  # early, before the outage
    permanent = dict.fromkeys(order[:each], (401, first_bad))
    permanent.update(dict.fromkeys(order[each : 2 * each], (404, first_bad)))
    loop_runs = order[2 * each : 2 * each + n_loops]
    low, high = max(1, steps // 4), max(2, (3 * steps) // 4)
    loops = {r: rng.randrange(low, high) for r in loop_runs}
    nominal = steps * (tool_s + llm_s)
    outage_start = 0.3 * nominal
    # Worker 1 dies a second after the outage; the sidecar 9 s later, once the
    # stall of worker 1's runs has been seen and acted on. The sidecar takes
    # seconds to serve again, and starts with an empty run table: a worker
    # crash while it is down, or just back, is another experiment (README).
    second_crash = outage_start + outage_s + 1.0
    sidecar_kill = second_crash + 9.0
    crashes: tuple[Crash, ...] = (Crash(round(0.15 * nominal, 2), 0),)
    if workers > 1:
        crashes += (Crash(round(second_crash, 2), 1),)
    return Scenario(
        seed=seed,
        runs=runs,
        steps=steps,
        workers=workers,
        tool_s=tool_s,
        after_effect=0.5,
        transient_rate=transient_rate,
        retry_after_s=retry_after_s,
        outage_start_s=round(outage_start, 2),
        outage_s=outage_s,
        crashes=crashes,
        sidecar_kill_s=round(sidecar_kill, 2),
        restart_delay_s=restart_delay_s,
        permanent=permanent,
        loops=loops,
    )


# -- the fake model ------------------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """What a chat request asks, as the fake model reads it."""

    run: str
    turn: int
    model: str
    #: The step the run is at: the next one to do (``steps``: all done).
    step: int
    #: Whether the last tool result was the loop tool's (the model is looping).
    looping: bool
    #: Whether the conversation holds guidance (a note of the supervisor's).
    guided: bool

    @property
    def key(self) -> str:
        """The logical call: retries of it have the same key."""
        return f"{self.run}/{self.turn}"


def read_request(body: Mapping[str, Any]) -> Asked | None:
    """The fake model's reading of an OpenAI chat request; None when it is not the bench's."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    header = None
    step = 0
    looping = False
    guided = False
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        text = _text(message.get("content"))
        if role == "system" and header is None:
            header = _HEADER_RE.search(text)
        elif role == "user" and text.startswith(GUIDANCE_PREFIXES):
            guided = True
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "tool":
            text = _text(message.get("content"))
            if (m := _STEP_DONE_RE.match(text)) is not None:
                step, looping = int(m.group(1)) + 1, False
            elif (m := _STATUS_RE.match(text)) is not None:
                step, looping = int(m.group(1)), True
            break
    if header is None:
        return None
    return Asked(
        run=header["run"],
        turn=int(header["turn"]),
        model=str(body.get("model") or ""),
        step=min(step, int(header["steps"])),
        looping=looping,
        guided=guided,
    )


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return ""


@dataclass(frozen=True)
class Verdict:
    """The fake model's decision for one request: a fault, or what the model says."""

    fault: str  # "" (success), "transient_429", "transient_503", "outage", "auth", "not_found"
    tool: str = ""  # the tool the model calls ("" with a text answer)
    arguments: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""


def decide(scenario: Scenario, asked: Asked, attempt: int, rel_s: float) -> Verdict:
    """What the fake answers to attempt ``attempt`` (1-based) of ``asked`` at ``rel_s``."""
    bad = scenario.permanent.get(asked.run)
    if bad is not None and asked.step >= bad[1]:
        return Verdict("auth" if bad[0] == 401 else "not_found")
    if asked.model == scenario.primary and scenario.in_outage(rel_s):
        return Verdict("outage")
    draw = unit_hash(scenario.seed, asked.run, asked.turn, attempt)
    if draw < scenario.transient_rate:
        half = unit_hash(scenario.seed, "kind", asked.run, asked.turn, attempt) < 0.5
        return Verdict("transient_429" if half else "transient_503")
    loop_at = scenario.loops.get(asked.run)
    if loop_at is not None and asked.step == loop_at and not asked.guided:
        return Verdict("", LOOP_TOOL, {"item": f"order-{asked.step}"})
    if asked.step < scenario.steps:
        return Verdict("", STEP_TOOL, {"step": asked.step})
    return Verdict("", text=f"All {scenario.steps} steps of {asked.run} are done.")


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of ``path`` (a line cut by a kill is skipped)."""
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
