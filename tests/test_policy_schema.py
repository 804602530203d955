"""``spanvisor schema`` accepts what ``spanvisor validate`` accepts, and refuses what it refuses.

An editor that checks a policy file against the JSON Schema must not flag a file
that loads (``on_exhausted: escalate`` once was), nor pass one the loader refuses
for a reason a schema can state. Checked with the reference ``jsonschema``
library on every policy in the repository (files, README and docs examples, the
policies written inline in Python: tests, benches, ``spanvisor init``'s), and on
generated policies: valid ones built from the file's grammar, then mutated.

What a JSON Schema cannot say is listed in :mod:`policies._schema_json`; a policy
the schema passes and the loader refuses must be refused for those reasons only
(:data:`SCHEMA_BLIND`). Two gaps come from the data model, not the schema, and are
not generated: YAML values JSON lacks (``.inf``, dates, non-string keys), and an
integral float such as ``3.0`` where an integer is wanted (JSON Schema calls it an
integer, the strict loader does not).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import json_schema, load_policy
from policies._yamldoc import parse
from supervisor.cli.init_verb import STARTER_POLICY
from supervisor.errors import PolicyError

ROOT = Path(__file__).resolve().parent.parent

#: Messages of the loader's checks that no JSON Schema can state (see policies._schema_json).
SCHEMA_BLIND = re.compile(
    "|".join(
        [
            r"bad regex",
            r"duplicate name",
            r"two verifiers are named",
            r"unknown kind",
            r"unknown remediator",
            r"is its own fallback",
            r"is above",  # wait.min/max, attribute_range min/max, success_threshold
            r"must not exceed",  # stalls min_idle_s/max_idle_s
            r"must be longer than",  # slo windows
            r"can never be reached",  # slo burn_alert
            r"low <= high",  # a status range 599-500
            r"JSON Schema",  # a verifier's own output_json_schema
        ]
    )
)


@cache
def _validator() -> Any:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _schema_errors(data: object) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in _validator().iter_errors(data)]


def _validate_issues(text: str) -> list[str]:
    """What ``spanvisor validate`` says of ``text``: nothing when it loads."""
    try:
        load_policy(text=text, source="p.yaml")
    except PolicyError as exc:
        return [f"{issue.path}: {issue.message}" for issue in exc.issues]
    return []


def _check_agreement(text: str, data: object) -> None:
    """The schema and the loader agree on ``data`` (the YAML ``text``), up to SCHEMA_BLIND."""
    schema_errors = _schema_errors(data)
    issues = _validate_issues(text)
    if not issues:
        assert not schema_errors, f"validate accepts, the schema refuses:\n{text}\n{schema_errors}"
    elif not schema_errors:
        seen = [issue for issue in issues if not SCHEMA_BLIND.search(issue)]
        assert not seen, f"the schema accepts, validate refuses:\n{text}\n{seen}"


# --------------------------------------------------------------------------- the repository's


def _yaml_blocks(markdown: Path) -> Iterator[tuple[str, str]]:
    text = markdown.read_text(encoding="utf-8")
    for index, block in enumerate(re.findall(r"```ya?ml\n(.*?)```", text, re.S)):
        if re.search(r"^version: 1$", block, re.M):
            yield f"{markdown.relative_to(ROOT)}#{index}", block


def _policy_files() -> list[tuple[str, str]]:
    """Every policy a user may copy: files, Markdown examples, ``spanvisor init``'s."""
    found = [("config/policy.yaml", (ROOT / "config" / "policy.yaml").read_text("utf-8"))]
    for markdown in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found.extend(_yaml_blocks(markdown))
    found.append(("spanvisor init", STARTER_POLICY))
    return found


def _inline_policies() -> list[tuple[str, str]]:
    """Policies written as plain string literals in Python (tests, benches): valid or not."""
    found: list[tuple[str, str]] = []
    for folder in ("tests", "bench", "examples", "supervisor"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and re.match(r"(#[^\n]*\n)*version: 1\n", node.value)
                ):
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value))
    return found


