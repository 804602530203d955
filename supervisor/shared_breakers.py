"""Breaker state shared by a fleet of sidecars through Redis, kept locally when Redis is away.

Each dependency's breaker has a :class:`RedisBreakerStorage`: a copy in this
process of its state, counts and isolation, and the same keys in Redis
(pybreaker's layout, ``<namespace>:pybreaker:state`` and so on, plus
``<namespace>:spanvisor:isolated``). Every Redis operation goes through one
:class:`RedisLink`: a short timeout, no retries, and a breaker of its own
(the first error or timeout stops every storage asking Redis for
``retry_s``; the next operation after that is the probe). While Redis is
unreachable, breakers read and count on the local copy: an open breaker stays
open, nothing raises into the judging pipeline, and the link says so once in
the log (and once when Redis answers again) and counts it.

The fleet's breakers are listed from an index: a sorted set of dependency
names, ``<namespace>:breakers``, which a storage adds its dependency to at
its first write to Redis (a breaker that only ever read as closed is not
listed anywhere) and which keeps the :data:`MAX_INDEXED` most recently added.
An index, not a ``SCAN`` of the namespace: a scan walks the whole Redis
keyspace (five keys a breaker, and whatever else shares that Redis) in
round trips whose count grows with it, where ``ZRANGE`` of a bounded set is
one round trip of just the names.

When Redis answers again, each breaker that changed meanwhile reconciles at
its next read, by one rule: **the more severe state wins** (isolated, then
open, then half-open, then closed), and failure counts take the larger; an
operator's ``isolate`` or ``close`` made meanwhile is written as this
sidecar has it (the operator's word is the latest). A breaker that did not
change meanwhile takes the shared state as it is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

import pybreaker
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies import SharedStorage
from supervisor.errors import ConfigError

log = logging.getLogger("spanvisor.breakers.redis")

T = TypeVar("T")

_SEVERITY = {pybreaker.STATE_CLOSED: 0, pybreaker.STATE_HALF_OPEN: 1, pybreaker.STATE_OPEN: 2}
_FIELDS = ("pybreaker:state", "pybreaker:fail_counter", "pybreaker:success_counter")
_OPENED_AT = "pybreaker:opened_at"
_ISOLATED = "spanvisor:isolated"
#: Dependency names the fleet's index keeps (the most recently added; a board's own bound).
MAX_INDEXED = 10_000


class Unreachable(Exception):
    """Redis did not answer (or was not asked: it failed less than ``retry_s`` ago)."""


@dataclass(frozen=True, slots=True)
class LinkStats:
    """The link's health, for ``/v1/stats`` and ``/metrics``."""

    reachable: bool
    #: Times Redis became unreachable.
    outages: int
    #: Operations that failed or timed out.
    errors: int
    #: Operations not tried because Redis had failed less than ``retry_s`` ago.
    skipped: int


