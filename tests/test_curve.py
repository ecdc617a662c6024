"""The cost curve (`rl.curve`): budget points, the curve read from metrics records, its area,
the measurement standing for a budget point, trajectories to reach a success, the ratio."""

from __future__ import annotations

import math

import pytest

from rcgrpo_jax.rl.curve import Curve, Point, budget_points, ratio, reached


def test_budget_points_are_even_and_end_at_the_budget():
    assert budget_points(2048, 4) == (512, 1024, 1536, 2048)
    assert budget_points(100, 3) == (34, 67, 100)  # ceil(k * 100 / 3)
    assert budget_points(5, 1) == (5,)
    with pytest.raises(ValueError, match="budget_points"):
        budget_points(0, 4)
    points = (512, 1024, 1536, 2048)
    assert [reached(points, n) for n in (0, 511, 512, 1600, 4096)] == [0, 0, 1, 3, 4]


def _records():
    """An RL run's metrics: the start, then iterations of 256 trajectories (the first two
    without an evaluation), as stages.rl writes them."""
    return [
        {"step": 0, "eval_success": 0.5, "rollouts": 0, "budget_point": 0},
        {"step": 1, "generated_rollouts": 256.0, "rollouts": 256},
        {"step": 2, "generated_rollouts": 256.0, "rollouts": 512, "eval_success": 0.6,
         "budget_point": 1},
        {"step": 3, "generated_rollouts": 256.0, "rollouts": 768},
        {"step": 4, "generated_rollouts": 192.0, "rollouts": 960, "eval_success": 0.55,
         "budget_point": 2},
    ]  # fmt: skip


def test_curve_from_records_and_its_area():
    c = Curve.from_records(_records(), budget=1024)
    assert c.points == (Point(0, 0.5, 0), Point(512, 0.6, 1), Point(960, 0.55, 2))
    assert c.final == 0.55
    # by hand: trapezoids 512 * 0.55 + 448 * 0.575, then 0.55 held from 960 to the budget 1024
    area = (512 * 0.55 + 448 * 0.575 + 64 * 0.55) / 1024
    assert c.area() == pytest.approx(area)
    assert Curve.from_dict(c.to_dict()) == c
    # a run older than the cumulative count: the running sum of generated_rollouts
    old = [{k: v for k, v in r.items() if k not in ("rollouts", "budget_point")}
           for r in _records()]  # fmt: skip
    c_old = Curve.from_records(old, budget=1024)
    assert [p.rollouts for p in c_old.points] == [0, 512, 960]
    assert [p.budget_point for p in c_old.points] == [0, -1, -1]
    # no measurement at the start: no area
    assert Curve.from_records(_records()[1:], budget=1024).area() is None
    # a periodic measurement between budget points (rl.eval_every, budget_point -1) is in the
    # curve but not in the area: arms of other iteration counts share the area's grid
    periodic = [*_records()[:4], {**_records()[3], "eval_success": 0.9, "budget_point": -1},
                _records()[4]]  # fmt: skip
    c_p = Curve.from_records(periodic, budget=1024)
    assert len(c_p.points) == 4 and c_p.area() == pytest.approx(area)


def test_point_lookup_and_trajectories_to_reach():
    c = Curve(2048, (Point(0, 0.5, 0), Point(600, 0.55, 1), Point(1280, 0.7, 3),
                     Point(2040, 0.65, 4)))  # fmt: skip
    assert c.at(0).rollouts == 0 and c.at(1).rollouts == 600
    assert c.at(2) == c.at(3) == Point(1280, 0.7, 3)  # one iteration crossed two points
    assert c.at(4).success == 0.65 and c.at(5) is None
    assert c.to_reach(0.5) == 0 and c.to_reach(0.6) == 1280 and c.to_reach(0.71) is None
    assert c.to_reach(0.7) == 1280  # reached exactly counts


def test_ratio():
    assert ratio(2048, 512) == 4.0 and ratio(512, 2048) == 0.25
    assert ratio(None, 512) is None and ratio(512, None) is None
    assert ratio(0, 0) is None and math.isinf(ratio(512, 0))
