"""The run detectors on traces made by the real instrumentations, as in "The core loop".

An agent loop in the test drives the real ``openai`` (or ``anthropic``) client,
wrapped by one of the real instrumentations, against :class:`FakeProvider` on
loopback. The agent's own spans are made the way each ecosystem makes them:

* ``openinference`` (openai) and ``openinference_anthropic``: the run is an
  ``openinference.span.kind=AGENT`` span and each tool runs under
  ``OITracer.tool`` (``openinference.span.kind=TOOL``, ``tool.name``, the bound
  arguments as JSON in ``input.value``);
* ``openai_v2``: the run is an ``invoke_agent`` span and each tool runs under
  ``opentelemetry-util-genai``'s ``TelemetryHandler.tool``, the helper the
  instrumentation is built on (``execute_tool <name>``,
  ``gen_ai.tool.call.arguments``);
* ``openllmetry``, which has no tool spans without ``traceloop-sdk``: an
  ``execute_tool`` span written with the SDK tracer.

Every step's finished spans are encoded as OTLP, as an exporter sends them,
and go through :meth:`Pipeline.process_payload` with a run tracker built as
the app builds it, one injected second apart (nothing sleeps). A crash is a
root span that never ends, so nothing of it is ever exported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic.warnings import PydanticDeprecatedSince20

from policies import load_policy
from supervisor.judge.pipeline import Outcome, Pipeline, detected_failure
from supervisor.runs import RunTracker
from supervisor.testing import FakeProvider, Reply, ToolCall
from tests.screening import assert_early_reads_agree
from tests.test_normalize_real_instrumentation import (
    CLAUDE,
    MODEL,
    SERVICE,
    _instrumented,
    _tracer_provider,
)

T0 = 1_700_000_000.0


@dataclass(frozen=True)
class Flavor:
    """One instrumentation, the SDK it wraps and the model table's entry for its model."""

    name: str
    sdk: str
    model: str
    context_window: int
    #: USD per million input and output tokens (policies/model_tables.yaml).
    prices: tuple[float, float]

    @property
    def dependency(self) -> str:
        return f"{self.sdk}:{self.model}"

    @property
    def openinference(self) -> bool:
        return self.name.startswith("openinference")


FLAVORS = {
    flavor.name: flavor
    for flavor in (
        Flavor("openinference", "openai", MODEL, 128_000, (0.15, 0.60)),
        Flavor("openai_v2", "openai", MODEL, 128_000, (0.15, 0.60)),
        Flavor("openllmetry", "openai", MODEL, 128_000, (0.15, 0.60)),
        Flavor("openinference_anthropic", "anthropic", CLAUDE, 200_000, (1.00, 5.00)),
    )
}
OPENINFERENCE = [name for name, flavor in FLAVORS.items() if flavor.openinference]
OPENAI_FLAVORS = [name for name, flavor in FLAVORS.items() if flavor.sdk == "openai"]

_SCHEMAS = {
    "get_weather": ("Current weather for a city.", {"city": {"type": "string"}}),
    "charge_card": (
        "Charge the customer's card.",
        {"amount": {"type": "integer"}, "currency": {"type": "string"}},
    ),
    "send_receipt": ("Email a receipt.", {"to": {"type": "string"}}),
}
OPENAI_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties},
        },
    }
    for name, (description, properties) in _SCHEMAS.items()
]
ANTHROPIC_TOOLS: Any = [
    {
        "name": name,
        "description": description,
        "input_schema": {"type": "object", "properties": properties},
    }
    for name, (description, properties) in _SCHEMAS.items()
]


def get_weather(city: str) -> str:
    return f"Sunny in {city}, 21C"


def charge_card(amount: int, currency: str) -> str:
    return f"charged {amount} {currency}"


def send_receipt(to: str) -> str:
    return f"receipt sent to {to}"


TOOL_FUNCTIONS: dict[str, Callable[..., str]] = {
    f.__name__: f for f in (get_weather, charge_card, send_receipt)
}

#: Runs a tool inside its convention's span: (name, arguments, call id) -> (span id, result).
ToolSpan = Callable[[str, dict[str, Any], str], tuple[str, str]]


def _current_span_id() -> str:
    return f"{trace.get_current_span().get_span_context().span_id:016x}"


