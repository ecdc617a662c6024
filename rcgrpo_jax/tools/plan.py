"""AOT planner: will a config fit a TPU slice, and how fast could its steps run?

    python -m rcgrpo_jax.tools.plan --config=configs/qwen7b.py --topology=v5p-16 \\
        [--prompts=8 --group=8 --seq=16384 --grad_accum=4] [--config.mesh.shape=(1,4,2)] \\
        [--config.model.remat=full] [--json=plan.json]

It plans what the config runs: P, G, T and grad_accum default to the config's RL update
(`rl.num_prompts` / `rl.minibatches`, `rl.group_size`, `rl.max_len`, `rl.optim.grad_accum`; the
flags override them), the prefill chunk to the sampler's `Buckets.chunk_max`, and the attention
kernels to what `model.attention` picks on a TPU (`models.attention.resolve`, for the train step
and for the sampler's cached attention). Splash is a Pallas TPU kernel, which does not compile for
the CPU, so a splash config's train step is compiled with `flash` in its place: the same
O(T * block) memory (blockwise scores, output + log-sum-exp kept for the backward pass); the
output says so. Its FLOPs are counted for splash.

For a topology of N chips the planner runs on N virtual CPU devices (it re-executes itself with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`), builds the config's (data, fsdp, tensor)
mesh and lowers + compiles, with abstract inputs only (ShapeDtypeStructs carrying NamedShardings;
nothing is allocated):

- train:   the fused RC-GRPO step (`rl.train_step.make_rl_step`) on a [P, G, T] rollout batch;
- decode:  the sampler's decode program (`sampling.core.decode`) over the rollout rows held at
           once (every row of an iteration, num_prompts·G = P·minibatches·G, or `rl.max_rows` of
           them; `sampling.batch_capacity`) at the cache length the rollout allocates
           (`sampling.cache_capacity(T)`);
- prefill: the sampler's prefill program for one chunk (`--prefill_chunk`) into that cache.

Per program it reports XLA's per-device memory (arguments, outputs, temporaries, peak), whether
that fits the chip's HBM, analytic FLOPs (`cost_analysis` counts a scanned layer body once, so it
is not used) and a roofline projection of the step time and MFU. Caveats, also printed:
memory comes from the XLA *CPU* compiler's buffer assignment, which fuses and schedules
differently from the TPU compiler (usually more conservatively); collectives over ICI are not
modelled in the time projection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rcgrpo_jax.tools.chips import GiB, Topology, parse_topology

# Architectures of the two paper models (their HF config.json), so the planner needs no checkpoint.
HF_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b-instruct": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
}

PROGRAMS = ("train", "decode", "prefill")
HEADROOM = 0.9  # "fits" = peak <= 90% of HBM (runtime reservations, fragmentation, CPU≠TPU)


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
        """KV-cache slots per row the rollout allocates (`sampling.cache_capacity`)."""
        from rcgrpo_jax.sampling import Buckets, cache_capacity

        return cache_capacity(self.seq, Buckets(chunk_max=self.prefill_chunk))


def shape_from_config(config, **overrides: int | None) -> Shape:
    """The [P, G, T] update the config's RL stage runs (`rl.*`: P = num_prompts / minibatches
    prompts per update; the sampler rolls out all minibatches at once); overrides that are not
    None win."""
    from rcgrpo_jax.sampling import Buckets

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
class Assumptions:
    efficiency: float = 0.6  # fraction of peak FLOP/s a well-fused matmul step reaches
    headroom: float = HEADROOM


# --------------------------------------------------------------------------- model and mesh


def model_config(config, extra_vocab: int = 0, layers: int = 0):
    """ModelConfig for a run config: the checkpoint's config.json if present, else a preset named
    by the checkpoint directory, else `model.arch` (the random-init architecture); `layers` > 0
    cuts its depth (a quick check of everything but the per-layer memory)."""
    from rcgrpo_jax import models

    m = config.model
    common = dict(
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        scan_layers=bool(m.scan_layers),
        attention=m.attention,
    )
    hf_path = Path(m.hf_path) if m.hf_path else None
    if hf_path is not None and (hf_path / "config.json").is_file():
        cfg = models.config_from_hf(json.loads((hf_path / "config.json").read_text()), **common)
    elif hf_path is not None and hf_path.name.lower() in HF_PRESETS:
        cfg = models.config_from_hf(HF_PRESETS[hf_path.name.lower()], **common)
    elif hf_path is not None:
        raise ValueError(
            f"model.hf_path={m.hf_path!r}: no config.json there and not a known preset "
            f"({', '.join(HF_PRESETS)})"
        )
    else:
        cfg = models.ModelConfig.from_dict(dict(m.arch.to_dict(), **common))
    if layers:
        cfg = cfg.replace(num_layers=int(layers))
    return cfg.replace(vocab_size=cfg.vocab_size + extra_vocab) if extra_vocab else cfg


@dataclasses.dataclass(frozen=True)
class PlannedAttention:
    """The kernels a config runs on a TPU, and what the CPU compile stands in with."""

    train: str  # the train step's self-attention on a TPU (FLOPs are counted for it)
    compiled: str  # what the train step is compiled with here: splash -> flash
    sampler: str  # the sampler's cached attention at the full cache (dense | flash, both here)


def planned_attention(cfg, seq: int, cache: int | None = None) -> PlannedAttention:
    """`models.attention.resolve` on a TPU for the train step at T = `seq` and for the sampler's
    cached attention over `cache` slots (default `seq`). Splash does not compile for the CPU, so
    the train step is compiled as flash (see the module docstring)."""
    from rcgrpo_jax.models import attention

    kw = dict(backend="tpu", head_dim=cfg.head_dim, dtype=cfg.compute_dtype)
    train = attention.resolve(cfg.attention, self_attn=True, kv_len=seq, **kw)
    kv_len = seq if cache is None else cache
    sampler = attention.resolve(cfg.attention, self_attn=False, kv_len=kv_len, **kw)
    return PlannedAttention(train, "flash" if train == "splash" else train, sampler)


def resolve_mesh_shape(shape: Sequence[int], n: int) -> tuple[int, ...]:
    """Fills the one -1 entry so the product is n; raises when the shape cannot use n devices."""
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        raise ValueError(f"mesh.shape={tuple(shape)}: at most one entry may be -1")
    rest = 1
    for s in shape:
        rest *= s if s != -1 else 1
    if -1 in shape:
        if n % rest:
            raise ValueError(f"mesh.shape={tuple(shape)} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    if _prod(shape) != n:
        raise ValueError(f"mesh.shape={tuple(shape)} uses {_prod(shape)} of {n} devices")
    return tuple(shape)


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


# --------------------------------------------------------------------------- abstract inputs


def _sds(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_rl_batch(mesh, shape: Shape, with_ref: bool) -> dict[str, Any]:
    """The [P, G, T] rollout batch `policy_loss` reads, sharded as `shard_batch` would."""
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


def train_setup(cfg, mesh, shape: Shape, objective):
    """(jitted fused RL step for the `rl.losses.Objective`, abstract TrainState, abstract
    batch); nothing is compiled."""
    from rcgrpo_jax import models
    from rcgrpo_jax.rl.train_step import make_rl_step
    from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
    from rcgrpo_jax.train.state import abstract_train_state, state_shardings

    optimizer = make_optimizer(OptimConfig(grad_accum=shape.grad_accum))
    pshapes = models.param_shapes(cfg)
    shardings = state_shardings(optimizer, models.param_shardings(cfg, mesh), mesh, pshapes)
    state = abstract_train_state(optimizer, pshapes, shardings)
    step = make_rl_step(
        cfg,
        objective,
        optimizer,
        mesh=mesh,
        shardings=shardings,
        grad_accum=shape.grad_accum,
    )
    return step.jitted, state, abstract_rl_batch(mesh, shape, with_ref=objective.kl_beta > 0)


def compile_train(jitted, mesh, state, batch) -> Compiled:
    from rcgrpo_jax.models.sharding import use_mesh

    t0 = time.perf_counter()
    with use_mesh(mesh):
        compiled = jitted.lower(state, batch).compile()
    return Compiled("train", compiled, time.perf_counter() - t0)


def sampler_batch(mesh, shape: Shape) -> int:
    """State rows of the rollout's session: num_prompts·G rows (or rl.max_rows), bucketed as
    `Session` buckets them (`sampling.batch_capacity` over the mesh's data x fsdp shards)."""
    from rcgrpo_jax.sampling import batch_capacity

    return batch_capacity(shape.sampler_rows, mesh.shape["data"] * mesh.shape["fsdp"])


def sampler_weights(cfg, mesh, state, layout: str) -> tuple[Any, int]:
    """(abstract weights the sampler reads under `mesh.sampler_weights`, per-device bytes
    that stay allocated beside it). "tensor": the compute-dtype copy over the tensor axis, next
    to the whole training state; "train": the state's own params, next to its optimizer state."""
    import jax

    from rcgrpo_jax import models

    if layout == "train":
        return state.params, device_bytes(state.opt_state)
    shapes = models.sampler_param_shapes(cfg)
    shardings = models.sampler_param_shardings(cfg, mesh)
    params = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)
    return params, device_bytes(state)


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
    hoisted out of the decode loop, all layers' at once (measured: temporaries of ~4x the bf16
    weight bytes). A TPU multiplies bf16 natively and makes no such copy."""
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


# --------------------------------------------------------------------------- analytics


def matmul_params(cfg) -> int:
    """Weights that take part in a matmul per token: every layer's projections plus the LM head
    (the embedding lookup is a gather, not a matmul)."""
    e, h, kv, d, m = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    return cfg.num_layers * (2 * e * h * d + 2 * e * kv * d + 3 * e * m) + e * cfg.vocab_size


def train_flops(cfg, shape: Shape, kind: str | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one train step on P·G·T tokens.

    model    = 6·N·tokens + 12·L·H·D·T·tokens   (fwd 2 + bwd 4 per weight per token; attention
               QKᵀ and PV, 2·2·H·D·T per token per layer forward, ×3 with backward, over the
               full T×T: PaLM's MFU convention, whatever an implementation skips)
    hardware = what our step computes with attention kernel `kind` (default: what
               `cfg.attention` runs on a TPU, `planned_attention`): the attention only over the
               blocks on or below the causal diagonal, `models.attention.flop_units` passes of
               it (dense 3, flash/cuDNN 3.5, splash 4.5), plus what the remat policy recomputes
               in the backward pass (`remat_recompute`).
    """
    from rcgrpo_jax.models.attention import flop_units

    kind = planned_attention(cfg, shape.seq).train if kind is None else kind
    tokens = shape.rollouts * shape.seq
    n = matmul_params(cfg)
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * shape.seq  # per token
    fraction, passes = flop_units(kind, shape.seq, cfg.flash_block)
    attn_hw = attn_fwd * fraction
    model = (6 * n + 3 * attn_fwd) * tokens
    hardware = 6 * n + passes * attn_hw + remat_recompute(cfg, kind, attn_hw)
    return float(model), float(hardware * tokens)


