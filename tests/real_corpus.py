"""Spans of whole agent runs, written by the real instrumentations in this process.

Each builder runs a real agent (a hand-written loop on the ``openai`` client, a
LangGraph graph with ``ToolNode``, an OpenAI Agents SDK ``Runner``) against
:class:`FakeProvider`, instrumented as its ecosystem instruments it, and
returns what an exporter would send: one encoded OTLP request per run. Every
run asks the model, runs the tools it asks for and ends with the model's
answer, so a run whose script ends in a non-empty text is a healthy run: a
failure reported on it is a false positive.

The tools answer honestly, and some honest answers talk about errors
(``"Error rates fell to 0.1% ..."``, ``{"errors": [], "status": "ok"}``): what
a tool says is not a failure unless it is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import openai
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.tools import StructuredTool, ToolException
from langchain_openai import ChatOpenAI
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel
from pydantic.warnings import PydanticDeprecatedSince20
from typing_extensions import TypedDict

from supervisor.testing import FakeProvider, Reply

MODEL = "gpt-4o-mini"
CAPTURE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"

#: What the tools of the corpus answer: honest outputs, two of which talk about errors.
HONEST: dict[str, str] = {
    "get_weather": "Sunny in Paris, 21C",
    "search_logs": "Error rates fell to 0.1% after the deploy; no new exceptions since 10:02.",
    "check_health": json.dumps({"status": "ok", "errors": [], "checked": 12}),
}


class Order(BaseModel):
    id: int


def _raise(exc: Exception) -> Callable[[], str]:
    def fail() -> str:
        raise exc

    return fail


def _caught() -> str:
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except OSError as exc:  # the tool catches its own failure and says so
        return f"Error: {exc}"


#: ``read_file``'s ways to fail, by the query the model sends it.
FAILURES: dict[str, Callable[[], str]] = {
    "permission": _raise(PermissionError(13, "Permission denied", "/srv/quota_report.csv")),
    "not_found": _raise(FileNotFoundError(2, "No such file or directory", "notes.txt")),
    "timeout": _raise(TimeoutError("the file server did not answer in 5s")),
    "connection": _raise(ConnectionRefusedError(111, "Connection refused")),
    "backend_json": lambda: json.loads("<html>502 Bad Gateway</html>"),
    "backend_schema": lambda: Order.model_validate({"id": "x"}).model_dump_json(),
    "caught": _caught,
    # LangChain's own: with handle_tool_error the tool answers a ToolMessage, status "error".
    "tool_exception": _raise(ToolException("the archive is offline")),
    "fine": lambda: "line 1: all clear",
}
#: ``lookup`` answers like ``read_file``; under LangChain it handles its own argument
#: errors (``handle_validation_error``): an OK span whose ToolMessage says status "error".
TOOLS = (*HONEST, "read_file", "lookup")
_PARAMETERS = {"type": "object", "properties": {"query": {"type": "string"}}}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": _PARAMETERS}}
    for n in TOOLS
]

#: One step of a scripted run: ``("call", "tool")`` or ``("call", "tool:query")``,
#: ``("bad_args", tool)`` (arguments without the ``query``), ``("bad_json", tool)``
#: (arguments that are not JSON), or ``("answer", text)``.
Step = tuple[str, str]
_ARGUMENTS = {"bad_args": '{"city": "paris"}', "bad_json": "{query: paris"}


def healthy_script(run: int) -> list[Step]:
    """A run that calls one or two tools, then answers in words."""
    tools = list(HONEST)
    calls = [("call", tools[run % 3])]
    if run % 2:
        calls.append(("call", tools[(run + 1) % 3]))
    return [*calls, ("answer", f"All good (run {run}).")]


def _replies(script: Sequence[Step]) -> list[Reply]:
    out: list[Reply] = []
    for kind, what in script:
        tool, _, query = what.partition(":")
        if kind == "answer":
            out.append(Reply.text(what))
        elif kind == "call":
            out.append(Reply.tool_call(tool, json.dumps({"query": query or "paris"})))
        else:
            out.append(Reply.tool_call(tool, _ARGUMENTS[kind]))
    return out


def _provider(service: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _drain(exporter: InMemorySpanExporter) -> bytes:
    spans = exporter.get_finished_spans()
    exporter.clear()
    return encode_spans(spans).SerializeToString()


# -- a hand-written loop on the openai client ------------------------------------------------


@contextlib.contextmanager
def _openai_instrumented(flavor: str, provider: TracerProvider) -> Iterator[None]:
    """openai under ``openai_v2`` (capture on / off), ``openinference`` or ``openllmetry``."""
    instrumentor: Any
    with pytest_env(CAPTURE, "SPAN_ONLY" if flavor == "openai_v2" else None):
        if flavor.startswith("openai_v2"):
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

            instrumentor = OpenAIInstrumentor()  # type: ignore[no-untyped-call]
        elif flavor == "openinference":
            from openinference.instrumentation.openai import OpenAIInstrumentor as OIInstrumentor

            instrumentor = OIInstrumentor()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PydanticDeprecatedSince20)
                from opentelemetry.instrumentation.openai import (
                    OpenAIInstrumentor as TraceloopInstrumentor,
                )
            instrumentor = TraceloopInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PydanticDeprecatedSince20)
            instrumentor.instrument(tracer_provider=provider)
        try:
            yield
        finally:
            instrumentor.uninstrument()


@contextlib.contextmanager
def pytest_env(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (or unset) for the block, restored after."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _tool_runner(flavor: str, provider: TracerProvider) -> Callable[[str, str, str], str]:
    """How each ecosystem wraps a tool's execution: (tool, query, call id) -> result."""
    if flavor == "openinference":
        from openinference.instrumentation import OITracer, TraceConfig

        oi = OITracer(provider.get_tracer("agent"), TraceConfig())

        def oi_tool(tool: str, query: str, call_id: str) -> str:
            def body(query: str) -> str:
                return run_tool(tool, query)

            body.__name__ = tool
            result: str = oi.tool(name=tool)(body)(query=query)
            return result

        return oi_tool
    if flavor.startswith("openai_v2"):
        from opentelemetry.util.genai.handler import TelemetryHandler

        handler = TelemetryHandler(tracer_provider=provider)

        def genai_tool(tool: str, query: str, call_id: str) -> str:
            invocation = handler.tool(tool, tool_call_id=call_id, tool_type="function")
            with invocation:
                invocation.arguments = {"query": query}
                result = run_tool(tool, query)
                invocation.tool_result = result
            return result

        return genai_tool
    tracer = provider.get_tracer("agent")

    def sdk_tool(tool: str, query: str, call_id: str) -> str:
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.call.arguments": json.dumps({"query": query}),
        }
        with tracer.start_as_current_span(f"execute_tool {tool}", attributes=attributes) as span:
            result = run_tool(tool, query)
            span.set_attribute("gen_ai.tool.call.result", result)
        return result

    return sdk_tool


