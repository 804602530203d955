"""End to end with a real trace viewer: Arize Phoenix as the sidecar's downstream.

Real processes, all on loopback: a Phoenix server (``python -m
phoenix.server.main serve``, SQLite in the test's directory, telemetry and
external resources off), a ``spanvisor run`` sidecar whose
``OTEL_EXPORTER_OTLP_ENDPOINT`` is Phoenix (it forwards the agent's batches
there unchanged and exports its own spans there), and the example agent
``examples/webhook_agent.py`` (the ``openai`` SDK instrumented with
``opentelemetry-instrumentation-openai-v2``, exporting OTLP/HTTP to the
sidecar) against the fake provider, which answers the run's first model call
with a 503.

The policy remediates ``unavailable`` with the built-in ``retry_step``
remediator, so the one failure is classified (transient / unavailable),
decided (``remediate``), and remediated (a durable workflow sends
``retry_step`` to the agent's webhook; the retried step succeeds, which
verifies the remediation and ends its root span).

Everything is then found through Phoenix's REST API
(``GET /v1/projects/{project}/spans``), as a Phoenix user would:

* the agent's failing LLM span (status ERROR);
* the ``spanvisor.decide`` span in the same trace, its parent the failing span,
  with the ``spanvisor.*`` attributes;
* the remediation's root span ``spanvisor.remediate <name>`` in a trace of its
  own. Phoenix keeps no span links, so it is found by searching its
  ``spanvisor.trigger.trace_id`` / ``spanvisor.trigger.span_id`` attributes
  (``attribute=key:"value"``), which equal the failing span's ids.

Projects: Phoenix files each ``ResourceSpans`` under its resource attribute
``openinference.project.name`` (else ``default``), and a trace stays in the
project of its first span. The agent and the sidecar both get
``OTEL_RESOURCE_ATTRIBUTES=openinference.project.name=...`` (both build their
resource with ``Resource.create``, which reads it): the decision spans join
the agent's trace wherever it is, but a remediation is a new trace and lands
in the sidecar's own project, ``default`` unless the sidecar is told.

The fixtures run the processes; the tests poll Phoenix (bounded) and assert,
each with Phoenix's answer and the processes' log tails on failure.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import FaultSchedule, ProviderRequest, tool_then_text
from supervisor.testing.sidecar_process import SidecarProcess, free_port, stop_process, tail
from supervisor.testing.sidecar_process import wait_until as poll_until

ROOT = Path(__file__).resolve().parent.parent


def _phoenix_python() -> tuple[str, str] | None:
    """The Python that runs the Phoenix server and Phoenix's version; None to skip.

    Phoenix is a server of its own and pins ``anthropic<2`` where this test
    environment has 2.x, so .ci/run installs the ``phoenix`` extra in a venv
    of its own, ``.venv-phoenix``; ``SPANVISOR_PHOENIX_PYTHON`` names another,
    and a Phoenix installed beside the tests is used last. The distribution
    is checked, not imported: importing Phoenix loads ~7,500 modules, and the
    client package alone (arize-phoenix-client) has no server.
    """
    candidates = [
        os.environ.get("SPANVISOR_PHOENIX_PYTHON", ""),
        str(ROOT / ".venv-phoenix/bin/python"),
    ]
    check = "import importlib.metadata as m; print(m.version('arize-phoenix'))"
    for python in filter(None, candidates):
        if Path(python).exists():
            found = subprocess.run(
                [python, "-c", check], capture_output=True, text=True, timeout=60, check=False
            )
            if found.returncode == 0:
                return python, found.stdout.strip()
    try:
        return sys.executable, importlib.metadata.version("arize-phoenix")
    except importlib.metadata.PackageNotFoundError:
        return None


_FOUND = _phoenix_python()
if _FOUND is None:
    pytest.skip(
        "no Phoenix server: install the 'phoenix' extra in .venv-phoenix (as .ci/run does)"
        " or set SPANVISOR_PHOENIX_PYTHON",
        allow_module_level=True,
    )
PHOENIX_PYTHON, PHOENIX_VERSION = _FOUND

pytestmark = pytest.mark.slow

T = TypeVar("T")

AGENT = ROOT / "examples" / "webhook_agent.py"
SECRET = "phoenix-e2e-webhook-secret-0123"
TOKEN = "phoenix-e2e-api-token-0123456789"
SERVICE = "phoenix-e2e-agent"
PROJECT = "spanvisor-e2e"
MODEL = "gpt-4o-mini"
REMEDIATOR = "retry_unavailable"
RUN_PREFIX = "phx"
#: What no child inherits: nothing in this environment may steer it elsewhere.
DROPPED_ENV = ("OTEL_", "SPANVISOR_", "PHOENIX_", "OPENAI_")

# Only the remediation decides: no breaker, budget or intensity gets in the way.
POLICY = f"""\
version: 1
breakers: {{enabled: false}}
retry_budget: {{enabled: false}}
restart_intensity: {{enabled: false}}
detectors: {{loops: {{enabled: false}}}}
remediators:
  {REMEDIATOR}:
    use: retry_step
    params: {{delay_s: 0.2}}
    verify_window_s: 20
    on_unresolved: none
