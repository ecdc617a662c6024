"""The jitted step and its fresh state on one device: what every bench times (shared)."""

from __future__ import annotations

from typing import Any


def fresh_step(cfg, params, optim, make=None, objective=None) -> tuple[Any, Any, Any]:
    """(step, state, mesh) on a one-device mesh with `optim` (an `OptimConfig`): our fused RL step
    with `objective` (default `rl.Objective()`), or `make(optimizer, mesh=, shardings=)`'s."""
    import jax

    from rcgrpo_jax import models, rl
    from rcgrpo_jax.rl.train_step import make_rl_step
    from rcgrpo_jax.train.optim import make_optimizer
    from rcgrpo_jax.train.state import init_train_state, state_shardings

    mesh = models.make_mesh((1, 1, 1), jax.devices()[:1])
    optimizer = make_optimizer(optim)
    psh = models.param_shardings(cfg, mesh)
    state = init_train_state(params, optimizer, 0, mesh=mesh, param_shardings=psh)
    shardings = state_shardings(optimizer, psh, mesh, params)
    if make is None:
        objective = objective if objective is not None else rl.Objective()
        make = lambda opt, **kw: make_rl_step(cfg, objective, opt, **kw)
    return make(optimizer, mesh=mesh, shardings=shardings), state, mesh


def compile_step(step, state, batch, mesh) -> tuple[Any, Any, float, Any]:
    """(compiled step, the batch on the mesh, compile seconds, XLA's memory analysis): the AOT
    compile the memory benches read their temporaries from."""
    import time

    from rcgrpo_jax.models.sharding import use_mesh
    from rcgrpo_jax.train.state import shard_batch

    batch = shard_batch(batch, mesh)
    t0 = time.perf_counter()
    with use_mesh(mesh):
        compiled = step.jitted.lower(state, None, batch).compile()
    return compiled, batch, time.perf_counter() - t0, compiled.memory_analysis()
