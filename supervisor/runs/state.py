"""One run's state, and how ``GET /v1/runs`` shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies import ModelInfo, RunSpend
from supervisor.runs.loops import RecentCalls

__all__ = ["RunState", "RunView", "view"]


@dataclass(frozen=True, slots=True)
class RunView:
    """One run as ``GET /v1/runs`` and ``spanvisor runs`` show it."""

    run_id: str
    service: str
    status: str
    started_at: float
    last_seen_at: float
    idle_s: float
    spans: int
    llm_calls: int
    tool_calls: int
    errors: int
    input_tokens: int
    output_tokens: int
    step: str
    spans_per_minute: float
    #: The run's spend in USD from its token usage (None: no priced call yet).
    cost_usd: float | None = None
    #: Some calls were of models without a price: ``cost_usd`` is a lower bound.
    cost_partial: bool = False
    #: Where its spend is headed against its budget, from its recent burn rate
    #: (:meth:`policies.Forecast.to_json`; None: no budget, or no call yet).
    forecast: dict[str, object] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "service": self.service,
            "status": self.status,
            "started_at": self.started_at,
            "last_seen_at": self.last_seen_at,
            "idle_s": round(self.idle_s, 3),
            "spans": self.spans,
            "llm_calls": self.llm_calls,
            "tool_calls": self.tool_calls,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "step": self.step,
            "spans_per_minute": round(self.spans_per_minute, 2),
            "cost_usd": None if self.cost_usd is None else round(self.cost_usd, 6),
            "cost_partial": self.cost_partial,
            "forecast": self.forecast,
        }


class RunState:
    """What the tracker keeps of one run; owned by :class:`~supervisor.runs.RunTracker`."""

    __slots__ = (
        "anchored",
        "by_trace",
        "ended_at",
        "ended_traces",
        "errors",
        "failed",
        "gap",
        "go_on_at",
        "gone",
        "input_tokens",
        "journaled",
        "last_dependency",
        "last_llm",
        "last_seen",
        "last_span",
        "llm_calls",
        "model",
        "model_info",
        "objective",
        "on_timeout",
        "output_tokens",
        "outputs",
        "paused_for",
        "paused_until",
        "phase",
        "pressured",
        "run_id",
        "service",
        "service_stopped",
        "spans",
        "spend",
        "stalled",
        "started",
        "step",
        "tool_calls",
        "tools",
        "tools_since_llm",
        "trace",
        "unverified",
    )

    def __init__(self, run_id: str, service: str, trace: bytes, now: float) -> None:
        #: The run: its session, or its trace id in hex.
        self.run_id = run_id
        #: Keyed by its trace: a later span of the trace may still name a session.
        self.by_trace = False
        self.service = service
        #: The trace of the run's latest span.
        self.trace = trace
        self.started = now
        self.last_seen = now
        self.last_span = b""
        self.last_dependency = ""
        #: The name of the last call (LLM or tool): where the run is.
        self.step = ""
        self.spans = 0
        self.llm_calls = 0
        self.tool_calls = 0
        self.errors = 0
        self.input_tokens = 0
        self.output_tokens = 0
        #: Where the run is in its life (:mod:`supervisor.runs.phase` moves it, and says
        #: what each phase means): open, waiting, paused or ended.
        self.phase = "open"
        #: Its last turn ended in error, or it was aborted (what an SLO counts).
        self.failed = False
        #: When it last ended (0: never).
        self.ended_at = 0.0
        #: Traces whose root span arrived -> whether it succeeded (a session's turns; bounded).
        self.ended_traces: dict[bytes, bool] | None = None
        #: A pause's deadline, what follows it (resume | abort), and what it waits for.
        self.paused_until = 0.0
        self.on_timeout = "abort"
        self.paused_for = ""
        #: The longest silence between two of its requests while open (seconds): its rhythm.
        self.gap = 0.0
        #: The unverified work a sidecar before a restart had listed (None: not restored).
        self.unverified: tuple[str, ...] | None = None
        #: What the journal holds of it: (phase, go_on_at, paused_until, stalled) and its
        #: last span's time; None: not in the journal.
        self.journaled: tuple[tuple[str, float, float, bool], float] | None = None
        #: Left the tracker (evicted, expired, or folded into its session's run).
        self.gone = False
        self.stalled = False
        #: When the sidecar's command telling the run to go on may be delivered (0: none).
        self.go_on_at = 0.0
        self.pressured = False
        #: The run's first input as text (bounded), for re-anchoring: "" when its service
        #: did not re-anchor when it came. Steps when last re-anchored.
        self.objective: str | None = None
        self.anchored = 0
        #: The last LLM dependency called and its table entry (runs call one model, mostly).
        self.model = ""
        self.model_info: ModelInfo | None = None
        #: Recent tool calls and LLM outputs, for loops (made at the first of each).
        self.tools: RecentCalls | None = None
        self.outputs: RecentCalls | None = None
        #: What names the tool calls the last LLM response asked for (encoded values).
        self.last_llm: dict[str, bytes] | None = None
        #: Tools called since the last LLM response, as ``tool:<name>`` (at most 64; made
        #: when the first is: most runs never need it).
        self.tools_since_llm: list[str] | None = None
        #: Tokens and cost so far, from the first call with usage.
        self.spend: RunSpend | None = None
        #: Reported once for its service's budget (see :mod:`.spend`).
        self.service_stopped = False

    def fold(self, early: RunState) -> None:
        """Take in the counts of a trace's first spans, seen before it named its session."""
        self.started = min(self.started, early.started)
        self.spans += early.spans
        self.llm_calls += early.llm_calls
        self.tool_calls += early.tool_calls
        self.errors += early.errors
        self.input_tokens += early.input_tokens
        self.output_tokens += early.output_tokens
        self.gap = max(self.gap, early.gap)
        if self.objective is None:
            self.objective = early.objective


def view(run: RunState, now: float, status: str) -> RunView:
    """The run as listed; ``status`` from :func:`supervisor.runs.phase.status`."""
    idle = max(0.0, now - run.last_seen)
    minutes = max((run.last_seen - run.started) / 60.0, 1 / 60)
    spend = run.spend
    return RunView(
        run_id=run.run_id,
        service=run.service,
        status=status,
        started_at=run.started,
        last_seen_at=run.last_seen,
        idle_s=idle,
        spans=run.spans,
        llm_calls=run.llm_calls,
        tool_calls=run.tool_calls,
        errors=run.errors,
        input_tokens=run.input_tokens,
        output_tokens=run.output_tokens,
        step=run.step[:128],
        spans_per_minute=run.spans / minutes,
        cost_usd=spend.cost_usd if spend is not None and spend.calls else None,
        cost_partial=spend.partial if spend is not None else False,
        forecast=_outlook(spend),
    )


def _outlook(spend: RunSpend | None) -> dict[str, object] | None:
    found = spend.outlook() if spend is not None else None
    return found.to_json() if found is not None else None
