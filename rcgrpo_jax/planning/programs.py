"""The programs a config runs, lowered and compiled ahead of time on abstract inputs
(ShapeDtypeStructs carrying NamedShardings; nothing is allocated), for XLA's per-device memory:

- train:   the fused RC-GRPO step (`rl.train_step.make_rl_step`) on a [P, G, T] rollout batch;
- decode:  the sampler's decode program (`sampling.core.decode`) over the rollout rows held at
           once (every row of an iteration, num_prompts·G = P·minibatches·G, or `rl.max_rows` of
           them; `shapes.batch_capacity`) at the cache length the rollout allocates
           (`shapes.cache_capacity(T)`);
- prefill: the sampler's prefill program for one chunk (`Shape.prefill_chunk`) into that cache.

The attention kernels are what `model.attention` picks on the planned chip, a TPU or a GPU
(`planned_attention`). Splash (a Pallas TPU kernel) and cuDNN's fused attention do not compile
for the CPU, so such a config's train step is compiled with `flash` in its place: the same
O(T * block) memory (blockwise scores, output + log-sum-exp kept for the backward pass).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rcgrpo_jax.shapes import Buckets, batch_capacity, cache_capacity, length_bucket


@dataclasses.dataclass(frozen=True)
class Shape:
    prompts: int = 8  # P: prompts per train step (rl.num_prompts / rl.minibatches)
    group: int = 8  # G rollouts per prompt
    seq: int = 16384  # T tokens per trajectory (rl.max_len)
    grad_accum: int = 1  # microbatches of whole groups in the train step
    prefill_chunk: int = 128  # the sampler's largest prefill chunk (Buckets.chunk_max)
    decode_steps: int = 64  # tokens per decode call (Buckets.decode_steps); memory barely moves
    minibatches: int = 1  # train steps per rollout batch: the sampler rolls out all of them
    max_rows: int = 0  # rows the sampler holds at once (rl.max_rows); 0 = all of them
    # positions per row the loss reads, where the head runs (`model.gather_head`: the sampled
    # tokens, `loss_index`); 0 = the head at every position of the row
    loss_tokens: int = 0

    @property
    def rollouts(self) -> int:
        """Rows of one train step: P·G."""
        return self.prompts * self.group

    @property
    def sampler_rows(self) -> int:
        """Rows the sampler rolls out at once: every train step's, num_prompts·G, or
        `max_rows` of them (the rollout samples them a chunk at a time)."""
        rows = self.prompts * self.minibatches * self.group
        return min(rows, self.max_rows) if self.max_rows else rows

    @property
    def cache(self) -> int:
        """KV-cache slots per row the rollout allocates (`shapes.cache_capacity`)."""
        return cache_capacity(self.seq, Buckets(chunk_max=self.prefill_chunk))


def shape_from_config(config, **overrides: int | None) -> Shape:
    """The [P, G, T] update the config's RL stage runs (`rl.*`: P = num_prompts / minibatches
    prompts per update; the sampler rolls out all minibatches at once); overrides that are not
    None win."""
    rl = config.rl
    buckets = Buckets()
    base = {
        "prompts": int(rl.num_prompts) // max(1, int(rl.minibatches)),
        "group": int(rl.group_size),
        "seq": int(rl.max_len),
        "grad_accum": int(rl.optim.grad_accum),
        "prefill_chunk": buckets.chunk_max,
        "decode_steps": buckets.decode_steps,
        "minibatches": max(1, int(rl.minibatches)),
        "max_rows": int(rl.max_rows),
    }
    base.update({k: int(v) for k, v in overrides.items() if v is not None})
    return Shape(**base)


@dataclasses.dataclass(frozen=True)
class PlannedAttention:
    """The kernels a config runs on a TPU, and what the CPU compile stands in with."""

    train: str  # the train step's self-attention on a TPU (FLOPs are counted for it)
    compiled: str  # what the train step is compiled with here: splash -> flash
    sampler: str  # the sampler's cached attention at the full cache (dense | flash, both here)


def planned_attention(
    cfg, seq: int, cache: int | None = None, backend: str = "tpu"
) -> PlannedAttention:
    """`models.attention.resolve` on `backend` ("tpu" | "gpu") for the train step at T = `seq`
    and for the sampler's cached attention over `cache` slots (default `seq`). Splash (a Pallas
    TPU kernel) and cuDNN's do not compile for the CPU, so the train step is compiled as flash
    (see the module docstring)."""
    from rcgrpo_jax.models import attention

    kw = dict(backend=backend, head_dim=cfg.head_dim, dtype=cfg.compute_dtype)
    train = attention.resolve(cfg.attention, self_attn=True, kv_len=seq, **kw)
    kv_len = seq if cache is None else cache
    sampler = attention.resolve(cfg.attention, self_attn=False, kv_len=kv_len, **kw)
    compiled = "flash" if train in ("splash", "cudnn") else train
    return PlannedAttention(train, compiled, sampler)


# --------------------------------------------------------------------------- abstract inputs


def _sds(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_rl_batch(mesh, shape: Shape, with_ref: bool) -> dict[str, Any]:
    """The [P, G, T] rollout batch `policy_loss` reads (whole rows; with `loss_index` where
    `shape.loss_tokens` is set), sharded as `shard_batch` would."""
    import jax.numpy as jnp

    from rcgrpo_jax.train.state import batch_sharding

    p, g, t = shape.prompts, shape.group, shape.seq
    spec = {
        "tokens": ((p, g, t), jnp.int32),
        "positions": ((p, g, t), jnp.int32),
        "segments": ((p, g, t), jnp.int32),
        "loss_mask": ((p, g, t), jnp.int32),
        "old_logprobs": ((p, g, t), jnp.float32),
        "rewards": ((p, g), jnp.float32),
        "reward_token": ((p, g), jnp.int32),
    }
    if with_ref:
        spec["ref_logprobs"] = ((p, g, t), jnp.float32)
    if shape.loss_tokens:  # as `data.packing.loss_index` buckets it
        spec["loss_index"] = ((p, g, min(length_bucket(shape.loss_tokens), t)), jnp.int32)
    return {k: _sds(s, d, batch_sharding(mesh, s)) for k, (s, d) in spec.items()}


def abstract_rollout_state(cfg, mesh, batch: int, capacity: int):
    """A `sampling.core.RolloutState` of ShapeDtypeStructs laid out as `_constrain_state` does."""
    import jax

    from rcgrpo_jax.models.sharding import named_sharding
    from rcgrpo_jax.sampling import core

    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    return jax.tree.map(
        lambda axes, s: _sds(s.shape, s.dtype, named_sharding(mesh, axes, s.shape)),
        core.state_logical_axes(cfg),
        core.state_shapes(cfg, batch, capacity),
        is_leaf=is_axes,
    )


def _replicated(mesh, x):
    from jax.sharding import NamedSharding, PartitionSpec

    return _sds(x.shape, x.dtype, NamedSharding(mesh, PartitionSpec()))


def device_bytes(tree) -> int:
    """Bytes one device holds for a pytree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