policies:
  - name: e2e.remediate_unavailable
    match: {{kind: unavailable}}
    action: remediate
    remediator: {REMEDIATOR}
"""


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """:func:`~supervisor.testing.sidecar_process.wait_until`, asking Phoenix 4 times a second."""
    return poll_until(predicate, timeout_s, what, interval_s=0.25)


def clean_env() -> dict[str, str]:
    """This process's environment without anything that would steer a child elsewhere."""
    return {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV)}


# -- Phoenix ----------------------------------------------------------------------------------


@dataclass
class Phoenix:
    process: subprocess.Popen[bytes]
    url: str
    grpc_port: int
    log_path: Path

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10, trust_env=False)
        response.raise_for_status()
        return response.json()

    def spans(self, project: str = PROJECT, **params: Any) -> list[dict[str, Any]]:
        """``GET /v1/projects/{project}/spans`` (all pages); [] while the project is unknown."""
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(20):
            query = {"limit": 1000, **params, **({"cursor": cursor} if cursor else {})}
            response = httpx.get(
                f"{self.url}/v1/projects/{project}/spans",
                params=query,
                timeout=10,
                trust_env=False,
            )
            if response.status_code == 404:  # no span of the project has arrived yet
                return []
            response.raise_for_status()
            body = response.json()
            found.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                break
        return found


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """One Phoenix server for the module: it takes ~10 s to migrate its database and start."""
    work = tmp_path_factory.mktemp("phoenix")
    http_port, grpc_port = free_port(), free_port()
    env = {
        **clean_env(),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http_port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_SQL_DATABASE_URL": f"sqlite:///{work / 'phoenix.db'}",
        # Nothing leaves the machine: no analytics pixels, no fonts, no WASM download.
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
        # Its migrations otherwise log every SQL statement (~400 KB).
        "PHOENIX_LOG_MIGRATIONS": "false",
    }
    log_path = work / "phoenix.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [PHOENIX_PYTHON, "-m", "phoenix.server.main", "serve"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=work,
        )
    server = Phoenix(process, f"http://127.0.0.1:{http_port}", grpc_port, log_path)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(
                f"Phoenix {PHOENIX_VERSION} exited at start ({process.returncode}):\n"
                f"{tail(log_path)}"
            )
        try:
            return httpx.get(f"{server.url}/readyz", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        try:
            wait_until(ready, 90, f"Phoenix {PHOENIX_VERSION} to be ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- Phoenix log\n{tail(log_path)}") from None
        yield server
    finally:
        stop_process(process, 15)


# -- the sidecar, the fake provider, the agent --------------------------------------------------


@dataclass
class Scenario:
    """What ran, and what the processes left behind."""

    phoenix: Phoenix
    sidecar: SidecarProcess
    fake: FaultSchedule
    agent_log: Path
    agent_returncode: int | None
    summary: dict[str, Any] = field(default_factory=dict)

    def diagnostics(self) -> str:
        """The sidecar's, the agent's and Phoenix's side of the story."""
        parts = [
            "--- agent: exit " + str(self.agent_returncode),
            tail(self.agent_log, 30),
            "--- agent summary",
            json.dumps(self.summary.get("runs", []), indent=1)[:4000],
            "--- fake provider",
            "\n".join(
                f"#{s.request.number} {s.request.model} {s.request.last_role}->{s.status} {s.fault}"
                for s in self.fake.served
            )[-3000:],
        ]
        for path in ("/v1/incidents", "/v1/remediations"):
            try:
                parts += [f"--- sidecar {path}", json.dumps(self.sidecar.get(path))[:3000]]
            except (httpx.HTTPError, ValueError) as exc:
                parts += [f"--- sidecar {path}: {exc}"]
        parts += ["--- sidecar log (tail)", tail(self.sidecar.log_path, 40)]
        try:
            projects = self.phoenix.get("/v1/projects")["data"]
            parts += ["--- Phoenix projects", json.dumps([p["name"] for p in projects])]
            for project in projects:
                spans = self.phoenix.spans(project["name"])
                parts += [f"--- Phoenix spans in {project['name']!r} ({len(spans)})"]
                parts += [describe(s) for s in spans[:60]]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            parts += [f"--- Phoenix: {exc}"]
        parts += ["--- Phoenix log (tail)", tail(self.phoenix.log_path, 20)]
        return "\n".join(parts)


def describe(span: dict[str, Any]) -> str:
    """One line per span: enough to see the tree and the ``spanvisor.*`` attributes."""
    context = span.get("context", {})
    ours = {k: v for k, v in span.get("attributes", {}).items() if k.startswith("spanvisor.")}
    return (
        f"{span.get('name')!r} trace={context.get('trace_id')} span={context.get('span_id')}"
        f" parent={span.get('parent_id')} status={span.get('status_code')}"
        f" {json.dumps(ours)[:400]}"
    )


def _email(request: ProviderRequest) -> dict[str, Any]:
    return {"to": "oncall@example.com", "subject": request.last_user_text[:60]}


@pytest.fixture(scope="module")
def scenario(phoenix: Phoenix, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """Sidecar in front of Phoenix; one agent run whose first model call gets a 503."""
    tmp = tmp_path_factory.mktemp("phoenix-e2e")
    fake = FaultSchedule(
        answer=tool_then_text("send_email", _email, "Told the on-call team.")
    ).start()
    webhook_port = free_port()
    settings = {
        "api_token": TOKEN,
        "drain_timeout_s": 5,
        "agents": {
            SERVICE: {
                "webhook": {
                    "url": f"http://127.0.0.1:{webhook_port}/commands",
                    "secret": SECRET,
                    "timeout_s": 2,
                },
            }
        },
    }
    project = f"openinference.project.name={PROJECT}"
    sidecar = SidecarProcess(
        settings,
        tmp,
        policy=POLICY,
        # The standard variables: forwarded and own spans go to Phoenix's OTLP/HTTP
        # receiver (the sidecar appends /v1/traces), under the agent's project.
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url, "OTEL_RESOURCE_ATTRIBUTES": project},
        drop_env_prefixes=DROPPED_ENV,
        startup_timeout_s=30,
    )
    agent: subprocess.Popen[bytes] | None = None
    try:
        sidecar.start()
        # The run's first model call (step 0, the user's turn) fails with a 503.
        fake.burst(
            Reply.server_error(503),
            model=MODEL,
            when=lambda r: r.model == MODEL and r.last_role == "user",
            name="503",
        )
        summary_path, agent_log = tmp / "summary.json", tmp / "agent.log"
        agent_env = {
            **clean_env(),
            "OPENAI_BASE_URL": fake.base_url,
            "OPENAI_API_KEY": "sk-fake",
            "OTEL_EXPORTER_OTLP_ENDPOINT": sidecar.otlp_endpoint,
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_RESOURCE_ATTRIBUTES": project,
            "AGENT_WEBHOOK_SECRET": SECRET,
        }
        argv = [
            sys.executable,
            str(AGENT),
            f"--model={MODEL}",
            "--runs=1",
            "--steps=1",
            f"--run-prefix={RUN_PREFIX}",
            f"--webhook-port={webhook_port}",
            f"--effects={tmp / 'effects.jsonl'}",
            f"--summary={summary_path}",
            "--command-timeout-s=20",
            "--run-timeout-s=40",
            "--llm-timeout-s=5",
            "--export-delay-ms=50",
        ]
        with agent_log.open("wb") as agent_file:
            agent = subprocess.Popen(
                argv, env=agent_env, stdout=agent_file, stderr=subprocess.STDOUT
            )
        returncode: int | None
        try:
            returncode = agent.wait(45)
        except subprocess.TimeoutExpired:
            stop_process(agent, 5)  # the agent writes its summary on SIGTERM
            returncode = None
        summary = (
            json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else {}
        )
        yield Scenario(phoenix, sidecar, fake, agent_log, returncode, summary)
    finally:
        if agent is not None:
            stop_process(agent, 5)
        sidecar.stop(15)
        fake.stop()


@contextlib.contextmanager
def explained(scenario: Scenario) -> Iterator[None]:
    """Append every process's side of the story to a failed assertion."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n\n{scenario.diagnostics()}") from None


# -- what Phoenix shows --------------------------------------------------------------------------

#: Phoenix ingests in the background; the sidecar exports its own spans every second.
ARRIVAL_S = 30.0


def failing_llm_span(scenario: Scenario) -> dict[str, Any]:
    """The agent's LLM span that got the 503, as Phoenix has it (waits for it, bounded)."""

    def find() -> dict[str, Any] | None:
        failed = [
            s
            for s in scenario.phoenix.spans(status_code="ERROR")
            if str(s["name"]).startswith("chat ")
        ]
        return failed[0] if len(failed) == 1 else None

    return wait_until(find, ARRIVAL_S, f"one failed LLM span ('chat ...') in Phoenix {PROJECT!r}")


def test_the_agent_run_was_remediated(scenario: Scenario) -> None:
    """The premise of the rest: one 503, one remediation, a retry_step, a completed run."""
    with explained(scenario):
        assert scenario.agent_returncode == 0
        [run] = scenario.summary["runs"]
        assert run["status"] == "completed"
        assert [f["status_code"] for f in run["failures"]] == [503]
        assert [(c["type"], c["acted"]) for c in run["commands"]] == [("retry_step", "retried")]
        incidents = [
            i for i in scenario.sidecar.get("/v1/incidents")["incidents"] if i["service"] == SERVICE
        ]
        assert [(i["kind"], i["action"]) for i in incidents] == [("unavailable", "remediate")]


def test_phoenix_has_the_agents_failing_llm_span(scenario: Scenario) -> None:
    with explained(scenario):
        failing = failing_llm_span(scenario)
        assert failing["name"] == f"chat {MODEL}"
        assert failing["status_code"] == "ERROR"
        assert "503" in failing["status_message"]
        assert failing["attributes"].get("gen_ai.request.model") == MODEL
        # The sidecar's incident names this very span: Phoenix got the agent's ids unchanged.
        [incident] = [
            i for i in scenario.sidecar.get("/v1/incidents")["incidents"] if i["service"] == SERVICE
        ]
        context = failing["context"]
        assert (context["trace_id"], context["span_id"]) == (
            incident["trace_id"],
            incident["span_id"],
        )
        # The whole run arrived: its root, both attempts at the step, and the model
        # calls (the 503, then the retry's tool call and its answer).
        expected = [f"chat {MODEL}"] * 3 + [f"invoke_agent {SERVICE}", "step 0", "step 0"]

        def whole_run() -> list[str] | None:
            names = sorted(
                s["name"]
                for s in scenario.phoenix.spans(trace_id=context["trace_id"])
                if not str(s["name"]).startswith(("spanvisor.", "execute_tool "))
            )
            return names if names == sorted(expected) else None

        wait_until(whole_run, ARRIVAL_S, f"the agent's whole run in Phoenix: {expected}")


def test_phoenix_has_the_decide_span_under_the_failing_span(scenario: Scenario) -> None:
    with explained(scenario):
        failing = failing_llm_span(scenario)
        trace_id, span_id = failing["context"]["trace_id"], failing["context"]["span_id"]

        def decided() -> list[dict[str, Any]]:
            # Found the way a Phoenix user filters: by the decision's attributes.
            return scenario.phoenix.spans(
                name="spanvisor.decide",
                trace_id=trace_id,
                attribute=[
                    'spanvisor.action:"remediate"',
                    'spanvisor.failure.kind:"unavailable"',
                    # A decision's parameters are searchable too: no attribute name
                    # is also a namespace (Phoenix keeps attributes as a tree).
                    f'spanvisor.decision.remediator:"{REMEDIATOR}"',
                ],
            )

        [decide] = wait_until(decided, ARRIVAL_S, "the spanvisor.decide span in the agent's trace")
        assert decide["context"]["trace_id"] == trace_id
        assert decide["parent_id"] == span_id
        attributes = decide["attributes"]
        assert attributes["spanvisor.failure.class"] == "transient"
        assert attributes["spanvisor.failure.kind"] == "unavailable"
        assert attributes["spanvisor.failure.dependency"] == f"openai:{MODEL}"
        assert attributes["spanvisor.action"] == "remediate"
        assert attributes["spanvisor.policy"] == "e2e.remediate_unavailable"
        assert attributes["spanvisor.service"] == SERVICE
        assert attributes["spanvisor.run_id"] == trace_id  # the agent's run is its trace
        assert len(attributes["spanvisor.remediation.trace_id"]) == 32


def test_phoenix_finds_the_remediation_by_the_trigger_ids(scenario: Scenario) -> None:
    """Phoenix keeps no span links: the trigger's ids as attributes are how it is found."""
    with explained(scenario):
        failing = failing_llm_span(scenario)
        trace_id, span_id = failing["context"]["trace_id"], failing["context"]["span_id"]

        def searched() -> list[dict[str, Any]]:
            # What a Phoenix user types: JSON-quoted, since an id of digits only
            # would otherwise be read as a number.
            return scenario.phoenix.spans(
                attribute=[
                    f'spanvisor.trigger.trace_id:"{trace_id}"',
                    f'spanvisor.trigger.span_id:"{span_id}"',
                ]
            )

        [root] = wait_until(
            searched, ARRIVAL_S, "a span whose spanvisor.trigger.* attributes name the failing span"
        )
        assert root["name"] == f"spanvisor.remediate {REMEDIATOR}"
        assert root["parent_id"] is None  # the root of a trace of its own
        remediation_trace, root_id = root["context"]["trace_id"], root["context"]["span_id"]
        assert remediation_trace != trace_id
        attributes = root["attributes"]
        assert attributes["spanvisor.trigger.trace_id"] == trace_id
        assert attributes["spanvisor.trigger.span_id"] == span_id
        assert attributes["spanvisor.remediator"] == REMEDIATOR
        assert attributes["spanvisor.service"] == SERVICE
        assert attributes["spanvisor.remediation.outcome"] == "succeeded"
        # Both ways: the decision names the remediation's trace.
        [decide] = scenario.phoenix.spans(name="spanvisor.decide", trace_id=trace_id)
        assert decide["attributes"]["spanvisor.remediation.trace_id"] == remediation_trace

        # The remediation's steps are in its trace, under its root; one sent retry_step.
        def steps() -> list[dict[str, Any]] | None:
            found = [
                s
                for s in scenario.phoenix.spans(trace_id=remediation_trace)
                if s["context"]["span_id"] != root_id
            ]
            names = {s["name"] for s in found}
            return found if "spanvisor.tool retry_step" in names else None

        found = wait_until(steps, ARRIVAL_S, "the remediation's retry_step span under its root")
        assert {s["parent_id"] for s in found} == {root_id}