def _tool_span_maker(flavor: Flavor, provider: TracerProvider) -> ToolSpan:
    """How each ecosystem wraps a tool's execution in a span."""
    if flavor.openinference:
        from openinference.instrumentation import OITracer, TraceConfig

        oi_tracer = OITracer(provider.get_tracer("agent"), TraceConfig())

        def openinference_tool(
            tool: str, arguments: dict[str, Any], call_id: str
        ) -> tuple[str, str]:
            seen: list[str] = []

            @functools.wraps(TOOL_FUNCTIONS[tool])  # its signature makes input.value
            def body(**kwargs: Any) -> str:
                seen.append(_current_span_id())
                return TOOL_FUNCTIONS[tool](**kwargs)

            result = oi_tracer.tool(name=tool)(body)(**arguments)
            return seen[0], result

        return openinference_tool
    if flavor.name == "openai_v2":
        from opentelemetry.util.genai.handler import TelemetryHandler

        handler = TelemetryHandler(tracer_provider=provider)

        def genai_util_tool(tool: str, arguments: dict[str, Any], call_id: str) -> tuple[str, str]:
            invocation = handler.tool(tool, tool_call_id=call_id, tool_type="function")
            with invocation:
                invocation.arguments = arguments
                result = TOOL_FUNCTIONS[tool](**arguments)
                invocation.tool_result = result
                return _current_span_id(), result

        return genai_util_tool
    tracer = provider.get_tracer("agent")

    def sdk_tool(tool: str, arguments: dict[str, Any], call_id: str) -> tuple[str, str]:
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.call.arguments": json.dumps(arguments),
        }
        with tracer.start_as_current_span(f"execute_tool {tool}", attributes=attributes) as span:
            result = TOOL_FUNCTIONS[tool](**arguments)
            span.set_attribute("gen_ai.tool.call.result", result)
            return _current_span_id(), result

    return sdk_tool


@contextlib.contextmanager
def _instrumented_anthropic() -> Iterator[InMemorySpanExporter]:
    from openinference.instrumentation.anthropic import AnthropicInstrumentor

    tracer_provider, exporter = _tracer_provider()
    instrumentor = AnthropicInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=tracer_provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()
        tracer_provider.shutdown()


@contextlib.contextmanager
def _openllmetry_unwrapped_after() -> Iterator[None]:
    """Undo what OpenLLMetry wraps when its instrumentation ends.

    Its ``uninstrument`` (0.62.4) calls ``unwrap("openai.resources.chat.completions",
    "Completions.create")``, and ``opentelemetry.instrumentation.utils.unwrap`` reads
    that as attribute ``"Completions.create"`` of ``openai.resources.chat``: nothing is
    unwrapped. A later instrumentation (another test module) would then wrap the SDK
    twice and write every streamed chunk twice. What it wraps is recorded and unwrapped.
    """
    from opentelemetry.instrumentation.utils import unwrap

    with warnings.catch_warnings():
        # OpenLLMetry 0.62 imports a module with a pydantic v1-style Config class.
        warnings.simplefilter("ignore", PydanticDeprecatedSince20)
        from opentelemetry.instrumentation.openai import v1

    wrapped: list[tuple[str, str]] = []
    original = vars(v1)["wrap_function_wrapper"]  # wrapt's, as v1 imported it

    def recording(module: str, name: str, wrapper: Any) -> Any:
        done = original(module, name, wrapper)  # raises for what this SDK lacks
        wrapped.append((module, name))
        return done

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(v1, "wrap_function_wrapper", recording)
        yield
    for module, name in wrapped:
        owner: Any = importlib.import_module(module)
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        unwrap(owner, attribute)


@dataclass(frozen=True)
class Instrumented:
    """One instrumentation at work: its exporter, the agent's tracer and tool spans, a client."""

    flavor: Flavor
    exporter: InMemorySpanExporter
    tracer: trace.Tracer
    tool_span: ToolSpan
    client: Any
    fake: FakeProvider


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture(scope="module", params=list(FLAVORS))
def instrumented(request: pytest.FixtureRequest, fake: FakeProvider) -> Iterator[Instrumented]:
    """Each flavor instrumented once for the module (instrumentations are process-wide)."""
    flavor = FLAVORS[request.param]
    with contextlib.ExitStack() as stack:
        if flavor.sdk == "anthropic":
            exporter = stack.enter_context(_instrumented_anthropic())
            client: Any = stack.enter_context(
                anthropic.Anthropic(base_url=fake.url, api_key="sk-ant-fake", max_retries=0)
            )
        else:
            if flavor.name == "openllmetry":
                stack.enter_context(_openllmetry_unwrapped_after())
            exporter = stack.enter_context(_instrumented(flavor.name))
            client = stack.enter_context(
                openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
            )
        # The agent's own spans go to the instrumentation's exporter.
        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        stack.callback(provider.shutdown)
        yield Instrumented(
            flavor,
            exporter,
            provider.get_tracer("agent"),
            _tool_span_maker(flavor, provider),
            client,
            fake,
        )


