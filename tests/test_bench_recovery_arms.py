"""The recovery benchmark's arms, counted the same in its ``--help``, its docs and its table.

An arm was added and the help still said "four ways of recovering": every
place that counts the arms (or lists them) is checked against ``ARMS``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.recovery import ARMS  # noqa: E402 - needs the path above

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
# "six arms", "the four arms", "recovered four ways", "five ways of recovering"
COUNTED = re.compile(
    rf"(?:\brecovered\s+)?\b(?P<n>{'|'.join(WORDS)})\s+(?P<what>arms|ways\s+of\s+recovering)"
    rf"|\brecovered\s+(?P<n2>{'|'.join(WORDS)})\s+(?P<what2>ways)\b",
    re.IGNORECASE,
)
PLACES = (
    "README.md",
    "bench/README.md",
    "bench/recovery.py",
    "bench/_recovery_scenario.py",
    "bench/_recovery_worker.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))),
)


#: In these, only the recovery benchmark's section counts arms.
SECTIONS = {"README.md": "## The recovery benchmark", "bench/README.md": "## `recovery.py`"}


def section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same level."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def counts(text: str) -> list[tuple[int, str]]:
    """Each "<number word> arms / ways (of recovering)" in ``text``: the number and the noun."""
    return [
        (
            WORDS.index((m["n"] or m["n2"]).lower()),
            " ".join((m["what"] or m["what2"]).lower().split()),
        )
        for m in COUNTED.finditer(text)
    ]


def test_help_says_how_many_arms_and_lists_them() -> None:
    done = subprocess.run(
        [sys.executable, "bench/recovery.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert (len(ARMS), "arms") in counts(done.stdout), done.stdout[:600]
    assert ",".join(ARMS) in done.stdout


def test_every_count_of_the_arms_is_right() -> None:
    wrong = []
    for place in PLACES:
        text = (ROOT / place).read_text(encoding="utf-8")
        if place in SECTIONS:  # other benchmarks are described around it
            text = section(text, SECTIONS[place])
        for number, what in counts(text):
            # "arms" counts them all; "ways (of recovering)" every arm but no recovery
            expected = len(ARMS) if what == "arms" else len(ARMS) - 1
            if number != expected:
                wrong.append(f"{place}: {WORDS[number]} {what} (there are {len(ARMS)} arms)")
    assert not wrong, wrong


def test_the_readme_table_has_a_row_per_arm() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = section(readme, SECTIONS["README.md"])
    rows = re.findall(r"^\| \((?P<arm>[a-z+]+)\) ", table, re.MULTILINE)
    assert tuple(rows) == ARMS


def test_the_counter_sees_a_wrong_count() -> None:
    assert counts("a fleet through faults, four ways of recovering.") == [(4, "ways of recovering")]
    assert counts("recovered four ways") == [(4, "ways")]
    assert counts("the Six\narms") == [(6, "arms")]
    assert counts("worked out three ways, and they disagreed") == []
