"""Whether a failing LLM span's streamed response had already begun.

Once chunks of an answer reached the agent, a fallback to another model
cannot take them back: the user has seen half an answer from one model and
would get the next half, or a whole second answer, from another (AWS Bedrock
AgentCore Gateway makes no fallback then either). What says the stream began,
in each convention:

- a time to the first chunk or token, above zero: OTel GenAI's
  ``gen_ai.response.time_to_first_chunk``, and ``gen_ai.response.time_to_first_token``
  that other GenAI instrumentations record;
- a first-token or chunk event, which only a stream has (OpenInference's
  ``First Token Stream Event``, OpenLLMetry's ``gen_ai.content.completion.chunk``,
  ``gen_ai.first_token``);
- a streaming request (``gen_ai.request.stream``, OpenLLMetry's
  ``gen_ai.is_streaming`` / ``llm.is_streaming``, ``llm.streaming``) that got
  output: output tokens above zero, or output text;
- output text with the finish reason ``error``: what the OTel GenAI
  instrumentations (``opentelemetry-instrumentation-openai-v2``) write when a
  stream breaks, with the chunks received so far (a call that failed before
  its answer has no output).

Read once, when a failing span is normalized (:mod:`.record`): the
governor reads the answer from the evidence, never the attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from supervisor.records import AttrValue

__all__ = ["FIRST_TOKEN_EVENTS", "STREAM_FLAGS", "TIME_TO_FIRST", "stream_began"]

#: Seconds from the request to the first chunk of a streamed response.
TIME_TO_FIRST: Final = (
    "gen_ai.response.time_to_first_chunk",
    "gen_ai.response.time_to_first_token",
)
#: The request asked for a streamed response.
STREAM_FLAGS: Final = (
    "gen_ai.request.stream",
    "gen_ai.is_streaming",
    "llm.is_streaming",
    "llm.streaming",
)
#: Events an instrumentation adds when the first chunk (or each chunk) arrives.
FIRST_TOKEN_EVENTS: Final = frozenset(
    {"First Token Stream Event", "gen_ai.content.completion.chunk", "gen_ai.first_token"}
)
#: Events looked at for a first-token event: it is recorded early, near the start.
_EVENT_SCAN: Final = 16


def stream_began(
    attrs: Mapping[str, AttrValue],
    output_tokens: int | None,
    output_text: str,
    finish_reasons: tuple[str, ...] = (),
    events: Iterable[Any] = (),
) -> bool:
    """Whether the span shows a streamed response that had begun (see the module)."""
    for key in TIME_TO_FIRST:
        value = attrs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    for n, event in enumerate(events):
        if n >= _EVENT_SCAN:
            break
        if event.name in FIRST_TOKEN_EVENTS:
            return True
    got_output = (output_tokens is not None and output_tokens > 0) or bool(output_text)
    if not got_output:
        return False
    return "error" in finish_reasons or any(_true(attrs.get(key)) for key in STREAM_FLAGS)


def _true(value: object) -> bool:
    """A flag set true, as a bool or as the string some instrumentations write."""
    return value is True or (isinstance(value, str) and value.lower() == "true")
