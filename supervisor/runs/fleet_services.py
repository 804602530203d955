"""Each service's windowed spend and burn rate counted fleet-wide, for its budget.

A service's runs are spread over a fleet's sidecars: a ``service_budgets:``
cap counted per sidecar lets the fleet spend it several times over. With the
breakers' Redis configured, :class:`FleetServices` counts in Redis, per
service, the window's buckets (cost, tokens, calls) and the burn rate (the
decayed sums of :class:`policies._forecast.Burn`), from every sidecar's calls.

No round trip per call: a batch's charges are gathered per service (calls
within the same second as one entry) and go in the batch's one round
trip of :mod:`.fleet` (its script counts them, in the worker thread). A
batch's calls are timed by when the batch was received, as the local count's. Its
answer is the fleet's window and rate for each service sent, which this
sidecar adopts as its **fleet view**: each later call of the service is
charged to the view, and its outlook (crossed, or a cap forecast near) is the
fleet's, at most one batch behind on the other sidecars' calls. A service
this sidecar has no view of yet, or every service after a round trip Redis
did not answer, is judged by the local count (:class:`policies.ServiceSpend`,
which keeps counting all along), as without a fleet: a sidecar then holds its
service to the fleet's cap alone, and the fleet may spend it once per sidecar
while Redis is away.

What was not counted while Redis was away is kept per service, merged per
bucket of its window (at most ``max_backlog`` services, a window's worth of
buckets each; what is not kept is counted in ``backlog_dropped``), and sent
with the round trips that follow.

Keys: ``<namespace>:service:{<service digest>}`` (service names are untrusted:
hashed), a hash of buckets (``b`` + bucket number: cost, tokens, calls), the rate
(``s``, ``l``, ``bc``, ``bt``) and the window (``w``, a new window starts over);
it expires a window after its last call.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from policies import ServiceBudgetSpec, ServiceOutlook, ServiceSpend, window_buckets

__all__ = ["SERVICES_LUA", "FleetServices", "parse"]

#: Services whose spend made while Redis was away is kept for when it answers.
MAX_BACKLOG: Final = 1024
#: Names (services, runs) whose key is remembered (then forgotten at once).
_MAX_KEYS: Final = 4096

#: A Lua chunk of the fleet's script: ``count_service(sv, tau)`` counts one service's
#: charges (``sv``: ``k`` key, ``w`` window s, ``d`` bucket width, ``n`` now, ``s``
#: entries [at, cost, tokens, calls], oldest first) and returns its window and rate:
#: ``{b = {"bucket cost tokens calls", ...}, r = {since, last, cost, tokens}}``, the
#: buckets oldest first. (A bucket is one field, ``b<bucket number>`` = "cost tokens
#: calls": the script reads the whole window each time, and fewer fields cost less.)
SERVICES_LUA: Final = """
local function count_service(sv, tau)
  local key, w, width, now = sv.k, sv.w, sv.d, sv.n
  local seen = redis.call('HGET', key, 'w')
  if seen and tonumber(seen) ~= w then redis.call('DEL', key) end
  local r = redis.call('HMGET', key, 's', 'l', 'bc', 'bt')
  local since, last = tonumber(r[1]), tonumber(r[2])
  local bc, bt = tonumber(r[3] or '0'), tonumber(r[4] or '0')
  local oldest = math.floor((now - w) / width)
  for _, e in ipairs(sv.s) do
    local at, cost, tokens, calls = e[1], e[2], e[3], e[4]
    local slot = math.floor(at / width)
    if slot > oldest then
      local field = 'b' .. string.format('%d', slot)
      local was = redis.call('HGET', key, field)
      if was then
        local c, t, n = string.match(was, '^(%S+) (%S+) (%S+)$')
        cost, tokens, calls = cost + tonumber(c), tokens + tonumber(t), calls + tonumber(n)
      end
      redis.call('HSET', key, field, string.format('%.17g %d %d', cost, tokens, calls))
      cost, tokens, calls = e[2], e[3], e[4]
    end
    if since == nil then
      since, last = at, at  -- the first call opens the rate (see Burn)
    else
      if at > last then
        local decay = math.exp(-(at - last) / tau)
        bc, bt, last = bc * decay, bt * decay, at
      end
      bc, bt = bc + cost, bt + tokens
    end
  end
  local answer = {b = {}, r = {}}
  if since == nil then return answer end
  redis.call('HSET', key, 'w', string.format('%.17g', w), 's', string.format('%.17g', since),
    'l', string.format('%.17g', last), 'bc', string.format('%.17g', bc),
    'bt', string.format('%.17g', bt))
  local buckets, old = {}, {}
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local field = all[i]
    if string.sub(field, 1, 1) == 'b' and field ~= 'bc' and field ~= 'bt' then
      local num = tonumber(string.sub(field, 2))
      if num <= oldest then
        table.insert(old, field)
      else
        table.insert(buckets, {num, all[i + 1]})
      end
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  for _, b in ipairs(buckets) do table.insert(answer.b, string.format('%d ', b[1]) .. b[2]) end
  answer.r = {string.format('%.17g', since), string.format('%.17g', last),
    string.format('%.17g', bc), string.format('%.17g', bt)}
  redis.call('PEXPIRE', key, math.ceil(w * 1000))
  return answer
