"""The per-stage benchmark (``bench/stages.py``): it runs, and its table adds up.

Run as a child process, as a user runs it: it silences warnings for the
whole process, which must not reach the other tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import stages  # noqa: E402 - needs the path above


@pytest.mark.parametrize(
    "flag",
    ["--batches=0", "--repeat=0", "--tracked-runs=0", "--failure-rate=0", "--failure-rate=1"],
)
def test_nonsense_sizes_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        stages.parse_args([flag])


def test_every_stage_and_the_cost_of_a_failure_are_printed() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "stages.py"),
            "--batches=2",
            "--repeat=1",
            "--tracked-runs=100",
            "--failure-rate=0.2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("python ") and "bench/stages.py" in out.splitlines()[0]

    def figure(label: str) -> float:
        found = re.search(rf"^\s*{re.escape(label)}\s+([\d.]+)\s", out, re.MULTILINE)
        assert found is not None, f"{label!r} missing from:\n{out}"
        return float(found.group(1))

    stage_names = ["decode", "read_spans", "shows_failure_signal", "may_fail_quietly"]
    for name in [*stage_names, "dependency", "run tracker", "id check"]:
        assert figure(name) > 0
    assert figure("id check") >= 0
    whole = figure("whole path, tracker off, 20% injected")
    # The whole path includes the wire view.
    assert whole > figure("read_spans") > 0
    parts = [figure(part) for part in ("judge", "report", "store")]
    # At a fifth of spans failing, judging and storing failures are real work.
    assert parts[0] > 0 and parts[2] > 0
    assert figure("all") == pytest.approx(sum(parts), abs=1.5)
