"""Orbax checkpoints of the train state plus the data-iterator position, with fallback restore.

Layout under `directory` (one orbax CheckpointManager):

    <step>/state/   TrainState (step, params, opt_state, rng, skipped) — StandardSave, sharded
    <step>/data/    JSON: the grain iterator state of process 0 ({} when there is none)
    corrupt/<step>/ checkpoints that failed to restore, moved aside (never deleted by us)

Every process consumes the same number of batches from its own shard, so process 0's iterator
state (an index) restores every host's iterator. Saves are async; `wait()` before reading them.
A latest checkpoint that fails to restore (truncated/deleted file, partial write) is moved to
`corrupt/` with a warning and the previous one is tried, so the run resumes from there and can
later save that step number again.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    """Save every `save_every` steps (and when forced, e.g. at the end), keep the last `keep`."""

    def __init__(
        self, directory: str | Path, *, save_every: int, keep: int = 3, async_save: bool = True
    ) -> None:
        self.directory = Path(directory).absolute()
        self.save_every = int(save_every)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(self.save_every, 1),
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self, step: int, state: Any, data_state: dict | None = None, *, force: bool = False
    ) -> bool:
        """Saves if `step` is on the interval (or `force`); returns whether a save started."""
        step = int(step)
        if step in self.manager.all_steps():
            return False
        if not force and (self.save_every <= 0 or step % self.save_every):
            return False
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state or {}),
            ),
            force=True,
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restores `step` onto the shardings of `target` (ShapeDtypeStructs with shardings)."""
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
            ),
        )
        _check_like(out.state, target)
        return out.state, dict(out.data or {})

    def restore_latest(self, target: Any) -> tuple[Any, dict, int] | None:
        """(state, data_state, step) from the newest checkpoint that restores; None if none does.

        A checkpoint that fails is moved to `corrupt/` (process 0) and the previous one is tried.
        """
        self.wait()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data = self.restore(step, target)
            except Exception as e:  # noqa: BLE001 — any failure means "unusable checkpoint"
                log.warning(
                    "checkpoint step %d in %s failed to restore (%s: %s); moving it to corrupt/ "
                    "and falling back to the previous one",
                    step,
                    self.directory,
                    type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "",
                )
                self._quarantine(step)
                continue
            return state, data, step
        return None

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            src = self.directory / str(step)
            if src.exists():
                dst = self.directory / "corrupt" / str(step)
                if dst.exists():
                    shutil.rmtree(dst)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(src), str(dst))
        if jax.process_count() > 1:  # every host must see the move before re-listing steps
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"rcgrpo_ckpt_quarantine_{step}")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_like(restored: Any, target: Any) -> None:
    """Structure/shape/dtype agreement: a mismatch means the checkpoint is not this run's."""
    r_leaves, r_def = jax.tree.flatten(restored)
    t_leaves, t_def = jax.tree.flatten(target)
    if r_def != t_def:
        raise ValueError(f"restored tree structure differs from target: {r_def} vs {t_def}")
    for r, t in zip(r_leaves, t_leaves, strict=True):
        if r.shape != t.shape or r.dtype != t.dtype:
            raise ValueError(f"restored leaf {r.shape}/{r.dtype} != target {t.shape}/{t.dtype}")
