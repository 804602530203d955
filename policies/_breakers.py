"""Circuit breakers per dependency, fed by the outcomes the sidecar observes in spans.

A dependency is a string such as ``openai:gpt-4o``, ``tool:search`` or
``http:api.example.com``. The sidecar does not make the calls it judges, so the
board never wraps one: ``record(dependency, ok)`` replays each observed outcome
through a pybreaker ``CircuitBreaker`` (a no-op call that returns, or raises a
private error), which keeps pybreaker's counting, listeners and optional shared
storage (``pybreaker.CircuitRedisStorage``) in charge of closed → open and
half-open → closed / open.

Time is the board's own injectable clock, never pybreaker's: pybreaker decides
open → half-open with ``datetime.now()`` inside ``call``, which tests cannot
control. The board stamps ``opened_at`` from its clock when pybreaker opens a
breaker (a pybreaker listener), moves it to half-open itself
(``breaker.half_open()``) once ``clock() >= opened_at + reset_timeout_s``, and
never hands pybreaker an outcome while its breaker is open, so pybreaker's
wall-clock check is never reached.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pybreaker

log = logging.getLogger("spanvisor.breakers")

#: Upper bounds that keep a typo in a policy from disabling a breaker for good.
MAX_FAIL_MAX = 10_000
MAX_SUCCESS_THRESHOLD = 10_000
MAX_RESET_TIMEOUT_S = 86_400.0
MAX_MIN_CALLS = 10_000


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """How one dependency's breaker trips and recovers.

    ``fail_max`` consecutive failures open it; it stays open ``reset_timeout_s``
    seconds, then lets trial calls through (half-open): ``success_threshold``
    successful trials close it, and it opens again once failed trials make
    that out of reach among its ``half_open_trials`` (with the defaults, 2
    successes of 3 trials: one failure among them is tolerated; with
    ``half_open_trials == success_threshold``, one failed trial re-opens it,
    pybreaker's own rule).
    """

    fail_max: int = 5
    reset_timeout_s: float = 30.0
    success_threshold: int = 2
    #: None: ``success_threshold`` (pybreaker's rule: the first failed trial re-opens).
    half_open_trials: int | None = None
    #: A call that lasted at least this many seconds is slow; None: durations are not counted.
    slow_call_s: float | None = None
    #: A closed breaker opens (reason ``slow_calls``) once this share of its last
    #: ``min_calls`` calls were slow (Resilience4j's slow-call rate).
    slow_call_rate: float = 0.5
    min_calls: int = 10

    def __post_init__(self) -> None:
        if self.slow_call_s is not None:
            _check_seconds("slow_call_s", self.slow_call_s, MAX_RESET_TIMEOUT_S)
        rate = self.slow_call_rate
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
            raise ValueError(f"slow_call_rate must be more than 0 and at most 1, got {rate!r}")
        _check_int("min_calls", self.min_calls, 1, MAX_MIN_CALLS)
        _check_int("fail_max", self.fail_max, 1, MAX_FAIL_MAX)
        _check_seconds("reset_timeout_s", self.reset_timeout_s, MAX_RESET_TIMEOUT_S)
        _check_int("success_threshold", self.success_threshold, 1, MAX_SUCCESS_THRESHOLD)
        if self.half_open_trials is not None:
            _check_int(
                "half_open_trials",
                self.half_open_trials,
                self.success_threshold,
                MAX_SUCCESS_THRESHOLD,
            )

    @property
    def tolerated_trial_failures(self) -> int:
        """Failed trials a half-open breaker absorbs before it opens again."""
        if self.half_open_trials is None:
            return 0
        return self.half_open_trials - self.success_threshold


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_seconds(name: str, value: object, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= high:
        raise ValueError(f"{name} must be more than 0 and at most {high:g} seconds, got {value}")


class BreakerState(str, Enum):
    """Where a dependency's breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
    #: Forced open by an operator (``isolate``) until ``close``; no timeout.
    ISOLATED = "isolated"


_FROM_PYBREAKER: dict[str, BreakerState] = {
    pybreaker.STATE_CLOSED: BreakerState.CLOSED,
    pybreaker.STATE_OPEN: BreakerState.OPEN,
    pybreaker.STATE_HALF_OPEN: BreakerState.HALF_OPEN,
}

#: Why a breaker changed state, by (old, new), when an observed outcome changed it.
_OUTCOME_REASONS: dict[tuple[BreakerState, BreakerState], str] = {
    (BreakerState.CLOSED, BreakerState.OPEN): "failures",
    (BreakerState.HALF_OPEN, BreakerState.OPEN): "trial_failed",
    (BreakerState.HALF_OPEN, BreakerState.CLOSED): "trial_succeeded",
}


@dataclass(frozen=True, slots=True)
class BreakerChange:
    """One state change of one breaker, as passed to ``on_change``.

    ``reason`` is one of ``failures`` (closed → open), ``reset_timeout`` (open →
    half_open), ``trial_succeeded`` (half_open → closed), ``trial_failed``
    (half_open → open), ``isolated``, ``closed_manually``, or ``shared_storage``
    (another process sharing the breaker's storage changed it). ``failures`` is
    the consecutive failure count at the change (the count that tripped it, for
    ``failures`` and ``trial_failed``).
    """

    dependency: str
    old: BreakerState
    new: BreakerState
    reason: str
    at: float
    failures: int


@dataclass(frozen=True, slots=True)
class BreakerInfo:
    """One breaker as ``snapshot`` sees it.

    ``failures`` is the consecutive failure count as pybreaker keeps it: reset by
    a success or a close, kept while open (outcomes are not counted then).
    ``opened_at`` is the clock value when it last opened (None once closed);
    ``reopens_at`` is when it goes half-open, set only while it is open.
    """

    dependency: str
    state: BreakerState
    failures: int
    opened_at: float | None
    reopens_at: float | None


class SharedStorage(pybreaker.CircuitBreakerStorage):
    """A pybreaker storage that boards of several processes share, with isolation besides.

    pybreaker's storage has no notion of an operator's isolation, so a board
    keeps the flag here too: ``isolate`` and ``close`` then act on every board
    sharing the storage. ``isolated()`` answers as of the last read of
    ``state`` (one round trip reads both).
    """

    @abstractmethod
    def isolated(self) -> bool:
        """Whether an operator isolated the breaker (as of the last read of ``state``)."""

    @abstractmethod
    def set_isolated(self, isolated: bool) -> None:
        """Record an operator's isolate (True) or close (False)."""


class _Breaker(pybreaker.CircuitBreaker):
    """pybreaker's breaker, except that a state noticed in a shared storage is adopted silently.

    pybreaker adopts another process's change as if it made it: noticing
    half-open resets the shared success count, noticing closed the shared
    failure count, so each board that looked undid trials and failures the
    others had counted. The process that made the change did those resets;
    the board reports what it noticed itself (reason ``shared_storage``).
    """

    @property
    def state(self) -> Any:
        current = self.current_state
        if current != self._state.name:
            with self._lock:
                self._state = self._create_new_state(current, prev_state=self._state)
        return self._state

    @state.setter
    def state(self, state_str: str) -> None:
        with self._lock:
            self._state = self._create_new_state(state_str, prev_state=self._state, notify=True)


class _ObservedFailure(Exception):
    """A failure seen in a span, replayed through pybreaker so that it counts."""


def _succeed() -> None:
    return None


def _fail() -> None:
    # A new instance each time: re-raising one instance would grow its traceback.
    raise _ObservedFailure


def _unlink(error: BaseException) -> None:
    """Cut the reference cycle pybreaker leaves in an error it re-raised.

    It re-raises from a frame that holds the error, so each counted failure
    was a cycle (the error, its traceback, six frames) that only the garbage
    collector could free: in a busy sidecar, most of what its young
    generation collected. Without the tracebacks, reference counting frees it.
    """
    found: BaseException | None = error
    for _ in range(4):  # the error, and the one it was raised while handling
        if found is None:
            return
        found.__traceback__ = None
        found = found.__context__


class _Entry:
    """A breaker and what the board keeps beside it (its clock, its manual state)."""

    __slots__ = (
        "breaker",
        "failures",
        "isolated",
        "opened_at",
        "settings",
        "shared",
        "slow",
        "slow_count",
        "state",
        "trial_failures",
    )

    def __init__(self, settings: BreakerSettings, shared: SharedStorage | None) -> None:
        self.settings = settings
        #: The storage, when other processes share it (isolation is then read from it).
        self.shared = shared
        self.breaker: Any = None  # pybreaker.CircuitBreaker, set once its listener exists
        #: The state last reported through on_change (a change is a difference from it).
        self.state = BreakerState.CLOSED
        #: The failure count last read, for eviction without a storage round trip.
        self.failures = 0
        self.opened_at: float | None = None
        self.isolated = False
        #: Failed trials absorbed since the breaker last half-opened.
        self.trial_failures = 0
        #: Whether each of the last ``min_calls`` calls was slow (closed only), and how many were.
        self.slow: deque[bool] = deque(maxlen=settings.min_calls)
        self.slow_count = 0


class _Watch(pybreaker.CircuitBreakerListener):
    """Stamps the entry's ``opened_at`` from the board's clock when pybreaker opens it."""

    def __init__(self, entry: _Entry, now: Callable[[], float]) -> None:
        self._entry = entry
        self._now = now

    def state_change(self, cb: Any, old_state: Any, new_state: Any) -> None:
        # pybreaker notifies open → open too (open() on an open breaker): not a new opening.
        if new_state.name == pybreaker.STATE_OPEN and (
            old_state is None or old_state.name != pybreaker.STATE_OPEN
        ):
            self._entry.opened_at = self._now()


class BreakerBoard:
    """One circuit breaker per dependency, driven by observed outcomes.

    Lifecycle of a breaker: created closed on the first ``record`` (or
    ``isolate`` / ``close``) of its dependency. Closed: ``fail_max`` consecutive
    failures open it; a success resets the count. Open: outcomes are ignored
    (calls already in flight, or made against advice) until ``reset_timeout_s``
    has passed on the clock; the breaker is then half-open, as ``state``,
    ``record`` and ``snapshot`` see it. Half-open: ``success_threshold``
    successes close it; failures open it again (a new ``opened_at``) once
    they leave fewer than ``success_threshold`` of its ``half_open_trials``
    able to succeed (see :class:`BreakerSettings`).
    ``isolate`` forces it open with no timeout and outcomes ignored, until
    ``close``, which closes it and resets its counts.

    Bounded: at most ``max_breakers`` breakers. A new dependency on a full board
    evicts the least recently used closed breaker with no failures (counted in
    ``evictions``); when there is none it is not tracked (counted in
    ``untracked``) and reads as closed.

    A clock that goes backwards never crashes the board: an open breaker then
    waits a full ``reset_timeout_s`` from the earlier time. A non-finite clock
    reading is replaced by the last finite one.

    Thread-safety: meant for one thread (the sidecar's event loop); every method
    holds a re-entrant lock all the same. ``on_change`` runs on the calling
    thread after the lock is released, in the order the changes happened; one
    that raises is logged (the first time, with its traceback), counted in
    ``listener_errors`` and otherwise ignored.

    ``settings`` is one ``BreakerSettings`` for every dependency, or a function
    of the dependency read once, when its breaker is created.
    ``storage_factory(dependency)`` gives each breaker's pybreaker storage
    (default: in memory); with a shared one, changes made by other processes are
    reported with reason ``shared_storage`` when this board notices them (only
    for dependencies it has a breaker for). ``state`` and ``info`` of a
    dependency the board does not track read the shared storage, and track it
    from then on when it is not closed there (a closed one is not tracked, so
    reads cannot fill the board). With a :class:`SharedStorage`, ``isolate``
    and ``close`` act on every board sharing it. The count of failed trials a
    half-open breaker absorbed (``half_open_trials``) is each board's own: each
    tolerates its own, and the one that re-opens it opens it for all.
    """

    def __init__(
        self,
        settings: BreakerSettings | Callable[[str], BreakerSettings] | None = None,
        *,
        on_change: Callable[[BreakerChange], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_breakers: int = 10_000,
        storage_factory: Callable[[str], pybreaker.CircuitBreakerStorage] | None = None,
    ) -> None:
        _check_int("max_breakers", max_breakers, 1, None)
        if settings is None:
            settings = BreakerSettings()
        if isinstance(settings, BreakerSettings):
            fixed = settings
            # object: a caller's callable may return anything; the check below says what.
            self._settings_for: Callable[[str], object] = lambda _dependency: fixed
        else:
            self._settings_for = settings
        self._on_change = on_change
        self._clock = clock
        self._storage_factory = storage_factory
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._last_now = 0.0
        self.max_breakers = max_breakers
        #: Breakers evicted to make room (closed, no failures, least recently used first).
        self.evictions = 0
        #: Operations on dependencies that found the board full with nothing evictable.
        self.untracked = 0
        #: ``on_change`` calls that raised.
        self.listener_errors = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, dependency: str, ok: bool) -> BreakerState:
        """Count one observed outcome of ``dependency``; its breaker's state afterwards."""
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            if entry is None:
                state = BreakerState.CLOSED
            else:
                state = self._refresh(dependency, entry, now, changes)
                if state is BreakerState.CLOSED or state is BreakerState.HALF_OPEN:
                    state = self._feed(dependency, entry, ok, state, now=now, changes=changes)
        self._emit(changes)
        return state

    def record_all(self, dependency: str, outcomes: Sequence[bool]) -> BreakerState:
        """:meth:`record` each of ``outcomes`` in order; the state afterwards.

        A closed breaker counts failures in a row, so of a batch's outcomes it
        needs only whether a success reset its count and the failures after
        the last success, or those up to the one that trips it (then the rest
        as :meth:`record` would take them). Each outcome through pybreaker
        is a locked call with listeners, and a busy dependency that fails now
        and then has many in a batch.
        """
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            state = BreakerState.CLOSED
            if entry is not None:
                state = self._refresh(dependency, entry, now, changes)
                if state is BreakerState.CLOSED:
                    outcomes = _closed_equivalent(
                        outcomes, entry.breaker.fail_counter, entry.settings.fail_max
                    )
                for n, ok in enumerate(outcomes):
                    if n:
                        state = self._refresh(dependency, entry, now, changes)
                    if state is BreakerState.CLOSED or state is BreakerState.HALF_OPEN:
                        state = self._feed(dependency, entry, ok, state, now=now, changes=changes)
        self._emit(changes)
        return state

    def record_durations(self, dependency: str, durations_s: Sequence[float]) -> BreakerState:
        """Calls of ``dependency`` that ended (well or not) and how long each took, in order.

        Only a breaker with ``slow_call_s`` set counts them, and only while
        closed: once ``slow_call_rate`` of its last ``min_calls`` calls took
        ``slow_call_s`` or longer, it opens with reason ``slow_calls`` (and
        half-opens after ``reset_timeout_s`` like any open breaker; its trials
        are judged by their outcomes). One comparison per call.
        """
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            state = BreakerState.CLOSED
            if entry is not None:
                state = self._refresh(dependency, entry, now, changes)
                threshold = entry.settings.slow_call_s
                if threshold is not None and state is BreakerState.CLOSED:
                    state = self._count_slow(
                        dependency, entry, durations_s, threshold, now=now, changes=changes
                    )
        self._emit(changes)
        return state

    def _count_slow(
        self,
        dependency: str,
        entry: _Entry,
        durations_s: Sequence[float],
        threshold: float,
        *,
        now: float,
        changes: list[BreakerChange],
    ) -> BreakerState:
        window = entry.slow
        settings = entry.settings
        size = settings.min_calls
        needed = settings.slow_call_rate * size
        for duration in durations_s:
            slow = duration >= threshold
            if len(window) == size and window[0]:
                entry.slow_count -= 1
            window.append(slow)
            entry.slow_count += slow
            if len(window) == size and entry.slow_count >= needed:
                entry.breaker.open()
                entry.opened_at = now
                self._change(
                    dependency, entry, BreakerState.OPEN, "slow_calls", now=now, changes=changes
                )
                return BreakerState.OPEN
        return BreakerState.CLOSED

    def state(self, dependency: str) -> BreakerState:
        """The state of ``dependency``'s breaker; closed when it has none (none is created)."""
        changes: list[BreakerChange] = []
        with self._lock:
            entry = self._entries.get(dependency)
            if entry is None:
                entry, state = self._peek(dependency, changes)
            else:
                self._entries.move_to_end(dependency)
                state = self._refresh(dependency, entry, self._now(), changes)
        self._emit(changes)
        return state

    def info(self, dependency: str) -> BreakerInfo:
        """``dependency``'s breaker as ``snapshot`` shows it; closed when it has none."""
        changes: list[BreakerChange] = []
        with self._lock:
            entry = self._entries.get(dependency)
            if entry is None:
                entry, state = self._peek(dependency, changes)
            if entry is None:
                result = BreakerInfo(dependency, state, 0, None, None)
            else:
                result = self._info(dependency, entry, self._now(), changes)
        self._emit(changes)
        return result

    def snapshot(self) -> list[BreakerInfo]:
        """Every tracked breaker, sorted by dependency (does not change recency)."""
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            result = [
                self._info(dependency, self._entries[dependency], now, changes)
                for dependency in sorted(self._entries)
            ]
        self._emit(changes)
        return result

    def isolate(self, dependency: str) -> bool:
        """Force ``dependency``'s breaker open until ``close``.

        False only when the board is full with nothing evictable, so the
        dependency could not be tracked (counted in ``untracked``).
        """
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            if entry is None:
                log.warning("cannot isolate %s: %d breakers, none evictable", dependency, len(self))
                return False
            if self._refresh(dependency, entry, now, changes) is not BreakerState.ISOLATED:
                entry.isolated = True
                if entry.shared is not None:
                    entry.shared.set_isolated(True)
                # Open in pybreaker too, so boards sharing its storage see it open.
                entry.breaker.open()
                self._change(
                    dependency, entry, BreakerState.ISOLATED, "isolated", now=now, changes=changes
                )
        self._emit(changes)
        return True

    def trip(self, dependency: str, reason: str) -> bool:
        """Open ``dependency``'s breaker now (a cascade across runs), as its failures would.

        It half-opens after its ``reset_timeout_s`` like any open breaker. An
        isolated or already open breaker is left as it is. False when the
        dependency could not be tracked.
        """
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            if entry is None:
                return False
            state = self._refresh(dependency, entry, now, changes)
            if state is BreakerState.CLOSED or state is BreakerState.HALF_OPEN:
                entry.breaker.open()
                entry.opened_at = now
                self._change(dependency, entry, BreakerState.OPEN, reason, now=now, changes=changes)
        self._emit(changes)
        return True

    def close(self, dependency: str) -> None:
        """Close ``dependency``'s breaker and reset its counts, whatever its state.

        Creates it, closed, when the dependency has none.
        """
        changes: list[BreakerChange] = []
        with self._lock:
            now = self._now()
            entry = self._get_or_create(dependency)
            if entry is None:
                return  # untracked reads as closed anyway
            old = self._refresh(dependency, entry, now, changes)
            entry.isolated = False
            if entry.shared is not None:
                entry.shared.set_isolated(False)
            entry.breaker.close()  # resets pybreaker's failure and success counts
            entry.opened_at = None
            if old is BreakerState.CLOSED:
                entry.failures = 0
            else:
                self._change(
                    dependency,
                    entry,
                    BreakerState.CLOSED,
                    "closed_manually",
                    now=now,
                    changes=changes,
                )
        self._emit(changes)

    def now(self) -> float:
        """The board's clock now (``opened_at`` and ``reopens_at`` are on it)."""
        return self._clock()

    # -- internals (called with the lock held) --------------------------------------------

    def _now(self) -> float:
        now = self._clock()
        if math.isfinite(now):
            self._last_now = now
        return self._last_now

    def _stamp(self) -> float:
        """The time of the operation in progress, for the listener's ``opened_at``."""
        return self._last_now

    def _peek(
        self, dependency: str, changes: list[BreakerChange]
    ) -> tuple[_Entry | None, BreakerState]:
        """An untracked dependency's state in the shared storage; tracked if not closed there."""
        if self._storage_factory is None:
            return None, BreakerState.CLOSED
        storage = self._storage_factory(dependency)
        name = storage.state  # one round trip; isolation comes with it
        isolated = isinstance(storage, SharedStorage) and storage.isolated()
        if name == pybreaker.STATE_CLOSED and not isolated:
            return None, BreakerState.CLOSED
        entry = self._get_or_create(dependency, storage)
        if entry is None:  # full: answered all the same, never as closed
            return None, BreakerState.ISOLATED if isolated else _FROM_PYBREAKER[name]
        return entry, self._refresh(dependency, entry, self._now(), changes)

    def _get_or_create(
        self, dependency: str, storage: pybreaker.CircuitBreakerStorage | None = None
    ) -> _Entry | None:
        entries = self._entries
        entry = entries.get(dependency)
        if entry is not None:
            entries.move_to_end(dependency)
            return entry
        # Settings and storage first: if either raises, nothing has been evicted.
        settings = self._settings_for(dependency)
        if not isinstance(settings, BreakerSettings):
            raise TypeError(
                f"settings for {dependency!r} must be BreakerSettings, got {settings!r}"
            )
        if len(entries) >= self.max_breakers and not self._evict_one():
            self.untracked += 1
            return None
        if storage is None and self._storage_factory is not None:
            storage = self._storage_factory(dependency)
        entry = _Entry(settings, storage if isinstance(storage, SharedStorage) else None)
        entry.breaker = _Breaker(
            fail_max=settings.fail_max,
            reset_timeout=settings.reset_timeout_s,
            success_threshold=settings.success_threshold,
            listeners=[_Watch(entry, self._stamp)],
            name=dependency,
            state_storage=storage,
        )
        entries[dependency] = entry
        return entry

    def _evict_one(self) -> bool:
        # Cached state and count: no storage round trip per breaker scanned.
        for dependency, entry in self._entries.items():
            if (
                entry.state is BreakerState.CLOSED
                and entry.failures == 0
                and not entry.isolated
                and not entry.slow_count
            ):
                del self._entries[dependency]
                self.evictions += 1
                return True
        return False

    def _refresh(
        self, dependency: str, entry: _Entry, now: float, changes: list[BreakerChange]
    ) -> BreakerState:
        """The entry's state now: catches up with the storage and the reset timeout."""
        shared = entry.shared
        if shared is None and entry.isolated:
            return BreakerState.ISOLATED
        # Reading .state re-reads the storage (and adopts what another process changed).
        state = _FROM_PYBREAKER[entry.breaker.state.name]
        if shared is not None:
            # Isolated or closed by an operator through any board sharing the storage.
            entry.isolated = shared.isolated()
            if entry.isolated:
                if entry.state is not BreakerState.ISOLATED:
                    self._change(
                        dependency,
                        entry,
                        BreakerState.ISOLATED,
                        "shared_storage",
                        now=now,
                        changes=changes,
                    )
                return BreakerState.ISOLATED
        if state is not entry.state:
            if state is BreakerState.OPEN:
                entry.opened_at = now  # opened elsewhere, noticed now: a full wait from now
            self._change(dependency, entry, state, "shared_storage", now=now, changes=changes)
        if state is BreakerState.OPEN:
            opened_at = entry.opened_at
            if opened_at is None or now < opened_at:
                # Opened elsewhere (shared storage), or the clock went back: a full wait from now.
                entry.opened_at = opened_at = now
            if now >= opened_at + entry.settings.reset_timeout_s:
                entry.breaker.half_open()
                state = BreakerState.HALF_OPEN
                self._change(dependency, entry, state, "reset_timeout", now=now, changes=changes)
        return state

    def _feed(
        self,
        dependency: str,
        entry: _Entry,
        ok: bool,
        before: BreakerState,
        *,
        now: float,
        changes: list[BreakerChange],
    ) -> BreakerState:
        """Replay one outcome through pybreaker (closed or half-open only).

        Half-open, a failed trial is absorbed while the breaker can still reach
        ``success_threshold`` within its ``half_open_trials`` (pybreaker would
        re-open at the first one): one failure among the first runs resumed
        must not re-open the breaker for every run.
        """
        breaker = entry.breaker
        if (
            before is BreakerState.HALF_OPEN
            and not ok
            and entry.trial_failures < entry.settings.tolerated_trial_failures
        ):
            entry.trial_failures += 1
            return before
        # pybreaker hands a counted failure back as our error, or as CircuitBreakerError when
        # it trips; CircuitBreakerError also comes when a shared storage was opened meanwhile
        # (the outcome is then ignored, as any outcome while open).
        try:
            breaker.call(_succeed if ok else _fail)
        except (_ObservedFailure, pybreaker.CircuitBreakerError) as exc:
            _unlink(exc)
        after = _FROM_PYBREAKER[breaker.state.name]
        if after is before:
            entry.failures = breaker.fail_counter
        else:
            reason = _OUTCOME_REASONS.get((before, after), "shared_storage")
            self._change(dependency, entry, after, reason, now=now, changes=changes)
        return after

    def _change(
        self,
        dependency: str,
        entry: _Entry,
        new: BreakerState,
        reason: str,
        *,
        now: float,
        changes: list[BreakerChange],
    ) -> None:
        old = entry.state
        entry.state = new
        entry.trial_failures = 0  # a new state: trials, if any, start afresh
        if entry.slow_count or entry.slow:
            entry.slow.clear()  # and so does the share of slow calls
            entry.slow_count = 0
        entry.failures = failures = entry.breaker.fail_counter
        if new is BreakerState.CLOSED:
            entry.opened_at = None
        changes.append(BreakerChange(dependency, old, new, reason, now, failures))

    def _info(
        self, dependency: str, entry: _Entry, now: float, changes: list[BreakerChange]
    ) -> BreakerInfo:
        state = self._refresh(dependency, entry, now, changes)
        entry.failures = failures = entry.breaker.fail_counter
        opened_at = entry.opened_at
        reopens_at = None
        if state is BreakerState.OPEN and opened_at is not None:
            reopens_at = opened_at + entry.settings.reset_timeout_s
        return BreakerInfo(dependency, state, failures, opened_at, reopens_at)

    def _emit(self, changes: list[BreakerChange]) -> None:
        on_change = self._on_change
        if on_change is None:
            return
        for change in changes:
            try:
                on_change(change)
            except Exception:
                with self._lock:
                    self.listener_errors += 1
                    first = self.listener_errors == 1
                if first:
                    log.exception("breaker on_change listener raised (logged once): %r", change)


def _closed_equivalent(outcomes: Sequence[bool], failures: int, fail_max: int) -> Sequence[bool]:
    """Outcomes that leave a closed breaker with ``failures`` counted as ``outcomes`` would.

    A reset if a success found failures counted, then the failures after the
    last success. If a run of failures trips the breaker, the outcomes up to
    that failure are replaced so, and those after it are kept as they were.
    """
    count = failures
    reset = False
    trailing = 0
    for n, ok in enumerate(outcomes):
        if ok:
            reset = reset or count > 0
            count = trailing = 0
            continue
        count += 1
        trailing += 1
        if count >= fail_max:
            return [True] * reset + [False] * trailing + list(outcomes[n + 1 :])
    return [True] * reset + [False] * trailing
