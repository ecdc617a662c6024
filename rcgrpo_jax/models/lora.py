"""LoRA (`ModelConfig.lora`): the adapters' init, the trainable/frozen split of the param tree
and the merge into the base (PEFT's adapter files: `models.peft_io`).

The adapter rows are declared in `models.weights` beside the base's (`LORA_WEIGHTS`) and applied
in the forward by `decoder.project`, `decoder.embed` and `decoder.lm_logits`; here is what
happens around them. A LoRA param tree is the base's tree plus the adapters' leaves: `split`
parts it into what trains (the adapters and the reward-token rows: the optimizer's and the
checkpoint's) and what does not (the base), `join` puts it back together.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rcgrpo_jax.models import weights
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.weights import LORA_TARGETS, Params, Weight


def init_lora(cfg: ModelConfig, params: Params, key: jax.Array) -> Params:
    """`params` (the base's tree) with the adapters of `cfg.lora` added, as PEFT starts them:
    A ~ U(±1/sqrt(in)) (torch's kaiming_uniform(a=sqrt(5)) on lora_A [rank, in], PEFT's default)
    or N(0, 1/rank²) ("gaussian"), B = 0, and the token rows copies of the base's rows, so the
    model computes exactly what the base does. Call inside a jit (or on host arrays)."""
    if cfg.lora is None:
        raise ValueError("init_lora needs a config with lora set")
    leaves = []
    for i, w in enumerate(x for x in weights.weights(cfg) if x.lora):
        shape = w.full_shape(cfg)
        if w.init == "zeros":
            leaf = jnp.zeros(shape, jnp.float32)
        elif w.init == "lora_a":
            k = jax.random.fold_in(key, i)
            fan_in = math.prod(shape[1:-1])  # [L, in..., rank]
            if cfg.lora.init == "kaiming":
                bound = 1.0 / math.sqrt(fan_in)
                leaf = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
            else:
                leaf = jax.random.normal(k, shape, jnp.float32) / cfg.lora.rank
        elif w.path == ("lora_tokens", "embedding"):
            ids = jnp.asarray(cfg.lora.token_ids, jnp.int32)
            leaf = params["embedding"][ids].astype(jnp.float32)
        else:  # ("lora_tokens", "lm_head"): the untied head's columns
            ids = jnp.asarray(cfg.lora.token_ids, jnp.int32)
            leaf = params["lm_head"][:, ids].astype(jnp.float32)
        leaves.append((w.path, leaf))
    return _merge_trees(params, weights.nest(leaves))


def _merge_trees(a: Params, b: Params) -> Params:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge_trees(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def split(cfg: ModelConfig, params: Params) -> tuple[Params, Params]:
    """(trainable, frozen): under LoRA the adapters and token rows, and the base; without
    LoRA the whole tree and nothing."""
    if cfg.lora is None:
        return params, {}
    table = weights.weights(cfg)
    trainable = weights.nest((w.path, weights.lookup(params, w.path)) for w in table if w.lora)
    frozen = weights.nest((w.path, weights.lookup(params, w.path)) for w in table if not w.lora)
    return trainable, frozen


def join(trainable: Params, frozen: Params) -> Params:
    """The whole param tree from `split`'s two parts."""
    return _merge_trees(frozen, trainable) if frozen else trainable


def merged_weight(
    cfg: ModelConfig, w: Weight, base: Any, params: Params, xp: ModuleType = jnp
) -> Any:
    """Base weight `w` (its stacked value `base`) with its adapter folded in: W + A B * scale,
    and the token rows written into the embedding (and the untied head), in W's dtype; `xp` is
    jnp (on device) or np (on the host, one weight at a time, as `save_hf` exports)."""
    if cfg.lora is None:
        return base
    dtype = base.dtype
    ids = np.asarray(cfg.lora.token_ids, np.int64)
    # the token rows: the embedding's rows, the untied head's columns
    at = {("embedding",): (ids,), ("lm_head",): (slice(None), ids)}.get(w.path)
    if at is not None and cfg.lora_tokens:
        values = xp.asarray(_get(params, ("lora_tokens", *w.path), xp)).astype(dtype)
        if xp is jnp:
            return base.at[at].set(values)
        out = np.array(base, copy=True)
        out[at] = values
        return out
    target = next((t for t in LORA_TARGETS if t.path == w.path), None)
    if target is None or target.name not in cfg.lora.targets:
        return base
    scope = (*w.path[:-1], f"{w.path[-1]}_lora")
    a = xp.asarray(_get(params, (*scope, "a"), xp)).astype(np.float32)
    b = xp.asarray(_get(params, (*scope, "b"), xp)).astype(np.float32)
    n_in = target.n_in
    a2 = a.reshape(a.shape[0], -1, a.shape[-1])  # [L, in, r]
    b2 = b.reshape(b.shape[0], b.shape[1], -1)  # [L, r, out]
    delta = xp.einsum("lir,lro->lio", a2, b2) * np.float32(cfg.lora.scale)
    delta = delta.reshape(base.shape[:1] + a.shape[1 : 1 + n_in] + b.shape[2:])
    return (base.astype(np.float32) + delta).astype(dtype)


def _get(params: Params, path: tuple[str, ...], xp: ModuleType) -> Any:
    leaf = weights.lookup(params, path)
    return np.asarray(jax.device_get(leaf)) if xp is np else leaf


def merge(cfg: ModelConfig, params: Params) -> Params:
    """The params of `cfg.base()`: the base's tree with every adapter and token row folded in,
    what a merged checkpoint holds (PEFT's `merge_and_unload()`). Jit it for big models."""
    return weights.nest(
        (w.path, merged_weight(cfg, w, weights.lookup(params, w.path), params))
        for w in weights.base_weights(cfg)
    )
