"""The Dockerfile, checked without a Docker engine.

Read as text: a non-root user, a health check that finds the control API as the
CLI does, the ports the settings default to, extras that pyproject declares, a
base image inside requires-python, and a CMD that leaves every setting to
SPANVISOR_* variables. Run for real: the health check's own command against a
sidecar, and (slow) the wheel the image builds, installed into a fresh venv and
started as the image starts it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.cli.verbs import build_parser
from supervisor.settings import LOOPBACK, Settings, load_settings
from supervisor.wiring import build_sidecar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tests.dockerfile import (
    DOCKERIGNORE,
    ROOT,
    Instruction,
    arg_defaults,
    env,
    final_stage,
    instructions,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
ALL = instructions()
FINAL = final_stage(ALL)


def _one(keyword: str, found: list[Instruction] = FINAL) -> Instruction:
    matches = [i for i in found if i.keyword == keyword]
    assert len(matches) == 1, f"expected one {keyword} in the final stage, got {matches}"
    return matches[0]


def _expand(text: str) -> str:
    defaults = arg_defaults(ALL)
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), text)


def test_the_image_runs_as_a_fixed_non_root_user() -> None:
    user = _one("USER").args.split(":")[0]
    assert user.isdigit(), "numeric, so Kubernetes' runAsNonRoot can verify it"
    assert int(user) != 0
    # The user's home is the state directory the defaults write to, and the workdir.
    useradd = next(i for i in FINAL if i.keyword == "RUN" and "useradd" in i.args)
    home = re.search(r"--home-dir (\S+)", useradd.args)
    assert home is not None
    assert f"--uid {user}" in useradd.args
    assert env(FINAL)["HOME"] == home.group(1) == _one("WORKDIR").args


def test_exposed_ports_are_the_settings_defaults() -> None:
    exposed = {int(p) for p in _one("EXPOSE").words()}
    fields = Settings.model_fields
    defaults = {fields[name].default for name in ("otlp_grpc_port", "otlp_http_port", "api_port")}
    assert exposed == defaults


def test_the_entrypoint_is_the_console_script() -> None:
    assert _one("ENTRYPOINT").exec_form() == ["spanvisor"]
    assert "spanvisor" in PYPROJECT["project"]["scripts"]


def test_cmd_flags_exist_and_leave_every_setting_to_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cmd = _one("CMD").exec_form()
    assert cmd[0] == "run"
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    known = {flag for action in run._actions for flag in action.option_strings}
    assert {w for w in cmd if w.startswith("-")} <= known, "a CMD flag `spanvisor run` lacks"
    args = build_parser().parse_args(cmd)
    overrides = {k: v for k, v in vars(args).items() if k not in ("verb", "config", "policy")}
    for name in [n for n in os.environ if n.startswith("SPANVISOR_")]:
        monkeypatch.delenv(name)
    # As the image starts: loopback only, the sidecar pattern's honest default.
    plain = load_settings(None, overrides)
    assert (plain.host, plain.api_host) == (LOOPBACK, LOOPBACK)
    # And `docker run -e` still decides: a flag in CMD would win over these.
    monkeypatch.setenv("SPANVISOR_HOST", "0.0.0.0")
    monkeypatch.setenv("SPANVISOR_API_PORT", "4400")
    opened = load_settings(None, overrides)
    assert (opened.host, opened.api_port) == ("0.0.0.0", 4400)


def test_the_installed_extras_exist_in_pyproject() -> None:
    install = next(i for i in FINAL if i.keyword == "RUN" and "pip install" in i.args)
    extras = re.search(r"\[([^\]]+)\]", _expand(install.args))
    assert extras is not None, "the wheel is installed with its runtime extras"
    wanted = set(extras.group(1).split(","))
    assert "fleet" in wanted  # Redis-shared breakers: what a fleet of sidecars needs
    assert wanted <= set(PYPROJECT["project"]["optional-dependencies"])


def test_the_base_image_is_a_python_the_project_supports() -> None:
    bases = {_expand(i.args.split(" AS ")[0]) for i in ALL if i.keyword == "FROM"}
    assert len(bases) == 1, f"build and runtime stages on one base: {bases}"
    match = re.fullmatch(r"python:(\d+\.\d+)-slim", bases.pop())
    assert match is not None
    assert match.group(1) in SpecifierSet(PYPROJECT["project"]["requires-python"])


def _copied() -> set[str]:
    """What the build stage copies from the build context."""
    return {
        source
        for i in ALL
        if i.keyword == "COPY" and not i.args.startswith("--from")
        for source in i.words()[:-1]
    }


_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def test_the_build_context_holds_what_the_wheel_is_built_from() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "an allow-list: nothing new slips into the image unnoticed"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = _copied()
    assert copied == allowed
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        assert any(fnmatch.fnmatch(c, pattern) for c in copied), pattern
    assert PYPROJECT["project"]["readme"] in copied


def _healthcheck() -> list[str]:
    command = _one("HEALTHCHECK").exec_form()
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[int]:
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "state_path": str(tmp_path / "state.db"),
            "token_file": str(tmp_path / "api-token"),
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy()))
    ports = background.start()
    try:
        yield ports.api
    finally:
        background.stop()


def _clean_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SPANVISOR_")}
    return {**keep, "PYTHONPATH": str(ROOT), **extra}


def test_the_healthcheck_passes_on_a_serving_sidecar_and_fails_without_one(
    sidecar: int, tmp_path: Path
) -> None:
    ok = subprocess.run(
        _healthcheck(),
        env=_clean_env(SPANVISOR_API_PORT=str(sidecar)),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    # The port from a settings file named by SPANVISOR_CONFIG, as `run` reads it too.
    config = tmp_path / "spanvisor.yaml"
    config.write_text(f"api_port: {sidecar}\n", encoding="utf-8")
    by_file = subprocess.run(
        _healthcheck(),
        env=_clean_env(SPANVISOR_CONFIG=str(config)),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert by_file.returncode == 0, by_file.stderr
    down = subprocess.run(
        _healthcheck(),
        env=_clean_env(SPANVISOR_API_PORT=str(_free_port())),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert down.returncode != 0


@pytest.mark.slow
def test_the_wheel_the_image_builds_installs_and_runs_as_the_image_does(tmp_path: Path) -> None:
    """``pip wheel`` on what the build stage copies, ``pip install wheel[extras]`` into a venv."""
    context = tmp_path / "context"  # the build context: only what the Dockerfile copies
    context.mkdir()
    for source in _copied():
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, context / source, ignore=_IGNORED)
        else:
            shutil.copy2(ROOT / source, context / source)
    # Outside the worktree (an in-tree build leaves *.egg-info behind), and without
    # PYTHONPATH, which would show the checkout's package to the new venv as installed.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPANVISOR_", "PYTHON"))}
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(context), "-w", str(wheels)],
        env=base,
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("spanvisor-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], env=base, check=True, timeout=120)
    python = venv / "bin" / "python"
    install = next(i for i in FINAL if i.keyword == "RUN" and "pip install" in i.args)
    extras = re.search(r"\[([^\]]+)\]", _expand(install.args))
    assert extras is not None
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{wheel}[{extras.group(1)}]"],
        env=base,
        check=True,
        timeout=1200,
    )
    spanvisor = venv / "bin" / "spanvisor"
    home = tmp_path / "home"  # the image's HOME: where the state lands by default
    home.mkdir()
    run_env = {**base, "HOME": str(home)}
    shown = subprocess.run(
        [str(spanvisor), "--help"], env=run_env, capture_output=True, text=True, check=True
    )
    assert "run" in shown.stdout
    # The built-in policy is package data: explain reads it from the installed wheel.
    subprocess.run([str(spanvisor), "explain"], env=run_env, capture_output=True, check=True)

    api = _free_port()
    run_env |= {
        "SPANVISOR_OTLP_GRPC_PORT": str(_free_port()),
        "SPANVISOR_OTLP_HTTP_PORT": str(_free_port()),
        "SPANVISOR_API_PORT": str(api),
    }
    cmd = [str(spanvisor), *_one("CMD").exec_form()]
    log = tmp_path / "sidecar.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(cmd, env=run_env, stderr=stderr, cwd=home)
        try:
            healthy = [str(python), *_healthcheck()[1:]]
            deadline = time.monotonic() + 120
            while True:
                check = subprocess.run(healthy, env=run_env, capture_output=True, check=False)
                if check.returncode == 0:
                    break
                assert process.poll() is None, log.read_text(encoding="utf-8", errors="replace")
                assert time.monotonic() < deadline, check.stderr
                time.sleep(0.5)
            # The state and the token land in HOME, the image's volume.
            assert (home / ".spanvisor" / "state.db").exists()
            assert (home / ".spanvisor" / "api-token").exists()
        finally:
            process.terminate()
            process.wait(timeout=60)
    assert process.returncode == 0, log.read_text(encoding="utf-8", errors="replace")