# --------------------------------------------------------------------------- lowering


@dataclasses.dataclass
class Compiled:
    program: str
    compiled: Any
    compile_s: float
    resident_bytes: int = 0  # per-device bytes that stay allocated beside this program
    # temporaries taken from another compile of the same program (`f32_temp`), or None
    temp_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """The fused RL step to compile and its abstract inputs."""

    jitted: Any
    state: Any  # TrainState; under LoRA its params are the adapters and token rows alone
    frozen: Any  # under LoRA the frozen base (an argument of the step, not donated), else None
    batch: dict[str, Any]


def train_setup(cfg, mesh, shape: Shape, objective) -> TrainProgram:
    """The jitted fused RL step for the `rl.losses.Objective` and its abstract inputs (under
    LoRA, `cfg.lora`, the state trains the adapters and the base is a separate argument, as
    `stages.setup.training` runs it); nothing is compiled."""
    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.models import lora
    from rcgrpo_jax.rl.train_step import make_rl_step
    from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
    from rcgrpo_jax.train.state import abstract_train_state, state_shardings

    optimizer = make_optimizer(OptimConfig(grad_accum=shape.grad_accum))
    pshapes, frozen_shapes = lora.split(cfg, models.param_shapes(cfg))
    psh, frozen_sh = lora.split(cfg, models.param_shardings(cfg, mesh))
    shardings = state_shardings(optimizer, psh, mesh, pshapes)
    state = abstract_train_state(optimizer, pshapes, shardings)
    frozen = None
    if cfg.lora is not None:
        frozen = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), frozen_shapes, frozen_sh)
    step = make_rl_step(
        cfg,
        objective,
        optimizer,
        mesh=mesh,
        shardings=shardings,
        grad_accum=shape.grad_accum,
        frozen=frozen,
    )
    batch = abstract_rl_batch(mesh, shape, with_ref=objective.kl_beta > 0)
    return TrainProgram(step.jitted, state, frozen, batch)


