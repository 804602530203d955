"""A fleet of three sidecars under agents whose sessions hop between them: kill -9, Redis away.

    python bench/fleet.py [--runs 30] [--steps 4] [--seed 1] [--outage-s 5] [--settle-s 150]

Three ``spanvisor run`` processes share one fresh PostgreSQL schema
(``database_url``: incidents, commands, approvals, remediations) and one Redis
namespace (``breaker_redis_url``), Redis reached through a TCP proxy that can
cut it off. Their policy retries 503s, escalates 401s for approval and
remediates timeouts (a durable ``retry_step`` after a few seconds). The agents
(:mod:`bench._fleet_agents`) export with the OpenTelemetry SDK, each trace of a
session to another sidecar, and take commands by signed webhook. Approvals are
answered once each, through a random live sidecar's API. During the runs,
Redis is made unreachable for ``--outage-s`` and then restored, and one
sidecar is killed (SIGKILL, never restarted) while it holds work: remediations
asleep and webhook deliveries in flight.

What is printed (each a goal):

* runs completed, of the recoverable runs (goal: all). A run is
  **recoverable** when each of its failing spans was acknowledged (its OTLP
  export answered with success) by a sidecar that is alive at the end, or by
  the killed one and stored by it in the shared database (an incident) before
  it died. A failure the killed sidecar acknowledged but had not stored yet is
  only in its own ingest log, on its own disk, read by nobody until it
  restarts (it never does); a failure no sidecar acknowledged (queued in the
  exporter of the sidecar that died) never reached the fleet. Neither run can
  be finished by the other sidecars; every other one can, and must: its
  commands are delivered, its approval answered, its remediation carried on
  by a live sidecar if the killed one held it;
* duplicate deliveries: a command delivered again under the same
  ``Idempotency-Key`` after an attempt the agent acknowledged (goal 0). A
  second delivery after an attempt that was in flight when its sender was
  killed (or acknowledged in the last half second before, which it may not have
  recorded) is at-least-once delivery working, counted apart as redelivered;
* approvals per escalation in the store and answers per approval (goal 1 each);
* decisions lost while Redis was away: failures sent during the outage and
  acknowledged by a live sidecar that have no incident at the end (goal 0);
* loops caught: runs whose same tool call hops between the sidecars, none of
  which sees it often enough to call it a loop alone (goal: all);
* takeover: from the kill until no remediation of the killed sidecar is still
  held by it (DBOS's ``workflow_status``: pending under its executor id), and
  until every delivery it had in flight reached the agent from another
  sidecar; ``/v1/stats``'s ``fleet`` section when the sidecars have one.

Sidecars get short instance heartbeats through ``SPANVISOR_INSTANCE_HEARTBEAT_S``
and ``SPANVISOR_INSTANCE_DEAD_AFTER_S`` (a sidecar that has no such settings logs
them as unknown and goes on).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/fleet.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._fleet_agents import (
    LOOP_CALLS,
    SECRET,
    Agents,
    AgentWebhooks,
    Exporters,
    Ledger,
    plan_runs,
)
from bench._fleet_figures import Figures, delivery_figures, recoverability
from bench._fleet_store import SharedStore, TakeoverWatch
from bench.harness import command_line
from supervisor.testing.sidecar_process import SidecarProcess, wait_until
from tests.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
REDIS = ("127.0.0.1", 6379)


def policy(remediate_delay_s: float) -> str:
    """Retry 503s, escalate 401s, remediate timeouts; nothing else gets in the way.

    Breakers, budget and intensity are on (their state is what Redis shares)
    with bounds the load never reaches, so every failure gets its own rule's
    decision. Loops are caught at :data:`LOOP_CALLS` repeats of a tool call (the
    LLM calls carry no output to compare); stalls are not looked for (a run
    waiting for its approval is silent).
    """
    return f"""\
version: 1
breakers:
  default: {{fail_max: 10000, reset_timeout_s: 30}}
retry_budget: {{ratio: 1.0, min_retries: 10000, window_s: 10}}
restart_intensity: {{max_actions: 1000, period_s: 60}}
detectors: {{loops: {{enabled: true, repeats: {LOOP_CALLS}}}, stalls: {{enabled: false}}}}
remediators:
  retry_later:
    use: retry_step
    params: {{delay_s: {remediate_delay_s:g}}}
    verify_window_s: 120
    on_unresolved: none