def test_the_repository_holds_policies_to_check() -> None:
    names = [name for name, _ in _policy_files()]

    assert "README.md#0" in names
    assert len(_inline_policies()) > 50


@pytest.mark.parametrize(("name", "text"), _policy_files(), ids=lambda v: str(v)[:40])
def test_every_policy_file_and_example_loads_and_fits_the_schema(name: str, text: str) -> None:
    assert _validate_issues(text) == []
    assert _schema_errors(parse(text, name).data) == []


def test_the_builtin_policy_fits_the_schema_but_for_its_reserved_names() -> None:
    path = ROOT / "policies" / "default_policy.yaml"
    text = path.read_text("utf-8")
    renamed = text.replace("name: builtin.", "name: my.")

    assert _validate_issues(text)  # a copy of the built-in policy: refused by both
    assert _schema_errors(parse(text, str(path)).data)
    assert "builtin." not in "".join(re.findall(r"name: \S+", renamed))
    assert _validate_issues(renamed) == []
    assert _schema_errors(parse(renamed, str(path)).data) == []


def test_inline_policies_get_the_same_verdict_from_both() -> None:
    checked = 0
    for name, text in _inline_policies():
        try:
            data = parse(text, name).data
        except PolicyError:
            continue  # bad YAML: no schema sees it
        _check_agreement(text, data)
        checked += 1

    assert checked > 50


@pytest.mark.parametrize("version", ["1", "true", "1.5", "'1'", "2"])
def test_only_version_1_is_a_policy_file(version: str) -> None:
    text = f"version: {version}\n"

    assert (_validate_issues(text) == []) is (version == "1")
    assert (_schema_errors(yaml.safe_load(text)) == []) is (version == "1")


# --------------------------------------------------------------------------- shorthands


@pytest.mark.parametrize(
    ("fragment", "accepted"),
    [
        ("on_exhausted: escalate", True),
        ("on_exhausted: fail_fast", True),
        ("on_exhausted: none", True),
        ("on_exhausted: fallback", True),
        ("on_exhausted: remediate", False),  # needs its remediator
        ("on_exhausted: retry", False),
        ("on_exhausted: {action: fallback, on_exhausted: fail_fast}", True),
        ("wait: {multiplier: 0.5, max: 20}", True),  # type: exponential when left out
        ("wait: {seconds: 1}", False),  # a fixed wait says so
        ("wait: {type: random_exponential, jitter: full}", True),
    ],
)
def test_retry_shorthands(fragment: str, accepted: bool) -> None:
    text = f"version: 1\npolicies:\n  - name: r\n    action: retry\n    {fragment}\n"

    assert (_validate_issues(text) == []) is accepted
    assert (_schema_errors(yaml.safe_load(text)) == []) is accepted


@pytest.mark.parametrize(
    ("match", "accepted"),
    [
        ("{role: tool, swallowed: true}", True),
        ("{role: [tool, llm]}", True),
        ("{role: robot}", False),
        ("{http_status: 429}", True),
        ("{http_status: ['5xx', '500-504', [400, 404], ' 418 ']}", True),
        ("{http_status: '5XX'}", True),
        ("{http_status: 600}", False),
        ("{http_status: '6xx'}", False),
        ("{http_status: '50x'}", False),
        ("{http_status: [[500]]}", False),
        ("{grpc_code: [14, UNAVAILABLE, deadline_exceeded]}", True),
        ("{grpc_code: 17}", False),
        ("{grpc_code: UNAVAILABLE_}", False),
        ("{attributes: {a.b: 1, c: {regex: '^x'}}}", True),
        ("{attributes: {c: {regex: x, flags: i}}}", False),
        ("{service: '[!a]x', span_name: '[]]'}", True),
        ("{service: '[a'}", False),
        ("{service: ''}", False),
        ("{service: []}", False),
        ("{finish_reason: ''}", False),
    ],
)
def test_rule_match_forms(match: str, accepted: bool) -> None:
    text = f"version: 1\nrules:\n  - name: r\n    match: {match}\n    class: model\n    kind: k\n"

    assert (_validate_issues(text) == []) is accepted
    assert (_schema_errors(yaml.safe_load(text)) == []) is accepted


