"""The fused RL train step: one jit from rollout tensors to updated params.

Inside the jit, read top to bottom: current log-probs and entropy of the [P, G, T] rollouts →
group advantages from the rewards (vmapped over groups) → clipped surrogate with separate low/high
clip and optional k3 KL, as the `Objective` says (GRPO, Dr. GRPO, DAPO, GSPO) → gradients
(scanned over microbatches of whole groups) → skip-if-non-finite → optax update. The step
machinery (sharding, donation, accumulation, skipping) is the one SFT uses
(`train.state.make_train_step`); only the loss differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from rcgrpo_jax.models import ModelConfig
from rcgrpo_jax.rl.losses import Objective, logprobs_and_entropy, policy_loss
from rcgrpo_jax.train.state import TrainState, make_train_step


def make_rl_step(
    cfg: ModelConfig,
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    shardings: TrainState,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, dict[str, Any]], tuple[TrainState, dict[str, jax.Array]]]:
    """(state, batch [P, G, ...]) -> (state, metrics); microbatches split the P groups."""

    def loss_fn(params, batch, rng):
        del rng  # the loss is deterministic given the rollouts
        return policy_loss(cfg, objective, params, batch)

    return make_train_step(
        loss_fn,
        optimizer,
        mesh=mesh,
        shardings=shardings,
        grad_accum=grad_accum,
        schedule=schedule,
    )


@functools.partial(jax.jit, static_argnums=0)
def sequence_logprobs(cfg: ModelConfig, params: Any, tokens, positions, segments) -> jax.Array:
    """log p(tokens[t] | < t) [B, T] under `params` (e.g. the frozen reference policy)."""
    return logprobs_and_entropy(cfg, params, tokens, positions, segments)[0]
