"""The model table: a model's context window and list prices, looked up by name.

One table serves three checks (``model_tables.yaml``, packaged, under a
policy's ``context_pressure.models`` overrides):

- **context pressure**: an LLM call whose input tokens reach ``share`` of the
  model's window predicts a ``model / context_overflow`` before the provider
  refuses the next, longer call (:func:`context_pressure`);
- **run budgets**: a run's tokens and cost add up from its spans' token usage
  (:class:`policies._spend.RunSpend`);
- **SLOs**: a run's cost is one of the things that makes it bad
  (:class:`policies._slo.SloTracker`).

Nothing here does I/O besides reading the packaged table once, and nothing
knows about spans: callers pass model names and token counts.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from importlib import resources

from policies._glob import GlobSet
from policies._schema_budgets import ModelInfoSpec, ModelTableFile
from policies._spend import MAX_MODEL_NAME, ModelInfo, clamp_tokens
from policies._yamldoc import parse

__all__ = ["MODEL_TABLE_FILE", "ModelTable", "builtin_models", "context_pressure"]

#: The packaged table, next to this module.
MODEL_TABLE_FILE = "model_tables.yaml"
MODEL_TABLE_SOURCE = "<builtin model table>"

#: Leading vendor prefixes of Bedrock-style ids: ``us.anthropic.``, ``meta.``, ``mistral.``.
_VENDOR_PREFIX = re.compile(r"(?:[a-z]+\.)+")


@functools.cache
def builtin_models() -> tuple[tuple[str, ModelInfoSpec], ...]:
    """The packaged table's entries, in order (read and validated once)."""
    text = resources.files("policies").joinpath(MODEL_TABLE_FILE).read_text(encoding="utf-8")
    spec = ModelTableFile.model_validate(parse(text, MODEL_TABLE_SOURCE).data)
    return tuple(spec.models.items())


def _candidates(model: str) -> tuple[str, ...]:
    """The spellings a model name is tried in: as reported, after its last '/', unprefixed."""
    name = model.strip().lower()
    if not name or len(name) > MAX_MODEL_NAME:
        return ()
    found = [name]
    tail = name.rsplit("/", 1)[-1]
    if tail and tail != name:
        found.append(tail)
    bare = _VENDOR_PREFIX.sub("", tail, count=1) if _VENDOR_PREFIX.match(tail) else tail
    if bare and bare not in found:
        found.append(bare)
    return tuple(found)


class ModelTable:
    """Ordered model-name globs -> :class:`ModelInfo`; the first matching glob wins.

    Matching is case-insensitive. A name is tried as reported, then after its
    last ``/`` (``models/gemini-1.5-pro``, ``anthropic/claude-3.5-sonnet``),
    then without leading vendor prefixes (``us.anthropic.claude-...``,
    ``meta.llama3-...``); the globs are tried in order, each against all three
    spellings, so an earlier glob (an override) always beats a later one.

    Model names come from spans, so lookups are memoised in a bounded LRU of
    ``memo_size`` names (evictions counted); names longer than
    ``MAX_MODEL_NAME`` are not looked up. The table itself never changes: a
    policy reload builds a new one.
    """

    def __init__(
        self,
        entries: Mapping[str, ModelInfoSpec] | Iterable[tuple[str, ModelInfoSpec]],
        *,
        memo_size: int = 1024,
    ) -> None:
        if not isinstance(memo_size, int) or memo_size < 1:
            raise ValueError(f"memo_size must be at least 1, got {memo_size!r}")
        items = entries.items() if isinstance(entries, Mapping) else entries
        self._entries: tuple[tuple[GlobSet, ModelInfo], ...] = tuple(
            (
                GlobSet([pattern.lower()]),
                ModelInfo(pattern, spec.context_window, spec.input_per_mtok, spec.output_per_mtok),
            )
            for pattern, spec in items
        )
        self.memo_size = memo_size
        self._memo: OrderedDict[str, ModelInfo | None] = OrderedDict()
        self._lock = threading.Lock()
        #: Names dropped from the memo to make room.
        self.memo_evictions = 0

    @classmethod
    def builtin(cls, overrides: Mapping[str, ModelInfoSpec] | None = None) -> ModelTable:
        """The packaged table, with ``overrides`` (a policy's globs) tried first."""
        entries = list((overrides or {}).items())
        entries.extend(builtin_models())
        return cls(entries)

    @property
    def patterns(self) -> tuple[str, ...]:
        """The globs, in the order they are tried."""
        return tuple(info.pattern for _, info in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: str) -> ModelInfo | None:
        """The first entry whose glob matches ``model``; None for unknown models."""
        if not isinstance(model, str):
            return None
        memo = self._memo
        with self._lock:
            if model in memo:
                memo.move_to_end(model)
                return memo[model]
        names = _candidates(model)
        found: ModelInfo | None = None
        if names:
            for matches, info in self._entries:
                if any(matches(name) for name in names):
                    found = info
                    break
        if len(model) <= MAX_MODEL_NAME:
            with self._lock:
                memo[model] = found
                if len(memo) > self.memo_size:
                    memo.popitem(last=False)
                    self.memo_evictions += 1
        return found

    def cost_usd(
        self, model: str, input_tokens: int | None, output_tokens: int | None
    ) -> float | None:
        """USD for one call; None when the model is unknown or has no price.

        ``None`` or negative token counts count as 0. No cache or batch
        discounts, lowest price tier: an estimate at list price.
        """
        info = self.lookup(model)
        if info is None:
            return None
        return info.cost_usd(clamp_tokens(input_tokens), clamp_tokens(output_tokens))


def context_pressure(
    model: str, input_tokens: int | None, share: float, table: ModelTable
) -> tuple[float, int] | None:
    """``(fraction of the window used, window)`` when ``input_tokens`` reach ``share`` of it.

    None below the share, for an unknown model, or without input tokens. The
    fraction may exceed 1 (the provider accepted more than the table says:
    the table is out of date, or the call went to a larger variant).
    """
    if not (isinstance(share, (int, float)) and 0 < share <= 1):
        raise ValueError(f"share must be more than 0 and at most 1, got {share!r}")
    tokens = clamp_tokens(input_tokens)
    if tokens == 0:
        return None
    info = table.lookup(model)
    if info is None:
        return None
    fraction = tokens / info.context_window
    if fraction >= share:
        return fraction, info.context_window
    return None
