"""Functional entry points over the decoder: params are plain pytrees of arrays."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from rcgrpo_jax.models import attention, decoder, sharding, weights
from rcgrpo_jax.models.config import SAMPLER_WEIGHTS, ModelConfig
from rcgrpo_jax.models.weights import Params

_INITS = {
    "normal": nn.initializers.normal(0.02),
    "ones": nn.initializers.ones,
    "zeros": nn.initializers.zeros,
}


class _Declare(nn.Module):
    """Draws the random init of the weights under `prefix` in `models.weights` (Flax scopes keep
    the random stream of each weight tied to its path: one child scope per path component, the
    stacked layers under `nn.scan`, one key per layer)."""

    cfg: ModelConfig
    prefix: tuple[str, ...] = ()

    @nn.compact
    def __call__(self, carry: None = None) -> tuple[None, None]:
        cfg, n = self.cfg, len(self.prefix)
        children: list[str] = []
        for w in weights.base_weights(cfg):  # LoRA's rows: `lora.init_lora`
            if w.path[:n] != self.prefix:
                continue
            if len(w.path) == n + 1:
                self.param(w.name, _INITS[w.init], w.shape(cfg), cfg.weight_dtype)
            elif w.path[n] not in children:
                children.append(w.path[n])
        for child in children:
            path = (*self.prefix, child)
            if path == ("layers",):
                stack = nn.scan(
                    _Declare,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    length=cfg.num_layers,
                )
                stack(cfg, path, name=child)(None)
            else:
                _Declare(cfg, path, name=child)()
        return carry, None


def param_shapes(cfg: ModelConfig) -> Params:
    """Abstract params (ShapeDtypeStruct leaves) — no memory is allocated."""
    return weights.shapes(cfg)


def param_logical_axes(cfg: ModelConfig) -> Params:
    """Pytree of logical-axis tuples, one per weight (`models.weights`)."""
    return weights.logical_axes(cfg)


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    return sharding.tree_shardings(mesh, param_logical_axes(cfg), param_shapes(cfg))


_SAMPLER_REPLICATE = ("data", "fsdp")


def _per_layer(cfg: ModelConfig, tree: Params, leaf) -> Params:
    """`tree` with its stacked `layers` [L, ...] as a tuple of L per-layer trees (`leaf` maps a
    stacked leaf to its per-layer one, the layer index as its second argument)."""
    layers = tuple(
        jax.tree.map(lambda x, i=i: leaf(x, i), tree["layers"], is_leaf=weights.is_axes)
        for i in range(cfg.num_layers)
    )
    return {**tree, "layers": layers}


def _sampler_axes(cfg: ModelConfig) -> Params:
    return _per_layer(cfg, param_logical_axes(cfg), lambda ax, _: ax[1:])


def _sampler_table(cfg: ModelConfig) -> Params:
    return _per_layer(cfg, weights.table(cfg), lambda w, _: w)


def sampler_param_shapes(cfg: ModelConfig) -> Params:
    """Abstract weights of the "tensor" sampler layout: the compute dtype (or as stored, where
    the table says `stored_dtype`: the forward casts every other weight to the compute dtype
    where it is used, so casting it beforehand changes no value), `layers` a tuple of
    per-layer trees (the sampler's cached forward reads them so; stored that way, its
    programs slice nothing)."""
    per_layer = lambda s, _: jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
    shapes = _per_layer(cfg, param_shapes(cfg), per_layer)
    cast = lambda s: jax.ShapeDtypeStruct(s.shape, cfg.compute_dtype)
    return jax.tree.map(lambda w, s: s if w.stored_dtype else cast(s), _sampler_table(cfg), shapes)


def sampler_param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    return sharding.tree_shardings(
        mesh, _sampler_axes(cfg), sampler_param_shapes(cfg), replicate=_SAMPLER_REPLICATE
    )


@functools.cache
def _sampler_copy(cfg: ModelConfig, mesh: Mesh | None):
    from rcgrpo_jax.models import lora

    base = cfg.base()
    table = _sampler_table(base)

    def cast(params):
        if cfg.lora is not None:  # folded in once per copy: each step reads one weight
            params = lora.merge(cfg, params)
        unstacked = _per_layer(base, params, lambda w, i: w[i])
        return jax.tree.map(
            lambda spec, w: w if spec.stored_dtype else w.astype(base.compute_dtype),
            table, unstacked,
        )  # fmt: skip

    out = None if mesh is None else sampler_param_shardings(base, mesh)
    return jax.jit(cast, out_shardings=out)


def sampler_config(cfg: ModelConfig, layout: str = "tensor") -> ModelConfig:
    """The model a sampling session runs under `layout`: "tensor"'s copy holds the base with
    any LoRA adapters folded in (`cfg.base()`; the copy is made anyway, and each decode step
    then reads one weight per projection), "train" reads the state's own tree and applies the
    adapters on the fly (`cfg`; no second copy of the base)."""
    if layout not in SAMPLER_WEIGHTS:
        raise ValueError(f"sampler weights {layout!r}; expected one of {SAMPLER_WEIGHTS}")
    return cfg.base() if layout == "tensor" else cfg


def sampler_params(cfg: ModelConfig, params: Params, layout: str = "tensor") -> Params:
    """The weights a sampling session reads under `layout` (one of SAMPLER_WEIGHTS), for the
    model `sampler_config(cfg, layout)`: `params` themselves for "train"; for "tensor", a copy
    in the compute dtype laid out over the tensor axis only, one tree per layer, adapters
    merged. Sampling from either gives the same values up to the matmuls' partitioning (and,
    under LoRA, the merge's rounding)."""
    sampler_config(cfg, layout)  # checks the layout
    if layout == "train":
        return params
    mesh = params_mesh(params)
    with sharding.use_mesh(mesh):
        return _sampler_copy(cfg, mesh)(params)


