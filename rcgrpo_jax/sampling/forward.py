"""The decoder's math for cached inference: per-layer KV buffers in [B, KV, S, D] layout.

`models.apply` (one `nn.scan` over stacked layers, cache [L, B, S, KV, D]) is the training-side
forward. Driving a KV cache through that scan costs, on every decode step, a copy of the whole
cache in and out of the scan plus a relayout of each layer's keys and values for the attention
dots — on CPU that was ~70% of a batch-32 decode step at 512 cache slots. Here each layer owns
its cache buffers (updated in place inside the jitted loop), laid out so that both attention dots
read them as they are, and the layer loop is unrolled over weights that are sliced out of the
stacked params once per jitted call (outside the decode loop), not once per step.

Same weights, same math and the same masking rule as `models.decoder` (query slot q sees key
slot s iff s <= q and both carry the same non-zero segment); the tests check the logits against
`models.forward` and the tokens against transformers.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rcgrpo_jax import models
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.decoder import apply_rope, rope_inv_freq
from rcgrpo_jax.models.sharding import constrain

KV_AXES = ("cache_batch", "cache_kv_heads", "cache_len", "head_dim")
_MASKED = -1e30  # as models.decoder: finite, so a padding query with no visible key is no NaN


@flax.struct.dataclass
class Cache:
    """Per-row KV cache. `k[l]`/`v[l]`: layer l's [B, KV, S, D] buffers; `segments[b, s]` is 1
    where slot s of row b holds a real token; `end[b]` is row b's next free slot."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    segments: jax.Array  # [B, S] int32
    end: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.segments.shape[1]


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> Cache:
    shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)

    def zeros() -> jax.Array:
        return constrain(jnp.zeros(shape, cfg.compute_dtype), KV_AXES)

    return Cache(
        k=tuple(zeros() for _ in range(cfg.num_layers)),
        v=tuple(zeros() for _ in range(cfg.num_layers)),
        segments=jnp.zeros((batch, capacity), jnp.int32),
        end=jnp.zeros((batch,), jnp.int32),
    )


def constrain_cache(c: Cache) -> Cache:
    return Cache(
        k=tuple(constrain(x, KV_AXES) for x in c.k),
        v=tuple(constrain(x, KV_AXES) for x in c.v),
        segments=constrain(c.segments, ("cache_batch", "cache_len")),
        end=constrain(c.end, ("cache_batch",)),
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


def _rms_norm(cfg: ModelConfig, scale: jax.Array, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def _write(buf: jax.Array, chunk: jax.Array, start: jax.Array) -> jax.Array:
    """buf[b, :, start[b]:start[b]+T] = chunk[b] for every row b (buf [B, KV, S, D], chunk
    [B, KV, T, D]); in place when `buf` is a loop carry or donated."""

    def one(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), s, axis=1)

    return jax.vmap(one)(buf, chunk, start)


def _attention(cfg, p, x, positions, mask, ck, cv, start):
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cd = cfg.compute_dtype
    q = jnp.einsum("bte,ehd->bthd", x, p["wq"].astype(cd))
    k = jnp.einsum("bte,ehd->bthd", x, p["wk"].astype(cd))
    v = jnp.einsum("bte,ehd->bthd", x, p["wv"].astype(cd))
    if cfg.qkv_bias:
        q, k, v = q + p["bq"].astype(cd), k + p["bk"].astype(cd), v + p["bv"].astype(cd)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    ck = constrain(_write(ck, k.transpose(0, 2, 1, 3), start), KV_AXES)
    cv = constrain(_write(cv, v.transpose(0, 2, 1, 3), start), KV_AXES)

    b, t = x.shape[:2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, ck, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(cd)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, cv).reshape(b, t, h, d)
    out = constrain(out, ("act_batch", "act_len", "act_heads", "head_dim"))
    return jnp.einsum("bthd,hde->bte", out, p["wo"].astype(cd)), ck, cv


def _mlp(cfg, p, x):
    cd = cfg.compute_dtype
    hidden = jax.nn.silu(x @ p["w_gate"].astype(cd)) * (x @ p["w_up"].astype(cd))
    hidden = constrain(hidden, ("act_batch", "act_len", "act_mlp"))
    return hidden @ p["w_down"].astype(cd)


def apply_cached(
    cfg: ModelConfig,
    weights: dict[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    cache: Cache,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """Appends the chunk tokens/positions/segments [B, T] at `cache.end` (which advances by T)
    and returns (logits [B, T, V] — or [B, 1, V] at chunk positions `logits_at` [B] —, cache).

    `weights` comes from `split_layers`. Call inside a jit.
    """
    x = jnp.take(weights["embedding"], tokens, axis=0).astype(cfg.compute_dtype)
    x = constrain(x, ("act_batch", "act_len", "act_embed"))
    t = tokens.shape[1]
    start = cache.end
    q_slot = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    kv_segments = jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new, (s,)))(
        cache.segments, segments, start
    )
    kv_slot = jnp.arange(kv_segments.shape[1], dtype=jnp.int32)
    mask = (
        (kv_slot[None, None, :] <= q_slot[:, :, None])
        & (kv_segments[:, None, :] == segments[:, :, None])
        & (kv_segments[:, None, :] > 0)
    )
    ks, vs = [], []
    for layer, ck, cv in zip(weights["layers"], cache.k, cache.v, strict=True):
        attn_out, ck, cv = _attention(
            cfg,
            layer["attn"],
            _rms_norm(cfg, layer["attn_norm"]["scale"], x),
            positions,
            mask,
            ck,
            cv,
            start,
        )
        x = x + attn_out
        x = x + _mlp(cfg, layer["mlp"], _rms_norm(cfg, layer["mlp_norm"]["scale"], x))
        x = constrain(x, ("act_batch", "act_len", "act_embed"))
        ks.append(ck)
        vs.append(cv)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)
    x = _rms_norm(cfg, weights["final_norm"]["scale"], x)
    head = weights["embedding"].T if cfg.tie_embeddings else weights["lm_head"]
    logits = jnp.einsum(
        "bte,ev->btv", x, head.astype(cfg.compute_dtype), preferred_element_type=jnp.float32
    )
    logits = constrain(logits, ("act_batch", "act_len", "act_vocab"))
    return logits, Cache(k=tuple(ks), v=tuple(vs), segments=kv_segments, end=start + t)