def remat_recompute(cfg, kind: str, attn_hw: float) -> float:
    """Per-token FLOPs the remat policy recomputes in the backward pass. full: one more forward
    of the layers (2·N_layers + attention). dots_no_batch: the attention, whose einsums all have
    batch dims. dots: nothing for dense (its einsums are saved), but the other kernels'
    attention forward: flash's out/lse come out of a loop, splash's and cuDNN's out of a kernel
    call, none of them a dot, so the policy saves none and the backward reruns the forward
    (the grad's program holds flash's forward loop twice). none: nothing."""
    n_layers = matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size
    if cfg.remat == "full":
        return 2 * n_layers + attn_hw
    if cfg.remat == "dots_no_batch" or (cfg.remat == "dots" and kind != "dense"):
        return attn_hw
    return 0.0


def sampler_flops(cfg, mesh, shape: Shape, program: str) -> float:
    """FLOPs of one decode token step (every state row) or one prefill chunk: 2·N per token
    plus attention over the whole cache capacity (dense: 4·L·H·D·cache per token)."""
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * shape.cache
    chunk = 1 if program == "decode" else min(shape.prefill_chunk, shape.seq)
    toks = sampler_batch(mesh, shape) * chunk
    per_tok = 2 * matmul_params(cfg) + attn
    return float(per_tok * toks)


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def hbm_traffic(
    cfg, mesh, shape: Shape, program: str, state_bytes: int, layout: str = "train"
) -> float:
    """Per-device HBM bytes one step must move at least (the roofline's memory side).

    FSDP gathers each layer's weights onto every device, so a device reads all weights divided
    only by the tensor axis (in param dtype; the bf16 cast is fused). train: weights × (2, or 3
    with full remat) + the optimizer's read/write of its state shard (2 × state bytes).
    decode/prefill: weights once + the device's share of the KV cache (all rollout rows, the
    rollout's cache length). Activations ignored.
    """
    tensor = mesh.shape["tensor"]
    # the sampler's "tensor" copy (mesh.sampler_weights) holds the weights in the compute dtype
    dtype = cfg.compute_dtype if program != "train" and layout == "tensor" else cfg.weight_dtype
    w = matmul_params(cfg) * _itemsize(dtype) / tensor
    if program == "train":
        passes = 3 if cfg.remat == "full" else 2
        return w * passes * shape.grad_accum + 2 * state_bytes
    kv_bytes = (
        2
        * cfg.num_layers
        * sampler_batch(mesh, shape)
        * shape.cache
        * cfg.num_kv_heads
        * cfg.head_dim
        * _itemsize(cfg.compute_dtype)
    )
    return w + kv_bytes / mesh.size


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


