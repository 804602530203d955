"""The run detectors' benchmark (``bench/detectors.py``): its arguments, and a paced run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import detectors  # noqa: E402 - needs the path above


def test_a_rate_needs_both_sidecars_loaded_at_once() -> None:
    with pytest.raises(SystemExit):
        detectors.parse_args(["--rate", "8000"])
    with pytest.raises(SystemExit):
        detectors.parse_args(["--together", "--rate", "-1"])
    assert detectors.parse_args(["--together", "--rate", "8000"]).rate == 8000
    assert detectors.parse_args([]).rate == 0


@pytest.mark.slow
def test_a_paced_run_sends_every_span_to_both_and_prints_their_ratio() -> None:
    tiny = ["--together", "--rate", "4000", "--repeat", "2", "--spans", "2000"]
    done = subprocess.run(
        [sys.executable, "bench/detectors.py", *tiny, "--warmup-spans", "500"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "paced at 4,000 spans/s" in out, out
    assert len(re.findall(r"rep \d/2: off [\d,]+, on [\d,]+ spans/CPU-s", out)) == 2, out
    ratios = re.search(r"on/off: ([\d.]+) \(medians\), ([\d.]+) \(median of", out)
    assert ratios is not None, out
    assert all(0.2 < float(r) < 5.0 for r in ratios.groups())
    assert out.count("sidecar's CPU went:") == 2 and "MainThread" in out