@pytest.mark.parametrize(
    ("fragment", "accepted"),
    [
        ("fallbacks: {'[': [b]}", False),  # a key that is no glob
        ("fallbacks: {a: [b, b]}", False),
        ("fallbacks: {a: [' b']}", False),
        ("remediators: {'9x': {use: llm}}", False),
        ("remediators: {fix: {use: 'pkg.mod:Fixer', params: {a-b: 1}}}", True),
        ("remediators: {fix: {use: 'pkg.mod:'}}", False),
        ("rules: [{name: builtin.mine, class: model, kind: k}]", False),
        ("rules: [{name: r, class: model, kind: k, dependency: 'tool:{tool}'}]", True),
        ("rules: [{name: r, class: model, kind: k, dependency: '{nope}'}]", False),
        ("verifiers: [{name: v, output_json: true}]", True),
        ("verifiers: [{name: v, output_json: false}]", False),
        ("verifiers: [{name: v}]", False),
        ("verifiers: [{name: v, output_json: true, output_empty: true}]", False),
        ("verifiers: [{name: v, output_json: true, output_empty: null}]", True),
        ("verifiers: [{name: v, attribute_range: {key: k}}]", False),
        ("verifiers: [{name: v, attribute_range: {key: k, max: 3}}]", True),
        ("verifiers: [{name: v, output_regex: {pattern: x, flags: ignorecase}}]", True),
        ("verifiers: [{name: v, output_regex: {pattern: x, flags: [nocase]}}]", False),
        ("admission: {default: {rpm: 60, tpm: 90000}}", True),
        ("admission: {keys: {'openai:gpt-4o@team-a': {rpm: 100, floor: 0.2}}}", True),
        ("admission: {keys: {'openai': {rpm: 100}}}", False),  # no model
        ("admission: {keys: {'openai:gpt-4o@a b': {rpm: 100}}}", False),
        ("admission: {default: {rpm: 0}}", False),
        ("admission: {default: {decrease: 1}}", False),
        ("admission: {default: {rpm: 60, burst: 3}}", False),
        ("admission: {services: {planner: {weight: 2}}}", True),
        ("admission: {services: {planner: {weight: 0}}}", False),
        ("admission: {services: {'': {weight: 2}}}", False),
        ("admission: {services: {planner: 2}}", False),
    ],
)
def test_other_sections(fragment: str, accepted: bool) -> None:
    text = f"version: 1\n{fragment}\n"

    assert (_validate_issues(text) == []) is accepted
    assert (_schema_errors(yaml.safe_load(text)) == []) is accepted


# --------------------------------------------------------------------------- generated policies


