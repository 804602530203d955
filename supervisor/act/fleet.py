"""A fleet's members: each sidecar beats in the shared store; a live one takes over a dead one.

Why: a sidecar of a fleet (``database_url``) that dies and never comes back
would leave work nobody does. DBOS resumes an executor's pending remediation
workflows only when that same executor starts again, and a push command the
dead sidecar had claimed (:meth:`Store.due <supervisor.act.store.Store.due>`)
waits out the rest of its claim.

How:

* **Heartbeats.** Every ``instance_heartbeat_s`` each sidecar writes the time
  in its row of ``instances`` (:mod:`.store_pg`), off the event loop. A
  sidecar started again under the same id is alive again: its beat clears a
  taken-over mark.
* **Dead**: no beat for ``instance_dead_after_s``. Times are the database
  server's (:meth:`Fleet.now`), so the sidecars' clocks need not agree.
* **Takeover.** After its beat, a sidecar claims a dead one not yet taken
  over, in one ``UPDATE ... RETURNING`` that re-checks both conditions on the
  row it locked: of sidecars racing for it, exactly one gets it. It then
  resumes the dead executor's pending remediations (DBOS enqueues them; any
  live executor runs each from its last completed step, and a durable sleep
  keeps its wake-up time), starts those it stored and had not started yet, and
  makes the dead sidecar's claimed commands due
  now (:meth:`Store.release_claims <supervisor.act.store.Store.release_claims>`).
  A sidecar that cannot resume yet (its remediations are starting) gives the
  claim back, for the next round or another sidecar.

A dead sidecar's work moves ``instance_dead_after_s`` after its last beat,
plus up to one heartbeat (the round that notices). One caveat: a sidecar
that was only stopped longer than that (a paused VM), not dead, still holds
what it was running in memory, so a remediation may then run in two places
at once; when it beats again it says so in a warning. Give
``instance_dead_after_s`` more than the longest pause a sidecar may take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.act.store import Store

__all__ = ["DeadInstance", "Fleet", "Takeover"]

log = logging.getLogger("spanvisor.fleet")

#: Dead sidecars one round takes over at most (the next round takes the rest).
_MAX_PER_ROUND = 16

#: Takes over a dead sidecar's remediations, given its executor's id and its own:
#: how many; None when it cannot yet.
Resume = Callable[[str, str], "int | None"]


@dataclass(frozen=True, slots=True)
class DeadInstance:
    """A sidecar claimed as dead: its id, its remediation executor's, its last beat."""

    instance: str
    executor_id: str
    beat_at: float


@dataclass(frozen=True, slots=True)
class Takeover:
    """What one takeover moved: the dead sidecar's remediations and commands."""

    instance: str
    silent_s: float
    remediations: int
    commands: int


