"""Cached inference: the KV cache the decoder's layers read and write (keys [B, KV, D, S],
values [B, KV, S, D]: the layouts `models.attention` reads).

The layers, their stack and the head are the training forward's own (`models.decoder`:
`forward_hidden` -> `run_layers` -> `decoder_layer`); this module owns only the cache: its
allocation, the slots a chunk occupies (`cache.end`), the mask over them, and the per-layer
write of each chunk's keys and values (`decoder.KVWrite`). Each layer owns its cache buffers
(updated in place inside the jitted loop), and the layer loop is unrolled over weights sliced
out of the stacked params once per jitted call (`decoder.unstack_layers`, outside the decode
loop): driving a cache through a `lax.scan` copies the whole cache in and out of the scan on
every decode step, which would cost a small decode step more than its own work. Attention runs
through `models.attention`, whose dense or flash kernel also serves prefill and decode (flash
visits only the cache blocks some row occupies); the tests check the logits against
`models.apply` and the tokens against transformers.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rcgrpo_jax import models
from rcgrpo_jax.models import attention, decoder
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


def first_slots(c: Cache, n: int) -> Cache:
    """A copy of the cache's first `n` slots (rows' `end` unchanged: the caller keeps them
    within `n`)."""
    return Cache(
        k=tuple(x[..., :n] for x in c.k),
        v=tuple(x[:, :, :n] for x in c.v),
        segments=c.segments[:, :n],
        end=c.end,
    )


def with_first_slots(c: Cache, first: Cache) -> Cache:
    """`c` with its first slots replaced by `first`'s (`first_slots`' inverse; in place when `c`
    is donated), and `first`'s `end`."""
    put = lambda x, y, axis: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis)
    return Cache(
        k=tuple(put(x, y, 3) for x, y in zip(c.k, first.k, strict=True)),
        v=tuple(put(x, y, 2) for x, y in zip(c.v, first.v, strict=True)),
        segments=put(c.segments, first.segments, 1),
        end=first.end,
    )


def _write(buf: jax.Array, chunk: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    """buf[b, ..., start[b]:start[b]+T, ...] = chunk[b] along slot `axis` of each row, for every
    row b; in place when `buf` is a loop carry or donated."""

    def one(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), s, axis=axis - 1)

    return jax.vmap(one)(buf, chunk, start)


def apply_cached(
    cfg: ModelConfig,
    params: models.Params,
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

    `params` comes from `decoder.unstack_layers`. Call inside a jit.
    """
    t = tokens.shape[1]
    start = cache.end
    q_slot = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    kv_segments = jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new, (s,)))(
        cache.segments, segments, start
    )
    kv_len = cache.capacity if kv_len is None else min(kv_len, cache.capacity)
    mask = attention.prepare(cfg, q_slot, segments, kv_segments[:, :kv_len], self_attn=False)

    def write(slot, keys_t, values):
        """Stores the chunk's K/V at `start` in the layer's buffers; attends over [0, kv_len)."""
        ck, cv = slot
        ck = constrain(_write(ck, keys_t, start, axis=3), K_AXES)
        cv = constrain(_write(cv, values, start, axis=2), V_AXES)
        return ck[..., :kv_len], cv[:, :, :kv_len], (ck, cv)

    slots = tuple(zip(cache.k, cache.v, strict=True))
    hidden, slots = decoder.forward_hidden(
        cfg, params, tokens, positions, mask, logits_at, slots, write
    )
    ks, vs = zip(*slots, strict=True)
    cache = Cache(k=ks, v=vs, segments=kv_segments, end=start + t)
    return decoder.logits(cfg, params, hidden), cache
