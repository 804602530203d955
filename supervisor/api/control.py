"""What the control API and the CLI can do to a running sidecar, without HTTP.

:mod:`supervisor.api.server` maps routes onto these methods, so every operation is
testable in process with real components (an in-memory store, a real
governor). Answers are JSON-ready; span content in them is data.

Lifecycle: built by the sidecar once its parts exist; methods run on the
sidecar's event loop (FastAPI's sync endpoints would use a thread pool, so
the routes are all ``async``). The remediation runner's methods block, so
the remediation operations await them on a worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar, cast

from policies import Governor, Policy
from supervisor.act.actor import Actor
from supervisor.act.store import (
    ApprovalError,
    Incident,
    IncidentCounts,
    RedeliveryError,
    Store,
    StoredCommand,
)
from supervisor.act.store_rows import APPROVAL_STATUSES
from supervisor.act.store_runs import StoredRuns
from supervisor.admission import Admitter, admission_key
from supervisor.api.inline import Question, decide
from supervisor.api.paging import CursorError, Key, decode_cursor, encode_cursor
from supervisor.api.recent_answers import RecentAnswers
from supervisor.api.store_outage import StoreOutage
from supervisor.api.thread_cpu import thread_cpu
from supervisor.errors import ConfigError
from supervisor.forward.breaker_history import BreakerHistory, BreakerTimeline
from supervisor.records import REMEDIATION_STATUSES, RUN_STATUSES
from supervisor.settings import AgentDelivery, PullChannel

MAX_WAIT_S = 30.0
MAX_LIMIT = 1000
#: Remediations read past a page's end, to order those created at the same time.
_SAME_TIME_MARGIN = 16
#: The most remediations one page reads (many created in one second grow the read).
_MAX_REMEDIATIONS_READ = 20_000

#: A remediation's id, as :func:`supervisor.records.remediation_ids` makes it.
REMEDIATION_ID = re.compile(r"^rem_[0-9a-f]{1,64}$")
#: States in which a remediation is over: nothing left to cancel.
FINISHED = frozenset({"SUCCESS", "ERROR", "CANCELLED"})
#: The longest window incidents are counted over (a retention is a week by default).
MAX_COUNT_WINDOW_S = 31 * 86_400.0
#: The most buckets one count of incidents has.
MAX_COUNT_BUCKETS = 200
#: How long an incident count is kept and answered again (per window).
COUNTS_KEPT_S = 10.0
#: The longest window a breaker's changes are shown over.
MAX_BREAKER_WINDOW_S = 7 * 86_400.0
#: What a re-delivery refused answers, by :attr:`RedeliveryError.why`.
_REDELIVERY_STATUS = {"unknown": 404, "not_dead": 409, "no_channel": 409, "full": 503}
#: Why remediations are unavailable when the control API has no remediations at all.
NOT_RUNNING = "remediations are not running on this sidecar"


T = TypeVar("T")


#: How often a long poll on a fleet's shared store looks for commands other sidecars stored.
FLEET_LOOK_S = 0.5


class RemediationRunner(Protocol):
    """What the control API asks :class:`remediators.runner.DurableRunner`.

    Every method blocks (up to 10 s, waiting for the runner's thread) and
    raises ConfigError once the runner has stopped: call them off the loop.
    """

    def show(self, remediation_id: str) -> dict[str, Any] | None: ...

    def cancel(self, remediation_id: str) -> bool: ...

    def list(
        self, limit: int = 50, status: str | None = None, created_before: float | None = None
    ) -> builtins.list[dict[str, Any]]: ...


class RemediationsView(Protocol):
    """What the control API reads of :class:`supervisor.remediation.engine.Remediations`."""

    @property
    def runner(self) -> RemediationRunner | None: ...

    def describe(self) -> dict[str, Any]: ...


class RunEntry(Protocol):
    """One run as the control API reads it (:class:`supervisor.runs.RunView`)."""

    @property
    def service(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def last_seen_at(self) -> float: ...

    def to_json(self) -> dict[str, Any]: ...


class RunsView(Protocol):
    """What the control API reads of :class:`supervisor.runs.RunTracker`.

    The tracker belongs to the event loop's thread (the pipeline updates it
    there) and is not thread-safe: call these on the loop, never on a worker.
    """

    def snapshot(
        self,
        limit: int = 100,
        now: float | None = None,
        *,
        before: tuple[float, str] | None = None,
        service: str | None = None,
        status: str | None = None,
    ) -> Sequence[RunEntry]: ...

    def stats(self) -> dict[str, int]: ...

    def find(self, run_id: str) -> RunEntry | None: ...


class FailureList(Protocol):
    """What the control API reads of :class:`supervisor.act.failure_log.RecentFailures`."""

    def page(
        self, limit: int, before: int | None = None
    ) -> tuple[builtins.list[dict[str, Any]], int | None]: ...


class ControlError(ValueError):
    """A request the sidecar cannot do: the message says why (an API 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Control:
    """The operations of the control API; see the module."""

    store: Store
    actor: Actor
    governor: Governor
    policy: Callable[[], Policy]
    #: The recent failures in memory (the incidents are the store's).
    failures: FailureList
    stats: Callable[[], dict[str, Any]]
    ready: Callable[[], bool]
    reload: Callable[[], dict[str, Any]]
    clock: Callable[[], float] = time.time
    #: What degrades the sidecar while it serves (readiness says; empty: nothing).
    degraded: Callable[[], list[str]] = list
    #: The sidecar's remediations (None: a control API without them, as in some tests).
    remediations: RemediationsView | None = None
    #: The sidecar's run tracker (None: runs are not tracked, as in some tests).
    runs: RunsView | None = None
    #: The body of ``/metrics`` (:func:`supervisor.api.metrics.exposition`; None: not served).
    exposition: Callable[[], bytes] | None = None
    #: The fleet's breaker names, from Redis (None from it: Redis is away; None: not shared).
    fleet_breakers: Callable[[], builtins.list[str] | None] | None = None
    #: The shared store as requests last found it (an outage: 503, said once in the log).
    outage: StoreOutage = field(default_factory=StoreOutage)
    #: The breakers' recent changes as this sidecar saw them (None: not kept).
    breaker_history: BreakerHistory | None = None
    #: Incident counts kept a few seconds per window (see :meth:`incident_counts`).
    recent_counts: RecentAnswers[IncidentCounts] = field(
        default_factory=lambda: RecentAnswers(COUNTS_KEPT_S)
    )
    #: The fleet's runs in the shared store (None: not a fleet, runs are this sidecar's).
    fleet_runs: StoredRuns | None = None
    #: Admission control (None: every call may go, as in some tests).
    admitter: Admitter | None = None

    def health(self) -> list[str]:
        """What degrades the sidecar now: the sidecar's own reasons and a store found down."""
        found = list(self.degraded())
        down = self.outage.degraded()
        if down is not None:
            found.append(down)
        return found

    async def stored(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, a store call, as :meth:`Store.call` makes it; one that
        answers ends an outage (one that cannot raises StoreUnavailable: a 503)."""
        result = await self.store.call(fn, *args, **kwargs)
        self.outage.reached()
        return result

    async def stored_in_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """As :meth:`stored`, in a worker thread on SQLite too (:meth:`Store.call_in_thread`)."""
        result = await self.store.call_in_thread(fn, *args, **kwargs)
        self.outage.reached()
        return result

    def all_stats(self) -> dict[str, Any]:
        return self.stats()

    def metrics(self) -> bytes:
        """The counters of :meth:`all_stats`' stages, in the Prometheus text format."""
        if self.exposition is None:
            raise ControlError("this control API serves no metrics", 404)
        return self.exposition()

    def threads(self) -> dict[str, Any]:
        """CPU seconds of the process and of each of its threads (see :mod:`.thread_cpu`)."""
        return thread_cpu()

    # -- incidents and commands -------------------------------------------

    def failure_page(self, limit: int, cursor: str | None) -> dict[str, Any]:
        """Recent failures in memory, newest last; ``next_cursor`` leads to older ones."""
        before = _row_cursor(cursor, "failures")
        found, more = self.failures.page(limit, before)  # the route bounds it (10,000)
        return {"failures": found, "next_cursor": _next_row(more, "failures")}

    def incidents(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        """Stored incidents, newest first: what survives a restart (until ``retention_s``)."""
        page = self.store.incident_page(_limit(limit), _row_cursor(cursor, "incidents"))
        return {
            "incidents": [_incident_view(i) for i in page.items],
            "next_cursor": _next_row(page.next_before, "incidents"),
        }

    def incident(self, key: str) -> dict[str, Any]:
        found = self.store.incident(key)
        if found is None:
            raise ControlError(f"no incident {key!r}", 404)
        return _incident_view(found)

    def commands(
        self, *, status: str | None, service: str | None, limit: int, cursor: str | None = None
    ) -> dict[str, Any]:
        """Commands of every channel, newest first; ``dead`` ones are the dead letters."""
        if status is not None and status not in ("pending", "leased", "delivered", "dead"):
            raise ControlError("status must be pending, leased, delivered or dead")
        page = self.store.command_page(
            status=status,
            service=service,
            limit=_limit(limit),
            before=_row_cursor(cursor, "commands"),
        )
        return {
            # Which sidecar judged and delivered each: for operators, not sent to agents.
            "commands": [_command_view(c) for c in page.items],
            "next_cursor": _next_row(page.next_before, "commands"),
        }

    def command(self, command_id: str) -> dict[str, Any]:
        """One stored command, for operators (404: none by that id)."""
        found = self.store.command(command_id)
        if found is None:
            raise ControlError(f"no command {command_id!r}", 404)
        return _command_view(found)

    def dead_letters(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        answer = self.commands(status="dead", service=None, limit=limit, cursor=cursor)
        return {"dead_letters": answer["commands"], "next_cursor": answer["next_cursor"]}

    async def redeliver(self, command_id: str, *, by: str) -> dict[str, Any]:
        """Put dead letter ``command_id`` back to pending and wake its deliverers.

        Stored off the loop (a slow shared store does not hold it), announced on
        it, as a new command is: the dispatcher sends it at once, a pull agent's
        long poll gets it. 404: unknown; 409: not dead, or its service still
        has no channel; 503: ``max_pending`` commands already wait.
        """
        actor = self.actor
        try:
            stored = await self.stored(
                self.store.redeliver,
                command_id,
                channel_for=actor.channel_for,
                by=by,
                now=self.clock(),
            )
        except RedeliveryError as exc:
            raise ControlError(str(exc), _REDELIVERY_STATUS.get(exc.why, 409)) from None
        actor.announce([stored])
        return _command_view(stored)

    async def incident_counts(
        self, *, window_s: float = 86_400.0, buckets: int = 24, end: float | None = None
    ) -> IncidentCounts:
        """Stored incidents by class and kind in ``buckets`` equal buckets over ``window_s``.

        Buckets fall on multiples of their width (hours for the default day), the
        last one holding ``end`` (default now), so a refresh moves the chart by
        whole buckets. Counted in the store's SQL, in a worker thread on SQLite
        too (about 45 ms at 10,000 rows: too long to hold the loop); bounded
        (see :meth:`Store.incident_counts`: ``complete`` False when it was).

        Kept :data:`COUNTS_KEPT_S` seconds per window (its buckets, its first
        bucket): a console refreshed by several browsers counts once, and
        callers asking while a count runs wait for it. So a count may miss
        the incidents of its last few seconds.
        """
        if not 1 <= buckets <= MAX_COUNT_BUCKETS:
            raise ControlError(f"buckets must be between 1 and {MAX_COUNT_BUCKETS}")
        if not 60.0 <= window_s <= MAX_COUNT_WINDOW_S:
            raise ControlError(f"the window must be between 60 and {MAX_COUNT_WINDOW_S:g} seconds")
        bucket_s = window_s / buckets
        last = math.floor((self.clock() if end is None else end) / bucket_s) * bucket_s
        start = last - (buckets - 1) * bucket_s
        return await self.recent_counts.get(
            (start, bucket_s, buckets),
            lambda: self.stored_in_thread(self.store.incident_counts, start, bucket_s, buckets),
        )

    def _pull_settings(self, service: str) -> PullChannel:
        delivery: AgentDelivery | None = self.actor.agents.get(service) or self.actor.agents.get(
            "*"
        )
        if delivery is None or delivery.pull is None:
            raise ControlError(
                f"service {service!r} does not take commands by pull: configure"
                f" agents.{service}.pull in the settings",
                404,
            )
        return delivery.pull

    async def pull(self, service: str, *, wait_s: float, limit: int) -> list[dict[str, Any]]:
        """Lease due commands of ``service``, waiting up to ``wait_s`` for one (long poll).

        The wait ends early when a command for ``service`` is stored (notified) or
        one of its own commands comes due or has its lease run out (timed); other
        services' commands never wake it, so an idle poll is a few store calls.
        """
        if not service:
            raise ControlError("service is required")
        settings = self._pull_settings(service)
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ControlError(f"wait must be between 0 and {MAX_WAIT_S:g} seconds")
        deadline = time.monotonic() + wait_s
        while True:
            event = self.actor.waiters.event(service)
            store = self.store
            leased = await self.stored(
                store.lease, service, self.clock(), settings.visibility_s, _limit(limit)
            )
            if leased:
                return [c.to_json() for c in leased]
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            # A delayed command (not_before) becoming due and a lease running out are not
            # announced: sleep until the first of these for this service's own commands.
            next_at = await self.stored(store.next_lease_at, service)
            if next_at is not None:
                left = min(left, max(0.01, next_at - self.clock()))
            if self.store.shared:
                # A command another sidecar of the fleet stores is announced there only.
                left = min(left, FLEET_LOOK_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=left)

    def ack(self, command_id: str, service: str) -> dict[str, Any]:
        if not service:
            raise ControlError("service is required")
        if not self.store.ack(command_id, service, self.clock()):
            found = self.store.command(command_id)
            if found is None or found.command.service != service:
                raise ControlError(f"no command {command_id!r} for service {service!r}", 404)
            raise ControlError(
                f"command {command_id!r} is {found.status}, not waiting for an ack", 409
            )
        return {"id": command_id, "status": "delivered"}

    # -- approvals ----------------------------------------------------------

    def approvals(
        self, status: str | None, limit: int, cursor: str | None = None
    ) -> dict[str, Any]:
        if status is not None and status not in APPROVAL_STATUSES:
            raise ControlError("status must be one of " + ", ".join(APPROVAL_STATUSES))
        page = self.store.approval_page(
            status=status, limit=_limit(limit), before=_row_cursor(cursor, "approvals")
        )
        return {
            "approvals": [a.to_json() for a in page.items],
            "next_cursor": _next_row(page.next_before, "approvals"),
        }

    def approval(self, approval_id: str) -> dict[str, Any]:
        found = self.store.approval(approval_id)
        if found is None:
            raise ControlError(f"no approval request {approval_id!r}", 404)
        return found.to_json()

    async def answer(
        self, approval_id: str, *, approved: bool, by: str, note: str
    ) -> dict[str, Any]:
        """Answer an approval: stored off the loop (a slow shared store does not hold it),
        then announced on it."""
        try:
            answered, created = await self.stored(
                self.actor.answer_stored, approval_id, approved=approved, by=by, note=note
            )
            return self.actor.announce_answer(answered, created).to_json()
        except ApprovalError as exc:
            status = 404 if "no approval" in str(exc) else 409
            raise ControlError(str(exc), status) from None

    # -- breakers -------------------------------------------------------------

    def breakers(self, limit: int = MAX_LIMIT, cursor: str | None = None) -> dict[str, Any]:
        """Breakers by dependency name; ``next_cursor`` past the page's last name.

        With breakers shared through Redis, the fleet's: those this sidecar
        tracks and those only others have used (the index in Redis), each of
        the latter read there (``tracked_here`` false), so its state is the
        fleet's. ``scope`` says which: ``fleet``, or ``local`` (breakers not
        shared, or Redis away: ``why`` says so).
        """
        limit = _limit(limit)
        after = _cursor(cursor, "breakers", (str,))
        board = self.governor.board
        here = {b.dependency: b for b in board.snapshot()}
        scope, why = "local", None
        names = set(here)
        if self.fleet_breakers is not None:
            fleet = self.fleet_breakers()
            if fleet is None:
                why = "the breakers' Redis is unreachable: this sidecar's own breakers only"
            else:
                scope = "fleet"
                names.update(fleet)
        found = sorted(n for n in names if after is None or n > str(after[0]))
        page = found[:limit]
        more = len(found) > limit
        offset = self.clock() - board.now()
        # Only the page's names are read from Redis (one round trip each, as GET one does).
        rows = [
            {
                **_breaker_json(asdict(here.get(n) or board.info(n)), offset),
                "tracked_here": n in here,
            }
            for n in page
        ]
        answer: dict[str, Any] = {
            "breakers": rows,
            "scope": scope,
            "next_cursor": encode_cursor("breakers", (page[-1],)) if more else None,
        }
        if why is not None:
            answer["why"] = why
        return answer

    def breaker_timelines(
        self, dependencies: Sequence[str], *, window_s: float = 6 * 3600.0
    ) -> dict[str, BreakerTimeline]:
        """Each breaker's state now and the changes this sidecar saw over ``window_s``.

        On the loop, as :meth:`breakers` (a Redis read per breaker not tracked
        here). A breaker this sidecar does not track (only other sidecars of
        the fleet use it) has no changes here: its whole window is unknown,
        its state now the fleet's. See :mod:`supervisor.forward.breaker_history`
        for what the changes of breakers shared through Redis are.
        """
        if not 60.0 <= window_s <= MAX_BREAKER_WINDOW_S:
            raise ControlError(
                f"the window must be between 60 and {MAX_BREAKER_WINDOW_S:g} seconds"
            )
        if len(dependencies) > MAX_LIMIT:
            raise ControlError(f"at most {MAX_LIMIT} breakers at once")
        board = self.governor.board
        tracked = {b.dependency for b in board.snapshot()}
        end = self.clock()
        start = end - window_s
        found: dict[str, BreakerTimeline] = {}
        for dependency in dependencies:
            state = board.info(dependency).state.value
            history = self.breaker_history
            if history is None or dependency not in tracked:
                found[dependency] = BreakerTimeline(dependency, start, end, state, end, ())
            else:
                found[dependency] = history.timeline(dependency, state, start, end)
        return found

    def breaker(self, dependency: str) -> dict[str, Any]:
        self.governor.breaker_state(dependency)  # moves an elapsed open breaker to half-open
        board = self.governor.board
        return _breaker_json(asdict(board.info(dependency)), self.clock() - board.now())

    def isolate(self, dependency: str) -> dict[str, Any]:
        if not dependency:
            raise ControlError("dependency is required")
        if not self.governor.isolate(dependency):
            raise ControlError("too many breakers are tracked to isolate another one", 503)
        return self.breaker(dependency)

    def close_breaker(self, dependency: str) -> dict[str, Any]:
        if not dependency:
            raise ControlError("dependency is required")
        self.governor.close(dependency)
        return self.breaker(dependency)

    # -- remediations ----------------------------------------------------------

    def _remediations(self) -> RemediationsView | None:
        return self.remediations

    def _runner(self) -> RemediationRunner:
        remediations = self._remediations()
        runner = remediations.runner if remediations is not None else None
        if runner is None:
            why = remediations.describe().get("why") if remediations is not None else None
            raise ControlError(str(why or NOT_RUNNING), 409)
        return runner

    async def _ask(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the runner's methods block."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ConfigError as exc:
            raise ControlError(f"remediations are unavailable: {exc}", 503) from None
        except (TimeoutError, concurrent.futures.TimeoutError):  # one class from 3.11 on
            raise ControlError(
                "the remediation runner did not answer in time; try again", 503
            ) from None

    async def remediation_list(
        self, *, status: str | None, limit: int, cursor: str | None = None
    ) -> dict[str, Any]:
        """Newest first; ``running`` false (and none listed) when the runner is not up,
        with ``state`` and ``why`` saying what is the case."""
        if status is not None:
            status = status.upper()
            if status not in REMEDIATION_STATUSES:
                raise ControlError("status must be one of " + ", ".join(REMEDIATION_STATUSES))
        limit = _limit(limit)
        after = _cursor(cursor, "remediations", (float, str))
        remediations = self._remediations()
        runner = remediations.runner if remediations is not None else None
        if runner is None:
            described = remediations.describe() if remediations is not None else {}
            return {
                "remediations": [],
                "running": False,
                "state": described.get("state", "off"),
                "why": described.get("why", NOT_RUNNING),
                "next_cursor": None,
            }
        page, more = await self._remediation_page(runner, status, limit, after)
        next_cursor = (
            encode_cursor("remediations", (_created(page[-1]), str(page[-1].get("id", ""))))
            if more and page
            else None
        )
        return {"remediations": page, "running": True, "next_cursor": next_cursor}

    async def _remediation_page(
        self, runner: RemediationRunner, status: str | None, limit: int, after: Key | None
    ) -> tuple[builtins.list[dict[str, Any]], bool]:
        """``limit`` remediations after the cursor's (time, id), newest first; and whether
        more are left.

        DBOS keeps creation times to the second or the millisecond, bounds a list
        by time only, and orders equal times arbitrarily: the page is read with a
        margin and ordered here by (time, id). When the read was cut (more were
        there), its oldest time may be cut through, so that time is left for the
        next page; the read grows until the page fills.
        """
        created_before = None if after is None else float(after[0])
        size = limit + 1 + _SAME_TIME_MARGIN
        while True:
            found: builtins.list[dict[str, Any]] = _jsonable(
                await self._ask(runner.list, size, status, created_before)
            )
            ordered = sorted(found, key=_remediation_key, reverse=True)
            if after is not None:
                ordered = [r for r in ordered if _remediation_key(r) < after]
            complete = len(found) < size
            if not complete and ordered:
                oldest = _created(ordered[-1])
                whole = [r for r in ordered if _created(r) > oldest]
                if whole or size < _MAX_REMEDIATIONS_READ:
                    ordered = whole
            if len(ordered) > limit or complete or size >= _MAX_REMEDIATIONS_READ:
                return ordered[:limit], len(ordered) > limit or not complete
            size = min(size * 4, _MAX_REMEDIATIONS_READ)

    async def remediation(self, remediation_id: str) -> dict[str, Any]:
        """One remediation with its request (the workflow input) and its recorded steps."""
        _check_remediation_id(remediation_id)
        runner = self._runner()
        found = await self._ask(runner.show, remediation_id)
        if found is None:
            raise ControlError(f"no remediation {remediation_id!r}", 404)
        return cast(dict[str, Any], _jsonable(found))

    async def cancel_remediation(self, remediation_id: str) -> dict[str, Any]:
        """Cancel a remediation still running: 404 when unknown, 409 when it is over."""
        _check_remediation_id(remediation_id)
        runner = self._runner()
        found = await self._ask(runner.show, remediation_id)
        if found is None:
            raise ControlError(f"no remediation {remediation_id!r}", 404)
        if found.get("status") in FINISHED:
            raise ControlError(_finished(remediation_id, found), 409)
        if not await self._ask(runner.cancel, remediation_id):
            # It finished (or vanished) between the look and the cancel.
            again = await self._ask(runner.show, remediation_id)
            if again is None:
                raise ControlError(f"no remediation {remediation_id!r}", 404)
            raise ControlError(_finished(remediation_id, again), 409)
        return {"cancelled": True, "id": remediation_id}

    # -- runs -------------------------------------------------------------------

    async def run_list(
        self,
        *,
        status: str | None,
        service: str | None,
        limit: int,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """The most recently active runs first; ``tracking`` false (none listed) without a tracker.

        In a fleet (``fleet_runs``): the fleet's runs, from the shared store, each with the
        sidecar that ``tracked_by`` it; else this sidecar's, read on the loop (the tracker
        is the loop's, see :class:`RunsView`). Pages are keyed on (last span time, run
        id): a run active again after its page was read moves ahead of the cursor and is
        not shown twice.
        """
        if status is not None:
            status = status.lower()
            if status not in RUN_STATUSES:
                raise ControlError("status must be one of " + ", ".join(RUN_STATUSES))
        limit = _limit(limit)
        after = _cursor(cursor, "runs", (float, str))
        before = None if after is None else (float(after[0]), str(after[1]))
        runs = self.runs
        if runs is None and self.fleet_runs is None:
            return {"runs": [], "tracking": False, "next_cursor": None}
        listed: list[dict[str, Any]]
        if self.fleet_runs is not None:
            listed = await self.stored(
                self.fleet_runs.page,
                limit + 1,
                self.clock(),
                before=before,
                service=service,
                status=status,
            )
        else:
            assert runs is not None
            views = runs.snapshot(limit=limit + 1, before=before, service=service, status=status)
            listed = [view.to_json() for view in views]
        page = listed[:limit]
        last = page[-1] if page else None
        answer: dict[str, Any] = {
            "runs": page,
            "tracking": True,
            "fleet": self.fleet_runs is not None,
            "stats": dict(runs.stats()) if runs is not None else {},
            "next_cursor": encode_cursor("runs", (last["last_seen_at"], last["run_id"]))
            if last is not None and len(listed) > limit
            else None,
        }
        slo_status = getattr(runs, "slo_status", None)  # the tracker's SLOs, when it has them
        if callable(slo_status):
            answer["slo"] = slo_status()
        return answer

    async def run(self, run_id: str) -> dict[str, Any] | None:
        """One run as :meth:`run_list` shows it; None when no sidecar tracks it.

        This sidecar's tracker first (read on the loop); in a fleet, then the shared
        store's row of a run another sidecar tracks.
        """
        found = self.runs.find(run_id) if self.runs is not None else None
        if found is not None:
            return found.to_json()
        if self.fleet_runs is None:
            return None
        return await self.stored(self.fleet_runs.find, run_id, self.clock())

    # -- decisions --------------------------------------------------------------

    def decide(self, question: Question) -> dict[str, Any]:
        if not question.dependency:
            raise ControlError("dependency is required, e.g. openai:gpt-4o or tool:search")
        if not 1 <= question.attempt <= 1000:
            raise ControlError("attempt must be between 1 and 1000")
        return decide(self.policy(), self.governor, question)

    def admit(
        self,
        dependency: str,
        *,
        credential: str | None,
        priority: str,
        tokens: int,
        service: str = "",
    ) -> dict[str, Any]:
        """May a call to ``dependency`` go now? ``{"go": true}``, or the wait and why."""
        try:
            key = admission_key(dependency, credential)
        except ValueError as exc:  # CredentialRefused too: never echo the value
            raise ControlError(str(exc)) from None
        spec = self.policy().limits.admission
        if self.admitter is None or not spec.enabled:
            return {"go": True}
        found = self.admitter.admit(
            key, priority=priority, tokens=tokens, service=service, weight=spec.weight(service)
        )
        if found.go:
            return {"go": True}
        return {"go": False, "wait_ms": found.wait_ms, "why": found.why}


def _command_view(stored: StoredCommand) -> dict[str, Any]:
    """A command for operators: which sidecar judged and delivered it, who re-delivered it
    (never sent to agents)."""
    return {
        **stored.to_json(),
        "judged_by": stored.judged_by,
        "delivered_by": stored.delivered_by,
        "redeliveries": stored.redeliveries,
        "redelivered_by": stored.redelivered_by,
        "redelivered_at": stored.redelivered_at,
    }


def _breaker_json(info: dict[str, Any], offset: float) -> dict[str, Any]:
    """A breaker for people: its state's name, its times in Unix seconds.

    ``offset``: Unix time minus the board's clock (a monotonic one, which no one
    can read as a date).
    """
    state = info.get("state")
    times = {
        k: None if info.get(k) is None else round(info[k] + offset, 3)
        for k in ("opened_at", "reopens_at")
    }
    return {**info, **times, "state": getattr(state, "value", state)}


def _check_remediation_id(remediation_id: str) -> None:
    if not REMEDIATION_ID.fullmatch(remediation_id):  # match() takes "rem_1\n"
        raise ControlError(
            "a remediation id is rem_ and 1 to 64 lowercase hex digits, e.g. rem_3f2a9c"
        )


def _finished(remediation_id: str, found: dict[str, Any]) -> str:
    outcome = found.get("outcome")
    how = f"{found.get('status')}" + (f", outcome {outcome}" if outcome else "")
    return f"remediation {remediation_id!r} is already finished ({how}); nothing to cancel"


def _jsonable(value: Any) -> Any:
    """Workflow inputs and step outputs as plain JSON (anything else as its text)."""
    return json.loads(json.dumps(value, default=str))


def _cursor(cursor: str | None, list_name: str, shape: tuple[type, ...]) -> Key | None:
    try:
        return decode_cursor(cursor, list_name, shape)
    except CursorError as exc:
        raise ControlError(str(exc)) from None


def _row_cursor(cursor: str | None, list_name: str) -> int | None:
    """The row id (or sequence number) in a store list's cursor."""
    key = _cursor(cursor, list_name, (int,))
    return None if key is None else int(key[0])


def _next_row(before: int | None, list_name: str) -> str | None:
    return None if before is None else encode_cursor(list_name, (before,))


def _created(remediation: dict[str, Any]) -> float:
    return float(remediation.get("created_at") or 0.0)


def _remediation_key(remediation: dict[str, Any]) -> tuple[float, str]:
    return (_created(remediation), str(remediation.get("id", "")))


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise ControlError(f"limit must be between 1 and {MAX_LIMIT}")
    return limit


def _incident_view(incident: Incident) -> dict[str, Any]:
    return {
        "key": incident.key,
        "created_at": incident.created_at,
        "judged_by": incident.judged_by,
        **incident.body,
    }
