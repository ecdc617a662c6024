"""One Flax Linen decoder for Qwen2.5 and LLaMA-3.1, used functionally.

The two families differ only in flags on `ModelConfig`: q/k/v biases (Qwen2), tied embeddings
(Qwen2.5 <= 3B) and "llama3" rope scaling (LLaMA-3.1). Layers are stacked with `nn.scan`, so a
7B model compiles one layer body; the remat policy comes from the config.

Attention masking is expressed with *segments* and *slots*, which covers training with left or
right padding, packed sequences, and KV-cache continuation with one rule: a query at slot q sees
key slot s iff s <= q and both carry the same non-zero segment id (0 = padding / empty). The
kernels that compute it (dense | flash | splash | cudnn, `ModelConfig.attention`) live in
`models.attention`.

The layer math lives in pure functions (`project_qkv`, `mlp`, ...; attention in
`models.attention`) that the Linen modules here and the sampler's cached forward
(`sampling.forward`) share.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rcgrpo_jax.models import attention
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import constrain


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


# ---------------------------------------------------------------------------------------------
# The layer math as pure functions: the Linen modules below (training, scoring) and the sampler's
# cached forward (`sampling.forward`) both call these, so there is one copy of it.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense(x: jax.Array, w: jax.Array, k: int = 1, out_dtype=None) -> jax.Array:
    """x [..., K1..Kk] @ w [K1..Kk, N...] -> [..., N...]: every weight projection goes through here.

    The custom VJP only orders the weight gradient. dW contracts the token axes of X and dY, and
    XLA:CPU feeds its GEMM by first copying one of the two transposed; autodiff always picks
    dY, the [tokens, intermediate] one for the MLP's up/gate projections (~45% of a CPU train
    step once). Here the smaller of X and dY is the one transposed: dW = dot(X, dY), or for a
    wide input (the down projection) dW = dot(dY, X)^T, whose final transpose is weight-sized.
    Same math, same dtypes as autodiff's.
    """
    return _dense_fwd(x, w, k, out_dtype)[0]


def _dense_fwd(x, w, k, out_dtype):
    dims = ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype), (x, w)


def _dense_bwd(k, out_dtype, res, g):
    del out_dtype
    x, w = res
    lead, n_out = x.ndim - k, w.ndim - k
    g = g.astype(x.dtype)
    g_x = jax.lax.dot_general(
        g,
        w,
        ((tuple(range(lead, lead + n_out)), tuple(range(k, k + n_out))), ((), ())),
        preferred_element_type=x.dtype,
    )
    tokens = ((tuple(range(lead)), tuple(range(lead))), ((), ()))
    if x.size <= g.size:
        g_w = jax.lax.dot_general(x, g, tokens, preferred_element_type=w.dtype)
    else:  # [N..., K...] -> [K..., N...]
        g_w = jax.lax.dot_general(g, x, tokens, preferred_element_type=w.dtype)
        g_w = g_w.transpose(*range(n_out, n_out + k), *range(n_out))
    return g_x, g_w


dense.defvjp(_dense_fwd, _dense_bwd)


def project_qkv(
    cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, E] -> roped q [B, T, H, D] and k, v [B, T, KV, D]."""
    cd = cfg.compute_dtype
    q = dense(x, p["wq"].astype(cd))
    k = dense(x, p["wk"].astype(cd))
    v = dense(x, p["wv"].astype(cd))
    if cfg.qkv_bias:
        q, k, v = q + p["bq"].astype(cd), k + p["bk"].astype(cd), v + p["bv"].astype(cd)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    return (
        constrain(q, ("act_batch", "act_len", "act_heads", "head_dim")),
        apply_rope(k, positions, inv_freq),
        v,
    )


def attention_out(cfg: ModelConfig, p: dict[str, jax.Array], out: jax.Array) -> jax.Array:
    return dense(out, p["wo"].astype(cfg.compute_dtype), 2)


