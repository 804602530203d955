"""Each run's progress, and the detectors that need it: reasoning loops and stalls.

A run is a trace, or the session it names (``gen_ai.conversation.id``,
``session.id``, OpenLLMetry's association properties). The tracker sees every
span once, on the wire (:meth:`RunTracker.observe`, from the pipeline's first
pass), and reads only what it needs from the encoded attributes: the session,
the dependency (already known), token counts on LLM spans, and a hash of the
raw bytes of a tool call's arguments or an LLM's output. Hashing raw bytes
rather than canonical JSON keeps the per-span cost to a dictionary update;
an agent that repeats a call serializes it the same way each time.

* **Loops**: the same tool with the same argument bytes ``repeats`` times
  within the run's last ``window`` tool calls, or the same LLM output
  ``repeats`` times within its last ``window`` LLM calls, is one detection,
  reported at the first repeated call (the second of them). A loop that goes
  on after it was reported (the agent ignored the guidance) is reported again
  once the call has been made ``repeats - 1`` more times, at most ``MAX_LOOP_REPORTS``
  times per call, each with its ``occurrence``: the loop breaker escalates
  from guidance to rewinding the run to aborting it on these.
* **Stalls**: a run whose root span has not ended and that has had no span for
  ``idle_seconds`` (per service) is one detection per silence, from a timer
  (:meth:`RunTracker.stalled`, with an injectable clock); it lists the tool
  calls the last LLM response asked for that no tool span answered, the work
  whose effects are unverified.

Bounded: at most ``max_runs`` runs (the least recently active is evicted),
and runs idle for ``max_idle_s`` are dropped; both are counted.

Lifecycle: built by the pipeline's owner; :meth:`observe` and
:meth:`failed` from the pipeline's thread; :meth:`stalled`, :meth:`snapshot`
from the same thread (the event loop), never concurrently.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from policies import DetectorSettings, ModelInfo, ModelTable, RunSpend, SloSpec, SloTracker
from supervisor.normalize.screen import (
    FIRST_TOOL_CALL,
    INPUT_TOKEN_KEYS,
    LLM_OUTPUT_KEYS,
    OBJECTIVE_KEYS,
    OUTPUT_TOKEN_KEYS,
    REQUEST_MARKERS,
    SESSION_KEYS,
    TOOL_ARGUMENT_KEYS,
    WireSpan,
)
from supervisor.normalize.walk import identity_of
from supervisor.normalize.wire import RawAttributes, raw_value, value_of

__all__ = [
    "Detection",
    "RunTracker",
    "RunView",
    "requested_calls",
]

_MAX_KEPT_BYTES: Final = 16 * 1024
_MAX_SERVICES: Final = 1024


@dataclass(frozen=True, slots=True)
class Detection:
    """What a run detector found at one span: a failure to classify and decide on."""

    kind: str
    failure_class: str
    rule: str
    run_id: str
    service: str
    trace_id: str
    #: Where the failure is reported (a loop: its first repeated call).
    span_id: str
    span_name: str
    #: ``tool:<name>`` or the LLM's ``provider:model``.
    dependency: str
    message: str
    details: Mapping[str, Any]
    #: The failing role when it is not the dependency's (a stall: the agent's).
    role: str = ""


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


_SESSION_MARK: Final = b"\x00session"
_MAX_SESSION_BYTES: Final = 512
#: The rules that run detectors report under (policies match on them like any other).
LOOP_RULE: Final = "builtin.detect.reasoning_loop"
STALL_RULE: Final = "builtin.detect.stall"
PRESSURE_RULE: Final = "builtin.detect.context_pressure"
BUDGET_RULE: Final = "builtin.detect.run_budget"
CASCADE_RULE: Final = "builtin.detect.cascade"
REANCHOR_RULE: Final = "builtin.detect.reanchor"
#: Longest objective carried in a re-anchoring command (characters).
_MAX_OBJECTIVE: Final = 2000
#: Dependencies whose model table entry is remembered (then forgotten at once).
_MAX_MODELS_MEMO: Final = 4096
#: How many times one looping call is reported in a run (guidance, rewind, abort).
MAX_LOOP_REPORTS: Final = 3
_SAME_CALL: Final = "the same tool call"
_SAME_OUTPUT: Final = "the same LLM output"
_REQUEST_MARKERS: Final[tuple[str, ...]] = tuple(REQUEST_MARKERS)
#: OpenInference's tool calls, probed in order: message n, call m.
_OI_CALL: Final = "llm.output_messages.{n}.message.tool_calls.{m}.tool_call.function.{field}"
_MAX_PROBED: Final = 8
_INT_TAG: Final = 0x18
_OI_ROLE: Final = "llm.output_messages.0.message.role"
_MESSAGES: Final = "gen_ai.output.messages"
#: LLM_OUTPUT_KEYS but the message list, which is read once for both uses.
_LLM_TEXT_KEYS: Final = tuple(k for k in LLM_OUTPUT_KEYS if k != _MESSAGES)
#: OpenInference tool-call keys, [message][call] -> (name key, arguments key).
_OI_KEYS: Final = tuple(
    tuple(
        (
            _OI_CALL.format(n=n, m=m, field="name"),
            _OI_CALL.format(n=n, m=m, field="arguments"),
        )
        for m in range(_MAX_PROBED)
    )
    for n in range(1)
)


def _repeated(
    run: _Run,
    digest: int,
    instance: int,
    *,
    tool: bool,
    span_id: bytes,
    name: str,
    repeats: int,
    window: int,
    span: Any,
    now_ns: int,
) -> tuple[bytes, str, int] | None:
    """Count one call in its run; (where its first repeat was, its name, occurrence) at ``repeats``.

    Per (dependency, digest), where it was seen among the run's last
    ``window`` calls of its kind (``tool``: tool calls, else LLM outputs),
    one entry per distinct call in the run's table of that kind. A call seen
    once (the usual case) is one integer, its sequence number and its 32-bit
    instance packed together: no container for the garbage collector to
    count, and below 2**62, a machine integer to the compiled code. A call
    that repeats becomes a flat list ``[first repeat or None, seq, instance,
    seq, instance...]`` of its last ``repeats - 1`` occurrences, each
    instance tagged above 32 bits so that it never equals a sequence number
    (a run would need 4 billion calls); a new occurrence counts those still
    in the window. O(1) per call; entries out of the window are pruned when
    the table grows past a few windows' worth. The tables and counters are
    the run's own fields, not an object of their own: runs are made and
    evicted every few spans of a busy sidecar, and each object a run holds is
    allocated, traversed by young collections and freed with it.

    ``instance`` tells calls apart: the span id's hash (a span re-sent by an
    exporter is not a repeat), or for an LLM call its prompt's size (the
    same prompt answered again is a retry, not a loop). After a report, only
    calls that started after it count towards the next: calls made before
    the agent could be told (a backlog exported at once) are not evidence
    that it ignored what it was told.
    """
    reported = run.loops_reported
    if reported is not None:
        last = reported.get(digest)
        if last is not None and span.start_time_unix_nano < last[1]:
            return None
    seen = run.tools_seen if tool else run.outputs_seen
    if seen is None:
        seen = _new_table(run, tool, {})
    seq = (run.tool_seq if tool else run.output_seq) + 1
    found = seen.get(digest)
    if found is None:  # the usual case: a call not made lately
        if len(seen) >= 4 * window:
            pruned = {k: v for k, v in seen.items() if _last_seq(v) > seq - window}
            seen = _new_table(run, tool, pruned)
        seen[digest] = (seq << _INSTANCE_BITS) | instance
        _counted(run, tool, seq)
        return None
    tagged = instance | _TAG
    if isinstance(found, int):
        if found & _INSTANCE_MASK == instance:
            return None  # the same call again (a re-sent span): nothing changes
        # Repeated: counted in place from now on.
        entry: list[Any] = [None, found >> _INSTANCE_BITS, (found & _INSTANCE_MASK) | _TAG]
        seen[digest] = entry
    else:
        entry = found
        if tagged in entry:
            return None
    _counted(run, tool, seq)
    oldest = seq - window
    while len(entry) > 1 and entry[1] <= oldest:
        del entry[1:3]
    if len(entry) == 1:
        entry[0] = None  # what was seen fell out of the window: start again
    elif entry[0] is None:
        entry[0] = (span_id, name)  # this call is the first repeat
    entry.append(seq)
    entry.append(tagged)
    count = (len(entry) - 1) // 2
    if count > repeats - 1 and count > 1:
        del entry[1:3]
    first: tuple[bytes, str] | None = entry[0]
    if count < repeats or first is None:
        return None
    if reported is None:
        reported = run.loops_reported = {}
    previous = reported.get(digest)
    occurrence = 1 if previous is None else previous[0] + 1
    if occurrence > MAX_LOOP_REPORTS or (occurrence == 1 and len(reported) >= 256):
        return None
    reported[digest] = (occurrence, now_ns)
    # Count again from here: a loop that goes on is reported after as many repeats.
    seen[digest] = (seq << _INSTANCE_BITS) | instance
    return first[0], first[1], occurrence


def _new_table(
    run: _Run, tool: bool, seen: dict[int, int | list[Any]]
) -> dict[int, int | list[Any]]:
    if tool:
        run.tools_seen = seen
    else:
        run.outputs_seen = seen
    return seen


def _counted(run: _Run, tool: bool, seq: int) -> None:
    if tool:
        run.tool_seq = seq
    else:
        run.output_seq = seq


#: What tells two calls with the same digest apart (see ``_repeated``): 32 bits of the
#: span id's hash, or of the prompt's token count. Two spans of a call that agree on
#: them (1 in 4 billion) count as one.
_INSTANCE_BITS: Final = 32
_INSTANCE_MASK: Final = (1 << _INSTANCE_BITS) - 1
#: Set on the instances of a repeated call's list: above any instance, so an
#: instance is never taken for one of the sequence numbers beside it.
_TAG: Final = 1 << _INSTANCE_BITS


def _last_seq(entry: int | list[Any]) -> int:
    if isinstance(entry, int):
        return entry >> _INSTANCE_BITS
    last: int = entry[-2]
    return last


class _Shape:
    """Which of the keys the tracker reads a span carries, worked out from its ``present``.

    Spans of one kind carry the same watched keys, and the wire path interns
    their ``present`` set: the tracker looks the set up once per span instead
    of testing a dozen keys against it (a set lookup each: a seventh of its
    instructions per span). Each ``*_key`` is the first of its keys present,
    as the set holds it: the walker interns keys, so the span's attribute
    dict holds that very string, and looking it up compares no characters.
    """

    __slots__ = (
        "input_tokens_key",
        "llm_text_key",
        "messages_key",
        "objective_key",
        "output_tokens_key",
        "requests",
        "session_keys",
        "tool_arguments_key",
    )

    def __init__(self, present: frozenset[str]) -> None:
        self.session_keys = tuple(_own(present, key) for key in SESSION_KEYS if key in present)
        self.objective_key = _first_key(present, OBJECTIVE_KEYS)
        self.tool_arguments_key = _first_key(present, TOOL_ARGUMENT_KEYS)
        self.input_tokens_key = _first_key(present, INPUT_TOKEN_KEYS)
        self.output_tokens_key = _first_key(present, OUTPUT_TOKEN_KEYS)
        self.llm_text_key = _first_key(present, _LLM_TEXT_KEYS)
        self.messages_key = _first_key(present, (_MESSAGES,))
        self.requests = _any_of(_REQUEST_MARKERS, present)


#: Distinct ``present`` sets whose shape is remembered (then forgotten at once).
_MAX_SHAPES: Final = 4096


class _Run:
    __slots__ = (
        "anchored",
        "batch",
        "errors",
        "go_on_at",
        "gone",
        "input_tokens",
        "key",
        "last_dependency",
        "last_llm",
        "last_seen",
        "last_span",
        "llm_calls",
        "loops_reported",
        "model",
        "model_info",
        "objective",
        "open",
        "output_seq",
        "output_tokens",
        "outputs_seen",
        "pressured",
        "service",
        "spans",
        "spend",
        "stalled",
        "started",
        "step",
        "tool_calls",
        "tool_seq",
        "tools_seen",
        "tools_since_llm",
        "trace",
    )

    def __init__(self, key: bytes, service: str, trace: bytes, now: float) -> None:
        #: Recent tool calls and LLM outputs, for loops (see ``_repeated``): digest ->
        #: seq << 32 | instance, or [first repeat, seq, instance, ...] once repeated.
        self.tools_seen: dict[int, int | list[Any]] | None = None
        self.outputs_seen: dict[int, int | list[Any]] | None = None
        #: digest -> (times reported, when last: Unix ns)
        self.loops_reported: dict[int, tuple[int, int]] | None = None
        #: Tools called since the last LLM response, as ``tool:<name>`` (made when the
        #: first is: most runs never need it).
        self.tools_since_llm: list[str] | None = None
        #: Tokens and cost so far (policies.RunSpend), from the first call with usage.
        self.spend: RunSpend | None = None
        #: The batch whose cache last held it (see ``RunTracker._run_for``).
        self.batch = 0
        self.begin(key, service, trace, now)

    def begin(self, key: bytes, service: str, trace: bytes, now: float) -> None:
        """Start as a new run: every field as a new run's, containers emptied, not dropped.

        An evicted run is begun again as the run that evicted it: with a full
        table one run is made every few spans of a busy sidecar, and a run
        made anew is half a dozen objects allocated, traversed by each young
        collection while young, and freed cold when evicted. Begun again,
        they are old objects, reused.
        """
        self.key = key
        self.service = service
        self.trace = trace
        self.started = now
        self.last_seen = now
        self.last_span = b""
        self.last_dependency = ""
        self.step = ""
        self.spans = 0
        self.llm_calls = 0
        self.tool_calls = 0
        self.errors = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.open = True
        self.stalled = False
        #: Evicted or expired: the batch's run cache may still hold it, and must not use it.
        self.gone = False
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
        #: Tool calls and LLM outputs counted in the loop tables.
        self.tool_seq = 0
        self.output_seq = 0
        #: What names the tool calls the last LLM response asked for (raw values).
        self.last_llm: dict[str, bytes] | None = None
        if self.tools_seen is not None:
            self.tools_seen.clear()
        if self.outputs_seen is not None:
            self.outputs_seen.clear()
        if self.loops_reported is not None:
            self.loops_reported.clear()
        if self.tools_since_llm is not None:
            self.tools_since_llm.clear()
        if self.spend is not None:
            self.spend.clear()

    @property
    def run_id(self) -> str:
        key = self.key
        if key.endswith(_SESSION_MARK):
            session = value_of(key[: -len(_SESSION_MARK)])
            return session[:256] if isinstance(session, str) else key.hex()
        return key.hex()


class RunTracker:
    """Per-run state for every span; see the module docstring."""

    def __init__(
        self,
        *,
        settings: Callable[[str], DetectorSettings] = lambda service: DetectorSettings(),
        models: ModelTable | None = None,
        slo: SloSpec | None = None,
        max_runs: int = 10_000,
        max_idle_s: float = 6 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        #: Context windows and prices (None: no context pressure, no budgets, no cost).
        self.models = models
        #: (the table, dependency -> its entry): the table's own lookup takes a lock
        #: and tries several spellings, once per run otherwise.
        self._model_memo: tuple[ModelTable | None, dict[str, ModelInfo | None]] = (models, {})
        #: Run outcomes per service, against the policy's SLO (None: no SLOs).
        self.slo = SloTracker(slo, clock=clock) if slo is not None else None
        #: Runs whose root span ended in this batch: judged (errors counted) first.
        self._ending: list[_Run] = []
        self._settings_memo: dict[str, DetectorSettings] = {}
        self._shapes: dict[frozenset[str], _Shape] = {}
        self.max_runs = max_runs
        self.max_idle_s = max_idle_s
        #: No run silent for less than this can stall: the policy's shortest
        #: ``idle_seconds`` (0: not known, the timer looks at every run). Runs are
        #: kept least recently active first, so the timer stops at the first run
        #: this recent instead of visiting a full table (~1 ms a second, cold caches).
        self.stall_horizon_s = 0.0
        self._clock = clock
        #: run key (trace id, or a session's encoded name, marked) -> state, least recently
        #: active first
        self._runs: OrderedDict[bytes, _Run] = OrderedDict()
        #: trace -> session run key, for a session's spans that do not name it. Two
        #: generations: the older is dropped whole when the newer holds half the
        #: bound, which costs a new trace a dict insert (an LRU's eviction per trace
        #: cost more, and a trace is looked up mostly while it is recent).
        self._sessions: dict[bytes, bytes] = {}
        self._sessions_before: dict[bytes, bytes] = {}
        self.evicted = 0
        self.expired = 0
        #: trace -> run, for the spans of the batch being observed: a batch holds
        #: the interleaved spans of a few dozen traces, and this spares each span
        #: the LRU's bookkeeping. Emptied when the batch settles or a run leaves.
        self._batch: dict[bytes, _Run] = {}
        #: Counts batches: a run whose ``batch`` is this one may be in the cache.
        self._batch_number = 1

    def __len__(self) -> int:
        return len(self._runs)

    def settings_for(self, service: str) -> DetectorSettings:
        found = self._settings_memo.get(service)
        if found is None:
            if len(self._settings_memo) >= _MAX_SERVICES:
                self._settings_memo.clear()
            found = self._settings_memo[service] = self._settings(service)
        return found

    def _shape_of(self, present: frozenset[str]) -> _Shape:
        shapes = self._shapes
        if len(shapes) >= _MAX_SHAPES:
            shapes.clear()
        shape = shapes[present] = _Shape(present)
        return shape

    def reset_settings(self) -> None:
        """The policy changed: settings are read again."""
        self._settings_memo.clear()

    # -- the span path ---------------------------------------------------------

    def observe_all(
        self, items: list[WireSpan], dependencies: list[str], now: float, found: list[Detection]
    ) -> None:
        """:meth:`observe` each of a batch's quiet spans, with its dependency."""
        for item, dependency in zip(items, dependencies, strict=True):
            self.observe(item, dependency, now, found)

    def observe(
        self,
        item: WireSpan,
        dependency: str,
        now: float,
        found: list[Detection],
        *,
        repeats: bool = True,
    ) -> None:
        """Count one span in its run; what it makes a detector find is appended to ``found``.

        ``repeats`` false for a span that shows a failure: a failed call tried
        again is a retry, which policies handle, not a loop.

        This runs for every span: ids stay bytes (hex only in what is
        reported), values are read raw and decoded only for sessions and
        token counts (memoized by their encoding).
        """
        span, _, service, present, encoded = item
        trace, span_id, child, name = identity_of(span)
        shape = self._shapes.get(present) or self._shape_of(present)
        batch = self._batch
        run = batch.get(trace)
        if run is None or run.gone or (run.key == trace and shape.session_keys):
            # The trace's first span in the batch, or one that may name its session.
            run = batch[trace] = self._run_for(trace, encoded, shape, service=service, now=now)
            run.batch = self._batch_number
        run.last_seen = now
        run.spans += 1
        run.stalled = False
        run.last_span = span_id
        self._turn(run, child, encoded, shape, failed=not repeats)
        if not dependency or dependency.startswith("http:"):
            return
        run.step = name
        run.last_dependency = dependency
        settings = self._settings_memo.get(service) or self.settings_for(service)
        if settings.reanchor_after is not None or settings.reanchor_after_s is not None:
            self._reanchor(run, settings, span_id, dependency, now=now, found=found)
        if dependency.startswith("tool:"):
            run.tool_calls += 1
            if run.last_llm is not None:
                _called_since(run, dependency)  # shared, not a new name per call
            if not settings.loops or not repeats:
                return
            tool = True
            key = shape.tool_arguments_key
            raw = encoded[key] if key is not None else None
            instance = _instance_of(span_id)
            what = _SAME_CALL
        else:
            prompt = self._llm_call(
                run, encoded, shape, dependency, settings=settings, span_id=span_id, found=found
            )
            key = shape.messages_key
            messages: bytes | None = encoded[key] if key is not None else None
            run.last_llm = _requested_raw(encoded, present, messages) if shape.requests else None
            if run.tools_since_llm:
                run.tools_since_llm.clear()  # reused: one list per run, not per LLM call
            key = shape.llm_text_key
            raw = (encoded[key] if key is not None else None) or messages
            if not settings.loops or not repeats or not raw:
                return  # no output recorded: nothing to compare
            tool = False
            # The same answer to the same prompt (as long: its token count) is a call
            # tried again; a loop answers the same to a context that keeps growing.
            instance = prompt & _INSTANCE_MASK if prompt else _instance_of(span_id)
            what = _SAME_OUTPUT
        first = _repeated(
            run,
            _digest(raw or b"", dependency),  # a tool called without arguments: b""
            instance,
            tool=tool,
            span_id=span_id,
            name=name,
            repeats=settings.loop_repeats,
            window=settings.loop_window,
            span=span,
            now_ns=int(now * 1e9),
        )
        if first is not None:
            found.append(_loop(run, dependency, first, repeats=settings.loop_repeats, what=what))

    @staticmethod
    def _reanchor(
        run: _Run,
        settings: DetectorSettings,
        span_id: bytes,
        dependency: str,
        *,
        now: float,
        found: list[Detection],
    ) -> None:
        """Every ``reanchor_every`` steps of a long run: remind it of its first input."""
        steps = run.llm_calls + run.tool_calls + 1  # this call included
        long_by_steps = settings.reanchor_after is not None and steps >= settings.reanchor_after
        long_by_time = (
            settings.reanchor_after_s is not None and now - run.started >= settings.reanchor_after_s
        )
        objective = run.objective
        if not (long_by_steps or long_by_time) or not objective:
            return
        if run.anchored and steps - run.anchored < settings.reanchor_every:
            return
        run.anchored = steps
        found.append(
            _at(
                run,
                span_id,
                run.step,
                dependency,
                kind="goal_drift",
                failure_class="semantic",
                rule=REANCHOR_RULE,
                message=f"step {steps} of a long run: re-anchoring it on its objective",
                details={"objective": objective, "steps": steps},
            )
        )

    def _llm_call(
        self,
        run: _Run,
        encoded: Any,
        shape: _Shape,
        dependency: str,
        *,
        settings: DetectorSettings,
        span_id: bytes,
        found: list[Detection],
    ) -> int:
        """Count an LLM call's tokens, cost and context pressure; its prompt's token count."""
        run.llm_calls += 1
        prompt = _tokens(encoded, shape.input_tokens_key)
        completion = _tokens(encoded, shape.output_tokens_key)
        run.input_tokens += prompt
        run.output_tokens += completion
        if prompt or completion:
            self._spend(
                run,
                dependency,
                prompt,
                completion,
                settings=settings,
                span_id=span_id,
                found=found,
            )
        return prompt

    def _spend(
        self,
        run: _Run,
        dependency: str,
        prompt: int,
        completion: int,
        *,
        settings: DetectorSettings,
        span_id: bytes,
        found: list[Detection],
    ) -> None:
        """Context pressure and the run's budget, for one LLM call with token usage."""
        models = self.models
        if models is None:
            return
        if dependency == run.model:
            info = run.model_info  # a run calls the same model, most of the time
        else:
            memo = self._model_memo
            if memo[0] is not models:  # a reloaded policy's table
                memo = self._model_memo = (models, {})
            known = memo[1]
            if dependency in known:
                info = known[dependency]  # every new run of a known model
            else:
                info = models.lookup(dependency.partition(":")[2])
                if len(known) >= _MAX_MODELS_MEMO:
                    known.clear()
                known[dependency] = info
            run.model, run.model_info = dependency, info
        share = settings.pressure_share
        if (
            info is not None
            and share is not None
            and not run.pressured
            and prompt >= share * info.context_window
        ):
            run.pressured = True  # once per run: every later call would say the same
            window = info.context_window
            model = dependency.partition(":")[2]
            found.append(
                _at(
                    run,
                    span_id,
                    run.step,
                    dependency,
                    kind="context_overflow",
                    failure_class="model",
                    rule=PRESSURE_RULE,
                    message=f"{prompt:,} input tokens are {prompt / window:.0%} of {model}'s"
                    f" {window:,}-token context window",
                    details={
                        "input_tokens": prompt,
                        "context_window": window,
                        "share": round(prompt / window, 4),
                    },
                )
            )
        spend = run.spend
        if spend is None:
            spend = run.spend = RunSpend()
        # The dependency names the model in the list of unpriced ones (provider:model).
        spend.add_known(run.model, info, prompt, completion)
        budget = settings.budget
        if budget is None:
            return
        crossed = spend.crossed(budget)
        if crossed is not None:
            found.append(
                _at(
                    run,
                    span_id,
                    run.step,
                    dependency,
                    kind="budget_exceeded",
                    failure_class="permanent",
                    rule=BUDGET_RULE,
                    message=f"{crossed}: {spend.describe(budget)}",
                    details={"crossed": crossed, **spend.to_json()},
                )
            )

    def _turn(self, run: _Run, child: bool, encoded: Any, shape: _Shape, *, failed: bool) -> None:
        """Whether the run's turn ended (its root span arrived), and its objective.

        A root span that failed does not end a run the sidecar has told to go
        on: its spans may arrive after the decision (a later batch).
        """
        if not child:
            if failed and run.go_on_at:
                child = True  # still open: the agent was told to retry, resume...
            else:
                run.go_on_at = 0.0
                if run.open and self.slo is not None and len(self._ending) < 10_000:
                    self._ending.append(run)  # for the SLO, once the batch is judged
        run.open = child  # a root span ends its run's turn
        key = shape.objective_key
        if run.objective is None and key is not None:
            # Kept only where it can be used (re-anchoring is off by default), and as
            # bounded text: a first input can be a whole document.
            settings = self._settings_memo.get(run.service) or self.settings_for(run.service)
            anchoring = settings.reanchor_after is not None or settings.reanchor_after_s is not None
            run.objective = _objective_text(encoded[key]) if anchoring else ""

    def _run_for(
        self, trace: bytes, encoded: Any, shape: _Shape, *, service: str, now: float
    ) -> _Run:
        key: bytes = trace
        sessions = self._sessions
        known = sessions.get(trace) if sessions else None
        if known is None and self._sessions_before:
            known = self._sessions_before.get(trace)
        if known is not None:
            key = known  # a trace never changes session: its spans need not be read again
        elif shape.session_keys:
            for name in shape.session_keys:
                raw_session: bytes = encoded[name]
                if 2 < len(raw_session) <= _MAX_SESSION_BYTES:
                    # The encoded value, marked, is the key: no decoding per span
                    # (run_id decodes it). A trace id is 16 bytes and never ends so.
                    key = raw_session + _SESSION_MARK
                    self._remember_session(trace, key)
                    break
        runs = self._runs
        # Spans of the trace seen before one named its session: their run is this one.
        early = runs.pop(trace) if key != trace and trace in runs else None
        run = runs.get(key)
        if run is None and early is not None:
            # The session's first run here: the trace's run becomes it, all it holds kept,
            # rather than made anew and folded into (and nothing evicted: it just left).
            run, early = early, None
            run.key = key
            runs[key] = run
        elif run is None:
            run = runs[key] = self._new_run(key, service, trace, now)
        else:
            runs.move_to_end(key)
        if early is not None:
            early.gone = True
            _fold(early, into=run)
        run.trace = trace
        return run

    def _new_run(self, key: bytes, service: str, trace: bytes, now: float) -> _Run:
        """A new run, in the place of the least recently active when the table is full.

        The evicted run is begun again as the new one (see ``_Run.begin``)
        unless this batch's cache holds it: it is marked gone instead, not
        looked for in the cache (with a full table every new run evicts one,
        and clearing the cache each time made most spans look their run up
        again), and the cache's spans of its trace find it gone.
        """
        runs = self._runs
        reused: _Run | None = None
        while len(runs) >= self.max_runs:
            evicted = runs.popitem(False)[1]  # positional: no keyword call
            self.evicted += 1
            if evicted.batch == self._batch_number or reused is not None:
                evicted.gone = True
            else:
                reused = evicted
        if reused is None:
            return _Run(key, service, trace, now)
        reused.begin(key, service, trace, now)
        return reused

    def begin_batch(self) -> None:
        """A batch's spans follow (its runs are looked up afresh, whatever the last one left)."""
        self._batch.clear()
        self._batch_number += 1

    def settle(self, now: float | None = None) -> None:
        """The batch is judged: runs that ended in it count in their service's SLO."""
        self._batch.clear()
        self._batch_number += 1
        ending, self._ending = self._ending, []
        slo = self.slo
        if slo is None:
            return
        for run in ending:
            spend = run.spend
            cost = (
                spend.cost_usd if spend is not None and spend.calls and not spend.partial else None
            )
            slo.record_run(
                run.service,
                run.errors == 0,
                max(0.0, run.last_seen - run.started),
                cost,
                now=now,
            )

    def set_slo(self, spec: SloSpec | None) -> None:
        """A reloaded policy's SLO (history kept where its windows did not change)."""
        if spec is None:
            self.slo = None
        elif self.slo is None:
            self.slo = SloTracker(spec, clock=self._clock)
        else:
            self.slo.set_spec(spec)

    def burning(self, service: str) -> bool:
        """Whether ``service``'s run SLO burns its error budget fast (policies may match it)."""
        return self.slo is not None and self.slo.burning(service)

    def slo_status(self) -> dict[str, Any]:
        """Each service's SLO status (success rate, burn rates, durations, cost per run)."""
        slo = self.slo
        if slo is None:
            return {}
        return {service: slo.status(service).to_json() for service in slo.services()[:100]}

    def failed(self, run_id: str) -> None:
        """A failure was reported in ``run_id`` (from the pipeline's judging)."""
        run = self._runs.get(_key_of(run_id))
        if run is not None:
            run.errors += 1

    def expect_more(self, run_id: str, after: float) -> None:
        """The sidecar tells ``run_id`` to go on at ``after``: silence from then is a stall.

        A run whose turn ended in a failure has its root span ended, so it
        would never stall; but an agent killed after it was told to retry
        leaves exactly that run behind, half done. Its idle time counts from
        when the command may be delivered, so a long backoff is no stall.
        """
        run = self._runs.get(_key_of(run_id))
        if run is not None:
            run.open = True
            run.stalled = False
            run.go_on_at = max(run.go_on_at, after)

    def _remember_session(self, trace: bytes, session: bytes) -> None:
        """``trace`` belongs to ``session`` (a trace not remembered yet)."""
        sessions = self._sessions
        if len(sessions) >= max(1, self.max_runs // 2):
            self._sessions_before = sessions
            sessions = self._sessions = {}
        sessions[trace] = session

    # -- the timer ------------------------------------------------------------

    def stalled(self, now: float | None = None) -> list[Detection]:
        """Runs silent past their ``idle_seconds``, each once per silence; drops expired runs."""
        now = self._clock() if now is None else now
        found: list[Detection] = []
        horizon = min(self.stall_horizon_s, self.max_idle_s)
        expired: list[_Run] = []
        for run in self._runs.values():  # least recently active first
            idle = now - run.last_seen
            if 0 <= idle < horizon:
                # The runs after it were active later (a run seen "in the future"
                # after the clock went back is passed over, not taken as recent).
                break
            if idle >= self.max_idle_s:
                expired.append(run)
                continue
            if run.stalled or not run.open:
                continue
            if run.go_on_at > run.last_seen:  # silent since it was told to go on
                idle = now - run.go_on_at
            settings = self.settings_for(run.service)
            if not settings.stalls or idle < settings.idle_seconds:
                continue
            run.stalled = True
            unverified = _unanswered(run)
            listed = ", ".join(unverified) or "none seen"
            found.append(
                _at(
                    run,
                    run.last_span,
                    run.step,
                    run.last_dependency,
                    kind="stall",
                    failure_class="transient",
                    rule=STALL_RULE,
                    message=f"no span for {idle:.0f} s; unverified work: {listed}",
                    details={"idle_s": round(idle, 3), "unverified": unverified},
                    role="agent",
                )
            )
        for run in expired:
            del self._runs[run.key]
            run.gone = True
            self.expired += 1
        return found

    # -- views ---------------------------------------------------------------

    def snapshot(self, limit: int = 100, now: float | None = None) -> list[RunView]:
        """The most recently active runs first."""
        now = self._clock() if now is None else now
        views: list[RunView] = []
        for run in reversed(self._runs.values()):
            if len(views) >= limit:
                break
            views.append(_view(run, now, self.settings_for(run.service)))
        return views

    def stats(self) -> dict[str, int]:
        return {"tracked": len(self._runs), "evicted": self.evicted, "expired": self.expired}


def _loop(
    run: _Run, dependency: str, first: tuple[bytes, str, int], *, repeats: int, what: str
) -> Detection:
    span_id, name, occurrence = first
    return _at(
        run,
        span_id,
        name,
        dependency,
        kind="reasoning_loop",
        failure_class="model",
        rule=LOOP_RULE,
        message=f"{what} {repeats} times: {name[:256]}"
        + (f" (still looping, report {occurrence})" if occurrence > 1 else ""),
        details={"repeats": repeats, "repeated_call": name[:256], "occurrence": occurrence},
    )


def _at(
    run: _Run,
    span_id: bytes,
    name: str,
    dependency: str,
    *,
    kind: str,
    failure_class: str,
    rule: str,
    message: str,
    details: Mapping[str, Any],
    role: str = "",
) -> Detection:
    return Detection(
        kind=kind,
        failure_class=failure_class,
        rule=rule,
        run_id=run.run_id,
        service=run.service,
        trace_id=run.trace.hex(),
        span_id=span_id.hex(),
        span_name=name[:256],
        dependency=dependency,
        message=message,
        details=details,
        role=role,
    )


def _requested_raw(
    encoded: Any, present: frozenset[str], messages: bytes | None = None
) -> dict[str, bytes] | None:
    """The raw values that name the tool calls an LLM response asked for; None when none.

    Probed cheaply first (OpenInference's first call's name; a ``tool_call``
    part in the GenAI message list), kept only when there is one: most
    responses ask for nothing. ``messages``: ``gen_ai.output.messages``, when
    the caller read it already.
    """
    kept: dict[str, bytes] | None = None
    if messages is None and "gen_ai.output.messages" in present:
        messages = encoded["gen_ai.output.messages"]
    # find(), not `in`: bytes' `in` tries its operand as an integer first, and the
    # TypeError it raises and clears cost more than the search.
    if (
        messages is not None
        and len(messages) <= _MAX_KEPT_BYTES
        and messages.find(b"tool_call") >= 0
    ):
        kept = {"gen_ai.output.messages": messages}
    if FIRST_TOOL_CALL not in present:
        return kept
    for message in _OI_KEYS:  # a response is one message
        for name_key, args_key in message:
            found = raw_value(encoded, name_key)
            if found is None:
                break
            if kept is None:
                role = raw_value(encoded, _OI_ROLE)  # the adapter needs the role
                kept = {_OI_ROLE: role} if role is not None else {}
            kept[name_key] = found
            arguments = raw_value(encoded, args_key)
            if arguments is not None and len(arguments) <= _MAX_KEPT_BYTES:
                kept[args_key] = arguments
    return kept or None


def _called_since(run: _Run, dependency: str) -> None:
    """A tool (``tool:<name>``) called after the run's last LLM response (at most 64 kept)."""
    since = run.tools_since_llm
    if since is None:
        since = run.tools_since_llm = []
    if len(since) < 64:
        since.append(dependency)


def _instance_of(span_id: bytes) -> int:
    """32 bits of a span id that tell its calls apart (a re-sent span keeps its id).

    Both halves folded: ids are random, or counters that differ in their last
    bytes. Read from the bytes: ``hash()`` gives 64 bits, beyond the compiled
    code's machine integers, and masking it took the arbitrary-precision path.
    """
    if len(span_id) != 8:
        return hash(span_id) & _INSTANCE_MASK
    return (
        (span_id[0] ^ span_id[4])
        | (span_id[1] ^ span_id[5]) << 8
        | (span_id[2] ^ span_id[6]) << 16
        | (span_id[3] ^ span_id[7]) << 24
    )


def _digest(raw: bytes, dependency: str) -> int:
    """What a repeat is compared by: the call's dependency and value (its ends, when long).

    Hashing a long answer cost microseconds per span; two answers of the same
    length with the same first and last 256 bytes are the same answer in any
    loop worth reporting. One hash of a tuple: XOR-ing two hashes took the
    compiled code's arbitrary-precision path (hashes exceed its machine ints).
    """
    if len(raw) <= 512:
        return hash((raw, dependency))
    return hash((len(raw), raw[:256], raw[-256:], dependency))


def _any_of(keys: tuple[str, ...], present: frozenset[str]) -> bool:
    """Whether the span has one of a few ``keys`` (compiled: a loop, no method call)."""
    return any(key in present for key in keys)


def _first_key(present: frozenset[str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in present:
            return _own(present, key)
    return None


def _own(present: frozenset[str], key: str) -> str:
    """``present``'s own string equal to ``key`` (once per shape: see ``_Shape``)."""
    for found in present:
        if found == key:
            return found
    return key


def _fold(early: _Run, *, into: _Run) -> None:
    """Counts of a trace's first spans (before it named its session) into the session's run."""
    into.started = min(into.started, early.started)
    into.spans += early.spans
    into.llm_calls += early.llm_calls
    into.tool_calls += early.tool_calls
    into.errors += early.errors
    into.input_tokens += early.input_tokens
    into.output_tokens += early.output_tokens
    if into.objective is None:
        into.objective = early.objective


def _objective_text(raw: bytes) -> str:
    """The first user message of a run's first input, as text (bounded)."""
    value = value_of(raw)
    if not isinstance(value, str):
        return ""
    text = value.strip()
    if text.startswith("["):  # a message list (gen_ai.input.messages, or OpenAI's JSON)
        try:
            messages = json.loads(text)
        except ValueError:
            messages = None
        if isinstance(messages, list):
            text = _first_user_text(messages) or text
    return text[:_MAX_OBJECTIVE]


def _first_user_text(messages: list[Any]) -> str:
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "human"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        parts = message.get("parts") or (content if isinstance(content, list) else [])
        texts = [
            str(p.get("content") or p.get("text") or "")
            for p in parts
            if isinstance(p, dict) and p.get("type") in ("text", None)
        ]
        return " ".join(t for t in texts if t)
    return ""


def _tokens(encoded: Any, key: str | None) -> int:
    """The span's attribute ``key`` (one it carries) as a token count (0 when None or odd)."""
    if key is None:
        return 0
    raw: bytes = encoded[key]
    size = len(raw)
    if size > 1 and raw[0] == _INT_TAG:  # int_value: read the varint here
        value = 0
        shift = 0
        for at in range(1, min(size, 11)):  # indexes: no slice copied per span
            byte = raw[at]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value if value < 1 << 40 else 0
            shift += 7
        return 0
    decoded = value_of(raw) if raw else None  # a string or double: the long way
    if isinstance(decoded, float) and decoded > 0:
        return int(decoded)
    if isinstance(decoded, str) and decoded.isdigit():
        return int(decoded[:12])
    return 0


def _key_of(run_id: str) -> bytes:
    """The tracker's key for a run id as records carry it (trace hex, or session name)."""
    if len(run_id) == 32:
        try:
            return bytes.fromhex(run_id)
        except ValueError:
            pass
    encoded = run_id.encode("utf-8", "surrogatepass")
    size = len(encoded)
    length = bytes([size]) if size < 0x80 else bytes([size & 0x7F | 0x80, size >> 7])
    return b"\x0a" + length + encoded + _SESSION_MARK


def _view(run: _Run, now: float, settings: DetectorSettings) -> RunView:
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
        cost_usd=run.spend.cost_usd if run.spend is not None and run.spend.calls else None,
        cost_partial=run.spend.partial if run.spend is not None else False,
    )


def requested_calls(encoded: Any, present: frozenset[str]) -> list[str]:
    """``name(arguments)`` of the tool calls an LLM span's response asked for."""
    if REQUEST_MARKERS.isdisjoint(present):
        return []
    kept = _requested_raw(encoded, present)
    return _requested_calls(kept) if kept else []


def _unanswered(run: _Run) -> tuple[str, ...]:
    """The tool calls the last LLM response asked for, less the tool spans seen since."""
    if run.last_llm is None:
        return ()
    requested = _requested_calls(run.last_llm)
    answered = [dependency[5:] for dependency in run.tools_since_llm or ()]
    left: list[str] = []
    for call in requested:
        name = call.split("(", 1)[0]
        if name in answered:
            answered.remove(name)
        else:
            left.append(call)
    return tuple(left)


def _requested_calls(kept: Mapping[str, bytes]) -> list[str]:
    """``name(arguments)`` of each tool call in the kept LLM attributes, through the adapters."""
    from supervisor.normalize import genai, openinference
    from supervisor.normalize.wire import LazyConverted

    attrs = LazyConverted(RawAttributes(kept))
    calls: list[tuple[str, object]] = []
    try:
        if any(k.startswith("llm.output_messages.") for k in kept):
            calls.extend(openinference.output_messages(attrs)[1])
        if "gen_ai.output.messages" in kept:
            calls.extend(genai.message_output(attrs.full("gen_ai.output.messages"))[1])
    except Exception:  # boundary: a report with fewer calls beats no report
        return []
    out: list[str] = []
    for name, arguments in calls[:32]:
        text = arguments if isinstance(arguments, str) else repr(arguments)
        out.append(f"{name}({text[:200]})")
    return out
