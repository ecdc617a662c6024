"""Stage `all`: the paper's comparison end to end, every arm through the same code.

    base (as loaded) [─▶ warm start: SFT steps shared by both stage-1 arms]
    SFT  ─▶ GRPO       (the baseline that stalls: peaked policy, σ_g → 0)
    SFT  ─▶ RC-GRPO    (conditioned sampling without RCTP: the model never learned the tokens)
    RCTP ─▶ RC-GRPO    (the method)
    RCTP ─▶ GRPO       (RCTP without conditioned sampling: every rollout and the evaluation under
                        <|high_reward|>, so the groups get no injected variance)
    SFT  ─▶ GRPO with dynamic sampling (DAPO's other answer to σ_g → 0: roll out more prompts
                        and train on the informative groups only, within the same budget)

Controls (`config.controls`): "shuffled" runs SFT → GRPO and RCTP → RC-GRPO again with the
rewards permuted within each batch (what the reward signal adds), "lr0" RCTP → RC-GRPO at lr 0
(the measurement alone: its change must be exactly 0). Every arm's change is its end minus its
start, both evaluated by its RL stage under the arm's own token.

RCTP → GRPO samples under one fixed token rather than none: the RCTP model has only seen
prompts that carry a token, so without one it is off its training distribution and the cell
would measure that, not what RC-GRPO's mixed-token groups add.

Each stage runs in its own sub-directory of the workdir (`sft/`, `rctp/`, ...) and is resumable
on its own; a finished stage (its `summary.json` exists) is not run again. Every RL arm gets the
same budget of generated trajectories (`rl.max_rollouts`, default steps x P x G) and at most
`rl.steps` iterations; the dynamic arm spends its budget faster, so it may run fewer.
Results: `summary.json` (per arm, the demo's three targets, the machine), a printed table, and
`dynamics.png` (reward, degenerate-group fraction, entropy per RL iteration, one line per arm)
and `rl.png` (held-out success at the evaluations, training reward under each token, degenerate
fraction, entropy, and entropy against reward, per arm).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import ml_collections

from rcgrpo_jax import machine
from rcgrpo_jax.stages import setup
from rcgrpo_jax.train import plots
from rcgrpo_jax.train.metrics import write_atomic

RL_ARMS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    # (name, stage-1 run, RL algorithm, rl overrides)
    ("sft_grpo", "sft", "grpo", {}),
    ("sft_rcgrpo", "sft", "rcgrpo", {}),
    ("rctp_rcgrpo", "rctp", "rcgrpo", {}),
    ("rctp_grpo", "rctp", "grpo", {"grpo_token": "high"}),
    ("sft_grpo_dynamic", "sft", "grpo", {"dynamic_sampling": True}),
)
# Controls (`config.controls`): (name, stage-1 run, RL algorithm, rl overrides) per control kind.
CONTROLS: dict[str, tuple[tuple[str, str, str, dict[str, Any]], ...]] = {
    "shuffled": (
        ("sft_grpo_shuffled", "sft", "grpo", {"shuffle_rewards": True}),
        ("rctp_rcgrpo_shuffled", "rctp", "rcgrpo", {"shuffle_rewards": True}),
    ),
    "lr0": (("rctp_rcgrpo_lr0", "rctp", "rcgrpo", {"optim.lr": 0.0}),),
}
DYNAMICS = ("reward_mean", "degenerate_frac", "entropy")


def rl_arms(config: ml_collections.ConfigDict) -> tuple[tuple[str, str, str, dict[str, Any]], ...]:
    """The RL arms stage `all` runs: `RL_ARMS`, then the controls `config.controls` names.

    An arm whose overrides are all already the config's values would repeat another arm's run
    exactly (the dynamic arm when `rl.dynamic_sampling` is on for every arm): it is left out."""
    arms = RL_ARMS + tuple(arm for kind in config.controls for arm in CONTROLS[kind])
    return tuple(arm for arm in arms if not arm[3] or not _already(config, arm[3]))


def _already(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> bool:
    """Whether every `rl` override ("optim.lr": rl.optim.lr) equals the config's own value."""
    return all(_node(config.rl, key.split(".")) == v for key, v in overrides.items())


def _node(root: ml_collections.ConfigDict, path: list[str]) -> Any:
    for part in path:
        root = root[part]
    return root