def run_tool(tool: str, query: str) -> str:
    """What a tool answers; ``read_file`` fails as its query says."""
    if tool in ("read_file", "lookup"):
        return FAILURES.get(query, FAILURES["fine"])()
    return HONEST.get(tool, f"no such tool: {tool}")


def openai_loop(
    flavor: str, fake: FakeProvider, scripts: Sequence[Sequence[Step]], service: str
) -> list[bytes]:
    """Runs of a hand-written tool loop: one request per run.

    ``flavor``: ``openai_v2`` (content captured on the span), ``openai_v2_off``
    (the default: nothing captured), ``openinference`` or ``openllmetry``.
    """
    provider, exporter = _provider(service)
    out: list[bytes] = []
    oi_root = flavor == "openinference"
    with (
        _openai_instrumented(flavor, provider),
        openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0) as client,
    ):
        tool_span = _tool_runner(flavor, provider)
        tracer = provider.get_tracer("agent")
        for script in scripts:
            fake.reset()  # what a run left unasked is not the next run's
            fake.script(*_replies(script))
            attributes: dict[str, Any] = (
                {"openinference.span.kind": "AGENT"}
                if oi_root
                else {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": service}
            )
            with tracer.start_as_current_span(f"invoke_agent {service}", attributes=attributes):
                messages: list[Any] = [{"role": "user", "content": "How is Paris doing?"}]
                for _ in range(len(script)):
                    response = client.chat.completions.create(
                        model=MODEL, messages=messages, tools=OPENAI_TOOLS
                    )
                    message = response.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        if oi_root:
                            trace.get_current_span().set_attribute(
                                "output.value", message.content or ""
                            )
                        break
                    for call in message.tool_calls:
                        query = json.loads(call.function.arguments)["query"]
                        try:
                            result = tool_span(call.function.name, query, call.id)
                        except Exception as exc:  # the loop tells the model, as agents do
                            result = f"{type(exc).__name__}: {exc}"
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": result}
                        )
            out.append(_drain(exporter))
    provider.shutdown()
    return out


