"""Fault-tolerance policies: the YAML model, classification rules and decisions.

Judges records from :mod:`supervisor.records` and returns decisions; never does I/O
beyond reading a policy file.

    policy = load_policy()                      # the built-in default policy
    policy = load_policy("policy.yaml")         # a user policy layered on top of it
    verdict = policy.classify(record)           # Classification | None
    decision = policy.decide(failure, attempt=2)
    governor = Governor(policy)                 # breakers, retry budget, restart intensity
    governor.observe_calls([(end_ns, "openai:gpt-4o", ok)])
    decision = governor.review(failure, decision)
"""

from policies._breakers import BreakerState
from policies._governor import Governor
from policies._loader import json_schema, load_policy
from policies._policy import Policy
from policies._schema import BUILTIN_REMEDIATORS, RemediatorBudgetSpec, RemediatorSpec

__all__ = [
    "BUILTIN_REMEDIATORS",
    "BreakerState",
    "Governor",
    "Policy",
    "RemediatorBudgetSpec",
    "RemediatorSpec",
    "json_schema",
    "load_policy",
]
