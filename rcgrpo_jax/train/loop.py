"""The step loop both stages share: restore-or-init, steps, metrics, periodic/final checkpoints.

The loop owns nothing model-specific: it is handed a compiled `step_fn` (from
`state.make_train_step`, or the RL step built on it), a batch iterator with get_state/set_state
(grain), a `Checkpointer` and a `MetricsWriter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from rcgrpo_jax.train.checkpoint import Checkpointer
from rcgrpo_jax.train.metrics import MetricsWriter, mfu
from rcgrpo_jax.train.state import TrainState


def restore_or_init(
    checkpointer: Checkpointer | None,
    target: TrainState,
    init_fn: Callable[[], TrainState],
    data_iter: Any | None = None,
) -> tuple[TrainState, dict]:
    """(state, data state) of the newest restorable checkpoint, else (`init_fn()`, {}). The
    data state is what the checkpoint stored beside the state: a grain iterator's position,
    also set on `data_iter` when given, or a loop's own counters."""
    restored = checkpointer.restore_latest(target) if checkpointer is not None else None
    if restored is None:
        return init_fn(), {}
    state, data_state, _ = restored
    if data_iter is not None and data_state:
        data_iter.set_state(data_state)
    return state, data_state


def train_loop(
    step_fn: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]],
    state: TrainState,
    data_iter: Iterator[Any],
    num_steps: int,
    *,
    checkpointer: Checkpointer | None = None,
    writer: MetricsWriter | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    on_step: Callable[[int, TrainState, dict[str, Any]], None] | None = None,
    until: Callable[[int, TrainState], bool] | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs from `state.step` to `num_steps`, or to the first step at which `until(step, state)`
    holds (asked before each step, so a run resumed at that step stops there again; not asked
    at `num_steps`, where the run ends anyway). Returns the final state and the per-step records
    of the whole run (a resumed run's earlier ones come from `writer.previous`).

    Step numbers in metrics/checkpoints are the state's step *after* the update (1-based), so a
    checkpoint at step s holds the iterator positioned at batch s. A final checkpoint is forced.
    """
    history = list(writer.previous) if writer is not None else []
    step = int(state.step)
    get_state = getattr(data_iter, "get_state", None)
    while step < num_steps and not (until is not None and until(step, state)):
        batch = next(data_iter)
        t0 = time.perf_counter()
        state, m = step_fn(state, batch)
        m = {k: v.item() for k, v in jax.device_get(m).items()}  # blocks: honest step time
        dt = time.perf_counter() - t0
        step += 1
        m["step_time_s"] = dt
        m["tokens_per_s"] = m.get("tokens", 0.0) / dt if dt > 0 else 0.0
        if flops_per_token and peak_flops:
            m["mfu"] = mfu(m["tokens_per_s"], flops_per_token, peak_flops)
        if writer is not None:
            m = writer.write(step, m)
        history.append(m)
        if on_step is not None:
            on_step(step, state, m)
        if checkpointer is not None:
            checkpointer.save(step, state, get_state() if get_state else None)
    if checkpointer is not None:
        checkpointer.save(step, state, get_state() if get_state else None, force=True)
        checkpointer.wait()
    return state, history