@functools.cache
def _init_program(cfg: ModelConfig, mesh: Mesh | None):
    """The jitted random init of `cfg` on `mesh`: one program per (cfg, mesh) and process, so
    every stage that starts from the random init reuses it (a new `jax.jit` per call would
    trace and lower it again)."""

    def init(key):
        return _Declare(cfg).init(key)["params"]

    return jax.jit(init, out_shardings=None if mesh is None else param_shardings(cfg, mesh))


def init_params(cfg: ModelConfig, rng: jax.Array, mesh: Mesh | None = None) -> Params:
    """Random params (the tiny from-scratch model); created sharded when a mesh is given."""
    with sharding.use_mesh(mesh):
        return _init_program(cfg, mesh)(rng)


@flax.struct.dataclass
class SharedPrefix:
    """Prefix rows that several rows continue (`shared_prefix_logprobs`), in P groups of K
    prefixes and G rows: tokens [P * K, Tp] (real on slots < length, then padding), length
    [P * K] int32, and of [P, G] int32 in [0, K): which of its group's prefixes each row
    (i, j), row i * G + j of the continuing rows, follows."""

    tokens: jax.Array
    length: jax.Array
    of: jax.Array


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Per-row positions that start at 0 on the first real token (left padding shifts nothing)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def apply(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    logits_at: jax.Array | None = None,
) -> jax.Array:
    """The decoder as a pure function (call it inside your own jit): float32 logits [B, T, V]
    (or [B, 1, V] at positions `logits_at` [B])."""
    mask = decoder.self_attention_mask(cfg, segments)
    hidden, _ = decoder.forward_hidden(cfg, params, tokens, positions, mask, logits_at)
    return decoder.logits(cfg, params, hidden)


LOGITS_CHUNK_BYTES = 1 << 30  # f32 logits of one head chunk, per device (`head_chunk`)


