"""The deployable examples in ``config/`` stay true to the code they deploy.

A misspelt ``SPANVISOR_*`` variable is only a warning in the sidecar's log, a
wrong flag only fails when the pod starts, and a wrong port only shows as spans
that go nowhere: so the names, flags, files and ports in the Kubernetes sidecar
manifest and the example settings file are checked against the real settings
model, CLI parser and policy loader here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.cli.verbs import build_parser, main
from supervisor.settings import LOOPBACK, Settings, load_settings
from tests.kubelet import container_env

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "config" / "kubernetes-sidecar.yaml"
EXAMPLE_SETTINGS = ROOT / "config" / "spanvisor.yaml"

ENV_PREFIX = str(Settings.model_config.get("env_prefix"))
#: Every variable the settings loader reads: one per field of the model.
SETTING_VARS = frozenset(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)

FLEET_BEGIN = "# >>> fleet variant"
FLEET_END = "# <<< fleet variant"
FLEET_VARS = {
    "SPANVISOR_BREAKER_REDIS_URL",
    "SPANVISOR_DATABASE_URL",
    "SPANVISOR_INSTANCE_ID",
    "SPANVISOR_REMEDIATION_DATABASE_URL",
    "SPANVISOR_REMEDIATION_EXECUTOR_ID",
}
#: Stand-ins for what the Secrets and the downward API would put in the environment.
SECRET_VALUES = {
    "api-token": "t0k3n-" + "x" * 40,
    "research-agent-webhook-secret": "whsec-" + "y" * 32,
    "redis-url": "redis://:password@redis.spanvisor.svc:6379/0",
    "postgres-url": "postgresql://spanvisor:password@postgres.spanvisor.svc:5432/spanvisor",
}
POD_NAME = "research-agent-6d8f7c9b5-x2x7q"


def _default(field: str) -> Any:
    return Settings.model_fields[field].default


def _uncomment_fleet(text: str) -> str:
    """The manifest as it reads once the fleet variant is uncommented.

    Inside the block, ``# `` marks a line to uncomment and ``## `` prose that
    stays a comment, so the test proves uncommenting gives valid YAML.
    """
    lines = text.splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip().startswith(FLEET_BEGIN))
    end = next(i for i, line in enumerate(lines) if line.strip().startswith(FLEET_END))
    assert begin < end
    for i in range(begin + 1, end):
        lines[i] = re.sub(r"^(\s*)# ", r"\1", lines[i])
    return "\n".join(lines) + "\n"


MANIFEST_TEXT = MANIFEST.read_text(encoding="utf-8")
VARIANTS = ("fleet", "sidecar")


def _variant(name: str) -> str:
    return _uncomment_fleet(MANIFEST_TEXT) if name == "fleet" else MANIFEST_TEXT


def _documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    everyone: list[dict[str, Any]] = [*pod.get("initContainers", []), *pod.get("containers", [])]
    found = [c for c in everyone if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}"
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return container_env(container, SECRET_VALUES, POD_NAME)


def _config_files(docs: list[dict[str, Any]], tmp_path: Path) -> dict[str, Path]:
    """The ConfigMap's files, written out as the volume mount would show them."""
    data: dict[str, str] = _one(docs, "ConfigMap")["data"]
    paths = {}
    for key, text in data.items():
        paths[key] = tmp_path / key
        paths[key].write_text(text, encoding="utf-8")
    return paths


