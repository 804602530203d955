"""Finding a remediator by the policy's ``use:``: built-in, entry point, or dotted path.

Resolution happens at policy load (:func:`check_policy`, so a bad name is an
error the operator sees before anything fails) and again when a remediation
runs (a resumed one may run in a newer process).
"""

from __future__ import annotations

import functools
import importlib
from importlib import metadata
from typing import Any, Final

from policies import BUILTIN_REMEDIATORS, Policy, RemediatorSpec
from remediators.base import Budget, Remediator

__all__ = ["ENTRY_POINT_GROUP", "allowed_tools", "budget_of", "check_policy", "resolve"]

ENTRY_POINT_GROUP: Final = "spanvisor.remediators"

_BUILTIN_PATHS: Final = {
    "retry_step": "remediators.builtin:RetryStep",
    "fallback_switch": "remediators.builtin:FallbackSwitch",
    "loop_breaker": "remediators.builtin:LoopBreaker",
    "rewind": "remediators.builtin:Rewind",
    "escalate": "remediators.builtin:Escalate",
    "restart_worker": "remediators.builtin:RestartWorker",
    "llm": "remediators.llm:LlmRemediator",
    "compact_context": "remediators.builtin:CompactContext",
    "resume_run": "remediators.builtin:ResumeRun",
    "reanchor": "remediators.builtin:Reanchor",
}
assert tuple(_BUILTIN_PATHS) == BUILTIN_REMEDIATORS


class RemediatorNotFound(LookupError):
    """A ``use:`` that names no remediator."""


@functools.lru_cache(maxsize=256)
def resolve(use: str) -> type[Remediator]:
    """The remediator class that ``use`` names; raises :class:`RemediatorNotFound`."""
    path = _BUILTIN_PATHS.get(use)
    if path is None and ":" not in use:
        found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == use]
        if not found:
            raise RemediatorNotFound(
                f"no remediator {use!r}: not built in ({', '.join(BUILTIN_REMEDIATORS)}), not an"
                f" entry point in {ENTRY_POINT_GROUP!r}, and not 'package.module:Class'"
            )
        return _checked(use, found[0].load())
    module_name, _, attribute = (path or use).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RemediatorNotFound(
            f"cannot import {module_name!r} for remediator {use!r}: {exc}"
        ) from None
    target = getattr(module, attribute, None)
    if target is None:
        raise RemediatorNotFound(f"{module_name!r} has no {attribute!r} (remediator {use!r})")
    return _checked(use, target)


def _checked(use: str, target: Any) -> type[Remediator]:
    if not (isinstance(target, type) and issubclass(target, Remediator)):
        raise RemediatorNotFound(f"{use!r} is not a spanvisor Remediator subclass")
    return target


def allowed_tools(spec: RemediatorSpec, cls: type[Remediator]) -> frozenset[str]:
    """The remediation's allowlist: the policy's, else the remediator's own."""
    return frozenset(spec.tools) if spec.tools is not None else cls.tools


def budget_of(spec: RemediatorSpec) -> Budget:
    b = spec.budget
    return Budget(steps=b.steps, tool_calls=b.tool_calls, deadline_s=b.deadline_s, tokens=b.tokens)


def check_policy(policy: Policy) -> list[str]:
    """What is wrong with the policy's remediators, as messages naming each one."""
    problems: list[str] = []
    names = set(policy.remediators) | set(policy.remediators_used)
    for name in sorted(names):
        spec = policy.remediator(name)
        if spec is None:
            problems.append(f"remediator {name!r} is not defined")
            continue
        try:
            cls = resolve(spec.use)
        except RemediatorNotFound as exc:
            problems.append(f"remediators.{name}: {exc}")
            continue
        if spec.tools is not None:
            wider = sorted(set(spec.tools) - cls.tools)
            if wider:
                problems.append(
                    f"remediators.{name}.tools: {', '.join(wider)} not usable by {spec.use!r}"
                    f" (it may use {', '.join(sorted(cls.tools))})"
                )
        problems.extend(f"remediators.{name}.params: {p}" for p in cls.check_params(spec.params))
    return problems
