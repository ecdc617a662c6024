"""PNG line plots from metrics.jsonl files: one panel per key, one line per run (arm)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rcgrpo_jax.train.metrics import read_jsonl

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot():
    """matplotlib.pyplot, headless (no display on training machines). Imported on first use:
    it costs ~0.6 s, which every process that never plots (tests, tools) would pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, value) of the records with a finite `key`; x is the record's `step`, or with
    x="rollouts" the trajectories generated up to it (`rollouts`, else the running sum of
    `generated_rollouts`)."""
    xs, ys, total = [], [], 0
    for r in records:
        total = r.get("rollouts", total + (r.get("generated_rollouts") or 0))
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(total if x == "rollouts" else r.get("step", len(xs)))
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
    fig, axes = _pyplot().subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
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
    return _save(fig, out_path)


def _save(fig: Figure, out_path: str | Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    _pyplot().close(fig)
    return out_path


# ------------------------------------------------------------------------------ RL summary

RL_PANELS = (
    "held-out success",
    "training reward",
    "degenerate groups",
    "entropy",
    "entropy-reward",
)


def _pairs(records: list[dict], kx: str, ky: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records where both keys hold finite numbers, in file order."""
    xs, ys = [], []
    for r in records:
        _, x = _series([r], kx)
        _, y = _series([r], ky)
        if x and y:
            xs.append(x[0])
            ys.append(y[0])
    return xs, ys


