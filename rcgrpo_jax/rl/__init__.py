"""RL building blocks: group advantages, reward-token draws, the objectives, the fused step."""

from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.advantages import (
    TokenDraw,
    degenerate_groups,
    draw_reward_tokens,
    draw_reward_tokens_jit,
    group_advantages,
    sample_reward_tokens,
)
from rcgrpo_jax.rl.losses import OBJECTIVES, Objective, policy_loss, summarize

__all__ = [
    "HIGH",
    "LOW",
    "NONE",
    "OBJECTIVES",
    "Objective",
    "TokenDraw",
    "degenerate_groups",
    "draw_reward_tokens",
    "draw_reward_tokens_jit",
    "group_advantages",
    "policy_loss",
    "sample_reward_tokens",
    "summarize",
]
