"""A session's loops and budget counted fleet-wide, through the fleet's Redis.

In a fleet, a session's traces may reach different sidecars (a collector that
routes by trace id, a session served by several agent pods each with its
sidecar, instances coming and going): each sees part of the run, a loop
repeated over three traces on two sidecars is missed, and a budget is counted
per sidecar. With the breakers' Redis configured (``breaker_redis_url``), the
run tracker shares with the fleet what these two detectors count, for the runs
that can span traces (a session's; a run that is one trace stays local and
costs nothing more):

* **loops**: per run and kind (tool calls, LLM outputs), the recent calls'
  digests (:func:`~supervisor.runs.loops.stable_digest`) with the fleet-wide
  sequence numbers and instances (span ids, or an LLM call's prompt size) of
  their last sightings, what was reported, and the run's call count: the rule
  of :class:`~supervisor.runs.loops.RecentCalls`, on every sidecar's calls;
* **budgets**: per run, the tokens, cost and calls spent, and which budget
  kinds were reported (a service budget's stop of the run too: once fleet-wide);
* **service budgets**: per service, its window's spend and burn rate, for
  every run of the service, a trace's too (:mod:`.fleet_services`).

A batch's contributions are gathered per run by the tracker
(:class:`RunShare`) and sent in **one round trip per batch**: one call of a
Lua script that counts each run's in order, atomically, and answers what to
report (one call for the batch, not one per run: the client's work per command
cost more than the script). The round trip runs in a worker thread: sent
once the batch's spans are observed, while its failures are judged and
reported, and taken in the rest of the batch (:meth:`FleetRuns.collect_steps`
yields its future when Redis has not answered yet, and the event loop serves
others meanwhile). It takes a few milliseconds for a batch of 500 spans of
sessions on a nearby Redis, at most the link's timeout (0.25 s) when Redis
hangs, after which the link does not ask for ``breaker_redis_retry_s``.

A detection is reported **once fleet-wide**, by the sidecar whose call crossed
the line, with the rule, kind and details of a local one. This sidecar's own
count still runs: what it finds (calls the fleet did not see, made before the
trace named its session) is reported unless the fleet already reported it. A
re-sent span (the same span id) counts once in a loop, as it does locally (an
LLM span's tokens count again, as they do in one sidecar).

Keys, under ``<namespace>:runs:{<run digest>}`` (one hash slot per run):
``:tools`` and ``:outputs`` (digest -> sightings, ``#`` -> calls counted; at
most ``4 * window`` digests), ``:tools:reported`` and ``:outputs:reported``
(digest -> report and when; at most 256 new loops per run), ``:spend``; all
expire ``ttl_s`` after the run's last shared call.

**While Redis is away** (the link's breaker open, a timeout of its 0.25 s, an
error), nothing raises into the pipeline: the batch's runs are judged by this
sidecar alone, as without a fleet, and what the fleet did not count of them is
kept (:meth:`RunShare.kept`; at most ``max_backlog`` runs, and a window's worth
of each run's loop calls of each kind; what is not kept is counted): the loop
calls, each with the occurrences of its loop this sidecar reported meanwhile
(which the fleet then does not report again), and the spend, as one charge
with the crossings reported here marked. Once the link is no longer resting
(:meth:`~supervisor.shared_breakers.RedisLink.resting`; nothing is asked to
find out), the backlog goes in the round trips that follow: a run's with its
next batch, up to ``catch_up`` runs more with any batch, and between batches
from the app's once-a-second watch (:meth:`FleetRuns.catch_up`), so that runs
this sidecar sees no more are counted too. The script counts them as they
arrive, after whatever other sidecars sent meanwhile: a loop whose repeats
were split between sidecars while Redis was away is found once the last of
them has caught up, and **reported late**: then, by the sidecar whose backlog
completed it, naming the first repeated call as usual. What the fleet still
gets wrong: a budget crossed only by the fleet's total is reported when the
backlogs join it, and each sidecar may have reported a crossing of its own
meanwhile; a loop reported here meanwhile is reported again if the other
sidecars' calls alone make one before this sidecar's backlog arrives; and what
a sidecar kept is lost if it stops first.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

from redis.exceptions import NoScriptError

from policies import DetectorSettings, RunSpend
from supervisor.judge.steps import Steps, drive
from supervisor.runs.detection import Detection, loop_detection
from supervisor.runs.fleet_services import SERVICES_LUA, FleetServices, hashed_key, parse
from supervisor.runs.loops import MAX_LOOP_REPORTS, MAX_REPORTED
from supervisor.runs.spend import budget_crossed
from supervisor.runs.state import RunState
from supervisor.shared_breakers import RedisLink, Unreachable

__all__ = ["FleetRuns", "RunShare"]

log = logging.getLogger("spanvisor.runs.fleet")

#: How long Redis keeps a run's counts after its last shared call: as long as the
#: run tracker keeps an idle run.
TTL_S: Final = 6 * 3600.0
#: Runs whose loop calls and spend made while Redis was away are kept for when it answers.
MAX_BACKLOG: Final = 4096
#: Kept runs sent with a batch, besides its own runs: a backlog catches up over batches.
MAX_CATCH_UP: Final = 32

#: ARGV: the runs' batches (JSON: per run, ``k`` the prefix of its keys, ``c`` its
#: calls, ``n`` when they were received (ms), ``s`` its charges, ``b`` its budget), TTL
#: (s), MAX_LOOP_REPORTS, MAX_REPORTED, the services' charges (JSON, see
#: :data:`~supervisor.runs.fleet_services.SERVICES_LUA`), their rate's time constant.
#: The keys are named in ARGV, not KEYS: the client packs each argument into a buffer
#: that it copies whole for the next, and five keys a run cost more than the script.
#: (A batch's runs are in different hash slots anyway; the client is not a cluster's.)
#: Returns JSON: ``r`` per run [loops, spent], ``s`` per service its window; loops
#: [call index, first span, its name, occurrence, this sidecar's own (1) or the
#: fleet's (0)]; spent [charge index, crossed, calls, input tokens, output tokens,
#: cost, unpriced calls, own].
_SCRIPT: Final = (
    SERVICES_LUA
    + """