def _one_or_many(item: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(item, st.lists(item, min_size=1, max_size=3))


def _obj(
    required: dict[str, st.SearchStrategy[Any]] | None = None, **optional: Any
) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(required or {}, optional=optional)


GLOBS = st.sampled_from(["*", "openai:*", "*Timeout*", "tool:search", "[!a]x", "[]]", "svc-?"])
KINDS = st.sampled_from(["timeout", "rate_limit", "unavailable", "auth", "tool_error"])
CLASSES = st.sampled_from(["transient", "model", "permanent", "semantic"])
ROLES = st.sampled_from(["llm", "tool", "agent", "chain", "http", "other"])
REGEXES = st.sampled_from(["timeout", "(?i)rate limit", "^x$", "a|b"])
STATUSES = st.sampled_from([429, 503, "5xx", "4XX", "500-599", " 502 ", "429", [500, 504]])
GRPC = st.sampled_from([14, 0, "UNAVAILABLE", "unavailable", "Deadline_Exceeded"])
SECONDS = st.one_of(st.integers(0, 30), st.floats(0.1, 30).map(lambda x: round(x, 2) + 0.001))
POSITIVE = st.one_of(st.integers(1, 30), st.just(0.5))
DEPENDENCIES = st.sampled_from(["openai:gpt-4o-mini", "anthropic:claude", "tool:search2"])
IDENTS = st.sampled_from(["fixer", "my_fix", "a.b-c"])

RULE_MATCH = _obj(
    exception_type=_one_or_many(GLOBS),
    error_type=_one_or_many(GLOBS),
    message=_one_or_many(REGEXES),
    http_status=_one_or_many(STATUSES),
    grpc_code=_one_or_many(GRPC),
    provider_code=_one_or_many(GLOBS),
    finish_reason=_one_or_many(st.sampled_from(["length", "content_filter"])),
    role=_one_or_many(ROLES),
    service=_one_or_many(GLOBS),
    dependency=_one_or_many(GLOBS),
    span_name=_one_or_many(GLOBS),
    attributes=st.dictionaries(
        st.sampled_from(["a", "b.c", "gen_ai.system"]),
        st.one_of(
            st.sampled_from(["x", 1, 2.5, True]),
            st.builds(lambda r: {"regex": r}, REGEXES),
        ),
        max_size=2,
    ),
    swallowed=st.booleans(),
    invalid_tool_call=st.booleans(),
)
DECISION_MATCH = _obj(
    **{"class": _one_or_many(CLASSES)},
    kind=_one_or_many(KINDS),
    dependency=_one_or_many(GLOBS),
    service=_one_or_many(GLOBS),
    role=_one_or_many(ROLES),
    rule=_one_or_many(GLOBS),
    slo_burning=st.booleans(),
)
WAIT = st.one_of(
    _obj({"type": st.just("fixed")}, seconds=SECONDS, jitter=st.sampled_from(["none", "full"])),
    _obj(
        type=st.just("exponential"),
        multiplier=POSITIVE,
        min=st.integers(0, 5),
        max=st.integers(10, 60),
        exp_base=st.sampled_from([1.5, 2, 3]),
        jitter=st.sampled_from(["none", "full", "equal"]),
    ),
    _obj({"type": st.just("random_exponential")}, max=st.integers(10, 60), jitter=st.just("full")),
)
CHAIN = st.dictionaries(
    GLOBS, st.lists(DEPENDENCIES, min_size=1, max_size=2, unique=True), max_size=2
)
ESCALATE = _obj(
    {"action": st.just("escalate")},
    timeout_s=POSITIVE,
    on_timeout=st.sampled_from(["abort", "resume"]),
)
EXHAUSTED = st.one_of(
    st.sampled_from(["escalate", "fail_fast", "none", "fallback"]),
    ESCALATE,
    _obj({"action": st.sampled_from(["fail_fast", "none"])}),
    _obj({"action": st.just("remediate"), "remediator": st.just("retry_step")}),
    _obj(
        {"action": st.just("fallback")},
        chain=CHAIN,
        on_exhausted=st.sampled_from(["escalate", "fail_fast"]),
    ),
)
ENTRY_COMMON = {"match": DECISION_MATCH, "observe": st.booleans(), "description": st.just("d")}
ENTRY = st.one_of(
    _obj(
        {"action": st.just("retry")},
        max_attempts=st.integers(1, 10),
        wait=WAIT,
        honour_retry_after=st.booleans(),
        max_retry_after_s=SECONDS,
        on_exhausted=EXHAUSTED,
        **ENTRY_COMMON,
    ),
    _obj({"action": st.just("fallback")}, chain=CHAIN, on_exhausted=EXHAUSTED, **ENTRY_COMMON),
    _obj({"action": st.just("remediate"), "remediator": st.just("loop_breaker")}, **ENTRY_COMMON),
    _obj({"action": st.just("escalate")}, timeout_s=POSITIVE, **ENTRY_COMMON),
    _obj({"action": st.sampled_from(["fail_fast", "none"])}, **ENTRY_COMMON),
)
RULE = _obj(
    {"class": CLASSES, "kind": st.sampled_from(["timeout", "my_kind"])},
    match=RULE_MATCH,
    description=st.just("d"),
    dependency=st.sampled_from(["tool:search", "{provider}:{model}", "x{{y}}"]),
)
BREAKER = _obj(
    fail_max=st.integers(1, 10),
    reset_timeout_s=POSITIVE,
    success_threshold=st.integers(1, 2),
    half_open_trials=st.integers(2, 5),
    resume_spread_s=SECONDS,
    slow_call_s=POSITIVE,
    slow_call_rate=st.sampled_from([0.1, 0.5, 1]),
    min_calls=st.integers(1, 100),
)
REMEDIATOR = _obj(
    {"use": st.sampled_from(["llm", "fallback_switch", "pkg.mod:Fixer"])},
    tools=st.lists(st.sampled_from(["retry_step", "pause_run", "recent_spans"]), max_size=2),
    budget=_obj(steps=st.integers(1, 20), tokens=st.integers(0, 1000), deadline_s=POSITIVE),
    params=st.dictionaries(IDENTS, st.sampled_from([1, "x", [1], {"a": None}]), max_size=2),
    verify_window_s=SECONDS,
    on_unresolved=st.sampled_from(["escalate", "abort_run", "none"]),
)
SERVICE_DETECTORS = _obj(
    loops=_obj(enabled=st.booleans(), repeats=st.integers(2, 5), window=st.integers(5, 20)),
    stalls=_obj(idle_seconds=POSITIVE, idle_multiple=st.integers(1, 8), min_idle_s=POSITIVE),
    reanchor=_obj(after_steps=st.integers(1, 50), every_steps=st.integers(1, 10)),
)
VERIFIER_CHECKS = st.one_of(
    st.just({"output_empty": True}),
    st.just({"output_json": True}),
    st.just({"final_answer_empty": True}),
    st.builds(lambda s: {"output_json_schema": s}, st.sampled_from([{"type": "object"}, {}])),
    st.builds(
        lambda p, f: {"output_regex": {"pattern": p, "flags": f}},
        REGEXES,
        _one_or_many(st.sampled_from(["ignorecase", "dotall"])),
    ),
    st.builds(
        lambda lo: {"attribute_range": {"key": "tokens", **lo}},
        st.sampled_from([{"min": 0}, {"max": 10.5}, {"min": 1, "max": 8000}]),
    ),
)
VERIFIER = st.builds(
    lambda match, check: {**match, **check},
    _obj(match=_obj(service=_one_or_many(GLOBS), role=_one_or_many(ROLES))),
    VERIFIER_CHECKS,
)


def _named(items: st.SearchStrategy[dict[str, Any]], prefix: str) -> st.SearchStrategy[Any]:
    """A list of ``items``, each with its own name (names first, as people write them)."""
    return st.lists(items, max_size=3).map(
        lambda found: [{"name": f"{prefix}{i}", **item} for i, item in enumerate(found)]
    )


POLICY = _obj(
    {"version": st.just(1)},
    builtin=st.booleans(),
    observe=st.booleans(),
    rules=_named(RULE, "rule."),
    policies=_named(ENTRY, "entry."),
    fallbacks=st.dictionaries(
        GLOBS, st.lists(DEPENDENCIES, min_size=1, max_size=3, unique=True), max_size=2
    ),
    breakers=_obj(
        enabled=st.booleans(),
        default=BREAKER,
        dependencies=st.dictionaries(GLOBS, BREAKER, max_size=2),
    ),
    retry_budget=_obj(ratio=st.sampled_from([0.1, 0.5, 2]), min_retries=st.integers(0, 5)),
    restart_intensity=_obj(max_actions=st.integers(1, 20), period_s=POSITIVE),
    admission=_obj(
        enabled=st.booleans(),
        default=_obj(rpm=POSITIVE, tpm=POSITIVE, decrease=st.sampled_from([0.5, 0.7])),
        keys=st.dictionaries(
            st.sampled_from(["openai:gpt-4o", "anthropic:claude-3@team-a"]),
            _obj(rpm=POSITIVE, floor=st.sampled_from([0.1, 1])),
            max_size=2,
        ),
        services=st.dictionaries(
            st.sampled_from(["planner", "search.agent"]), _obj(weight=POSITIVE), max_size=2
        ),
    ),
    remediators=st.dictionaries(IDENTS, REMEDIATOR, max_size=2),
    detectors=st.builds(
        lambda own, services, cascades: {**own, **services, **cascades},
        SERVICE_DETECTORS,
        _obj(services=st.dictionaries(GLOBS, SERVICE_DETECTORS, max_size=2)),
        _obj(cascades=_obj(window_s=POSITIVE, min_failures=st.integers(2, 20))),
    ),
    context_pressure=_obj(
        share=st.sampled_from([0.5, 0.9, 1]),
        models=st.dictionaries(
            GLOBS,
            _obj(
                {"context_window": st.integers(1000, 200_000)},
                input_per_mtok=st.just(1.5),
                output_per_mtok=st.just(3),
            ),
            max_size=2,
        ),
    ),
    run_budget=_obj(
        max_tokens=st.integers(1, 10**6),
        max_cost_usd=POSITIVE,
        action=st.sampled_from(["escalate", "abort_run"]),
    ),
    slo=_obj(success_target=st.sampled_from([0.95, 0.99]), max_duration_s=POSITIVE),
    verifiers=_named(VERIFIER, "verify."),
)

#: What a mutation puts in place of a value: other types, near misses, shorthands.
REPLACEMENTS: list[Any] = [
    None,
    True,
    0,
    1,
    -1,
    2.5,
    10**13,
    "",
    "x",
    "Bad Name!",
    "builtin.x",
    "escalate",
    "fallback",
    "remediate",
    "5xx",
    "600",
    "500-599",
    "UNAVAILABLE",
    "[",
    "{model}",
    "{nope}",
    " pad",
    [],
    ["x"],
    [1, 2],
    {},
    {"regex": "a"},
    {"action": "escalate"},
    {"type": "fixed"},
]


def _paths(value: object, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield here
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*here, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*here, index))


