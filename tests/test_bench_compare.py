"""The two-builds benchmark (``bench/compare.py``): its arguments, and a tree against itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import compare  # noqa: E402 - needs the path above


def test_a_folder_that_is_no_source_tree_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        compare.parse_args([str(ROOT), str(tmp_path)])
    with pytest.raises(SystemExit):
        compare.parse_args([str(ROOT), str(ROOT), "--repeat", "0"])
    args = compare.parse_args([str(ROOT), str(ROOT), "--env", "SPANVISOR_TRACK_RUNS=false"])
    assert args.sidecar_env == {"SPANVISOR_TRACK_RUNS": "false"}


@pytest.mark.slow
def test_a_tree_against_itself_prints_both_rates_their_ratios_and_the_threads() -> None:
    tiny = ["--repeat", "2", "--spans", "2000", "--warmup-spans", "500"]
    done = subprocess.run(
        [sys.executable, "bench/compare.py", str(ROOT), str(ROOT), *tiny],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("python bench/compare.py")
    assert len(re.findall(r"rep \d/2: before [\d,]+, after [\d,]+ spans/CPU-s", out)) == 2, out
    ratios = re.search(r"after/before: ([\d.]+) \(medians\), ([\d.]+) \(median of", out)
    assert ratios is not None, out
    assert all(0.2 < float(r) < 5.0 for r in ratios.groups())  # the same build: near 1
    assert out.count("sidecar's CPU went:") == 2 and "MainThread" in out