local batch = cjson.decode(ARGV[1])
local ttl = tonumber(ARGV[2])
local max_reports, max_reported = tonumber(ARGV[3]), tonumber(ARGV[4])

local function last_report(rk, digest)
  local rec = redis.call('HGET', rk, digest)
  if not rec then return 0, nil end
  local at = string.find(rec, ':', 1, true)
  return tonumber(string.sub(rec, 1, at - 1)), tonumber(string.sub(rec, at + 1))
end

local function prune(ck, oldest)
  local all = redis.call('HGETALL', ck)
  for n = 1, #all, 2 do
    if all[n] ~= '#' then
      local e = cjson.decode(all[n + 1])
      if e.q[#e.q] <= oldest then redis.call('HDEL', ck, all[n]) end
    end
  end
end

-- One run's calls (c: kind, digest, instance or '' for its span, span, name, start_ms,
-- repeats, window, own occurrence) at now_ms: RecentCalls.count on the fleet's calls.
local function count_calls(keys, calls, now_ms, loops)
  local seqs = {}
  for n, c in ipairs(calls) do
    local kind = c[1]
    local ck, rk = keys[1 + 2 * kind], keys[2 + 2 * kind]
    if seqs[kind] == nil then seqs[kind] = tonumber(redis.call('HGET', ck, '#') or '0') end
    local digest, inst, repeats, window = c[2], c[3], c[7], c[8]
    if inst == '' then inst = c[4] end
    local occ, at = last_report(rk, digest)
    local found = nil
    if not (at and c[6] < at) then
      local seq = seqs[kind] + 1
      local raw = redis.call('HGET', ck, digest)
      if not raw then
        if redis.call('HLEN', ck) - 1 >= 4 * window then prune(ck, seq - window) end
        redis.call('HSET', ck, digest, cjson.encode({q = {seq}, i = {inst}}))
        seqs[kind] = seq
      else
        local e = cjson.decode(raw)
        local again = false
        for _, x in ipairs(e.i) do if x == inst then again = true end end
        if not again then
          seqs[kind] = seq
          while #e.q > 0 and e.q[1] <= seq - window do
            table.remove(e.q, 1)
            table.remove(e.i, 1)
          end
          if #e.q == 0 then e.f = nil elseif e.f == nil then e.f = {c[4], c[5]} end
          table.insert(e.q, seq)
          table.insert(e.i, inst)
          local seen = #e.q
          if seen > math.max(1, repeats - 1) then
            table.remove(e.q, 1)
            table.remove(e.i, 1)
          end
          local first = e.f
          if seen >= repeats and first ~= nil and occ + 1 <= max_reports
              and (occ > 0 or redis.call('HLEN', rk) < max_reported) then
            occ = occ + 1
            redis.call('HSET', rk, digest, occ .. ':' .. now_ms)
            e = {q = {seq}, i = {inst}}
            found = {n - 1, first[1], first[2], occ, 0}
          end
          redis.call('HSET', ck, digest, cjson.encode(e))
        end
      end
    end
    if found then
      table.insert(loops, found)
    elseif c[9] > occ then
      -- Found by the sidecar's own count (calls the fleet did not see): once, here.
      redis.call('HSET', rk, digest, c[9] .. ':' .. now_ms)
      redis.call('HSET', ck, digest, cjson.encode({q = {seqs[kind]}, i = {inst}}))
      table.insert(loops, {n - 1, '', '', c[9], 1})
    end
  end
  for kind, seq in pairs(seqs) do redis.call('HSET', keys[1 + 2 * kind], '#', seq) end
