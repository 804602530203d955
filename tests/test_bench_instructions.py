"""The instruction-count benchmark (``bench/instructions.py``): its parsing and its work.

The work a child does under valgrind is run here without valgrind, on one
batch, so that a change to the span path's interfaces breaks this test, not
the next person's measurement.
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

from bench import instructions  # noqa: E402 - needs the path above

CACHEGRIND_SUMMARY = """\
==4242== Cachegrind, a cache and branch-prediction profiler
==4242== Command: python bench/instructions.py --child
==4242==
==4242== I   refs:      13,079,663,952
"""


def test_the_instruction_count_is_read_from_cachegrinds_summary() -> None:
    assert instructions.parse_i_refs(CACHEGRIND_SUMMARY) == 13_079_663_952


def test_last_level_misses_are_read_when_the_cache_was_simulated() -> None:
    simulated = CACHEGRIND_SUMMARY + "==4242== LL misses:     12,345,678  (  1,234 rd + 5 wr)\n"
    assert instructions.parse_ll_misses(simulated) == 12_345_678
    assert instructions.parse_ll_misses(CACHEGRIND_SUMMARY) is None


def test_output_without_a_count_is_an_error_that_shows_it() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)no instruction count.*Command: python"):
        instructions.parse_i_refs(CACHEGRIND_SUMMARY.replace("I   refs", "D   refs"))


@pytest.mark.parametrize("flag", ["--batches=0", "--tracked-runs=0", "--warmup=-1"])
def test_nonsense_sizes_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        instructions.parse_args([flag])


@pytest.mark.parametrize("track", ["--track", "--no-track"])
def test_a_child_judges_and_stores_its_batches(track: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "instructions.py"),
            "--child",
            track,
            "--batches=1",
            "--max-batches=1",
            "--warmup=1",
            "--tracked-runs=100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans, failures = map(int, re.findall(r"\d+", done.stdout))
    assert spans == 2 * instructions.SPANS_PER_REQUEST
    assert failures > 0  # 5% of the bench's spans fail
