"""The sidecar process: it runs the parts that :mod:`supervisor.wiring` built.

:class:`Sidecar` starts, serves, reloads and stops them; its docstring has the
lifecycle. :class:`BackgroundSidecar` runs one on an event loop of its own. The
module is past 600 lines because it is one idea, the process's lifecycle: what each
stage needs from the loop (start, the worker, the timers, reload, the ordered
shutdown) is here, and what each stage does is in its own package.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette

from policies import Governor, Policy, load_policy, regex_timeouts
from remediators.registry import check_policy
from supervisor.act.actor import Actor
from supervisor.act.actuators import Actuator
from supervisor.act.dispatch import Dispatcher, DispatchStats
from supervisor.act.failure_log import RecentFailures
from supervisor.act.fleet import Fleet
from supervisor.act.store import Store
from supervisor.act.store_runs import StoredRuns
from supervisor.act.store_writer import StoreHealth, StoreWriter
from supervisor.admission import Admitter
from supervisor.admission.config import configure as configure_admission
from supervisor.api.control import Control
from supervisor.api.metrics import MetricSources, exposition
from supervisor.api.server import build_control_app
from supervisor.bounded import LatencyWindow
from supervisor.collector import Collector
from supervisor.errors import ConfigError, PolicyError
from supervisor.forward.breaker_report import BreakerReport
from supervisor.forward.downstream import Downstream
from supervisor.forward.metrics import SidecarMetrics
from supervisor.forward.relay import Forwarder
from supervisor.forward.telemetry import DecisionTracer
from supervisor.http_deadline import with_header_deadline
from supervisor.ingest import codec
from supervisor.ingest.auth import ReceiverAuth
from supervisor.ingest.grpc_receiver import GrpcReceiver
from supervisor.ingest.queue import Batch, IngestQueue
from supervisor.ingest.wal import IngestLog, LoggedBatch, NoLog, Releases
from supervisor.judge.pipeline import Outcome, Pipeline, detected_failure
from supervisor.judge.steps import Steps, chunks, drive
from supervisor.normalize.credential import refused as refused_credentials
from supervisor.policy_in_force import PolicyInForce
from supervisor.remediation.engine import Remediations
from supervisor.runs import RunTracker
from supervisor.runs.journal import RunJournal
from supervisor.runs.publish import PUBLISH_S, RunPublisher
from supervisor.settings import Settings
from supervisor.ui.app import ConsoleOptions

if TYPE_CHECKING:
    from supervisor.runs import Detection
    from supervisor.shared_breakers import RedisLink

log = logging.getLogger("spanvisor.app")

#: Longest the pipeline worker reads a batch before letting the loop answer others.
_SLICE_S = 0.01
#: Turns of the loop after a slice that overran (one step longer than a slice:
#: a policy regex searching to its time limit). Answering a request takes a
#: few turns (read it, run its handler, write the answer), and with one turn
#: per slice a poll of ``/healthz`` waited a long step per turn. After a slice
#: of the usual length one turn is given: more cost 5% of the span path's CPU
#: (the receivers' and the ingest log's work is then cut into smaller rounds).
_TURNS_AFTER_LONG_SLICE = 4


@dataclass(frozen=True, slots=True)
class Ports:
    otlp_grpc: int
    otlp_http: int
    api: int


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the sidecar."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(frozen=True, slots=True)
class SidecarParts:
    """What a sidecar runs, built and connected by :func:`supervisor.wiring.build_sidecar`.

    Nothing in it is started: no port is bound, no thread or task runs.
    """

    settings: Settings
    #: The policy in force; a reload replaces it.
    policy: PolicyInForce
    downstream: Downstream | None
    queue: IngestQueue
    #: Acknowledged requests until their outcomes are stored (NoLog: state in memory).
    ingest_log: IngestLog | NoLog
    #: Releases a logged batch's entry once its outcomes are stored (the writer tells it).
    releases: Releases
    grpc: GrpcReceiver
    #: The OTLP/HTTP receiver's ASGI app (the sidecar serves it).
    otlp_http: Starlette
    pipeline: Pipeline
    #: Every run's progress; the pipeline feeds it only when ``track_runs`` is on.
    runs: RunTracker
    #: Where the open runs are kept across a restart (None: the state is in memory).
    journal: RunJournal | None
    governor: Governor
    #: What the governor calls on each breaker change.
    breakers: BreakerReport
    #: Admission control, fleet-wide through the breakers' Redis link when there is one
    #: (a policy reload gives it the new limits); its rates pace the governor's resumes.
    admitter: Admitter
    store: Store
    #: Push channels by service (``"*"``: the default); one actuator may serve several.
    actuators: Mapping[str, Actuator]
    dispatcher: Dispatcher
    actor: Actor
    remediations: Remediations
    writer: StoreWriter
    #: None: no downstream, the agents' spans are not relayed.
    forwarder: Forwarder | None
    tracer: DecisionTracer
    metrics: SidecarMetrics
    failures: RecentFailures
    #: When cyclic garbage is collected; ``spanvisor run`` hands it the collector.
    collector: Collector
    #: The control API's bearer token.
    token: str
    #: The OTLP receivers' token check (None: they take spans without one).
    otlp_auth: ReceiverAuth | None = None
    #: The Redis the breakers share (None: they are this sidecar's own).
    breaker_link: RedisLink | None = None
    #: Heartbeats and takeovers in a fleet's shared store (None: no ``database_url``).
    fleet: Fleet | None = None


class Sidecar:
    """One running sidecar. Not reusable: start once, shut down once.

    Built by :func:`supervisor.wiring.build_sidecar`; this class keeps only the
    lifecycle. Everything of its own runs on one asyncio event loop, the one
    that calls :meth:`start`.

    **Start** (:meth:`start`), in this order; a failure undoes what it can and
    raises:

    0. the open runs a sidecar before this one journaled are taken back
       (:mod:`supervisor.runs.journal`), so their stalls are still found; the
       ingest log's committer thread starts (``spanvisor-ingest-log``);
    1. the OTLP/gRPC receiver binds (gRPC's core runs its own threads), then
       the OTLP/HTTP server (a uvicorn task); spans queue from now on;
    2. the forwarder's task (``spanvisor-forwarder``), when there is a downstream;
    3. the actuators (a webhook's HTTP client), then the dispatcher's task
       (``spanvisor-dispatch``, plus one ``deliver-<id>`` task per delivery);
    4. remediations: bound to the loop; when earlier ones may be pending, DBOS is
       launched in the background (a worker thread that starts the runner's
       thread ``spanvisor-remediate``, which runs DBOS's loop, DBOS's own threads
       and the ``spanvisor-remediate-tool`` pool). Otherwise the first
       ``remediate`` decision launches it, on the store writer's thread;
    5. the store writer's thread (``spanvisor-store``): it stores each batch's
       outcomes and hands the remediations their decisions;
    6. the pipeline worker's task (``spanvisor-pipeline``), which first replays
       the requests acknowledged before a stop and not judged and stored (the
       ingest log's), then takes new ones; and three timers:
       ``spanvisor-gc`` (garbage collection, every second), ``spanvisor-house``
       (policy file polling, pruning the store) and ``spanvisor-runs`` (stalled
       runs, every second); in a fleet, ``spanvisor-fleet`` (heartbeats and
       takeovers, :mod:`supervisor.act.fleet`) and ``spanvisor-runs-publish``
       (the runs tracked here, to the shared store: :mod:`supervisor.runs.publish`);
    7. the control API: its operations (:class:`~supervisor.api.control.Control`,
       over these parts), then its server (a uvicorn task); then :attr:`ports`
       is set and the sidecar is ready.

    **Reload** (:meth:`reload_policy`: SIGHUP under ``spanvisor run``, the control
    API, or the housekeeping timer when the policy file changed), on the loop: a
    policy that loads and checks replaces the one in force, in the pipeline, the
    governor and the run tracker; a bad one is rejected and the old one kept.

    Threads not ours: the own-span exporter's and the metrics reader's (the
    OpenTelemetry SDK's), and ``asyncio.to_thread``'s pool for blocking calls.

    **Shutdown** (:meth:`shutdown`), in this order, all within
    ``drain_timeout_s`` (each step bounded by what is left, most by 5 s too):
    not ready; stop the gRPC receiver (at most 2 s grace) and the OTLP/HTTP
    server; drain the ingest queue (what is still queued at the deadline is
    not judged); cancel the worker and the timers; close the store writer
    (stores what it holds); close the remediations (pending ones resume at the
    next start); stop the dispatcher, then close the actuators; flush the
    forwarder, the own-span exporter and the metrics; stop the control API;
    close the ingest log (what was not stored is replayed at the next start);
    close the store.
    """

    def __init__(self, parts: SidecarParts) -> None:
        self.settings = parts.settings
        self.policy_in_force = parts.policy
        self.downstream = parts.downstream
        self.queue = parts.queue
        self.ingest_log = parts.ingest_log
        self.releases = parts.releases
        self._grpc = parts.grpc
        self._otlp_http = parts.otlp_http
        self.pipeline = parts.pipeline
        self.runs = parts.runs
        self.journal = parts.journal
        self.governor = parts.governor
        self.breakers = parts.breakers
        self.breaker_link = parts.breaker_link
        #: Admission control (a policy reload gives it the new limits).
        self.admitter = parts.admitter
        self.store = parts.store
        self.actuators = parts.actuators
        self.dispatcher = parts.dispatcher
        self.actor = parts.actor
        self.remediations = parts.remediations
        self.writer = parts.writer
        self.forwarder = parts.forwarder
        self.tracer = parts.tracer
        self.metrics = parts.metrics
        self.failures = parts.failures
        self.collector = parts.collector
        self.token = parts.token
        self._otlp_auth = parts.otlp_auth
        self.fleet = parts.fleet
        #: A fleet's runs published to, and listed from, the shared store (None: not a fleet).
        self.run_publisher = (
            RunPublisher(self.runs, StoredRuns(self.store)) if self.store.shared else None
        )
        # Its own state: what it serves, what runs, what it counted.
        self.ports: Ports | None = None
        self.reloads = {"ok": 0, "rejected": 0}
        self.latency = LatencyWindow()
        self._policy_stamp = _stamp(self.settings.policy)
        self._http: _EmbeddedServer | None = None
        self._api: _EmbeddedServer | None = None
        self._server_tasks: dict[int, asyncio.Task[None]] = {}
        self._worker: asyncio.Task[None] | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._run_watch: asyncio.Task[None] | None = None
        self._deadlines: asyncio.Task[None] | None = None
        self._fleet_watch: asyncio.Task[None] | None = None
        self._runs_publish: asyncio.Task[None] | None = None
        self._remediations_up: asyncio.Task[None] | None = None
        self._errors = 0
        self._ready = False
        self._busy = False
        # Clear while the worker is suspended in the middle of a batch.
        self._between_batches = asyncio.Event()
        self._between_batches.set()

    @property
    def policy(self) -> Policy:
        """The policy in force (a reload replaces it)."""
        return self.policy_in_force()

    @property
    def breaker_changes(self) -> int:
        """Breaker changes since start."""
        return self.breakers.changes

    def ready(self) -> bool:
        """Whether it serves: started, and not shutting down (the control API's readiness)."""
        return self._ready

    def degraded(self) -> list[str]:
        """What keeps it from doing all its work while it serves (empty: nothing).

        A failing store: decisions are still made and delivered from memory, and
        the failures are kept to be stored later (:mod:`supervisor.act.store_writer`).
        """
        reason = self.writer.degraded()
        return [reason] if reason is not None else []

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> Ports:
        """Bind everything and start the workers; on any failure, undo and raise."""
        try:
            return await self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self._grpc.stop(grace=0)
            for server in (self._http, self._api):
                if server is not None:
                    await self._stop_server(server)
            for task in (
                self._worker,
                self._gc_task,
                self._housekeeping,
                self._run_watch,
                self._deadlines,
                self._fleet_watch,
                self._runs_publish,
            ):
                if task is not None:
                    task.cancel()
            with contextlib.suppress(Exception):
                self.ingest_log.close()
                if self.journal is not None:
                    self.journal.close()
                self.store.close()
            raise

    async def _start(self) -> Ports:
        if self.journal is not None:
            saved = await asyncio.to_thread(self.journal.load, self.runs.max_runs)
            restored = self.runs.restore(saved)
            if restored:
                log.info("open runs taken back from before the restart", extra={"runs": restored})
        self.ingest_log.start()
        grpc_port = await self._grpc.start()
        self._http, http_port = await self._serve(
            self._otlp_http, self.settings.host, self.settings.otlp_http_port
        )
        if self.forwarder is not None:
            self.forwarder.start()
        for actuator in set(self.actuators.values()):
            await actuator.start()
        self.dispatcher.start()
        self.remediations.bind(asyncio.get_running_loop())
        if self.remediations.needed():
            # Remediations left pending resume once DBOS has launched (seconds on a
            # small machine); ingest, decisions and the control API do not wait for it.
            self._remediations_up = asyncio.create_task(
                asyncio.to_thread(self.remediations.start_in_background),
                name="spanvisor-remediations",
            )
        self.writer.start(asyncio.get_running_loop())
        self._worker = asyncio.create_task(self._work(), name="spanvisor-pipeline")
        self._gc_task = asyncio.create_task(self._collect_periodically(), name="spanvisor-gc")
        self._housekeeping = asyncio.create_task(self._keep_house(), name="spanvisor-house")
        self._run_watch = asyncio.create_task(self._watch_runs(), name="spanvisor-runs")
        self._deadlines = asyncio.create_task(self._watch_deadlines(), name="spanvisor-deadlines")
        if self.fleet is not None:
            self._fleet_watch = asyncio.create_task(self._keep_fleet(), name="spanvisor-fleet")
        if self.run_publisher is not None:
            self._runs_publish = asyncio.create_task(
                self._publish_runs(self.run_publisher), name="spanvisor-runs-publish"
            )
        self.control = Control(
            store=self.store,
            actor=self.actor,
            governor=self.governor,
            policy=self.policy_in_force,
            failures=self.failures,
            stats=self.stats,
            ready=self.ready,
            degraded=self.degraded,
            reload=self.reload_policy,
            remediations=self.remediations,
            runs=self.runs,
            exposition=exposition(self.metric_sources()),
            fleet_breakers=_fleet_breakers(self.breaker_link),
            breaker_history=self.breakers.history,
            fleet_runs=self.run_publisher.table if self.run_publisher is not None else None,
            admitter=self.admitter,
        )
        console = (
            ConsoleOptions(
                trace_url=self.settings.ui_trace_url,
                session_ttl_s=self.settings.ui_session_ttl_s,
            )
            if self.settings.ui_enabled
            else None
        )
        control = build_control_app(token=self.token, control=self.control, console=console)
        self._api, api_port = await self._serve(
            control, self.settings.api_host, self.settings.api_port
        )
        self.ports = Ports(otlp_grpc=grpc_port, otlp_http=http_port, api=api_port)
        self._ready = True
        log.info(
            "spanvisor listening",
            extra={
                "otlp_grpc": f"{self.settings.host}:{grpc_port}",
                "otlp_http": f"{self.settings.host}:{http_port}",
                "api": f"{self.settings.api_host}:{api_port}",
                "downstream": self.downstream.endpoint if self.downstream else None,
                "policy": self.policy.source,
            },
        )
        return self.ports

    async def shutdown(self) -> None:
        """Stop accepting, drain, flush, stop; bounded by ``drain_timeout_s``."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        self._ready = False
        await self._grpc.stop(grace=min(2.0, self.settings.drain_timeout_s))
        if self._http is not None:
            await self._stop_server(self._http)
        drained = await self._drain(deadline)
        if not drained:
            log.warning(
                "drain timed out; spans still queued were not judged",
                extra={"queued_batches": self.queue.qsize, "queued_spans": self.queue.queued_spans},
            )
        for task in (
            self._worker,
            self._gc_task,
            self._housekeeping,
            self._run_watch,
            self._deadlines,
            self._fleet_watch,
            self._runs_publish,
        ):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.to_thread(self.writer.close, max(0.1, min(5.0, deadline - time.monotonic())))
        if self._remediations_up is not None:  # a stop right after start: let it finish
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self._remediations_up),
                    max(0.1, deadline - time.monotonic()),
                )
        await asyncio.to_thread(
            self.remediations.close, max(0.1, min(5.0, deadline - time.monotonic()))
        )
        await self.dispatcher.shutdown(max(0.1, min(5.0, deadline - time.monotonic())))
        for actuator in set(self.actuators.values()):
            with contextlib.suppress(Exception):
                await actuator.close()
        if self.forwarder is not None:
            await self.forwarder.shutdown(max(0.1, deadline - time.monotonic()))
        await asyncio.to_thread(self.tracer.shutdown, max(0.1, deadline - time.monotonic()))
        await asyncio.to_thread(self.metrics.shutdown, max(0.1, deadline - time.monotonic()))
        if self._api is not None:
            await self._stop_server(self._api)
        log.info("spanvisor stopped", extra={"stats": self.stats()})
        if self.journal is not None:
            await self._journal_runs()
            self.journal.close()
        await asyncio.to_thread(self.ingest_log.close)
        self.store.close()

    async def _drain(self, deadline: float) -> bool:
        while self.queue.qsize > 0 or self._busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _serve(self, app: Starlette, host: str, port: int) -> tuple[_EmbeddedServer, int]:
        # The socket is bound here, not by uvicorn, whose start-up answers a
        # bind error with sys.exit(1) from inside the event loop.
        try:
            sock = socket.create_server((host, port), reuse_port=False)
            # Accepted sockets inherit it: without, asyncio leaves Nagle on for a socket
            # made with proto 0, and every keep-alive answer waited ~40 ms for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                "is another spanvisor or OTLP collector using the port?"
            ) from exc
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            # A request's head must arrive within the read timeout (bodies: the receiver).
            http=with_header_deadline(self.settings.http_read_timeout_s),
        )
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn-{host}:{port}")
        self._server_tasks[id(server)] = task
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise ConfigError(f"the server on {host}:{port} stopped during start-up")
            await asyncio.sleep(0.005)
        return server, int(sock.getsockname()[1])

    async def _stop_server(self, server: _EmbeddedServer) -> None:
        """Ask uvicorn to stop (it finishes in-flight requests), then wait, bounded."""
        server.should_exit = True
        task = self._server_tasks.pop(id(server), None)
        if task is None:
            return
        try:
            await asyncio.wait_for(task, timeout=5.0)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
            log.warning("a server did not stop in time and was cancelled")

    async def _collect_periodically(self) -> None:
        """Young collections when the loop is idle, full ones every ``gc_full_interval_s``.

        The bounded state holds hundreds of thousands of objects: a full pass
        takes tens of milliseconds, so it runs on this timer, never because the
        allocator says so (see :mod:`supervisor.collector`).
        """
        interval = self.settings.gc_full_interval_s
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            if time.monotonic() - last_full < interval:
                self.collector.tick()
                continue
            last_full = time.monotonic()
            found = self.collector.full()
            log.debug(
                "full garbage collection",
                extra={"ms": self.collector.stats().last_full_ms, "found": found},
            )

    # -- the pipeline worker ------------------------------------------------

    async def _work(self) -> None:
        await self._replay()
        while True:
            batch = await self.queue.get()
            self._busy = True
            try:
                await self._handle_in_slices(batch, self.ingest_log.take(batch))
            except Exception:  # a bug in judging must not stop ingest
                self._errors += 1
                log.exception("pipeline failed on a batch; continuing")
            finally:
                self.queue.task_done(batch)
                self._busy = False
            self.collector.between_batches()  # its decisions are out: a pause delays none
            await asyncio.sleep(0)  # let the receivers answer between batches

    async def _replay(self) -> None:
        """Judge the requests acknowledged before the last stop and not stored, oldest first.

        They were forwarded (or lost with the process) then, so they are not
        forwarded again; their decisions' latency is not counted.
        """
        entries = self.ingest_log.recovered()
        for entry in entries:
            try:
                await self._handle_in_slices(_replayed_batch(entry), entry.seq, replay=True)
            except Exception:  # a bug in judging must not stop the replay
                self._errors += 1
                log.exception("pipeline failed on a replayed request; continuing")
                self.ingest_log.release(entry.seq)
            await asyncio.sleep(0)  # new requests are answered meanwhile
        if entries:
            self.ingest_log.replayed(len(entries))
            log.info("acknowledged requests replayed", extra={"entries": len(entries)})

    def handle(self, batch: Batch) -> None:
        """Forward, judge and report one batch (synchronous).

        The spans that show signs of failure are judged and their decisions
        emitted before the rest of the batch is normalized.
        """
        if self.forwarder is not None:
            self.forwarder.offer(batch.raw_protobuf, batch.span_count)
        drive(self._judge_steps(batch))

    async def _handle_in_slices(
        self, batch: Batch, logged: int | None = None, *, replay: bool = False
    ) -> None:
        """:meth:`handle`, giving the loop back every :data:`_SLICE_S` of judging.

        A 100,000-span batch takes a second or more to read and judge; in
        slices, ``/healthz``, the receivers and the control API answer
        meanwhile (see :data:`_TURNS_AFTER_LONG_SLICE`). Nothing else judges
        while a batch is between slices (the stall check waits for
        ``_between_batches``), so its decisions are those of one go.
        ``logged``: the batch's ingest log entry, released once its outcomes
        are stored; a ``replay`` is not forwarded again.
        """
        if self.forwarder is not None and not replay:
            self.forwarder.offer(batch.raw_protobuf, batch.span_count)
        slice_ends = time.monotonic() + _SLICE_S
        for waited in self._judge_steps(batch, logged, replay):
            if waited is not None:  # work in another thread (Redis): others run meanwhile
                self._between_batches.clear()
                try:
                    await asyncio.wait((asyncio.wrap_future(waited),))
                finally:
                    self._between_batches.set()
                slice_ends = time.monotonic() + _SLICE_S
                continue
            now = time.monotonic()
            if now >= slice_ends:
                overran = now - slice_ends > _SLICE_S
                self._between_batches.clear()
                try:
                    for _ in range(_TURNS_AFTER_LONG_SLICE if overran else 1):
                        await asyncio.sleep(0)
                finally:
                    self._between_batches.set()
                slice_ends = time.monotonic() + _SLICE_S

    def _judge_steps(
        self, batch: Batch, logged: int | None = None, replay: bool = False
    ) -> Steps[None]:
        """Judge a batch in steps: failures first, reported, then the rest; all stored."""
        outcomes, rest = yield from self.pipeline.first_pass_steps(batch.request, batch.received_ns)
        # A replayed request's decisions come long after it was received: no latency.
        received_ns = None if replay else batch.received_ns
        yield from self._report(outcomes, received_ns)
        later = yield from self.pipeline.rest_pass_steps(rest)
        yield from self._report(later, received_ns)
        found = outcomes + later
        if logged is not None:  # told before the writer can have stored them
            self.releases.expect(logged, found)
        self._act(found)

    def _report(self, outcomes: list[Outcome], received_ns: int | None) -> Steps[None]:
        """Decisions into the recent failures and as spans; their latency from ``received_ns``."""
        for chunk in chunks(outcomes):
            for outcome in chunk:
                self.failures.add(outcome)
                failure = outcome.failure
                if failure.kind == "rate_limit" and failure.dependency:
                    self.admitter.throttled(  # a credential's 429: its key's alone
                        failure.breaker_key,
                        failure.evidence.retry_after_s,
                        span=f"{failure.trace_id}/{failure.span_id}",
                    )
                self.tracer.emit(outcome.failure, outcome.decision)
                if received_ns is not None:
                    self.latency.add((time.time_ns() - received_ns) / 1e6)
            yield

    def _act(self, outcomes: list[Outcome]) -> None:
        """Hand a batch's outcomes to the store writer (one transaction per batch)."""
        self.writer.put(outcomes)

    # -- policy reload -------------------------------------------------------

    def reload_policy(self) -> dict[str, Any]:
        """Load the policy file again; a bad file is rejected and the old policy kept."""
        path = self.settings.policy
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            self.reloads["rejected"] += 1
            log.error(
                "policy reload rejected; keeping the current policy",
                extra={"policy": str(path), "problems": [str(i) for i in exc.issues]},
            )
            return {"reloaded": False, "source": self.policy.source, "error": str(exc)}
        problems = check_policy(policy)
        if problems:
            self.reloads["rejected"] += 1
            log.error(
                "policy reload rejected; keeping the current policy",
                extra={"policy": str(path), "problems": problems},
            )
            return {"reloaded": False, "source": self.policy.source, "error": "; ".join(problems)}
        self.policy_in_force.replace(policy)
        self.pipeline.policy = policy
        self.governor.set_policy(policy)
        self.runs.reset_settings()
        self.runs.models = policy.detectors.models
        self.runs.stall_horizon_s = policy.detectors.shortest_idle_s
        self.runs.set_slo(policy.detectors.slo)
        configure_admission(self.admitter, policy.limits.admission)

        self.reloads["ok"] += 1
        log.info("policy reloaded", extra={"policy": policy.source, "rules": len(policy.rules)})
        return {"reloaded": True, "source": policy.source, "error": None}

    async def _watch_runs(self) -> None:
        """Every second: runs silent past their limit are stalls, judged like failures;
        the fleet's backlog is sent; the runs that changed are journaled (off the loop)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._between_batches.wait()  # never judge inside another batch
                self.check_stalls()
                self.share_backlog()
                await self._journal_runs()
            except Exception:  # the watch must never end
                log.exception("stall check failed; trying again")

    async def _journal_runs(self) -> None:
        if self.journal is None:
            return
        changed, gone = self.runs.journal_changes()
        if changed or gone:
            await asyncio.to_thread(self.journal.save, changed, gone)

    def check_stalls(self, now: float | None = None) -> list[Outcome]:
        """Judge the runs stalled at ``now`` (default: the clock); report and store them."""
        found = self.runs.stalled(now)
        if not found:
            return []
        now_ns = time.time_ns()
        outcomes = self.pipeline.judge_detected([detected_failure(s, now_ns) for s in found])
        drive(self._report(outcomes, None))
        self._act(outcomes)
        return outcomes

    def share_backlog(self) -> list[Outcome]:
        """Sessions' loops and spend the fleet did not count while Redis was away, sent
        when a sidecar gets no batch to send them with; what the fleet found is judged."""
        found: list[Detection] = []
        self.runs.share_backlog(found)
        if not found:
            return []
        now_ns = time.time_ns()
        outcomes = self.pipeline.judge_detected([detected_failure(d, now_ns) for d in found])
        drive(self._report(outcomes, None))
        self._act(outcomes)
        return outcomes

    async def _watch_deadlines(self) -> None:
        """Every second: approval requests past their pause's deadline expire (see Actor)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                # The store's half off the loop when the store is a server (Store.call).
                expired = await self.store.call(self.actor.expire_stored)
                self.actor.announce_expired(expired)
            except Exception:  # the watch must never end
                log.exception("expiring approval requests failed; trying again")

    async def _keep_house(self) -> None:
        """Every so often: reload a changed policy file, expire and prune stored rows."""
        last_prune = 0.0
        while True:
            interval = self.settings.policy_poll_s or 60.0
            await asyncio.sleep(min(interval, 60.0))
            try:
                stamp = _stamp(self.settings.policy)
                if self.settings.policy_poll_s and stamp != self._policy_stamp:
                    self._policy_stamp = stamp
                    self.reload_policy()
                now = time.time()
                if now - last_prune >= 60.0:
                    last_prune = now
                    await self.store.call(self._expire_and_prune, now)
            except Exception:  # housekeeping must never end; try again next round
                log.exception("housekeeping failed; trying again later")

    async def _keep_fleet(self) -> None:
        """Every ``instance_heartbeat_s``: beat, and take over dead sidecars (a fleet's)."""
        fleet = self.fleet
        assert fleet is not None
        failing = False
        while True:
            try:
                # Off the loop: a round is a few statements, and a takeover waits for DBOS.
                taken = await self.store.call(fleet.round)
                if any(t.commands for t in taken):
                    self.dispatcher.wake()  # the dead sidecar's commands are due now
                if failing:
                    log.warning("fleet heartbeats are written again")
                failing = False
            except Exception:  # the heartbeat must never end; try again next round
                if not failing:  # once per outage, not every heartbeat
                    log.exception("fleet heartbeat failed; trying again every heartbeat")
                failing = True
            await asyncio.sleep(fleet.heartbeat_s)

    @staticmethod
    async def _publish_runs(publisher: RunPublisher) -> None:
        """Every ``PUBLISH_S``: the runs that changed go to the fleet's table (see
        :mod:`supervisor.runs.publish`; a round never raises)."""
        while True:
            await asyncio.sleep(PUBLISH_S)
            await publisher.round()

    def _expire_and_prune(self, now: float) -> None:
        """Pull commands never acknowledged within their ``ttl_s`` expire; old rows go."""
        for name, delivery in self.settings.agents.items():
            if delivery.pull is not None and name != "*":
                self.store.expire_pull(now, delivery.pull.ttl_s)
        default = self.settings.agents.get("*")
        if default is not None and default.pull is not None:
            self.store.expire_pull(now, default.pull.ttl_s)
        self.store.prune(now)

    # -- introspection -----------------------------------------------------

    def metric_sources(self) -> MetricSources:
        """What ``/metrics`` reads: the parts whose counters :meth:`stats` reads."""
        return MetricSources(
            queue=self.queue,
            ingest_log=self.ingest_log,
            failures=self.failures,
            dispatcher=self.dispatcher,
            store=self.store,
            writer=self.writer,
            governor=self.governor,
            breakers=self.breakers,
            breaker_link=self.breaker_link,
            remediations=self.remediations,
            forwarder=self.forwarder,
            otlp_auth=self._otlp_auth,
            fleet=self.fleet,
            admitter=self.admitter,
        )

    def stats(self) -> dict[str, Any]:
        p50, p99 = self.latency.percentile(0.5), self.latency.percentile(0.99)
        return {
            "ingest": asdict(self.queue.stats()),
            "ingest_log": asdict(self.ingest_log.stats()),
            "pipeline": {**asdict(self.pipeline.stats()), "errors": self._errors},
            # One count per fact: failures judged (each has one decision) are
            # pipeline.failures; commands by status are the store's rows.
            "decisions": {
                "latency_ms": {
                    "p50": None if p50 is None else round(p50, 3),
                    "p99": None if p99 is None else round(p99, 3),
                    "count": self.latency.count,
                },
            },
            "failures": {"dropped_from_list": self.failures.dropped},
            "forward": asdict(self.forwarder.stats()) if self.forwarder is not None else None,
            "delivery": {
                "push": _push_stats(self.dispatcher.stats()),
                **self.actor.describe(),
                "store_backlog": self.writer.backlog,
                "store": _store_health(self.writer.health()),
                "latency_ms": _percentiles(self.dispatcher.latency),
            },
            "remediations": self.remediations.describe(),
            # None: not a fleet (no database_url); else heartbeats and takeovers.
            "fleet": self.fleet.stats() if self.fleet is not None else None,
            "runs": {
                **self.runs.stats(),
                "slo": self.runs.slo_status(),
                # None: not a fleet; else runs written to the shared table, failed rounds.
                "published": self.run_publisher.stats() if self.run_publisher else None,
            },
            "breakers": {
                "tracked": len(self.governor.board),
                "changes": self.breakers.changes,
                # spanvisor.credential values ignored: a secret, or not a name.
                "credentials_refused": refused_credentials(),
                "not_closed": sum(
                    1 for b in self.governor.board.snapshot() if b.state.value != "closed"
                ),
                # None: not shared; else whether Redis answers, and how often it did not.
                "shared": (
                    asdict(self.breaker_link.stats()) if self.breaker_link is not None else None
                ),
            },
            # answered_locally: questions Redis did not answer (this sidecar's own bucket).
            "admission": asdict(self.admitter.stats()),
            "retry_budget": {"denied": self.governor.budget.denied},
            "restart_intensity": {"escalated": self.governor.intensity.denied},
            "policy": {
                "source": self.policy.source,
                "reloads": dict(self.reloads),
                # Rule regexes stopped at their time limit (each counted as no match).
                "regex_timeouts": regex_timeouts(),
            },
            "gc": asdict(self.collector.stats()),
            "otlp_auth": {
                "required": self._otlp_auth is not None,
                "refused": self._otlp_auth.refused if self._otlp_auth is not None else 0,
            },
        }


def _replayed_batch(entry: LoggedBatch) -> Batch:
    """A logged request as the worker takes it (it was valid when acknowledged)."""
    request = codec.decode_spans(entry.payload)
    spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
    return Batch(
        request=request,
        raw_protobuf=entry.payload,
        received_ns=entry.received_ns,
        transport=entry.transport,
        span_count=spans,
    )


def _stamp(path: object) -> tuple[int, int] | None:
    """What tells a changed policy file: its mtime and size (None when unset or unreadable)."""
    if path is None:
        return None
    try:
        info = os.stat(str(path))
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size)


def _push_stats(stats: DispatchStats) -> dict[str, int]:
    """What only push delivery knows; what was delivered or dead-lettered is the store's
    (``delivery.commands``: every channel, the same rows the command lists show)."""
    return {"failed_attempts": stats.failed_attempts, "in_flight": stats.in_flight}


def _store_health(health: StoreHealth) -> dict[str, Any]:
    since = health.failing_since_unix
    return {
        "failing": since is not None,
        "failing_since": None
        if since is None
        else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)),
        "waiting_failures": health.waiting_failures,
        "waiting_bytes": health.waiting_bytes,
        "dropped_failures": health.dropped_failures,
        "failed_attempts": health.failed_attempts,
        "last_error": health.last_error or None,
    }


def _percentiles(window: LatencyWindow) -> dict[str, float | None]:
    p50, p99 = window.percentile(0.5), window.percentile(0.99)
    return {
        "p50": None if p50 is None else round(p50, 3),
        "p99": None if p99 is None else round(p99, 3),
    }


class BackgroundSidecar:
    """A sidecar on its own event loop in a daemon thread (the demo and tests use it).

    ``start()`` returns once the ports are bound; ``stop()`` runs the ordered
    shutdown and joins the thread.
    """

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="spanvisor-sidecar", daemon=True)

    @property
    def ports(self) -> Ports:
        assert self.sidecar.ports is not None, "start() first"
        return self.sidecar.ports

    def start(self, timeout_s: float = 30.0) -> Ports:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the sidecar did not start in time")
        if self._error is not None:
            raise self._error
        return self.ports

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout_s)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        try:
            await self.sidecar.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stopped.wait()
        await self.sidecar.shutdown()


def _fleet_breakers(link: RedisLink | None) -> Callable[[], list[str] | None] | None:
    """What lists the fleet's breakers (their index in Redis); None: breakers are not shared."""
    index = link.index if link is not None else None
    return index.names if index is not None else None
