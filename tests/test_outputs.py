"""Run outputs under a full disk and after a kill: whole lines, atomic files, one-line errors.

The writers are driven with a patched `os.write` / `os.replace` / `shutil.disk_usage` that fail
as a full disk does (ENOSPC, or a short write followed by ENOSPC); the real full disk, on a
tmpfs, is in test_kill_resume.py.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import jax.numpy as jnp
import pytest

from rcgrpo_jax.errors import UserError
from rcgrpo_jax.train import checkpoint, metrics
from rcgrpo_jax.train.metrics import JsonlLog, MetricsWriter, OutputError, write_atomic

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_after(n_bytes: int, fd_of):
    """An os.write that writes `n_bytes` more to the watched fd, then fails with ENOSPC."""
    real, left = os.write, [n_bytes]

    def write(fd, data):
        if fd != fd_of():
            return real(fd, data)
        if left[0] <= 0:
            raise ENOSPC
        n = real(fd, bytes(data[: left[0]]))
        left[0] -= n
        return n

    return write


def test_a_line_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = JsonlLog(path, "step", 0)
    log.append({"step": 1, "loss": 1.0})
    with monkeypatch.context() as mp:
        mp.setattr(os, "write", full_after(7, lambda: log._fd))  # half of the next line fits
        with pytest.raises(OutputError, match=f"cannot write {path}: No space left on device"):
            log.append({"step": 2, "loss": 0.5})
    assert path.read_text() == json.dumps({"step": 1, "loss": 1.0}) + "\n"
    log.append({"step": 2, "loss": 0.5})  # space again: the run could go on
    log.close()
    assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2]
    assert issubclass(OutputError, UserError)  # main prints it as one `error:` line, exit 2


def test_resume_drops_records_past_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    whole = "".join(json.dumps({"iteration": i, "x": [i]}) + "\n" for i in range(1, 6))
    path.write_text(whole + '{"iteration": 6, "x": [')  # killed mid-line
    log = JsonlLog(path, "iteration", 3)
    assert [r["iteration"] for r in log.previous] == [1, 2, 3]
    log.append({"iteration": 4, "x": [4]})
    log.close()
    assert [r["iteration"] for r in metrics.read_jsonl(path)] == [1, 2, 3, 4]
    assert not list(tmp_path.glob(".rollouts.jsonl.*"))  # the rewrite left no temporary file


def test_metrics_writer_resumes_at_its_initial_step(tmp_path):
    with MetricsWriter(tmp_path, progress=False, tensorboard=False) as w:
        for step in (1, 2, 3):
            w.write(step, {"loss": float(step)})
    with MetricsWriter(tmp_path, initial_step=2, progress=False, tensorboard=False) as w:
        assert [r["step"] for r in w.previous] == [1, 2]
        w.write(3, {"loss": 30.0})
    rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


class _FullFile:
    """What os.fdopen returns on a full disk: 3 bytes go in, then ENOSPC."""

    def __init__(self, fd, mode):
        self.f = _REAL_FDOPEN(fd, mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, text):
        self.f.write(text[:3])
        self.f.flush()
        raise ENOSPC


_REAL_FDOPEN = os.fdopen


def _no_room(*args):
    raise ENOSPC


@pytest.mark.parametrize("fails", ["fdopen", "replace"])
def test_write_atomic_keeps_the_old_file(tmp_path, monkeypatch, fails):
    path = tmp_path / "summary.json"
    path.write_text('{"old": 1}\n')
    monkeypatch.setattr(os, fails, _FullFile if fails == "fdopen" else _no_room)
    with pytest.raises(OutputError, match="summary.json: No space left on device"):
        write_atomic(path, '{"new": 2}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_checkpoint_refuses_a_save_that_does_not_fit(tmp_path, monkeypatch):
    state = {"w": jnp.arange(4096, dtype=jnp.float32)}
    with checkpoint.Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:
        assert ckpt.save(1, state)
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: _Usage(free=1))
        with pytest.raises(OutputError, match=f"checkpoint step 2 in {tmp_path}: No space left"):
            ckpt.save(2, state)
        assert ckpt.all_steps() == [1]  # the previous one stays as it was


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_out_of_space_errors_are_recognised():
    """orbax/tensorstore report a full disk as a ValueError carrying the OS message; an async
    save's failure surfaces later, chained."""
    ts = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "params.embedding/0.0" ... Failed to write 51922 '
        "bytes to file 9: No space left on device [os_error_code='28']"
    )
    assert checkpoint.disk_error(ts) == "No space left on device"
    try:
        try:
            raise ts
        except ValueError as e:
            raise RuntimeError("background save failed") from e
    except RuntimeError as chained:
        assert checkpoint.disk_error(chained) == "No space left on device"
    assert checkpoint.disk_error(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert checkpoint.disk_error(ValueError("shape mismatch")) is None


def test_checkpoint_save_failure_names_the_folder(tmp_path, monkeypatch):
    ckpt = checkpoint.Checkpointer(tmp_path, save_every=1, keep=3)

    def save(*args, **kwargs):
        raise ValueError("NOT_FOUND... No space left on device [os_error_code='28']")

    monkeypatch.setattr(ckpt.manager, "save", save)
    with pytest.raises(OutputError, match=f"checkpoints in {tmp_path}: No space left on device"):
        ckpt.save(1, {"w": jnp.zeros(3)})
    ckpt.close()
    assert Path(tmp_path).is_dir()
