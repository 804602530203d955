"""bench/admission.py: its ideal schedule; a small fleet kept under the limit by admission."""

from __future__ import annotations

import pytest

from bench.admission import GOAL_REFUSED, SERVICES, ideal_schedule, plan_runs, play


def test_the_ideal_schedule_is_the_burst_then_the_refill() -> None:
    runs = plan_runs(6)  # one run of each service on each key
    per_key = sum(s.calls for s in SERVICES)  # 13 calls a key
    # Requests only bind: 10 go at once, then one each 6 s (10 a minute): the 13th at 18 s.
    ideal = ideal_schedule(runs, rpm=10, tpm=10**6, latency_s=0.5)
    done = ideal.done
    assert sorted(done) == [r.number for r in runs]
    assert max(done.values()) == pytest.approx((per_key - 10) * 6 + 0.5)
    # No limit binds: each run is its calls one after the other.
    assert len(ideal.accepted_at) == 2 * per_key
    free = ideal_schedule(runs, rpm=10**6, tpm=10**8, latency_s=0.5).done
    assert {free[r.number] for r in runs} == {r.service.calls * 0.5 for r in runs}


@pytest.mark.slow
def test_admission_keeps_a_small_fleet_under_the_published_limit() -> None:
    results, ideal, runs, _ = play(["admission"], n_runs=12, rpm=20, tpm=12_000, latency_s=0.2)
    (arm,) = results
    assert len(arm.ended) == len(runs) and not arm.failed
    assert arm.accepted >= sum(r.service.calls for r in runs)
    assert arm.refused_share <= GOAL_REFUSED
    assert (
        max(arm.ended.values()) >= max(ideal.done.values()) * 0.9
    )  # the limit was met, not dodged
