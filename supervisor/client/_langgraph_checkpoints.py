"""A LangGraph thread's checkpoints, read and edited: its branch, rewinds (forks), compactions.

The adapter decides when a thread is rewound or compacted; this module knows
how: which checkpoint a rewind forks from (never between a tool call and its
result), what the fork's note says about the discarded turns, which messages
a compaction removes. Both edits mark their checkpoint with the command's
idempotency key (:data:`COMMAND_METADATA_KEY`), so a redelivered command
finds its edit instead of making it twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import merge_configs
from langgraph.pregel import Pregel
from langgraph.types import StateSnapshot

from supervisor.client._langgraph_notes import as_data, supervisor_note
from supervisor.client.pull import Command

log = logging.getLogger("spanvisor.client.langgraph")

#: Checkpoint metadata key naming the command that made a checkpoint (a rewind's fork).
COMMAND_METADATA_KEY = "spanvisor_command"


class ThreadCheckpoints:
    """A graph's checkpoints, per thread: the latest, the current branch, and the edits."""

    def __init__(
        self,
        graph: Pregel[Any, Any, Any, Any],
        *,
        messages_key: str,
        config: RunnableConfig,
        history_limit: int,
        max_note_chars: int,
    ) -> None:
        self.graph = graph
        self.messages_key = messages_key
        self.history_limit = history_limit
        self.max_note_chars = max_note_chars
        self._base = config

    def config(self, thread_id: str) -> RunnableConfig:
        """The thread's config with nothing of the adapter's in it (to read checkpoints)."""
        return merge_configs(self._base, {"configurable": {"thread_id": thread_id}})

    def latest(self, thread_id: str) -> StateSnapshot | None:
        """The thread's latest checkpoint, or ``None`` when it has none."""
        snapshot = self.graph.get_state(self.config(thread_id))
        if snapshot.metadata is None and not snapshot.next and not snapshot.values:
            return None
        return snapshot

    def messages(self, snapshot: StateSnapshot) -> list[BaseMessage]:
        values = snapshot.values
        found = values.get(self.messages_key) if isinstance(values, Mapping) else None
        if not isinstance(found, list):
            return []
        return [m for m in found if isinstance(m, BaseMessage)]

    def branch(self, thread_id: str) -> list[StateSnapshot]:
        """The thread's current branch, newest first: the head and its ancestors (bounded).

        ``get_state_history`` lists every checkpoint of the thread, abandoned
        forks too; the branch follows the parent links from the head.
        """
        history = list(
            islice(self.graph.get_state_history(self.config(thread_id)), self.history_limit)
        )
        if not history:
            return []
        by_id = {checkpoint_id(s): s for s in history}
        branch: list[StateSnapshot] = []
        current: StateSnapshot | None = history[0]
        while current is not None and len(branch) < self.history_limit:
            branch.append(current)
            parent = current.parent_config or {}
            current = by_id.get(str(parent.get("configurable", {}).get("checkpoint_id") or ""))
        return branch

    def fork(
        self,
        thread_id: str,
        *,
        summary: str,
        reason: str,
        tool: str | None,
        steps_back: int | None,
        key: str,
    ) -> tuple[RunnableConfig | None, bool]:
        """Fork the thread as ``LangGraphAdapter.rewind`` says; the fork's config, and whether
        it forked now (False: nothing to rewind, or the command's fork was made before)."""
        branch = self.branch(thread_id)
        if not branch:
            return None, False
        if key:
            for snapshot in branch:
                if (snapshot.metadata or {}).get(COMMAND_METADATA_KEY) == key:
                    return snapshot.config, False  # applied already (a redelivered command)
        if tool is not None and tool.startswith("tool:"):
            tool = tool[5:]
        target = self._rewind_target(branch, tool, steps_back)
        if target is None:
            return None, False
        kept = {m.id for m in self.messages(target) if m.id}
        discarded = [
            m for m in self.messages(branch[0]) if m.id not in kept and isinstance(m, AIMessage)
        ]
        calls = [
            f"{call.get('name')}({json.dumps(call.get('args'), sort_keys=True, default=str)})"
            for message in discarded
            for call in message.tool_calls
        ]
        parts = [summary.strip() or "(no summary given)"]
        if calls:
            shown = calls[-12:]
            more = f" (and {len(calls) - len(shown)} earlier)" if len(calls) > len(shown) else ""
            parts.append(
                f"Tool calls made in the discarded turns{more} (their effects were not undone):\n"
                + "\n".join(f"- {call[:300]}" for call in shown)
            )
        why = f" ({as_data(reason, 300)})" if reason else ""
        fork_note = supervisor_note(
            "rewind",
            key or f"{thread_id}/{checkpoint_id(target)}/{time.time_ns()}",
            "This conversation was taken back to an earlier point because going on the same"
            f" way would not help{why}. Do not repeat the approach that failed: take another"
            " one, or give your best final answer.",
            as_data("\n\n".join(parts), self.max_note_chars),
        )
        config = target.config
        if key:  # the fork names its command: a redelivery finds it (above)
            config = merge_configs(config, {"metadata": {COMMAND_METADATA_KEY: key}})
        fork = self.graph.update_state(config, {self.messages_key: [fork_note]})
        log.info(
            "rewound thread %s to checkpoint %s (%d checkpoint(s) back): fork %s",
            thread_id,
            checkpoint_id(target),
            branch.index(target),
            fork.get("configurable", {}).get("checkpoint_id"),
        )
        return fork, True

    def _rewind_target(
        self, branch: list[StateSnapshot], tool: str | None, steps_back: int | None
    ) -> StateSnapshot | None:
        head = self.messages(branch[0])
        if tool is not None:
            first = _loop_start(head, tool)
            if first is None:
                answered = (
                    bool(head) and isinstance(head[-1], AIMessage) and not (head[-1].tool_calls)
                )
                if answered:  # the thread moved on and answered: nothing to rewind
                    log.info("rewind: the thread's last model turn did not call %s", tool)
                    return None
                # A deferred rewind halted the model turn, which ended the graph with
                # no answer: step back one checkpoint, or the run ends unanswered.
                start = 1
            else:
                start = next(
                    (i for i, s in enumerate(branch) if not self._holds(s, first)), len(branch)
                )
        elif steps_back is not None and steps_back > 0:
            start = min(steps_back, len(branch) - 1)
        else:
            last = next((m for m in reversed(head) if isinstance(m, AIMessage)), None)
            if last is None or not last.id:
                return None
            start = next(
                (i for i, s in enumerate(branch) if not self._holds(s, last.id)), len(branch)
            )
        for snapshot in branch[max(start, 1) :]:
            if self._speaks_next(snapshot):
                return snapshot
        return None

    def _holds(self, snapshot: StateSnapshot, message_id: str) -> bool:
        return any(m.id == message_id for m in self.messages(snapshot))

    def _speaks_next(self, snapshot: StateSnapshot) -> bool:
        """A checkpoint the thread can continue from with a note: no tool call unanswered."""
        if not snapshot.next or "__start__" in snapshot.next:
            return False
        messages = self.messages(snapshot)
        if not messages:
            return False
        last = messages[-1]
        return not (isinstance(last, AIMessage) and last.tool_calls)

    def compact(self, thread_id: str, snapshot: StateSnapshot | None, command: Command) -> int:
        """Remove older messages of ``snapshot`` (the thread's latest checkpoint), keeping the
        task and the recent ones; how many went."""
        if snapshot is None:
            return 0
        key = command.idempotency_key
        if (snapshot.metadata or {}).get(COMMAND_METADATA_KEY) == key:
            return 0
        messages = self.messages(snapshot)
        params = command.params
        keep_last = params.get("keep_last")
        target = params.get("target_tokens")
        head = 0  # the leading messages up to the first user turn: the task
        while head < len(messages) and not isinstance(messages[head], HumanMessage):
            head += 1
        head = min(head + 1, len(messages))
        if isinstance(keep_last, int) and not isinstance(keep_last, bool) and keep_last > 0:
            tail = keep_last
        elif isinstance(target, int) and not isinstance(target, bool) and target > 0:
            budget, tail = target * 4, 0  # ~4 characters a token
            for message in reversed(messages[head:]):
                budget -= len(str(message.content))
                if budget < 0:
                    break
                tail += 1
            tail = max(tail, 2)
        else:
            tail = 8
        cut = max(head, len(messages) - tail)
        # The kept tail starts with a model turn or a user message, never a tool
        # result without the call it answers.
        while cut > head and messages[cut].type == "tool":
            cut -= 1
        middle = messages[head:cut]
        if len(middle) < 2 or not all(m.id for m in middle):
            return 0
        first, *rest = middle
        summary = supervisor_note(
            "compacted",
            key,
            f"{len(middle)} earlier message(s) were removed from this conversation to fit the"
            " context window; the task and the most recent messages are kept.",
            as_data(str(params.get("reason") or "compact_context"), 300),
        )
        # Same id as the first removed message: add_messages replaces it in place.
        summary.id = first.id
        config: RunnableConfig = merge_configs(
            self.config(thread_id), {"metadata": {COMMAND_METADATA_KEY: key}}
        )
        self.graph.update_state(
            config,
            {self.messages_key: [summary, *(RemoveMessage(id=m.id or "") for m in rest)]},
        )
        return len(middle)


