"""The decoder for every family (`models.families`), as pure functions over the param tree.

Families differ only in what `models.families` declares and `ModelConfig` carries: q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings (small Qwen checkpoints) and
"llama3" rope scaling (LLaMA-3.1). The weights are declared once, in
`models.weights`; here is the math over them, bottom up: the layer pieces (`project_qkv`,
`mlp`, ...), one pre-norm layer (`decoder_layer`), the layer stack (`run_layers`: `lax.scan`
over the stacked weights, so a 7B model compiles one layer body, or unrolled; remat policy from
the config), and embedding -> stack -> final norm (`forward_hidden`) before the head (`logits`).
The training forward (`models.api`) and the sampler's KV-cache forward (`sampling.forward`,
which passes each layer its cache slot) both run through these.

Attention masking is expressed with *segments* and *slots*, which covers training with left or
right padding, packed sequences, and KV-cache continuation with one rule: a query at slot q sees
key slot s iff s <= q and both carry the same non-zero segment id (0 = padding / empty). The
kernels that compute it (dense | flash | splash | cudnn, `ModelConfig.attention`) live in
`models.attention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rcgrpo_jax.models import attention, weights
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import BATCH_MESH_AXES, constrain
from rcgrpo_jax.models.weights import Params


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
# The layer pieces.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def dense(
    x: jax.Array, w: jax.Array, k: int = 1, out_dtype=None, frozen: bool = False
) -> jax.Array:
    """x [..., K1..Kk] @ w [K1..Kk, N...] -> [..., N...]: every weight projection goes through here.

    The custom VJP only orders the weight gradient. dW contracts the token axes of X and dY, and
    XLA:CPU feeds its GEMM by first copying one of the two transposed; autodiff always picks
    dY, the [tokens, intermediate] one for the MLP's up/gate projections, the largest copies of
    a CPU train step (docs/benchmarks.md, "Benchmark suite runs"). Here the smaller of X and dY
    is the one transposed: dW = dot(X, dY), or for a wide input (the down projection)
    dW = dot(dY, X)^T, whose final transpose is weight-sized. Same math, same dtypes as
    autodiff's.

    `frozen`: `w` is a weight that does not train (LoRA's base): the backward computes no dW
    (and keeps no X for it), rather than leaving the unused product to the compiler.
    """
    return _dense_fwd(x, w, k, out_dtype, frozen)[0]


def _dense_fwd(x, w, k, out_dtype, frozen):
    dims = ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ()))
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)
    # frozen: an empty stand-in for X that keeps only its dtype
    return y, (jnp.empty((0,), x.dtype) if frozen else x, w)


def _dense_bwd(k, out_dtype, frozen, res, g):
    del out_dtype
    x, w = res
    n_out = w.ndim - k
    lead = g.ndim - n_out
    g = g.astype(x.dtype)
    g_x = jax.lax.dot_general(
        g,
        w,
        ((tuple(range(lead, lead + n_out)), tuple(range(k, k + n_out))), ((), ())),
        preferred_element_type=x.dtype,
    )
    if frozen:
        return g_x, None
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
    """x [B, T, E] -> roped q [B, T, H, D] and k, v [B, T, KV, D]. The layer pieces read weights
    as `layer_weights` gives them (compute dtype, gathered), the head as `head_weights` does.
    Qwen3 (`Family.qk_norm`) RMS-normalises each head of q and k over head_dim before rope."""
    q, k, v = (project(cfg, p, name, x) for name in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.family_spec.qk_norm:
        q = rms_norm(q, p["q_norm"]["scale"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"]["scale"], cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    return (
        constrain(q, ("act_batch", "act_len", "act_heads", "head_dim")),
        apply_rope(k, positions, inv_freq),
        v,
    )


def attention_out(cfg: ModelConfig, p: dict[str, jax.Array], out: jax.Array) -> jax.Array:
    return project(cfg, p, "wo", out, 2)


def mlp(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    hidden = jax.nn.silu(project(cfg, p, "w_gate", x)) * project(cfg, p, "w_up", x)
    hidden = constrain(hidden, ("act_batch", "act_len", "act_mlp"))
    return project(cfg, p, "w_down", hidden)


def project(cfg: ModelConfig, p: Params, name: str, x: jax.Array, k: int = 1) -> jax.Array:
    """x through the weight `p[name]` (its first `k` axes contracted), plus its LoRA adapter
    where it has one: (x A) B * scale, PEFT's y = W x + B A x * scale. Under LoRA the base
    weight is frozen (`dense`'s `frozen`)."""
    y = dense(x, p[name], k, frozen=cfg.lora is not None)
    adapter = p.get(f"{name}_lora")
    if adapter is None:
        return y
    low = dense(x, adapter["a"], k) * jnp.asarray(cfg.lora.scale, x.dtype)
    return y + dense(low, adapter["b"], 1)


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [B, T, E] in the compute dtype; under LoRA the trainable rows of
    `LoraSpec.token_ids` (PEFT's trainable tokens) in place of the base's."""
    x = jnp.take(params["embedding"], tokens, axis=0).astype(cfg.compute_dtype)
    if cfg.lora_tokens:
        rows = params["lora_tokens"]["embedding"].astype(cfg.compute_dtype)
        for i, token in enumerate(cfg.lora.token_ids):
            x = jnp.where((tokens == token)[..., None], rows[i], x)
    return x


class Head(NamedTuple):
    """The output projection as the head reads it (`head_weights`): `w` [E, V], and under LoRA
    the trainable columns [E, n] of `LoraSpec.token_ids` that replace w's (else None)."""

    w: jax.Array
    token_cols: jax.Array | None = None


def lm_logits(cfg: ModelConfig, x: jax.Array, head: Head) -> jax.Array:
    """Final-normed hidden states [B, T, E] @ head [E, V] -> float32 logits [B, T, V]."""
    logits = dense(x, head.w, 1, jnp.float32, frozen=cfg.lora is not None)
    if head.token_cols is not None:
        cols = dense(x, head.token_cols, 1, jnp.float32)
        vocab = jax.lax.broadcasted_iota(jnp.int32, (logits.shape[-1],), 0)
        for i, token in enumerate(cfg.lora.token_ids):
            logits = jnp.where(vocab == token, cols[..., i : i + 1], logits)
    return constrain(logits, ("act_batch", "act_len", "act_vocab"))


def head_weights(cfg: ModelConfig, params: Params) -> Head:
    """The output projection [E, V] as the head reads it: the embedding, transposed, when tied;
    in the compute dtype, gathered over the batch mesh axes (`layer_weights` says why: its
    backward dX is the same mis-partitioned shape). Under LoRA with trainable token rows, their
    columns too: the head's own (untied) or the embedding's rows (tied, as PEFT ties them)."""
    head = params["embedding"].T if cfg.tie_embeddings else params["lm_head"]
    head = constrain(head.astype(cfg.compute_dtype), ("embed", "vocab"), replicate=BATCH_MESH_AXES)
    if not cfg.lora_tokens:
        return Head(head)
    tokens = params["lora_tokens"]
    cols = tokens["embedding"].T if cfg.tie_embeddings else tokens["lm_head"]
    return Head(head, cols.astype(cfg.compute_dtype))


def final_norm(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps)


# ---------------------------------------------------------------------------------------------
# The layer and the layer stack, shared by the training forward (`forward_hidden`) and the
# sampler's cached forward (`sampling.forward`), which passes each layer its KV-cache slot.

ACT = ("act_batch", "act_len", "act_embed")
# A layer's cache slot: (slot, keys^T [B, KV, D, T], values [B, KV, T, D]) -> the keys and
# values to attend over (same layouts, over the cache's slots) and the updated slot.
KVWrite = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array, Any]]


def layer_weights(cfg: ModelConfig, p: Params) -> Params:
    """One layer's weights as its matmuls read them: in the compute dtype (those the table
    keeps in their stored dtype, `Weight.stored_dtype`, as they are), gathered over the batch
    mesh axes, i.e. FSDP's all-gather made explicit. Sharding
    propagation gives the cast the gathered layout, so the gather moves parameter-dtype bytes
    (f32 all-gathers in the partitioned HLO of the planner's train and decode programs).

    Left to the partitioner, XLA 0.10.2 mis-partitions a projection whose weight splits its
    output dimension over "fsdp" (wo, w_down: [.., "tensor", "fsdp"]) when the result is wanted
    split over "tensor" (`act_embed`) and the batch over ("data", "fsdp"): it moves the input
    rows into ("fsdp", "data") order for the dot and never moves them back, so on a mesh with
    data, fsdp and tensor all > 1 the rows of the middle batch shards come out swapped. The same
    shape recurs in the backward (dX of wq/wk/wv/w_gate/w_up). With the weights gathered here
    no dot of the layer sees a weight split over a batch axis."""

    def one(spec: weights.Weight, w):
        if spec.stored_dtype:
            return w
        return constrain(w.astype(cfg.compute_dtype), spec.axes, replicate=BATCH_MESH_AXES)

    return jax.tree.map(one, weights.table(cfg)["layers"], p)


def decoder_layer(
    cfg: ModelConfig,
    p: Params,
    x: jax.Array,
    positions: jax.Array,
    mask: attention.Mask,
    slot: Any = None,
    kv_write: KVWrite | None = None,
) -> tuple[jax.Array, Any]:
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). `p` is one layer's weights
    (the "layers" subtree of `models.weights`, unstacked). Without a `slot` the layer attends
    over its own keys (training); with one, `kv_write` stores them and returns what to attend."""
    eps = cfg.rms_norm_eps
    p = layer_weights(cfg, p)
    q, k, v = project_qkv(cfg, p["attn"], rms_norm(x, p["attn_norm"]["scale"], eps), positions)
    keys_t, values = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    if slot is None:
        keys_t = constrain(keys_t, ("act_batch", "act_kv_heads", "head_dim", "act_len"))
        values = constrain(values, ("act_batch", "act_kv_heads", "act_len", "head_dim"))
    else:
        keys_t, values, slot = kv_write(slot, keys_t, values)
    x = x + attention_out(cfg, p["attn"], attention.apply(cfg, q, keys_t, values, mask))
    x = x + mlp(cfg, p["mlp"], rms_norm(x, p["mlp_norm"]["scale"], eps))
    return constrain(x, ACT), slot


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def unstack_layers(cfg: ModelConfig, params: Params) -> Params:
    """The params with `layers` as a tuple of per-layer trees, each sharded like its slice
    (params already so, the "tensor" sampler copy, are returned as they are). Call inside a
    jit, once per call: the sampler does, outside its decode loop, where slicing stacked
    weights would copy every weight on every step."""
    if isinstance(params["layers"], tuple):
        return params
    axes = weights.logical_axes(cfg)["layers"]
    layers = tuple(
        jax.tree.map(
            lambda ax, w, i=i: constrain(w[i], ax[1:]),
            axes,
            params["layers"],
            is_leaf=weights.is_axes,
        )
        for i in range(cfg.num_layers)
    )
    return {**params, "layers": layers}


def run_layers(
    cfg: ModelConfig,
    layers: Params | tuple[Params, ...],
    x: jax.Array,
    positions: jax.Array,
    mask: attention.Mask,
    slots: tuple[Any, ...] | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[jax.Array, tuple[Any, ...] | None]:
    """The layer stack. Training: `layers` stacked [L, ...], run under `lax.scan` (or, with
    `cfg.scan_layers` False, as an unrolled loop over slices of the same weights), with the
    config's remat policy. Cached (the sampler): `layers` from `unstack_layers` and one cache
    `slot` per layer, unrolled so that each layer updates its own buffers in place; no remat
    (nothing is differentiated)."""
    if slots is not None:
        new_slots = []
        for p_i, slot in zip(layers, slots, strict=True):
            x, slot = decoder_layer(cfg, p_i, x, positions, mask, slot, kv_write)
            new_slots.append(slot)
        return x, tuple(new_slots)
    layer = lambda p, h, pos, m: decoder_layer(cfg, p, h, pos, m)[0]
    return stack_layers(cfg, layers, layer, x, positions, mask), None


def stack_layers(cfg: ModelConfig, layers: Params, layer: Callable, carry: Any, *args: Any) -> Any:
    """`carry = layer(p, carry, *args)` for each layer's weights `p` of the stacked `layers`
    [L, ...]: under `lax.scan` (or unrolled over slices, `cfg.scan_layers` False), each layer
    rematerialised by the config's policy. The training stacks (`run_layers`,
    `run_shared_prefix_layers`) differ only in `layer` and what the carry holds."""
    if cfg.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT[cfg.remat], prevent_cse=False)
    if cfg.scan_layers:
        return jax.lax.scan(lambda c, p: (layer(p, c, *args), None), carry, layers)[0]
    for i in range(cfg.num_layers):
        carry = layer(jax.tree.map(lambda w, i=i: w[i], layers), carry, *args)
    return carry


def _keep_kv(slot: Any, keys_t: jax.Array, values: jax.Array):
    """`KVWrite` of a shared prefix's layer: attends over its own keys, hands them on."""
    del slot
    return keys_t, values, (keys_t, values)


