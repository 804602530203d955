"""Running calls under the sidecar's advice: :func:`guard`, on tenacity's retry loop.

The three ways to guard (a sync call, an async call, the ``attempts()``
iterator) run one loop: tenacity's ``Retrying`` / ``AsyncRetrying`` with
strategies that follow the advice the last failure got (:class:`_FollowAdvice`).
The advice is asked inside the attempt, synchronously or awaited as the call
is, so the strategies themselves are plain functions both loops take.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from tenacity import AsyncRetrying, RetryCallState, Retrying, stop_after_attempt
from tenacity import AttemptManager as _AttemptManager

from supervisor.admission.admitter import PRIORITIES
from supervisor.admission.key import admission_key, check_credential
from supervisor.client._advice import OPEN_STATES, Advice
from supervisor.client._http import SupervisorClient, shared_client
from supervisor.errors import SupervisorError
from supervisor.records import Action, breaker_key, split_model_dependency

P = ParamSpec("P")
#: The most a guard with ``admit`` waits for admission before a call, in all (then it calls).
MAX_ADMIT_WAIT_S = 30.0
#: The most ``/v1/admit`` questions before one call (each answer's wait is slept between):
#: a bound against a sidecar answering nonsense, not the wait's. Under a fleet's
#: contention a call is refused about once per refill of its key (once a second at
#: 60 requests a minute) until its turn; a call that stopped asking early would go
#: unadmitted, uncounted by the bucket, and meet the provider's 429.
MAX_ADMIT_ASKS = 1000
#: The least a guard sleeps between two questions (so that tiny waits are no busy loop).
MIN_ADMIT_SLEEP_S = 0.01
R = TypeVar("R")


class BreakerOpen(SupervisorError):
    """The breaker of ``dependency`` is open or isolated: the call was not attempted."""

    def __init__(self, dependency: str, state: str = "open") -> None:
        self.dependency = dependency
        self.state = state
        super().__init__(f"breaker for {dependency} is {state}: failing fast")


class FallbackAdvised(SupervisorError):
    """The sidecar advises calling ``to`` instead of ``dependency`` (see :meth:`Guard.attempts`)."""

    def __init__(self, dependency: str, to: str) -> None:
        super().__init__(f"spanvisor advises falling back from {dependency} to {to}")
        self.dependency = dependency
        self.to = to

    @property
    def model(self) -> str:
        """``to``'s model, as the agent's SDK calls it (``gpt-4o-mini`` for ``openai:gpt-4o-mini``).

        ``to`` itself when it names no model (a tool, a host).
        """
        split = split_model_dependency(self.to)
        return split[1] if split is not None and split[1] else self.to


class _FollowAdvice:
    """tenacity's strategies for one guarded call, each reading the advice its last failure got.

    ``retry``: the advice says retry (and is not observe-only); ``wait``: the
    advice's delay; ``stop``: the guard's ``max_attempts``, a bound of the
    agent's own (the sidecar and the local policy already turn a retry whose
    attempts are spent into another action). An exception the advice was not
    asked about (``KeyboardInterrupt``, a refused token) is never retried.
    """

    __slots__ = ("advice", "attempt", "failure", "guard")

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        #: The number of the attempt under way (1-based).
        self.attempt = 1
        self.failure: BaseException | None = None
        self.advice: Advice | None = None

    def judged(self, failure: Exception, advice: Advice) -> None:
        self.failure, self.advice = failure, advice

    def _advice_for(self, exc: BaseException | None) -> Advice | None:
        return self.advice if exc is not None and exc is self.failure else None

    def retries(self, exc: BaseException | None) -> bool:
        advice = self._advice_for(exc)
        return advice is not None and advice.action is Action.RETRY and not advice.observe_only

    def fallback_to(self, exc: BaseException) -> str | None:
        """The dependency to call instead, when the advice for ``exc`` is to fall back."""
        advice = self._advice_for(exc)
        if advice is None or advice.observe_only or advice.action is not Action.FALLBACK:
            return None
        return advice.fallback_to or self.guard.dependency

    def note(self, exc: BaseException) -> None:
        """Tell, on the exception that leaves the guard, what the advice was (Python 3.11+)."""
        advice = self._advice_for(exc)
        if advice is None:
            return
        spent = (
            f"; the guard's {self.guard.max_attempts} attempts are spent"
            if self.retries(exc)
            else ""
        )
        shadow = " (observe only)" if advice.observe_only else ""
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(
                f"spanvisor ({advice.source}{shadow}): {advice.action.value}: "
                f"{advice.reason or advice.policy}{spent}"
            )

    # -- the strategies --------------------------------------------------------

    def _before(self, state: RetryCallState) -> None:
        self.attempt = state.attempt_number

    def _retry(self, state: RetryCallState) -> bool:
        outcome = state.outcome
        return outcome is not None and outcome.failed and self.retries(outcome.exception())

    def _wait(self, state: RetryCallState) -> float:
        return self.advice.delay_s if self.advice is not None else 0.0

    def retrying(self, sleep: Callable[[float], None]) -> Retrying:
        return Retrying(
            sleep=sleep,
            stop=stop_after_attempt(self.guard.max_attempts),
            wait=self._wait,
            retry=self._retry,
            before=self._before,
            reraise=True,
        )

    def async_retrying(self, sleep: Callable[[float], Awaitable[None]]) -> AsyncRetrying:
        return AsyncRetrying(
            sleep=sleep,
            stop=stop_after_attempt(self.guard.max_attempts),
            wait=self._wait,
            retry=self._retry,
            before=self._before,
            reraise=True,
        )


class Guard:
    """Runs a call to one dependency under the sidecar's advice. Make one with :func:`guard`."""

    def __init__(
        self,
        dependency: str,
        *,
        client: SupervisorClient | None = None,
        fallback: Callable[[str], Any] | None = None,
        max_attempts: int = 5,
        run_id: str = "",
        admit: bool = False,
        credential: str | None = None,
        priority: str = "normal",
        tokens: int = 0,
        max_admit_wait_s: float = MAX_ADMIT_WAIT_S,
    ) -> None:
        if not dependency:
            raise ValueError("dependency must not be empty")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if credential is not None:
            check_credential(credential)  # refuses a secret before any call
        if admit:
            admission_key(dependency, credential)
            if priority not in PRIORITIES:
                raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        self.dependency = dependency
        self.fallback = fallback
        self.max_attempts = max_attempts
        self.run_id = run_id
        self.admit = admit
        self.credential = credential
        #: The breaker asked before a call: the credential's own when one is named.
        self.breaker_key = breaker_key(dependency, credential or "")
        self.priority = priority
        self.tokens = tokens
        self.max_admit_wait_s = max_admit_wait_s
        self._client = client

    @property
    def client(self) -> SupervisorClient:
        return self._client if self._client is not None else shared_client()

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorate a sync or async function."""
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[P, Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def awrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                return await self.acall(afn, *args, **kwargs)

            return cast(Callable[P, R], awrapper)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return self.call(fn, *args, **kwargs)

        return wrapper

    def _admit_args(self) -> dict[str, Any]:
        return {"credential": self.credential, "priority": self.priority, "tokens": self.tokens}

    def wait_admission(self, client: SupervisorClient) -> float:
        """With ``admit``: ask ``/v1/admit`` and sleep the advised waits, at most
        ``max_admit_wait_s`` in all (then the call goes); the seconds slept."""
        slept = 0.0
        for _ in range(MAX_ADMIT_ASKS):
            if not self.admit:
                break
            wait_s = client.admit(self.dependency, **self._admit_args()) / 1000
            if wait_s <= 0 or slept >= self.max_admit_wait_s:
                break
            wait_s = min(max(wait_s, MIN_ADMIT_SLEEP_S), self.max_admit_wait_s - slept)
            client.sleep(wait_s)
            slept += wait_s
        return slept

    async def await_admission(self, client: SupervisorClient) -> float:
        """The async twin of :meth:`wait_admission`."""
        slept = 0.0
        for _ in range(MAX_ADMIT_ASKS):
            if not self.admit:
                break
            wait_s = await client.aadmit(self.dependency, **self._admit_args()) / 1000
            if wait_s <= 0 or slept >= self.max_admit_wait_s:
                break
            wait_s = min(max(wait_s, MIN_ADMIT_SLEEP_S), self.max_admit_wait_s - slept)
            await client.async_sleep(wait_s)
            slept += wait_s
        return slept

    def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call ``fn(*args, **kwargs)`` under the guard (sync; blocks while waiting to retry)."""
        client = self.client
        state = client.breaker_state(self.breaker_key)
        if state in OPEN_STATES:
            if self.fallback is not None:
                return cast(R, self.fallback(self.dependency))
            raise BreakerOpen(self.breaker_key, state)
        follow = _FollowAdvice(self)

        def attempt() -> R:
            self.wait_admission(client)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                advice = client.decide(
                    self.dependency, exception=exc, run_id=self.run_id, attempt=follow.attempt
                )
                follow.judged(exc, advice)
                raise

        try:
            return follow.retrying(client.sleep)(attempt)
        except Exception as exc:
            to = follow.fallback_to(exc)
            if to is None or self.fallback is None:
                follow.note(exc)
                raise
        return cast(R, self.fallback(to))

    async def acall(self, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Await ``fn(*args, **kwargs)`` under the guard; the fallback may be sync or async."""
        client = self.client
        state = await client.abreaker_state(self.breaker_key)
        if state in OPEN_STATES:
            if self.fallback is not None:
                return cast(R, await _maybe_await(self.fallback(self.dependency)))
            raise BreakerOpen(self.breaker_key, state)
        follow = _FollowAdvice(self)

        async def attempt() -> R:
            await self.await_admission(client)
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                advice = await client.adecide(
                    self.dependency, exception=exc, run_id=self.run_id, attempt=follow.attempt
                )
                follow.judged(exc, advice)
                raise

        try:
            return cast(R, await follow.async_retrying(client.async_sleep)(attempt))
        except Exception as exc:
            to = follow.fallback_to(exc)
            if to is None or self.fallback is None:
                follow.note(exc)
                raise
        return cast(R, await _maybe_await(self.fallback(to)))

    def attempts(self) -> Iterator[GuardedAttempt]:
        """Attempts for a ``with`` block, as tenacity's ``for attempt in Retrying()``::

            try:
                for attempt in guard("openai:gpt-4o").attempts():
                    with attempt:
                        answer = ask("gpt-4o", prompt)
            except FallbackAdvised as advised:
                answer = ask(advised.model, prompt)

        Before the first attempt an open or isolated breaker raises
        :class:`BreakerOpen`. An exception in the block is passed to
        :meth:`SupervisorClient.decide`: ``retry`` lets the loop sleep the
        advised delay and go on (at most ``max_attempts`` attempts, then the
        exception comes out of the loop); ``fallback`` raises
        :class:`FallbackAdvised` naming the alternative; anything else lets the
        exception out of the block, with the advice as a note.
        """
        client = self.client
        state = client.breaker_state(self.breaker_key)
        if state in OPEN_STATES:
            raise BreakerOpen(self.breaker_key, state)
        follow = _FollowAdvice(self)
        try:
            for attempt in follow.retrying(client.sleep):
                self.wait_admission(client)
                yield GuardedAttempt(self, client, attempt, follow)
        except Exception as exc:  # the last retried attempt's, re-raised by tenacity
            follow.note(exc)
            raise


class GuardedAttempt:
    """One attempt of :meth:`Guard.attempts`: a context manager that judges its exception."""

    def __init__(
        self,
        guard: Guard,
        client: SupervisorClient,
        attempt: _AttemptManager,
        follow: _FollowAdvice,
    ) -> None:
        self._guard = guard
        self._client = client
        self._attempt = attempt
        self._follow = follow
        self.number = attempt.retry_state.attempt_number
        #: No more attempts follow: the block succeeded or its error went out.
        self.done = False

    def __enter__(self) -> GuardedAttempt:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.done = True
        if exc is None:
            self._attempt.__exit__(None, None, None)  # success: tenacity ends the loop
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt and the like: not ours to judge
        guard, follow = self._guard, self._follow
        advice = self._client.decide(
            guard.dependency, exception=exc, run_id=guard.run_id, attempt=self.number
        )
        follow.judged(exc, advice)
        to = follow.fallback_to(exc)
        if to is not None:
            raise FallbackAdvised(guard.dependency, to) from exc
        if follow.retries(exc):
            self.done = False
            # tenacity keeps the exception: it waits the advised delay, or re-raises it when
            # the attempts are spent.
            return bool(self._attempt.__exit__(exc_type, exc, tb))
        follow.note(exc)
        return False


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def guard(
    dependency: str,
    *,
    client: SupervisorClient | None = None,
    fallback: Callable[[str], Any] | None = None,
    max_attempts: int = 5,
    run_id: str = "",
    admit: bool = False,
    credential: str | None = None,
    priority: str = "normal",
    tokens: int = 0,
    max_admit_wait_s: float = MAX_ADMIT_WAIT_S,
) -> Guard:
    """Run calls to ``dependency`` under the sidecar's advice.

    Two ways to use it (a ``with`` block cannot re-run its body, so there is none)::

        @guard("openai:gpt-4o", fallback=lambda to: ask(model=to.split(":", 1)[1]))
        def ask(prompt: str) -> str: ...          # or `async def`

        answer = guard("tool:search").call(search, "query")        # sync
        answer = await guard("tool:search").acall(asearch, "query")  # async

    The decorator tells async functions by ``inspect.iscoroutinefunction``;
    wrap any other callable that returns an awaitable with ``acall``.

    What a guarded call does:

    1. It asks for the breaker of ``dependency`` (of ``dependency@credential``
       when a ``credential`` is named: the breaker of that API key, which the
       sidecar keeps for spans with ``spanvisor.credential``). Open or isolated: it calls
       ``fallback(dependency)`` and returns its result, or without a fallback
       raises :class:`BreakerOpen`; the function is not called. A sidecar that
       cannot say (``"unknown"``) does not stop the call.
    2. It calls the function. Success returns its result. An ``Exception``
       (never ``KeyboardInterrupt``, ``CancelledError``...) is passed to
       :meth:`SupervisorClient.decide` with ``attempt`` = the number of the
       failed attempt, and the advice is followed:

       - ``retry``: sleep ``delay_s`` (the client's ``sleep`` / ``async_sleep``)
         and call again, unless ``max_attempts`` calls were made: then re-raise.
       - ``fallback``: return ``fallback(advice.fallback_to or dependency)``
         (awaited when it returns an awaitable); without a fallback, re-raise.
         What the fallback raises propagates, unguarded.
       - ``fail_fast``, ``escalate``, ``remediate``, ``none``: re-raise.
       - observe-only advice (shadow mode) is never acted on: re-raise.

    With ``admit=True`` each attempt first asks ``POST /v1/admit`` (the
    fleet's limit for ``dependency`` and ``credential``, a name or a hash of
    the API key, never the key) and sleeps the advised wait, at most
    ``max_admit_wait_s`` in all; a sidecar that cannot answer does not delay
    the call.

    Whatever is re-raised is the last exception of the function itself, with
    its traceback, and on Python 3.11+ a note giving the advice. ``client``
    defaults to one shared client built from the environment.
    """
    return Guard(
        dependency,
        client=client,
        fallback=fallback,
        max_attempts=max_attempts,
        run_id=run_id,
        admit=admit,
        credential=credential,
        priority=priority,
        tokens=tokens,
        max_admit_wait_s=max_admit_wait_s,
    )
