"""The tools a remediator can be allowed: their arguments, checks, and effect.

Each tool has a JSON Schema for its arguments (given to LLM remediators as
function definitions) and a check that runs before anything happens. A call
is *refused*, never executed, when the tool is outside the remediation's
allowlist, when its arguments do not fit the schema, or when the policy does
not allow them (``switch_fallback`` only to an alternative in the failed
dependency's own fallback chain). Refusals are how instructions planted in
span text fail: the model may be talked into a call, the toolset still says no.

``restart_worker`` takes what it runs from the remediator's ``configured``
params (the policy's), never from its arguments; without a valid restart
command there, the call is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from remediators.base import AGENT_TOOLS, ALL_TOOLS, ToolResult, Trigger
from remediators.gateway import Gateway, WorkerRestart
from supervisor.act.commands import ESCALATION_PAUSE, MAX_PAUSE_S, PAUSE_OUTCOMES, agent_params
from supervisor.records import CommandType

__all__ = ["TOOL_SPECS", "ToolSpec", "check_arguments", "execute", "function_definitions"]

#: Longest text argument accepted (characters).
MAX_TEXT: Final = 2000
_MAX_LIST: Final = 64
_NOTHING_CONFIGURED: Final[Mapping[str, Any]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    #: argument -> (JSON type, required)
    arguments: Mapping[str, tuple[str, bool]]

    def schema(self) -> dict[str, Any]:
        properties: dict[str, Any] = {}
        for name, (kind, _) in self.arguments.items():
            if kind == "array":
                properties[name] = {"type": "array", "items": {"type": "string"}}
            else:
                properties[name] = {"type": kind}
        return {
            "type": "object",
            "properties": properties,
            "required": [name for name, (_, required) in self.arguments.items() if required],
            "additionalProperties": False,
        }


def _spec(name: str, description: str, **arguments: tuple[str, bool]) -> ToolSpec:
    return ToolSpec(name, description, arguments)


TOOL_SPECS: Final[Mapping[str, ToolSpec]] = {
    spec.name: spec
    for spec in (
        _spec(
            "retry_step",
            "Ask the agent to retry the failed step, after delay_s seconds.",
            delay_s=("number", False),
            reason=("string", False),
        ),
        _spec(
            "resume_run",
            "Ask the agent to resume the run from its checkpoint; list effects to verify first.",
            unverified=("array", False),
            reason=("string", False),
        ),
        _spec(
            "rewind_run",
            "Ask the agent to go back to an earlier checkpoint of the run, before the"
            " failed attempt, carrying a short summary of what went wrong.",
            summary=("string", True),
            reason=("string", False),
            tool=("string", False),
            steps_back=("integer", False),
            step=("string", False),
        ),
        _spec(
            "switch_fallback",
            "Ask the agent to use another dependency from the failed one's fallback chain.",
            to=("string", True),
            reason=("string", False),
        ),
        _spec(
            "pause_run",
            "Ask the agent to pause the run for at most timeout_s seconds (default 3600);"
            " then it resumes or aborts (on_timeout: resume or abort, default abort).",
            reason=("string", False),
            timeout_s=("number", False),
            on_timeout=("string", False),
        ),
        _spec("abort_run", "Ask the agent to abort the run.", reason=("string", False)),
        _spec(
            "inject_guidance",
            "Give the agent a short instruction for its next step.",
            guidance=("string", True),
        ),
        _spec(
            "compact_context",
            "Ask the agent to compact its context (summarize older turns).",
            target_tokens=("integer", False),
            reason=("string", False),
        ),
        _spec(
            "request_approval",
            "Ask a person to approve a proposed action; the answer arrives later.",
            question=("string", True),
            proposal=("string", False),
            on_approve=("string", False),
            on_deny=("string", False),
        ),
        _spec(
            "recent_spans",
            "Read the run's recent spans as the sidecar saw them.",
            limit=("integer", False),
        ),
        _spec(
            "incident_history",
            "Read earlier incidents of the same run or dependency.",
            limit=("integer", False),
        ),
        _spec("breaker_states", "Read the circuit breakers' states."),
        _spec(
            "restart_worker",
            "Restart the run's worker with the command the policy configures for this"
            " remediator (the command is not an argument).",
            reason=("string", False),
        ),
    )
}
assert set(TOOL_SPECS) == ALL_TOOLS  # the vocabulary: supervisor.records and remediators.base

_TYPES: Final[Mapping[str, tuple[type, ...]]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "array": (list, tuple),
}


def function_definitions(tools: frozenset[str]) -> list[dict[str, Any]]:
    """OpenAI-style function tools for an allowlist, in a stable order."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": TOOL_SPECS[name].description,
                "parameters": TOOL_SPECS[name].schema(),
            },
        }
        for name in sorted(tools)
    ]