def _sub(config: ml_collections.ConfigDict, stage: str, name: str, **rl: Any):
    """The config of one stage; RL arms read the tokenizer saved with their stage-1 export."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.stage = stage
    c.workdir = str(Path(config.workdir) / name)
    if rl.get("init_from"):
        c.tokenizer_path = ""
    for k, v in rl.items():
        *path, leaf = k.split(".")  # "optim.lr": c.rl.optim.lr
        _node(c.rl, path)[leaf] = v
    return c


ALGO_NAMES = {"sft": "SFT", "rctp": "RCTP", "grpo": "GRPO", "rcgrpo": "RC-GRPO"}


def _run_once(c: ml_collections.ConfigDict, fn, what: str) -> dict[str, Any]:
    """Runs one arm unless its summary exists; prints the arm's start line."""
    algo = ALGO_NAMES[c.stage]
    if c.stage == "grpo" and c.rl.grpo_token == "high":
        algo += " under <|high_reward|>"
    if c.stage in ("grpo", "rcgrpo") and c.rl.shuffle_rewards:
        algo += ", rewards shuffled"
    if c.stage in ("grpo", "rcgrpo") and c.rl.optim.lr == 0:
        algo += ", lr 0"
    name = f"{Path(c.workdir).name} ({algo})"
    done = Path(c.workdir) / "summary.json"
    if done.exists():
        print(f"{name}: finished earlier, {done}", flush=True)
        return json.loads(done.read_text())
    print(f"{name}: {what}", flush=True)
    return fn(c)


def _base_success(config: ml_collections.ConfigDict) -> float:
    """Held-out success of the initial model (no training)."""
    from rcgrpo_jax.stages.eval import success_rate

    c = _sub(config, "eval", "base")
    done = Path(c.workdir) / "summary.json"
    if done.exists():
        return json.loads(done.read_text())["heldout_success"]
    Path(c.workdir).mkdir(parents=True, exist_ok=True)
    mesh = setup.mesh_from_config(c)
    tokenizer = setup.tokenizer_from_config(c)
    model = setup.model_from_config(c, mesh)
    entries = setup.task_entries(c, "test")[: int(c.eval.max_entries) or None]
    rate = success_rate(c, model, tokenizer, mesh, entries, None)
    record = {"heldout_success": rate, "machine": machine.describe()}
    write_atomic(done, json.dumps(record) + "\n")  # "done" marks the arm
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


def format_table(summary: dict[str, Any]) -> str:
    pct = lambda x: "   -  " if x is None or x != x else f"{100 * x:6.1f}"
    w = max(16, *(len(name) + 1 for name in summary["arms"]))
    lines = [
        f"{'arm':<{w}}{'start %':>8}{'held-out %':>11}{'high-tok %':>11}{'low-tok %':>10}"
        f"{'degenerate':>11}{'entropy':>9}",
    ]
    for name, row in summary["arms"].items():
        ent = row.get("entropy")
        lines.append(
            f"{name:<{w}}{pct(row.get('start_success')):>8}"
            f"{pct(row.get('heldout_success')):>11}{pct(row.get('success_high')):>11}"
            f"{pct(row.get('success_low')):>10}{pct(row.get('degenerate_frac')):>11}"
            f"{'   -' if ent is None or ent != ent else f'{ent:9.3f}':>9}"
        )
    return "\n".join(lines)


SFT_BAND = (0.2, 0.8)  # target 1: the SFT policy is neither hopeless nor saturated
BASE_BELOW = 0.2  # ... and starts from a base below this
CONTROL_GAP = 0.2  # target 2: RCTP success under high minus under low


