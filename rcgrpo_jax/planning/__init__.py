"""AOT planning: will a config fit a TPU slice, and how fast could its steps run?

- chips:    TPU chip specs and slice names (`parse_topology("v5p-16")`).
- presets:  the model a config plans (`model_config`; `HF_PRESETS`, the two paper models).
- programs: the [P, G, T] update and sampler rows planned (`Shape`, `shape_from_config`), the
            attention kernels a TPU runs (`planned_attention`), and the train, decode and
            prefill programs lowered + compiled on abstract inputs.
- cost:     FLOPs (`models.flops` over a program's batch), HBM traffic, roofline projection.
- planner:  `plan`: one row per program (memory, fit, FLOPs, projected time and MFU).
- auto:     `mesh.shape=auto`: `choose` the first mesh, grad_accum and rl.max_rows that fit;
            `resolve_auto` at a run's start-up.

The command line and its report (table, projected RL iteration) are `tools.plan`. The package
sits beside `stages`, over the libraries whose programs it compiles, and below `main`, which
resolves `mesh.shape=auto` with it. Modules import JAX and the libraries
inside their functions: `tools.plan` re-executes itself with virtual devices before JAX loads.
"""

from rcgrpo_jax.planning.auto import (
    Choice,
    choose,
    device_topology,
    mesh_candidates,
    resolve_auto,
)
from rcgrpo_jax.planning.chips import CHIPS, Chip, GiB, Topology, parse_topology
from rcgrpo_jax.planning.cost import (
    HEADROOM,
    Assumptions,
    hbm_traffic,
    project,
    sampler_flops,
    train_flops,
)
from rcgrpo_jax.planning.planner import PROGRAMS, is_auto, plan, resolve_mesh_shape
from rcgrpo_jax.planning.presets import HF_PRESETS, model_config
from rcgrpo_jax.planning.programs import (
    PlannedAttention,
    Shape,
    planned_attention,
    sampler_batch,
    shape_from_config,
)

__all__ = [
    "CHIPS",
    "HEADROOM",
    "HF_PRESETS",
    "PROGRAMS",
    "Assumptions",
    "Chip",
    "Choice",
    "GiB",
    "PlannedAttention",
    "Shape",
    "Topology",
    "choose",
    "device_topology",
    "hbm_traffic",
    "is_auto",
    "mesh_candidates",
    "model_config",
    "parse_topology",
    "plan",
    "planned_attention",
    "project",
    "resolve_auto",
    "resolve_mesh_shape",
    "sampler_batch",
    "sampler_flops",
    "shape_from_config",
    "train_flops",
]
