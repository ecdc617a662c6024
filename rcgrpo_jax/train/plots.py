"""PNG line plots from metrics.jsonl files: one panel per key, one line per run (arm)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on training machines

import matplotlib.pyplot as plt  # noqa: E402

from rcgrpo_jax.train.metrics import read_jsonl  # noqa: E402


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r.get("step", len(xs)))
            ys.append(float(v))
    return xs, ys


def _smooth(ys: list[float], window: int) -> list[float]:
    if window <= 1:
        return ys
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_metrics(
    runs: str | Path | Sequence[str | Path] | Mapping[str, str | Path],
    keys: Sequence[str],
    out_path: str | Path,
    *,
    smooth: int = 1,
    title: str | None = None,
) -> Path:
    """Writes one PNG with a panel per key; `runs` is a metrics.jsonl path, a list of them
    (labelled by their parent directory), or {label: path}. Keys absent from a run are skipped."""
    if isinstance(runs, str | Path):
        runs = [runs]
    if not isinstance(runs, Mapping):
        runs = {Path(p).parent.name or str(p): p for p in runs}
    data = {label: read_jsonl(p) for label, p in runs.items()}
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for label, records in data.items():
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, _smooth(ys, smooth), label=label, linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if len(data) > 1 and ax.get_lines():
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
