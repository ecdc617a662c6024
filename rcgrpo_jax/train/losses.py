"""Masked next-token cross-entropy (SFT / RCTP) over packed rows (`data.packing`).

Batch layout (all [B, T], host numpy or jax arrays):
- tokens: int32 ids.
- loss_mask: 1 on tokens that are *predicted* (assistant tokens), 0 elsewhere.
- segments: packing ids 1, 2, 3, ... per example in the row; 0 = padding.
- positions: restart at 0 at the start of each segment.
- loss_weight (optional, [B]): per-row multiplier of the token losses (source weighting; a NaN
  here is also the clean way to inject a non-finite loss in tests).
- loss_index (optional, [B, K], `data.packing.loss_index`): the positions of the loss tokens
  (then 0s); the head then runs only there.

Token t+1 is a target of position t only when both lie in the same non-zero segment, so packed
examples never predict across their boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rcgrpo_jax import models
from rcgrpo_jax.models import ModelConfig


def masked_nll(
    cfg: ModelConfig, params: Any, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean NLL over loss tokens: sum(mask·w·nll) / sum(mask). aux has tokens (= the divisor,
    also the microbatch `weight`), and the unweighted sum for exact per-example comparisons.
    With `loss_index`, the same sums over the indexed targets alone."""
    index = batch.get("loss_index")
    # the head runs in chunks (and, with the index, at the indexed targets only)
    logp, _, valid = models.token_logprobs(
        cfg, params, batch["tokens"], batch["positions"], batch["segments"], at=index
    )
    loss_mask = jnp.asarray(batch["loss_mask"])
    targets = loss_mask[:, 1:] if index is None else jnp.take_along_axis(loss_mask, index, 1)
    mask = (targets > 0) & valid
    nll = -logp
    if "loss_weight" in batch:
        nll = nll * batch["loss_weight"].astype(jnp.float32)[:, None]
    n = jnp.sum(mask.astype(jnp.float32))
    total = jnp.sum(jnp.where(mask, nll, 0.0))
    loss = total / jnp.maximum(n, 1.0)
    return loss, {"tokens": n, "weight": n, "nll_sum": total}


def make_sft_loss(cfg: ModelConfig) -> Callable:
    """loss_fn(params, batch, rng) -> (loss, aux) for `state.make_train_step`."""

    def loss_fn(params, batch, rng):
        del rng
        return masked_nll(cfg, params, batch)

    return loss_fn


# ----------------------------------------------------------------------------- packing