@pytest.fixture
def no_spanvisor_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Only the file (and what a test sets) decides: conftest sets SPANVISOR_* of its own."""
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


def _settings(docs: list[dict[str, Any]], tmp_path: Path) -> Settings:
    return load_settings(_config_files(docs, tmp_path)["spanvisor.yaml"])


# --------------------------------------------------------------------- manifest


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifest_parses_as_kubernetes_documents(variant: str) -> None:
    docs = _documents(_variant(variant))
    assert sorted(doc["kind"] for doc in docs) == ["ConfigMap", "Deployment"]
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"]
    spanvisor = _container(_pod(docs), "spanvisor")
    named = {name for name in _env(spanvisor) if name.startswith(ENV_PREFIX)}
    # The fleet block adds exactly its variables, and nothing else changes.
    expected = {"SPANVISOR_API_TOKEN"} | (FLEET_VARS if variant == "fleet" else set())
    assert named == expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_spanvisor_variable_named_is_a_setting(variant: str) -> None:
    # The raw text, comments included: a name in a comment is copied into manifests too.
    named = set(re.findall(rf"\b{ENV_PREFIX}[A-Z0-9_]+", _variant(variant)))
    assert named, "the manifest names no SPANVISOR_* variable"
    assert named <= SETTING_VARS, f"not settings: {sorted(named - SETTING_VARS)}"
    assert named >= FLEET_VARS


def test_fleet_environment_loads_with_the_real_settings(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    docs = _documents(_variant("fleet"))
    env = _env(_container(_pod(docs), "spanvisor"))
    for name, value in env.items():
        no_spanvisor_env.setenv(name, value)
    settings = _settings(docs, tmp_path)
    assert settings.api_token == SECRET_VALUES["api-token"]
    assert settings.breaker_redis_url == SECRET_VALUES["redis-url"]
    assert settings.database_url == SECRET_VALUES["postgres-url"]
    assert settings.remediation_database_url == SECRET_VALUES["postgres-url"]
    assert settings.remediation_executor_id == POD_NAME
    assert settings.instance() == POD_NAME
    # The own spans say which pod they came from.
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"k8s.pod.name={POD_NAME}"


def test_run_arguments_are_accepted_by_the_cli(tmp_path: Path) -> None:
    docs = _documents(MANIFEST_TEXT)
    pod = _pod(docs)
    spanvisor = _container(pod, "spanvisor")
    assert spanvisor["command"] == ["spanvisor"]
    args = build_parser().parse_args(spanvisor["args"])  # SystemExit on an unknown flag
    assert args.verb == "run"
    # --config and --policy name files of the mounted ConfigMap.
    mounts = {m["name"]: m["mountPath"] for m in spanvisor["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    mount = Path(mounts[volume["name"]])
    keys = set(_one(docs, "ConfigMap")["data"])
    assert args.config.parent == mount and args.config.name in keys
    assert args.policy.parent == mount and args.policy.name in keys


def test_embedded_settings_load(tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch) -> None:
    settings = _settings(_documents(MANIFEST_TEXT), tmp_path)
    # State and token on the writable volume; the root filesystem is read-only.
    pod = _pod(_documents(MANIFEST_TEXT))
    spanvisor = _container(pod, "spanvisor")
    assert spanvisor["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [Path(m["mountPath"]) for m in spanvisor["volumeMounts"] if not m.get("readOnly")]
    for path in (settings.state_path, settings.token_file):
        assert any(path.is_relative_to(mount) for mount in writable), path


def test_embedded_policy_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    policy = _config_files(_documents(MANIFEST_TEXT), tmp_path)["policy.yaml"]
    assert main(["validate", str(policy)]) == 0, capsys.readouterr().err
    assert ": ok (" in capsys.readouterr().out


def test_ports_are_the_defaults(tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch) -> None:
    assert (_default("otlp_grpc_port"), _default("otlp_http_port"), _default("api_port")) == (
        4317,
        4318,
        4320,
    )
    docs = _documents(MANIFEST_TEXT)
    settings = _settings(docs, tmp_path)
    assert (settings.otlp_grpc_port, settings.otlp_http_port, settings.api_port) == (
        4317,
        4318,
        4320,
    )
    agent = _env(_container(_pod(docs), "agent"))
    assert agent["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{LOOPBACK}:{settings.otlp_http_port}"
    assert agent["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def test_loopback_api_is_probed_from_inside_the_container(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    docs = _documents(MANIFEST_TEXT)
    settings = _settings(docs, tmp_path)
    assert settings.host == LOOPBACK and settings.api_host == LOOPBACK
    spanvisor = _container(_pod(docs), "spanvisor")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = spanvisor[kind]
        # The kubelet's httpGet/tcpSocket probes dial the pod IP: loopback needs exec.
        assert set(probe) & {"exec", "httpGet", "tcpSocket", "grpc"} == {"exec"}, kind
        command = probe["exec"]["command"]
        assert command[:2] == ["python", "-c"], kind
        compile(command[2], f"<{kind}>", "exec")  # a typo would fail every probe
        urls = re.findall(r"https?://[^'\"]+", command[2])
        assert urls == [f"http://{LOOPBACK}:{settings.api_port}/healthz"], kind


def test_native_sidecar_outlives_the_agent_and_may_drain(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    docs = _documents(MANIFEST_TEXT)
    pod = _pod(docs)
    assert [c["name"] for c in pod["initContainers"]] == ["spanvisor"]
    assert pod["initContainers"][0]["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["containers"]] == ["agent"]
    # Room for the drain and the stores' and forwarder's closing, after the agent's stop.
    settings = _settings(docs, tmp_path)
    assert pod["terminationGracePeriodSeconds"] >= settings.drain_timeout_s + 20


def test_commands_reach_the_agent_container(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    docs = _documents(MANIFEST_TEXT)
    settings = _settings(docs, tmp_path)
    pod = _pod(docs)
    agent = _env(_container(pod, "agent"))
    spanvisor = _env(_container(pod, "spanvisor"))
    delivery = settings.agents[agent["OTEL_SERVICE_NAME"]]
    assert delivery.webhook is not None
    assert delivery.webhook.url.startswith(f"http://{LOOPBACK}:")
    # Both sides hold the signing secret under the name the settings give it.
    secret_env = delivery.webhook.secret_env
    assert secret_env is not None and spanvisor[secret_env] == agent[secret_env]
    no_spanvisor_env.setenv(secret_env, spanvisor[secret_env])
    assert delivery.webhook.resolved_secret() == SECRET_VALUES["research-agent-webhook-secret"]
    # The agent's client library and the sidecar share one API token.
    assert agent["SPANVISOR_API_TOKEN"] == spanvisor["SPANVISOR_API_TOKEN"]


# ------------------------------------------------------------- settings file


def test_example_settings_file_loads(no_spanvisor_env: pytest.MonkeyPatch) -> None:
    settings = load_settings(EXAMPLE_SETTINGS)
    # It shows the default ports, and an agent on each channel.
    ports = ("otlp_grpc_port", "otlp_http_port", "api_port")
    assert [getattr(settings, port) for port in ports] == [_default(port) for port in ports]
    assert {settings.agents[name].channel for name in settings.agents} == {
        "webhook",
        "command",
        "pull",
    }


# The collector's config: tests/test_config_deploy.py, with the central manifest.


# -------------------------------------------------------------------- documents


# A document named in a comment, with the section quoted after it: `README, "Deployment"`,
# `README's measurements ("Performance"`, `docs/commands.md, "Signatures"`.
_DOCUMENT_SECTION = re.compile(r'(?P<doc>README|[\w./-]+\.md)\b[^"\n]{0,40}"(?P<section>[^"]+)"')
_DOCUMENT = re.compile(r"\b(?:README|[\w./-]+\.md)\b")


def _headings(document: Path) -> set[str]:
    lines = document.read_text(encoding="utf-8").splitlines()
    return {line.lstrip("#").strip() for line in lines if line.startswith("#")}


@pytest.mark.parametrize("path", sorted((ROOT / "config").iterdir()), ids=lambda p: p.name)
def test_every_document_named_is_in_the_repository(path: Path) -> None:
    """A comment that sends the reader to a document sends them to one they have."""
    text = path.read_text(encoding="utf-8")
    for name in _DOCUMENT.findall(text):
        document = ROOT / ("README.md" if name == "README" else name)
        assert document.is_file(), f"{path.name} names {name}, which is not in the repository"
    for found in _DOCUMENT_SECTION.finditer(text):
        document = ROOT / ("README.md" if found["doc"] == "README" else found["doc"])
        assert found["section"] in _headings(document), (
            f"{path.name} names the section {found['section']!r} of {found['doc']},"
            " which has no such heading"
        )