end
"""


#: A service's window as the fleet counted it: its buckets (bucket number, cost, tokens,
#: calls; oldest first) and its rate (since, last, decayed cost, decayed tokens; None: no
#: call yet).
Window = tuple[list[tuple[float, float, int, int]], tuple[float, float, float, float] | None]


class _Charges:
    """One service's charges not counted by the fleet yet: entries [at, cost, tokens, calls]."""

    __slots__ = ("entries", "spec")

    def __init__(self, spec: ServiceBudgetSpec) -> None:
        self.spec = spec
        self.entries: list[list[Any]] = []

    def add(self, at: float, cost: float, tokens: int, calls: int, *, width: float) -> None:
        """A call (or several), merged with the latest entry when in the same ``width`` s."""
        entries = self.entries
        if entries and at // width == entries[-1][0] // width:
            last = entries[-1]
            last[0] = max(last[0], at)
            last[1] += cost
            last[2] += tokens
            last[3] += calls
        else:
            entries.append([at, cost, tokens, calls])


class FleetServices:
    """Services' spend counted fleet-wide through :mod:`.fleet`'s round trips; see the module."""

    def __init__(self, namespace: str, *, max_backlog: int = MAX_BACKLOG) -> None:
        self._namespace = namespace
        self._max_backlog = max_backlog
        #: The fleet's windows as last answered, plus this sidecar's calls since (a service
        #: is in it only once adopted; all are forgotten when Redis does not answer).
        self.view = ServiceSpend()
        #: Charges of the batch so far, and those kept while Redis was away.
        self._pending: dict[str, _Charges] = {}
        self._backlog: dict[str, _Charges] = {}
        self._keys: dict[str, str] = {}
        #: Services' charges not kept while Redis was away (beyond ``max_backlog``).
        self.backlog_dropped = 0

    @property
    def backlog(self) -> int:
        """Services whose spend is kept for when Redis answers again."""
        return len(self._backlog)

    def charge(
        self, service: str, spec: ServiceBudgetSpec, *, now: float, cost: float, tokens: int
    ) -> ServiceOutlook | None:
        """One call of ``service`` at ``now`` (the wall clock): gathered for the next round
        trip; the fleet's outlook after it (None: no current view: the local count decides)."""
        pending = self._pending.get(service)
        if pending is None:
            pending = self._pending[service] = _Charges(spec)
        pending.spec = spec
        pending.add(now, max(0.0, cost), max(0, tokens), 1, width=1.0)
        if service not in self.view:
            return None
        return self.view.charge(service, spec, now=now, cost=cost, tokens=tokens)

    def take(self, *, catch_up: bool) -> list[tuple[str, _Charges]]:
        """The batch's charges to send (each service's backlog first); with ``catch_up``,
        the backlog of services without charges in the batch too."""
        pending, self._pending = self._pending, {}
        backlog = self._backlog
        taken: list[tuple[str, _Charges]] = []
        for service, charges in pending.items():
            kept = backlog.pop(service, None)
            if kept is not None:
                charges.entries[:0] = kept.entries
            taken.append((service, charges))
        if catch_up and backlog:
            taken += backlog.items()
            backlog.clear()
        return taken

    def wire(self, taken: list[tuple[str, _Charges]]) -> list[dict[str, Any]]:
        """What the script reads of ``taken`` (see ``SERVICES_LUA``)."""
        sent = []
        for service, charges in taken:
            window = charges.spec.window_s
            sent.append(
                {
                    "k": self._key(service),
                    "w": window,
                    "d": window_buckets(window)[1],
                    "n": max(entry[0] for entry in charges.entries),
                    "s": charges.entries,
                }
            )
        return sent

    def answered(self, taken: list[tuple[str, _Charges]], answers: list[Window] | None) -> None:
        """The fleet's windows for ``taken`` (as :func:`parse` gives them) become the view
        (this batch's calls since sent charged to it again); None: Redis did not answer: no
        view is current, ``taken`` is kept."""
        if answers is None or len(answers) != len(taken):
            self.view.forget()
            for service, charges in taken:
                self._keep(service, charges)
            return
        for (service, charges), (buckets, burn) in zip(taken, answers, strict=True):
            spec = charges.spec
            self.view.adopt(service, spec, buckets=buckets, burn=burn)
            since = self._pending.get(service)
            if since is not None:  # charged after the round trip was sent: not in Redis yet
                for at, cost, tokens, _ in since.entries:
                    self.view.charge(service, spec, now=at, cost=cost, tokens=tokens)

    def _keep(self, service: str, charges: _Charges) -> None:
        """A service's charges the fleet did not count, merged per bucket (bounded)."""
        backlog = self._backlog
        kept = backlog.get(service)
        if kept is None:
            if len(backlog) >= self._max_backlog:
                self.backlog_dropped += len(charges.entries)
                return
            kept = backlog[service] = _Charges(charges.spec)
        kept.spec = charges.spec
        width = window_buckets(charges.spec.window_s)[1]
        for at, cost, tokens, calls in charges.entries:
            kept.add(at, cost, tokens, calls, width=width)
        excess = len(kept.entries) - window_buckets(charges.spec.window_s)[0]
        if excess > 0:  # older than the window: would not count anyway
            self.backlog_dropped += excess
            del kept.entries[:excess]

    def _key(self, service: str) -> str:
        return hashed_key(self._keys, f"{self._namespace}:service", service)


def hashed_key(known: dict[str, str], prefix: str, name: str) -> str:
    """``prefix:{digest of name}``: one hash slot, whatever the (untrusted, maybe long) name.

    ``known`` remembers the last few thousand (cleared when full: a digest is cheap).
    """
    key = known.get(name)
    if key is None:
        if len(known) >= _MAX_KEYS:
            known.clear()
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=12)
        key = known[name] = f"{prefix}:{{{digest.hexdigest()}}}"
    return key


def parse(answer: Any) -> Window:
    """The script's answer for one service (cjson writes an empty list as ``{}``): parsed
    where the answer came (the worker thread), not on the event loop."""
    if not isinstance(answer, dict):
        return [], None
    raw_buckets, raw_burn = answer.get("b"), answer.get("r")
    buckets = []
    for raw in raw_buckets if isinstance(raw_buckets, list) else []:
        slot, cost, tokens, calls = str(raw).split()
        buckets.append((float(slot), float(cost), int(tokens), int(calls)))
    burn = None
    if isinstance(raw_burn, list) and len(raw_burn) == 4:
        since, last, spent, used = (float(x) for x in raw_burn)
        burn = (since, last, spent, used)
    return buckets, burn
