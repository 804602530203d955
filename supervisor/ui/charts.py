"""The console's charts, drawn on the server as SVG markup (a ``str``) for inline use.

Why server-side: the pages work without JavaScript, and the console's
Content-Security-Policy allows no inline script or style. So the markup has
no ``<script>``, no event attributes, no ``style`` attributes (SVG
presentation attributes instead), and no reference outside itself (patterns
are ``url(#id)`` within the same markup). Every name in it (a failure kind,
a dependency) comes from spans: it goes through :func:`text`, an XML escape
that also drops what XML cannot hold, and is never anything but text.

Readable without colour: each series has a pattern as well as a hue, the
legend names every one, each bar and segment carries a ``<title>`` with its
figures, and the whole chart a ``<title>`` and ``<desc>`` (``role="img"``,
``aria-label``) that say what it shows in words.

Ids inside a chart start with the chart's own id, so two charts on one page
never share a pattern.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from xml.sax.saxutils import escape

from supervisor.act.store_rows import IncidentCounts, KindCounts
from supervisor.forward.breaker_history import BreakerTimeline

__all__ = ["breaker_strip", "incidents_chart", "text"]

#: Characters XML 1.0 cannot hold at all (escaping does not help): replaced.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
#: What an id may hold (the caller's, and the patterns' made from it).
_NOT_ID = re.compile(r"[^A-Za-z0-9_-]")
#: Longest name shown in a legend or a label (the ``<title>`` holds more).
_LABEL_CHARS = 48
_TITLE_CHARS = 300
_FONT = 'font-family="sans-serif"'


def text(value: object, limit: int = _TITLE_CHARS) -> str:
    """``value`` as XML text or attribute value: escaped, shortened to ``limit`` characters."""
    found = _NOT_XML.sub("\ufffd", str(value))
    if len(found) > limit:
        found = found[: limit - 1] + "\u2026"
    return escape(found, {'"': "&quot;", "'": "&apos;"})


def _id(value: str) -> str:
    found = _NOT_ID.sub("-", value)[:64]
    return found if found[:1].isalpha() else f"c-{found}"


def _num(value: float) -> str:
    """A coordinate: short, and never ``nan`` or ``inf`` (which would not parse)."""
    if not math.isfinite(value):
        value = 0.0
    return f"{value:.2f}".rstrip("0").rstrip(".") or "0"


def _clock(at: float, with_day: bool = False) -> str:
    moment = datetime.fromtimestamp(at, tz=timezone.utc)
    return moment.strftime("%m-%d %H:%M" if with_day else "%H:%M")


# -- fills that differ in grey as well as in hue -----------------------------------

#: (background, ink, pattern) per series: the pattern tells series apart without colour.
_SERIES_FILLS: tuple[tuple[str, str, str], ...] = (
    ("#4e79a7", "#1b2a3a", "solid"),
    ("#f28e2b", "#5a3000", "diagonal"),
    ("#e15759", "#4a0f10", "dots"),
    ("#76b7b2", "#1d3d3a", "cross"),
    ("#59a14f", "#173312", "horizontal"),
    ("#edc948", "#4d3d00", "vertical"),
    ("#b07aa1", "#3b1f33", "back-diagonal"),
    ("#9c755f", "#2e1d14", "checks"),
)
#: The fill of the series that sums those past the chart's room.
_OTHER_FILL = ("#d0d0d0", "#303030", "grid")


def _pattern(pattern_id: str, background: str, ink: str, kind: str) -> str:
    marks = {
        "solid": "",
        "diagonal": f'<path d="M0 6L6 0M-1 1L1 -1M5 7L7 5" stroke="{ink}" stroke-width="1.2"/>',
        "back-diagonal": f'<path d="M0 0L6 6M5 -1L7 1M-1 5L1 7" stroke="{ink}"'
        ' stroke-width="1.2"/>',
        "dots": f'<circle cx="3" cy="3" r="1.3" fill="{ink}"/>',
        "cross": f'<path d="M0 6L6 0M0 0L6 6" stroke="{ink}" stroke-width="0.8"/>',
        "horizontal": f'<path d="M0 3H6" stroke="{ink}" stroke-width="1.2"/>',
        "vertical": f'<path d="M3 0V6" stroke="{ink}" stroke-width="1.2"/>',
        "checks": f'<rect width="3" height="3" fill="{ink}"/><rect x="3" y="3" width="3"'
        f' height="3" fill="{ink}"/>',
        "grid": f'<path d="M0 0.5H6M0.5 0V6" stroke="{ink}" stroke-width="0.6"/>',
    }[kind]
    return (
        f'<pattern id="{pattern_id}" width="6" height="6" patternUnits="userSpaceOnUse">'
        f'<rect width="6" height="6" fill="{background}"/>{marks}</pattern>'
    )


# -- incidents by class and kind over time ------------------------------------------


def incidents_chart(
    counts: IncidentCounts,
    *,
    chart_id: str = "incidents-chart",
    width: int = 720,
    height: int = 220,
    max_series: int = 8,
) -> str:
    """Stacked bars, one per bucket, of incidents by class and kind, with a legend.

    The ``max_series - 1`` pairs with most incidents are drawn apart, the
    others summed as one "other" series (the legend says how many pairs it
    sums). Times are UTC.
    """
    cid = _id(chart_id)
    max_series = max(1, min(max_series, len(_SERIES_FILLS)))
    series, folded = _fold(counts.series, max_series)
    totals = counts.bucket_totals()
    top = _nice_ceiling(max(totals, default=0))
    left, right, top_pad, axis_h = 44.0, 8.0, 10.0, 30.0
    plot_w, plot_h = width - left - right, float(height) - top_pad - axis_h
    bar_w = plot_w / counts.buckets
    legend_rows = len(series) if series else 1
    full_h = height + 8 + legend_rows * 18 + (18 if not counts.complete else 0)
    span = f"{_clock(counts.start, True)} to {_clock(counts.end, True)} UTC"
    summary = _summary(counts, series, span)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{cid}" role="img"'
        f' viewBox="0 0 {width} {full_h}" width="{width}" height="{full_h}"'
        f' aria-labelledby="{cid}-title {cid}-desc" aria-label="{text(summary)}">',
        f'<title id="{cid}-title">Incidents by class and kind, {text(span)}</title>',
        f'<desc id="{cid}-desc">{text(summary, 2000)}</desc>',
        "<defs>",
    ]
    fills = [*_SERIES_FILLS[: len(series) - (1 if folded else 0)]]
    if folded:
        fills.append(_OTHER_FILL)
    for n, (background, ink, kind) in enumerate(fills):
        parts.append(_pattern(f"{cid}-p{n}", background, ink, kind))
    parts.append("</defs>")

    # The value axis: 0, half and the top, with grid lines.
    for fraction in (0.0, 0.5, 1.0):
        y = top_pad + plot_h * (1 - fraction)
        parts.append(
            f'<line x1="{_num(left)}" y1="{_num(y)}" x2="{_num(width - right)}" y2="{_num(y)}"'
            f' stroke="#bbbbbb" stroke-width="0.5"/>'
            f'<text x="{_num(left - 4)}" y="{_num(y + 4)}" text-anchor="end" font-size="11"'
            f' {_FONT} fill="#222222">{_num(top * fraction)}</text>'
        )
    # The bars.
    for b in range(counts.buckets):
        x = left + b * bar_w
        y = top_pad + plot_h
        at, until = counts.start + b * counts.bucket_s, counts.start + (b + 1) * counts.bucket_s
        when = f"{_clock(at, True)} to {_clock(until)} UTC"
        parts.append(f"<g><title>{text(f'{totals[b]} incidents, {when}')}</title>")
        for n, (label, values) in enumerate(series):
            value = values[b]
            if not value:
                continue
            h = plot_h * value / top
            y -= h
            parts.append(
                f'<rect x="{_num(x + 1)}" y="{_num(y)}" width="{_num(max(bar_w - 2, 1))}"'
                f' height="{_num(h)}" fill="url(#{cid}-p{n})" stroke="#222222"'
                f' stroke-width="0.5"><title>{text(f"{label}: {value}, {when}")}</title></rect>'
            )
        parts.append("</g>")
    # The time axis: a label every few buckets, so they never overlap.
    parts.append(
        f'<line x1="{_num(left)}" y1="{_num(top_pad + plot_h)}" x2="{_num(width - right)}"'
        f' y2="{_num(top_pad + plot_h)}" stroke="#222222" stroke-width="1"/>'
    )
    every = max(1, math.ceil(counts.buckets / max(1, int(plot_w // 64))))
    for b in range(0, counts.buckets, every):
        x = left + b * bar_w
        parts.append(
            f'<text x="{_num(x + 1)}" y="{_num(top_pad + plot_h + 14)}" font-size="10"'
            f' {_FONT} fill="#222222">{text(_clock(counts.start + b * counts.bucket_s))}</text>'
        )
    parts.append(
        f'<text x="{_num(width - right)}" y="{_num(top_pad + plot_h + 27)}" text-anchor="end"'
        f' font-size="10" {_FONT} fill="#444444">UTC, {text(_duration(counts.bucket_s))}'
        " per bar</text>"
    )
    # The legend: a swatch and the words for each series.
    y = float(height) + 8
    if not series:
        parts.append(
            f'<text x="{_num(left)}" y="{_num(y + 12)}" font-size="12" {_FONT}'
            ' fill="#222222">No incidents in this window.</text>'
        )
    for n, (label, values) in enumerate(series):
        parts.append(
            f'<rect x="{_num(left)}" y="{_num(y)}" width="14" height="14"'
            f' fill="url(#{cid}-p{n})" stroke="#222222" stroke-width="0.5"/>'
            f'<text x="{_num(left + 20)}" y="{_num(y + 11)}" font-size="12" {_FONT}'
            f' fill="#222222">{text(label, _LABEL_CHARS + 20)} ({sum(values)})</text>'
        )
        y += 18
    if not counts.complete:
        parts.append(
            f'<text x="{_num(left)}" y="{_num(y + 12)}" font-size="11" {_FONT} fill="#222222">'
            "Only the newest incidents were counted: the window holds more.</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _fold(found: Sequence[KindCounts], room: int) -> tuple[list[tuple[str, tuple[int, ...]]], bool]:
    """(label, counts) per series drawn; past ``room``, the rest summed as "other"."""
    labelled = [(_series_label(s), s.counts) for s in found]
    if len(labelled) <= room:
        return labelled, False
    kept, rest = labelled[: room - 1], labelled[room - 1 :]
    summed = tuple(sum(column) for column in zip(*(c for _, c in rest), strict=True))
    return [*kept, (f"other ({len(rest)} classes and kinds)", summed)], True


def _series_label(series: KindCounts) -> str:
    cls = series.failure_class or "unclassified"
    return f"{cls} / {series.kind}" if series.kind else cls


def _summary(
    counts: IncidentCounts, series: Sequence[tuple[str, tuple[int, ...]]], span: str
) -> str:
    if not series:
        return f"No incidents from {span}."
    parts = ", ".join(f"{label}: {sum(values)}" for label, values in series)
    busiest = max(range(counts.buckets), key=lambda b: counts.bucket_totals()[b])
    at = _clock(counts.start + busiest * counts.bucket_s, True)
    note = "" if counts.complete else " Only the newest incidents were counted."
    return (
        f"{counts.total} incidents from {span}, in {counts.buckets} bars of"
        f" {_duration(counts.bucket_s)}; most at {at} UTC. By class and kind: {parts}.{note}"
    )


def _nice_ceiling(value: int) -> int:
    """The axis' top: a round even number at or above ``value`` (its half is a whole one)."""
    if value <= 2:
        return 2
    power = int(10 ** math.floor(math.log10(value)))
    for step in (1, 2, 3, 4, 5, 6, 8, 10):
        found = step * power
        if found >= value and found % 2 == 0:
            return found
    return value + value % 2


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


