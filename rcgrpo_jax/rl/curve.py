"""Held-out success against trajectories generated: the cost curve an RL arm is judged by.

Rollouts are RL's cost (at scale most of an iteration is generation), so arms are compared at
equal numbers of generated trajectories, not at equal iterations: an arm with dynamic sampling
spends more trajectories per update, one with informative groups fewer. An RL run with
`rl.eval_points` N evaluates each time its count of generated trajectories first reaches one of
N evenly spaced budget points (`budget_points`) and records the point it stands for; a run whose
budget is spent (fewer than G trajectories left) stands for the last point, the budget, within
one rollout round. `Curve` holds those measurements and reads from them what `stages.all` and
`tools.seeds` report: the final value, the normalised area under the curve, the success at a
budget point, and the trajectories an arm needed to reach a given success.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def budget_points(budget: int, n: int) -> tuple[int, ...]:
    """`n` evenly spaced trajectory counts, the last the budget: ceil(k * budget / n), k = 1..n."""
    if budget < 1 or n < 1:
        raise ValueError(f"budget_points needs budget >= 1 and n >= 1, got {budget}, {n}")
    return tuple(-(-k * budget // n) for k in range(1, n + 1))


def reached(points: Sequence[int], generated: int) -> int:
    """How many budget points `generated` trajectories have reached (the index of the latest)."""
    return sum(p <= generated for p in points)


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: held-out success after `rollouts` generated trajectories, standing for
    budget point `budget_point` (0: the start, before any rollout; -1: none, a periodic one)."""

    rollouts: int
    success: float
    budget_point: int


@dataclasses.dataclass(frozen=True)
class Curve:
    """An arm's held-out success against trajectories generated, its start first."""

    budget: int  # the arm's budget of generated trajectories (rl.max_rollouts)
    points: tuple[Point, ...]

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]], budget: int) -> Curve:
        """The curve of an RL run's metrics.jsonl records: every record with `eval_success`,
        at its cumulative `rollouts` (absent in a record: the sum of `generated_rollouts` so
        far) and its `budget_point` (absent: the number of points it has reached is unknown,
        so 0 for the start and -1 otherwise)."""
        out, total = [], 0
        for r in records:
            total = int(r.get("rollouts", total + int(r.get("generated_rollouts") or 0)))
            s = r.get("eval_success")
            if s is None or s != s:
                continue
            point = r.get("budget_point", 0 if r.get("step") == 0 else -1)
            out.append(Point(total, float(s), int(point)))
        return cls(int(budget), tuple(out))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Curve:
        return cls(int(d["budget"]), tuple(Point(**p) for p in d["points"]))

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "points": [dataclasses.asdict(p) for p in self.points]}

    @property
    def final(self) -> float | None:
        return self.points[-1].success if self.points else None

    def area(self) -> float | None:
        """The area under success against trajectories over [0, budget], divided by the budget:
        the mean held-out success over the spend, from the start, the measurement standing for
        each budget point and the last one (trapezoids between them; after the last, its value
        held to the budget). Other measurements (periodic ones, `rl.eval_every`) are left out,
        so that arms of different iteration counts are integrated on the same grid. None
        without a measurement at the start."""
        if not self.points or self.points[0].rollouts != 0:
            return None
        grid = [self.points[0]]
        for p in self.points[1:]:
            if p.budget_point > grid[-1].budget_point or p is self.points[-1]:
                grid.append(p)
        xs = [p.rollouts for p in grid] + [max(self.budget, grid[-1].rollouts)]
        ys = [p.success for p in grid] + [grid[-1].success]
        pairs = zip(xs, xs[1:], ys, ys[1:], strict=False)
        total = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in pairs)
        return total / xs[-1] if xs[-1] else ys[0]

    def at(self, k: int) -> Point | None:
        """The measurement that stands for budget point `k`: the first taken at or after it."""
        return next((p for p in self.points if p.budget_point >= k), None)

    def to_reach(self, target: float) -> int | None:
        """Trajectories generated before held-out success first reached `target` (0: at the
        start already); None where no measurement reached it."""
        return next((p.rollouts for p in self.points if p.success >= target - 1e-12), None)


def ratio(reference: int | None, arm: int | None) -> float | None:
    """`reference` / `arm`: how many times fewer trajectories the arm needed (None where either
    did not reach, or where both reached at the start)."""
    if reference is None or arm is None or (reference == 0 and arm == 0):
        return None
    return math.inf if arm == 0 else reference / arm
