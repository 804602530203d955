"""``spanvisor demo``: the sidecar, an instrumented agent and a faulty provider, live.

Everything runs on loopback with free ports: a fake OpenAI-compatible
provider scripted with the failures agents meet in production, the sidecar
(in this process), and the example agent (``examples/demo_agent.py``, a
separate process exporting OTLP to the sidecar as any agent would). Failures
are printed as the sidecar classifies them, then a summary.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from policies import load_policy
from supervisor.app import BackgroundSidecar, Sidecar, resolve_downstream
from supervisor.settings import load_settings
from supervisor.testing.fake_provider import FakeProvider, FaultPlan, Reply

AGENT = Path(__file__).resolve().parent.parent / "examples" / "demo_agent.py"
_DEADLINE_S = 120.0


def _script() -> list[Reply]:
    """Four steps per run; the agent asks the model once per step."""
    return [
        # run 1: a tool call, a rate limit, a tool that swallows its error, an answer
        Reply.tool_call("get_weather", {"city": "Paris"}),
        Reply.rate_limited(retry_after_s=1.5),
        Reply.tool_call("search_docs", {"query": "secret roadmap"}),
        Reply.text("Paris is sunny; the roadmap is restricted."),
        # run 2: out of quota, a tool that times out, provider overloaded, an unoffered tool
        Reply.quota_exhausted(),
        Reply.tool_call("get_weather", {"city": "Atlantis"}),
        Reply.server_error(503),
        Reply.tool_call("get_wether", {"city": "Rome"}),
        # run 3: context too long, bad key, cut-off answer, model not found
        Reply.context_length_exceeded(),
        Reply.unauthorized(),
        Reply.truncated(),
        Reply.not_found(),
    ]


def run_demo(*, runs: int = 3, seed: int = 7) -> int:
    if not AGENT.exists():
        print(
            f"spanvisor demo: the example agent is not at {AGENT}; run the demo from a "
            "checkout of the spanvisor repository (pip install -e '.[demo]').",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="spanvisor-demo-") as tmp:
        token = secrets.token_urlsafe(24)
        settings = load_settings(
            overrides={
                "otlp_grpc_port": 0,
                "otlp_http_port": 0,
                "api_port": 0,
                "api_token": token,
                "token_file": str(Path(tmp) / "token"),
                "log_level": "WARNING",
            }
        )
        from supervisor.logs import configure_logging

        configure_logging("WARNING")
        provider = FakeProvider(fault_plan=FaultPlan(rate=0.2, seed=seed))
        provider.script(*_script())
        downstream = resolve_downstream(settings)
        background = BackgroundSidecar(Sidecar(settings, load_policy(), downstream=downstream))
        with provider:
            ports = background.start()
            try:
                return _drive(
                    ports.otlp_http,
                    ports.api,
                    token,
                    base_url=provider.base_url,
                    runs=runs,
                    downstream=downstream,
                )
            finally:
                background.stop()


def _drive(
    http_port: int, api_port: int, token: str, *, base_url: str, runs: int, downstream: Any
) -> int:
    api = f"http://127.0.0.1:{api_port}"
    print("spanvisor demo")
    print(f"  sidecar   OTLP/HTTP 127.0.0.1:{http_port}   control API {api}")
    print(f"  provider  fake OpenAI-compatible at {base_url}, faults injected")
    print(f"  agent     {AGENT.name}: {runs} runs of 4 steps, OpenInference-instrumented\n")
    print(f"{'CLASS':9}  {'KIND':18}  {'DEPENDENCY':26}  {'ACTION':9}  RULE / EVIDENCE")
    env = {
        **os.environ,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "sk-demo",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    agent = subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
        [sys.executable, str(AGENT), "--runs", str(runs)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + _DEADLINE_S
    with httpx.Client(base_url=api, headers=headers, timeout=5) as client:
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            _show_new(client, seen)
            if agent.poll() is not None:
                stats = client.get("/v1/stats").json()
                settled = stats["ingest"]["accepted_spans"] == stats["pipeline"]["processed_spans"]
                quiet_since = quiet_since or time.monotonic()
                if settled and time.monotonic() - quiet_since > 1.0:
                    break
            time.sleep(0.2)
        else:
            agent.kill()
            print("spanvisor demo: the agent did not finish in time", file=sys.stderr)
        _show_new(client, seen)
        stats = client.get("/v1/stats").json()
    _, agent_err = agent.communicate(timeout=10)
    _summary(seen, stats, agent_err, downstream)
    return 0


def _show_new(client: httpx.Client, seen: list[dict[str, Any]]) -> None:
    failures = client.get("/v1/failures", params={"limit": 10_000}).json()["failures"]
    for entry in failures[len(seen) :]:
        seen.append(entry)
        evidence = entry["message"][:60]
        print(
            f"{entry['class']:9}  {entry['kind']:18}  {entry['dependency'][:26]:26}  "
            f"{entry['action']:9}  {entry['rule']}\n{'':72}{evidence}"
        )


def _summary(
    seen: list[dict[str, Any]], stats: dict[str, Any], agent_err: str, downstream: Any
) -> None:
    print("\nsummary")
    print(
        f"  spans received {stats['ingest']['accepted_spans']}, judged "
        f"{stats['pipeline']['processed_spans']}; failures reported {len(seen)}, "
        f"propagations attributed to their origin {stats['pipeline']['attributed']}"
    )
    by_class = Counter(e["class"] for e in seen)
    print("  by class  " + ", ".join(f"{k} {v}" for k, v in sorted(by_class.items())))
    by_action = Counter(e["action"] for e in seen)
    print("  decisions " + ", ".join(f"{k} {v}" for k, v in sorted(by_action.items())))
    latency = stats["decisions"]["latency_ms"]
    if latency["count"]:
        print(f"  receipt-to-decision latency p50 {latency['p50']} ms, p99 {latency['p99']} ms")
    last = [line for line in agent_err.strip().splitlines() if line.startswith("demo agent:")]
    if last:
        print(f"  {last[-1]}")
    print(
        "\nThis demo shows classification and decisions. An agent that takes them (retries,"
        "\nfallbacks, approvals, remediations) is examples/webhook_agent.py; see the README."
    )
    if downstream is None:
        print(
            "To see the failures next to their spanvisor.decide spans in a trace viewer, start\n"
            "Jaeger (OTLP on 4317/4318, UI on 16686) and run the demo again with\n"
            "  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 spanvisor demo"
        )
    else:
        print(
            f"Spans and spanvisor.decide spans went to {downstream.endpoint}: open the traces of "
            "service demo-agent there."
        )
