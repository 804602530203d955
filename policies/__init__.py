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

Everything the sidecar uses from here is exported below; the ``policies._*``
modules are private.
"""

from policies._breakers import BreakerChange, BreakerState, SharedStorage
from policies._cascade import Cascade
from policies._detectors import DetectorSettings
from policies._forecast import Forecast
from policies._governor import RUN_KINDS, Governor, counts_for_breaker
from policies._loader import load_policy
from policies._model_table import ModelTable
from policies._pacer import Capacity
from policies._policy import Policy
from policies._regex import regex_timeouts
from policies._schema import BUILTIN_REMEDIATORS, RemediatorBudgetSpec, RemediatorSpec
from policies._schema_admission import AdmissionLimitSpec, AdmissionServiceSpec, AdmissionSpec
from policies._schema_budgets import ServiceBudgetSpec, SloSpec
from policies._schema_json import json_schema
from policies._service_spend import SERVICE_BUDGET_RULE, ServiceOutlook, ServiceSpend
from policies._slo import SloTracker
from policies._spend import ModelInfo, RunSpend
from policies._verifiers import VerificationFailure, VerifierSet
from policies._window_counter import (
    Admission,
    CascadeTally,
    Limit,
    WindowCounter,
    cascade_calls,
    window_buckets,
)

__all__ = [
    "BUILTIN_REMEDIATORS",
    "RUN_KINDS",
    "SERVICE_BUDGET_RULE",
    "Admission",
    "AdmissionLimitSpec",
    "AdmissionServiceSpec",
    "AdmissionSpec",
    "BreakerChange",
    "BreakerState",
    "Capacity",
    "Cascade",
    "CascadeTally",
    "DetectorSettings",
    "Forecast",
    "Governor",
    "Limit",
    "ModelInfo",
    "ModelTable",
    "Policy",
    "RemediatorBudgetSpec",
    "RemediatorSpec",
    "RunSpend",
    "ServiceBudgetSpec",
    "ServiceOutlook",
    "ServiceSpend",
    "SharedStorage",
    "SloSpec",
    "SloTracker",
    "VerificationFailure",
    "VerifierSet",
    "WindowCounter",
    "cascade_calls",
    "counts_for_breaker",
    "json_schema",
    "load_policy",
    "regex_timeouts",
    "window_buckets",
]
