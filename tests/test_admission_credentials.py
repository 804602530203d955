"""What a 429 or a published limit teaches, when its span names the credential the call used.

Providers limit per API key: team-a's 429s lower and pause team-a's key
(``provider:model@team-a``) only, fleet-wide, while team-b keeps the full
rate; a 429 that names no credential is the model's, every key's. Real Redis,
the test's clocks; the pipeline-level tests build their spans with the real
OTel SDK (and the real openai SDK against the fake provider).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from policies import load_policy
from supervisor.admission import Admitter, Ceiling, LocalBucket, admission_key
from supervisor.admission.bucket import Take
from supervisor.admission.capacity import AdmissionCapacity
from supervisor.admission.shared import RedisBucket
from supervisor.admission.shared_learning import RedisLearning
from supervisor.app import BackgroundSidecar
from supervisor.records import RateLimitHeaders
from supervisor.testing import FakeProvider, Reply
from supervisor.wiring import build_sidecar
from tests.redis_server import REDIS
from tests.test_admission_fleet_learning import URL, link, sidecar
from tests.test_admission_provider_limits import Agent
from tests.test_app import settings as sidecar_settings
from tests.test_breaker_credentials import call, instrumented
from tests.test_shared_breakers import AUTH
from tests.test_shared_counts import Clock

MODEL = "openai:gpt-4o"
TEAM_A = admission_key(MODEL, "team-a")
TEAM_B = admission_key(MODEL, "team-b")
CEILING = Ceiling(rpm=100)


@pytest.fixture
def clock() -> Clock:
    return Clock(1_700_000_000.0)


def test_team_a_s_429s_lower_and_pause_team_a_only(namespace: str, clock: Clock) -> None:
    a, b = sidecar(namespace, clock, CEILING), sidecar(namespace, clock, CEILING)
    a.throttled(f"{MODEL}@team-a", 30.0, span="t/1")
    a.throttled(f"{MODEL}@team-a", 30.0, span="t/2")  # the same burst: one decrease
    for admitter in (a, b):  # b saw no 429: the pause is the fleet's
        paused = admitter.admit(TEAM_A)
        assert (paused.go, paused.why, paused.wait_ms, paused.shared) == (
            False,
            "paused",
            30_000,
            True,
        )
        assert admitter.admit(TEAM_B).go
        assert admitter.admit(admission_key(MODEL)).go  # the model without a credential too
    assert (a.rpm(TEAM_A), a.rpm(TEAM_B), a.rpm(admission_key(MODEL))) == (70, 100, 100)
    pace = AdmissionCapacity(a, lambda: True)  # what the governor paces a breaker's key at
    assert (pace(f"{MODEL}@team-a"), pace(f"{MODEL}@team-b"), pace(MODEL)) == (70, 100, 100)
    assert a.stats().decreases == 1
    # team-b keeps the full rate: its 100 a minute are all there.
    assert sum(b.admit(TEAM_B).go for _ in range(200)) == 100 - 2  # 2 taken above
    clock.now += 30  # the pause over: team-a's bucket holds 70 now, at b too
    assert sum(b.admit(TEAM_A).go for _ in range(200)) == 70
    limits = {m.model: m for m in b.stats().models}
    assert (limits[str(TEAM_A)].rpm, limits[str(TEAM_A)].fleetwide) == (70, True)
    assert (limits[str(TEAM_B)].rpm, limits[MODEL].rpm) == (100, 100)


def test_a_429_without_a_credential_lowers_and_pauses_every_key(
    namespace: str, clock: Clock
) -> None:
    a, b = sidecar(namespace, clock, CEILING), sidecar(namespace, clock, CEILING)
    a.throttled(MODEL, 10.0, span="t/1")
    for key in (TEAM_A, TEAM_B):
        found = b.admit(key)
        assert (found.go, found.why, found.wait_ms) == (False, "paused", 10_000)
    assert (b.rpm(TEAM_A), b.rpm(TEAM_B)) == (70, 70)
    # A key's share is the lower of the model's and its own: team-a's own 429 now
    # takes it lower still, team-b stays at the model's.
    clock.now += 11
    a.throttled(f"{MODEL}@team-a", span="t/2")
    clock.now += 1.5  # b reads the fleet's states again (at most once a second)
    b.admit(TEAM_A)
    assert (b.rpm(TEAM_A), b.rpm(TEAM_B)) == (70, 70)  # team-a's own share: 0.7 too
    clock.now += 3
    a.throttled(f"{MODEL}@team-a", span="t/3")  # another burst: 0.49
    clock.now += 1.5
    b.admit(TEAM_A)
    assert b.rpm(TEAM_A) == pytest.approx(49) and b.rpm(TEAM_B) == 70


def test_two_admitters_share_a_credential_s_learned_share(namespace: str, clock: Clock) -> None:
    a, b = sidecar(namespace, clock, CEILING), sidecar(namespace, clock, CEILING)
    for i in range(3):  # three bursts: 0.7 ** 3 of the ceiling
        a.throttled(f"{MODEL}@team-a", span=f"t/{i}")
        clock.now += 5
    b.admit(TEAM_A)  # reads the fleet's share of the model and of team-a's key
    assert b.rpm(TEAM_A) == pytest.approx(100 * 0.7**3)
    assert b.rpm(TEAM_B) == 100
    # b seeing one of those spans again counts it once, as the fleet did.
    b.throttled(f"{MODEL}@team-a", span="t/2")
    assert (b.stats().repeated, b.stats().decreases) == (1, 0)
    # A quiet minute gives back a step, at both.
    clock.now += 61
    b.admit(TEAM_A)
    assert b.rpm(TEAM_A) == pytest.approx(100 * (0.7**3 + 0.05))


def test_a_credential_s_knobs_are_its_own_entry(namespace: str, clock: Clock) -> None:
    found = link(URL, clock)
    admitter = Admitter(
        CEILING,
        {str(TEAM_A): Ceiling(rpm=1000, floor=0.5)},
        shared=RedisBucket(found, namespace, clock=clock),
        learning=RedisLearning(found, namespace, clock=clock),
        clock=clock,
    )
    for i in range(5):
        clock.now += 3
        admitter.throttled(f"{MODEL}@team-a", span=f"t/{i}")
    assert admitter.rpm(TEAM_A) == 500  # its floor: 0.5 of its own ceiling


def test_redis_away_a_credential_s_429_is_still_that_key_s(clock: Clock) -> None:
    down = sidecar("unused", clock, CEILING, url="redis://127.0.0.1:1/0")
    down.throttled(f"{MODEL}@team-a", 20.0, span="t/1")
    paused = down.admit(TEAM_A)
    assert (paused.go, paused.why, paused.wait_ms) == (False, "paused", 20_000)
    assert down.admit(TEAM_B).go and not down.admit(TEAM_B).shared
    assert (down.rpm(TEAM_A), down.rpm(TEAM_B)) == (70, 100)
    assert down.stats().learned_locally == 1


def test_the_script_checks_the_key_s_pause_and_the_model_s(namespace: str, clock: Clock) -> None:
    """One round trip: the take script waits for the later of the two pauses; the local
    bucket has no pauses (the admitter's learners hold them), so past them both agree."""
    fleet, local = RedisBucket(link(URL, clock), namespace, clock=clock), LocalBucket(clock=clock)
    assert fleet.pause(str(TEAM_A), clock.now + 5)
    assert fleet.pause(MODEL, clock.now + 2)

    def take(key: str) -> Any:
        return fleet.take(key, MODEL, 60.0, None, n=1, t=0, priority=1)

    assert take(str(TEAM_A)) == Take(False, 5000, "paused")
    assert take(str(TEAM_B)).wait_ms == 2000 and take(MODEL).why == "paused"
    clock.now += 2
    assert take(str(TEAM_B)) == local.take(str(TEAM_B), 60.0, None, n=1, t=0, priority=1)
    assert take(str(TEAM_A)).wait_ms == 3000
    clock.now += 3
    assert take(str(TEAM_A)) == local.take(str(TEAM_A), 60.0, None, n=1, t=0, priority=1)


def test_a_published_limit_on_team_a_s_span_is_team_a_s() -> None:
    admitter = Admitter(Ceiling(rpm=500, tpm=1_000_000), clock=Clock(time.time()))
    agent = Agent(admitter)
    agent.call(
        tokens=(1800, 200),
        own={
            "spanvisor.credential": "team-a",
            "x-ratelimit-limit-requests": "50",
            "x-ratelimit-limit-tokens": "40000",
        },
    )
    agent.call(tokens=(90, 10), own={"spanvisor.credential": "team-b"})
    limits = {m.model: m for m in admitter.stats().models}
    assert (limits[str(TEAM_A)].provider_rpm, limits[str(TEAM_A)].tpm) == (50, 40_000)
    assert (limits[str(TEAM_A)].avg_tokens, limits[str(TEAM_B)].avg_tokens) == (2000, 100)
    assert limits[str(TEAM_B)].provider_rpm is None and limits[str(TEAM_B)].rpm == 500
    assert MODEL not in limits  # no span without a credential: nothing of the model's
    assert (admitter.rpm(TEAM_A), admitter.rpm(TEAM_B)) == (50, 500)
    assert admitter.ceiling(TEAM_A).rpm == 500  # the configured one is left as it is
    # A limit published on a span without a credential is every key's.
    agent.call(own={"x-ratelimit-limit-requests": "300"})
    assert (admitter.rpm(TEAM_A), admitter.rpm(TEAM_B)) == (50, 300)


def test_an_exhausted_limit_on_team_a_s_span_pauses_team_a_only() -> None:
    admitter = Admitter(Ceiling(rpm=500), clock=Clock(time.time()))
    admitter.llm_call(f"{MODEL}@team-a", 100, RateLimitHeaders(60, None, 20.0))
    paused = admitter.admit(TEAM_A)
    assert (paused.go, paused.why, paused.wait_ms) == (False, "paused", 20_000)
    assert admitter.admit(TEAM_B).go


POLICY = """\
version: 1
admission:
  enabled: true
  default: {rpm: 1000}
"""


def test_team_a_s_429_spans_pause_team_a_at_a_real_sidecar(
    tmp_path: Path, namespace: str, direct: Any
) -> None:
    """The real openai SDK, instrumented, naming its credential on its spans, gets 429s
    for team-a; the spans reach a sidecar over OTLP/HTTP; /v1/admit then pauses team-a
    and lets team-b go."""
    settings = sidecar_settings(
        tmp_path,
        breaker_redis_url=f"redis://{REDIS[0]}:{REDIS[1]}/0",
        breaker_redis_namespace=namespace,
        breaker_redis_timeout_s=0.25,
        state_path=str(tmp_path / "state.db"),
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(text=POLICY)))
    background.start()
    try:
        with FakeProvider() as fake, instrumented() as exporter:
            client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
            with client:
                fake.script(*[Reply.rate_limited(20.0)] * 2)
                call(client, "team-a")
                call(client, "team-a")
                call(client, "team-b")  # OK
            spans = exporter.get_finished_spans()
        assert len(spans) == 3
        response = httpx.post(
            f"http://127.0.0.1:{background.ports.otlp_http}/v1/traces",
            content=encode_spans(spans).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert response.status_code == 200
        api = f"http://127.0.0.1:{background.ports.api}"

        def admit(credential: str) -> dict[str, Any]:
            body = {"dependency": "openai:gpt-4o-mini", "credential": credential}
            found = httpx.post(f"{api}/v1/admit", headers=AUTH, json=body)
            return dict(found.json())

        deadline = time.monotonic() + 10
        while admit("team-a")["go"]:
            assert time.monotonic() < deadline, "the 429s never reached the admitter"
            time.sleep(0.05)
        paused = admit("team-a")
        assert paused["why"] == "paused" and 15_000 < paused["wait_ms"] <= 20_000
        assert admit("team-b") == {"go": True}
        stats = httpx.get(f"{api}/v1/stats", headers=AUTH).json()["admission"]
        assert (stats["throttles"], stats["decreases"]) == (2, 1)
        shown = {m["model"]: m["fraction"] for m in stats["models"]}
        assert shown["openai:gpt-4o-mini@team-a"] == 0.7
        assert shown["openai:gpt-4o-mini@team-b"] == 1.0
        assert direct.exists(f"{namespace}:admit:pause:openai:gpt-4o-mini@team-a")
        assert not direct.exists(f"{namespace}:admit:pause:openai:gpt-4o-mini")
    finally:
        background.stop()
