"""Smoke runs of the remediation benchmark (``bench/remediation.py``) with tiny parameters.

They check that the script runs end to end and prints its figures, not what
the figures are: those depend on the machine. Postgres is left out (SQLite
only), so the tests need no server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import remediation  # noqa: E402 - needs the path above
from policies import load_policy  # noqa: E402
from remediators.registry import check_policy  # noqa: E402

NUMBER = r"[\d,]+(?:\.\d+)?"


def _run(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANVISOR_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "bench/remediation.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_help_explains_the_script() -> None:
    done = _run("--help", timeout=60)

    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--remediations" in done.stdout


@pytest.mark.parametrize("use", remediation.REMEDIATORS)
def test_the_bench_policy_remediates_timeouts_and_ends_at_once(use: str, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(remediation.policy_yaml(use))

    policy = load_policy(policy_file)

    assert check_policy(policy) == []
    spec = policy.remediator("bench")
    assert spec is not None
    assert (spec.use, spec.verify_window_s, spec.on_unresolved) == (use, 0.0, "none")
    assert not policy.limits.breakers_enabled


def test_the_failing_span_is_a_timeout_of_openai() -> None:
    payload = remediation.failing_request(b"\x01" * 16, b"\x02" * 8, 1_700_000_000_000_000_000)

    request = ExportTraceServiceRequest.FromString(payload)
    (span,) = request.resource_spans[0].scope_spans[0].spans
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert "APITimeoutError" in span.status.message


@pytest.mark.slow
def test_latency_and_sqlite_throughput_print_their_figures() -> None:
    done = _run(
        "--failures",
        "6",
        "--rate",
        "20",
        "--burst",
        "4",
        "--warmup",
        "2",
        "--threads",
        "4",
        "--remediations",
        "8",
        "--repeat",
        "1",
        "--warmup-remediations",
        "2",
        "--backends",
        "sqlite",
        "--timeout",
        "60",
    )

    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.startswith("python bench/remediation.py --failures 6")
    for phase, count in (("steady 20/s", 6), ("burst of 4", 4)):
        assert re.search(rf"{phase} \({count} failures sent in", out), out
    row = rf"\s+{{count}}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}"
    assert re.search(r"received -> first tool call" + row.format(count=6), out), out
    assert re.search(r"received -> first tool call" + row.format(count=4), out), out
    assert "first tool: breaker_states 10" in out
    assert "no remediation spans within 60 s: steady 20/s 0, burst of 4 0" in out
    assert re.search(r"goal p99 < 100 ms at 20/s: (yes|NO)", out), out
    rate = rf"\s+sqlite\s+8 x 1\s+{NUMBER}\s+{NUMBER}"
    assert re.search(rate, out), out
    assert '"failed": 10' in out  # warm-up and batch: every remediation has its outcome
    assert "postgres" not in out.split("Remediations per second", 1)[1].split("\n\n", 1)[0]