end

-- One run's charges (s: calls, input tokens, output tokens, cost, unpriced calls, own
-- crossed kinds, 1: crossed here now / 0: kept from while Redis was away) against its
-- budget (b: max tokens, max cost; -1: none).
local function charge(sk, charges, limits, spent)
  local t = redis.call('HMGET', sk, 'calls', 'in', 'out', 'cost', 'unpriced')
  local tot, add = {}, {0, 0, 0, 0, 0}
  for k = 1, 5 do tot[k] = tonumber(t[k] or '0') end
  local max_tokens, max_cost = limits[1], limits[2]
  for n, s in ipairs(charges) do
    for k = 1, 5 do
      tot[k] = tot[k] + s[k]
      add[k] = add[k] + s[k]
    end
    local claimed = false
    if s[7] == 0 then  -- reported by this sidecar while Redis was away: marked first
      for kind in string.gmatch(s[6], '[^+]+') do redis.call('HSETNX', sk, 'r:' .. kind, 1) end
    end
    local new = {}
    if max_tokens >= 0 and tot[2] + tot[3] > max_tokens
        and redis.call('HSETNX', sk, 'r:max_tokens', 1) == 1 then
      table.insert(new, 'max_tokens')
    end
    if max_cost >= 0 and tot[4] > max_cost
        and redis.call('HSETNX', sk, 'r:max_cost_usd', 1) == 1 then
      table.insert(new, 'max_cost_usd')
    end
    if s[7] == 1 then  -- crossed by this sidecar's own count: reported unless already
      for kind in string.gmatch(s[6], '[^+]+') do
        if redis.call('HSETNX', sk, 'r:' .. kind, 1) == 1 then claimed = true end
      end
    end
    if #new > 0 then
      table.insert(spent, {n - 1, table.concat(new, '+'), tot[1], tot[2], tot[3],
        string.format('%.17g', tot[4]), tot[5], 0})
    elseif claimed then
      table.insert(spent, {n - 1, s[6], 0, 0, 0, '0', 0, 1})
    end
  end
  redis.call('HINCRBY', sk, 'calls', add[1])
  redis.call('HINCRBY', sk, 'in', add[2])
  redis.call('HINCRBY', sk, 'out', add[3])
  redis.call('HINCRBYFLOAT', sk, 'cost', string.format('%.17g', add[4]))
  redis.call('HINCRBY', sk, 'unpriced', add[5])
end

local answers = {}
local suffixes = {':tools', ':tools:reported', ':outputs', ':outputs:reported', ':spend'}
for r, run in ipairs(batch) do
  local keys = {}
  for k = 1, 5 do keys[k] = run.k .. suffixes[k] end
  local loops, spent = {}, {}
  if #run.c > 0 then count_calls(keys, run.c, run.n, loops) end
  if #run.s > 0 then charge(keys[5], run.s, run.b, spent) end
  for k = 1, 5 do redis.call('EXPIRE', keys[k], ttl) end
  answers[r] = {loops, spent}