class RedisLink:
    """One Redis client for every breaker's storage, with a breaker of its own; see the module."""

    def __init__(
        self,
        client: Any,
        *,
        where: str,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        #: Lua sources, registered once (redis-py sends the SHA, and the source again if
        #: Redis lost it).
        self._scripts: dict[str, Any] = {}
        self._where = where
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._up = True
        self._down_since = 0.0
        self._retry_at = 0.0
        self._outages = 0
        self._errors = 0
        self._skipped = 0
        #: The fleet's breaker names (:func:`shared_breakers` sets it; None: not listed).
        self.index: BreakerIndex | None = None

    def run(self, op: Callable[[Any], T]) -> T:
        """``op(client)``; raises :class:`Unreachable` instead of any Redis or socket error."""
        with self._lock:
            if not self._up and self._clock() < self._retry_at:
                self._skipped += 1
                raise Unreachable
        try:
            result = op(self._client)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            raise Unreachable from None
        if not self._up:
            self._recovered()
        return result

    def script(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """Run the Lua ``source`` on ``keys`` and ``args``; raises :class:`Unreachable` as
        :meth:`run` does."""

        def op(client: Any) -> list[Any]:
            script = self._scripts.get(source)
            if script is None:
                script = self._scripts[source] = client.register_script(source)
            return list(script(keys=list(keys), args=list(args), client=client))

        return self.run(op)

    def resting(self) -> bool:
        """Whether the link would not ask Redis now (it failed less than ``retry_s`` ago).

        Asks nothing: for work that can wait until Redis may answer (the next
        operation after the rest is the probe).
        """
        with self._lock:
            return not self._up and self._clock() < self._retry_at

    def stats(self) -> LinkStats:
        with self._lock:
            return LinkStats(self._up, self._outages, self._errors, self._skipped)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
            now = self._clock()
            self._retry_at = now + self._retry_s
            if not self._up:
                return
            self._up = False
            self._down_since = now
            self._outages += 1
        log.warning(
            "breakers' Redis at %s unreachable (%s): deciding with this sidecar's own"
            " breaker state and counts, asking Redis again every %gs",
            self._where,
            exc or type(exc).__name__,
            self._retry_s,
        )

    def _recovered(self) -> None:
        with self._lock:
            if self._up:
                return
            self._up = True
            down_for = self._clock() - self._down_since
        log.warning(
            "breakers' Redis at %s reachable again after %.1fs: breakers and counts are"
            " shared again (breakers changed meanwhile reconcile, the more severe state"
            " winning; counts made meanwhile stay this sidecar's)",
            self._where,
            down_for,
        )


class BreakerIndex:
    """The fleet's breakers by dependency name, in Redis; see the module."""

    def __init__(
        self,
        link: RedisLink,
        key: str,
        *,
        limit: int = MAX_INDEXED,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._link = link
        self._key = key
        self._limit = limit
        self._clock = clock

    def add(self, dependency: str) -> bool:
        """Index ``dependency`` (one round trip, trimmed to the bound); False: Redis is away."""

        def op(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.zadd(self._key, {dependency: self._clock()})
            pipe.zremrangebyrank(self._key, 0, -self._limit - 1)
            pipe.execute()

        try:
            self._link.run(op)
        except Unreachable:
            return False
        return True

    def names(self) -> list[str] | None:
        """Every indexed dependency (at most the bound); None while Redis is unreachable."""
        try:
            found = self._link.run(lambda c: c.zrange(self._key, 0, self._limit - 1))
        except Unreachable:
            return None
        return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in found]


class RedisBreakerStorage(SharedStorage):
    """One dependency's breaker in Redis, with a local copy; see the module.

    Only reading ``state`` asks Redis (one ``MGET`` of everything); the
    counts, ``opened_at`` and isolation are answered from the copy that read
    refreshed, and the increments update it with Redis's new value.
    """

    def __init__(
        self,
        link: RedisLink,
        namespace: str,
        *,
        index: BreakerIndex | None = None,
        dependency: str = "",
    ) -> None:
        super().__init__("redis")
        self._link = link
        self._namespace = namespace
        #: Where the fleet lists it, once it is written to Redis (None: once done).
        self._index = index
        self._dependency = dependency
        self._keys = [f"{namespace}:{field}" for field in (*_FIELDS, _OPENED_AT, _ISOLATED)]
        self._state = pybreaker.STATE_CLOSED
        self._fail = 0
        self._success = 0
        self._opened_at: int | None = None  # wall-clock seconds, as pybreaker stores it
        self._isolated = False
        #: Written here while Redis was unreachable: reconcile at the next read.
        self._diverged = False
        #: An operator's isolate or close among those writes: written as it is here.
        self._manual = False

    # -- pybreaker's storage interface ------------------------------------------------

    @property
    def state(self) -> str:
        self._pull()
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._write(lambda: setattr(self, "_state", state), lambda c: c.set(self._keys[0], state))

    def increment_counter(self) -> None:
        self._write(
            lambda: setattr(self, "_fail", self._fail + 1),
            lambda c: setattr(self, "_fail", int(c.incr(self._keys[1]))),
        )

    def reset_counter(self) -> None:
        self._write(lambda: setattr(self, "_fail", 0), lambda c: c.set(self._keys[1], 0))

    def increment_success_counter(self) -> None:
        self._write(
            lambda: setattr(self, "_success", self._success + 1),
            lambda c: setattr(self, "_success", int(c.incr(self._keys[2]))),
        )

    def reset_success_counter(self) -> None:
        self._write(lambda: setattr(self, "_success", 0), lambda c: c.set(self._keys[2], 0))

    @property
    def counter(self) -> int:
        return self._fail

    @property
    def success_counter(self) -> int:
        return self._success

    @property
    def opened_at(self) -> datetime | None:
        if self._opened_at is None:
            return None
        return datetime.fromtimestamp(self._opened_at, timezone.utc)

    @opened_at.setter
    def opened_at(self, now: datetime) -> None:
        stamp = int(now.timestamp())
        self._write(
            lambda: setattr(self, "_opened_at", stamp), lambda c: c.set(self._keys[3], stamp)
        )

    # -- isolation (SharedStorage) ---------------------------------------------------

    def isolated(self) -> bool:
        return self._isolated

    def set_isolated(self, isolated: bool) -> None:
        written = self._write(
            lambda: setattr(self, "_isolated", isolated),
            lambda c: c.set(self._keys[4], int(isolated)),
        )
        if not written:
            self._manual = True

    # -- internals ------------------------------------------------------------------

    def _write(self, change: Callable[[], None], op: Callable[[Any], object]) -> bool:
        """``change`` to the local copy, then ``op`` in Redis; False when Redis was unreachable.

        A copy that diverged reconciles first, so that the change is neither
        lost to the shared state nor counted twice.
        """
        if self._diverged:
            self._pull()
        change()
        if self._diverged:
            return False
        try:
            self._link.run(op)
        except Unreachable:
            self._diverged = True
            return False
        self._indexed()
        return True

    def _indexed(self) -> None:
        """List the dependency in the fleet's index at its first write (once a storage)."""
        index = self._index
        if index is not None and index.add(self._dependency):
            self._index = None

    def _pull(self) -> None:
        try:
            values = self._link.run(lambda c: c.mget(self._keys))
        except Unreachable:
            return  # the local copy stands: an open breaker stays open
        remote = _parse(values)
        if self._diverged:
            self._reconcile(remote)
        elif remote is not None:
            self._adopt(remote)
        elif self._state != pybreaker.STATE_CLOSED or self._fail or self._isolated:
            self._reconcile(None)  # Redis lost the keys (restarted empty): what it had is here
        # else none yet: a first write creates them (a read of a clean breaker writes nothing)

    def _adopt(self, remote: _Remote) -> None:
        self._state, self._fail, self._success, self._opened_at, self._isolated = remote

    def _reconcile(self, remote: _Remote | None) -> None:
        """This copy's changes made while Redis was unreachable, or Redis lost the keys."""
        local: _Remote = (self._state, self._fail, self._success, self._opened_at, self._isolated)
        if remote is not None and not self._manual and _rank(remote) >= _rank(local):
            self._adopt(remote)
            self._fail = max(local[1], remote[1])
            kept = self._fail == remote[1] or self._push({self._keys[1]: self._fail})
        else:
            if remote is not None:
                self._fail = max(local[1], remote[1])
            kept = self._push(
                {
                    self._keys[0]: self._state,
                    self._keys[1]: self._fail,
                    self._keys[2]: self._success,
                    self._keys[4]: int(self._isolated),
                    **({self._keys[3]: self._opened_at} if self._opened_at is not None else {}),
                }
            )
            if kept and remote is not None and _rank(remote) != _rank(local):
                log.info(
                    "breaker %s: this sidecar's %s kept over the shared %s (changed while"
                    " Redis was unreachable)",
                    self._namespace,
                    _describe(local),
                    _describe(remote),
                )
        if kept:
            self._diverged = self._manual = False

    def _push(self, mapping: dict[str, Any]) -> bool:
        try:
            self._link.run(lambda c: c.mset(mapping))
        except Unreachable:
            return False
        self._indexed()
        return True


#: (state, failures, successes, opened_at, isolated), as read from Redis.
_Remote = tuple[str, int, int, int | None, bool]


def _parse(values: list[bytes | None]) -> _Remote | None:
    """Redis's values, or None when the state is missing or not one pybreaker knows."""
    state = values[0].decode("utf-8", "replace") if values[0] is not None else None
    if state not in _SEVERITY:
        return None
    opened = _int(values[3])
    return (state, _int(values[1]) or 0, _int(values[2]) or 0, opened, values[4] == b"1")


def _int(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _rank(state: _Remote) -> tuple[bool, int]:
    return state[4], _SEVERITY[state[0]]


def _describe(state: _Remote) -> str:
    return "isolated" if state[4] else state[0]


def shared_breakers(
    url: str,
    *,
    namespace: str,
    timeout_s: float,
    retry_s: float,
    required: bool,
) -> tuple[Callable[[str], pybreaker.CircuitBreakerStorage], RedisLink]:
    """The storage factory for a governor, and the link (for stats), for the Redis at ``url``.

    The client never retries (a retry would multiply ``timeout_s``). Redis is
    pinged once: when it does not answer, the sidecar starts with local
    breakers (and says so) unless ``required``, when it raises ConfigError.
    """
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}"
    where += f"/{kwargs.get('db', 0)}"
    link = RedisLink(client, where=where, retry_s=retry_s)
    link.index = index = BreakerIndex(link, f"{namespace}:breakers")
    if required:
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            client.close()
            raise ConfigError(f"cannot reach the breakers' Redis at {where}: {exc}") from exc
    else:
        # Not answering is logged by the link; the sidecar starts with local breakers.
        with contextlib.suppress(Unreachable):
            link.run(lambda c: c.ping())

    def storage(dependency: str) -> pybreaker.CircuitBreakerStorage:
        return RedisBreakerStorage(
            link, f"{namespace}:breaker:{dependency}", index=index, dependency=dependency
        )

    return storage, link
