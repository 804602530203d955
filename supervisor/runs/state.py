"""One run's state, and how ``GET /v1/runs`` shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies import DetectorSettings, ModelInfo, RunSpend
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
        }


class RunState:
    """What the tracker keeps of one run; owned by :class:`~supervisor.runs.RunTracker`."""

    __slots__ = (
        "anchored",
        "by_trace",
        "errors",
        "go_on_at",
        "gone",
        "input_tokens",
        "last_dependency",
        "last_llm",
        "last_seen",
        "last_span",
        "llm_calls",
        "model",
        "model_info",
        "objective",
        "open",
        "output_tokens",
        "outputs",
        "pressured",
        "run_id",
        "service",
        "spans",
        "spend",
        "stalled",
        "started",
        "step",
        "tool_calls",
        "tools",
        "tools_since_llm",
        "trace",
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
        #: The run's turn has not ended (its root span has not arrived).
        self.open = True
        #: Left the tracker (evicted, expired, or folded into its session's run).
        self.gone = False
        self.stalled = False
        #: When the sidecar's command telling the run to go on after a failure may be
        #: delivered (0: none): a failed root keeps the run open, idle time counts from it.
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

    def fold(self, early: RunState) -> None:
        """Take in the counts of a trace's first spans, seen before it named its session."""
        self.started = min(self.started, early.started)
        self.spans += early.spans
        self.llm_calls += early.llm_calls
        self.tool_calls += early.tool_calls
        self.errors += early.errors
        self.input_tokens += early.input_tokens
        self.output_tokens += early.output_tokens
        if self.objective is None:
            self.objective = early.objective


def view(run: RunState, now: float, settings: DetectorSettings) -> RunView:
    idle = max(0.0, now - run.last_seen)
    if not run.open:
        status = "ended"
    elif run.stalled or (settings.stalls and idle >= settings.idle_seconds):
        status = "stalled"
    elif run.errors:
        status = "failing"
    else:
        status = "running"
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
    )