def rl_series(
    records: list[dict], *, smooth: int = 4
) -> dict[str, tuple[list[float], list[float]]]:
    """The series `plot_rl` draws for one run, {name: (xs, ys)}, against the trajectories
    generated (RL's cost), empty ones left out: eval_success and eval_sampled raw (the start,
    at 0, first); reward_high / reward_low smoothed, or reward_mean when the run has no token
    rewards; degenerate_frac and entropy smoothed; "entropy_reward" the raw (entropy,
    reward_mean) pairs. NaN, null and absent values are dropped per series."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for key in ("eval_success", "eval_sampled"):
        out[key] = _series(records, key, "rollouts")
    tokens = {k: _series(records, k, "rollouts") for k in ("reward_high", "reward_low")}
    if any(xs for xs, _ in tokens.values()):
        reward_keys = tokens
    else:
        reward_keys = {"reward_mean": _series(records, "reward_mean", "rollouts")}
    for key, (xs, ys) in reward_keys.items():
        out[key] = (xs, _smooth(ys, smooth))
    for key in ("degenerate_frac", "entropy"):
        xs, ys = _series(records, key, "rollouts")
        out[key] = (xs, _smooth(ys, smooth))
    out["entropy_reward"] = _pairs(records, "entropy", "reward_mean")
    return {k: v for k, v in out.items() if v[0]}


def _rl_figure(
    data: Mapping[str, list[dict]], *, smooth: int = 4, title: str | None = None
) -> Figure:
    from matplotlib.lines import Line2D

    fig, axes = _pyplot().subplots(len(RL_PANELS), 1, figsize=(8, 2.8 * len(RL_PANELS)))
    ax_eval, ax_rew, ax_deg, ax_ent, ax_er = axes
    arm_handles = []
    for i, (label, records) in enumerate(data.items()):
        c = f"C{i % 10}"
        arm_handles.append(Line2D([], [], color=c, label=label, linewidth=2))
        s = rl_series(records, smooth=smooth)
        line = dict(color=c, linewidth=1.3)
        if "eval_success" in s:
            ax_eval.plot(*s["eval_success"], "-o", markersize=4, **line)
        if "eval_sampled" in s:
            ax_eval.plot(*s["eval_sampled"], "--s", markersize=3, **line)
        for key, ls in (("reward_high", "-"), ("reward_low", ":"), ("reward_mean", "-")):
            if key in s:
                ax_rew.plot(*s[key], linestyle=ls, **line)
        if "degenerate_frac" in s:
            ax_deg.plot(*s["degenerate_frac"], **line)
        if "entropy" in s:
            ax_ent.plot(*s["entropy"], **line)
        if "entropy_reward" in s:
            ex, ry = s["entropy_reward"]
            ax_er.scatter(ex, ry, color=c, s=10, alpha=0.45)
            # Direction of travel: from the mean of the first few points to that of the last few.
            k = max(1, min(smooth, len(ex) // 2))
            if len(ex) >= 2:
                start = (sum(ex[:k]) / k, sum(ry[:k]) / k)
                end = (sum(ex[-k:]) / k, sum(ry[-k:]) / k)
                ax_er.annotate(
                    "", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=c, lw=1.8)
                )
            ax_er.scatter(ex[-1:], ry[-1:], color=c, s=60, marker="*", edgecolors="black", lw=0.5)

    ax_eval.set_ylabel("held-out success")
    ax_eval.legend(
        handles=arm_handles
        + [
            Line2D([], [], color="gray", linestyle="-", marker="o", label="greedy"),
            Line2D([], [], color="gray", linestyle="--", marker="s", label="sampled (T=1)"),
        ],
        fontsize=8,
    )
    ax_rew.set_ylabel(f"train reward (smooth {smooth})")
    ax_rew.legend(
        handles=[
            Line2D([], [], color="gray", linestyle="-", label="<|high_reward|> / mean"),
            Line2D([], [], color="gray", linestyle=":", label="<|low_reward|>"),
        ],
        fontsize=8,
    )
    ax_deg.set_ylabel("degenerate-group frac")
    ax_ent.set_ylabel("policy entropy")
    for ax in (ax_eval, ax_rew, ax_deg, ax_ent):
        ax.set_xlabel("trajectories generated")
        ax.grid(alpha=0.3)
    ax_er.set_xlabel("policy entropy")
    ax_er.set_ylabel("reward_mean")
    ax_er.set_title("entropy vs reward per iteration (arrow: start → end, ★ last)", fontsize=9)
    ax_er.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_rl(
    runs: Mapping[str, str | Path],
    out_path: str | Path,
    *,
    smooth: int = 4,
    title: str | None = None,
) -> Path:
    """One PNG to judge whether RL helps at equal cost, {arm: metrics.jsonl} in, one colour per
    arm, against trajectories generated: held-out
    success (greedy solid, sampled dashed, from step 0), training reward per reward token
    (high solid, low dotted; reward_mean for arms without tokens), degenerate-group fraction,
    policy entropy, and entropy against reward (the paper ties falling entropy to rising reward).
    Training curves are smoothed over `smooth` points; missing or NaN values are skipped."""
    data = {label: read_jsonl(p) for label, p in runs.items()}
    return _save(_rl_figure(data, smooth=smooth, title=title), out_path)


# ------------------------------------------------------------------------------ cost curves


def curves_figure(
    panels: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
    controls: Mapping[str, str] | None = None,
):
    """Held-out success against trajectories generated, one panel per task set {title: {arm:
    rows}}, one line per arm: each row (`tools.seed_stats.curve_bands`) a budget point with the
    runs' mean `rollouts`, `mean` success and `ci95` half-width. A real arm is its mean with its
    95% band, one colour per arm with its `_dynamic` twin (solid plain, dashed dynamic); a
    control (`controls`: {control arm: the arm it controls}) is a thin dotted line in its arm's
    colour, without a band, so that a dozen arms stay readable."""
    plt = _pyplot()
    controls = dict(controls or {})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 2.6, 4.6), squeeze=False)
    colour: dict[str, str] = {}  # an arm without `_dynamic` -> its colour, in order met
    for ax, (name, arms) in zip(axes[0], panels.items(), strict=True):
        for arm, rows in arms.items():
            if not rows:
                continue
            real = controls.get(arm, arm)
            base = real.removesuffix("_dynamic")
            c = colour.setdefault(base, f"C{len(colour) % 10}")
            xs = [r["rollouts"] for r in rows]
            ys = [100 * r["mean"] for r in rows]
            if arm in controls:
                ax.plot(xs, ys, ":", color=c, linewidth=1.2, label=arm)
                continue
            style = "--" if real.endswith("_dynamic") else "-"
            ax.plot(xs, ys, style, marker="o", markersize=3, color=c, label=arm)
            half = [100 * r["ci95"] for r in rows]
            lo = [y - h for y, h in zip(ys, half, strict=True)]
            hi = [y + h for y, h in zip(ys, half, strict=True)]
            ax.fill_between(xs, lo, hi, color=c, alpha=0.1, linewidth=0)
        n = max((r["n"] for rows in arms.values() for r in rows), default=0)
        ax.set_title(f"{name} ({n} runs: mean, 95% band)", fontsize=10)
        ax.set_xlabel("trajectories generated")
        ax.set_ylabel("held-out success %")
        ax.grid(alpha=0.3)
    legend = {}  # one entry per arm over all panels, right of the last
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.02, 1))  # fmt: skip
    fig.tight_layout()
    return fig


def plot_curves(
    panels: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
    out_path: str | Path,
    *,
    controls: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Path:
    """`curves_figure` written to `out_path` as a PNG."""
    fig = curves_figure(panels, controls)
    if title:
        fig.suptitle(title)
        fig.tight_layout()
    return _save(fig, out_path)
