"""What the LangGraph adapter holds per thread, and the handle a graph's nodes read it through.

:class:`ThreadState` is the adapter's own record of a thread (its fallback
model, pending notes, pause and stop); :class:`Supervision` is the read-only
view of it that nodes and tools find in their config (:func:`supervision`).
The records the adapter hands out (:class:`Directive`, :class:`ThreadView`,
:class:`AdapterStats`) are here too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig

from supervisor.client.pull import Command

#: ``config["configurable"]`` key of the model a fallback moved the thread to.
MODEL_KEY = "model"
#: ``config["configurable"]`` key of the thread's :class:`Supervision` handle.
HANDLE_KEY = "spanvisor"

Action = Literal["continue", "wait", "stop", "none"]


# -- records ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Directive:
    """What an applied command says the agent should do next with one thread.

    ``continue``: call :meth:`LangGraphAdapter.proceed` (it invokes the graph
    with ``input``: ``None`` to continue from the last checkpoint, or a
    LangGraph ``Command(resume=...)`` answering an interrupt). ``wait``: the
    thread waits for another command (paused, or waiting in an interrupt).
    ``stop``: the thread must not go on. ``none``: nothing to do now.
    """

    thread_id: str
    action: Action
    #: The command's type (``retry_step``...), and its id.
    command_type: str
    command_id: str = ""
    #: Why, in words, for logs and summaries.
    reason: str = ""
    input: Any = None
    #: The checkpoint the thread continues from (after a rewind: the fork).
    checkpoint_id: str | None = None
    #: The thread was running: the command is applied when its invocation ends.
    deferred: bool = False
    #: The adapter's clock when the command was applied.
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class ThreadView:
    """What the adapter holds for one thread (a snapshot; it changes as commands come)."""

    thread_id: str
    #: The model a fallback moved the thread to; ``None``: its primary model.
    model: str | None
    pending_notes: int
    unverified: tuple[str, ...]
    paused: bool
    stopped: bool
    running: bool
    #: Type of a command waiting for the running invocation to end.
    deferred: str | None
    #: The last directives (at most 16), oldest first.
    directives: tuple[Directive, ...]


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """Counters: what was applied, dropped, evicted."""

    threads: int
    applied: int
    duplicates: int
    unknown: int
    deferred: int
    evicted: int
    notes_dropped: int


# -- per-thread state --------------------------------------------------------------------


class ThreadState:
    """One thread's state in the adapter; every field is read and written under its lock."""

    __slots__ = (
        "deferred",
        "directives",
        "ended_pauses",
        "model",
        "notes",
        "pause",
        "pause_until",
        "paused",
        "restored",
        "running",
        "stopped",
        "thread_id",
        "unverified",
    )

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.model: str | None = None
        self.notes: OrderedDict[str, HumanMessage] = OrderedDict()
        self.unverified: tuple[str, ...] = ()
        self.paused = False
        #: The pause_run that paused the thread, and when (adapter clock) it times out
        #: (None: it states no deadline, or the thread is not paused).
        self.pause: Command | None = None
        self.pause_until: float | None = None
        #: Ids of pauses that timed out here: the sidecar's own outcome of one is dropped.
        self.ended_pauses: deque[str] = deque(maxlen=8)
        self.stopped = False
        self.running = 0
        self.deferred: Command | None = None
        self.directives: deque[Directive] = deque(maxlen=16)
        #: Whether the fallback model was read back from the thread's checkpoint.
        self.restored = False


class Supervision:
    """The live view a graph's nodes and tools have of their thread's commands.

    Get it with :func:`supervision` ``(config)``. Outside the adapter (a graph
    invoked directly, a test) it is inert: no model override, no notes,
    nothing unverified, never halted.
    """

    __slots__ = ("_lock", "_thread")

    def __init__(self, thread: ThreadState | None, lock: threading.Lock | None = None) -> None:
        self._thread = thread
        self._lock = lock if lock is not None else threading.Lock()

    @property
    def thread_id(self) -> str:
        return self._thread.thread_id if self._thread is not None else ""

    def model(self, default: str) -> str:
        """The model to call: a fallback's, else ``default``."""
        thread = self._thread
        if thread is None:
            return default
        with self._lock:
            return thread.model or default

    def notes(self, messages: Sequence[BaseMessage] = ()) -> list[HumanMessage]:
        """The supervisor's pending notes that ``messages`` do not hold yet (by id).

        Return them with the model's reply (``{"messages": [*notes, reply]}``)
        so they join the checkpoint in the order the model saw them.
        """
        thread = self._thread
        if thread is None:
            return []
        with self._lock:
            pending = list(thread.notes.values())
        if not pending:
            return []
        present = {m.id for m in messages if m.id}
        return [note for note in pending if note.id not in present]

    @property
    def unverified(self) -> tuple[str, ...]:
        """``name(arguments)`` of tool calls in flight when the agent stopped (``resume_run``).

        Their effects may or may not have happened: a tool that finds its own
        call here checks its ledger (or the service it calls) before acting.
        """
        thread = self._thread
        if thread is None:
            return ()
        with self._lock:
            return thread.unverified

    def is_unverified(self, tool: str) -> bool:
        """Whether a call of ``tool`` is among :attr:`unverified`."""
        prefix = f"{tool}("
        return any(call.startswith(prefix) for call in self.unverified)

    @property
    def halted(self) -> bool:
        """The thread is aborted or about to be rewound: a model node should return ``{}``."""
        thread = self._thread
        if thread is None:
            return False
        with self._lock:
            deferred = thread.deferred
            return thread.stopped or (deferred is not None and deferred.type == "rewind_run")


_INERT = Supervision(None)


def supervision(config: RunnableConfig | Mapping[str, Any] | None) -> Supervision:
    """The :class:`Supervision` handle in a node's or tool's config (inert when there is none)."""
    if not config:
        return _INERT
    configurable = config.get("configurable")
    if not isinstance(configurable, Mapping):
        return _INERT
    handle = configurable.get(HANDLE_KEY)
    return handle if isinstance(handle, Supervision) else _INERT
