"""A small reader of the repository's Dockerfile, for tests that check it without Docker.

Only what the Dockerfile uses: comments, ``\\`` continuations, ``ARG`` defaults and
JSON (exec form) arguments. Each instruction is kept with the stage it belongs to.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # 0 before the first FROM (global ARGs), then 1, 2, ...

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form instruction (CMD, ENTRYPOINT, HEALTHCHECK CMD)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text.split(" CMD ", 1)[1]
        value = json.loads(text)
        assert isinstance(value, list), f"{self.keyword} is not in exec form: {self.args}"
        return [str(v) for v in value]

    def words(self) -> list[str]:
        return shlex.split(self.args)


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    found: list[Instruction] = []
    stage = 0
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        found.append(Instruction(keyword, re.sub(r"\s+", " ", args).strip(), stage))
    assert not pending, f"{path}: ends inside a continued line"
    return found


def final_stage(found: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in found)
    return [i for i in found if i.stage == last]


def arg_defaults(found: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=default`` anywhere in the file (names are not reused across stages)."""
    defaults: dict[str, str] = {}
    for i in found:
        if i.keyword == "ARG" and "=" in i.args:
            name, _, value = i.args.partition("=")
            defaults[name.strip()] = value.strip()
    return defaults


def env(found: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for i in found:
        if i.keyword == "ENV":
            for word in i.words():
                name, _, value = word.partition("=")
                values[name] = value
    return values