class Fleet:
    """This sidecar's membership in its fleet; see the module.

    :meth:`round` from the sidecar's timer, in the store's thread
    (:meth:`Store.call <supervisor.act.store.Store.call>`); the counters are
    read by ``/v1/stats`` and ``/metrics``.
    """

    def __init__(
        self,
        store: Store,
        *,
        instance: str,
        executor_id: str,
        heartbeat_s: float,
        dead_after_s: float,
        resume: Resume,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self.instance = instance
        self.executor_id = executor_id
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._resume = resume
        self._clock = clock
        self._beaten = False
        #: Sidecars beating within ``dead_after_s`` (this one too), and the others, as of
        #: the last round.
        self.alive = 0
        self.dead = 0
        #: Takeovers done by this sidecar, and what they moved.
        self.takeovers = 0
        self.remediations_resumed = 0
        self.commands_released = 0

    def now(self) -> float:
        """The time heartbeats are written and judged in: the database server's."""
        if self._clock is not None:
            return self._clock()
        with self.store.transaction() as db:
            return float(db.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0])

    def round(self) -> list[Takeover]:
        """Beat, count the members, take over the dead ones (blocking: off the loop)."""
        now = self.now()
        self.beat(now)
        self.count(now)
        return self.take_over(now)

    def beat(self, now: float) -> None:
        """This sidecar is alive at ``now`` (a taken-over mark is cleared)."""
        with self.store.transaction() as db:
            row = db.execute(
                "SELECT beat_at, taken_over_by FROM instances WHERE id = ? FOR UPDATE",
                (self.instance,),
            ).fetchone()
            db.execute(
                "INSERT INTO instances (id, executor_id, beat_at) VALUES (?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET executor_id = excluded.executor_id,"
                " beat_at = excluded.beat_at, taken_over_by = NULL, taken_over_at = NULL",
                (self.instance, self.executor_id, now),
            )
        first, self._beaten = not self._beaten, True
        if row is None or row["taken_over_by"] is None:
            return
        silent = round(now - float(row["beat_at"]), 1)
        if first:  # started again: what it left went on elsewhere
            log.info(
                "this instance had been taken over while it was away; it beats again",
                extra={"instance": self.instance, "by": row["taken_over_by"], "silent_s": silent},
            )
        else:  # it was alive all along, only silent: what it runs may now run twice
            log.warning(
                "this instance did not beat for %.1f s and was taken over by %s: remediations"
                " it was running were resumed there too; raise instance_dead_after_s",
                silent,
                row["taken_over_by"],
                extra={"instance": self.instance, "by": row["taken_over_by"], "silent_s": silent},
            )

    def count(self, now: float) -> None:
        """How many sidecars beat within ``dead_after_s``, and how many not."""
        horizon = now - self.dead_after_s
        with self.store.transaction() as db:
            # A sidecar taken over and silent for longer than the store keeps rows: gone.
            db.execute(
                "DELETE FROM instances WHERE taken_over_by IS NOT NULL AND beat_at < ?",
                (now - self.store.retention_s,),
            )
            row = db.execute(
                "SELECT COUNT(*) FILTER (WHERE beat_at >= ?),"
                " COUNT(*) FILTER (WHERE beat_at < ?) FROM instances",
                (horizon, horizon),
            ).fetchone()
        self.alive, self.dead = int(row[0]), int(row[1])

    def claim(self, now: float) -> DeadInstance | None:
        """Claim one dead sidecar not yet taken over; None when there is none (or others won).

        The row is locked (``SKIP LOCKED``: another claimer's row is passed
        over) and the conditions checked again by the update itself.
        """
        horizon = now - self.dead_after_s
        with self.store.transaction() as db:
            row = db.execute(
                "UPDATE instances SET taken_over_by = ?, taken_over_at = ?"
                " WHERE id = (SELECT id FROM instances WHERE taken_over_by IS NULL"
                " AND beat_at < ? AND id <> ? ORDER BY beat_at LIMIT 1 FOR UPDATE SKIP LOCKED)"
                " AND taken_over_by IS NULL AND beat_at < ?"
                " RETURNING id, executor_id, beat_at",
                (self.instance, now, horizon, self.instance, horizon),
            ).fetchone()
        if row is None:
            return None
        return DeadInstance(row["id"], row["executor_id"], float(row["beat_at"]))

    def give_back(self, dead: DeadInstance) -> None:
        """Undo a claim whose takeover could not be done."""
        with self.store.transaction() as db:
            db.execute(
                "UPDATE instances SET taken_over_by = NULL, taken_over_at = NULL"
                " WHERE id = ? AND taken_over_by = ?",
                (dead.instance, self.instance),
            )

    def take_over(self, now: float) -> list[Takeover]:
        """Claim the dead sidecars, resume their remediations, release their commands."""
        done: list[Takeover] = []
        for _ in range(_MAX_PER_ROUND):
            dead = self.claim(now)
            if dead is None:
                break
            try:
                resumed = self._resume(dead.executor_id, dead.instance)
            except Exception:
                log.exception("could not resume a dead instance's remediations")
                resumed = None
            if resumed is None:
                self.give_back(dead)
                break
            released = self.store.release_claims(dead.instance, now)
            taken = Takeover(dead.instance, round(now - dead.beat_at, 3), resumed, released)
            self.takeovers += 1
            self.remediations_resumed += resumed
            self.commands_released += released
            log.warning(
                "took over dead instance %s (silent %.1f s): %d remediations resumed,"
                " %d commands released",
                taken.instance,
                taken.silent_s,
                resumed,
                released,
                extra={
                    "dead_instance": taken.instance,
                    "silent_s": taken.silent_s,
                    "remediations": resumed,
                    "commands": released,
                },
            )
            done.append(taken)
        return done

    def stats(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "alive": self.alive,
            "dead": self.dead,
            "takeovers": self.takeovers,
            "remediations_resumed": self.remediations_resumed,
            "commands_released": self.commands_released,
            "heartbeat_s": self.heartbeat_s,
            "dead_after_s": self.dead_after_s,
        }
