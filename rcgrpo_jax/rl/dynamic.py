"""Dynamic sampling (DAPO): train only on groups that carry signal, drawing more to fill.

A group without signal (by the advantage estimator's rule, `rl.advantages.group_signal`: for the
group-relative ones, rewards all equal) has zero advantage, so it adds no gradient, only dilutes
the batch. `fill_groups` rolls out rounds of prompts until enough informative groups are in
hand, within a cap on rounds and a budget of generated trajectories. It knows nothing of models:
`draw(round, n)` is whatever produces n groups (the RL stage: a rollout; tests: fake rewards).
`padded_groups` then lays the k kept groups out as a batch of the usual P groups (the rest
masked), so the fused step keeps one shape and its data-parallel layout whatever k is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

from rcgrpo_jax.rl.advantages import group_signal


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
    estimator: str,
    max_rounds: int = 4,
    multiple_of: int = 1,
) -> Filled[R]:
    """Rounds of `draw(round, n)` until `num_groups` groups are kept or a limit is hit.

    Without `dynamic`: one round of `num_groups` groups, every group kept. With it: every round
    draws `num_groups` groups (one rollout shape, so one set of programs, whatever is missing),
    keeps its informative groups (those with signal under advantage estimator `estimator`) up
    to the number still missing and drops the rest, for at most `max_rounds` rounds. No round
    generates past `budget` trajectories (it draws fewer groups, or none). The kept groups are
    then cut to a multiple of `multiple_of` (an update needs the same whole number of groups in
    every minibatch), the last-drawn dropped first."""
    rounds: list[R] = []
    keep: list[np.ndarray] = []
    kept = generated = 0
    for r in range(max_rounds if dynamic else 1):
        n = min(num_groups, (budget - generated) // group_size)
        if n <= 0 or kept == num_groups:
            break
        out = draw(r, n)
        if np.shape(out.rewards) != (n, group_size):
            raise ValueError(f"draw({r}, {n}) gave rewards of shape {np.shape(out.rewards)}")
        generated += n * group_size
        mask = np.array(group_signal(estimator, out.rewards)) if dynamic else np.ones(n, bool)
        mask[np.flatnonzero(mask)[num_groups - kept :]] = False  # enough: the rest unused
        rounds.append(out)
        keep.append(mask)
        kept += int(mask.sum())
    excess = kept % multiple_of
    for mask in reversed(keep):
        while excess and mask.any():
            mask[np.flatnonzero(mask)[-1]] = False
            excess -= 1
    return Filled(rounds, keep, generated)


def padded_groups(
    trained: np.ndarray, num_groups: int, minibatches: int, microbatches: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(index [num_groups] into the drawn groups, valid [num_groups] bool): the k groups set in
    `trained` as a batch of `num_groups`, in `minibatches` equal contiguous parts that each
    start with k / minibatches trained groups; the rest of each part repeats its trained groups,
    marked not valid (the loss masks them out: `group_mask`). A part's microbatch takes its rows
    a, a + microbatches, ... (`train.state`), so every microbatch gets the same number of
    trained groups: k must be a multiple of minibatches x microbatches (`fill_groups` cuts)."""
    kept = np.flatnonzero(trained)
    k, parts = len(kept), minibatches * microbatches
    if not 0 < k <= num_groups or k % parts or num_groups % minibatches:
        raise ValueError(
            f"{k} trained groups do not fill {minibatches} minibatches x {microbatches} "
            f"microbatches of {num_groups} groups"
        )
    per, size = k // minibatches, num_groups // minibatches
    index, valid = [], []
    for c in range(minibatches):
        own = kept[c * per : (c + 1) * per]
        index += [*own, *np.resize(own, size - per)]
        valid += [True] * per + [False] * (size - per)
    return np.asarray(index), np.asarray(valid)


def padded_batch(
    batch: dict[str, np.ndarray],
    trained: np.ndarray,
    num_groups: int,
    minibatches: int,
    microbatches: int = 1,
) -> dict[str, np.ndarray]:
    """The train step's batch of `num_groups` groups from the drawn groups' `batch` (every key
    [drawn, ...]): `padded_groups`' layout, with its validity as `group_mask`."""
    index, valid = padded_groups(trained, num_groups, minibatches, microbatches)
    return {**{k: v[index] for k, v in batch.items()}, "group_mask": valid.astype(np.float32)}
