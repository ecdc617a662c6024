"""What an RL iteration draws at random, each keyed by (seed, iteration, round) alone, so that a
run resumed from a checkpoint draws what the uninterrupted run drew: its prompts, its reward
tokens (`TokenDraw`, the same program the fused step runs for the next iteration), the sampler's
seed and the shuffled-reward control's permutation."""

from __future__ import annotations

import ml_collections
import numpy as np

from rcgrpo_jax.envs.entries import Entry
from rcgrpo_jax.envs.reward_tokens import HIGH, NONE
from rcgrpo_jax.rl.advantages import TokenDraw, draw_reward_tokens_jit


def token_draw(algo: str, rl: ml_collections.ConfigDict, seed: int) -> TokenDraw:
    """The run's reward-token assignment (GRPO: every row `rl.grpo_token`)."""
    fixed = (HIGH if rl.grpo_token == "high" else NONE) if algo == "grpo" else None
    return TokenDraw(
        seed=int(seed), num_groups=int(rl.num_prompts), group_size=int(rl.group_size),
        p_high=float(rl.p_high), stratified=bool(rl.stratified), fixed=fixed,
    )  # fmt: skip


def reward_tokens_for(
    draw: TokenDraw, iteration: int, num: int | None = None, rnd: int = 0
) -> np.ndarray:
    """[num (default P), G] reward tokens of one iteration's round `rnd`, drawn on the host by
    the program the fused step runs for the next iteration's (the draw's values as inputs, as
    there: one program for every arm)."""
    num = None if num == draw.num_groups else num  # one program for P groups
    return np.asarray(draw_reward_tokens_jit(draw.shape(), iteration, rnd, num, draw.inputs()))


def prompts_for(
    pool: list[Entry],
    num: int,
    seed: int,
    iteration: int,
    rnd: int = 0,
    drawn: frozenset = frozenset(),
) -> list[Entry]:
    """`num` training entries of one iteration's round `rnd`, without replacement within the
    iteration: a later round draws from the entries not `drawn` before (all, if too few)."""
    rng = np.random.default_rng([seed, iteration] if rnd == 0 else [seed, iteration, rnd])
    fresh = [e for e in pool if e.id not in drawn]
    pool = fresh if len(fresh) >= num else pool
    return [pool[i] for i in rng.choice(len(pool), size=num, replace=len(pool) < num)]


def rollout_seed(seed: int, iteration: int, rnd: int = 0) -> int:
    """The sampler's seed for one iteration's round `rnd`."""
    if rnd == 0:
        return seed * 1_000_003 + iteration
    return int(np.random.SeedSequence([seed, iteration, rnd]).generate_state(1)[0])


def shuffled(rewards: np.ndarray, seed: int, iteration: int) -> np.ndarray:
    """`rewards` [n, G] permuted across all n x G rollouts (`rl.shuffle_rewards`, the control):
    the batch's reward distribution kept, its link to the trajectories broken."""
    rng = np.random.default_rng([seed, iteration, 0x5EED])
    return rng.permutation(rewards.reshape(-1)).reshape(rewards.shape)
