"""Stage `all`: the paper's comparison end to end, every arm through the same code.

    base (untrained / as loaded) [─▶ warm start: SFT steps shared by both stage-1 arms]
    SFT  ─▶ GRPO                      (the baseline that stalls: peaked policy, σ_g → 0)
    RCTP ─▶ RC-GRPO                   (the method)
    RCTP ─▶ GRPO                      (ablation: RCTP init without reward-conditioned sampling)

The warm start (`train.warm_start_steps` > 0) stands in for what the paper's arms share, an
instruct model that already calls tools: a tiny model trained from scratch learns to copy names
after a seed-dependent plateau, and two independent stage-1 runs would draw it independently.

Each stage runs in its own sub-directory of the workdir (`warm_start/`, `sft/`, `rctp/`, ...) and
is resumable on its own; a finished stage (its `summary.json` exists) is not run again. Every RL
arm gets the same number of iterations, prompts and rollouts. Results: `summary.json`, a printed
table, and `dynamics.png` (reward, degenerate-group fraction, entropy per RL iteration, one line
per arm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from rcgrpo_jax import runtime
from rcgrpo_jax.train import plots
from rcgrpo_jax.train.metrics import read_jsonl, write_atomic

RL_ARMS = (  # (name, stage-1 run, RL algorithm)
    ("sft_grpo", "sft", "grpo"),
    ("rctp_rcgrpo", "rctp", "rcgrpo"),
    ("rctp_grpo", "rctp", "grpo"),
)
DYNAMICS = ("reward_mean", "degenerate_frac", "entropy")


def _sub(config: ml_collections.ConfigDict, stage: str, name: str, **rl: Any):
    """The config of one stage; RL arms read the tokenizer saved with their stage-1 export."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.stage = stage
    c.workdir = str(Path(config.workdir) / name)
    if rl.get("init_from"):
        c.tokenizer_path = ""
    for k, v in rl.items():
        c.rl[k] = v
    return c


ALGO_NAMES = {"sft": "SFT", "rctp": "RCTP", "grpo": "GRPO", "rcgrpo": "RC-GRPO"}


def _run_once(c: ml_collections.ConfigDict, fn, what: str) -> dict[str, Any]:
    """Runs one arm unless its summary exists; prints the arm's start line."""
    name = f"{Path(c.workdir).name} ({ALGO_NAMES[c.stage]})"
    done = Path(c.workdir) / "summary.json"
    if done.exists():
        print(f"{name}: finished earlier, {done}", flush=True)
        return json.loads(done.read_text())
    print(f"{name}: {what}", flush=True)
    return fn(c)


def _base_success(config: ml_collections.ConfigDict) -> float:
    """Held-out success of the initial model (no training)."""
    from rcgrpo_jax.eval import success_rate

    c = _sub(config, "eval", "base")
    done = Path(c.workdir) / "summary.json"
    if done.exists():
        return json.loads(done.read_text())["heldout_success"]
    Path(c.workdir).mkdir(parents=True, exist_ok=True)
    mesh = runtime.mesh_from_config(c)
    tokenizer = runtime.tokenizer_from_config(c)
    model = runtime.model_from_config(c, mesh)
    entries = runtime.task_entries(c, "test")[: int(c.eval.max_entries) or None]
    rate = success_rate(c, model, tokenizer, mesh, entries, None)
    write_atomic(done, json.dumps({"heldout_success": rate}) + "\n")  # "done" marks the arm
    return rate


def _stage1_row(summary: dict[str, Any]) -> dict[str, Any]:
    """A stage-1 run's table row: held-out success (RCTP: under the high token) and, for RCTP,
    success under each reward token."""
    got = summary.get("heldout_success", {})
    return {
        "heldout_success": got.get("none", got.get("high")),
        "success_high": got.get("high"),
        "success_low": got.get("low"),
    }


def _rl_stats(workdir: Path) -> dict[str, float]:
    """Over the RL run: mean degenerate-group fraction and entropy, last held-out success."""
    rows = read_jsonl(workdir / "metrics.jsonl")
    evals = [r["eval_success"] for r in rows if r.get("eval_success") is not None]
    mean = lambda k: float(np.mean([r[k] for r in rows if r.get(k) is not None]))
    return {
        "heldout_success": evals[-1] if evals else float("nan"),
        "degenerate_frac": mean("degenerate_frac"),
        "entropy": mean("entropy"),
        "reward_mean": mean("reward_mean"),
    }


def format_table(summary: dict[str, Any]) -> str:
    pct = lambda x: "   -  " if x is None or x != x else f"{100 * x:6.1f}"
    lines = [
        f"{'arm':<16}{'held-out %':>11}{'high-tok %':>11}{'low-tok %':>10}"
        f"{'degenerate':>11}{'entropy':>9}",
    ]
    for name, row in summary["arms"].items():
        ent = row.get("entropy")
        lines.append(
            f"{name:<16}{pct(row.get('heldout_success')):>11}{pct(row.get('success_high')):>11}"
            f"{pct(row.get('success_low')):>10}{pct(row.get('degenerate_frac')):>11}"
            f"{'   -' if ent is None else f'{ent:9.3f}':>9}"
        )
    return "\n".join(lines)


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
    from rcgrpo_jax.rl import loop as rl_loop
    from rcgrpo_jax.train import sft

    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not config.tokenizer_path and not config.model.hf_path:  # one tokenizer for every stage
        config = ml_collections.ConfigDict(config.to_dict())
        runtime.tokenizer_from_config(config)
        config.tokenizer_path = str(workdir / "tokenizer")
    base = _base_success(config)
    print(f"base: held-out success {base:.1%} (the initial model)", flush=True)
    arms: dict[str, dict[str, Any]] = {"base": {"heldout_success": base}}
    start = ""
    if int(config.train.warm_start_steps) > 0:
        c = _sub(config, "sft", "warm_start")
        c.train.steps = int(config.train.warm_start_steps)
        s = _run_once(c, sft.run, f"{c.train.steps} steps on the golden trajectories")
        arms["warm_start"] = _stage1_row(s)
        start = s["export"]
    for stage in ("sft", "rctp"):
        c = _sub(config, stage, stage)
        if start:
            c.model.hf_path = start  # both stage-1 arms continue from the same model
        if stage == "rctp" and config.rctp.train_steps > 0:
            c.train.steps = int(config.rctp.train_steps)  # e.g. the same epochs over more data
        what = f"{c.train.steps} steps from {'the warm start' if start else 'the base'}"
        arms[stage] = _stage1_row(_run_once(c, sft.run, what))
    for name, init, algo in RL_ARMS:
        init_from = str(workdir / init / "export")
        c = _sub(config, algo, name, init_from=init_from)
        _run_once(c, rl_loop.run, f"{c.rl.steps} iterations from {init}")
        arms[name] = stats = _rl_stats(Path(c.workdir))
        print(
            f"{name}: held-out success {stats['heldout_success']:.1%}, "
            f"degenerate groups {stats['degenerate_frac']:.1%}",
            flush=True,
        )

    runs = {name: workdir / name / "metrics.jsonl" for name, _, _ in RL_ARMS}
    plots.plot_metrics(runs, DYNAMICS, workdir / "dynamics.png")
    summary = {
        "arms": arms,
        "rl_iterations": int(config.rl.steps),
        "rollouts_per_iteration": int(config.rl.num_prompts) * int(config.rl.group_size),
    }
    table = format_table(summary)
    summary["table"] = table
    write_atomic(workdir / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(workdir / "table.txt", table + "\n")
    print(table)
    return summary
