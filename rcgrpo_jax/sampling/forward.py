"""Cached inference: the decoder's layers over per-layer KV buffers in [B, KV, S, D] layout.

`models.apply` runs the layers under one `nn.scan` over stacked weights, which suits training.
Driving a KV cache through that scan costs, on every decode step, a copy of the whole cache in
and out of the scan — on CPU that was ~70% of a batch-32 decode step at 512 cache slots. Here
each layer owns its cache buffers (updated in place inside the jitted loop), laid out as
`models.attention` reads them, and the layer loop is unrolled over weights sliced out of
the stacked params once per jitted call (outside the decode loop), not once per step.

The math is the decoder's own (`models.decoder`: `project_qkv`, `mlp`, `rms_norm`; attention
through `models.attention`, whose dense or flash kernel also serves prefill and decode: flash
visits only the cache blocks some row occupies), only driven differently; the tests check the
logits against `models.forward` and the tokens against transformers.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rcgrpo_jax import models
from rcgrpo_jax.models import attention
from rcgrpo_jax.models import decoder as dec
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import constrain

K_AXES = ("cache_batch", "cache_kv_heads", "head_dim", "cache_len")  # keys stored transposed
V_AXES = ("cache_batch", "cache_kv_heads", "cache_len", "head_dim")


@flax.struct.dataclass
class Cache:
    """Per-row KV cache. `k[l]`: layer l's keys, transposed [B, KV, D, S]; `v[l]`: its values
    [B, KV, S, D] (the layouts `models.attention` reads); `segments[b, s]` is 1 where slot s
    of row b holds a real token; `end[b]` is row b's next free slot."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    segments: jax.Array  # [B, S] int32
    end: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.segments.shape[1]


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> Cache:
    kv, d, cd = cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype
    zeros = lambda shape, axes: constrain(jnp.zeros(shape, cd), axes)
    return Cache(
        k=tuple(zeros((batch, kv, d, capacity), K_AXES) for _ in range(cfg.num_layers)),
        v=tuple(zeros((batch, kv, capacity, d), V_AXES) for _ in range(cfg.num_layers)),
        segments=jnp.zeros((batch, capacity), jnp.int32),
        end=jnp.zeros((batch,), jnp.int32),
    )


def constrain_cache(c: Cache) -> Cache:
    return Cache(
        k=tuple(constrain(x, K_AXES) for x in c.k),
        v=tuple(constrain(x, V_AXES) for x in c.v),
        segments=constrain(c.segments, ("cache_batch", "cache_len")),
        end=constrain(c.end, ("cache_batch",)),
    )


def pad_cache(c: Cache, capacity: int) -> Cache:
    """The same cache with `capacity` slots (new slots empty)."""
    extra = capacity - c.capacity
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
    return Cache(
        k=tuple(pad(x, 3) for x in c.k),
        v=tuple(pad(x, 2) for x in c.v),
        segments=pad(c.segments, 1),
        end=c.end,
    )


def split_layers(cfg: ModelConfig, params: models.Params) -> dict[str, Any]:
    """The params with `layers` as a tuple of per-layer trees (call inside a jit, once per call:
    slicing stacked weights inside the decode loop would copy every weight on every step)."""
    axes = models.param_logical_axes(cfg)["layers"]
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
    layers = tuple(
        jax.tree.map(
            lambda ax, w, i=i: constrain(w[i], ax[1:]), axes, params["layers"], is_leaf=is_axes
        )
        for i in range(cfg.num_layers)
    )
    return {**params, "layers": layers}


def _write(buf: jax.Array, chunk: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    """buf[b, ..., start[b]:start[b]+T, ...] = chunk[b] along slot `axis` of each row, for every
    row b; in place when `buf` is a loop carry or donated."""

    def one(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), s, axis=axis - 1)

    return jax.vmap(one)(buf, chunk, start)


def _attention(cfg, p, x, positions, mask, ck, cv, start, kv_len):
    q, k, v = dec.project_qkv(cfg, p, x, positions)
    ck = constrain(_write(ck, k.transpose(0, 2, 3, 1), start, axis=3), K_AXES)
    cv = constrain(_write(cv, v.transpose(0, 2, 1, 3), start, axis=2), V_AXES)
    out = attention.apply(cfg, q, ck[..., :kv_len], cv[:, :, :kv_len], mask)
    return dec.attention_out(cfg, p, out), ck, cv


def apply_cached(
    cfg: ModelConfig,
    weights: dict[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    cache: Cache,
    logits_at: jax.Array | None = None,
    kv_len: int | None = None,
) -> tuple[jax.Array, Cache]:
    """Appends the chunk tokens/positions/segments [B, T] at `cache.end` (which advances by T)
    and returns (logits [B, T, V] — or [B, 1, V] at chunk positions `logits_at` [B] —, cache).

    `kv_len` (static): attend over slots [0, kv_len) only; the caller guarantees that no row's
    `end + T` exceeds it. Attention then costs what the rows hold, not what the cache could
    hold: a 1k-token prompt prefilled into a 1.5k-slot cache in 128-token chunks would
    otherwise score every chunk against all 1.5k slots.

    `weights` comes from `split_layers`. Call inside a jit.
    """
    x = constrain(
        dec.embed(cfg, weights["embedding"], tokens), ("act_batch", "act_len", "act_embed")
    )
    t = tokens.shape[1]
    start = cache.end
    q_slot = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    kv_segments = jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new, (s,)))(
        cache.segments, segments, start
    )
    kv_len = cache.capacity if kv_len is None else min(kv_len, cache.capacity)
    mask = attention.prepare(cfg, q_slot, segments, kv_segments[:, :kv_len], self_attn=False)
    norm = lambda p, h: dec.rms_norm(h, p["scale"], cfg.rms_norm_eps)
    ks, vs = [], []
    for layer, ck, cv in zip(weights["layers"], cache.k, cache.v, strict=True):
        attn_out, ck, cv = _attention(
            cfg, layer["attn"], norm(layer["attn_norm"], x), positions, mask, ck, cv, start, kv_len
        )
        x = x + attn_out
        x = x + dec.mlp(cfg, layer["mlp"], norm(layer["mlp_norm"], x))
        x = constrain(x, ("act_batch", "act_len", "act_embed"))
        ks.append(ck)
        vs.append(cv)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)
    x = norm(weights["final_norm"], x)
    head = weights["embedding"].T if cfg.tie_embeddings else weights["lm_head"]
    logits = dec.lm_logits(cfg, x, head)
    return logits, Cache(k=tuple(ks), v=tuple(vs), segments=kv_segments, end=start + t)
