"""The package's layers: which of its parts may import which.

`LAYERS` lists the floors bottom first; each floor names units, a unit being a top-level module
(`errors`) or subpackage (`models`) of `rcgrpo_jax`. A module imports from its own unit or from
units on lower floors only: never from a unit on its own floor (no sideways import) and never
upward. That holds for every import, those inside functions and the module names handed to
`importlib` included; and no chain of module-level imports comes back to where it started.
tests/test_style.py checks both on every module. A new top-level module or subpackage takes its
place in this table.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    # what every layer raises
    ("errors",),
    # config defaults and utilities with no part of the package below them: logging, the
    # machine's figures, multi-host start-up, the XLA cache, host memory, bundled assets,
    # shape buckets, this table; the run report (a page built from a run's files alone)
    (
        "config",
        "logs",
        "machine",
        "distributed",
        "compilation",
        "host_memory",
        "assets",
        "shapes",
        "layers",
        "report",
    ),
    # the decoder; the environments (neither knows the other)
    ("models", "envs"),
    # the sampler (over models); trajectories and packing (over envs); training (over models)
    ("sampling", "data", "train"),
    # RL: rollouts through the sampler in an environment, the fused train step
    ("rl",),
    # the stages that compose the libraries; the config's validation against their registries;
    # AOT planning, which compiles the programs a config's stages run (mesh.shape=auto)
    ("stages", "config_check", "planning"),
    # the command lines
    ("main", "tools"),
)