def _mutated(doc: Any, path: tuple[Any, ...], how: int, replacement: Any) -> Any:
    """``doc`` with one change at ``path``: replaced, dropped, renamed, wrapped or extended."""
    if not path:
        if how == 2 and isinstance(doc, dict):
            return {**doc, "surprise": replacement}
        return replacement
    head, rest = path[0], path[1:]
    if isinstance(doc, list):
        copy = list(doc)
        copy[head] = _mutated(doc[head], rest, how, replacement)
        return copy
    if rest:
        return {**doc, head: _mutated(doc[head], rest, how, replacement)}
    out = dict(doc)
    if how == 0:
        out[head] = replacement
    elif how == 1:
        del out[head]
    elif how == 2 and isinstance(replacement, str):
        out = {(replacement if k == head else k): v for k, v in doc.items()}
    elif how == 3:
        out[head] = [doc[head]]
    elif how == 4 and isinstance(doc[head], dict):
        out[head] = {**doc[head], "surprise": 1}
    else:
        out[head] = replacement
    return out


@st.composite
def policies(draw: st.DrawFn) -> Any:
    """A policy from the grammar, then up to two mutations (none a third of the time)."""
    doc = draw(POLICY)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        path = draw(st.sampled_from(list(_paths(doc))))
        doc = _mutated(doc, path, draw(st.integers(0, 4)), draw(st.sampled_from(REPLACEMENTS)))
    return doc


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(policies())
def test_generated_policies_get_the_same_verdict_from_the_schema_and_validate(doc: Any) -> None:
    text = yaml.safe_dump(doc, sort_keys=False)

    _check_agreement(text, doc)