end
local services = {}
local tau = tonumber(ARGV[6])
for n, sv in ipairs(cjson.decode(ARGV[5])) do services[n] = count_service(sv, tau) end
return cjson.encode({r = answers, s = services})
"""
)
_SHA: Final = hashlib.sha1(_SCRIPT.encode()).hexdigest()  # noqa: S324 (Redis names scripts so)
_TOOLS, _OUTPUTS = 0, 1


class RunShare:
    """What one batch adds to one run's fleet-wide counts, and what this sidecar found.

    Made by the tracker for a session's run with the first contribution of a
    batch; the detections this sidecar's own count found wait here (``held``)
    until the fleet says whether they are still to report. A share Redis did
    not answer for is kept (:meth:`kept`) as the run's backlog, itself a share:
    sent again before the run's next batch, or alone when Redis may answer.
    """

    __slots__ = ("calls", "charges", "loops", "now_ms", "run", "settings", "spent")

    def __init__(self, run: RunState) -> None:
        self.run = run
        #: The script's calls (see ``_SCRIPT``), and per call what a report needs: its
        #: dependency, what repeats, the repeats that make a loop, this sidecar's own
        #: detection at it, and (kept calls) the occurrences of the call's loop that
        #: this sidecar already reported while Redis was away.
        self.calls: list[list[Any]] = []
        self.loops: list[tuple[str, str, int, Detection | None, int]] = []
        #: When its last call was received (Unix ms): a report's time, fleet-wide.
        self.now_ms = 0
        #: The script's charges, and per charge where a crossing is reported.
        self.charges: list[list[Any]] = []
        self.spent: list[tuple[bytes, str, Detection | None]] = []
        #: The settings of the run's last charge: its budget.
        self.settings: DetectorSettings | None = None

    def __len__(self) -> int:
        return len(self.calls) + len(self.charges)

    def call(
        self,
        *,
        tool: bool,
        digest: str,
        instance: str,
        span_id: bytes,
        name: str,
        start_ns: int,
        now_ns: int,
        settings: DetectorSettings,
        dependency: str,
        what: str,
        held: Detection | None,
    ) -> None:
        """One call counted for loops; ``held``: what this sidecar's own count found at it.

        ``instance``: what tells the call's sightings apart ("": its span id).
        """
        own = int(held.details["occurrence"]) if held is not None else 0
        self.calls.append(
            [
                _TOOLS if tool else _OUTPUTS,
                digest,
                instance,
                span_id.hex(),
                name[:256],
                start_ns // 1_000_000,
                settings.loop_repeats,
                settings.loop_window,
                own,
            ]
        )
        self.now_ms = now_ns // 1_000_000
        self.loops.append((dependency, what, settings.loop_repeats, held, 0))

    def charge(
        self,
        *,
        span_id: bytes,
        dependency: str,
        tokens: tuple[int, int],
        cost: float | None,
        settings: DetectorSettings,
        held: Detection | None,
    ) -> None:
        """One LLM call's spend against the budget; ``held``: this sidecar's own crossing."""
        crossed = str(held.details["crossed"]) if held is not None else ""
        unpriced = int(cost is None)
        self.charges.append([1, tokens[0], tokens[1], cost or 0.0, unpriced, crossed, 1])
        self.spent.append((span_id, dependency, held))
        self.settings = settings

    def stopped(self, *, span_id: bytes, dependency: str, held: Detection) -> None:
        """The run stopped by its service's budget (``held``), reported once fleet-wide:
        a charge of nothing marking ``service`` reported."""
        self.charges.append([0, 0, 0, 0.0, 0, "service", 1])
        self.spent.append((span_id, dependency, held))

    def held(self) -> list[Detection]:
        """What this sidecar's own counts found, in the order found."""
        return [d for _, _, _, d, _ in self.loops if d is not None] + [
            d for *_, d in self.spent if d is not None
        ]

    def after(self, kept: RunShare) -> RunShare:
        """This share with ``kept`` (a backlog) counted first."""
        self.calls[:0] = kept.calls
        self.loops[:0] = kept.loops
        self.charges[:0] = kept.charges
        self.spent[:0] = kept.spent
        self.now_ms = max(self.now_ms, kept.now_ms)
        if self.settings is None:
            self.settings = kept.settings
        return self

    def kept(self) -> tuple[RunShare, int]:
        """What the fleet must still count of this share, with the calls dropped.

        Its loop calls: at most a window's worth of each kind (the latest;
        older ones cannot be within a window of what comes next), each with
        the occurrences of its loop already reported here, which the fleet
        then does not report again. Its spend: one charge, the crossings
        reported here marked as such (its last call's span names a crossing
        found in it). What was held has been reported: nothing is held.
        """
        kept = RunShare(self.run)
        kept.now_ms, kept.settings = self.now_ms, self.settings
        reported: dict[tuple[int, str], int] = {}
        for call, (*_, done) in zip(self.calls, self.loops, strict=True):
            key = (call[0], call[1])
            reported[key] = max(reported.get(key, 0), call[8], done)
        taken: dict[int, int] = {}
        for call, (dependency, what, repeats, _, _) in reversed(
            list(zip(self.calls, self.loops, strict=True))
        ):
            if taken.get(call[0], 0) >= call[7]:
                continue
            taken[call[0]] = taken.get(call[0], 0) + 1
            kept.calls.append(call)
            kept.loops.append((dependency, what, repeats, None, reported[call[0], call[1]]))
        kept.calls.reverse()
        kept.loops.reverse()
        if self.charges:
            merged: list[Any] = [0, 0, 0, 0.0, 0, "", 0]
            for charge in self.charges:
                for k in range(5):
                    merged[k] += charge[k]
                kinds = {*str(merged[5]).split("+"), *str(charge[5]).split("+")} - {""}
                merged[5] = "+".join(sorted(kinds))
            span_id, dependency, _ = self.spent[-1]
            kept.charges, kept.spent = [merged], [(span_id, dependency, None)]
        return kept, len(self.calls) - len(kept.calls)


