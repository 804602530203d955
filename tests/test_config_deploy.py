"""The container and central deployments in ``config/`` agree with the code and each other.

Every YAML file there loads; the collector routes by the session attributes the
sidecar itself reads as run ids (imported here, not retyped); the manifests name
only real settings, run the image the Dockerfile builds, and their ports, names
and tokens line up from the agents to the collector to each spanvisor instance.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.cli.verbs import build_parser, main
from supervisor.errors import ConfigError
from supervisor.normalize.identity import SESSION_KEYS
from supervisor.settings import LOOPBACK, Settings, load_settings
from supervisor.settings_sources import NOT_SETTINGS
from supervisor.wiring import _check_api_exposure, _check_otlp_exposure
from tests.dockerfile import final_stage, instructions
from tests.kubelet import container_env

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
CENTRAL = CONFIG / "kubernetes-central.yaml"
COLLECTOR = CONFIG / "otel-collector-loadbalancing.yaml"
MANIFESTS = (CONFIG / "kubernetes-sidecar.yaml", CENTRAL)
YAMLS = sorted(CONFIG.glob("*.yaml"))

ENV_PREFIX = str(Settings.model_config.get("env_prefix"))
SETTING_VARS = frozenset(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)
READ_BY_SPANVISOR = SETTING_VARS | {f"{ENV_PREFIX}{name}" for name in NOT_SETTINGS}
SECRET_VALUES = {
    "otlp-token": "o" * 44,
    "api-token": "a" * 44,
    "research-agent-webhook-secret": "whsec_" + "w" * 40,
    "redis-url": "redis://:password@redis.example.internal:6379/0",
    "postgres-url": "postgresql://spanvisor:password@postgres.example.internal:5432/spanvisor",
}
POD_NAME = "spanvisor-1"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return container_env(container, SECRET_VALUES, POD_NAME)


def _default(field: str) -> Any:
    return Settings.model_fields[field].default


CENTRAL_DOCS = _documents(CENTRAL)
SPANVISOR = _one(CENTRAL_DOCS, "StatefulSet", "spanvisor")
(SPANVISOR_CONTAINER,) = _containers(_pod(SPANVISOR))
COLLECTOR_DEPLOYMENT = _one(CENTRAL_DOCS, "Deployment", "otel-collector")
(COLLECTOR_CONTAINER,) = _containers(_pod(COLLECTOR_DEPLOYMENT))
COLLECTOR_CONFIG: dict[str, Any] = yaml.safe_load(COLLECTOR.read_text(encoding="utf-8"))


@pytest.fixture
def no_spanvisor_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


def _central_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings one instance starts with: its environment and the mounted ConfigMap."""
    data = _one(CENTRAL_DOCS, "ConfigMap", "spanvisor-config")["data"]
    env = _env(SPANVISOR_CONTAINER)
    mount = _mount(SPANVISOR_CONTAINER, SPANVISOR, "spanvisor-config")
    config = Path(env["SPANVISOR_CONFIG"])
    assert config.parent == mount and config.name in data
    (tmp_path / config.name).write_text(data[config.name], encoding="utf-8")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPANVISOR_CONFIG", str(tmp_path / config.name))
    return load_settings(os.environ["SPANVISOR_CONFIG"])


def _mount(container: dict[str, Any], workload: dict[str, Any], config_map: str) -> Path:
    volume = next(
        v["name"]
        for v in _pod(workload)["volumes"]
        if v.get("configMap", {}).get("name") == config_map
    )
    return Path(next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume))