def head_chunk(cfg: ModelConfig, batch: int, chunk: int = 512) -> int:
    """Positions per head chunk of `token_logprobs`: `chunk`, or fewer (>= 16) when one chunk's
    [B, chunk, V] f32 logits on a device would exceed LOGITS_CHUNK_BYTES. A small model with a
    152k vocabulary at 64 rows holds 39 MB of logits per position: 20 GB at 512 positions."""
    b, v = batch, cfg.vocab_size
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(mesh.axis_names) == set(sharding.MESH_AXES):
        spec = sharding.logical_to_spec(("act_batch", "act_vocab"), (b, v), mesh)
        ways = [math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax or ()))
                for ax in spec]  # fmt: skip
        b, v = -(-b // ways[0]), -(-v // ways[1])
    return max(16, min(chunk, LOGITS_CHUNK_BYTES // (4 * b * v)))


def token_logprobs(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    *,
    chunk: int = 512,
    at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p(tokens[:, t+1] | <= t), entropy at t, valid) — each [B, T-1], float32.

    With `at` [B, K] int32 target positions (into the T axis of `tokens`), the three are [B, K]
    for the targets tokens[b, at[b, k]] instead: only the K hidden states that predict them are
    gathered before the head, which is what a loss over a few hundred of T positions needs (the
    head is the largest single cost at a 152k vocabulary). Position 0 has no prediction: its
    entries are not `valid` (index padding points there, `data.packing.loss_index`).

    The head runs over `chunk` positions at a time (fewer when the logits would pass
    `head_chunk`'s byte bound) under `jax.checkpoint`, so neither the forward nor the backward
    pass holds more than [B, chunk, V] logits. Rows that fit one chunk skip the checkpoint: their
    logits are within that bound already, and recomputing them would cost one more head matmul.
    `valid` marks targets in the same non-zero segment as their context (packed examples never
    predict across a boundary). Both SFT and RL losses are built on this one function.
    """
    mask = decoder.self_attention_mask(cfg, segments)
    hidden, _ = decoder.forward_hidden(cfg, params, tokens, positions, mask)
    return _predictions(cfg, params, hidden, tokens, segments, at, chunk)


def _predictions(cfg, params, hidden, tokens, segments, at, chunk):
    """`token_logprobs`' three values from final-normed hidden states [B, T, E] of `tokens`
    [B, T] (or [B, T - 1, E]: the last token's, which predicts nothing, never computed)."""
    tokens = tokens.astype(jnp.int32)
    if at is None:
        hidden, targets = hidden[:, : tokens.shape[1] - 1], tokens[:, 1:]
        seg, prev = segments[:, 1:], segments[:, :-1]
    else:
        at = at.astype(jnp.int32)
        src = jnp.maximum(at - 1, 0)  # the position whose hidden state predicts the target
        hidden = jnp.take_along_axis(hidden, src[..., None], axis=1)
        targets = jnp.take_along_axis(tokens, at, axis=1)
        seg, prev = (jnp.take_along_axis(segments, i, axis=1) for i in (at, src))
    logp, ent = _head_logprobs(cfg, params, hidden, targets, chunk)
    valid = (seg == prev) & (seg > 0)
    if at is not None:
        valid &= at > 0
    return logp, ent, valid


def shared_prefix_logprobs(
    cfg: ModelConfig,
    params: Params,
    prefix: SharedPrefix,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    *,
    chunk: int = 512,
    at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_logprobs` of rows [B, Ts] that each continue one of a few shared prefixes: row
    (i, j) is its group's prefix `prefix.of[i, j]` then `tokens[i * G + j]`, and the values are
    those of `token_logprobs` over that concatenation, for the targets in `tokens` (positions
    into its Ts axis; position 0, whose context is the prefix alone, has none). `positions`
    continue the prefix's (its real token count, `prefix.length`). Each prefix runs through the
    stack once however many rows continue it: G rollouts of one prompt pay for it once. The
    stack runs over the rows' first Ts - 1 positions: the last one's hidden state would predict
    past the piece, so its token is a target only (`data.packing.shared_prompts` sizes the
    pieces to a bucket plus that one)."""
    n, tp = prefix.tokens.shape
    targets, target_segments = tokens, segments
    tokens, positions, segments = tokens[:, :-1], positions[:, :-1], segments[:, :-1]
    b, ts = tokens.shape
    pre_positions = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (n, tp))
    pre_segments = (pre_positions < prefix.length[:, None]).astype(jnp.int32)
    # the rows' queries sit at slots Tp.. over the keys [their prefix's Tp | their own Ts]
    slots = jnp.broadcast_to(tp + jnp.arange(ts, dtype=jnp.int32), (b, ts))
    pick = decoder.prefix_pick(n, prefix.of)
    kv_segments = jnp.concatenate([decoder.select_prefix(pre_segments, pick), segments], axis=1)
    masks = (
        decoder.self_attention_mask(cfg, pre_segments),
        attention.prepare(cfg, slots, segments, kv_segments, self_attn=False),
    )
    embed = lambda x: sharding.constrain(decoder.embed(cfg, params, x), decoder.ACT)
    _, hidden = decoder.run_shared_prefix_layers(
        cfg, params["layers"], embed(prefix.tokens), embed(tokens), masks,
        (pre_positions, positions), pick,
    )  # fmt: skip
    hidden = decoder.final_norm(cfg, params, hidden)
    return _predictions(cfg, params, hidden, targets, target_segments, at, chunk)


def _head_logprobs(
    cfg: ModelConfig, params: Params, hidden: jax.Array, targets: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """(log p(targets), entropy), each [B, N], of the head over hidden states [B, N, E], in
    checkpointed chunks of positions when N is over one chunk (`token_logprobs`)."""
    b, t, e = hidden.shape
    head = decoder.head_weights(cfg, params)
    chunk = head_chunk(cfg, b, chunk)

    def one(h, y):
        logits = decoder.lm_logits(cfg, h, head)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp_all, y[..., None], axis=-1)[..., 0]
        return picked, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    n = -(-t // chunk)
    if n == 1:
        return one(hidden, targets)
    chunk = -(-t // n)  # as even as n chunks allow: at most n - 1 padded positions
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, e)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk)
    xs = (jnp.swapaxes(hidden, 0, 1), targets.swapaxes(0, 1))
    _, (logp, ent) = jax.lax.scan(lambda _, x: (None, jax.checkpoint(one)(*x)), None, xs)
    logp = jnp.swapaxes(logp, 0, 1).reshape(b, n * chunk)[:, :t]
    ent = jnp.swapaxes(ent, 0, 1).reshape(b, n * chunk)[:, :t]
    return logp, ent


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array):
    mask = attention_mask.astype(jnp.int32)
    logits = apply(cfg, params, tokens, positions_from_mask(mask), mask)
    return logits


def forward(
    cfg: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array | None = None
) -> jax.Array:
    """Logits [B, T, V] in float32. attention_mask: 1 = real token, 0 = padding (left or right).

    Sharded params run sharded; activations follow the mesh of the surrounding `use_mesh` context,
    or that of the params when there is none.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    if attention_mask is None:
        attention_mask = jnp.ones_like(tokens)
    mesh = params_mesh(params)
    if mesh is not None and jax.sharding.get_abstract_mesh().empty:
        with sharding.use_mesh(mesh):
            return _forward(cfg, params, tokens, jnp.asarray(attention_mask))
    return _forward(cfg, params, tokens, jnp.asarray(attention_mask))


def params_mesh(params: Params) -> Mesh | None:
    """The multi-device mesh the params are sharded over, or None (single device)."""
    leaf = jax.tree.leaves(params)[0]
    s = getattr(leaf, "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def resize_vocab(cfg: ModelConfig, params: Params, vocab_size: int) -> tuple[ModelConfig, Params]:
    """Grows the vocabulary (e.g. for reward tokens): new embedding rows — and new columns of an
    untied lm_head — are the mean of the old ones, so new tokens start as an "average" token."""
    extra = vocab_size - cfg.vocab_size
    if extra < 0:
        raise ValueError(f"cannot shrink vocab from {cfg.vocab_size} to {vocab_size}")
    if extra == 0:
        return cfg, params
    new_cfg = cfg.replace(vocab_size=vocab_size)
    mesh = params_mesh(params)

    def grow(w: jax.Array, axis: int) -> jax.Array:
        mean = jnp.mean(w.astype(jnp.float32), axis=axis, keepdims=True).astype(w.dtype)
        return jnp.concatenate([w, jnp.repeat(mean, extra, axis=axis)], axis=axis)

    out = dict(params)
    out["embedding"] = grow(params["embedding"], 0)
    if not cfg.tie_embeddings:
        out["lm_head"] = grow(params["lm_head"], 1)
    if mesh is not None:
        out = jax.device_put(out, param_shardings(new_cfg, mesh))
    return new_cfg, out


def mean_init_rows(cfg: ModelConfig, params: Params, ids: list[int], n_old: int) -> Params:
    """Sets embedding rows (and untied lm_head columns) `ids` to the mean over the first `n_old`
    rows — for tokens added inside a checkpoint's padded vocabulary."""
    idx = jnp.asarray(ids, jnp.int32)
    out = dict(params)
    emb = params["embedding"]
    out["embedding"] = emb.at[idx].set(
        jnp.mean(emb[:n_old].astype(jnp.float32), 0).astype(emb.dtype)
    )
    if not cfg.tie_embeddings:
        head = params["lm_head"]
        mean = jnp.mean(head[:, :n_old].astype(jnp.float32), 1).astype(head.dtype)
        out["lm_head"] = head.at[:, idx].set(mean[:, None])
    mesh = params_mesh(params)
    return jax.device_put(out, param_shardings(cfg, mesh)) if mesh is not None else out