class FleetRuns:
    """Sends the batches' :class:`RunShare` s through the sidecar's Redis link; see the module."""

    def __init__(
        self,
        link: RedisLink,
        namespace: str,
        *,
        ttl_s: float = TTL_S,
        max_backlog: int = MAX_BACKLOG,
        catch_up: int = MAX_CATCH_UP,
        services: FleetServices | None = None,
    ) -> None:
        self._link = link
        self._namespace = namespace
        #: Services' spend, for their budgets: sent in the same round trips.
        self.services = FleetServices(namespace) if services is None else services
        self._ttl = str(max(1, int(ttl_s)))
        self._max_backlog = max_backlog
        self._catch_up = catch_up
        #: The thread that waits for Redis (made at the first round trip), and the round
        #: trip sent and not collected yet.
        self._thread: ThreadPoolExecutor | None = None
        self._flight: tuple[list[_Send], _Taken, Future[_Answers]] | None = None
        #: run id -> the prefix of its keys (runs come back batch after batch).
        self._prefixes: dict[str, str] = {}
        #: run id -> what the fleet did not count of it while Redis was away (oldest first).
        self._backlog: dict[str, RunShare] = {}
        #: run id -> what the batch so far adds to its counts (sent by :meth:`send`).
        self._shares: dict[str, RunShare] = {}
        #: Spans that contributed since the last :meth:`send`.
        self.pending = 0
        #: Runs' batches sent and answered, and not answered (judged locally).
        self.shared = 0
        self.unshared = 0
        #: Runs not kept while Redis was away (beyond ``max_backlog``), and loop calls not
        #: kept (theirs, and beyond a window's worth of a run's).
        self.backlog_dropped = 0
        self.backlog_calls_dropped = 0

    def share_of(self, run: RunState) -> RunShare:
        """What the batch adds to ``run``'s fleet-wide counts (a span's contribution goes there)."""
        self.pending += 1
        share = self._shares.get(run.run_id)
        if share is None:
            share = self._shares[run.run_id] = RunShare(run)
        else:
            share.run = run  # the run's latest state (evicted and made again, its latest trace)
        return share

    @property
    def backlog(self) -> int:
        """Runs kept for when Redis answers again."""
        return len(self._backlog)

    def catch_up(self, found: list[Detection]) -> None:
        """Between batches (the app's every second): the backlog, without waiting for one.

        A round trip already answered is collected (what it found goes to
        ``found``); else, when there is a backlog, no batch's shares pending
        and the link not resting, the backlog is sent (its answer collected
        here next time, or by the next batch's :meth:`send`). Never waits for Redis.
        """
        flight = self._flight
        if flight is not None:
            if flight[2].done():
                drive(self.collect_steps(found))
        elif (
            (self._backlog or self.services.backlog)
            and not self._shares
            and not self._link.resting()
        ):
            self.send(found)

    def count(self, found: list[Detection]) -> None:
        """:meth:`send` and :meth:`collect_steps` in one go (waiting on this thread)."""
        self.send(found)
        drive(self.collect_steps(found))

    def send(self, found: list[Detection]) -> None:
        """Start counting the batch's shares fleet-wide: one round trip, in a worker thread.

        :meth:`collect_steps` takes its answer. One round trip at a time: one
        not collected yet is collected first (what it found goes to ``found``).
        A run's backlog goes first in its share; up to ``catch_up`` other
        backlogged runs go too unless the link is resting after a failure (the
        next round trip after its rest is the probe). Nothing to send: no
        round trip.
        """
        if self._flight is not None:
            drive(self.collect_steps(found))
        shares, self._shares, self.pending = self._shares, {}, 0
        backlog = self._backlog
        sends: list[_Send] = []
        for run_id, share in shares.items():
            if not len(share):
                continue
            kept = backlog.pop(run_id, None)
            sends.append((run_id, share if kept is None else share.after(kept), True))
        rested = not self._link.resting()
        if backlog and rested:
            for run_id in list(itertools.islice(backlog, self._catch_up)):
                sends.append((run_id, backlog.pop(run_id), False))
        taken = self.services.take(catch_up=rested)
        if sends or taken:
            self._flight = (sends, taken, self._worker().submit(self._exchange, sends, taken))

    def collect_steps(self, found: list[Detection]) -> Steps[None]:
        """What the round trip :meth:`send` started found goes to ``found``.

        Yields its future while Redis has not answered (see
        :mod:`supervisor.judge.steps`): the event loop answers others
        meanwhile. Never raises for Redis: runs whose answer did not come are
        judged by this sidecar alone (their held detections reported), their
        loop calls and spend kept.
        """
        flight, self._flight = self._flight, None
        if flight is None:
            return
        sends, taken, exchange = flight
        if not exchange.done():
            yield exchange
        answers, services = exchange.result()  # never raises (see _exchange)
        self.services.answered(taken, services)
        for (run_id, share, batch), answer in zip(sends, answers, strict=True):
            if answer is None:  # unreachable, or an error
                self.unshared += batch
                found += share.held()
                self._keep(run_id, share)
                continue
            self.shared += batch
            _report(share, answer, found)

    def _worker(self) -> ThreadPoolExecutor:
        worker = self._thread
        if worker is None:
            worker = self._thread = ThreadPoolExecutor(1, thread_name_prefix="spanvisor-runs-fleet")
        return worker

    def _exchange(self, sends: list[_Send], taken: _Taken) -> _Answers:
        """In the worker thread: the batch's answers from Redis, None for each run (and
        for the services) when none came."""
        unshared: _Answers = ([None] * len(sends), None)
        try:
            answered: tuple[list[Any], list[Any]] = self._link.run(
                lambda client: self._send(client, sends, taken)
            )
        except Unreachable:
            return unshared
        except Exception:  # a bug here must not lose what this sidecar found
            log.exception("counting runs fleet-wide failed; judged by this sidecar alone")
            return unshared
        answers, services = answered
        if len(answers) != len(sends) or len(services) != len(taken):
            log.error("Redis answered for %d runs of %d; judged alone", len(answers), len(sends))
            return unshared
        return answers, services

    def _send(self, client: Any, sends: list[_Send], taken: _Taken) -> tuple[list[Any], list[Any]]:
        """One script call for the batch's runs (loading the script if Redis lost it)."""
        runs = [
            {
                "k": self._keys(run_id),
                "c": share.calls,
                "n": share.now_ms,
                "s": share.charges,
                "b": _limits(share.settings),
            }
            for run_id, share, _ in sends
        ]
        services = self.services
        args = (
            json.dumps(runs, separators=(",", ":")),
            self._ttl,
            MAX_LOOP_REPORTS,
            MAX_REPORTED,
            json.dumps(services.wire(taken), separators=(",", ":")),
            services.view.tau_s,
        )
        try:
            answer = client.evalsha(_SHA, 0, *args)
        except NoScriptError:
            answer = client.eval(_SCRIPT, 0, *args)
        decoded = json.loads(answer)
        # cjson writes an empty list as {}.
        runs_answers, services_answers = decoded.get("r"), decoded.get("s")
        return (
            [a if isinstance(a, list) else None for a in _listed(runs_answers)],
            [parse(a) for a in _listed(services_answers)],
        )

    def _keys(self, run_id: str) -> str:
        """The prefix of the run's keys, one hash slot (its id hashed: ids may be long)."""
        return hashed_key(self._prefixes, f"{self._namespace}:runs", run_id)

    def _keep(self, run_id: str, share: RunShare) -> None:
        """A run's share the fleet did not count, kept (bounded) for when Redis answers.

        The share sent held the run's backlog (taken out when sent): what is
        kept now is all of it.
        """
        backlog = self._backlog
        if len(backlog) >= self._max_backlog:
            self.backlog_dropped += 1
            self.backlog_calls_dropped += len(share.calls)
            return
        kept, dropped = share.kept()
        self.backlog_calls_dropped += dropped
        if len(kept):
            backlog[run_id] = kept