# -- a breaker's states over the last hours -------------------------------------------

#: Per state: (background, ink, pattern); open is the darkest, half-open hatched.
_STATE_FILLS: dict[str, tuple[str, str, str]] = {
    "closed": ("#e8f3e8", "#e8f3e8", "solid"),
    "half_open": ("#f6d28b", "#6b4a00", "diagonal"),
    "open": ("#d9534f", "#3a0b0a", "cross"),
    "isolated": ("#8a8a8a", "#1a1a1a", "checks"),
    "unknown": ("#ffffff", "#9a9a9a", "dots"),
}
_STATE_WORDS = {
    "closed": "closed",
    "half_open": "half-open",
    "open": "open",
    "isolated": "isolated",
    "unknown": "not known here",
}


def breaker_strip(
    timeline: BreakerTimeline,
    *,
    strip_id: str | None = None,
    width: int = 480,
    height: int = 22,
) -> str:
    """One breaker's states over its timeline's window: segments named by their state,
    a mark at each change (its ``<title>``: when, from, to, why), times below.

    ``strip_id`` defaults to one made from the dependency (the same name, the
    same id; any name, a safe one).
    """
    digest = hashlib.sha256(timeline.dependency.encode("utf-8", "replace")).hexdigest()[:12]
    sid = _id(strip_id) if strip_id is not None else f"breaker-strip-{digest}"
    left, right, label_h = 2.0, 2.0, 14.0
    plot_w = width - left - right
    full_h = height + label_h
    window = max(timeline.end - timeline.start, 1e-9)
    segments = timeline.segments()
    state_now = _STATE_WORDS.get(timeline.state, timeline.state)
    summary = (
        f"Circuit breaker {timeline.dependency}: {state_now} now;"
        f" {len(timeline.transitions)} changes seen from {_clock(timeline.start, True)}"
        f" to {_clock(timeline.end, True)} UTC. "
        + "; ".join(
            f"{_STATE_WORDS.get(s.state, s.state)} {_clock(s.start)} to {_clock(s.end)}"
            for s in segments
        )
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{sid}" role="img"'
        f' viewBox="0 0 {width} {_num(full_h)}" width="{width}" height="{_num(full_h)}"'
        f' aria-labelledby="{sid}-title" aria-label="{text(summary)}">',
        f'<title id="{sid}-title">{text(summary, 2000)}</title>',
        "<defs>",
    ]
    used = sorted({s.state for s in segments})
    for n, state in enumerate(used):
        background, ink, kind = _STATE_FILLS.get(state, _STATE_FILLS["unknown"])
        parts.append(_pattern(f"{sid}-s{n}", background, ink, kind))
    parts.append("</defs>")
    for segment in segments:
        x = left + plot_w * (segment.start - timeline.start) / window
        w = max(plot_w * (segment.end - segment.start) / window, 0.5)
        words = _STATE_WORDS.get(segment.state, segment.state)
        when = f"{words} from {_clock(segment.start, True)} to {_clock(segment.end, True)} UTC"
        parts.append(
            f'<rect x="{_num(x)}" y="0" width="{_num(w)}" height="{height}"'
            f' fill="url(#{sid}-s{used.index(segment.state)})" stroke="#444444"'
            f' stroke-width="0.5"><title>{text(when)}</title></rect>'
        )
        label = text(words, _LABEL_CHARS)
        label_w = 6.2 * len(words) + 6
        if w >= label_w + 2:  # the state's name, on a white ground: legible over any fill
            cx = x + w / 2
            parts.append(
                f'<rect x="{_num(cx - label_w / 2)}" y="{_num(height / 2 - 7)}"'
                f' width="{_num(label_w)}" height="14" rx="3" fill="#ffffff"'
                f' fill-opacity="0.85"/><text x="{_num(cx)}" y="{_num(height / 2 + 4)}"'
                f' text-anchor="middle" font-size="11" {_FONT} fill="#111111">{label}</text>'
            )
    for change in timeline.transitions:
        x = left + plot_w * (change.at - timeline.start) / window
        said = (
            f"{_clock(change.at, True)} UTC: {_STATE_WORDS.get(change.old, change.old)} to"
            f" {_STATE_WORDS.get(change.new, change.new)} ({change.reason})"
        )
        parts.append(
            f'<line x1="{_num(x)}" y1="0" x2="{_num(x)}" y2="{height}" stroke="#000000"'
            f' stroke-width="1.5"><title>{text(said)}</title></line>'
        )
    parts.append(
        f'<text x="{_num(left)}" y="{_num(full_h - 2)}" font-size="10" {_FONT}'
        f' fill="#333333">{text(_clock(timeline.start, True))} UTC</text>'
        f'<text x="{_num(width - right)}" y="{_num(full_h - 2)}" text-anchor="end"'
        f' font-size="10" {_FONT} fill="#333333">now: {text(state_now)}</text>'
    )
    parts.append("</svg>")
    return "".join(parts)
