"""One Flax Linen decoder for Qwen2.5 and LLaMA-3.1, used functionally.

The two families differ only in flags on `ModelConfig`: q/k/v biases (Qwen2), tied embeddings
(Qwen2.5 <= 3B) and "llama3" rope scaling (LLaMA-3.1). Layers are stacked with `nn.scan`, so a
7B model compiles one layer body; the remat policy comes from the config.

Attention masking is expressed with *segments* and *slots*, which covers training with left or
right padding, packed sequences, and KV-cache continuation with one rule: a query at slot q sees
key slot s iff s <= q and both carry the same non-zero segment id (0 = padding / empty).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import constrain

_MASKED = -1e30  # finite, so rows with no visible key (padding queries) give no NaN


def _param(
    module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str, ...], dtype
):
    """Declares a weight once, with its shape and logical axes."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies, with LLaMA-3.1's piecewise low-frequency stretch when set."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates [B, T, H, D] by per-token positions [B, T] (half-split layout, as transformers)."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.param_dtype
        )
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * y.astype(x.dtype)


@flax.struct.dataclass
class KVCache:
    """Per-row KV cache. `segments[b, s]` is 1 where slot s holds a real token; `end[b]` is the
    next free slot of row b (chunks are appended there, so rows may have different lengths)."""

    k: jax.Array  # [L, B, S, KV, D]
    v: jax.Array  # [L, B, S, KV, D]
    segments: jax.Array  # [B, S] int32
    end: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


