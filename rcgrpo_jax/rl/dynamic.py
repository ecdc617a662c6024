"""Dynamic sampling (DAPO): train only on groups whose rewards differ, drawing more to fill.

A group whose rewards are all equal has zero advantage, so it adds no gradient, only dilutes
the batch. `fill_groups` rolls out rounds of prompts until enough informative groups are in
hand, within a cap on rounds and a budget of generated trajectories. It knows nothing of models:
`draw(round, n)` is whatever produces n groups (the RL stage: a rollout; tests: fake rewards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

from rcgrpo_jax.rl.advantages import degenerate_groups


class HasRewards(Protocol):
    rewards: np.ndarray  # [n, G]


R = TypeVar("R", bound=HasRewards)


@dataclasses.dataclass(frozen=True)
class Filled(Generic[R]):
    rounds: list[R]  # what each round's draw returned
    trained: list[np.ndarray]  # per round, [n] bool: the groups that go into the update
    generated: int  # trajectories generated over all rounds

    @property
    def num_trained(self) -> int:
        return int(sum(t.sum() for t in self.trained))


def fill_groups(
    draw: Callable[[int, int], R],
    num_groups: int,
    group_size: int,
    *,
    budget: int,
    dynamic: bool,
    max_rounds: int = 4,
    multiple_of: int = 1,
) -> Filled[R]:
    """Rounds of `draw(round, n)` until `num_groups` groups are kept or a limit is hit.

    Without `dynamic`: one round of `num_groups` groups, every group kept. With it: the
    degenerate groups of each round are dropped and the next round draws as many groups as are
    still missing, for at most `max_rounds` rounds. No round generates past `budget`
    trajectories (it draws fewer groups, or none). The kept groups are then cut to a multiple of
    `multiple_of` (an update needs the same whole number of groups in every minibatch), the
    last-drawn dropped first."""
    rounds: list[R] = []
    keep: list[np.ndarray] = []
    kept = generated = 0
    for r in range(max_rounds if dynamic else 1):
        n = min(num_groups - kept, (budget - generated) // group_size)
        if n <= 0:
            break
        out = draw(r, n)
        if np.shape(out.rewards) != (n, group_size):
            raise ValueError(f"draw({r}, {n}) gave rewards of shape {np.shape(out.rewards)}")
        generated += n * group_size
        mask = ~np.asarray(degenerate_groups(out.rewards)) if dynamic else np.ones(n, bool)
        rounds.append(out)
        keep.append(mask)
        kept += int(mask.sum())
    excess = kept % multiple_of
    for mask in reversed(keep):
        while excess and mask.any():
            mask[np.flatnonzero(mask)[-1]] = False
            excess -= 1
    return Filled(rounds, keep, generated)
