"""Each thread's CPU time, named as ``threading`` names it (``GET /v1/threads``)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.api import thread_cpu as module
from supervisor.api.thread_cpu import thread_cpu

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin_until(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


@linux_only
def test_a_busy_thread_is_listed_by_its_name_with_its_cpu_time() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=_spin_until, args=(stop,), name="busy-worker")
    busy.start()
    try:
        deadline = time.monotonic() + 10
        found: dict[str, object] = {}
        while time.monotonic() < deadline:
            listed = {t["name"]: t for t in thread_cpu()["threads"]}
            found = listed.get("busy-worker", {})
            if isinstance(found.get("cpu_s"), float) and found["cpu_s"] >= 0.05:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        busy.join()
    assert found["python"] is True
    assert found["tid"] == busy.native_id
    report = thread_cpu()
    assert report["supported"] is True
    assert report["process_cpu_s"] >= report["listed_cpu_s"] - 0.05  # threads that ended drop out
    cpu = [t["cpu_s"] for t in report["threads"]]
    assert cpu == sorted(cpu, reverse=True)
    assert "busy-worker" not in {t["name"] for t in report["threads"]}  # it has ended


@linux_only
def test_the_list_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "MAX_THREADS", 1)
    assert len(thread_cpu()["threads"]) == 1


def test_without_proc_it_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(module, "_TASKS", tmp_path / "missing")
    assert thread_cpu() == {
        "supported": False,
        "process_cpu_s": None,
        "listed_cpu_s": 0.0,
        "threads": [],
    }
