"""Attention kernels behind one masking rule, chosen by `ModelConfig.attention`.

The rule: a query at slot q sees key slot s iff s <= q and both carry the same non-zero segment
id (0 = padding / empty). It covers left and right padding, packed sequences and KV-cache
continuation. Every kind computes it; they differ in what they hold in memory:

- `dense`: scores [B, H, T, S] in one piece (the self-attention of training splits the queries
  into `causal_blocks` and skips the blocks above the diagonal). Fastest on CPU at short lengths.
- `flash`: pure-JAX blockwise attention: an online softmax over key blocks, and a custom VJP that
  stores only the output and the log-sum-exp and recomputes each block in the backward pass, so
  memory is O(T * block). Blocks that no query of the batch can see (above the causal diagonal,
  all padding, disjoint segments) are skipped. Portable; the fallback everywhere.
- `splash`: Pallas splash attention (TPU): causal mask + segment ids, shard_mapped over the
  mesh's batch and head axes. Explicit `splash` off a TPU raises (the Pallas interpreter would
  run it, orders of magnitude slower); tests call `splash(..., interpret=True)`.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (GPU): causal + per-row
  lengths, so only rows that hold one segment from slot 0 (right padding) qualify.

`auto` picks per backend (`resolve`). The sampler's cached attention (prefill chunks and decode
steps at per-row cache offsets) is `dense` or `flash`: splash's static mask and cuDNN's lengths
cannot express a per-row offset, so `splash`/`cudnn` models attend there with `flash`, and
`auto` takes dense up to DENSE_MAX_LEN keys (a one-token decode step's scores are small).

Layouts are those of the KV cache: q [B, T, H, D], keys transposed [B, KV, D, S], values
[B, KV, S, D]; grouped-query heads are handled by reshaping q to [B, KV, G, T, D], never by
repeating keys or values.

One module, long because the kinds share the masking rule, the block bookkeeping and the
cache layouts: each kind's forward and backward stay next to the rule they must agree on.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import constrain

_MASKED = -1e30  # finite, so rows with no visible key (padding queries) give no NaN
DENSE_MAX_LEN = 1024  # `auto` on CPU and for cached attention: dense up to this many keys
SPLASH_BLOCK = 512  # splash's largest block (it needs multiples of 128)

_Q_AXES = ("act_batch", "act_kv_heads", None, None, None)  # [B, KV, G, T, D]


# ---------------------------------------------------------------------------------------------
# Choosing the kernel


def resolve(
    kind: str,
    *,
    backend: str,
    self_attn: bool,
    kv_len: int,
    head_dim: int,
    dtype: jnp.dtype,
) -> str:
    """The kernel a call runs: `kind` itself, or for `auto` the backend's choice (`_auto`).

    Cached attention (`self_attn=False`) is dense or flash only: an explicit splash/cudnn runs
    flash there. Explicit `cudnn` off a GPU (or with a dtype/head_dim it does not take) and
    explicit `splash` off a TPU raise here, when the mask is built, not deep inside a kernel.
    """
    if kind == "auto":
        return _auto(backend, self_attn, kv_len, head_dim, dtype)
    problem = _backend_problem(kind, backend, head_dim, dtype)
    if problem is not None:
        raise ValueError(f"model.attention={kind!r}: {problem}; use 'auto' or 'flash'")
    if not self_attn and kind in ("splash", "cudnn"):
        return "flash"  # per-row cache offsets: see the module docstring
    return kind


def _auto(backend: str, self_attn: bool, kv_len: int, head_dim: int, dtype: jnp.dtype) -> str:
    """`auto`: the training self-attention on a TPU -> splash at head_dim % 128 == 0, else
    flash; on a GPU -> cudnn where its shapes/dtypes apply (rows it cannot express take flash at
    run time), else flash. Everywhere else (CPU; cached attention on every backend): dense up to
    DENSE_MAX_LEN keys, flash beyond. Dense keeps the CPU's calibrated numerics at short lengths
    and costs little where the scores are small (a decode step's [B, H, 1, S]); flash bounds
    them when a long prefill chunk would hold [B, H, T, S]."""
    if self_attn and backend == "tpu":
        return "splash" if head_dim % 128 == 0 else "flash"
    if self_attn and backend == "gpu":
        return "cudnn" if _backend_problem("cudnn", backend, head_dim, dtype) is None else "flash"
    return "dense" if kv_len <= DENSE_MAX_LEN else "flash"


def _backend_problem(kind: str, backend: str, head_dim: int, dtype: jnp.dtype) -> str | None:
    """Why an explicit `kind` cannot run on `backend` (None: it can)."""
    if kind == "cudnn":
        return _cudnn_problem(backend, head_dim, dtype)
    if kind == "splash" and backend != "tpu":
        return (
            f"Pallas splash attention needs a TPU backend, this one is {backend!r} (off a TPU "
            "only the Pallas interpreter runs it, orders of magnitude slower)"
        )
    return None


def _cudnn_problem(backend: str, head_dim: int, dtype: jnp.dtype) -> str | None:
    if backend != "gpu":
        return f"needs a GPU backend, this one is {backend!r}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16/float16, the compute dtype is {dtype}"
    if head_dim > 128 or head_dim % 8:
        return f"cuDNN flash attention takes head_dim <= 128 and a multiple of 8, not {head_dim}"
    return None


@flax.struct.dataclass
class Mask:
    """What a layer's attention needs besides q/k/v, built once per forward by `prepare`:
    the slots and segments of the rule, plus the chosen kernel's own precomputation."""

    q_slot: jax.Array  # [B, T] int32
    q_seg: jax.Array  # [B, T] int32
    kv_seg: jax.Array  # [B, S] int32
    dense: jax.Array | None = None  # [B, T, S] bool: the rule, materialised (kind dense)
    live: jax.Array | None = None  # [nq, nk] bool: blocks some query sees (flash, cudnn+flash)
    simple: jax.Array | None = None  # bool: every row is one segment from slot 0 (cudnn)
    kind: str = flax.struct.field(pytree_node=False, default="dense")
    self_attn: bool = flax.struct.field(pytree_node=False, default=True)
    fallback: bool = flax.struct.field(pytree_node=False, default=False)  # cudnn: else flash


def prepare(
    cfg: ModelConfig,
    q_slot: jax.Array,
    q_seg: jax.Array,
    kv_seg: jax.Array,
    *,
    self_attn: bool,
    backend: str | None = None,
) -> Mask:
    """The `Mask` for queries at slots `q_slot` [B, T] with segments `q_seg` over keys at slots
    0..S-1 with segments `kv_seg` [B, S]. `self_attn`: the training forward (q_slot = 0..T-1
    over the same T tokens); else cached attention (prefill/decode)."""
    backend = jax.default_backend() if backend is None else backend
    t, s = q_slot.shape[1], kv_seg.shape[1]
    kind = resolve(
        cfg.attention,
        backend=backend,
        self_attn=self_attn,
        kv_len=s,
        head_dim=cfg.head_dim,
        dtype=cfg.compute_dtype,
    )
    m = Mask(q_slot, q_seg, kv_seg, kind=kind, self_attn=self_attn)
    if kind == "dense":
        return m.replace(dense=segment_mask(q_slot, q_seg, kv_seg))
    blocks = flash_blocks(t, s, cfg.flash_block)
    if kind == "flash":
        return m.replace(live=block_liveness(q_slot, q_seg, kv_seg, blocks))
    if kind == "cudnn":
        simple = one_segment_rows(q_seg)
        if cfg.attention == "auto":  # rows cuDNN cannot express run through flash
            live = block_liveness(q_slot, q_seg, kv_seg, blocks)
            return m.replace(simple=simple, live=live, fallback=True)
        jax.debug.callback(_check_simple, simple)
        return m.replace(simple=simple)
    return m


def _check_simple(simple) -> None:
    if not bool(simple):
        raise ValueError(
            "model.attention='cudnn' takes rows holding one segment from slot 0 (right padding "
            "only); this batch has packed or left-padded rows: use 'auto' or 'flash'"
        )


def one_segment_rows(seg: jax.Array) -> jax.Array:
    """Whether every row of segments [B, T] is one non-zero id on slots [0, n), then zeros (an
    all-padding row, n = 0, qualifies: `cudnn_lengths` gives it length 1, `cudnn` zeroes it)."""
    n = jnp.sum(seg > 0, axis=1, keepdims=True)
    slots = jnp.arange(seg.shape[1], dtype=jnp.int32)[None, :]
    return jnp.all(jnp.where(slots < n, seg == seg[:, :1], seg == 0))


def apply(
    cfg: ModelConfig, q: jax.Array, keys_t: jax.Array, values: jax.Array, m: Mask
) -> jax.Array:
    """Attention of q [B, T, H, D] over keys_t [B, KV, D, S] / values [B, KV, S, D] under `m`,
    through the kernel `prepare` chose; returns [B, T, H, D] in the compute dtype."""
    if m.kind == "dense":
        fn = attend_causal if m.self_attn else attend
        return fn(cfg, q, keys_t, values, m.dense)
    if m.kind == "flash":
        return flash(cfg, q, keys_t, values, m.q_slot, m.q_seg, m.kv_seg, live=m.live)
    if m.kind == "splash":
        return splash(cfg, q, keys_t, values, m.q_seg, m.kv_seg)
    if m.kind == "cudnn":
        if not m.fallback:
            return cudnn(cfg, q, keys_t, values, m.q_seg)
        return jax.lax.cond(
            m.simple,
            lambda q, k, v: cudnn(cfg, q, k, v, m.q_seg),
            lambda q, k, v: flash(cfg, q, k, v, m.q_slot, m.q_seg, m.kv_seg, live=m.live),
            q,
            keys_t,
            values,
        )
    raise ValueError(f"unknown attention kind {m.kind!r}")


# Passes of the forward attention (QK^T and PV: 2 matmuls) per train step, backward included.
# dense: backward dP, dV, dQ, dK -> 2 + 4 = 6 matmuls, 3 passes. flash and cuDNN (FlashAttention-2
# style): one backward kernel recomputes QK^T, then dV, dP, dQ, dK -> 2 + 5 = 7, 3.5 passes.
# splash with its separate dq kernel (`_splash_kernel`): dkv recomputes QK^T, then dV, dP, dK (4),
# dq recomputes QK^T, then dP, dQ (3) -> 2 + 4 + 3 = 9 matmuls, 4.5 passes.
ATTENTION_PASSES = {"dense": 3.0, "flash": 3.5, "cudnn": 3.5, "splash": 4.5}


def flop_units(kind: str, t: int, flash_block: int) -> tuple[float, float]:
    """(fraction of the causal T x T the forward computes, passes of it per train step) for a
    kernel at length t: the planner's hardware FLOPs. Dense skips `causal_blocks`; the
    blockwise kernels skip the blocks above the diagonal (flash/cuDNN: `flash_blocks`; splash:
    its own block on the 128-padded length). Passes: `ATTENTION_PASSES`."""
    if kind == "dense":
        n = causal_blocks(t)
    elif kind == "splash":
        tp = -(-t // 128) * 128
        n = tp // _splash_block(tp)
    else:
        n = flash_blocks(t, t, flash_block)[0]
    return (n + 1) / (2 * n), ATTENTION_PASSES[kind]


# ---------------------------------------------------------------------------------------------
# dense


def segment_mask(
    q_slot: jax.Array, q_segments: jax.Array, kv_segments: jax.Array, k_start: int | jax.Array = 0
) -> jax.Array:
    """[B, T, S]: query at slot q_slot[b, t] sees key slot s iff s <= q_slot and both carry the
    same non-zero segment (the one masking rule). The keys are slots k_start .. k_start + S - 1:
    0 for a whole cache or sequence (dense), a block's first slot inside `flash`."""
    kv_slot = k_start + jnp.arange(kv_segments.shape[1], dtype=jnp.int32)
    return (
        (kv_slot[None, None, :] <= q_slot[:, :, None])
        & (kv_segments[:, None, :] == q_segments[:, :, None])
        & (kv_segments[:, None, :] > 0)
    )


@jax.custom_vjp
def _weighted_values(probs: jax.Array, values: jax.Array) -> jax.Array:
    """probs [B, KV, G, T, S] @ values [B, KV, S, D] -> [B, KV, G, T, D].

    Custom VJP: autodiff's dValues contracts the query axes of probs, and XLA:CPU copies the
    whole [.., T, S] probs transposed to feed it; here the small output gradient is the
    transposed operand and dValues^T [.., D, S] is turned around after.
    """
    return jnp.einsum("bkgts,bksd->bkgtd", probs, values)


def _weighted_values_fwd(probs, values):
    return _weighted_values(probs, values), (probs, values)


def _weighted_values_bwd(res, g):
    probs, values = res
    g_probs = jnp.einsum("bkgtd,bksd->bkgts", g.astype(probs.dtype), values)
    g_values_t = jax.lax.dot_general(
        g.astype(values.dtype),
        probs.astype(values.dtype),
        (((2, 3), (2, 3)), ((0, 1), (0, 1))),
        preferred_element_type=values.dtype,
    )  # [B, KV, D, S]
    return g_probs.astype(probs.dtype), g_values_t.transpose(0, 1, 3, 2)


_weighted_values.defvjp(_weighted_values_fwd, _weighted_values_bwd)


def _grouped(q: jax.Array, kv: int) -> jax.Array:
    """[B, T, H, D] -> [B, KV, G, T, D]: query heads grouped under their key/value head."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x: jax.Array) -> jax.Array:
    """[B, KV, G, T, D] -> [B, T, H, D]."""
    b, kv, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


def attend(
    cfg: ModelConfig, q: jax.Array, keys_t: jax.Array, values: jax.Array, mask: jax.Array
) -> jax.Array:
    """Dense grouped-query attention: q [B, T, H, D] over keys_t [B, KV, D, S] (keys
    transposed) and values [B, KV, S, D] where mask [B, T, S] allows; returns [B, T, H, D].

    Both dots are plain [.., M, K] @ [.., K, N] products: scores come out [B, KV, G, T, S], so
    neither the softmax nor the second dot relayouts the one large tensor, and a KV cache kept
    in these layouts is read as it lies (on CPU the score dot over keys stored [S, D] is several
    times slower per decode step than over keys stored [D, S]: docs/benchmarks.md, "Measured").
    """
    d = q.shape[-1]
    qg = _grouped(q, keys_t.shape[1])
    scores = jnp.einsum("bkgtd,bkds->bkgts", qg, keys_t, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * (1.0 / math.sqrt(d)), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(cfg.compute_dtype)
    out = _ungrouped(_weighted_values(probs, values))
    return constrain(out, ("act_batch", "act_len", "act_heads", "head_dim"))


def causal_blocks(t: int) -> int:
    """Query blocks `attend_causal` splits a length-t sequence into: at most 8, at least 32
    queries each. Blocks above the diagonal are skipped, so it computes (n + 1) / 2n of the
    dense attention (56% at n = 8); smaller blocks save more but add per-block overhead."""
    return max(1, min(8, t // 32))


def attend_causal(
    cfg: ModelConfig, q: jax.Array, keys_t: jax.Array, values: jax.Array, mask: jax.Array
) -> jax.Array:
    """`attend` for self-attention over one sequence, query t at key slot t (the training
    forward): the queries go in `causal_blocks` blocks, each against the keys up to its own last
    slot only. The skipped blocks are ones the causal mask discards whole, so every query that
    sees a key gets `attend`'s math (fully masked padding queries average fewer values; nothing
    reads them). What it saves on the CPU train step: docs/benchmarks.md, "Causal blocks"."""
    t = q.shape[1]
    n = causal_blocks(t)
    size = -(-t // n)
    outs = []
    for start in range(0, t, size):
        end = min(start + size, t)
        block = (q[:, start:end], keys_t[..., :end], values[:, :, :end], mask[:, start:end, :end])
        outs.append(attend(cfg, *block))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


# ---------------------------------------------------------------------------------------------
# flash


def _split(n: int, block: int) -> tuple[int, int]:
    """(blocks, block length) covering n: ceil(n / block) blocks, as even as that allows (at
    most blocks - 1 padded slots)."""
    nb = max(1, -(-n // block))
    return nb, -(-n // nb)


def flash_blocks(t: int, s: int, block: int) -> tuple[int, int, int, int]:
    """(nq, bq, nk, bk): the query and key blocking of `flash` for t queries over s keys in
    blocks of at most `block` (`ModelConfig.flash_block`)."""
    return (*_split(t, block), *_split(s, block))


def _pad_to(x: jax.Array, n: int, axis: int) -> jax.Array:
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def block_liveness(
    q_slot: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, blocks: tuple[int, int, int, int]
) -> jax.Array:
    """[nq, nk] bool: whether some query of query block i may see some key of key block j in
    some row. Per block it keeps the last real query slot, the first real key slot and the
    range of non-zero segment ids: a block pair fails if the keys all come later (causal), one
    side is all padding, or the id ranges are disjoint. One table for the whole batch, so the
    loops branch on a scalar; a block that is dead in some rows is masked there."""
    nq, bq, nk, bk = blocks
    big = jnp.iinfo(jnp.int32).max
    b = q_slot.shape[0]

    def per_block(x, valid, n, size, fill, reduce):
        x = jnp.pad(jnp.where(valid, x, fill), ((0, 0), (0, n * size - x.shape[1])),
                    constant_values=fill)  # fmt: skip
        return reduce(x.reshape(b, n, size), axis=2)

    qv, kvv = q_seg > 0, kv_seg > 0
    kv_slot = jnp.broadcast_to(jnp.arange(kv_seg.shape[1], dtype=jnp.int32), kv_seg.shape)
    q_last = per_block(q_slot, qv, nq, bq, -1, jnp.max)
    q_lo = per_block(q_seg, qv, nq, bq, big, jnp.min)
    q_hi = per_block(q_seg, qv, nq, bq, -1, jnp.max)
    k_first = per_block(kv_slot, kvv, nk, bk, big, jnp.min)
    k_lo = per_block(kv_seg, kvv, nk, bk, big, jnp.min)
    k_hi = per_block(kv_seg, kvv, nk, bk, -1, jnp.max)
    live = (
        (k_first[:, None, :] <= q_last[:, :, None])
        & (q_lo[:, :, None] <= k_hi[:, None, :])
        & (k_lo[:, None, :] <= q_hi[:, :, None])
    )
    return jnp.any(live, axis=0)


def _live_range(live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of `live` [n, m]: [first, last + 1) of its live columns (empty: (m, 0))."""
    m = live.shape[1]
    idx = jnp.arange(m, dtype=jnp.int32)
    return jnp.min(jnp.where(live, idx, m), axis=1), jnp.max(jnp.where(live, idx + 1, 0), axis=1)


def _key_block(keys_t, values, kv_seg, j, bk: int):
    """Key block j of length bk: transposed keys [B, KV, D, bk], values, segments."""
    at = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=axis)
    return at(keys_t, 3), at(values, 2), at(kv_seg, 1)


