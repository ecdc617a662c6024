"""Group-relative advantages and reward-token assignment, as vmapped per-group functions.

Both are written for one group and lifted over the P groups of a step with `jax.vmap`, so the
same code runs inside the fused train step (advantages) and on the rollout side (reward tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGH, LOW, NONE = 1, 0, -1  # reward-token codes; NONE = unconditioned rollout (plain GRPO)


def _group_advantage(rewards: jax.Array, eps: float, normalize_std: bool) -> jax.Array:
    """(r - mean) / (std + eps) for one group (r - mean without `normalize_std`); exactly 0
    when every reward is equal."""
    r = rewards.astype(jnp.float32)
    mu = jnp.mean(r)
    degenerate = jnp.all(r == r[0])  # not `sigma == 0`: float rounding must not leak 1e-8/eps
    if not normalize_std:
        return jnp.where(degenerate, 0.0, r - mu)
    sigma = jnp.sqrt(jnp.mean(jnp.square(r - mu)))  # population std (ddof=0), as GRPO
    return jnp.where(degenerate, 0.0, (r - mu) / (sigma + eps))


def group_advantages(
    rewards: jax.Array, eps: float = 1e-6, normalize_std: bool = True
) -> jax.Array:
    """rewards [P, G] -> advantages [P, G], centred (and by default std-normalised) within each
    group (row)."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {rewards.shape}")
    return jax.vmap(lambda r: _group_advantage(r, eps, normalize_std))(rewards)


def degenerate_groups(rewards: jax.Array) -> jax.Array:
    """[P] bool: groups whose rewards are all equal (their advantages, hence gradients, vanish)."""
    rewards = jnp.asarray(rewards)
    return jnp.all(rewards == rewards[:, :1], axis=1)


def _group_tokens(key: jax.Array, group_size: int, p_high: float, stratified: bool) -> jax.Array:
    if not stratified:
        return jax.random.bernoulli(key, p_high, (group_size,)).astype(jnp.int32)
    # Stratified: round(p_high * G) high tokens, clamped so that both tokens appear, then shuffled.
    n_high = jnp.clip(jnp.round(p_high * group_size), 1, group_size - 1).astype(jnp.int32)
    tokens = (jnp.arange(group_size) < n_high).astype(jnp.int32)
    return jax.random.permutation(key, tokens)


def sample_reward_tokens(
    key: jax.Array, num_groups: int, group_size: int, p_high: float, stratified: bool = False
) -> jax.Array:
    """[P, G] int32 of HIGH/LOW: r_j ~ P_sample(r) i.i.d., or stratified within every group."""
    if stratified and group_size < 2:
        raise ValueError("stratified reward tokens need group_size >= 2")
    if not 0.0 <= p_high <= 1.0:
        raise ValueError(f"p_high={p_high} is not a probability")
    keys = jax.random.split(key, num_groups)
    return jax.vmap(lambda k: _group_tokens(k, group_size, p_high, stratified))(keys)