policies:
  - name: fleet.retry
    match: {{kind: unavailable}}
    action: retry
    max_attempts: 100
    wait: {{type: fixed, seconds: 0.2}}
    honour_retry_after: false
  - name: fleet.escalate
    match: {{kind: auth}}
    action: escalate
    timeout_s: 600
    on_timeout: abort
  - name: fleet.remediate
    match: {{kind: timeout}}
    action: remediate
    remediator: retry_later
"""


@dataclass(frozen=True)
class Plan:
    """The scenario's knobs; times in seconds from the first run's start."""

    runs: int = 30
    steps: int = 4
    #: Runs that loop across the sidecars (on top of ``runs``).
    loops: int = 3
    sidecars: int = 3
    victim: int = 1
    spacing_s: float = 0.3
    step_pause_s: float = 0.2
    ack_delay_s: float = 0.5
    remediate_delay_s: float = 4.0
    outage_at_s: float = 1.5
    outage_s: float = 5.0
    #: The kill comes at this moment or later, once the victim holds a sleeping
    #: remediation and a delivery in flight (or ``hold_wait_s`` after it anyway).
    kill_at_s: float = 3.0
    hold_wait_s: float = 10.0
    #: After the last run started, how long to wait for the runs to finish.
    settle_s: float = 150.0
    heartbeat_s: float = 1.0
    dead_after_s: float = 4.0
    seed: int = 1


class Approver:
    """Answers each pending approval once (approve), each time through a random live sidecar."""

    def __init__(self, live: Callable[[], Sequence[SidecarProcess]], rng: random.Random) -> None:
        self._live = live
        self._rng = rng
        self.answers: Counter[str] = Counter()
        self.conflicts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-approver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(httpx.HTTPError):
                self._answer_pending()

    def _answer_pending(self) -> None:
        pending = self._rng.choice(self._live()).get("/v1/approvals", status="pending", limit=1000)[
            "approvals"
        ]
        for approval in pending:
            if approval["id"] in self.answers:
                continue  # answered once already: never a second time
            try:
                self._rng.choice(self._live()).post(
                    f"/v1/approvals/{approval['id']}/approve", {"by": "fleet-oncall"}
                )
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 409:
                    raise
                self.conflicts += 1
            self.answers[approval["id"]] += 1


def in_flight(agents: Agents, instance: str) -> int:
    """Deliveries from ``instance`` the agents have not answered yet."""
    _, _, deliveries = agents.snapshot()
    return sum(1 for d in deliveries if d.instance == instance and d.answered is None)


def kill_moment(store: SharedStore, agents: Agents, killed: str, wait_s: float) -> set[str]:
    """Wait (bounded) until ``killed`` holds work; the remediations it holds then.

    Best: a remediation asleep and a delivery in flight at once; failing that
    within half of ``wait_s``, a remediation asleep; failing that, whatever it holds.
    """

    def holding(with_delivery: bool) -> set[str]:
        if with_delivery and not in_flight(agents, killed):
            return set()
        return store.held_remediations(killed)

    for with_delivery in (True, False):
        with contextlib.suppress(AssertionError):
            return wait_until(
                lambda: holding(with_delivery),  # noqa: B023 - called within the iteration
                wait_s / 2,
                f"{killed} holding work",
                interval_s=0.05,
            )
    return store.held_remediations(killed)


def start_sidecars(
    plan: Plan,
    directory: Path,
    database_url: str,
    redis_url: str,
    namespace: str,
    webhooks: AgentWebhooks,
    stack: contextlib.ExitStack,
) -> list[SidecarProcess]:
    """The fleet's sidecars, one after the other (each healthy before the next starts)."""
    token = secrets.token_urlsafe(16)
    env = {
        "PYTHONPATH": str(ROOT),  # the sidecars run this tree, from any directory
        "SPANVISOR_INSTANCE_HEARTBEAT_S": f"{plan.heartbeat_s:g}",
        "SPANVISOR_INSTANCE_DEAD_AFTER_S": f"{plan.dead_after_s:g}",
    }
    sidecars: list[SidecarProcess] = []
    for n in range(plan.sidecars):
        name = f"fleet-{n}"
        home = directory / name
        home.mkdir()
        settings = {
            "host": "127.0.0.1",
            "api_token": token,
            "state_path": str(home / "state.db"),  # its own ingest log and run journal
            "database_url": database_url,
            "instance_id": name,
            "breaker_redis_url": redis_url,
            "breaker_redis_namespace": namespace,
            "policy_poll_s": 0,
            "agents": {
                "*": {
                    "webhook": {"url": webhooks.url_for(name), "secret": SECRET, "timeout_s": 10},
                    "max_attempts": 20,
                }
            },
        }
        sidecar = SidecarProcess(
            settings,
            home,
            policy=policy(plan.remediate_delay_s),
            env=env,
            name=name,
            startup_timeout_s=60,
        )
        sidecar.start()
        stack.callback(sidecar.stop)
        sidecars.append(sidecar)
    # Each runs its remediations before the agents start: a failure judged while
    # DBOS is still launching waits for it (on a loaded machine, seconds).
    for sidecar in sidecars:
        wait_until(
            lambda: bool(sidecar.get("/v1/stats")["remediations"]["running"]),  # noqa: B023
            60,
            f"{sidecar.name}'s remediations running",
            interval_s=0.1,
        )
    return sidecars