@dataclass
class Agent:
    """An instrumented agent, and the sidecar's pipeline that judges its spans as they end."""

    on: Instrumented
    pipeline: Pipeline = field(init=False)
    now: float = T0
    messages: list[Any] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    #: The ids of the LLM spans, in call order.
    llm_spans: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.use_policy(None)
        self.say("What is the weather in Paris?")

    @property
    def flavor(self) -> Flavor:
        return self.on.flavor

    @property
    def tracker(self) -> RunTracker:
        assert self.pipeline.runs is not None
        return self.pipeline.runs

    def use_policy(self, text: str | None) -> None:
        """A fresh pipeline with a run tracker, as the app builds them."""
        policy = load_policy(text=text) if text is not None else load_policy()
        self.pipeline = Pipeline(
            policy,
            runs=RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models),
        )

    # -- the agent's steps --------------------------------------------------------

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def ask(self, reply: Reply, *, tools: bool = True, stream: bool = False) -> Any:
        """One model call on the conversation so far; the answer joins the conversation."""
        self.on.fake.script(reply)
        client = self.on.client
        if stream:  # text answers only, read to the end as an agent does
            assert self.flavor.sdk == "openai"
            chunks = client.chat.completions.create(
                model=self.flavor.model,
                messages=self.messages,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            self.messages.append({"role": "assistant", "content": text})
            response: Any = text
        elif self.flavor.sdk == "anthropic":
            extra: dict[str, Any] = {"tools": ANTHROPIC_TOOLS} if tools else {}
            response = client.messages.create(
                model=self.flavor.model, max_tokens=512, messages=self.messages, **extra
            )
            content = [block.model_dump(exclude_none=True) for block in response.content]
            self.messages.append({"role": "assistant", "content": content})
        else:
            extra = {"tools": OPENAI_TOOLS} if tools else {}
            response = client.chat.completions.create(
                model=self.flavor.model, messages=self.messages, **extra
            )
            self.messages.append(response.choices[0].message.model_dump(exclude_none=True))
        (span_id,) = self._flush()
        self.llm_spans.append(span_id)
        return response

    def retract(self) -> None:
        """Forget the last answer, to ask the same again (a retry)."""
        self.messages.pop()

    def tool_calls(self, response: Any) -> list[tuple[str, dict[str, Any], str]]:
        if self.flavor.sdk == "anthropic":
            return [(b.name, b.input, b.id) for b in response.content if b.type == "tool_use"]
        return [
            (c.function.name, json.loads(c.function.arguments), c.id)
            for c in response.choices[0].message.tool_calls or ()
        ]

    def run_tool(self, name: str, arguments: dict[str, Any], call_id: str) -> str:
        """Execute a tool the model asked for; its result joins the conversation."""
        span_id, result = self.on.tool_span(name, arguments, call_id)
        if self.flavor.sdk == "anthropic":
            block = {"type": "tool_result", "tool_use_id": call_id, "content": result}
            self.messages.append({"role": "user", "content": [block]})
        else:
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        assert self._flush() == [span_id]
        return span_id

    def answer_tool_calls(self, response: Any) -> list[str]:
        """Run every tool call of a response, as an agent loop does; their span ids."""
        return [self.run_tool(*call) for call in self.tool_calls(response)]

    @contextlib.contextmanager
    def run(self, *, crash: bool = False) -> Iterator[trace.Span]:
        """The agent's root span; a crash leaves it open, never exported."""
        attributes: dict[str, Any] = (
            {"openinference.span.kind": "AGENT"}
            if self.flavor.openinference
            else {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": SERVICE}
        )
        root = self.on.tracer.start_span(f"invoke_agent {SERVICE}", attributes=attributes)
        with trace.use_span(root, end_on_exit=False):
            yield root
        if not crash:
            root.end()
            self._flush()

    def _flush(self) -> list[str]:
        """Send the spans that ended since the last flush, a second after it; their ids."""
        self.now += 1.0
        spans = self.on.exporter.get_finished_spans()
        self.on.exporter.clear()
        if not spans:
            return []
        payload = encode_spans(spans).SerializeToString()
        assert_early_reads_agree(payload)
        self.outcomes += self.pipeline.process_payload(payload, received_ns=int(self.now * 1e9))
        return [f"{s.context.span_id:016x}" for s in spans if s.context is not None]


@pytest.fixture
def agent(instrumented: Instrumented) -> Iterator[Agent]:
    instrumented.fake.reset()
    instrumented.exporter.clear()
    yield Agent(instrumented)
    assert instrumented.fake.pending == 0


# -- reasoning loops ---------------------------------------------------------------


def test_the_same_tool_call_three_times_is_one_loop_at_the_first_repeat(agent: Agent) -> None:
    tool_spans: list[str] = []
    with agent.run() as root:
        for _ in range(3):  # the model keeps asking for the same thing
            response = agent.ask(Reply.tool_call("get_weather", {"city": "Paris"}))
            tool_spans += agent.answer_tool_calls(response)
        agent.ask(Reply.text("It is sunny in Paris."))
    (outcome,) = agent.outcomes
    failure, decision = outcome.failure, outcome.decision
    assert (failure.kind, failure.failure_class.value, failure.rule, failure.dependency) == (
        "reasoning_loop",
        "model",
        "builtin.detect.reasoning_loop",
        "tool:get_weather",
    )
    assert failure.span_id == tool_spans[1]  # the first repeated call
    assert failure.run_id == failure.trace_id == f"{root.get_span_context().trace_id:032x}"
    assert failure.message.startswith("the same tool call 3 times")
    assert (decision.action.value, decision.params["remediator"]) == ("remediate", "loop_breaker")
    (view,) = agent.tracker.snapshot(now=agent.now)
    assert (view.status, view.llm_calls, view.tool_calls, view.errors) == ("ended", 4, 3, 1)


def test_different_arguments_to_the_same_tool_are_not_a_loop(agent: Agent) -> None:
    with agent.run():
        for city in ("Paris", "Rome", "Oslo", "Lima"):
            agent.answer_tool_calls(agent.ask(Reply.tool_call("get_weather", {"city": city})))
        agent.ask(Reply.text("Sunny everywhere."))
    assert agent.outcomes == []


@pytest.mark.parametrize("instrumented", OPENINFERENCE, indirect=True)
def test_a_loop_across_the_traces_of_one_session(agent: Agent) -> None:
    """No agent span: each call is a trace of its own, and ``session.id`` makes them a run."""
    from openinference.instrumentation import using_session

    tool_spans: list[str] = []
    with using_session("support-chat-7"):
        for _ in range(3):
            response = agent.ask(Reply.tool_call("get_weather", {"city": "Paris"}))
            tool_spans += agent.answer_tool_calls(response)
    (outcome,) = agent.outcomes
    assert (outcome.failure.kind, outcome.failure.run_id, outcome.failure.span_id) == (
        "reasoning_loop",
        "support-chat-7",
        tool_spans[1],
    )
    (view,) = agent.tracker.snapshot(now=agent.now)
    assert (view.run_id, view.llm_calls, view.tool_calls) == ("support-chat-7", 3, 3)


def test_the_same_answer_to_a_growing_conversation_is_a_loop(
    agent: Agent, request: pytest.FixtureRequest
) -> None:
    with agent.run():
        for _ in range(3):
            agent.ask(Reply.text("Let me look that up again."))
            agent.say("Go on.")
    (outcome,) = agent.outcomes
    failure = outcome.failure
    assert (failure.kind, failure.rule, failure.dependency) == (
        "reasoning_loop",
        "builtin.detect.reasoning_loop",
        agent.flavor.dependency,
    )
    assert failure.span_id == agent.llm_spans[1]
    assert failure.message.startswith("the same LLM output 3 times")
    assert outcome.decision.params["remediator"] == "loop_breaker"


@pytest.mark.parametrize("instrumented", OPENAI_FLAVORS, indirect=True)
def test_the_same_streamed_answer_to_a_growing_conversation_is_a_loop(
    agent: Agent, request: pytest.FixtureRequest
) -> None:
    with agent.run():
        for _ in range(3):
            assert agent.ask(Reply.text("Let me look that up again."), stream=True)
            agent.say("Go on.")
    (outcome,) = agent.outcomes
    assert (outcome.failure.kind, outcome.failure.span_id) == ("reasoning_loop", agent.llm_spans[1])


def test_identical_retries_of_the_same_prompt_are_not_a_loop(agent: Agent) -> None:
    with agent.run():
        for _ in range(4):  # the agent asks again: the same prompt, the same answer
            agent.ask(Reply.text("Let me look that up again."))
            agent.retract()
    assert agent.outcomes == []
    assert len(agent.llm_spans) == 4


# -- stalls --------------------------------------------------------------------------

STALLS = "version: 1\ndetectors:\n  stalls: {idle_seconds: 5}\n"


def test_a_crash_before_the_tool_ran_leaves_the_charge_unverified(
    agent: Agent, request: pytest.FixtureRequest
) -> None:
    agent.use_policy(STALLS)
    with agent.run(crash=True):
        agent.ask(Reply.tool_call("charge_card", {"amount": 42, "currency": "EUR"}))
        # The agent process dies here: no tool span, and the root span never ends.
    last = agent.now
    assert agent.outcomes == []
    assert agent.tracker.stalled(now=last + 4.9) == []
    (stall,) = agent.tracker.stalled(now=last + 5.0)
    assert (stall.span_id, stall.dependency, stall.details["idle_s"]) == (
        agent.llm_spans[0],
        agent.flavor.dependency,
        5.0,
    )
    assert agent.tracker.snapshot(now=last + 5.0)[0].status == "stalled"
    assert agent.tracker.stalled(now=last + 60.0) == []  # once per silence
    (outcome,) = agent.pipeline.judge_detected([detected_failure(stall, int((last + 5) * 1e9))])
    assert (outcome.failure.kind, outcome.failure.rule) == ("stall", "builtin.detect.stall")
    assert (outcome.decision.action.value, outcome.decision.params["remediator"]) == (
        "remediate",
        "resume_run",
    )
    (unverified,) = stall.details["unverified"]
    assert unverified.startswith("charge_card(")
    assert "42" in unverified and "EUR" in unverified
    assert "charge_card(" in outcome.failure.message


def test_a_crash_between_two_tool_calls_leaves_only_the_second_unverified(
    agent: Agent, request: pytest.FixtureRequest
) -> None:
    agent.use_policy(STALLS)
    with agent.run(crash=True):
        response = agent.ask(
            Reply.tool_call(
                "charge_card",
                {"amount": 42, "currency": "EUR"},
                ToolCall("send_receipt", json.dumps({"to": "ada@example.com"}), id="call_r"),
            )
        )
        agent.run_tool(*agent.tool_calls(response)[0])
        # ...and dies before sending the receipt.
    (stall,) = agent.tracker.stalled(now=agent.now + 5)
    assert stall.dependency == "tool:charge_card"
    (unverified,) = stall.details["unverified"]
    assert unverified.startswith("send_receipt(")
    assert "ada@example.com" in unverified


def test_a_run_that_ended_does_not_stall(agent: Agent) -> None:
    agent.use_policy(STALLS)
    with agent.run():
        response = agent.ask(Reply.tool_call("charge_card", {"amount": 42, "currency": "EUR"}))
        agent.answer_tool_calls(response)
        agent.ask(Reply.text("Charged 42 EUR."))
    assert agent.tracker.stalled(now=agent.now + 3600) == []
    assert agent.outcomes == []


# -- context pressure ------------------------------------------------------------------


def test_a_prompt_near_the_models_window_is_context_pressure_once_per_run(agent: Agent) -> None:
    window = agent.flavor.context_window
    near, nearer = int(window * 0.92), int(window * 0.97)
    with agent.run():
        agent.ask(Reply.text("Noted.", usage=(2_000, 10)))
        agent.say("And tomorrow?")
        agent.ask(Reply.text("Rain.", usage=(near, 10)))
        agent.say("And the day after?")
        agent.ask(Reply.text("Snow.", usage=(nearer, 10)))  # the same run: not again
    (outcome,) = agent.outcomes
    failure = outcome.failure
    assert (failure.kind, failure.failure_class.value, failure.rule, failure.dependency) == (
        "context_overflow",
        "model",
        "builtin.detect.context_pressure",
        agent.flavor.dependency,
    )
    assert failure.span_id == agent.llm_spans[1]
    assert (failure.details["input_tokens"], failure.details["context_window"]) == (near, window)
    assert (outcome.decision.action.value, outcome.decision.params["remediator"]) == (
        "remediate",
        "compact_context",
    )


def test_a_long_prompt_to_a_small_window_from_the_policy_is_context_pressure(
    agent: Agent,
) -> None:
    agent.use_policy(
        f"""\
version: 1
context_pressure:
  models:
    "{agent.flavor.model}*": {{context_window: 1000, input_per_mtok: 0.15, output_per_mtok: 0.6}}
"""
    )
    with agent.run():
        agent.ask(Reply.text("Noted."), tools=False)
        agent.say("Here is the whole log: " + "x" * 4000)
        response = agent.ask(Reply.text("That is a long log."), tools=False)
    usage = response.usage
    prompt_tokens = usage.input_tokens if agent.flavor.sdk == "anthropic" else usage.prompt_tokens
    assert prompt_tokens >= 900  # what the provider counted
    (outcome,) = agent.outcomes
    assert (outcome.failure.kind, outcome.failure.span_id) == (
        "context_overflow",
        agent.llm_spans[1],
    )
    assert outcome.failure.details == {
        "input_tokens": prompt_tokens,
        "context_window": 1000,
        "share": round(prompt_tokens / 1000, 4),
    }


# -- run budgets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "decided"), [("escalate", "escalate"), ("abort_run", "fail_fast")]
)
def test_a_run_over_its_token_budget_is_stopped_once(
    agent: Agent, action: str, decided: str
) -> None:
    # forecast_s 0: the crossing alone (test_budget_forecast stops runs before the cap).
    agent.use_policy(
        f"version: 1\nrun_budget: {{max_tokens: 300, action: {action}, forecast_s: 0}}\n"
    )
    with agent.run():
        for city in ("Paris", "Rome", "Oslo", "Lima", "Pune"):
            response = agent.ask(Reply.tool_call("get_weather", {"city": city}, usage=(100, 20)))
            agent.answer_tool_calls(response)
    (outcome,) = agent.outcomes
    failure = outcome.failure
    assert (failure.kind, failure.failure_class.value, failure.rule, failure.span_id) == (
        "budget_exceeded",
        "permanent",
        "builtin.detect.run_budget",
        agent.llm_spans[2],  # 3 calls of 120 tokens crossed 300
    )
    assert failure.details["tokens"] == 360
    assert "max_tokens" in failure.message
    assert outcome.decision.action.value == decided
    (view,) = agent.tracker.snapshot(now=agent.now)
    assert (view.input_tokens, view.output_tokens) == (500, 100)
    per_input, per_output = agent.flavor.prices
    assert view.cost_usd == pytest.approx((500 * per_input + 100 * per_output) / 1e6)


# -- semantic verifiers -------------------------------------------------------------------

VERIFIERS = f"""\
version: 1
verifiers:
  - name: answer_is_json
    match: {{service: ["{SERVICE}"], role: [llm]}}
    output_json_schema: {{type: object, required: [answer]}}
"""


def test_an_answer_that_is_not_the_promised_json_fails_verification(agent: Agent) -> None:
    agent.use_policy(VERIFIERS)
    with agent.run():
        agent.ask(Reply.text(json.dumps({"answer": "sunny"})), tools=False)
        agent.say("And tomorrow?")
        agent.ask(Reply.text("Tomorrow it will rain."), tools=False)
    (outcome,) = agent.outcomes
    failure = outcome.failure
    assert (failure.kind, failure.failure_class.value, failure.rule, failure.span_id) == (
        "verification_failed",
        "semantic",
        "verifier.answer_is_json",
        agent.llm_spans[1],
    )
    assert (failure.dependency, failure.role.value) == (agent.flavor.dependency, "llm")
    assert failure.message.startswith("answer_is_json: output is not JSON")


def test_a_turn_that_only_calls_tools_is_not_judged_as_the_answer(
    agent: Agent, request: pytest.FixtureRequest
) -> None:
    agent.use_policy(VERIFIERS)
    with agent.run():
        agent.answer_tool_calls(agent.ask(Reply.tool_call("get_weather", {"city": "Paris"})))
        agent.ask(Reply.text(json.dumps({"answer": "sunny"})))
    assert [o.failure.message for o in agent.outcomes] == []
