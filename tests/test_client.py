"""supervisor.client against a real HTTP server on loopback (no mocks of httpx).

The server is a scripted stand-in for the sidecar's control API: it answers
``POST /v1/decide`` and ``GET /v1/breakers/{dependency}`` from queues the test
fills, checks the bearer token as the sidecar does, and records every request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest

from supervisor.act.signing import signature_headers
from supervisor.client import (
    Advice,
    BreakerOpen,
    FallbackAdvised,
    LocalPolicy,
    SeenCommands,
    SignatureError,
    SupervisorClient,
    SupervisorClientError,
    exception_type_name,
    guard,
    verify_webhook,
)
from supervisor.errors import SupervisorError
from supervisor.records import Action
from supervisor.testing.loopback import LoopbackHTTPServer, LoopbackServer

TOKEN = "test-token"
DEP = "openai:gpt-4o"


# -- the scripted sidecar ----------------------------------------------------------


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # a dict (sent as JSON) or raw bytes
    hang_s: float = 0.0


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Script:
    decide: deque[Reply] = field(default_factory=deque)
    breaker: deque[Reply] = field(default_factory=deque)
    requests: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


def answer(action: str = "retry", **extra: Any) -> Reply:
    body: dict[str, Any] = {
        "action": action,
        "delay_s": None,
        "reason": f"{action} because the test says so",
        "policy": "test-policy",
        "class": "transient",
        "kind": "rate_limit",
        "rule": "test-rule",
        "params": {},
        "fallback_to": None,
        "breaker": {"dependency": DEP, "state": "closed"},
        "observe_only": False,
    }
    body.update(extra)
    return Reply(body=body)


def state(value: str) -> Reply:
    return Reply(body={"dependency": DEP, "state": value})


class _Handler(BaseHTTPRequestHandler):
    server: LoopbackHTTPServer[Script]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output quiet

    def _serve(self, queue_name: str) -> None:
        script = self.server.context
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        script.requests.append(
            Seen(
                self.command,
                self.path,
                {k.lower(): v for k, v in self.headers.items()},
                json.loads(raw) if raw else None,
            )
        )
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(Reply(401, {"error": "missing or wrong bearer token"}))
            return
        queue: deque[Reply] = getattr(script, queue_name)
        reply = queue.popleft() if queue else Reply(500, {"error": "nothing scripted"})
        if reply.hang_s:
            script.release.wait(reply.hang_s)
        self._send(reply)

    def _send(self, reply: Reply) -> None:
        data = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (the hang test)

    def do_POST(self) -> None:
        if self.path == "/v1/decide":
            self._serve("decide")
        else:
            self._send(Reply(404, {"error": "no route"}))

    def do_GET(self) -> None:
        if self.path.startswith("/v1/breakers/"):
            self._serve("breaker")
        else:
            self._send(Reply(404, {"error": "no route"}))


@dataclass
class Sidecar:
    url: str
    script: Script

    def decide(self, *replies: Reply) -> None:
        self.script.decide.extend(replies)

    def breaker(self, *replies: Reply) -> None:
        self.script.breaker.extend(replies)

    @property
    def requests(self) -> list[Seen]:
        return self.script.requests

    def posted(self) -> list[Any]:
        return [r.body for r in self.requests if r.method == "POST"]


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    script = Script()
    with LoopbackServer(_Handler, script, name="sidecar", poll_interval_s=0.01) as server:
        try:
            yield Sidecar(server.url, script)
        finally:
            script.release.set()  # ends every hang before the stop waits for the handlers


class Sleeps:
    """An injected sleep that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)

    async def asleep(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


def make_client(url: str, sleeps: Sleeps | None = None, **kwargs: Any) -> SupervisorClient:
    sleeps = sleeps or Sleeps()
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("timeout_s", 1.0)  # 0.3 s was missed under load: a reply read as down
    kwargs.setdefault("service", "my-agent")
    kwargs.setdefault("local_policy", LocalPolicy(rng=lambda: 0.5))
    return SupervisorClient(url, sleep=sleeps, async_sleep=sleeps.asleep, **kwargs)


@pytest.fixture
def client(sidecar: Sidecar, sleeps: Sleeps) -> Iterator[SupervisorClient]:
    with make_client(sidecar.url, sleeps) as c:
        yield c


@pytest.fixture
def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def client_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    # Straight on the logger, not propagated: supervisor.logs may have stopped
    # "spanvisor" propagating, and each record must be captured once.
    logger = logging.getLogger("spanvisor.client")
    old = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield caplog
    finally:
        logger.setLevel(old[0])
        logger.propagate = old[1]
        logger.removeHandler(caplog.handler)


def rate_limit_error(message: str = "Rate limit reached. Please try again in 1.5s") -> Exception:
    """The exception the openai SDK raises for a 429 (it reads only the response's fields)."""
    request = httpx.Request("POST", "https://api.openai.com/v1/chat/completions")
    response = httpx.Response(429, request=request, headers={"x-request-id": "req_1"})
    return openai.RateLimitError(message, response=response, body=None)  # type: ignore[arg-type]


# -- decide -------------------------------------------------------------------------------


def test_decide_maps_the_answer_and_sends_what_the_exception_says(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.decide(
        answer(
            "retry",
            delay_s=1.5,
            params={"attempt": 1, "max_attempts": 5, "delay_s": 1.5},
            breaker={"dependency": "openai", "state": "half_open"},
        )
    )

    advice = client.decide(DEP, exception=rate_limit_error(), run_id="r-123")

    assert advice == Advice(
        action=Action.RETRY,
        delay_s=1.5,
        reason="retry because the test says so",
        policy="test-policy",
        failure_class="transient",
        kind="rate_limit",
        rule="test-rule",
        params={"attempt": 1, "max_attempts": 5, "delay_s": 1.5},
        fallback_to=None,
        dependency="openai",
        breaker_state="half_open",
        observe_only=False,
        source="sidecar",
    )
    (seen,) = sidecar.requests
    assert seen.headers["authorization"] == f"Bearer {TOKEN}"
    assert seen.body == {
        "dependency": DEP,
        "exception_type": "openai.RateLimitError",
        "message": "Rate limit reached. Please try again in 1.5s",
        "status_code": 429,
        "service": "my-agent",
        "run_id": "r-123",
        "attempt": 1,
    }


def test_decide_with_explicit_fields_and_fallback_answer(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.decide(answer("fallback", fallback_to="openai:gpt-4o-mini", observe_only=True))

    advice = client.decide(DEP, exception_type="x.Boom", message="m", status_code=503, attempt=3)

    assert advice.action is Action.FALLBACK
    assert advice.fallback_to == "openai:gpt-4o-mini"
    assert advice.observe_only
    assert advice.delay_s == 0.0
    assert sidecar.posted() == [
        {
            "dependency": DEP,
            "exception_type": "x.Boom",
            "message": "m",
            "status_code": 503,
            "service": "my-agent",
            "attempt": 3,
        }
    ]


def test_status_code_from_the_exception_response(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    request = httpx.Request("GET", "https://tool.example/search")
    error = httpx.HTTPStatusError(
        "Server error '502 Bad Gateway'",
        request=request,
        response=httpx.Response(502, request=request),
    )
    sidecar.decide(answer("fail_fast"))

    client.decide("http:tool.example", exception=error)

    (body,) = sidecar.posted()
    assert body["exception_type"] == "httpx.HTTPStatusError"
    assert body["status_code"] == 502


def test_breaker_state_url_encodes_the_dependency(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("open"), Reply(body={"state": "sideways"}))

    assert client.breaker_state("http:api.example.com/v1") == "open"
    assert client.breaker_state(DEP) == "unknown"  # not a state: garbage
    assert sidecar.requests[0].path == "/v1/breakers/http%3Aapi.example.com%2Fv1"


def test_bad_arguments_are_refused_before_asking(client: SupervisorClient) -> None:
    with pytest.raises(ValueError, match="dependency"):
        client.decide("")
    with pytest.raises(ValueError, match="1-based"):
        client.decide(DEP, attempt=0)


def test_a_refused_token_raises(sidecar: Sidecar) -> None:
    with make_client(sidecar.url, token="wrong") as client:
        with pytest.raises(SupervisorClientError, match="refused") as caught:
            client.decide(DEP, exception=TimeoutError())
        assert isinstance(caught.value, SupervisorError)
        with pytest.raises(SupervisorClientError):
            client.breaker_state(DEP)


def test_no_token_anywhere_raises_and_says_where_to_put_one(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv("SPANVISOR_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with SupervisorClient(sidecar.url) as client, pytest.raises(SupervisorClientError) as caught:
        client.decide(DEP)
    assert "no API token" in str(caught.value)
    assert "SPANVISOR_API_TOKEN" in str(caught.value)
    assert "authorization" not in sidecar.requests[0].headers


def test_token_from_the_environment_then_the_file(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SPANVISOR_TOKEN_FILE")  # then the sidecar's default token file
    (tmp_path / ".spanvisor").mkdir()
    (tmp_path / ".spanvisor" / "api-token").write_text(TOKEN + "\n")
    monkeypatch.setenv("SPANVISOR_API_TOKEN", "from-env")
    with SupervisorClient(sidecar.url) as client, pytest.raises(SupervisorClientError):
        client.breaker_state(DEP)  # the environment wins, and it is wrong
    monkeypatch.delenv("SPANVISOR_API_TOKEN")
    sidecar.breaker(state("closed"))
    with SupervisorClient(sidecar.url) as client:
        assert client.breaker_state(DEP) == "closed"


# -- when the sidecar cannot answer ----------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        None,  # the port is closed
        Reply(hang_s=3.0, body={"action": "retry"}),  # past timeout_s
        Reply(500, {"error": "boom"}),
        Reply(200, b"<html>not json</html>"),
        Reply(200, {"action": "panic"}),
        Reply(200, {"action": "retry", "delay_s": -1}),
        Reply(404, {"error": "no route"}),
    ],
    ids=["closed", "hang", "500", "not-json", "bad-action", "bad-delay", "404"],
)
def test_unusable_sidecar_falls_back_to_the_local_policy(
    reply: Reply | None,
    sidecar: Sidecar,
    closed_port: str,
    client_log: pytest.LogCaptureFixture,
) -> None:
    url = closed_port if reply is None else sidecar.url
    if reply is not None:
        sidecar.decide(reply)
    with make_client(url, timeout_s=0.3) as client:  # every answer is unusable: none is late
        started = time.monotonic()
        advice = client.decide(DEP, exception=rate_limit_error(), attempt=1)
        took = time.monotonic() - started
        # The next question within recheck_s is answered locally without asking.
        assert client.breaker_state(DEP) == "unknown"

    assert took < 1.5
    assert advice.source == "local"
    assert advice.action is Action.RETRY
    assert advice.delay_s == 1.5  # the hint beats the jittered 0.5 s
    assert advice.kind == "rate_limit"
    assert len(sidecar.requests) == (0 if reply is None else 1)
    warnings = [r for r in client_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "spanvisor unreachable at" in warnings[0].getMessage()
    assert "using the local policy" in warnings[0].getMessage()


def test_one_warning_per_unreachable_period(
    sidecar: Sidecar, client_log: pytest.LogCaptureFixture
) -> None:
    sidecar.decide(Reply(500), Reply(502), Reply(200, b"garbage"), answer("fail_fast"), Reply(503))
    with make_client(sidecar.url, recheck_s=0.0) as client:
        sources = [client.decide(DEP, exception=TimeoutError()).source for _ in range(5)]

    assert sources == ["local", "local", "local", "sidecar", "local"]
    assert len(sidecar.requests) == 5
    levels = [(r.levelno, r.getMessage().split(" at ")[0]) for r in client_log.records]
    assert levels == [
        (logging.WARNING, "spanvisor unreachable"),
        (logging.INFO, "spanvisor reachable again"),
        (logging.WARNING, "spanvisor unreachable"),
    ]


def test_the_sidecar_is_asked_again_after_recheck_s(sidecar: Sidecar) -> None:
    now = [100.0]
    sidecar.decide(Reply(500), answer("fail_fast"))
    with make_client(sidecar.url, recheck_s=5.0, clock=lambda: now[0]) as client:
        assert client.decide(DEP).source == "local"
        now[0] += 4.9
        assert client.decide(DEP).source == "local"
        assert len(sidecar.requests) == 1
        now[0] += 0.2
        assert client.decide(DEP).source == "sidecar"
    assert len(sidecar.requests) == 2


def test_async_twins(sidecar: Sidecar, closed_port: str) -> None:
    sidecar.decide(answer("escalate"))
    sidecar.breaker(state("isolated"))

    async def main() -> tuple[Advice, str, Advice]:
        async with make_client(sidecar.url) as client:
            advice = await client.adecide(DEP, exception=ValueError("bad"), run_id="r")
            breaker = await client.abreaker_state(DEP)
        async with make_client(closed_port) as down:
            local = await down.adecide(DEP, exception=ConnectionResetError("reset"))
        return advice, breaker, local

    advice, breaker, local = asyncio.run(main())

    assert advice.action is Action.ESCALATE
    assert advice.source == "sidecar"
    assert breaker == "isolated"
    assert sidecar.posted()[0]["exception_type"] == "ValueError"
    assert (local.source, local.action, local.kind) == ("local", Action.RETRY, "connection")


# -- the local policy ---------------------------------------------------------------------------


def test_local_policy_backoff_full_jitter_and_cap() -> None:
    top = LocalPolicy(rng=lambda: 0.999999, max_attempts=10)
    delays = [top.advise(DEP, status_code=503, attempt=n).delay_s for n in range(1, 8)]
    assert [round(d) for d in delays] == [1, 2, 4, 8, 16, 30, 30]
    assert LocalPolicy(rng=lambda: 0.0).advise(DEP, status_code=500).delay_s == 0.0


def test_local_policy_retries_transient_looking_errors_at_most_three_times() -> None:
    policy = LocalPolicy(rng=lambda: 0.5)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"status_code": 408}, "timeout"),
        ({"status_code": 429}, "rate_limit"),
        ({"status_code": 502}, "unavailable"),
        ({"exception_type": "openai.APITimeoutError"}, "timeout"),
        ({"exception_type": "httpx.ConnectError"}, "connection"),
        ({"exception_type": "ConnectionResetError"}, "connection"),
        ({"exception_type": "TimeoutError"}, "timeout"),
        ({"message": "upstream timed out"}, "timeout"),
    ]
    for kwargs, kind in cases:
        first = policy.advise(DEP, attempt=1, **kwargs)
        assert (first.action, first.kind, first.source) == (Action.RETRY, kind, "local"), kwargs
        assert policy.advise(DEP, attempt=2, **kwargs).action is Action.RETRY
        assert policy.advise(DEP, attempt=3, **kwargs).action is Action.FAIL_FAST


def test_local_policy_fails_fast_on_everything_else() -> None:
    policy = LocalPolicy()
    cases: list[dict[str, Any]] = [
        {"status_code": 400, "exception_type": "openai.BadRequestError"},
        {"status_code": 401, "message": "timed out"},  # the status speaks louder
        {"exception_type": "ValueError", "message": "bad input"},
        {},
        {"status_code": 429, "message": "You exceeded your current quota (insufficient_quota)"},
    ]
    for kwargs in cases:
        advice = policy.advise(DEP, **kwargs)
        assert advice.action is Action.FAIL_FAST, kwargs
        assert advice.delay_s == 0.0


def test_local_policy_honours_hints_up_to_sixty_seconds() -> None:
    policy = LocalPolicy(rng=lambda: 0.5)

    def delay(message: str, retry_after_s: float | None = None) -> float:
        return policy.advise(
            DEP, status_code=429, message=message, retry_after_s=retry_after_s
        ).delay_s

    assert delay("Please try again in 20ms") == 0.5  # jitter above the hint
    assert delay("Please try again in 7.25s.") == 7.25
    assert delay("Please retry after 20 seconds") == 20.0
    assert delay("Rate limited, try again in 1m3s") == 60.0
    assert delay("retry-after: 12") == 12.0
    assert delay("no hint") == 0.5
    assert delay("no hint", retry_after_s=9.0) == 9.0


# -- exception names ----------------------------------------------------------------------


def test_exception_type_names() -> None:
    pkg = types.ModuleType("fakepkg")
    impl = types.ModuleType("fakepkg._impl")

    class Exported(Exception):
        pass

    class Hidden(Exception):
        pass

    for cls in (Exported, Hidden):
        cls.__module__ = "fakepkg._impl"
        cls.__qualname__ = cls.__name__
    impl.Exported = Exported  # type: ignore[attr-defined]
    impl.Hidden = Hidden  # type: ignore[attr-defined]
    pkg.Exported = Exported  # type: ignore[attr-defined]
    sys.modules["fakepkg"], sys.modules["fakepkg._impl"] = pkg, impl
    try:
        assert exception_type_name(Exported) == "fakepkg.Exported"
        assert exception_type_name(Hidden) == "fakepkg.Hidden"
    finally:
        del sys.modules["fakepkg"], sys.modules["fakepkg._impl"]
    assert exception_type_name(openai.RateLimitError) == "openai.RateLimitError"
    assert exception_type_name(TimeoutError) == "TimeoutError"
    assert exception_type_name(json.JSONDecodeError) == "json.decoder.JSONDecodeError"
    assert exception_type_name(BreakerOpen) == "supervisor.client.BreakerOpen"


# -- guard ----------------------------------------------------------------------------------


class Flaky:
    """Raises the given exceptions in turn, then returns "ok"; counts its calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, prompt: str) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return f"ok: {prompt}"

    async def acall(self, prompt: str) -> str:
        return self(prompt)


def test_guard_retries_after_the_advised_delay(
    sidecar: Sidecar, client: SupervisorClient, sleeps: Sleeps
) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(answer("retry", delay_s=1.5), answer("retry", delay_s=3.0))
    flaky = Flaky(rate_limit_error(), rate_limit_error())

    @guard(DEP, client=client, run_id="r-1")
    def ask(prompt: str) -> str:
        return flaky(prompt)

    assert ask("hi") == "ok: hi"
    assert ask.__name__ == "ask"
    assert flaky.calls == 3
    assert sleeps.delays == [1.5, 3.0]
    assert [(b["attempt"], b["run_id"]) for b in sidecar.posted()] == [(1, "r-1"), (2, "r-1")]


def test_guard_falls_back_to_the_advised_dependency(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("closed"), state("closed"))
    sidecar.decide(answer("fallback", fallback_to="openai:gpt-4o-mini"), answer("fallback"))
    asked: list[str] = []

    def fallback(to: str) -> str:
        asked.append(to)
        return f"answered by {to}"

    flaky = Flaky(rate_limit_error(), rate_limit_error())
    assert guard(DEP, client=client, fallback=fallback).call(flaky, "hi") == (
        "answered by openai:gpt-4o-mini"
    )
    # No alternative named: the fallback gets the guarded dependency.
    assert guard(DEP, client=client, fallback=fallback).call(flaky, "hi") == f"answered by {DEP}"
    assert flaky.calls == 2


def test_guard_fallback_advice_without_a_fallback_reraises(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(answer("fallback", fallback_to="openai:gpt-4o-mini"))
    error = rate_limit_error()
    with pytest.raises(openai.RateLimitError) as caught:
        guard(DEP, client=client).call(Flaky(error), "hi")
    assert caught.value is error


@pytest.mark.parametrize("state_name", ["open", "isolated"])
def test_guard_fails_fast_while_the_breaker_is_open(
    state_name: str, sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state(state_name), state(state_name))
    flaky = Flaky()

    with pytest.raises(BreakerOpen) as caught:
        guard(DEP, client=client).call(flaky, "hi")
    assert (caught.value.dependency, caught.value.state) == (DEP, state_name)
    assert guard(DEP, client=client, fallback=lambda d: f"instead of {d}").call(flaky, "hi") == (
        f"instead of {DEP}"
    )
    assert flaky.calls == 0
    assert sidecar.posted() == []


def test_guard_with_a_credential_asks_the_breaker_of_that_key(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("open"))
    flaky = Flaky()

    with pytest.raises(BreakerOpen) as caught:
        guard(DEP, client=client, credential="team-a").call(flaky, "hi")
    assert caught.value.dependency == f"{DEP}@team-a"
    assert sidecar.requests[0].path == "/v1/breakers/" + quote(f"{DEP}@team-a", safe="")
    assert flaky.calls == 0
    with pytest.raises(ValueError, match="looks like an API key") as refused:
        guard(DEP, client=client, credential="sk-proj-abc123")
    assert "sk-proj" not in str(refused.value)


@pytest.mark.parametrize("action", ["fail_fast", "escalate", "remediate", "none"])
def test_guard_reraises_the_original_exception(
    action: str, sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(answer(action, reason=f"{action}: see the runbook"))
    error = ValueError("the model said no")
    flaky = Flaky(error)

    with pytest.raises(ValueError, match="the model said no") as caught:
        guard(DEP, client=client).call(flaky, "hi")

    assert caught.value is error
    assert flaky.calls == 1
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__ == [
            f"spanvisor (sidecar): {action}: {action}: see the runbook"
        ]


def test_guard_ignores_observe_only_advice(sidecar: Sidecar, client: SupervisorClient) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(answer("retry", delay_s=1.0, observe_only=True))
    flaky = Flaky(rate_limit_error())
    with pytest.raises(openai.RateLimitError):
        guard(DEP, client=client).call(flaky, "hi")
    assert flaky.calls == 1


def test_guard_attempts_are_bounded(
    sidecar: Sidecar, client: SupervisorClient, sleeps: Sleeps
) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(*(answer("retry", delay_s=0.25) for _ in range(10)))
    errors = [TimeoutError(f"try {n}") for n in range(10)]
    flaky = Flaky(*errors)

    with pytest.raises(TimeoutError) as caught:
        guard(DEP, client=client, max_attempts=3).call(flaky, "hi")

    assert flaky.calls == 3
    assert caught.value is errors[2]  # the last one, never swallowed
    assert sleeps.delays == [0.25, 0.25]
    if sys.version_info >= (3, 11):
        assert "3 attempts are spent" in caught.value.__notes__[0]


def test_guard_follows_the_local_policy_when_the_sidecar_is_down(closed_port: str) -> None:
    sleeps = Sleeps()
    with make_client(closed_port, sleeps) as client:
        flaky = Flaky(*(TimeoutError() for _ in range(5)))
        with pytest.raises(TimeoutError):
            guard(DEP, client=client).call(flaky, "hi")
    assert flaky.calls == 3  # the local policy's limit
    assert sleeps.delays == [0.5, 1.0]  # full jitter at 0.5 of 1 s, 2 s


def test_guard_on_async_functions(sidecar: Sidecar, sleeps: Sleeps) -> None:
    sidecar.breaker(state("closed"), state("closed"), state("open"))
    sidecar.decide(
        answer("retry", delay_s=2.0),
        answer("fallback", fallback_to="openai:gpt-4o-mini"),
    )
    retried, fell_back = Flaky(rate_limit_error()), Flaky(rate_limit_error())

    async def afallback(to: str) -> str:
        return f"async fallback to {to}"

    async def main() -> tuple[str, str, str]:
        async with make_client(sidecar.url, sleeps) as client:

            @guard(DEP, client=client)
            async def ask(prompt: str) -> str:
                return await retried.acall(prompt)

            first = await ask("a")
            second = await guard(DEP, client=client, fallback=afallback).acall(fell_back.acall, "b")
            third = await guard(DEP, client=client, fallback=lambda d: f"sync {d}").acall(
                fell_back.acall, "c"
            )
            return first, second, third

    assert asyncio.run(main()) == ("ok: a", "async fallback to openai:gpt-4o-mini", f"sync {DEP}")
    assert sleeps.delays == [2.0]
    assert (retried.calls, fell_back.calls) == (2, 1)


def test_guard_async_breaker_open_without_fallback(sidecar: Sidecar) -> None:
    sidecar.breaker(state("open"))

    async def main() -> None:
        async with make_client(sidecar.url) as client:

            @guard(DEP, client=client)
            async def ask() -> str:
                raise AssertionError("not called")

            await ask()

    with pytest.raises(BreakerOpen):
        asyncio.run(main())


def test_guard_attempts_in_a_with_block_are_bounded(
    sidecar: Sidecar, client: SupervisorClient, sleeps: Sleeps
) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(*(answer("retry", delay_s=0.25) for _ in range(10)))
    errors = [TimeoutError(f"try {n}") for n in range(10)]
    numbers: list[int] = []

    with pytest.raises(TimeoutError) as caught:
        for attempt in guard(DEP, client=client, max_attempts=3).attempts():
            with attempt:
                numbers.append(attempt.number)
                raise errors[attempt.number - 1]

    assert numbers == [1, 2, 3]
    assert caught.value is errors[2]
    assert sleeps.delays == [0.25, 0.25]
    assert [b["attempt"] for b in sidecar.posted()] == [1, 2, 3]
    if sys.version_info >= (3, 11):
        assert "3 attempts are spent" in caught.value.__notes__[0]


class Interrupted(BaseException):
    """Not an Exception: what a guard must let through unjudged (as KeyboardInterrupt)."""


def test_guard_lets_base_exceptions_through_unjudged(
    sidecar: Sidecar, client: SupervisorClient
) -> None:
    sidecar.breaker(state("closed"))
    interrupted = Interrupted()
    flaky = Flaky(interrupted)  # type: ignore[arg-type]
    with pytest.raises(Interrupted) as caught:
        guard(DEP, client=client).call(flaky, "hi")
    assert caught.value is interrupted
    assert flaky.calls == 1
    assert sidecar.posted() == []  # not asked about


def test_guard_async_attempts_are_bounded(sidecar: Sidecar, sleeps: Sleeps) -> None:
    sidecar.breaker(state("closed"))
    sidecar.decide(*(answer("retry", delay_s=0.5) for _ in range(5)))
    flaky = Flaky(*(TimeoutError(f"try {n}") for n in range(5)))

    async def main() -> None:
        async with make_client(sidecar.url, sleeps) as client:
            await guard(DEP, client=client, max_attempts=2).acall(flaky.acall, "hi")

    with pytest.raises(TimeoutError, match="try 1"):
        asyncio.run(main())
    assert (flaky.calls, sleeps.delays) == (2, [0.5])


def test_guard_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="dependency"):
        guard("")
    with pytest.raises(ValueError, match="max_attempts"):
        guard(DEP, max_attempts=0)


# -- webhooks ---------------------------------------------------------------------------------

SECRET = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHM="


def command_body() -> bytes:
    return json.dumps(
        {"id": "cmd-1", "idempotency_key": "k-1", "type": "retry_step", "params": {}}
    ).encode()


def test_verify_webhook_returns_the_command() -> None:
    body = command_body()
    headers = signature_headers(SECRET, "cmd-1", body)
    assert verify_webhook(SECRET, headers, body)["idempotency_key"] == "k-1"
    upper = {k.upper(): v for k, v in headers.items()}
    assert verify_webhook(SECRET, upper, body)["id"] == "cmd-1"


def test_verify_webhook_refuses_bad_signatures() -> None:
    body = command_body()
    headers = signature_headers(SECRET, "cmd-1", body)
    with pytest.raises(SignatureError):
        verify_webhook(SECRET, headers, body.replace(b"retry_step", b"abort_run"))
    with pytest.raises(SignatureError):
        verify_webhook("whsec_" + "b3RoZXItc2VjcmV0", headers, body)
    stale = signature_headers(SECRET, "cmd-1", body, now=time.time() - 3600)
    with pytest.raises(SignatureError, match="from now"):
        verify_webhook(SECRET, stale, body)
    with pytest.raises(SignatureError, match="missing"):
        verify_webhook(SECRET, {}, body)


def test_verify_webhook_refuses_a_body_that_is_not_a_json_object() -> None:
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        headers = signature_headers(SECRET, "cmd-1", body)
        with pytest.raises(ValueError, match=r"not (a )?JSON") as caught:
            verify_webhook(SECRET, headers, body)
        assert not isinstance(caught.value, SignatureError)


def test_seen_commands_drops_duplicates_within_capacity() -> None:
    seen = SeenCommands(capacity=3)
    assert [seen.first_time(k) for k in ("a", "b", "a", "c")] == [True, True, False, True]
    assert seen.first_time("d")  # evicts "b", the least recently seen ("a" was refreshed)
    assert len(seen) == 3
    assert not seen.first_time("a")
    assert seen.first_time("b")
    with pytest.raises(ValueError):
        SeenCommands(capacity=0)


def test_seen_commands_is_thread_safe() -> None:
    seen = SeenCommands()
    firsts: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = [seen.first_time(f"k{n}") for n in range(500)]
        with lock:
            firsts.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(firsts) == 500
    assert len(seen) == 500


def test_guard_attempts_in_a_with_block_retry_and_fall_back(
    sidecar: Sidecar, client: SupervisorClient, sleeps: Sleeps
) -> None:
    sidecar.breaker(state("closed"), state("closed"), state("open"))
    sidecar.decide(
        answer("retry", delay_s=2.0),
        answer("fallback", fallback_to="openai:gpt-4o-mini"),
    )
    flaky = Flaky(rate_limit_error())

    for attempt in guard(DEP, client=client).attempts():
        with attempt:
            result = flaky("hi")
    assert (result, flaky.calls, sleeps.delays) == ("ok: hi", 2, [2.0])

    with pytest.raises(FallbackAdvised) as advised:
        for attempt in guard(DEP, client=client).attempts():
            with attempt:
                Flaky(rate_limit_error())("hi")
    assert (advised.value.dependency, advised.value.to) == (DEP, "openai:gpt-4o-mini")

    with pytest.raises(BreakerOpen):
        for attempt in guard(DEP, client=client).attempts():
            with attempt:
                pytest.fail("no attempt while the breaker is open")
