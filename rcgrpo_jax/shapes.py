"""Shape buckets: the sizes every compiled program's dimensions are rounded up to, so that a
run compiles a small, bounded set of programs whatever the lengths it meets.

The sampler's sessions (`sampling.session`), the RL rollout batch and the training rows'
loss positions (`data.packing.loss_index`) and the planner (`planning`) read the same rules
here. No imports from the package: every layer may use it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Shape buckets: each dimension is rounded up so that few distinct programs are compiled."""

    # Rows (raised to the data*fsdp mesh size when sharded) and prefill chunk length (2^k or
    # 1.5 * 2^k in [chunk_min, chunk_max]). Smaller minimums give a session's tail (a few rows
    # still running, short tool outputs) a program per small shape, each run a handful of
    # times; a larger row minimum changes the rounding of some log-probs on XLA:CPU (another
    # batch size picks other kernels). Program counts per setting: docs/benchmarks.md,
    # "Fewer programs".
    batch_min: int = 8
    chunk_min: int = 32
    # Longer appends are prefilled in several chunks: bounds the [B, H, T, S] attention scores
    # a chunk materialises, and the padding of ragged rows.
    chunk_max: int = 128
    cache_min: int = 64  # cache length: 2^k or 1.5 * 2^k (<= 1/3 unused) up to cache_geom_max,
    cache_geom_max: int = 4096  # then multiples of cache_geom_max
    # A session whose max_len is at most this allocates its caches at max_len once, rather than
    # growing them bucket by bucket: every grow is a program, and every cache length multiplies
    # the prefill, decode and gather programs by one. Attention still reads only the slots the
    # growing schedule would have (`Session._room`), so the numbers are the same either way.
    preallocate_max: int = 2048
    decode_steps: int = 64  # most tokens per jitted decode call (the loop exits when rows stop)
    stops_min: int = 4  # stop-set width: power of two >= stops_min
    # The shared-prompt update's prompt and rest lengths (`piece_bucket`): from this lower
    # minimum, since the two pieces of a short row each padded to cache_min would give back most
    # of what sharing the prompt saves.
    piece_min: int = 16


def pow2_bucket(n: int, lo: int) -> int:
    """The smallest power of two >= n (and >= lo)."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def geom_bucket(n: int, lo: int) -> int:
    """The smallest 2^k or 1.5 * 2^k >= n (and >= lo): at most 1/3 of it is padding."""
    size = pow2_bucket(n, lo)
    return size * 3 // 4 if size >= 2 * lo and n <= size * 3 // 4 else size


def cache_capacity(max_len: int, buckets: Buckets = Buckets()) -> int:  # noqa: B008 (frozen)
    """Cache slots per row for trajectories of up to `max_len` tokens: the `max_len` to give
    their `Session`, and so the largest cache it allocates. One prefill chunk more than
    `max_len`, because the last chunk of an append is padded to its bucket and writes past the
    row's last real token. The RL rollout sizes its session and the planner its cache by this."""
    return int(max_len) + buckets.chunk_max


def batch_capacity(rows: int, shard: int = 1, buckets: Buckets = Buckets()) -> int:  # noqa: B008
    """State rows a `Session` allocates for `rows` trajectories: a power of two, at least
    `buckets.batch_min` and the mesh's data x fsdp size `shard` (every shard holds rows)."""
    return pow2_bucket(rows, max(buckets.batch_min, shard))


def length_bucket(n: int, buckets: Buckets = Buckets()) -> int:  # noqa: B008 (frozen)
    """The cache-length bucket of `n` tokens: 2^k or 1.5 * 2^k (>= cache_min) up to
    cache_geom_max, then multiples of it. The RL step's T uses the same rule, so the programs
    compiled for a run stay few (one per bucket) whatever the trajectories' lengths."""
    top = buckets.cache_geom_max
    return -(-n // top) * top if n > top else geom_bucket(n, buckets.cache_min)


def piece_bucket(n: int, buckets: Buckets = Buckets()) -> int:  # noqa: B008 (frozen)
    """The shared-prompt update's lengths: 2^k x (1, 1.25, 1.5, 1.75) (>= piece_min), at most
    1/5 padding. Finer than `length_bucket` because each piece is padded on its own, and a
    prompt of 4,100 tokens padded to 8,192 would cost more than its sharing saves."""
    if n <= buckets.piece_min:
        return buckets.piece_min
    base = 1 << (int(n) - 1).bit_length() - 1  # the largest power of two below n
    step = base // 4
    return base + -(-(int(n) - base) // step) * step