def compile_train(mesh, program: TrainProgram) -> Compiled:
    from rcgrpo_jax.models.sharding import use_mesh

    t0 = time.perf_counter()
    with use_mesh(mesh):
        compiled = program.jitted.lower(program.state, program.frozen, program.batch).compile()
    return Compiled("train", compiled, time.perf_counter() - t0)


def sampler_batch(mesh, shape: Shape) -> int:
    """State rows of the rollout's session: num_prompts·G rows (or rl.max_rows), bucketed as
    `Session` buckets them (`shapes.batch_capacity` over the mesh's data x fsdp shards)."""
    return batch_capacity(shape.sampler_rows, mesh.shape["data"] * mesh.shape["fsdp"])


def sampler_weights(cfg, mesh, train: TrainProgram, layout: str) -> tuple[Any, Any, int]:
    """(the model the sampler runs, its abstract weights under `mesh.sampler_weights`, per-device
    bytes that stay allocated beside it). "tensor": the compute-dtype copy over the tensor axis
    (under LoRA with the adapters merged: `models.sampler_config`), next to the whole training
    state and base; "train": the state's own params (joined with the base under LoRA, the
    adapters applied on the fly), next to its optimizer state."""
    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.models import lora

    scfg = models.sampler_config(cfg, layout)
    state = train.state
    if layout == "train":
        frozen = train.frozen if train.frozen is not None else {}
        return scfg, lora.join(state.params, frozen), device_bytes(state.opt_state)
    shapes = models.sampler_param_shapes(scfg)
    shardings = models.sampler_param_shardings(scfg, mesh)
    params = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)
    return scfg, params, device_bytes(state) + device_bytes(train.frozen or {})


def compile_sampler(cfg, mesh, shape: Shape, program: str, params, resident: int) -> Compiled:
    """Lowers + compiles `sampling.core.decode` or `prefill` over all rollout rows
    (`sampler_batch`) at the rollout's cache length (`Shape.cache`)."""
    import jax
    import jax.numpy as jnp

    from rcgrpo_jax.models.sharding import use_mesh
    from rcgrpo_jax.sampling import core

    b = sampler_batch(mesh, shape)
    state = abstract_rollout_state(cfg, mesh, b, shape.cache)
    rep = lambda shp, dt: _replicated(mesh, jax.ShapeDtypeStruct(shp, dt))
    batch_vec = lambda dt: _sds((b,), dt, state.traj.sharding)
    t0 = time.perf_counter()
    with use_mesh(mesh):
        if program == "decode":
            key = _replicated(mesh, jax.eval_shape(lambda: jax.random.key(0)))
            lowered = core.decode.lower(
                cfg,
                core.SampleMode("filtered"),
                shape.decode_steps,
                params,
                state,
                key,
                rep((), jnp.float32),
                rep((), jnp.int32),
                rep((), jnp.float32),
                batch_vec(jnp.int32),
                _sds((b, 4), jnp.int32, state.cache.segments.sharding),
            )
        else:
            chunk = _sds(
                (b, min(shape.prefill_chunk, shape.seq)), jnp.int32, state.cache.segments.sharding
            )
            lowered = core.prefill.lower(cfg, params, state, chunk, batch_vec(jnp.int32))
        compiled = lowered.compile()
    return Compiled(program, compiled, time.perf_counter() - t0, resident)


def upcasts_on_cpu(cfg) -> bool:
    """Whether XLA:CPU would hold f32 copies of this sampler's weights: it has no bf16 (or f16)
    dot, so it converts every such weight to f32, and the converts of loop-invariant weights are
    hoisted out of the decode loop, all layers' at once (temporaries of several times the bf16
    weight bytes, docs/benchmarks.md). A TPU multiplies bf16 natively and makes no such copy."""
    import jax.numpy as jnp

    return jnp.dtype(cfg.compute_dtype).itemsize < 4


def f32_temp(cfg, mesh, shape: Shape, program: str, params) -> Compiled:
    """The same sampler program compiled with f32 weights, cache and compute (same shapes and
    shardings), for its temporaries: no converts to hoist, and every activation at least as
    wide as in bf16, so an upper bound of the bf16 program's own on a backend with bf16 dots."""
    import jax
    import jax.numpy as jnp

    f32 = lambda x: _sds(x.shape, jnp.float32, x.sharding)
    wide = cfg.replace(dtype="float32", param_dtype="float32")
    return compile_sampler(wide, mesh, shape, program, jax.tree.map(f32, params), 0)


def memory(c: Compiled) -> dict[str, int]:
    """XLA's per-device memory: peak = arguments + outputs − donated aliases + temporaries
    (those of `c.temp_bytes` where set)."""
    ma = c.compiled.memory_analysis()
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes if c.temp_bytes is None else c.temp_bytes),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
