"""A small tool-using agent, instrumented with OpenInference, for `spanvisor demo`.

It is an ordinary agent: the real ``openai`` client, OpenInference's
instrumentation, and OTLP export to wherever ``OTEL_EXPORTER_OTLP_ENDPOINT``
points (the sidecar). It knows nothing of spanvisor. Each run asks the model
for a few steps; the model may call tools; tools can fail, and one of them
catches its own errors and returns them as text, as many real tools do.

Run it on its own against any OpenAI-compatible endpoint:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 python examples/demo_agent.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import openai
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the internal docs.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]


def get_weather(city: str) -> str:
    if city.lower() == "atlantis":
        raise TimeoutError(f"weather service did not answer for {city} within 5s")
    return f"It is sunny in {city}."


def search_docs(query: str) -> str:
    # Catches its own errors and hands them to the model as text, as LangChain's
    # handle_tool_error does: the span's status stays OK.
    try:
        if "secret" in query:
            raise PermissionError(f"search index denies access to {query!r}")
        return f"3 documents match {query!r}."
    except PermissionError as exc:
        return f"Error: PermissionError: {exc}"


def run_tool(tracer: trace.Tracer, name: str, arguments: str) -> str:
    with tracer.start_as_current_span(f"tool {name}") as span:
        span.set_attribute("openinference.span.kind", "TOOL")
        span.set_attribute("tool.name", name)
        span.set_attribute("tool.parameters", arguments)
        span.set_attribute("input.value", arguments)
        args = json.loads(arguments or "{}")
        if name == "get_weather":
            result = get_weather(str(args.get("city", "")))
        elif name == "search_docs":
            result = search_docs(str(args.get("query", "")))
        else:
            result = f"Error: {name} is not a valid tool, try one of [get_weather, search_docs]."
        span.set_attribute("output.value", result)
        return result


def run_once(
    client: openai.OpenAI, tracer: trace.Tracer, number: int, steps: int, model: str
) -> bool:
    with tracer.start_as_current_span(f"agent run {number}") as root:
        root.set_attribute("openinference.span.kind", "AGENT")
        root.set_attribute("session.id", f"demo-run-{number}")
        messages: list[Any] = [
            {"role": "user", "content": f"Plan trip {number}: weather and docs."}
        ]
        root.set_attribute("input.value", messages[0]["content"])
        failed = False
        for step in range(steps):
            try:
                reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            except openai.OpenAIError as exc:
                print(
                    f"run {number} step {step}: LLM call failed: {type(exc).__name__}",
                    file=sys.stderr,
                )
                failed = True
                continue
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            for call in choice.message.tool_calls or []:
                fn = getattr(call, "function", None)
                if fn is None:
                    continue
                try:
                    output = run_tool(tracer, fn.name, fn.arguments)
                except Exception as exc:  # the agent survives a failing tool
                    output = f"tool failed: {type(exc).__name__}"
                    failed = True
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        root.set_attribute("output.value", "done" if not failed else "done with errors")
        if failed:
            root.set_status(Status(StatusCode.ERROR, "the run had failed steps"))
        return not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--service", default="demo-agent")
    args = parser.parse_args(argv)

    provider = TracerProvider(resource=Resource.create({"service.name": args.service}))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318").rstrip("/")
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces"), schedule_delay_millis=200
        )
    )
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    tracer = provider.get_tracer("demo-agent")
    client = openai.OpenAI(max_retries=0, timeout=2.0)
    ok = 0
    try:
        for number in range(1, args.runs + 1):
            ok += run_once(client, tracer, number, args.steps, args.model)
    finally:
        OpenAIInstrumentor().uninstrument()
        provider.shutdown()
    print(f"demo agent: {ok} of {args.runs} runs finished without errors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