# -- LangGraph with ToolNode -----------------------------------------------------------------


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@contextlib.contextmanager
def _langchain_instrumented(flavor: str, provider: TracerProvider) -> Iterator[None]:
    """LangChain instrumented by OpenInference (outputs shown or hidden) or by OpenLLMetry."""
    instrumentor: Any
    if flavor.startswith("openinference"):
        from openinference.instrumentation import TraceConfig
        from openinference.instrumentation.langchain import LangChainInstrumentor

        instrumentor = LangChainInstrumentor()
        config = TraceConfig(hide_outputs=flavor == "openinference_hidden")
        instrumentor.instrument(tracer_provider=provider, config=config)
    else:
        import opentelemetry.instrumentation.langchain as traceloop_langchain

        wrapped: list[tuple[str, str]] = []
        original = vars(traceloop_langchain)["wrap_function_wrapper"]  # wrapt's

        def recording(module: str, name: str, wrapper: Any) -> Any:
            done = original(module, name, wrapper)  # raises for what is not installed
            wrapped.append((module, name))
            return done

        instrumentor = traceloop_langchain.LangchainInstrumentor()
        traceloop_langchain.wrap_function_wrapper = recording  # type: ignore[attr-defined]
        try:
            instrumentor.instrument(tracer_provider=provider)
        finally:
            traceloop_langchain.wrap_function_wrapper = original  # type: ignore[attr-defined]
    try:
        yield
    finally:
        instrumentor.uninstrument()
        if not flavor.startswith("openinference"):
            _unwrap_all(wrapped)


def _unwrap_all(wrapped: list[tuple[str, str]]) -> None:
    """Undo what OpenLLMetry wrapped: its ``uninstrument`` (0.62) reads ``"Class.method"``
    as one attribute of the module and unwraps nothing, so later LangChain code in the
    process would go on writing spans to a provider that was shut down.
    """
    from opentelemetry.instrumentation.utils import unwrap

    for module, name in wrapped:
        owner: Any = importlib.import_module(module)
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(getattr(owner, attribute, None), "__wrapped__"):
            unwrap(owner, attribute)


def langgraph(
    flavor: str,
    fake: FakeProvider,
    scripts: Sequence[Sequence[Step]],
    service: str,
    *,
    handle_tool_errors: Any = True,
) -> list[bytes]:
    """Runs of a LangGraph ReAct graph (``ToolNode``, ``tools_condition``), one request each."""

    def make(name: str) -> Any:
        def body(query: str) -> str:
            return run_tool(name, query)

        return StructuredTool.from_function(
            body,
            name=name,
            description=f"{name}.",
            handle_tool_error=True,
            handle_validation_error=name == "lookup",
        )

    tools = [make(name) for name in TOOLS]
    provider, exporter = _provider(service)
    out: list[bytes] = []
    with _langchain_instrumented(flavor, provider):
        llm = ChatOpenAI(
            model=MODEL, base_url=fake.base_url, api_key="sk-fake", max_retries=0
        ).bind_tools(tools)

        def agent(state: State) -> dict[str, Any]:
            return {"messages": [llm.invoke(state["messages"])]}

        graph = StateGraph(State)
        graph.add_node("agent", agent)
        graph.add_node("tools", ToolNode(tools, handle_tool_errors=handle_tool_errors))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        compiled = graph.compile()
        for script in scripts:
            fake.reset()  # what a run left unasked is not the next run's
            fake.script(*_replies(script))
            with contextlib.suppress(Exception):  # a tool that raises ends the run: spans stay
                compiled.invoke({"messages": [HumanMessage("How is Paris doing?")]})
            out.append(_drain(exporter))
    provider.shutdown()
    return out


# -- the OpenAI Agents SDK -------------------------------------------------------------------


def agents_sdk(
    fake: FakeProvider,
    scripts: Sequence[Sequence[Step]],
    service: str,
    *,
    sensitive: bool = True,
    failure_error_function: Any = None,
) -> list[bytes]:
    """Runs of an Agents SDK agent with function tools, instrumented by OpenInference.

    ``sensitive``: the SDK's ``trace_include_sensitive_data`` (False: no inputs
    or outputs on the spans). ``failure_error_function``: the tools' own (None:
    the SDK's default).
    """
    from agents import (
        Agent,
        FunctionTool,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_trace_processors,
    )
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    provider, exporter = _provider(service)
    set_trace_processors([])  # nothing for OpenAI's tracing backend
    instrumentor = OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=provider)

    def make(name: str) -> FunctionTool:
        def body(query: str) -> str:
            return run_tool(name, query)

        body.__name__ = name
        body.__doc__ = f"{name}."
        options: dict[str, Any] = {}
        if failure_error_function is not None:
            options["failure_error_function"] = failure_error_function
        return function_tool(body, **options)

    tools = [make(name) for name in TOOLS]
    out: list[bytes] = []

    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        agent = Agent(name=service, instructions="Be brief.", tools=list(tools))
        config = RunConfig(model=model, trace_include_sensitive_data=sensitive)
        try:
            for script in scripts:
                fake.reset()  # what a run left unasked is not the next run's
                fake.script(*_replies(script))
                with contextlib.suppress(Exception):
                    await Runner.run(agent, "How is Paris doing?", run_config=config)
                out.append(_drain(exporter))
        finally:
            await client.close()

    try:
        asyncio.run(go())
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    return out
