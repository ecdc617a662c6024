"""Sampler: jitted KV-cache generation for ragged batches, with multi-turn cache continuation.

`generate` is the one-shot entry point; `Session` keeps each trajectory's cache alive across
turns for multi-turn rollouts (see `session` for the driving loop); `Lanes` drives several
sessions as one, their device work side by side (on one CPU device, one lane per core); `core`
holds the pure jitted programs over the `RolloutState` pytree.
"""

from rcgrpo_jax.sampling.core import (
    RolloutState,
    SampleMode,
    compile_count,
    state_logical_axes,
    state_shapes,
)
from rcgrpo_jax.sampling.lanes import Generation, Lanes, generate, generate_lanes
from rcgrpo_jax.sampling.session import CapacityError, Session, Trajectory, TurnOutput
from rcgrpo_jax.shapes import Buckets, batch_capacity, cache_capacity, length_bucket

__all__ = [
    "Buckets",
    "CapacityError",
    "Generation",
    "Lanes",
    "RolloutState",
    "SampleMode",
    "Session",
    "Trajectory",
    "TurnOutput",
    "batch_capacity",
    "cache_capacity",
    "compile_count",
    "state_logical_axes",
    "state_shapes",
    "generate",
    "generate_lanes",
    "length_bucket",
]