def mlp(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    cd = cfg.compute_dtype
    hidden = jax.nn.silu(dense(x, p["w_gate"].astype(cd))) * dense(x, p["w_up"].astype(cd))
    hidden = constrain(hidden, ("act_batch", "act_len", "act_mlp"))
    return dense(hidden, p["w_down"].astype(cd))


def embed(cfg: ModelConfig, embedding: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(embedding, tokens, axis=0).astype(cfg.compute_dtype)


def lm_logits(cfg: ModelConfig, x: jax.Array, head: jax.Array) -> jax.Array:
    """Final-normed hidden states [B, T, E] @ head [E, V] -> float32 logits [B, T, V]."""
    logits = dense(x, head.astype(cfg.compute_dtype), 1, jnp.float32)
    return constrain(logits, ("act_batch", "act_len", "act_vocab"))


# ---------------------------------------------------------------------------------------------
# Linen modules: each declares its weights once (shape + logical axes), then calls the math above.


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.param_dtype
        )
        return rms_norm(x, scale, self.eps)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask: attention.Mask):
        cfg = self.cfg
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.weight_dtype
        init, zeros = nn.initializers.normal(0.02), nn.initializers.zeros
        p = {
            "wq": _param(self, "wq", init, (e, h, d), ("embed", "q_heads", "head_dim"), pd),
            "wk": _param(self, "wk", init, (e, kv, d), ("embed", "kv_heads", "head_dim"), pd),
            "wv": _param(self, "wv", init, (e, kv, d), ("embed", "kv_heads", "head_dim"), pd),
            "wo": _param(self, "wo", init, (h, d, e), ("q_heads", "head_dim", "embed"), pd),
        }
        if cfg.qkv_bias:
            p["bq"] = _param(self, "bq", zeros, (h, d), ("q_heads", "head_dim"), pd)
            p["bk"] = _param(self, "bk", zeros, (kv, d), ("kv_heads", "head_dim"), pd)
            p["bv"] = _param(self, "bv", zeros, (kv, d), ("kv_heads", "head_dim"), pd)
        q, k, v = project_qkv(cfg, p, x, positions)
        keys_t = constrain(
            k.transpose(0, 2, 3, 1), ("act_batch", "act_kv_heads", "head_dim", "act_len")
        )
        values = constrain(
            v.transpose(0, 2, 1, 3), ("act_batch", "act_kv_heads", "act_len", "head_dim")
        )
        return attention_out(cfg, p, attention.apply(cfg, q, keys_t, values, mask))


class Mlp(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        e, m, pd = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype
        init = nn.initializers.normal(0.02)
        p = {
            "w_gate": _param(self, "w_gate", init, (e, m), ("embed", "mlp"), pd),
            "w_up": _param(self, "w_up", init, (e, m), ("embed", "mlp"), pd),
            "w_down": _param(self, "w_down", init, (m, e), ("mlp", "embed"), pd),
        }
        return mlp(cfg, p, x)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        cfg = self.cfg
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, cfg.weight_dtype)
        x = x + Attention(cfg, name="attn")(norm(name="attn_norm")(x), positions, mask)
        x = x + Mlp(cfg, name="mlp")(norm(name="mlp_norm")(x))
        return constrain(x, ("act_batch", "act_len", "act_embed")), None


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
        logits_at=None,
        return_hidden: bool = False,
    ):
        """tokens/positions/segments [B, T] -> logits [B, T, V] float32 (or [B, 1, V] at
        positions `logits_at` [B]). With `return_hidden`, the final-normed hidden states
        [B, T, E] replace the logits, so a caller can apply the head in chunks
        (`api.token_logprobs`) instead of materialising [B, T, V] — 20 GB in f32 for 4 × 8k
        tokens of a 152k vocabulary. (Cached inference: `sampling.forward`, same math.)
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
        x = constrain(embed(cfg, embedding, tokens), ("act_batch", "act_len", "act_embed"))
        slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        # Init only needs shapes: dense there, so a kernel this backend lacks fails only when run.
        kind_cfg = cfg.replace(attention="dense") if self.is_initializing() else cfg
        mask = attention.prepare(kind_cfg, slots, segments, segments, self_attn=True)

        layer = DecoderLayer
        if cfg.remat != "none":
            layer = nn.remat(layer, policy=_REMAT[cfg.remat], prevent_cse=False)
        stack = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, name="layers")
        if cfg.scan_layers or self.is_initializing():
            x, _ = stack(x, positions, mask)
        else:  # same stacked weights, one layer at a time (see ModelConfig.scan_layers)
            stacked = nn.unbox(self.variables["params"]["layers"])
            for i in range(cfg.num_layers):
                p_i = jax.tree.map(lambda w, i=i: w[i], stacked)
                x, _ = layer(cfg, parent=None).apply({"params": p_i}, x, positions, mask)

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
            return x
        return lm_logits(cfg, x, head)