def flash(
    cfg: ModelConfig,
    q: jax.Array,
    keys_t: jax.Array,
    values: jax.Array,
    q_slot: jax.Array,
    q_seg: jax.Array,
    kv_seg: jax.Array,
    *,
    live: jax.Array | None = None,
    block: int | None = None,
) -> jax.Array:
    """Blockwise attention under the rule, never holding more than one [B, H, bq, bk] block of
    scores. Queries/keys are padded (segment 0) to whole blocks of at most `block` (None:
    `cfg.flash_block`); `live` is `block_liveness` for the same blocking (computed here when not
    given). Padding queries get zeros. Dtypes come from q/k/v."""
    t, s = q.shape[1], keys_t.shape[3]
    blocks = flash_blocks(t, s, cfg.flash_block if block is None else block)
    nq, bq, nk, bk = blocks
    if live is None:
        live = block_liveness(q_slot, q_seg, kv_seg, blocks)
    out = _flash(
        _pad_to(q, nq * bq, 1),
        _pad_to(keys_t, nk * bk, 3),
        _pad_to(values, nk * bk, 2),
        _pad_to(q_slot, nq * bq, 1),
        _pad_to(q_seg, nq * bq, 1),
        _pad_to(kv_seg, nk * bk, 1),
        live,
        bq,
        bk,
    )
    return constrain(out[:, :t], ("act_batch", "act_len", "act_heads", "head_dim"))