def check_arguments(
    tool: str,
    arguments: Mapping[str, Any],
    trigger: Trigger,
    gateway: Gateway,
    configured: Mapping[str, Any] = _NOTHING_CONFIGURED,
) -> str:
    """Why the call must be refused, or ``""`` when it may run.

    ``configured`` is the remediator's params from the policy (trusted).
    """
    spec = TOOL_SPECS.get(tool)
    if spec is None:
        return f"unknown tool {tool[:64]!r}"
    for name, value in arguments.items():
        declared = spec.arguments.get(name)
        if declared is None:
            return f"{tool} takes no argument {str(name)[:64]!r}"
        kind, _ = declared
        if isinstance(value, bool) or not isinstance(value, _TYPES[kind]):
            return f"{tool}: {name} must be a {kind}"
        if isinstance(value, str) and len(value) > MAX_TEXT:
            return f"{tool}: {name} is longer than {MAX_TEXT} characters"
        if isinstance(value, (list, tuple)) and (
            len(value) > _MAX_LIST
            or not all(isinstance(v, str) and len(v) <= MAX_TEXT for v in value)
        ):
            return f"{tool}: {name} must be at most {_MAX_LIST} strings"
    missing = [n for n, (_, required) in spec.arguments.items() if required and n not in arguments]
    if missing:
        return f"{tool}: missing {', '.join(missing)}"
    if tool == "switch_fallback":
        chain = gateway.fallback_chain(trigger.dependency) or ()
        target = arguments["to"]
        if target not in chain or target == trigger.dependency:
            allowed = [d for d in chain if d != trigger.dependency]
            return (
                f"switch_fallback to {str(target)[:128]!r} is not in {trigger.dependency!r}'s"
                f" fallback chain ({', '.join(allowed) or 'none configured'})"
            )
    if tool == "rewind_run" and not 1 <= int(arguments.get("steps_back", 1)) <= 100:
        return "rewind_run: steps_back must be between 1 and 100"
    if tool == "pause_run":
        timeout = float(arguments.get("timeout_s", ESCALATION_PAUSE.timeout_s))
        if not 0 < timeout <= MAX_PAUSE_S:
            return f"pause_run: timeout_s must be more than 0 and at most {MAX_PAUSE_S:g}"
        if arguments.get("on_timeout", ESCALATION_PAUSE.on_timeout) not in PAUSE_OUTCOMES:
            return f"pause_run: on_timeout must be one of {', '.join(PAUSE_OUTCOMES)}"
    if tool == "retry_step":
        delay = arguments.get("delay_s", 0)
        if not 0 <= float(delay) <= 3600:
            return "retry_step: delay_s must be between 0 and 3600"
    if tool == "restart_worker":
        try:
            WorkerRestart.from_params(configured)
        except ValueError as exc:
            return f"restart_worker: no restart command in the remediator's params ({exc})"
    return ""


def _limit(arguments: Mapping[str, Any]) -> int:
    value = arguments.get("limit", 20)
    return max(1, min(50, int(value)))


def execute(
    tool: str,
    arguments: Mapping[str, Any],
    trigger: Trigger,
    gateway: Gateway,
    *,
    key: str,
    remediation_id: str,
    configured: Mapping[str, Any] = _NOTHING_CONFIGURED,
) -> ToolResult:
    """Run a checked call through the gateway (the caller checked the allowlist)."""
    if tool == "recent_spans":
        return ToolResult(True, gateway.recent_spans(trigger, _limit(arguments)))
    if tool == "incident_history":
        return ToolResult(True, gateway.incident_history(trigger, _limit(arguments)))
    if tool == "breaker_states":
        return ToolResult(True, gateway.breaker_states())
    if tool == "request_approval":
        return ToolResult(
            True, gateway.open_approval(trigger, arguments, key=key, remediation_id=remediation_id)
        )
    params: dict[str, Any] = {**arguments, "remediation_id": remediation_id}
    if tool in AGENT_TOOLS:
        # What the agent needs to act (the step, the model, the pause's deadline) is
        # completed as for the sidecar's own commands.
        params = agent_params(CommandType(tool), params, step=trigger.span_name)
        return ToolResult(True, gateway.send_command(trigger, tool, params, key=key))
    if tool == "restart_worker":
        restart = WorkerRestart.from_params(configured)
        ran = gateway.restart_worker(trigger, restart, params, key=key)
        ok = bool(ran.get("ok"))
        return ToolResult(ok, ran, error="" if ok else str(ran.get("detail") or "restart failed"))
    return ToolResult(False, error=f"unknown tool {tool[:64]!r}", refused=True)