def checkpoint_id(snapshot: StateSnapshot) -> str:
    return str(snapshot.config.get("configurable", {}).get("checkpoint_id") or "")


def _loop_start(messages: Sequence[BaseMessage], tool: str) -> str | None:
    """Id of the first model turn of the trailing run of turns calling ``tool``."""
    turns = [m for m in messages if isinstance(m, AIMessage)]

    def signatures(message: AIMessage) -> list[str]:
        return [
            json.dumps(call.get("args"), sort_keys=True, default=str)
            for call in message.tool_calls
            if call.get("name") == tool
        ]

    if not turns or not signatures(turns[-1]):
        return None
    same = signatures(turns[-1])[-1]
    first_same: AIMessage | None = None
    count = 0
    for message in reversed(turns):
        if same not in signatures(message):
            break
        first_same, count = message, count + 1
    if count >= 2 and first_same is not None:
        return first_same.id
    first_any = turns[-1]
    for message in reversed(turns):
        if not signatures(message):
            break
        first_any = message
    return first_any.id


def unanswered_calls(messages: list[BaseMessage]) -> list[str]:
    """``name(arguments)`` of the last model turn's tool calls that no tool message answers."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        calls = getattr(message, "tool_calls", None)
        if isinstance(message, AIMessage) and calls:
            answered = {getattr(m, "tool_call_id", None) for m in messages[index + 1 :]}
            return [
                f"{call.get('name', '')}({json.dumps(call.get('args', {}), sort_keys=True)})"
                for call in calls
                if call.get("id") not in answered
            ]
    return []


def canonical_call(call: str) -> str:
    """``name(arguments)`` with its JSON arguments' keys sorted, to compare two spellings."""
    name, paren, rest = call.partition("(")
    if not paren or not rest.endswith(")"):
        return call
    try:
        arguments = json.loads(rest[:-1])
    except ValueError:
        return call
    return f"{name}({json.dumps(arguments, sort_keys=True)})"