def _scores(qi, kj, mask, scale):
    s = jnp.einsum("bkgtd,bkds->bkgts", qi, kj, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], s, _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, keys_t, values, q_slot, q_seg, kv_seg, live, bq, bk):
    return _flash_fwd(q, keys_t, values, q_slot, q_seg, kv_seg, live, bq, bk)[0]


def _flash_fwd(q, keys_t, values, q_slot, q_seg, kv_seg, live, bq, bk):
    b, t, h, d = q.shape
    kv = keys_t.shape[1]
    g, nq = h // kv, t // bq
    scale = 1.0 / math.sqrt(d)
    qg = constrain(_grouped(q, kv), _Q_AXES)
    lo, hi = _live_range(live)

    def q_block(_, i):
        qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=3)
        slot_i = jax.lax.dynamic_slice_in_dim(q_slot, i * bq, bq, axis=1)
        seg_i = jax.lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)

        def update(j, carry):
            m, denom, acc = carry
            kj, vj, seg_j = _key_block(keys_t, values, kv_seg, j, bk)
            mask = segment_mask(slot_i, seg_i, seg_j, j * bk)
            s = _scores(qi, kj, mask, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(values.dtype), vj,
                            preferred_element_type=jnp.float32)  # fmt: skip
            return m_new, denom * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        def body(j, carry):
            return jax.lax.cond(live[i, j], update, lambda _, c: c, j, carry)

        init = (
            constrain(jnp.full((b, kv, g, bq), _MASKED, jnp.float32), _Q_AXES[:4]),
            constrain(jnp.zeros((b, kv, g, bq), jnp.float32), _Q_AXES[:4]),
            constrain(jnp.zeros((b, kv, g, bq, d), jnp.float32), _Q_AXES),
        )
        m, denom, acc = jax.lax.fori_loop(lo[i], hi[i], body, init)
        seen = denom > 0
        denom = jnp.where(seen, denom, 1.0)
        out = jnp.where(seen[..., None], acc / denom[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(denom), 0.0)
        return None, (out.astype(q.dtype), lse)

    _, (outs, lses) = jax.lax.scan(q_block, None, jnp.arange(nq))
    out = outs.transpose(1, 2, 3, 0, 4, 5).reshape(b, kv, g, t, d)  # [B, KV, G, T, D]
    lse = lses.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, t)
    res = (q, keys_t, values, q_slot, q_seg, kv_seg, live, out, lse)
    return _ungrouped(out), res