# ------------------------------------------------------------------ every file


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_yaml_in_config_loads(path: Path) -> None:
    docs = _documents(path)
    assert docs
    for doc in docs:
        assert isinstance(doc, dict)
        if "apiVersion" in doc:
            assert doc["kind"] and doc["metadata"]["name"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_set_only_variables_spanvisor_reads(path: Path) -> None:
    for doc in _documents(path):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in _containers(_pod(doc)):
            named = {n for n in _env(container) if n.startswith(ENV_PREFIX)}
            assert named <= READ_BY_SPANVISOR, f"not read: {sorted(named - READ_BY_SPANVISOR)}"
    # Comments too, since they are copied into manifests: real names, or the one to come.
    mentioned = set(re.findall(rf"\b{ENV_PREFIX}[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert mentioned <= READ_BY_SPANVISOR, sorted(mentioned - READ_BY_SPANVISOR)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_run_the_image_the_dockerfile_builds(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    images = {
        c["image"]
        for doc in _documents(path)
        if doc["kind"] in ("Deployment", "StatefulSet")
        for c in _containers(_pod(doc))
        if c["name"] == "spanvisor"
    }
    assert len(images) == 1
    image = images.pop()
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None and image.endswith(f":{version.group(1)}")
    # The build and push commands in the comments make that very image.
    assert f"docker build -t {image} ." in text
    assert f"docker push {image}" in text
    # The pod runs as the image's user.
    (user,) = [i.args for i in final_stage(instructions()) if i.keyword == "USER"]
    for doc in _documents(path):
        if doc["kind"] in ("Deployment", "StatefulSet") and any(
            c["image"] == image for c in _containers(_pod(doc))
        ):
            context = _pod(doc)["securityContext"]
            assert f"{context['runAsUser']}:{context['runAsGroup']}" == user


# ------------------------------------------------------------- the collector


RUN_KEY_SET = re.compile(
    r'set\(attributes\["(?P<target>[^"]+)"\], attributes\["(?P<source>[^"]+)"\]\)'
    r' where attributes\["(?P=source)"\] != nil and attributes\["(?P=source)"\] != ""'
)
TRACE_FALLBACK = re.compile(
    r'set\(attributes\["(?P<target>[^"]+)"\], trace_id\.string\)'
    r' where attributes\["(?P=target)"\] == nil'
)


def test_collector_routes_by_the_session_attributes_the_sidecar_reads() -> None:
    exporter = COLLECTOR_CONFIG["exporters"]["loadbalancing"]
    assert exporter["routing_key"] == "attributes"
    (run_key,) = exporter["routing_attributes"]  # one: the key is all of them together
    pipeline = COLLECTOR_CONFIG["service"]["pipelines"]["traces"]
    transforms = [p for p in pipeline["processors"] if p.startswith("transform")]
    assert len(transforms) == 1
    assert pipeline["exporters"] == ["loadbalancing"]
    (group,) = COLLECTOR_CONFIG["processors"][transforms[0]]["trace_statements"]
    assert group["context"] == "span"
    *by_session, fallback = group["statements"]
    found = [RUN_KEY_SET.fullmatch(s) for s in by_session]
    assert all(found), [s for s, m in zip(by_session, found, strict=True) if not m]
    assert {m["target"] for m in found if m} == {run_key}
    # The last set wins: the statements run in the reverse of the sidecar's order, so
    # the first session attribute with a value names the run, as in session_of().
    assert [m["source"] for m in found if m][::-1] == list(SESSION_KEYS)
    # No session: by trace, so such spans spread over the instances (a missing
    # attribute would hash as empty, sending them all to one).
    trace = TRACE_FALLBACK.fullmatch(fallback)
    assert trace is not None and trace["target"] == run_key


def test_collector_sends_spanvisor_its_otlp_token_on_its_grpc_port() -> None:
    exporter = COLLECTOR_CONFIG["exporters"]["loadbalancing"]
    otlp = exporter["protocol"]["otlp"]
    assert "endpoint" not in otlp  # the resolver fills it in
    assert otlp["headers"]["authorization"] == "Bearer ${env:SPANVISOR_OTLP_TOKEN}"
    assert exporter["resolver"]["dns"]["port"] == _default("otlp_grpc_port")
    pipeline = COLLECTOR_CONFIG["service"]["pipelines"]["traces"]
    assert set(pipeline["receivers"]) <= set(COLLECTOR_CONFIG["receivers"])
    assert set(pipeline["processors"]) <= set(COLLECTOR_CONFIG["processors"])
    assert set(COLLECTOR_CONFIG["service"]["extensions"]) <= set(COLLECTOR_CONFIG["extensions"])


# ------------------------------------------------------- the central manifest


def test_central_manifest_has_its_parts() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in CENTRAL_DOCS)
    assert kinds == [
        ("ConfigMap", "spanvisor-config"),
        ("Deployment", "otel-collector"),
        ("Service", "otel-collector"),
        ("Service", "spanvisor-headless"),
        ("StatefulSet", "spanvisor"),
    ]
    assert {d["metadata"]["namespace"] for d in CENTRAL_DOCS} == {"spanvisor"}
    assert SPANVISOR["spec"]["replicas"] > 1


def test_central_instances_load_their_settings_and_may_listen_beyond_loopback(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    settings = _central_settings(tmp_path, no_spanvisor_env)
    assert settings.host != LOOPBACK and settings.api_host == LOOPBACK
    _check_otlp_exposure(settings)  # the token from the Secret makes it allowed
    _check_api_exposure(settings)
    assert settings.otlp_token == SECRET_VALUES["otlp-token"]
    assert settings.breaker_redis_url == SECRET_VALUES["redis-url"]
    # Incidents, commands, approvals and (by default) remediations share it.
    assert settings.database_url == SECRET_VALUES["postgres-url"]
    assert settings.remediation_database_url is None
    assert settings.instance() == POD_NAME  # stable: a StatefulSet's name
    no_spanvisor_env.delenv("SPANVISOR_OTLP_TOKEN")
    with pytest.raises(ConfigError, match="OTLP_TOKEN"):
        _check_otlp_exposure(load_settings(os.environ["SPANVISOR_CONFIG"]))


def test_central_instances_state_and_policy(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = _central_settings(tmp_path, no_spanvisor_env)
    container = SPANVISOR_CONTAINER
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    claims = {t["metadata"]["name"] for t in SPANVISOR["spec"]["volumeClaimTemplates"]}
    persistent = [Path(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in claims]
    for path in (settings.state_path, settings.token_file):
        assert any(path.is_relative_to(mount) for mount in persistent), path
    args = build_parser().parse_args(container["args"])
    assert args.verb == "run" and args.config is None  # SPANVISOR_CONFIG names it
    data = _one(CENTRAL_DOCS, "ConfigMap", "spanvisor-config")["data"]
    assert args.policy.parent == _mount(container, SPANVISOR, "spanvisor-config")
    policy = tmp_path / args.policy.name
    policy.write_text(data[args.policy.name], encoding="utf-8")
    assert main(["validate", str(policy)]) == 0, capsys.readouterr().err


def test_central_probes_reach_the_loopback_api(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    settings = _central_settings(tmp_path, no_spanvisor_env)
    paths = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for kind, path in paths.items():
        command = SPANVISOR_CONTAINER[kind]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        compile(command[2], f"<{kind}>", "exec")
        urls = re.findall(r"https?://[^'\"]+", command[2])
        assert urls == [f"http://{LOOPBACK}:{settings.api_port}{path}"], kind


def _port(container: dict[str, Any], name: str) -> int:
    port: int = next(p["containerPort"] for p in container["ports"] if p["name"] == name)
    return port


def test_ports_and_names_line_up_from_the_agents_to_each_instance(
    tmp_path: Path, no_spanvisor_env: pytest.MonkeyPatch
) -> None:
    settings = _central_settings(tmp_path, no_spanvisor_env)
    grpc = _port(SPANVISOR_CONTAINER, "otlp-grpc")
    assert grpc == settings.otlp_grpc_port
    # The headless Service selects the instances; the resolver looks it up.
    headless = _one(CENTRAL_DOCS, "Service", "spanvisor-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert SPANVISOR["spec"]["serviceName"] == headless["metadata"]["name"]
    labels = SPANVISOR["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    (service_port,) = headless["spec"]["ports"]
    assert service_port["port"] == grpc and service_port["targetPort"] == "otlp-grpc"
    dns = COLLECTOR_CONFIG["exporters"]["loadbalancing"]["resolver"]["dns"]
    namespace = headless["metadata"]["namespace"]
    assert dns["hostname"] == f"{headless['metadata']['name']}.{namespace}.svc.cluster.local"
    assert dns["port"] == grpc
    # The collector: its Service, its pod's ports and its receivers agree.
    collector_service = _one(CENTRAL_DOCS, "Service", "otel-collector")
    pod_labels = COLLECTOR_DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert collector_service["spec"]["selector"].items() <= pod_labels.items()
    protocols = COLLECTOR_CONFIG["receivers"]["otlp"]["protocols"]
    for port in collector_service["spec"]["ports"]:
        protocol = port["targetPort"].removeprefix("otlp-")
        endpoint = protocols[protocol]["endpoint"]
        assert endpoint == f"0.0.0.0:{port['port']}"
        assert _port(COLLECTOR_CONTAINER, port["targetPort"]) == port["port"]
    health = COLLECTOR_CONFIG["extensions"]["health_check"]["endpoint"]
    assert health.endswith(f":{_port(COLLECTOR_CONTAINER, 'health')}")


def test_the_collector_runs_the_config_file_with_the_instances_token() -> None:
    text = CENTRAL.read_text(encoding="utf-8")
    created = re.search(
        r"create configmap (?P<name>\S+) \\\s*#\s*--from-file=(?P<key>[^=]+)=(?P<file>\S+)", text
    )
    assert created is not None, "the comment says how the collector's ConfigMap is made"
    assert ROOT / created["file"] == COLLECTOR
    mount = _mount(COLLECTOR_CONTAINER, COLLECTOR_DEPLOYMENT, created["name"])
    assert COLLECTOR_CONTAINER["args"] == [f"--config={mount / created['key']}"]
    assert "contrib" in COLLECTOR_CONTAINER["image"]  # loadbalancing and transform
    # The token the collector sends is the one the instances require.
    refs = {
        c["name"]: {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in c["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for c in (COLLECTOR_CONTAINER, SPANVISOR_CONTAINER)
    }
    assert (
        refs["otel-collector"]["SPANVISOR_OTLP_TOKEN"] == refs["spanvisor"]["SPANVISOR_OTLP_TOKEN"]
    )
