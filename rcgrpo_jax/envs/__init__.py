"""Environments: the protocol and registry (`base`), BFCL v4 multi-turn (`bfcl`) and the synthetic
file-system tasks (`synthetic`), both registered in `builtin`."""

from rcgrpo_jax.envs.base import (
    Environment,
    Episode,
    EpisodeSettings,
    Step,
    Task,
    get,
    names,
    register,
)

__all__ = ["Environment", "Episode", "EpisodeSettings", "Step", "Task", "get", "names", "register"]
