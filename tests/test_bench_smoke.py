"""Smoke runs of the decision, delivery and amplification benchmarks with tiny parameters.

They check that each script runs end to end and prints its figures, not what
the figures are: those depend on the machine (and, for the amplification
simulation, on the built-in policy's tuning).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import amplification  # noqa: E402 - needs the path above

NUMBER = r"[\d,]+(?:\.\d+)?"


def _run(script: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANVISOR_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("script", ["decide.py", "delivery.py", "amplification.py"])
def test_help_explains_the_script(script: str) -> None:
    done = _run(script, "--help", timeout=60)

    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--help" in done.stdout


def test_amplification_prints_both_sides_and_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--runs", "10", "--interval", "2", "--duration", "120", "--outage-start", "40"]
    argv += ["--outage-length", "40"]

    code = amplification.main(argv)

    out = capsys.readouterr().out
    assert code == 0
    rows = {
        name: re.search(rf"{re.escape(name)}\s+((?:{NUMBER}\s+){{7}}{NUMBER})", out)
        for name in (
            "ours: policy + governor",
            "naive: tenacity, 5 attempts",
            "policy alone (reference)",
        )
    }
    assert all(rows.values()), out
    baseline = {row.group(1).split()[1] for row in rows.values() if row}
    assert baseline == {"200"}  # 10 runs x 20 scheduled calls in the 40 s window
    assert re.search(r"goal <= 1\.3\): (PASS|FAIL); naive: \d+\.\d{3}", out), out


def test_amplification_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--runs", "5", "--duration", "60", "--outage-start", "20", "--outage-length", "20"]

    amplification.main(argv)
    first = capsys.readouterr().out
    amplification.main(argv)
    second = capsys.readouterr().out

    def without_timing(text: str) -> str:
        return re.sub(r"simulated in [\d.]+ s", "", text)

    assert without_timing(first) == without_timing(second)


def test_naive_side_uses_tenacitys_schedule() -> None:
    naive = amplification.Naive(5)

    waits = [naive.on_failure("run", 0, attempt, 0) for attempt in range(1, 6)]

    assert waits == [1.0, 2.0, 4.0, 8.0, None]


@pytest.mark.slow
def test_decide_prints_its_percentiles() -> None:
    done = _run(
        "decide.py", "--requests", "40", "--warmup", "5", "--concurrency", "2", "--floor", "10"
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("python bench/decide.py --requests 40")
    row = rf"\s+40\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}"
    assert re.search(r"POST /v1/decide, sequential" + row, done.stdout), done.stdout
    assert re.search(r"POST /v1/decide, 2 clients" + row, done.stdout), done.stdout
    assert "GET /healthz (HTTP floor)" in done.stdout
    assert re.search(r"goal p99 < 5 ms \(sequential round trip\): (yes|NO)", done.stdout)


@pytest.mark.slow
def test_delivery_prints_its_percentiles_and_verifies_every_webhook() -> None:
    done = _run("delivery.py", "--failures", "30", "--warmup", "5", "--rate", "50")

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("python bench/delivery.py --failures 30")
    row = rf"\s+30\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}"
    assert re.search(r"sent -> webhook arrived" + row, done.stdout), done.stdout
    assert re.search(r"command created -> arrived" + row, done.stdout), done.stdout
    assert "signatures verified, 0 bad, 0 repeated" in done.stdout
    assert "0 measured failure(s) got no retry_step" in done.stdout
    assert re.search(r"goal p99 < 50 ms, every failure delivered: (yes|NO)", done.stdout)
