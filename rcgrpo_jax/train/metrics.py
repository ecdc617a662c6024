"""Metrics sinks for every stage: metrics.jsonl, TensorBoard events (tensorboardX), a tqdm bar;
plus the analytic FLOP/MFU estimate (XLA's cost analysis counts a scanned layer body once).

Only process 0 writes (other processes get a writer whose calls do nothing), so multi-host runs
produce one file per workdir.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rcgrpo_jax.models import ModelConfig


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
    `bar_keys`. Use as a context manager or call `close()`."""

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
        self._jsonl = self._tb = self._bar = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.workdir / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 — closed in close()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.workdir / "tb"))
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)
        self._last_step = initial_step

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Logs one step; returns the JSON record written (values as Python scalars)."""
        record = {"step": int(step), "time": time.time()}
        record.update({k: _scalar(v) for k, v in metrics.items()})
        if not self.enabled:
            return record
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, int | float):
                    self._tb.add_scalar(k, v, global_step=int(step))
        if self._bar is not None:
            self._bar.update(max(int(step) - self._last_step, 0))
            self._bar.set_postfix(
                {k: _fmt(record[k]) for k in self.bar_keys if k in record}, refresh=False
            )
        self._last_step = int(step)
        return record

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        for h in (self._jsonl, self._tb, self._bar):
            if h is not None:
                h.close()
        self._jsonl = self._tb = self._bar = None

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


# ------------------------------------------------------------------------------------ FLOPs


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token (PaLM appendix B): 6·N + 12·L·H·D·T for training (2·N + 4·L·H·D·T
    forward only), N = params that take part in matmuls (the input embedding lookup does not,
    unless it is tied to the LM head). The attention term counts the full T×T score matrix."""
    n = cfg.num_params()
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    attn = cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return float(6 * n + 12 * attn) if training else float(2 * n + 4 * attn)


def mfu(tokens_per_second: float, flops_per_tok: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation: achieved matmul FLOP/s over the peak of all devices used."""
    if peak_flops_per_second <= 0:
        return float("nan")
    return tokens_per_second * flops_per_tok / peak_flops_per_second
