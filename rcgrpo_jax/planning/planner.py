"""The plan of one config on one topology: per program, XLA's per-device memory, whether it fits
the chip's HBM, analytic FLOPs and a roofline projection of the step time and MFU.

Memory comes from the XLA *CPU* compiler's buffer assignment, which fuses and schedules
differently from the TPU compiler (usually more conservatively). `cost_analysis` counts a
scanned layer body once, so the FLOPs are analytic (`planning.cost`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rcgrpo_jax.planning.chips import GiB, Topology, parse_topology
from rcgrpo_jax.planning.cost import Assumptions, hbm_traffic, project, sampler_flops, train_flops
from rcgrpo_jax.planning.presets import model_config
from rcgrpo_jax.planning.programs import (
    Shape,
    compile_sampler,
    compile_train,
    device_bytes,
    f32_temp,
    memory,
    planned_attention,
    sampler_batch,
    sampler_weights,
    train_setup,
    upcasts_on_cpu,
)

PROGRAMS = ("train", "decode", "prefill")


def is_auto(shape: Any) -> bool:
    """`mesh.shape=auto` (a command-line override arrives as the tuple ("auto",))."""
    return shape == "auto" or (isinstance(shape, tuple | list) and tuple(shape) == ("auto",))


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


def plan(
    config,
    topology: str | Topology,
    shape: Shape = Shape(),  # noqa: B008 (frozen)
    *,
    programs: Sequence[str] = ("train", "decode"),
    devices=None,
    assume: Assumptions = Assumptions(),  # noqa: B008 (frozen)
    kl_beta: float | None = None,
    extra_vocab: int = 0,
    layers: int = 0,
) -> list[dict[str, Any]]:
    """One row per program: memory, fit, FLOPs, projection. `devices`: defaults to the first
    `chips` of `jax.devices()` (the CLI provides exactly that many virtual CPU devices). The
    train step is the config's objective, `kl_beta` (if given) in place of rl.kl_beta."""
    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.rl.losses import objective_from_config

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
    kinds = planned_attention(cfg, shape.seq, shape.cache, topo.chip.backend)
    cfg = cfg.replace(attention=kinds.compiled)
    sampler_cfg = cfg.replace(attention=kinds.sampler)
    if shape.prompts % shape.grad_accum:
        raise ValueError(f"prompts={shape.prompts} not divisible by grad_accum={shape.grad_accum}")

    objective = objective_from_config(config.rl)
    if kl_beta is not None:
        objective = dataclasses.replace(objective, kl_beta=float(kl_beta))
    train = train_setup(cfg, mesh, shape, objective)
    compiled = [compile_train(mesh, train)] if "train" in programs else []
    state_bytes = device_bytes(train.state)
    frozen_bytes = device_bytes(train.frozen or {})
    layout = str(config.mesh.sampler_weights)
    sampler_cfg, sampler_params, resident = sampler_weights(sampler_cfg, mesh, train, layout)
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
        "loss_tokens": shape.loss_tokens,
        "sampler_rows": sampler_batch(mesh, shape),
        "sampler_weights": layout,
        "cache": shape.cache,
        "hbm_gib": topo.chip.hbm_bytes / GiB,
        "state_gib": state_bytes / GiB,
        "lora_rank": cfg.lora.rank if cfg.lora is not None else 0,
        "frozen_gib": frozen_bytes / GiB,
    }
    for c in compiled:
        mem = memory(c)
        total = mem["peak"] + c.resident_bytes
        if c.program == "train":
            flops = train_flops(cfg, shape, kinds.train)
        else:
            f = sampler_flops(sampler_cfg, mesh, shape, c.program)
            flops = (f, f)
        model = cfg if c.program == "train" else sampler_cfg
        traffic = hbm_traffic(model, mesh, shape, c.program, state_bytes, layout)
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
