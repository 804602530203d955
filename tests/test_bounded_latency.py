"""LatencyWindow: nearest-rank quantiles of the last samples, sorted once per new sample."""

from __future__ import annotations

from supervisor.bounded import LatencyWindow


def test_quantiles_by_nearest_rank_and_none_without_samples() -> None:
    window = LatencyWindow()
    assert window.percentile(0.5) is None
    for value in (5.0, 1.0, 4.0, 2.0, 3.0):
        window.add(value)
    assert (window.percentile(0.5), window.percentile(0.99), window.percentile(0.0)) == (
        3.0,
        5.0,
        1.0,
    )


def test_a_sample_added_after_a_scrape_counts_in_the_next() -> None:
    window = LatencyWindow(capacity=3)
    for value in (1.0, 2.0, 3.0):
        window.add(value)
    assert window.percentile(0.99) == 3.0
    window.add(10.0)  # and 1.0 leaves the window
    assert (window.percentile(0.99), window.percentile(0.0)) == (10.0, 2.0)
    assert window.count == 4
