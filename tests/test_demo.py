"""`spanvisor demo` runs on its own and shows the failures it injected, classified."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_to_the_end_and_classifies_the_injected_failures() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "demo", "--runs", "3"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The scripted faults of the first three runs, each with its verdict.
    for kind in (
        "rate_limit",
        "quota_exhausted",
        "timeout",
        "unavailable",
        "invalid_tool_call",
        "context_overflow",
        "auth",
        "output_truncated",
        "not_found",
        "permission",
    ):
        assert kind in out, f"{kind} missing from the demo output:\n{out}"
    assert "summary" in out
    assert "failures reported" in out
