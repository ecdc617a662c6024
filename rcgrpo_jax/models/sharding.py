"""Device mesh and the one table that maps logical axes to mesh axes.

Every parameter and main activation names its dimensions with logical axes ("embed", "q_heads",
"act_batch", ...). `LOGICAL_AXIS_RULES` is the only place that decides how those map onto the
physical mesh axes ("data", "fsdp", "tensor"). A mesh axis that does not divide a dimension is
dropped for that dimension (e.g. 2 KV heads on a 4-way tensor axis are replicated), because jit
rejects uneven argument shardings; `explain_sharding` reports where that happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),  # LoRA's A and B are split like the rows they adapt, never over rank
    ("lora_tokens", None),
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    # The residual stream: split over "tensor" like everything else in a layer, so that remat's
    # stack of layer inputs [L, B, T, E] is not whole on every tensor shard (issue 28).
    ("act_embed", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # KV cache
    ("cache_layers", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_len", None),
    ("cache_kv_heads", "tensor"),
)
_RULES = dict(LOGICAL_AXIS_RULES)
# The mesh axes that split the batch: a weight is gathered over them where a layer reads it
# (`decoder.layer_weights`), so every matmul sees its weights split over "tensor" at most.
BATCH_MESH_AXES = ("data", "fsdp")


def make_mesh(
    shape: Sequence[int] = (1, 1, 1), devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types (jit + sharding constraints decide)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {shape} needs {n} devices, only {len(devices)} available")
    grid = np.asarray(devices[:n], dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    replicate: Sequence[str] = (),
) -> PartitionSpec:
    """Resolves logical axes through the rules; with a shape and mesh, drops non-dividing axes.
    Mesh axes in `replicate` are never used (the array is replicated over them)."""
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        if name is not None and name not in _RULES:
            raise KeyError(f"logical axis {name!r} has no entry in LOGICAL_AXIS_RULES")
        target = _RULES.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        kept = []
        size = 1
        for ax in axes:
            if ax in used or ax in replicate:
                continue
            ax_size = mesh.shape[ax] if mesh is not None else 1
            if shape is not None and shape[i] % (size * ax_size):
                continue
            size *= ax_size
            kept.append(ax)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    replicate: Sequence[str] = (),
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, replicate))


def tree_shardings(mesh: Mesh, logical_tree, shape_tree, replicate: Sequence[str] = ()):
    """Maps a pytree of logical-axis tuples and a matching pytree of shapes to NamedShardings
    (never over the mesh axes in `replicate`)."""
    return jax.tree.map(
        lambda axes, s: named_sharding(mesh, axes, s.shape, replicate),
        logical_tree,
        shape_tree,
        is_leaf=lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x),
    )


def constrain(
    x: jax.Array, logical_axes: Sequence[str | None], replicate: Sequence[str] = ()
) -> jax.Array:
    """Sharding constraint on an activation (or a weight where it is used; never over the mesh
    axes in `replicate`); a no-op outside a mesh context (`use_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != set(MESH_AXES):
        return x
    spec = logical_to_spec(logical_axes, x.shape, mesh, replicate)
    return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Context in which traced code sees `mesh` (activation constraints resolve against it)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def explain_sharding(mesh: Mesh, logical_tree, shape_tree) -> list[str]:
    """Lines naming each leaf whose rule-given mesh axis was dropped because it does not divide."""
    notes: list[str] = []

    def check(path, axes, s):
        full = logical_to_spec(axes)
        got = logical_to_spec(axes, s.shape, mesh)
        if full != got:
            notes.append(f"{jax.tree_util.keystr(path)} {tuple(s.shape)}: wanted {full}, got {got}")

    jax.tree_util.tree_map_with_path(
        check,
        logical_tree,
        shape_tree,
        is_leaf=lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x),
    )
    return notes
