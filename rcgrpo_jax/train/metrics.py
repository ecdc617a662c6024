"""Metrics sinks for every stage: metrics.jsonl, TensorBoard events (tensorboardX), a tqdm bar;
plus MFU from the analytic FLOPs of `models.flops` (XLA's cost analysis counts a scanned layer
body once).

Only process 0 writes (other processes get a writer whose calls do nothing), so multi-host runs
produce one file per workdir.

TensorBoard events are written synchronously (`EventFile`): tensorboardX's own writer thread dies
on a full disk, after which its bounded queue blocks the run forever.

Run outputs survive a kill -9 or a full disk: a JSON-lines record is one `write` of the whole
line, undone (truncated back) if it fails, so a file never holds half a line; a resumed run first
drops the records past its restored step (and any torn last line) so that its file equals an
uninterrupted run's. Whole files (summaries) are written to a temporary name and renamed. A
write that fails (disk full, quota, read-only) raises `OutputError` naming the path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rcgrpo_jax import compilation
from rcgrpo_jax.errors import UserError


class OutputError(UserError):
    """A run output could not be written (disk full, quota, read-only); one line, the path."""


def output_error(path: str | Path, e: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {e.strerror or e}")


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """An OSError inside (a full disk while writing `path`) becomes an OutputError naming it."""
    try:
        yield
    except OSError as e:
        raise output_error(path, e) from e


def write_atomic(path: str | Path, text: str) -> None:
    """Writes `path` as a whole or not at all (temporary file in the same folder, then rename)."""
    path = Path(path)
    tmp = None
    try:
        with writing(path):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


class JsonlLog:
    """An append-only JSON-lines file of records numbered by `key`, resumable at `keep_through`.

    On open, records with `key` > keep_through and a torn last line are dropped (the file is
    rewritten atomically if so); they are `previous`. `append` writes one whole line or nothing.
    """

    def __init__(self, path: str | Path, key: str, keep_through: int) -> None:
        self.path = Path(path)
        self.previous = _kept_records(self.path, key, keep_through)
        with writing(self.path):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: Mapping[str, Any]) -> None:
        data = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            os.ftruncate(self._fd, size)  # no half line (shrinking needs no space)
            raise output_error(self.path, e) from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _import_tensorboardx() -> None:
    """Imports tensorboardX with torch hidden: its package __init__ loads its SummaryWriter,
    which tries `import torch` only to accept torch tensors (we write floats), ~2.5 s a process
    wherever torch is installed. Done once, in the main thread, before any writer exists."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX  # noqa: F401

        return
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        import tensorboardX  # noqa: F401
    finally:
        del sys.modules["torch"]


class EventFile:
    """Scalars appended to a TensorBoard event file in `logdir`, one event per step, written
    and flushed in the caller's thread (a failure raises OutputError here, never hangs)."""

    def __init__(self, logdir: Path) -> None:
        _import_tensorboardx()
        from tensorboardX.event_file_writer import EventsWriter

        self.logdir = logdir
        with writing(logdir):
            logdir.mkdir(parents=True, exist_ok=True)
            self._events = EventsWriter(str(logdir / "events"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        with writing(self.logdir):
            self._events.write_event(Event(wall_time=time.time(), step=step, summary=summary))
            self._events.flush()

    def close(self) -> None:
        with writing(self.logdir):
            self._events.close()


def _kept_records(path: Path, key: str, keep_through: int) -> list[dict[str, Any]]:
    """The file's whole records numbered <= keep_through; rewrites the file if it held more."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    complete, torn = lines[:-1], lines[-1]  # text after the last newline is a torn line
    kept = []
    for line in complete:
        if line.strip():
            record = json.loads(line)
            if int(record[key]) <= keep_through:
                kept.append(record)
    if torn or len(kept) != sum(bool(x.strip()) for x in complete):
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _scalar(v: Any) -> float | int | str | None:
    """JSON-safe scalar: arrays → Python numbers; NaN/inf → null (json.dumps would write the
    invalid token NaN, which strict JSON readers reject)."""
    if isinstance(v, str):
        return v
    a = np.asarray(v)
    if a.size != 1:
        raise ValueError(f"metric values must be scalars, got shape {a.shape}")
    x = a.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class MetricsWriter:
    """`write(step, metrics)` appends one JSON object per call to `<workdir>/metrics.jsonl`, logs
    every numeric value to TensorBoard under `<workdir>/tb`, and refreshes the progress bar with
    `bar_keys`. Each record also gets `compile_s`: the seconds spent making XLA programs since
    the previous record (or since the writer was made), which the record's own times include.
    Use as a context manager or call `close()`.

    Resuming at `initial_step`: records of later steps (written before a kill, not covered by the
    restored checkpoint) are dropped; the records kept are `previous`."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int | None = None,
        initial_step: int = 0,
        bar_keys: Sequence[str] = ("loss", "grad_norm"),
        desc: str = "train",
        tensorboard: bool = True,
        progress: bool = True,
        enabled: bool | None = None,
    ) -> None:
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.workdir = Path(workdir)
        self.bar_keys = tuple(bar_keys)
        self._compile = compilation.stats()
        self._jsonl = self._tb = self._bar = None
        self.previous: list[dict[str, Any]] = []
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.workdir / "metrics.jsonl"
        self._jsonl = JsonlLog(self.jsonl_path, "step", initial_step)
        self.previous = self._jsonl.previous
        if tensorboard:
            self._tb = EventFile(self.workdir / "tb")
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)
        self._last_step = initial_step

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Logs one step; returns the JSON record written (values as Python scalars)."""
        record = {"step": int(step), "time": time.time()}
        record.update({k: _scalar(v) for k, v in metrics.items()})
        now = compilation.stats()
        record.setdefault("compile_s", round(now.seconds - self._compile.seconds, 3))
        self._compile = now
        if not self.enabled:
            return record
        self._jsonl.append(record)
        if self._tb is not None:
            self._tb.scalars(
                int(step),
                {
                    k: float(v)
                    for k, v in record.items()
                    if k not in ("step", "time") and isinstance(v, int | float)
                },
            )
        if self._bar is not None:
            self._bar.update(max(int(step) - self._last_step, 0))
            self._bar.set_postfix(
                {k: _fmt(record[k]) for k in self.bar_keys if k in record}, refresh=False
            )
        self._last_step = int(step)
        return record

    def flush(self) -> None:
        """Nothing to do: every record is on disk (the OS's page cache) when `write` returns."""

    def close(self) -> None:
        handles = (self._jsonl, self._tb, self._bar)
        self._jsonl = self._tb = self._bar = None
        with contextlib.ExitStack() as stack:  # every handle is closed even if one fails
            for h in handles:
                if h is not None:
                    stack.callback(h.close)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------ MFU


def mfu(tokens_per_second: float, flops_per_tok: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation: achieved matmul FLOP/s over the peak of all devices used."""
    if peak_flops_per_second <= 0:
        return float("nan")
    return tokens_per_second * flops_per_tok / peak_flops_per_second