def targets(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The demo's three targets and whether each holds, from the arms' rows (absent arms: None).

    1. SFT lands in `SFT_BAND` from a base below `BASE_BELOW`; 2. after RCTP, success under
    `<|high_reward|>` exceeds success under `<|low_reward|>` by `CONTROL_GAP`; 3. RC-GRPO's
    degenerate-group fraction is below SFT+GRPO's. `moved`: each RL arm's final held-out
    success minus its start, both measured by the RL stage under the arm's evaluation token
    (a run without the start's record: the stage-1 figure)."""
    get = lambda arm, key: arms.get(arm, {}).get(key)
    base, sft = get("base", "heldout_success"), get("sft", "heldout_success")
    high, low = get("rctp", "success_high"), get("rctp", "success_low")
    deg_rc, deg_g = get("rctp_rcgrpo", "degenerate_frac"), get("sft_grpo", "degenerate_frac")
    controls = [arm for kinds in CONTROLS.values() for arm in kinds]
    start = {
        name: get(name, "start_success") if get(name, "start_success") is not None
        else get(init, "heldout_success")
        for name, init, *_ in (*RL_ARMS, *controls)
    }  # fmt: skip
    return {
        "sft_in_band": None if sft is None or base is None
        else bool(base < BASE_BELOW and SFT_BAND[0] <= sft <= SFT_BAND[1]),
        "rctp_controllable": None if high is None or low is None
        else bool(high - low >= CONTROL_GAP),
        "rcgrpo_less_degenerate": None if deg_rc is None or deg_g is None
        else bool(deg_rc < deg_g),
        "moved": {
            name: get(name, "heldout_success") - s0
            for name, s0 in start.items()
            if s0 is not None and get(name, "heldout_success") is not None
        },
    }  # fmt: skip


def format_machines(current: dict[str, Any], stages: dict[str, Any]) -> str:
    """Where the figures came from: this invocation's machine, and any stage whose recorded
    machine differs (a run resumed elsewhere, or a stage written before machines were
    recorded), since the rounding of each machine is in its figures."""
    line = f"figures from: {machine.one_line(current)}"
    others: dict[str, list[str]] = {}
    for name, m in stages.items():
        if m != current:
            others.setdefault(machine.one_line(m), []).append(name)
    return line + "".join(f"; {', '.join(names)}: {m}" for m, names in others.items())


def format_targets(t: dict[str, Any]) -> str:
    mark = lambda ok: "-" if ok is None else ("yes" if ok else "NO")
    moved = ", ".join(f"{k} {100 * v:+.1f}" for k, v in t["moved"].items())
    return (
        f"targets: SFT {SFT_BAND[0]:.0%}-{SFT_BAND[1]:.0%} from base < {BASE_BELOW:.0%}: "
        f"{mark(t['sft_in_band'])}; RCTP high - low >= {CONTROL_GAP:.0%}: "
        f"{mark(t['rctp_controllable'])}; RC-GRPO less degenerate than SFT+GRPO: "
        f"{mark(t['rcgrpo_less_degenerate'])}\n"
        f"RL change in held-out success (points): {moved or '-'}"
    )


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
    from rcgrpo_jax.stages import rl as rl_loop
    from rcgrpo_jax.stages import sft

    setup.require_golden_trajectories(config)
    t0 = time.time()
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not config.tokenizer_path and not config.model.hf_path:  # one tokenizer for every stage
        config = ml_collections.ConfigDict(config.to_dict())
        setup.tokenizer_from_config(config)
        config.tokenizer_path = str(workdir / "tokenizer")
    base = _base_success(config)
    print(f"base: held-out success {base:.1%} (the initial model)", flush=True)
    arms: dict[str, dict[str, Any]] = {"base": {"heldout_success": base}}
    start = ""
    if int(config.train.warm_start_steps) > 0:
        c = _sub(config, "sft", "warm_start")
        c.train.steps = int(config.train.warm_start_steps)
        s = _run_once(
            c, functools.partial(sft.run, name="warm_start"),
            f"{c.train.steps} steps on the golden trajectories",
        )  # fmt: skip
        arms["warm_start"] = _stage1_row(s)
        start = s["export"]
    for stage in ("sft", "rctp"):
        c = _sub(config, stage, stage)
        if start:
            c.model.hf_path = start  # both stage-1 arms continue from the same model
        if stage == "rctp" and config.rctp.train_steps > 0:
            c.train.steps = int(config.rctp.train_steps)  # e.g. the same epochs over more data
        what = f"{c.train.steps} steps from {'the warm start' if start else 'the base'}"
        arms[stage] = _stage1_row(_run_once(c, functools.partial(sft.run, name=stage), what))
    arms_run = rl_arms(config)
    for name, init, algo, overrides in arms_run:
        init_from = str(workdir / init / "export")
        c = _sub(config, algo, name, init_from=init_from, **overrides)
        arm = functools.partial(rl_loop.run, name=name)
        _run_once(c, arm, f"{c.rl.steps} iterations from {init}")
        arms[name] = rl_loop.run_stats(Path(c.workdir))

    runs = {name: workdir / name / "metrics.jsonl" for name, *_ in arms_run}
    plots.plot_metrics(runs, DYNAMICS, workdir / "dynamics.png")
    plots.plot_rl(runs, workdir / "rl.png", title="RL arms: held-out success, reward, dynamics")
    summary = {
        "arms": arms,
        "targets": targets(arms),
        "rl_iterations": int(config.rl.steps),
        "rollouts_per_iteration": int(config.rl.num_prompts) * int(config.rl.group_size),
        "wall_s": round(time.time() - t0, 1),  # this invocation (a resumed run: its part)
        "machine": machine.describe(),  # this invocation's; each stage's is in its summary
    }
    stages = {
        name: json.loads((workdir / name / "summary.json").read_text()).get("machine")
        for name in arms
    }
    table = "\n".join(
        (
            format_table(summary),
            format_targets(summary["targets"]),
            format_machines(summary["machine"], stages),
        )
    )
    summary["table"] = table
    write_atomic(workdir / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(workdir / "table.txt", table + "\n")
    print(table)
    return summary
