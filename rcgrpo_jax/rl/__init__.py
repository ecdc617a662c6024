"""RL building blocks: group advantages, reward-token draws, the policy loss, the fused step."""

from rcgrpo_jax.rl.advantages import (
    HIGH,
    LOW,
    NONE,
    degenerate_groups,
    group_advantages,
    sample_reward_tokens,
)
from rcgrpo_jax.rl.losses import PolicyLossConfig, policy_loss, summarize

__all__ = [
    "HIGH",
    "LOW",
    "NONE",
    "PolicyLossConfig",
    "degenerate_groups",
    "group_advantages",
    "policy_loss",
    "sample_reward_tokens",
    "summarize",
]
