"""The fused RL train step: one jit from rollout tensors to updated params.

Inside the jit, read top to bottom: advantages of the whole batch's rewards by the objective's
estimator (vmapped over groups; `with_advantages`, the step's `prepare`), kept as the batch fields
`advantages` and `group_signal` → split into microbatches of whole groups → per microbatch:
current log-probs and entropy of the [P, G, T] rollouts → clipped surrogate with separate
low/high clip and optional k3 KL, as the registered objective says (GRPO, Dr. GRPO, DAPO, GSPO)
→ gradients (scanned over the microbatches) → skip if non-finite or no group carries signal →
optax update; beside it, the next iteration's [P, G] reward tokens (vmapped over groups), when
the step is given a `TokenDraw`. The step machinery (sharding, donation, accumulation, skipping)
is the one SFT uses (`train.state.make_train_step`); only `prepare`, the loss and that extra
output differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import optax

from rcgrpo_jax.models import ModelConfig
from rcgrpo_jax.rl.advantages import TokenDraw, draw_reward_tokens
from rcgrpo_jax.rl.losses import Objective, logprobs_and_entropy, policy_loss, with_advantages
from rcgrpo_jax.train.state import TrainState, make_train_step

NEXT_REWARD_TOKENS = "next_reward_tokens"  # the metrics key of the next iteration's [P, G] tokens


def make_rl_step(
    cfg: ModelConfig,
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    reward_token_draw: TokenDraw | None = None,
    key: Hashable | None = None,
    **step_options: Any,
) -> Callable[[TrainState, dict[str, Any]], tuple[TrainState, dict[str, jax.Array]]]:
    """(state, batch [P, G, ...]) -> (state, metrics); microbatches split the P groups.

    `step_options` are `make_train_step`'s (mesh, shardings, grad_accum, schedule, ...). With
    `reward_token_draw`, the batch carries `iteration` (int32 []: the iteration its rollouts
    belong to) and the metrics carry `NEXT_REWARD_TOKENS`: `draw_reward_tokens(reward_token_draw,
    iteration + 1)`, keyed by the iteration alone, so every update of an iteration draws the
    same ones. The draw's seed, p_high and fixed token are step inputs, not constants of the
    program.

    `key`: what determines `optimizer` and the schedule (their `OptimConfig`); with it, every
    RL step of the same model config, objective, draw shape and key shares one program (all
    arms of stage `all`), compiled once per shape. The program is keyed by the `Objective`'s
    fields (the registered objective's and estimator's names and every setting they read),
    never by the functions' code.
    """
    # the program sees only the draw's shape
    shape = None if reward_token_draw is None else reward_token_draw.shape()

    def loss_fn(params, batch, rng):
        del rng  # the loss is deterministic given the rollouts
        return policy_loss(cfg, objective, params, batch)

    def prepare(batch):  # advantages over the whole batch, before the microbatch split
        return with_advantages(objective, batch)

    def outputs(batch):
        if "iteration" not in batch:
            raise ValueError("an RL step that draws reward tokens needs batch['iteration']")
        return {NEXT_REWARD_TOKENS: draw_reward_tokens(shape, batch["iteration"] + 1, inputs=batch)}

    return make_train_step(
        loss_fn,
        optimizer,
        outputs=None if reward_token_draw is None else outputs,
        inputs=None if reward_token_draw is None else reward_token_draw.inputs(),
        prepare=prepare,
        key=None if key is None else ("rl", cfg, objective, shape, key),
        **step_options,
    )


@functools.partial(jax.jit, static_argnums=0)
def sequence_logprobs(cfg: ModelConfig, params: Any, tokens, positions, segments) -> jax.Array:
    """log p(tokens[t] | < t) [B, T] under `params` (e.g. the frozen reference policy)."""
    return logprobs_and_entropy(cfg, params, tokens, positions, segments)[0]
