"""grain pipelines over stored examples: seeded shuffling, per-host sharding, packing, batching,
and a checkpointable iterator (`it.get_state()` / `it.set_state(...)`, JSON-serialisable dicts).

Per-host sharding drops the remainder so every host sees the same number of elements per epoch;
then all hosts take the same number of batches per step and one host's iterator state (a count)
is valid for all of them — which is what the checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np

from rcgrpo_jax.data.packing import loss_index, pack_examples

ROW_FIELDS = ("tokens", "loss_mask", "segments", "positions")


def _shard(ds: grain.MapDataset, shard_index: int | None, shard_count: int | None):
    index = jax.process_index() if shard_index is None else shard_index
    count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= index < count:
        raise ValueError(f"shard_index {index} not in [0, {count})")
    n = len(ds) - len(ds) % count
    if n == 0:
        raise ValueError(f"{len(ds)} elements cannot be split over {count} shards")
    return ds[:n][index::count]


def example_dataset(
    source: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
    transform: Callable[[Mapping[str, Any]], Any] | None = None,
) -> grain.MapDataset:
    """This host's shard, shuffled per epoch (a fresh order each epoch, fixed by `seed`),
    repeated `num_epochs` times (None = forever), optionally mapped through `transform`."""
    ds = _shard(grain.MapDataset.source(source), shard_index, shard_count)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    if transform is not None:
        ds = ds.map(transform)
    return ds


def packed_rows(
    source: Sequence[Mapping[str, Any]],
    row_len: int,
    *,
    seed: int,
    filter_fn: Callable[[Mapping[str, Any]], bool] | None = None,
    pad_id: int = 0,
    gather_head: bool = True,
) -> grain.MapDataset:
    """All (kept) examples packed into [row_len] rows, in a seed-shuffled order, as a
    MapDataset of row dicts. Packing is done once, in memory — fine for trajectory datasets of
    thousands of examples — so the row set is fixed and iterator state is a plain index. With
    `gather_head`, each row carries its `loss_index` (the loss applies the head there only), of
    one K for the whole row set (before per-host sharding): every batch of every host has the
    same shape, so a stage compiles one step."""
    order = np.random.default_rng(seed).permutation(len(source))
    examples = []
    for i in order:
        ex = source[int(i)]
        if filter_fn is None or filter_fn(ex):
            examples.append({"tokens": ex["tokens"], "loss_mask": ex["loss_mask"]})
    if not examples:
        raise ValueError("no examples left to pack")
    packed = pack_examples(examples, row_len, pad_id=pad_id)
    fields = ROW_FIELDS
    if gather_head:
        packed["loss_index"], fields = loss_index(packed["loss_mask"]), (*fields, "loss_index")
    rows = [{k: packed[k][r] for k in fields} for r in range(packed["tokens"].shape[0])]
    return grain.MapDataset.source(rows)


def batched_iter(
    ds: grain.MapDataset,
    batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_threads: int = 2,
) -> grain.IterDataset:
    """Shard → shuffle → repeat → batch(drop_remainder) of equal-shape elements (e.g. rows from
    `packed_rows`). `iter(result)` is a checkpointable grain DatasetIterator."""
    ds = _shard(ds, shard_index, shard_count)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs).batch(batch_size, drop_remainder=True)
    return ds.to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * batch_size)
    )


def train_loader(
    source: Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    row_len: int,
    seed: int,
    filter_fn: Callable[[Mapping[str, Any]], bool] | None = None,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    gather_head: bool = True,
) -> grain.IterDataset:
    """SFT/RCTP batches {tokens, loss_mask, segments, positions} [batch_size, row_len] (and,
    with `gather_head`, loss_index [batch_size, K]) of packed rows for this host. `filter_fn`
    keeps e.g. only label==1 for plain SFT."""
    rows = packed_rows(source, row_len, seed=seed, filter_fn=filter_fn, gather_head=gather_head)
    return batched_iter(
        rows,
        batch_size,
        seed=seed,
        num_epochs=num_epochs,
        shard_index=shard_index,
        shard_count=shard_count,
    )
