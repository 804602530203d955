"""The console's SVG charts: well-formed XML whatever the names in them, nothing a strict
Content-Security-Policy refuses (no script, no event attribute, no style attribute, no
reference outside the markup), and readable without colour (words for every series)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from supervisor.act.store_rows import IncidentCounts, KindCounts
from supervisor.forward.breaker_history import BreakerTimeline, Transition
from supervisor.ui.charts import breaker_strip, incidents_chart, text

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0
HOSTILE = [
    "<script>alert(1)</script>",
    '"onload="alert(1)',
    "' onmouseover='x",
    "]]><script>x</script>",
    "&amp;&lt;&#0;",
    "ctl\x00\x01\x1b\ud800end",
    "javascript:alert(1)",
    'x" style="fill:red',
    "url(http://evil.example/x.svg)",
]


def parse(markup: str) -> ET.Element:
    root = ET.fromstring(markup)  # raises on anything not well-formed
    assert root.tag == f"{SVG}svg"
    return root


def assert_safe(root: ET.Element) -> None:
    for element in root.iter():
        local = element.tag.removeprefix(SVG)
        assert element.tag.startswith(SVG), element.tag  # nothing outside SVG
        assert local not in {"script", "foreignObject", "style", "a", "image", "use", "iframe"}
        for name, value in element.attrib.items():
            bare = name.rsplit("}", 1)[-1].lower()
            assert not bare.startswith("on"), (local, name)
            assert bare not in {"style", "href", "src"}, (local, name)
            if bare == "aria-label":
                continue  # words for a screen reader, never fetched nor run
            for found in re.findall(r"url\(([^)]*)\)", value):
                assert found.startswith("#"), value  # only this markup's own patterns
            assert "javascript:" not in value.lower()


def words(root: ET.Element) -> str:
    return " ".join("".join(e.itertext()) for e in root.iter(f"{SVG}text"))


def counts(*series: tuple[str, str, tuple[int, ...]], complete: bool = True) -> IncidentCounts:
    buckets = len(series[0][2]) if series else 4
    return IncidentCounts(
        T0, 3600.0, buckets, tuple(KindCounts(c, k, n) for c, k, n in series), complete
    )


@pytest.mark.parametrize("name", HOSTILE)
def test_the_incidents_chart_is_well_formed_and_inert_whatever_the_class_and_kind(
    name: str,
) -> None:
    markup = incidents_chart(
        counts((name, name, (1, 0, 3, 2)), ("transient", "timeout", (0, 2, 0, 1))),
        chart_id=name,
    )
    root = parse(markup)
    assert_safe(root)
    assert "<script" not in markup.lower()
    legend = words(root)
    shown = name.replace("\x00", "\ufffd").replace("\x01", "\ufffd").replace("\x1b", "\ufffd")
    shown = shown.replace("\ud800", "\ufffd")
    assert f"{shown} / {shown}" in legend  # the name is shown, as text
    assert "transient / timeout (3)" in legend
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", root.attrib["id"])


def test_the_incidents_chart_says_what_it_shows_in_words() -> None:
    root = parse(
        incidents_chart(
            counts(("transient", "rate_limit", (5, 0, 1, 0)), ("permanent", "auth", (0, 1, 0, 0)))
        )
    )
    assert root.attrib["role"] == "img"
    assert root.attrib["id"] == "incidents-chart"
    assert "7 incidents" in root.attrib["aria-label"]
    title = root.find(f"{SVG}title")
    assert title is not None and "Incidents by class and kind" in "".join(title.itertext())
    desc = root.find(f"{SVG}desc")
    assert desc is not None and "transient / rate_limit: 6" in "".join(desc.itertext())
    # Each bar segment carries its figures; the legend names each series (not colour alone).
    segments = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(segments) == 3
    assert all(r.attrib["fill"].startswith("url(#incidents-chart-p") for r in segments)
    assert "permanent / auth (1)" in words(root)
    # The patterns differ between series: told apart in grey.
    fills = {r.attrib["fill"] for r in segments}
    assert len(fills) == 2


def test_series_past_the_room_are_summed_as_other_and_a_bounded_count_says_so() -> None:
    many = [("transient", f"kind{n}", (n + 1, 0)) for n in range(12)]
    root = parse(incidents_chart(counts(*many, complete=False), max_series=4))
    legend = words(root)
    assert "other (9 classes and kinds)" in legend
    assert "Only the newest incidents were counted" in legend
    assert_safe(root)


def test_an_empty_window_says_there_is_nothing() -> None:
    root = parse(incidents_chart(counts()))
    assert "No incidents in this window." in words(root)
    assert "No incidents" in root.attrib["aria-label"]


def test_text_escapes_for_attributes_and_elements_and_drops_what_xml_cannot_hold() -> None:
    assert text('<a href="x">\'&') == "&lt;a href=&quot;x&quot;&gt;&apos;&amp;"
    assert text("a\x00b") == "a\ufffdb"
    assert text("x" * 10, limit=4) == "xxx\u2026"


# -- a breaker's strip --------------------------------------------------------------


def timeline(dependency: str, *changes: Transition, state: str = "half_open") -> BreakerTimeline:
    return BreakerTimeline(dependency, T0, T0 + 6 * 3600, state, T0 + 600, changes)


@pytest.mark.parametrize("name", HOSTILE)
def test_the_breaker_strip_is_well_formed_and_inert_whatever_the_dependency_and_reason(
    name: str,
) -> None:
    strip = timeline(
        name,
        Transition(T0 + 3600, "closed", "open", name),
        Transition(T0 + 3 * 3600, "open", "half_open", "reset_timeout"),
    )
    markup = breaker_strip(strip)
    root = parse(markup)
    assert_safe(root)
    assert re.fullmatch(r"breaker-strip-[0-9a-f]{12}", root.attrib["id"])
    assert root.attrib["role"] == "img"
    assert "<script" not in markup.lower()


def test_the_breaker_strip_names_each_state_and_each_change() -> None:
    strip = timeline(
        "tool:search",
        Transition(T0 + 3600, "closed", "open", "failures"),
        Transition(T0 + 3 * 3600, "open", "half_open", "reset_timeout"),
    )
    root = parse(breaker_strip(strip, strip_id="b1"))
    assert words(root) == "closed open half-open 11-14 22:13 UTC now: half-open"
    # Each stretch says what and when (the first, before the sidecar knew, is too narrow
    # for its name in the strip).
    stretches = [
        "".join(title.itertext())
        for rect in root.iter(f"{SVG}rect")
        if (title := rect.find(f"{SVG}title")) is not None
    ]
    assert stretches == [
        "not known here from 11-14 22:13 to 11-14 22:23 UTC",
        "closed from 11-14 22:23 to 11-14 23:13 UTC",
        "open from 11-14 23:13 to 11-15 01:13 UTC",
        "half-open from 11-15 01:13 to 11-15 04:13 UTC",
    ]
    changes = [e for e in root.iter(f"{SVG}line") if e.find(f"{SVG}title") is not None]
    said = ["".join(e.itertext()) for e in changes]
    assert said == [
        "11-14 23:13 UTC: closed to open (failures)",
        "11-15 01:13 UTC: open to half-open (reset_timeout)",
    ]
    label = root.attrib["aria-label"]
    assert label.startswith("Circuit breaker tool:search: half-open now; 2 changes seen")


def test_two_strips_on_one_page_never_share_a_pattern_id() -> None:
    a = parse(breaker_strip(timeline("tool:a")))
    b = parse(breaker_strip(timeline("tool:b")))
    assert not ids(a) & ids(b)


def ids(root: ET.Element) -> set[str]:
    return {e.attrib["id"] for e in root.iter() if "id" in e.attrib}


@pytest.mark.parametrize(
    ("busiest", "axis"),
    [(0, "0 1 2"), (3, "0 2 4"), (5, "0 3 6"), (24, "0 15 30"), (150, "0 100 200")],
)
def test_the_value_axis_ends_on_a_round_number_with_a_whole_half(busiest: int, axis: str) -> None:
    root = parse(incidents_chart(counts(("transient", "timeout", (busiest, 0)))))
    assert words(root).startswith(axis)