CACHE_AXES = ("cache_layers", "cache_batch", "cache_len", "cache_kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, cfg.compute_dtype)
    return KVCache(
        k=constrain(zeros, CACHE_AXES),
        v=constrain(zeros, CACHE_AXES),
        segments=jnp.zeros((batch, max_len), jnp.int32),
        end=jnp.zeros((batch,), jnp.int32),
    )


def _write_rows(buf: jax.Array, chunk: jax.Array, start: jax.Array) -> jax.Array:
    """buf[b, start[b]:start[b]+T] = chunk[b] for every row b."""

    def one(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), s, axis=0)

    return jax.vmap(one)(buf, chunk, start)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, layer_cache, cache_start):
        cfg = self.cfg
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd, cd = cfg.weight_dtype, cfg.compute_dtype
        init = nn.initializers.normal(0.02)
        wq = _param(self, "wq", init, (e, h, d), ("embed", "q_heads", "head_dim"), pd)
        wk = _param(self, "wk", init, (e, kv, d), ("embed", "kv_heads", "head_dim"), pd)
        wv = _param(self, "wv", init, (e, kv, d), ("embed", "kv_heads", "head_dim"), pd)
        wo = _param(self, "wo", init, (h, d, e), ("q_heads", "head_dim", "embed"), pd)
        q = jnp.einsum("bte,ehd->bthd", x, wq.astype(cd))
        k = jnp.einsum("bte,ehd->bthd", x, wk.astype(cd))
        v = jnp.einsum("bte,ehd->bthd", x, wv.astype(cd))
        if cfg.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + _param(self, "bq", zeros, (h, d), ("q_heads", "head_dim"), pd).astype(cd)
            k = k + _param(self, "bk", zeros, (kv, d), ("kv_heads", "head_dim"), pd).astype(cd)
            v = v + _param(self, "bv", zeros, (kv, d), ("kv_heads", "head_dim"), pd).astype(cd)
        inv_freq = rope_inv_freq(cfg)
        q = constrain(
            apply_rope(q, positions, inv_freq), ("act_batch", "act_len", "act_heads", "head_dim")
        )
        k = apply_rope(k, positions, inv_freq)

        if layer_cache is not None:
            ck, cv = layer_cache
            ck = _write_rows(ck, k, cache_start)
            cv = _write_rows(cv, v, cache_start)
            keys, values, layer_cache = ck, cv, (ck, cv)
        else:
            keys, values = k, v
        keys = constrain(keys, ("act_batch", "act_len", "act_kv_heads", "head_dim"))
        values = constrain(values, ("act_batch", "act_len", "act_kv_heads", "head_dim"))

        b, t = x.shape[:2]
        qg = q.reshape(b, t, kv, h // kv, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
        scores = scores * (1.0 / math.sqrt(d))
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(cd)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(b, t, h, d)
        out = constrain(out, ("act_batch", "act_len", "act_heads", "head_dim"))
        return jnp.einsum("bthd,hde->bte", out, wo.astype(cd)), layer_cache


class Mlp(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        e, m, pd, cd = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype, cfg.compute_dtype
        init = nn.initializers.normal(0.02)
        gate = _param(self, "w_gate", init, (e, m), ("embed", "mlp"), pd)
        up = _param(self, "w_up", init, (e, m), ("embed", "mlp"), pd)
        down = _param(self, "w_down", init, (m, e), ("mlp", "embed"), pd)
        hidden = jax.nn.silu(x @ gate.astype(cd)) * (x @ up.astype(cd))
        hidden = constrain(hidden, ("act_batch", "act_len", "act_mlp"))
        return hidden @ down.astype(cd)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, positions, mask, cache_start):
        cfg = self.cfg
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, cfg.weight_dtype)
        attn_out, layer_cache = Attention(cfg, name="attn")(
            norm(name="attn_norm")(x), positions, mask, layer_cache, cache_start
        )
        x = x + attn_out
        x = x + Mlp(cfg, name="mlp")(norm(name="mlp_norm")(x))
        x = constrain(x, ("act_batch", "act_len", "act_embed"))
        return x, layer_cache


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Decoder(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens,
        positions,
        segments,
        cache: KVCache | None = None,
        logits_at=None,
        return_hidden: bool = False,
    ):
        """tokens/positions/segments [B, T]; with `cache`, the chunk is appended at `cache.end`.

        Returns (logits [B, T, V] float32 — or [B, 1, V] at positions `logits_at` [B] — , cache).
        With `return_hidden`, the final-normed hidden states [B, T, E] replace the logits, so a
        caller can apply the head in chunks (`api.token_logprobs`) instead of materialising
        [B, T, V] — 20 GB in f32 for 4 × 8k tokens of a 152k vocabulary.
        """
        cfg = self.cfg
        embedding = _param(
            self,
            "embedding",
            nn.initializers.normal(0.02),
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            cfg.weight_dtype,
        )
        x = jnp.take(embedding, tokens, axis=0).astype(cfg.compute_dtype)
        x = constrain(x, ("act_batch", "act_len", "act_embed"))

        t = tokens.shape[1]
        if cache is None:
            q_slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
            kv_segments, layer_caches, start = segments, None, None
        else:
            start = cache.end
            q_slot = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            kv_segments = _write_rows(cache.segments, segments, start)
            layer_caches = (cache.k, cache.v)
        kv_slot = jnp.arange(kv_segments.shape[1], dtype=jnp.int32)
        mask = (
            (kv_slot[None, None, :] <= q_slot[:, :, None])
            & (kv_segments[:, None, :] == segments[:, :, None])
            & (kv_segments[:, None, :] > 0)
        )

        layer = DecoderLayer
        if cfg.remat != "none":
            layer = nn.remat(layer, policy=_REMAT[cfg.remat], prevent_cse=False)
        stack = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, layer_caches = stack(cfg, name="layers")(x, layer_caches, positions, mask, start)
        if cache is not None:
            cache = KVCache(
                k=layer_caches[0], v=layer_caches[1], segments=kv_segments, end=start + t
            )

        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)
        x = RMSNorm(cfg.rms_norm_eps, cfg.weight_dtype, name="final_norm")(x)
        if cfg.tie_embeddings:
            head = embedding.T
        else:
            head = _param(
                self,
                "lm_head",
                nn.initializers.normal(0.02),
                (cfg.hidden_size, cfg.vocab_size),
                ("embed", "vocab"),
                cfg.weight_dtype,
            )
        if return_hidden:  # the caller applies the head (in chunks)
            return x, cache
        logits = jnp.einsum(
            "bte,ev->btv", x, head.astype(cfg.compute_dtype), preferred_element_type=jnp.float32
        )
        return constrain(logits, ("act_batch", "act_len", "act_vocab")), cache