def project(
    flops: tuple[float, float], traffic: float, topo: Topology, assume: Assumptions
) -> dict[str, float | str]:
    """Roofline: time = max(hw FLOPs / (chips·peak·efficiency), bytes / HBM bandwidth);
    MFU = model FLOPs / (time · chips · peak)."""
    model, hardware = flops
    chip = topo.chip
    t_compute = hardware / (topo.chips * chip.peak_flops * assume.efficiency)
    t_memory = traffic / chip.hbm_bandwidth
    t = max(t_compute, t_memory)
    return {
        "time_s": t,
        "bound": "compute" if t_compute >= t_memory else "memory",
        "mfu": model / (t * topo.chips * chip.peak_flops),
    }


# --------------------------------------------------------------------------- an RL iteration


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one RL iteration does, as `iteration` counts it (`workload_from_config`)."""

    rows: int  # trajectories rolled out: rl.num_prompts x G
    rounds: int  # prefill + decode rounds per trajectory: its assistant steps
    prompt_tokens: int  # the first prefill of each trajectory
    new_tokens: int  # decode steps per round: rl.max_new_tokens (a round ends with its last row)
    updates: int  # fused train steps: rl.epochs x rl.minibatches
    iterations: int  # rl.steps


def assistant_steps(entry) -> int:
    """Assistant steps of an entry's golden trajectory: per turn, one per ground-truth step
    (BFCL: a turn's calls in one step; none for a turn without calls) and the closing reply."""
    if entry.ground_truth_steps:
        return sum(len(steps) + 1 for steps in entry.ground_truth_steps)
    return sum((1 if calls else 0) + 1 for calls in entry.ground_truth)


def workload_from_config(config, prompt_tokens: int = 4096, quantile: float = 0.9) -> Workload:
    """The config's RL iteration over its own training tasks: rounds = the `quantile` of the
    golden trajectories' assistant steps (rows of a chunk advance together, so a chunk takes
    about as many rounds as its longest rows); BFCL prompts are 3-5k tokens."""
    import numpy as np

    from rcgrpo_jax.stages import setup

    rl = config.rl
    entries = setup.task_entries(config, rl.prompt_split)
    steps = [assistant_steps(e) for e in entries]
    return Workload(
        rows=int(rl.num_prompts) * int(rl.group_size),
        rounds=int(np.ceil(np.quantile(steps, quantile))),
        prompt_tokens=int(prompt_tokens),
        new_tokens=int(rl.max_new_tokens),
        updates=int(rl.epochs) * max(1, int(rl.minibatches)),
        iterations=int(rl.steps),
    )


def iteration(rows: Sequence[dict[str, Any]], shape: Shape, work: Workload) -> dict[str, Any]:
    """Projected seconds of one RL iteration from the rows' step times: the rollout, in
    chunks of `sampler_rows` rows run one after another, each prefilling its prompts in
    `prefill_chunk`-token calls plus one call per later round (tool results and the next user
    message), and decoding `rounds x new_tokens` token steps (at most T - prompt); then
    `updates` train steps. Upper-bound-ish: every round decodes its full token budget."""
    by = {r["program"]: r for r in rows}
    missing = sorted(set(PROGRAMS) - set(by))
    if missing:
        raise ValueError(f"an iteration needs the {', '.join(missing)} program(s) planned too")
    chunk = min(shape.prefill_chunk, shape.seq)
    prompt = min(work.prompt_tokens, shape.seq - 1)
    decode_tokens = min(work.rounds * work.new_tokens, shape.seq - prompt)
    prefill_calls = -(-prompt // chunk) + work.rounds - 1
    chunks = -(-work.rows // by["decode"]["sampler_rows"])
    parts = {
        "prefill": chunks * prefill_calls * by["prefill"]["time_s"],
        "decode": chunks * decode_tokens * by["decode"]["time_s"],
        "update": work.updates * by["train"]["time_s"],
    }
    total = sum(parts.values())
    top = max(parts, key=parts.get)
    program = "train" if top == "update" else top
    return {
        **{f"{k}_s": v for k, v in parts.items()},
        "iteration_s": total,
        "run_h": total * work.iterations / 3600,
        "iterations": work.iterations,
        "row_chunks": chunks,
        "rounds": work.rounds,
        "decode_tokens": decode_tokens,
        "prefill_calls": prefill_calls,
        "bound": f"{top} ({by[program]['bound']}-bound), {parts[top] / total:.0%} of it",
    }


def format_iteration(it: dict[str, Any]) -> str:
    """One line: the projected RL iteration and what bounds it."""
    return (
        f"RL iteration (projected): {it['iteration_s']:.0f} s = prefill {it['prefill_s']:.0f} + "
        f"decode {it['decode_s']:.0f} + update {it['update_s']:.0f} "
        f"({it['row_chunks']} row chunk(s) x {it['rounds']} rounds, {it['decode_tokens']} decode "
        f"steps); bound by {it['bound']}; {it['iterations']} iterations ~ {it['run_h']:.1f} h"
    )


# --------------------------------------------------------------------------- the plan


def plan(
    config,
    topology: str | Topology,
    shape: Shape = Shape(),
    *,
    programs: Sequence[str] = ("train", "decode"),
    devices=None,
    assume: Assumptions = Assumptions(),
    kl_beta: float | None = None,
    extra_vocab: int = 0,
    layers: int = 0,
) -> list[dict[str, Any]]:
    """One row per program: memory, fit, FLOPs, projection. `devices`: defaults to the first
    `chips` of `jax.devices()` (the CLI provides exactly that many virtual CPU devices). The
    train step is the config's objective, `kl_beta` (if given) in place of rl.kl_beta."""
    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.stages.setup import objective_from_config

    topo = parse_topology(topology) if isinstance(topology, str) else topology
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown programs {unknown}; known: {', '.join(PROGRAMS)}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < topo.chips:
        raise ValueError(f"{topo.name} needs {topo.chips} devices, {len(devices)} available")
    if is_auto(config.mesh.shape):
        raise ValueError("plan() takes a mesh; mesh.shape=auto is resolved by choose()")
    mesh_shape = resolve_mesh_shape(config.mesh.shape, topo.chips)
    mesh = models.make_mesh(mesh_shape, devices[: topo.chips])
    cfg = model_config(config, extra_vocab, layers)
    kinds = planned_attention(cfg, shape.seq, shape.cache)
    cfg = cfg.replace(attention=kinds.compiled)
    sampler_cfg = cfg.replace(attention=kinds.sampler)
    if shape.prompts % shape.grad_accum:
        raise ValueError(f"prompts={shape.prompts} not divisible by grad_accum={shape.grad_accum}")

    objective = objective_from_config(config.rl)
    if kl_beta is not None:
        objective = dataclasses.replace(objective, kl_beta=float(kl_beta))
    jitted, state, batch = train_setup(cfg, mesh, shape, objective)
    compiled = [compile_train(jitted, mesh, state, batch)] if "train" in programs else []
    state_bytes = device_bytes(state)
    layout = str(config.mesh.sampler_weights)
    sampler_params, resident = sampler_weights(sampler_cfg, mesh, state, layout)
    for prog in ("decode", "prefill"):
        if prog in programs:
            c = compile_sampler(sampler_cfg, mesh, shape, prog, sampler_params, resident)
            if upcasts_on_cpu(sampler_cfg):
                wide = f32_temp(sampler_cfg, mesh, shape, prog, sampler_params)
                c = dataclasses.replace(
                    c, temp_bytes=memory(wide)["temp"], compile_s=c.compile_s + wide.compile_s
                )
            compiled.append(c)

    rows = []
    base = {
        "model": f"{cfg.family}:{cfg.num_layers}L/{cfg.hidden_size}",
        "params_b": cfg.num_params() / 1e9,
        "topology": topo.name,
        "chip": topo.chip.name,
        "chips": topo.chips,
        "hosts": topo.hosts,
        "mesh": "x".join(map(str, mesh_shape)),
        "remat": cfg.remat,
        "attention": kinds.train,
        "attention_compiled": kinds.compiled,
        "sampler_attention": kinds.sampler,
        "P": shape.prompts,
        "G": shape.group,
        "T": shape.seq,
        "grad_accum": shape.grad_accum,
        "sampler_rows": sampler_batch(mesh, shape),
        "sampler_weights": layout,
        "cache": shape.cache,
        "hbm_gib": topo.chip.hbm_bytes / GiB,
        "state_gib": state_bytes / GiB,
    }
    for c in compiled:
        mem = memory(c)
        total = mem["peak"] + c.resident_bytes
        if c.program == "train":
            flops = train_flops(cfg, shape, kinds.train)
        else:
            f = sampler_flops(cfg, mesh, shape, c.program)
            flops = (f, f)
        traffic = hbm_traffic(cfg, mesh, shape, c.program, state_bytes, layout)
        proj = project(flops, traffic, topo, assume)
        rows.append(
            dict(
                base,
                program=c.program,
                **{f"{k}_gib": v / GiB for k, v in mem.items()},
                resident_gib=c.resident_bytes / GiB,
                total_gib=total / GiB,
                hbm_frac=total / topo.chip.hbm_bytes,
                fits=total <= assume.headroom * topo.chip.hbm_bytes,
                model_tflop=flops[0] / 1e12,
                hw_tflop=flops[1] / 1e12,
                hbm_traffic_gib=traffic / GiB,
                compile_s=c.compile_s,
                temp_estimated=c.temp_bytes is not None,
                **proj,
            )
        )
    return rows


COLUMNS = (
    ("topology", "{}"),
    ("mesh", "{}"),
    ("remat", "{}"),
    ("attention", "{}"),
    ("T", "{}"),
    ("grad_accum", "{}"),
    ("program", "{}"),
    ("argument_gib", "{:.2f}"),
    ("output_gib", "{:.2f}"),
    ("temp_gib", "{:.2f}"),
    ("resident_gib", "{:.2f}"),
    ("total_gib", "{:.2f}"),
    ("hbm_gib", "{:.0f}"),
    ("fits", "{}"),
    ("model_tflop", "{:.1f}"),
    ("hw_tflop", "{:.1f}"),
    ("time_s", "{:.3g}"),
    ("bound", "{}"),
    ("mfu", "{:.0%}"),
    ("compile_s", "{:.0f}"),
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table (pastes into the README as is)."""
    head = "| " + " | ".join(k.removesuffix("_gib") + (" GiB" if k.endswith("_gib") else "")
                             for k, _ in COLUMNS) + " |"  # fmt: skip
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format("yes" if r[k] is True else "NO" if r[k] is False else r[k])
                 for k, fmt in COLUMNS]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(rows: Sequence[dict[str, Any]], assume: Assumptions) -> str:
    """The assumptions behind the numbers, printed under the table."""
    if not rows:
        return ""
    r = rows[0]
    return "\n".join(
        [
            f"model {r['model']} ({r['params_b']:.2f}B params), {r['topology']} = {r['chips']} "
            f"{r['chip']} chips on {r['hosts']} hosts; batch P={r['P']} x G={r['G']} x "
            f"T={r['T']}, grad_accum={r['grad_accum']}; train state {r['state_gib']:.2f} GiB/chip",
            f"attention: {r['attention']}"
            + (
                f", compiled here as {r['attention_compiled']} (Pallas TPU kernels do not compile "
                "for the CPU; same O(T x block) memory)"
                if r["attention_compiled"] != r["attention"]
                else ""
            )
            + f"; the sampler's prefill/decode attend with {r['sampler_attention']} over "
            f"{r['sampler_rows']} rows x {r['cache']} cache slots",
            "memory: per device, from XLA:CPU buffer assignment (peak = args + outputs - donated "
            "+ temp); rollout programs add 'resident' = the training state that stays on device"
            + (
                "; their temp is that of the same program compiled in f32 (XLA:CPU has no bf16 "
                "dot and would count f32 copies of the bf16 weights, which a TPU does not make)"
                if any(r.get("temp_estimated") for r in rows)
                else ""
            ),
            f"fits: total <= {assume.headroom:.0%} of HBM. time: max(hw FLOPs / (chips x peak x "
            f"{assume.efficiency:.0%}), HBM bytes / bandwidth); ICI collectives not modelled",
            "train FLOPs: 6*N*tokens + 12*L*H*D*T*tokens (+ remat recompute in hw); decode: "
            "per token step of the rows held at once; prefill: one chunk of those rows",
        ]
    )


# --------------------------------------------------------------------------- mesh.shape=auto


def is_auto(shape: Any) -> bool:
    """`mesh.shape=auto` (a command-line override arrives as the tuple ("auto",))."""
    return shape == "auto" or (isinstance(shape, tuple | list) and tuple(shape) == ("auto",))


def mesh_candidates(n: int, num_kv_heads: int) -> list[tuple[int, int, int]]:
    """(1, n / t, t) for t = 1, 2, 4, 8 dividing both n and the KV heads: FSDP first (the train
    state spread over every chip), then more tensor parallelism (the sampler's weights and
    KV heads split t ways)."""
    return [(1, n // t, t) for t in (1, 2, 4, 8) if n % t == 0 and num_kv_heads % t == 0]


def _grad_accums(prompts: int, start: int) -> list[int]:
    """start, 2 start, 4 start, ... while each divides the update's prompts (whole groups)."""
    out, ga = [], max(1, start)
    while ga <= prompts and prompts % ga == 0:
        out.append(ga)
        ga *= 2
    return out


def _row_chunks(rows: int, shards: int) -> list[int]:
    """rows, rows / 2, ... while a whole number of rows per data x fsdp shard (at least one)."""
    out = []
    while rows >= shards and rows % shards == 0:
        out.append(rows)
        if rows % 2:
            break
        rows //= 2
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    mesh: tuple[int, int, int]
    grad_accum: int
    max_rows: int  # rl.max_rows: 0 = every row at once
    rows: list[dict[str, Any]]  # the plan rows that fit
    tried: int  # configurations compiled

    def apply(self, config) -> None:
        """Sets the choice in the config."""
        config.mesh.shape = self.mesh
        config.rl.optim.grad_accum = self.grad_accum
        config.rl.max_rows = self.max_rows

    def line(self, where: str) -> str:
        gib = ", ".join(f"{r['program']} {r['total_gib']:.1f}" for r in self.rows)
        rows = f"rl.max_rows={self.max_rows}" if self.max_rows else "all rows at once"
        return (
            f"mesh.shape=auto on {where}: {'x'.join(map(str, self.mesh))}, "
            f"rl.optim.grad_accum={self.grad_accum}, {rows} (GiB per device: {gib} of "
            f"{self.rows[0]['hbm_gib']:.0f}; {self.tried} plans compiled)"
        )


def choose(config, topology: str | Topology, shape: Shape, plan_fn=None, **plan_kw) -> Choice:
    """The first (mesh, grad_accum, max_rows) under which every program fits: meshes in
    `mesh_candidates` order; per mesh, the config's grad_accum, then doubled (up to one group
    per microbatch), until the train step fits; then all sampler rows at once, then halved
    (down to one row per data x fsdp shard), until decode and prefill fit. `plan_fn` (default
    `plan`) is called as `plan(config, topology, shape, programs=..., **plan_kw)`."""
    from rcgrpo_jax.errors import UserError

    plan_fn = plan if plan_fn is None else plan_fn
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    cfg = model_config(config, int(plan_kw.get("extra_vocab", 0)), int(plan_kw.get("layers", 0)))
    tried = 0
    for mesh in mesh_candidates(topo.chips, cfg.num_kv_heads):
        c = config.copy_and_resolve_references()
        c.mesh.shape = mesh
        train = None
        for ga in _grad_accums(shape.prompts, shape.grad_accum):
            tried += 1
            (row,) = plan_fn(c, topo, dataclasses.replace(shape, grad_accum=ga),
                             programs=("train",), **plan_kw)  # fmt: skip
            if row["fits"]:
                train = (ga, row)
                break
        if train is None:
            continue
        all_rows = shape.prompts * shape.minibatches * shape.group
        for rows in _row_chunks(all_rows, mesh[0] * mesh[1]):
            tried += 1
            max_rows = 0 if rows == all_rows else rows
            chunked = dataclasses.replace(shape, grad_accum=train[0], max_rows=max_rows)
            sampler = plan_fn(c, topo, chunked, programs=("decode", "prefill"), **plan_kw)
            if all(r["fits"] for r in sampler):
                return Choice(mesh, train[0], max_rows, [train[1], *sampler], tried)
    raise UserError(
        f"mesh.shape=auto: no mesh of {topo.chips} {topo.chip.name} devices fits every program "
        f"(tried {tried} plans); plan one by hand: python -m rcgrpo_jax.tools.plan"
    )


def device_topology(devices) -> Topology | None:
    """The devices as a planner topology: their chip's figures where the device kind names a
    known TPU, with the memory limit the runtime reports; None where none is reported (CPU)."""
    from rcgrpo_jax.tools.chips import CHIPS, Chip

    d = devices[0]
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return None
    kind = str(getattr(d, "device_kind", d.platform)).lower()
    known = next((c for k, c in CHIPS.items() if k in kind.replace(" lite", "e").replace(" ", "")),
                 None)  # fmt: skip
    chip = Chip(kind, int(limit), *(
        (known.peak_flops, known.hbm_bandwidth) if known else (1e15, 1e12)), 1, 4)  # fmt: skip
    return Topology(name=f"{len(devices)} x {kind}", chip=chip, chips=len(devices))


def resolve_auto(config) -> str:
    """Sets `mesh.shape=auto`'s choice in `config` (mesh, rl.optim.grad_accum, rl.max_rows)
    for the devices present, by planning on them (`choose`); returns the line that says it.
    Devices that report no memory limit (CPU) get FSDP over all of them, nothing else changed."""
    import jax

    devices = jax.devices()
    topo = device_topology(devices)
    if topo is None:
        config.mesh.shape = (1, len(devices), 1)
        return (
            f"mesh.shape=auto on {len(devices)} {devices[0].platform} devices (no memory limit "
            f"reported): 1x{len(devices)}x1"
        )
    choice = choose(config, topo, shape_from_config(config), devices=devices)
    choice.apply(config)
    return choice.line(topo.name)


# --------------------------------------------------------------------------- CLI

_DEVICES_ENV = "RCGRPO_PLAN_DEVICES"


def _topology_from_argv(argv: Sequence[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--topology="):
            return a.split("=", 1)[1]
        if a == "--topology" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def ensure_virtual_devices(argv: Sequence[str]) -> None:
    """Re-executes this module with N virtual CPU devices unless it already has them (XLA reads
    the flag once, when the backend starts, so it must be in the environment beforehand)."""
    name = _topology_from_argv(argv)
    if name is None:
        return
    try:
        n = parse_topology(name).chips
    except ValueError:
        return  # absl reports it
    if os.environ.get(_DEVICES_ENV) == str(n):
        return
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_DEVICES_ENV: str(n)})
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.execve(sys.executable, [sys.executable, "-m", "rcgrpo_jax.tools.plan", *argv[1:]], env)


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", "configs/qwen7b.py", "Experiment config.")
    flags.DEFINE_string("topology", "v5p-16", "TPU slice, e.g. v5p-16 (cores), v6e-16 (chips).")
    flags.DEFINE_integer(
        "prompts", None, "P: prompts per train step (default: rl.num_prompts / rl.minibatches)."
    )
    flags.DEFINE_integer(
        "minibatches", None, "Train steps per rollout batch: sampler rows = P x this x G."
    )
    flags.DEFINE_integer("group", None, "G: rollouts per prompt (default: rl.group_size).")
    flags.DEFINE_integer("seq", None, "T: tokens per trajectory (rl.max_len).")
    flags.DEFINE_integer("grad_accum", None, "Train-step microbatches (rl.optim.grad_accum).")
    flags.DEFINE_integer("prefill_chunk", None, "Prefill chunk length (Buckets.chunk_max).")
    flags.DEFINE_list("programs", ["train", "decode", "prefill"], f"Subset of {PROGRAMS}.")
    flags.DEFINE_float("efficiency", 0.6, "Assumed fraction of peak FLOP/s reached.")
    flags.DEFINE_float("kl_beta", None, "KL weight, >0 adds ref_logprobs (rl.kl_beta).")
    flags.DEFINE_integer("extra_vocab", 0, "Rows added to the vocabulary (reward tokens).")
    flags.DEFINE_integer("layers", 0, "Cut the model to this many layers (0 = all).")
    flags.DEFINE_integer("prompt_tokens", 4096, "Prompt tokens per trajectory (projection).")
    flags.DEFINE_string("json", "", "Also write the rows as JSON to this file.")
    return config


def main(argv: Sequence[str]) -> int:
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    shape = shape_from_config(
        config,
        prompts=f.prompts,
        minibatches=f.minibatches,
        group=f.group,
        seq=f.seq,
        grad_accum=f.grad_accum,
        prefill_chunk=f.prefill_chunk,
    )
    assume = Assumptions(efficiency=f.efficiency)
    kw = dict(assume=assume, kl_beta=f.kl_beta, extra_vocab=f.extra_vocab, layers=f.layers)
    out: dict[str, Any] = {}
    if is_auto(config.mesh.shape):
        choice = choose(config, f.topology, shape, **kw)
        print(choice.line(f.topology))
        rows = choice.rows
        shape = dataclasses.replace(shape, grad_accum=choice.grad_accum, max_rows=choice.max_rows)
        out["choice"] = {k: getattr(choice, k) for k in ("mesh", "grad_accum", "max_rows", "tried")}
    else:
        rows = plan(config, f.topology, shape, programs=f.programs, **kw)
    print(format_table(rows))
    print(describe(rows, assume))
    out["rows"] = rows
    if set(PROGRAMS) <= {r["program"] for r in rows}:
        out["iteration"] = iteration(rows, shape, workload_from_config(config, f.prompt_tokens))
        print(format_iteration(out["iteration"]))
    if f.json:
        Path(f.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    ensure_virtual_devices(sys.argv)
    from absl import app

    _CONFIG = _define_flags()
    app.run(main)
