"""Fault-tolerance policies: the YAML model, classification rules and decisions.

Judges records from :mod:`supervisor.records` and returns decisions; never does I/O
beyond reading a policy file.

    policy = load_policy()                      # the built-in default policy
    policy = load_policy("policy.yaml")         # a user policy layered on top of it
    verdict = policy.classify(record)           # Classification | None
    decision = policy.decide(failure, attempt=2)
"""

from policies._loader import json_schema, load_policy
from policies._policy import Policy

__all__ = ["Policy", "json_schema", "load_policy"]
