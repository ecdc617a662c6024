"""The planner's cost model: FLOPs per program (`models.flops`, over the batch a program runs),
the HBM bytes a step must move, and the roofline projection of its time and MFU from both.
Collectives over ICI are not modelled."""

from __future__ import annotations

import dataclasses

from rcgrpo_jax.planning.chips import Topology
from rcgrpo_jax.planning.programs import Shape, planned_attention, sampler_batch

HEADROOM = 0.9  # "fits" = peak <= 90% of HBM (runtime reservations, fragmentation, CPU≠TPU)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    efficiency: float = 0.6  # fraction of peak FLOP/s a well-fused matmul step reaches
    headroom: float = HEADROOM


def train_flops(cfg, shape: Shape, kind: str | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one train step on P·G·T tokens.

    model    = 6·N·tokens + 12·L·H·D·T·tokens   (fwd 2 + bwd 4 per weight per token; attention
               QKᵀ and PV, 2·2·H·D·T per token per layer forward, ×3 with backward, over the
               full T×T: PaLM's MFU convention, whatever an implementation skips)
    hardware = what our step computes with attention kernel `kind` (default: what
               `cfg.attention` runs on a TPU, `planned_attention`):
               `models.flops.train_hardware_flops_per_token` per token.
    """
    from rcgrpo_jax.models import flops

    kind = planned_attention(cfg, shape.seq).train if kind is None else kind
    tokens = shape.rollouts * shape.seq
    model = flops.flops_per_token(cfg, shape.seq) * tokens
    hardware = flops.train_hardware_flops_per_token(cfg, shape.seq, kind)
    return float(model), float(hardware * tokens)


def sampler_flops(cfg, mesh, shape: Shape, program: str) -> float:
    """FLOPs of one decode token step (every state row) or one prefill chunk: the forward's
    2·N per token plus attention over the whole cache capacity (4·L·H·D·cache per token)."""
    from rcgrpo_jax.models import flops

    chunk = 1 if program == "decode" else min(shape.prefill_chunk, shape.seq)
    toks = sampler_batch(mesh, shape) * chunk
    return flops.flops_per_token(cfg, shape.cache, training=False) * toks


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
    rollout's cache length). Activations ignored. `cfg` is the model the program runs (the
    sampler's: `models.sampler_config`); under LoRA the state is the adapters' alone.
    """
    from rcgrpo_jax.models import flops

    tensor = mesh.shape["tensor"]
    # the sampler's "tensor" copy (mesh.sampler_weights) holds the weights in the compute dtype
    dtype = cfg.compute_dtype if program != "train" and layout == "tensor" else cfg.weight_dtype
    # adapters (f32) are read where the program applies them: training, and "train"'s sampler
    adapters = flops.lora_matmul_params(cfg) * 4
    w = (flops.matmul_params(cfg) * _itemsize(dtype) + adapters) / tensor
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
