"""Orbax checkpoints of the train state plus the data-iterator position, with fallback restore.

Layout under `directory` (one orbax CheckpointManager):

    <step>/state/   TrainState (step, params, opt_state, rng, skipped) — StandardSave, sharded
    <step>/data/    JSON: the grain iterator state of process 0 ({} when there is none)
    corrupt/<step>/ checkpoints that failed to restore, moved aside (never deleted by us)

Every process consumes the same number of batches from its own shard, so process 0's iterator
state (an index) restores every host's iterator. Saves are async; `wait()` before reading them.
A latest checkpoint that fails to restore (truncated/deleted file, partial write) is moved to
`corrupt/` and the previous one is tried, so the run resumes from there (one `warning:` line on
stderr says which) and can later save that step number again. Orbax writes a step into a
temporary folder and renames it when complete, so a kill -9 mid-save leaves the previous steps
as they were. Before each save the free space is compared with the size of the latest step on
disk (orbax's async writer fails noisily, in background threads, when the disk fills up); a save
that would not fit, or one that fails for lack of space all the same, raises `OutputError`
naming the checkpoint folder. The steps saved before it stay readable. Orbax also logs such a
failure, with tracebacks, from each of its background threads; those records are dropped (a
disk error only: every other failure is logged as orbax logs it), since `wait()` reports it.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rcgrpo_jax.train.metrics import OutputError

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
_DISK_MESSAGES = ("No space left on device", "Disk quota exceeded", "Read-only file system")


def disk_error(e: BaseException) -> str | None:
    """The reason if `e` (or an exception it was raised from) is an out-of-space/read-only
    failure; tensorstore reports those as ValueErrors carrying the OS message."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e.strerror or str(e)
        hit = next((m for m in _DISK_MESSAGES if m in str(e)), None)
        if hit:
            return hit
        e = e.__cause__ or e.__context__
    return None


class _DropDiskErrors(logging.Filter):
    """Drops orbax's log records of a disk-full failure: `Checkpointer.wait` raises it as one
    OutputError line, where orbax's threads would print a traceback each."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return disk_error(error) is None and not any(
            m in record.getMessage() for m in _DISK_MESSAGES
        )


def _quiet_orbax_disk_errors() -> None:
    absl_logger = logging.getLogger("absl")  # orbax logs through absl
    if not any(isinstance(f, _DropDiskErrors) for f in absl_logger.filters):
        absl_logger.addFilter(_DropDiskErrors())


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
        _quiet_orbax_disk_errors()
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
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {})
        )
        self.wait()  # the previous save's bytes are on disk before the space is measured
        self._check_space(step)
        return self._disk_checked(lambda: self.manager.save(step, args=args, force=True))

    def _check_space(self, step: int) -> None:
        """OutputError if the disk lacks room for a step as big as the latest one (+10%)."""
        latest = self.manager.latest_step()
        if latest is None:
            return
        files = (self.directory / str(latest)).rglob("*")
        needed = 1.1 * sum(f.stat().st_size for f in files if f.is_file()) + 2**16
        free = shutil.disk_usage(self.directory).free
        short = free < needed
        if jax.process_count() > 1:  # one verdict for all: the save is collective
            from jax.experimental import multihost_utils

            short = bool(multihost_utils.process_allgather(np.int32(short)).any())
        if short:
            raise OutputError(
                f"cannot write checkpoint step {step} in {self.directory}: No space left on "
                f"device ({free / 2**20:.1f} MiB free, about {needed / 2**20:.1f} MiB needed)"
            )

    def _disk_checked(self, fn):
        """fn(), with an out-of-space failure (of this save or an earlier async one) as an
        OutputError naming the folder."""
        try:
            return fn()
        except Exception as e:
            reason = disk_error(e)
            if reason is None:
                raise
            raise OutputError(f"cannot write checkpoints in {self.directory}: {reason}") from e

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

        A checkpoint that fails is moved to `corrupt/` (process 0) and the previous one is tried;
        one stderr line names the failed steps and the one resumed from.
        """
        self.wait()
        failed: list[str] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data = self.restore(step, target)
            except Exception as e:  # noqa: BLE001 — any failure means "unusable checkpoint"
                first = str(e).splitlines()[0][:200] if str(e) else ""
                failed.append(f"step {step} ({type(e).__name__}: {first})")
                self._quarantine(step)
                continue
            self._report(failed, f"resuming from step {step}")
            return state, data, step
        self._report(failed, "starting from scratch")
        return None

    def _report(self, failed: list[str], outcome: str) -> None:
        if failed and jax.process_index() == 0:
            print(
                f"warning: checkpoint {', '.join(failed)} in {self.directory} could not be "
                f"restored; moved to corrupt/, {outcome}",
                file=sys.stderr,
                flush=True,
            )

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
        self._disk_checked(self.manager.wait_until_finished)

    def close(self) -> None:
        try:
            self.wait()
        finally:
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