def _after_prefix(slot: Any, keys_t: jax.Array, values: jax.Array):
    """`KVWrite` of a continuation's layer: its prefix's keys (the slot), then its own."""
    prefix_keys_t, prefix_values = slot
    keys_t = jnp.concatenate([prefix_keys_t, keys_t.astype(prefix_keys_t.dtype)], axis=-1)
    values = jnp.concatenate([prefix_values, values.astype(prefix_values.dtype)], axis=2)
    return keys_t, values, slot


def run_shared_prefix_layers(
    cfg: ModelConfig,
    layers: Params,
    prefix: jax.Array,
    rest: jax.Array,
    masks: tuple[attention.Mask, attention.Mask],
    positions: tuple[jax.Array, jax.Array],
    pick: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The training stack over rows that share prefixes: prefix rows [N, Tp, E] and the rows
    that continue them, `rest` [B, Ts, E], in P groups: the N = P * K prefix rows are each
    group's K, the B = P * G rows each group's G (row-major), and row (i, j) continues its
    group's prefix k where pick[i, j, k] = 1 (`prefix_pick`). In each layer the prefixes attend over
    themselves, and each continuation over its prefix's keys and values (`select_prefix`) then
    its own: the values of the unshared stack over the concatenated rows, with each prefix
    computed once however many rows continue it (autodiff sums their gradients into it).
    `masks`, `positions`: (prefix, rest); the rest's mask is a cached one over [Tp | Ts] keys
    (`attention.prepare`)."""

    def layer(p, carry, positions, masks, pick):
        x, xs = carry
        x, (keys_t, values) = decoder_layer(cfg, p, x, positions[0], masks[0], (), _keep_kv)
        shared = (select_prefix(keys_t, pick), select_prefix(values, pick))
        xs, _ = decoder_layer(cfg, p, xs, positions[1], masks[1], shared, _after_prefix)
        return x, xs

    return stack_layers(cfg, layers, layer, (prefix, rest), positions, masks, pick)


def prefix_pick(n: int, prefix_of: jax.Array) -> jax.Array:
    """One-hot [P, G, K] of which of its group's K prefixes each row (i, j) continues, for `n`
    prefix rows [P * K] and `prefix_of` [P, G] in [0, K)."""
    p = prefix_of.shape[0]
    if prefix_of.ndim != 2 or n % p:
        raise ValueError(f"{n} prefix rows for prefix_of {prefix_of.shape}: expected [P, G], P | n")
    return jax.nn.one_hot(prefix_of, n // p, dtype=jnp.int32)


def select_prefix(x: jax.Array, pick: jax.Array) -> jax.Array:
    """x [P * K, ...] (each group's K prefixes) -> [P * G, ...]: row (i, j) gets prefix
    (i, k) where pick[i, j, k] = 1. A contraction within each group rather than a gather, so
    the backward is one too (the sum over the G rows that share a prefix), not a scatter."""
    p, g, k = pick.shape
    grouped = x.reshape(p, k, *x.shape[1:])
    out = jnp.einsum("pgk,pk...->pg...", pick.astype(x.dtype), grouped)
    return out.reshape(p * g, *x.shape[1:])


def forward_hidden(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    mask: attention.Mask,
    logits_at: jax.Array | None = None,
    slots: tuple[Any, ...] | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[jax.Array, tuple[Any, ...] | None]:
    """Embedding -> layers -> final norm: hidden states [B, T, E] (or [B, 1, E] at positions
    `logits_at` [B]) ready for the head, and the updated cache slots. Callers apply the head
    (`logits`, or `api.token_logprobs` in chunks) and build `mask` (`attention.prepare`)."""
    x = constrain(embed(cfg, params, tokens), ACT)
    x, slots = run_layers(cfg, params["layers"], x, positions, mask, slots, kv_write)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)
    return final_norm(cfg, params, x), slots


def self_attention_mask(cfg: ModelConfig, segments: jax.Array) -> attention.Mask:
    """The training forward's mask: tokens [B, T] at slots 0..T-1 see their own segment."""
    slots = jnp.broadcast_to(jnp.arange(segments.shape[1], dtype=jnp.int32), segments.shape)
    return attention.prepare(cfg, slots, segments, segments, self_attn=True)


def logits(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """The head over final-normed hidden states: float32 logits [B, T, V]."""
    return lm_logits(cfg, hidden, head_weights(cfg, params))
