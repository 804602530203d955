"""supervisor.retry_after: every form of "wait this long" that servers write, read one way."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.retry_after import (
    MAX_PROVIDER_DELAY_S,
    MAX_RETRY_AFTER_S,
    RETRY_HEADERS,
    parse_duration,
    parse_retry_after,
    retry_after_from_headers,
    retry_after_from_text,
)

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def delay_from(values: Mapping[str, str | list[str]]) -> float | None:
    def lookup(name: str) -> Iterable[str]:
        value = values.get(name, [])
        return [value] if isinstance(value, str) else value

    return retry_after_from_headers(lookup, now=NOW)


# -- units -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5", 1.5),
        ("20ms", 0.02),
        ("20 milliseconds", 0.02),
        ("1m3s", 63.0),
        ("1m30s", 90.0),
        ("6m0s", 360.0),  # OpenAI's x-ratelimit-reset-tokens, as Go prints a Duration
        ("1h2m3.5s", 3723.5),
        ("250µs", 0.00025),
        ("100ns", 1e-7),
        ("20 seconds", 20.0),
        ("2 minutes", 120.0),
        ("3 hrs", 10_800.0),
        ("7s.", 7.0),
        ("", None),
        ("soon", None),
        ("-5s", None),
        ("25h", None),  # over a day: not a hint
        ("5xs", None),
        ("5 apples", 5.0),  # a bare number ends the duration
    ],
)
def test_parse_duration(text: str, expected: float | None) -> None:
    got = parse_duration(text)
    assert got == (expected if expected is None else pytest.approx(expected))


def test_a_date_without_a_zone_is_gmt() -> None:
    # RFC 9110's obsolete asctime form carries no zone; HTTP dates are GMT.
    assert parse_retry_after("Wed Jan  1 12:00:30 2025", now=NOW) == 30.0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:10 -0000", now=NOW) == 10.0
    assert parse_retry_after("2025-01-01T12:01:00Z", now=NOW) == 60.0


def test_headers_prefer_retry_after_ms_then_retry_after_then_the_longest_reset() -> None:
    assert delay_from({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert delay_from({"retry-after-ms": "soon", "retry-after": "9"}) == 9.0
    assert delay_from({"retry-after": "Wed, 01 Jan 2025 12:00:10 GMT"}) == 10.0
    resets = {"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"}
    assert delay_from(resets) == 360.0
    assert delay_from({"anthropic-ratelimit-tokens-reset": "2025-01-01T12:00:30Z"}) == 30.0
    # The first text that reads as a delay counts; blank ones are skipped.
    assert delay_from({"retry-after": ["  ", "garbage", "4"]}) == 4.0
    assert delay_from({"retry-after": "garbage"}) is None
    assert delay_from({}) is None


def test_hints_in_words() -> None:
    assert retry_after_from_text("Rate limit reached. Please try again in 1.5s. Visit x") == 1.5
    assert retry_after_from_text("Please retry after 20 seconds.") == 20.0
    assert retry_after_from_text("RETRYING IN 2 MINUTES") == 120.0
    assert retry_after_from_text("retry_after=250ms") == 0.25
    assert retry_after_from_text("try again later, or retry in 3s") == 3.0
    assert retry_after_from_text("try again later") is None
    assert retry_after_from_text("İstanbul says: try again in 4s") == 4.0  # not ASCII


# -- properties --------------------------------------------------------------------

_NUMBERS = st.integers(min_value=0, max_value=10**15)
_TIMES = st.floats(min_value=0, max_value=4e9, allow_nan=False)
_HEADER_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789.:-+ msuhTZ,GMTWedJan", max_size=30),
    _NUMBERS.map(str),
)


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.none(), _HEADER_TEXT), now=_TIMES)
def test_parse_retry_after_never_raises_and_stays_within_the_cap(
    value: str | None, now: float
) -> None:
    delay = parse_retry_after(value, now=now)
    assert delay is None or 0.0 <= delay <= MAX_RETRY_AFTER_S


@settings(max_examples=200, deadline=None)
@given(seconds=_NUMBERS, pad=st.sampled_from(["", " ", "\t", "  "]))
def test_delta_seconds_round_trip_up_to_the_cap(seconds: int, pad: str) -> None:
    assert parse_retry_after(f"{pad}{seconds}{pad}") == min(float(seconds), MAX_RETRY_AFTER_S)


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(min_value=-(10**7), max_value=10**7), now=st.integers(0, 4 * 10**9))
def test_http_dates_round_trip_clamped_to_now_and_the_cap(offset: int, now: int) -> None:
    when = datetime.fromtimestamp(now + offset, timezone.utc)
    delay = parse_retry_after(format_datetime(when, usegmt=True), now=float(now))
    assert delay == min(max(float(offset), 0.0), MAX_RETRY_AFTER_S)


@settings(max_examples=300, deadline=None)
@given(text=_HEADER_TEXT)
def test_durations_and_hints_never_raise_and_stay_within_a_day(text: str) -> None:
    for delay in (parse_duration(text), retry_after_from_text(text)):
        assert delay is None or 0.0 <= delay <= MAX_PROVIDER_DELAY_S
    duration = parse_duration(text)
    if duration is not None:
        assert retry_after_from_text(f"Please try again in {text}") == duration


@settings(max_examples=200, deadline=None)
@given(
    hours=st.integers(0, 23),
    minutes=st.integers(0, 59),
    millis=st.integers(0, 59_999),
)
def test_go_durations_round_trip(hours: int, minutes: int, millis: int) -> None:
    """As Go's ``time.Duration.String`` prints them: ``1h2m3.5s``, ``6m0s``, ``250ms``."""
    seconds = millis / 1000
    if hours:
        text = f"{hours}h{minutes}m{seconds:g}s"
    elif minutes:
        text = f"{minutes}m{seconds:g}s"
    elif millis >= 1000 or millis == 0:
        text = f"{seconds:g}s"
    else:
        text = f"{millis}ms"
    expected = hours * 3600 + minutes * 60 + seconds
    parsed = parse_duration(text)
    assert parsed is not None and math.isclose(parsed, expected, abs_tol=1e-9), text


@settings(max_examples=200, deadline=None)
@given(
    values=st.dictionaries(
        st.sampled_from([name for name, _ in RETRY_HEADERS]), st.lists(_HEADER_TEXT, max_size=3)
    ),
    now=_TIMES,
)
def test_headers_never_raise_and_stay_within_a_day(
    values: dict[str, list[str]], now: float
) -> None:
    delay = retry_after_from_headers(lambda name: values.get(name, []), now=now)
    assert delay is None or 0.0 <= delay <= MAX_PROVIDER_DELAY_S


def test_a_date_far_ahead_is_capped() -> None:
    far = format_datetime(datetime.fromtimestamp(NOW, timezone.utc) + timedelta(days=30))
    assert parse_retry_after(far, now=NOW) == MAX_RETRY_AFTER_S
    assert delay_from({"retry-after": far}) == MAX_PROVIDER_DELAY_S
