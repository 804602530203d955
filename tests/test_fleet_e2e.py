"""A fleet of three real sidecars under hopping agents, a ``kill -9`` and Redis away.

A smaller run of ``bench/fleet.py``'s scenario (its harness, imported): nine
runs whose sessions hop between three ``spanvisor run`` processes on one
PostgreSQL schema and one Redis namespace; 503s retried, 401s escalated and
approved once each through a random live sidecar, timeouts remediated after a
durable sleep; two more runs loop, their repeated tool call spread over the
sidecars. Redis is cut off for a while; one sidecar is killed while it
holds sleeping remediations and deliveries in flight, and never restarted.
The scenario runs once (a module fixture); each test asserts one goal, with
every figure in its message. What "recoverable" means is in ``bench/fleet.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench._fleet_figures import Figures
from bench.fleet import Plan, run_fleet
from tests.postgres import fresh_schema

pytestmark = pytest.mark.slow

PLAN = Plan(runs=9, loops=2, steps=4, outage_at_s=1.0, outage_s=4.0, kill_at_s=2.0, settle_s=20.0)
#: A dead sidecar is noticed after ``dead_after_s``; its work must move within a few more.
TAKEOVER_BOUND_S = PLAN.dead_after_s + PLAN.remediate_delay_s + 4.0


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Figures]:
    with fresh_schema() as url:
        found = run_fleet(PLAN, tmp_path_factory.mktemp("fleet"), url)
    print("\n".join(found.lines()))
    yield found


def said(figures: Figures) -> str:
    return "\n".join(figures.lines())


def test_every_recoverable_run_completes(figures: Figures) -> None:
    assert figures.recoverable >= PLAN.runs - 2, said(figures)
    assert figures.completed == figures.recoverable, said(figures)


def test_no_command_reaches_an_agent_twice(figures: Figures) -> None:
    assert figures.deliveries > 0, said(figures)
    assert figures.unsigned == 0, said(figures)
    assert figures.duplicates == 0, said(figures)


def test_each_escalation_has_one_approval_answered_once(figures: Figures) -> None:
    assert figures.escalations > 0, said(figures)
    assert figures.approvals_per_escalation == {1: figures.escalations}, said(figures)
    assert figures.answers_per_approval == {1: figures.escalations}, said(figures)
    assert figures.answer_conflicts == 0, said(figures)


def test_no_decision_is_lost_while_redis_is_away(figures: Figures) -> None:
    assert figures.outage_failures > 0, said(figures)  # the scenario sent some then
    assert figures.outage_lost == 0, said(figures)


def test_the_killed_sidecars_remediations_are_taken_over(figures: Figures) -> None:
    assert figures.held_remediations > 0, said(figures)  # it was killed holding some
    assert figures.remediation_takeover_s is not None, said(figures)
    assert figures.remediation_takeover_s <= TAKEOVER_BOUND_S, said(figures)


def test_the_killed_sidecars_deliveries_in_flight_are_taken_over(figures: Figures) -> None:
    if figures.held_deliveries == 0:
        pytest.skip(f"no delivery was in flight at the kill\n{said(figures)}")
    assert figures.delivery_takeover_s is not None, said(figures)
    assert figures.delivery_takeover_s <= TAKEOVER_BOUND_S, said(figures)


def test_a_loop_spread_over_the_sidecars_is_caught(figures: Figures) -> None:
    assert figures.loops == PLAN.loops, said(figures)
    assert figures.loops_caught == figures.loops, said(figures)