def _flash_bwd(bq, bk, res, dout):
    q, keys_t, values, q_slot, q_seg, kv_seg, live, out, lse = res
    b, t, h, d = q.shape
    kv, s = keys_t.shape[1], keys_t.shape[3]
    g, nk = h // kv, s // bk
    scale = 1.0 / math.sqrt(d)
    qg = constrain(_grouped(q, kv), _Q_AXES)
    do = constrain(_grouped(dout.astype(q.dtype), kv), _Q_AXES)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, KV, G, T]
    lo, hi = _live_range(live.T)

    def k_block(dq, j):
        kj, vj, seg_j = _key_block(keys_t, values, kv_seg, j, bk)

        def update(i, carry):
            dq, dk, dv = carry
            sl = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=axis)
            qi, do_i = sl(qg, 3), sl(do, 3)
            mask = segment_mask(sl(q_slot, 1), sl(q_seg, 1), seg_j, j * bk)
            sc = _scores(qi, kj, mask, scale)
            p = jnp.where(mask[:, None, None], jnp.exp(sc - sl(lse, 3)[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgts,bkgtd->bksd", p.astype(do_i.dtype), do_i,
                                 preferred_element_type=jnp.float32)  # fmt: skip
            dp = jnp.einsum("bkgtd,bksd->bkgts", do_i, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - sl(delta, 3)[..., None]) * scale).astype(q.dtype)
            dq_i = jnp.einsum("bkgts,bkds->bkgtd", ds, kj, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgts,bkgtd->bkds", ds, qi, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, sl(dq, 3) + dq_i, i * bq, axis=3)
            return dq, dk, dv

        def body(i, carry):
            return jax.lax.cond(live[i, j], update, lambda _, c: c, i, carry)

        init = (
            dq,
            constrain(jnp.zeros((b, kv, d, bk), jnp.float32), _Q_AXES[:2] + (None, None)),
            constrain(jnp.zeros((b, kv, bk, d), jnp.float32), _Q_AXES[:2] + (None, None)),
        )
        dq, dk, dv = jax.lax.fori_loop(lo[j], hi[j], body, init)
        return dq, (dk.astype(keys_t.dtype), dv.astype(values.dtype))

    dq0 = constrain(jnp.zeros((b, kv, g, t, d), jnp.float32), _Q_AXES)
    dq, (dks, dvs) = jax.lax.scan(k_block, dq0, jnp.arange(nk))
    dk = dks.transpose(1, 2, 3, 0, 4).reshape(b, kv, d, s)
    dv = dvs.transpose(1, 2, 0, 3, 4).reshape(b, kv, s, d)
    return _ungrouped(dq).astype(q.dtype), dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# splash (TPU)


def _splash_block(t: int) -> int:
    """splash's block length for a (128-padded) length t: the largest of 512/256/128 dividing t."""
    return next(b for b in (SPLASH_BLOCK, 256, 128) if t % b == 0)


def _splash_kernel(heads: int, t: int, interpret: bool):
    """The splash kernel for `heads` local heads at length t (built per trace: it holds arrays
    made with jnp, which inside a jit are that trace's values, so it cannot be cached).

    The backward runs splash's separate dkv and dq kernels (`use_fused_bwd_kernel=False`, 4.5
    forward passes per step, `ATTENTION_PASSES`). jax 0.10.2's fused kernel does take segment
    ids, but it writes dq unreduced, one [heads, T, D] slice per key block (T / block of them,
    in the input dtype) and sums them after: at T = 16384 that is 32 x the dq of a layer in
    memory, each partial rounded to bf16 before the sum. Until the two are compared on a TPU,
    the library's default two-kernel backward, which keeps dq O(T), is the one used."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    blk = _splash_block(t)
    sizes = sk.BlockSizes(
        block_q=blk, block_kv=blk, block_kv_compute=blk,
        block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
        block_q_dq=blk, block_kv_dq=blk,
    )  # fmt: skip
    mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * heads)
    return sk.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def splash(
    cfg: ModelConfig,
    q: jax.Array,
    keys_t: jax.Array,
    values: jax.Array,
    q_seg: jax.Array,
    kv_seg: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Causal self-attention with segment ids through Pallas splash attention, vmapped over the
    batch and, inside a mesh, shard_mapped over its batch and head axes. The length is padded
    to a multiple of 128 with segment 0. Splash lets padding queries see earlier padding keys
    (ids equal, both 0); no real query sees them, so the real rows follow the rule exactly.

    Off a TPU this raises unless `interpret` (tests only: the Pallas interpreter is far too
    slow to train with, so it must never stand in silently)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if not interpret and jax.default_backend() != "tpu":
        raise ValueError(_backend_problem("splash", jax.default_backend(), 128, q.dtype))
    t, d = q.shape[1], q.shape[3]
    tp = -(-t // 128) * 128
    qh = _pad_to((q * (1.0 / math.sqrt(d))).astype(q.dtype).transpose(0, 2, 1, 3), tp, 2)
    kh = _pad_to(keys_t.transpose(0, 1, 3, 2), tp, 2)  # [B, KV, T, D]
    vh = _pad_to(values, tp, 2)
    q_seg, kv_seg = _pad_to(q_seg, tp, 1), _pad_to(kv_seg, tp, 1)

    def local(qh, kh, vh, q_seg, kv_seg):
        kernel = _splash_kernel(qh.shape[1], tp, interpret)
        one = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sk.SegmentIds(qs, ks))
        return jax.vmap(one)(qh, kh, vh, q_seg, kv_seg)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        out = local(qh, kh, vh, q_seg, kv_seg)
    else:
        out = _shard_mapped(local, mesh, qh, kh, vh, q_seg, kv_seg)
    out = out[:, :, :t].transpose(0, 2, 1, 3).astype(q.dtype)
    return constrain(out, ("act_batch", "act_len", "act_heads", "head_dim"))


def _shard_mapped(fn, mesh, qh, kh, vh, q_seg, kv_seg):
    """`fn` per device: batch over the mesh's batch axes, heads over its tensor axis when both
    the query and the key/value heads divide it (else heads stay whole on every device)."""
    from jax.sharding import PartitionSpec as P

    from rcgrpo_jax.models.sharding import logical_to_spec

    q_spec = logical_to_spec(("act_batch", "act_heads", None, None), qh.shape, mesh)
    k_spec = logical_to_spec(("act_batch", "act_kv_heads", None, None), kh.shape, mesh)
    if q_spec[1] != k_spec[1]:
        q_spec, k_spec = P(q_spec[0], None, None, None), P(k_spec[0], None, None, None)
    seg_spec = P(q_spec[0], None)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, k_spec, k_spec, seg_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,
    )(qh, kh, vh, q_seg, kv_seg)


# ---------------------------------------------------------------------------------------------
# cuDNN (GPU)


def cudnn(
    cfg: ModelConfig,
    q: jax.Array,
    keys_t: jax.Array,
    values: jax.Array,
    q_seg: jax.Array,
    *,
    implementation: str = "cudnn",
) -> jax.Array:
    """Causal self-attention through cuDNN's fused kernel, with each row's length the number of
    its real tokens (`cudnn_lengths`): exact for rows holding one segment from slot 0
    (`one_segment_rows`). Padding queries get zeros, as in `flash`. `implementation="xla"`
    runs the same call through XLA (tests, off a GPU)."""
    out = jax.nn.dot_product_attention(
        q,
        keys_t.transpose(0, 3, 1, 2),
        values.transpose(0, 2, 1, 3),
        is_causal=True,
        query_seq_lengths=cudnn_lengths(q_seg),
        key_value_seq_lengths=cudnn_lengths(q_seg),
        implementation=implementation,
    )
    out = jnp.where((q_seg > 0)[:, :, None, None], out, 0).astype(cfg.compute_dtype)
    return constrain(out, ("act_batch", "act_len", "act_heads", "head_dim"))


def cudnn_lengths(q_seg: jax.Array) -> jax.Array:
    """[B] int32: each row's real tokens, at least 1. An all-padding row (length 0: a padded
    batch bucket) would have cuDNN normalise over no keys, which may give NaN, and NaN softmax
    statistics reach the gradients even where the output is zeroed (0 x NaN); at length 1 its
    slot 0 attends to itself, finite, and `cudnn` zeroes it."""
    return jnp.maximum(jnp.sum(q_seg > 0, axis=1), 1).astype(jnp.int32)