def forget_redis_keys(namespace: str) -> None:
    """Remove what the fleet wrote under its own namespace (Redis is shared)."""
    import redis

    client = redis.Redis(host=REDIS[0], port=REDIS[1], socket_timeout=3)
    try:
        keys = list(client.scan_iter(match=f"{namespace}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@dataclass
class Outage:
    """Redis unreachable (the proxy drops every connection) from ``at`` for ``length_s``."""

    proxy: TcpProxy
    at: float
    length_s: float
    began: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def ends(self) -> float:
        return self.at + self.length_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fleet-outage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.proxy.set("forward")

    def _run(self) -> None:
        if self._stop.wait(max(0.0, self.at - time.time())):
            return
        self.began = time.time()
        self.proxy.set("drop")
        self._stop.wait(max(0.0, self.ends - time.time()))
        self.proxy.set("forward")


def run_fleet(plan: Plan, directory: Path, database_url: str) -> Figures:
    """Start the fleet, run the agents through the outage and the kill; measure."""
    rng = random.Random(plan.seed)
    store = SharedStore(database_url)
    namespace = f"spanvisor-fleet-{uuid.uuid4().hex[:12]}"
    names = [f"fleet-{n}" for n in range(plan.sidecars)]
    killed = names[plan.victim]
    agents = Agents(
        plan_runs(plan.runs, plan.steps, plan.sidecars, plan.victim, plan.loops),
        names,
        spacing_s=plan.spacing_s,
        step_pause_s=plan.step_pause_s,
    )
    ledger = Ledger()
    with contextlib.ExitStack() as stack:
        stack.callback(forget_redis_keys, namespace)
        proxy = TcpProxy(REDIS)
        stack.callback(proxy.close)
        webhooks = AgentWebhooks(agents, plan.ack_delay_s).start()
        stack.callback(webhooks.stop)
        sidecars = start_sidecars(
            plan,
            directory,
            database_url,
            f"redis://127.0.0.1:{proxy.port}/0",
            namespace,
            webhooks,
            stack,
        )
        exporters = Exporters({s.name: s.otlp_endpoint for s in sidecars}, ledger)
        stack.callback(exporters.close)
        victim = sidecars[plan.victim]

        def live() -> list[SidecarProcess]:
            return [s for s in sidecars if s is not victim or s.process.poll() is None]

        approver = Approver(live, rng)
        stack.callback(approver.stop)

        began = time.time()
        agents.start(exporters)
        stack.callback(agents.stop)
        approver.start()
        outage = Outage(proxy, began + plan.outage_at_s, plan.outage_s)
        stack.callback(outage.stop)
        outage.start()

        time.sleep(max(0.0, began + plan.kill_at_s - time.time()))
        held = kill_moment(store, agents, killed, plan.hold_wait_s)
        kill_at = time.time()
        victim.kill()
        agents.dead.add(killed)  # the load balancer takes it out
        watch = TakeoverWatch(store, killed, held, kill_at)
        stack.callback(watch.stop)
        watch.start()

        last_start = began + (plan.runs + plan.loops) * plan.spacing_s
        loops = {r.session for r in agents.runs if r.kind == "loop"}
        settle_until = last_start + plan.settle_s

        def settled() -> bool:
            runs, failures, _ = agents.snapshot()
            if time.time() < outage.ends or time.time() < last_start:
                return False
            blocked = recoverability(
                runs, failures, ledger, store.incident_spans(), killed, time.time()
            )
            takeover_over = watch.taken_after_s is not None
            return (
                takeover_over
                and all(r.finished or r.index in blocked for r in runs)
                and loops <= store.looping_runs()
            )

        with contextlib.suppress(AssertionError):
            wait_until(settled, max(1.0, settle_until - time.time()), "the runs", interval_s=0.5)
        waited = time.time() - last_start
        approver.stop()
        agents.stop()
        fleet_stats = None
        with contextlib.suppress(httpx.HTTPError):
            fleet_stats = live()[0].get("/v1/stats").get("fleet")
        everything, failures, deliveries = agents.snapshot()
        runs = [r for r in everything if r.kind != "loop"]
        stored = store.incident_spans()
        blocked = recoverability(runs, failures, ledger, stored, killed, float("inf"))
        recoverable = [r for r in runs if r.index not in blocked]
        per_escalation = store.approvals_per_escalation()
        outage_sent = [
            f
            for f in failures
            if outage.began <= f.at <= outage.ends
            and ledger.acknowledged_by(f.span_id) not in (None, killed)
        ]
        duplicates, redelivered, held_deliveries, delivery_takeover = delivery_figures(
            deliveries, killed, kill_at
        )
        return Figures(
            runs=len(runs),
            recoverable=len(recoverable),
            completed=sum(1 for r in recoverable if r.state == "done"),
            unrecoverable=dict(Counter(blocked.values())),
            unstored_before_kill_s=tuple(
                sorted(
                    kill_at - found.at
                    for f in failures
                    if f.span_id not in stored
                    and (found := ledger.acknowledgement(f.span_id)) is not None
                    and found.target == killed
                )
            ),
            stuck=tuple(
                f"{r.session} ({r.kind}, step {r.step} of {r.steps}, {r.state})"
                for r in recoverable
                if r.state != "done"
            ),
            failures=len(failures),
            deliveries=len(deliveries),
            unsigned=sum(1 for d in deliveries if not d.signed),
            duplicates=duplicates,
            redelivered=redelivered,
            escalations=sum(per_escalation.values()),
            approvals_per_escalation=dict(per_escalation),
            answers_per_approval=dict(Counter(approver.answers.values())),
            answer_conflicts=approver.conflicts,
            outage_failures=len(outage_sent),
            outage_lost=sum(1 for f in outage_sent if f.span_id not in stored),
            killed=killed,
            kill_at_s=kill_at - began,
            held_remediations=len(held),
            remediation_takeover_s=watch.taken_after_s,
            held_deliveries=held_deliveries,
            delivery_takeover_s=delivery_takeover,
            loops=len(loops),
            loops_caught=len(loops & store.looping_runs()),
            fleet_stats=fleet_stats,
            waited_s=waited,
        )
    raise AssertionError("unreachable")  # the ExitStack does not swallow exceptions


@contextlib.contextmanager
def fleet_schema() -> Iterator[str]:
    """A fresh PostgreSQL schema for the fleet (dropped after)."""
    from tests.postgres import fresh_schema

    with fresh_schema() as url:
        yield url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=Plan.runs, help="agent runs (30)")
    parser.add_argument("--steps", type=int, default=Plan.steps, help="steps per run (4)")
    parser.add_argument("--seed", type=int, default=Plan.seed, help="approvers' picks (1)")
    parser.add_argument("--outage-s", type=float, default=Plan.outage_s, help="Redis away (5)")
    parser.add_argument(
        "--settle-s", type=float, default=Plan.settle_s, help="wait for the runs (150)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan(
        runs=args.runs,
        steps=args.steps,
        seed=args.seed,
        outage_s=args.outage_s,
        settle_s=args.settle_s,
    )
    print(command_line())
    print(
        f"{plan.sidecars} sidecars on one PostgreSQL schema and one Redis namespace;"
        f" {plan.runs} runs of {plan.steps} steps; Redis away for {plan.outage_s:g} s"
        f" from {plan.outage_at_s:g} s; fleet-{plan.victim} killed from {plan.kill_at_s:g} s"
    )
    with tempfile.TemporaryDirectory(prefix="spanvisor-fleet-") as tmp, fleet_schema() as url:
        figures = run_fleet(plan, Path(tmp), url)
    for line in figures.lines():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