#: A run's share as sent: its run id, the share (its backlog first), and whether it is
#: the batch's (False: a backlog sent alone).
_Send = tuple[str, "RunShare", bool]
#: The services' charges sent (see :meth:`FleetServices.take`).
_Taken = list[tuple[str, Any]]
#: Redis's answers: per run (None: not counted), and for the services (None: not counted).
_Answers = tuple[list[Any], list[Any] | None]


def _listed(value: Any) -> list[Any]:
    """A list the script answered (cjson writes an empty one as ``{}``)."""
    return value if isinstance(value, list) else []


def _limits(settings: DetectorSettings | None) -> list[float]:
    """The budget's limits as the script reads them (-1: none)."""
    budget = settings.budget if settings is not None else None
    if budget is None:
        return [-1, -1]
    tokens, cost = budget.max_tokens, budget.max_cost_usd
    return [-1 if tokens is None else tokens, -1 if cost is None else cost]


def _report(share: RunShare, answer: list[Any], found: list[Detection]) -> None:
    """The fleet's answer for one run: its reports, or this sidecar's own that still stand."""
    loops, spent = (part if isinstance(part, list) else [] for part in answer)
    run = share.run
    for n, span_hex, name, occurrence, own in loops:
        dependency, what, repeats, held, reported = share.loops[n]
        if own:
            if held is not None:
                found.append(held)
            continue
        if occurrence <= reported:  # reported here while Redis was away
            continue
        first = (bytes.fromhex(span_hex), str(name), int(occurrence))
        found.append(loop_detection(run, dependency, first, repeats=repeats, what=what))
    for n, crossed, calls, tokens_in, tokens_out, cost, unpriced, own in spent:
        span_id, dependency, held = share.spent[n]
        if own:
            if held is not None:
                found.append(held)
            continue
        settings = share.settings
        assert settings is not None  # a charge sets it
        total = RunSpend()
        total.calls, total.input_tokens, total.output_tokens = calls, tokens_in, tokens_out
        total.cost_usd, total.unpriced_calls = float(cost), unpriced
        if run.spend is not None and run.spend.unpriced_models:
            total.unpriced_models = list(run.spend.unpriced_models)
        found.append(
            budget_crossed(
                run,
                span_id=span_id,
                dependency=dependency,
                crossed=crossed,
                spend=total,
                settings=settings,
            )
        )
