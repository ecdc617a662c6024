"""RL building blocks: advantage estimators and reward-token draws, the objectives (each registered
by name), the fused step."""

from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.advantages import (
    ESTIMATORS,
    TokenDraw,
    degenerate_groups,
    draw_reward_tokens,
    draw_reward_tokens_jit,
    estimate,
    group_advantages,
    group_signal,
    register_estimator,
    sample_reward_tokens,
)
from rcgrpo_jax.rl.losses import (
    OBJECTIVES,
    Objective,
    policy_loss,
    register_objective,
    summarize,
    with_advantages,
)

__all__ = [
    "ESTIMATORS",
    "HIGH",
    "LOW",
    "NONE",
    "OBJECTIVES",
    "Objective",
    "TokenDraw",
    "degenerate_groups",
    "draw_reward_tokens",
    "draw_reward_tokens_jit",
    "estimate",
    "group_advantages",
    "group_signal",
    "policy_loss",
    "register_estimator",
    "register_objective",
    "sample_reward_tokens",
    "summarize",
    "with_advantages",
]
