"""CPU time of each of the sidecar's threads, for ``GET /v1/threads``.

Why: the sidecar's CPU goes to several threads (the event loop that
receives and judges spans, the store writer, the remediation runner and the
durable-workflow library's executors, gRPC's own native threads), and which
one grows under a given load is the first question when the sidecar uses
more CPU than expected. ``top -H`` shows every Python thread under the
process's name; this names them as ``threading`` does.

Linux only (``/proc/self/task``); elsewhere the list is empty and
``supported`` is false. Reading costs a file per thread, so it is an
endpoint of its own, not part of ``/v1/stats`` which benchmarks poll.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Final

__all__ = ["thread_cpu"]

_TASKS: Final = Path("/proc/self/task")
#: Threads listed at most, the busiest first (their sum is in ``listed_cpu_s``).
MAX_THREADS: Final = 64


def _ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


def _read_task(tid: str) -> tuple[str, float] | None:
    """(kernel name, user + system CPU seconds) of one thread; None once it has ended."""
    try:
        text = (_TASKS / tid / "stat").read_text()
    except OSError:
        return None
    # "tid (comm) state ..." where comm may hold spaces and parentheses.
    head, _, rest = text.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (IndexError, ValueError):
        return None
    return comm, ticks / _ticks_per_second()


def thread_cpu() -> dict[str, Any]:
    """The process's CPU seconds and each live thread's, by ``threading`` name when it has one.

    Native threads that Python did not start (gRPC's, for one) keep their
    kernel name. Threads that have ended are not listed, so the listed sum
    may be less than the process's total.
    """
    if not _TASKS.is_dir():
        return {"supported": False, "process_cpu_s": None, "listed_cpu_s": 0.0, "threads": []}
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    threads: list[dict[str, Any]] = []
    for tid in os.listdir(_TASKS):
        read = _read_task(tid)
        if read is None:
            continue
        comm, cpu_s = read
        native = int(tid) if tid.isdigit() else -1
        name = names.get(native)
        threads.append(
            {
                "tid": native,
                "name": name if name is not None else comm,
                "python": name is not None,
                "cpu_s": round(cpu_s, 2),
            }
        )
    threads.sort(key=lambda t: t["cpu_s"], reverse=True)
    process = os.times()
    return {
        "supported": True,
        "process_cpu_s": round(process.user + process.system, 2),
        "listed_cpu_s": round(sum(t["cpu_s"] for t in threads[:MAX_THREADS]), 2),
        "threads": threads[:MAX_THREADS],
    }
