"""rcgrpo_jax: Reward-Conditioned GRPO for multi-turn tool-calling agents, in JAX/Flax.

Submodules are imported on use (`from rcgrpo_jax import models, sampling, rl`), so that the
environment code can be used without loading JAX.
"""

__version__ = "0.1.0"
