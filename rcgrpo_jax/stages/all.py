"""Stage `all`: the paper's comparison end to end, every arm through the same code.

    base (as loaded) [─▶ warm start: SFT steps shared by both stage-1 arms, a fixed number or
                      until sampled success on training or rl-split tasks reaches a level
                      (`train.warm_start_stop`)]
    SFT  ─▶ GRPO       (the baseline that stalls: peaked policy, σ_g → 0)
    SFT  ─▶ RC-GRPO    (conditioned sampling without RCTP: the model never learned the tokens)
    RCTP ─▶ RC-GRPO    (the method; RCTP may stop once high- minus low-token success on
                        training or rl-split tasks reaches a level: `rctp.stop`)
    RCTP ─▶ GRPO       (RCTP without conditioned sampling: every rollout and the evaluation under
                        <|high_reward|>, so the groups get no injected variance)
    each plain (the paper's: one round of P × G rollouts per iteration) or `_dynamic` (DAPO's
    other answer to σ_g → 0: degenerate groups dropped and refilled by further rounds)

`config.arms` picks the cells (the table: `rcgrpo_jax/rl/arms.py`); `config.controls` adds
"shuffled" (rewards permuted within each batch: what the reward signal adds) and "lr0" (lr 0:
the measurement alone, its change exactly 0) beside each chosen arm it controls. Every arm's
change is its end minus its start, both evaluated by its RL stage under the arm's own token.

RCTP → GRPO samples under one fixed token rather than none: the RCTP model has only seen
prompts that carry a token, so without one it is off its training distribution and the cell
would measure that, not what RC-GRPO's mixed-token groups add.

Each stage runs in its own sub-directory of the workdir (`sft/`, `rctp/`, ...) and is resumable
on its own; a finished stage (its `summary.json` exists) is not run again. The arms are compared
at equal cost: every RL arm generates the same budget of trajectories (`rl.max_rollouts`,
default steps × P × G), however many iterations that takes (`rl.steps` only caps them; an arm it
stops says so), and with `rl.eval_points` is evaluated at the same trajectory counts (`rl.curve`).
Results: `summary.json` (per arm its figures, curve and area, success per task kind; the demo's
three targets; the machine), a printed table, `dynamics.png` (reward, degenerate-group fraction,
entropy per RL iteration, one line per arm), `rl.png` (against trajectories generated:
held-out success, training reward under each token, degenerate fraction, entropy; and entropy
against reward, per arm) and `report.html` (`rcgrpo_jax.report`: overview, curves, every arm's
rollouts and held-out tasks; rebuilt as each RL arm finishes).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_collections

from rcgrpo_jax import machine
from rcgrpo_jax.rl.arms import find, rl_arms
from rcgrpo_jax.stages import setup
from rcgrpo_jax.train import plots
from rcgrpo_jax.train.metrics import write_atomic

DYNAMICS = ("reward_mean", "degenerate_frac", "entropy")


def _node(root: ml_collections.ConfigDict, path: list[str]) -> Any:
    for part in path:
        root = root[part]
    return root


def _sub(
    config: ml_collections.ConfigDict, stage: str, name: str, rl: Mapping[str, Any] | None = None
):
    """The config of one stage; RL arms read the tokenizer saved with their stage-1 export."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.stage = stage
    c.workdir = str(Path(config.workdir) / name)
    if (rl or {}).get("init_from"):
        c.tokenizer_path = ""
    for k, v in (rl or {}).items():
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


def _base_success(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Held-out success of the initial model (no training): its record (`heldout_success`,
    per task kind `kinds`)."""
    from rcgrpo_jax.stages.eval import measure_success

    c = _sub(config, "eval", "base")
    done = Path(c.workdir) / "summary.json"
    if done.exists():
        return json.loads(done.read_text())
    Path(c.workdir).mkdir(parents=True, exist_ok=True)
    mesh = setup.mesh_from_config(c)
    tokenizer = setup.tokenizer_from_config(c)
    model = setup.model_from_config(c, mesh)
    entries = setup.task_entries(c, "test")[: int(c.eval.max_entries) or None]
    measured = measure_success(c, model, tokenizer, mesh, entries, None)
    record = {
        "heldout_success": measured.rate,
        "kinds": measured.by_kind,
        "machine": machine.describe(),
    }
    write_atomic(done, json.dumps(record) + "\n")  # "done" marks the arm
    return record


def _stage1_row(summary: dict[str, Any]) -> dict[str, Any]:
    """A stage-1 run's table row: held-out success (RCTP: under the high token) and, for RCTP,
    success under each reward token; per task kind under each."""
    got = summary.get("heldout_success", {})
    # a stage under a stopping rule (warm start, RCTP): the steps it ran, whether it stopped
    stop = summary.get("stop")
    stopped = {"steps": summary["steps"], "stopped": stop["reached"]} if stop else {}
    return {
        "heldout_success": got.get("none", got.get("high")),
        "success_high": got.get("high"),
        "success_low": got.get("low"),
        "kinds": summary.get("heldout_by_kind", {}),
        **stopped,
    }


def format_table(summary: dict[str, Any]) -> str:
    """One row per arm: held-out success at the start and end, the area under success against
    trajectories (`auc`: the mean over the budget), RCTP's success under each token, the
    degenerate-group fraction, entropy, and the trajectories generated ("*": rl.steps ended
    the arm before its budget)."""
    pct = lambda x: "   -  " if x is None or x != x else f"{100 * x:6.1f}"
    w = max(16, *(len(name) + 1 for name in summary["arms"]))
    lines = [
        f"{'arm':<{w}}{'start %':>8}{'held-out %':>11}{'area %':>8}{'high-tok %':>11}"
        f"{'low-tok %':>10}{'degenerate':>11}{'entropy':>9}{'trajectories':>13}",
    ]
    for name, row in summary["arms"].items():
        ent, n = row.get("entropy"), row.get("generated_rollouts")
        spent = "-" if n is None else f"{n}{'*' if row.get('ended') == 'steps' else ''}"
        lines.append(
            f"{name:<{w}}{pct(row.get('start_success')):>8}"
            f"{pct(row.get('heldout_success')):>11}{pct(row.get('auc')):>8}"
            f"{pct(row.get('success_high')):>11}"
            f"{pct(row.get('success_low')):>10}{pct(row.get('degenerate_frac')):>11}"
            f"{'   -' if ent is None or ent != ent else f'{ent:9.3f}':>9}{spent:>13}"
        )
    return "\n".join(lines)


def format_kinds(summary: dict[str, Any]) -> str:
    """Held-out success per task kind (%): a row per kind, a column per arm (stage-1 arms: at
    their end, RCTP under the high token; RL arms: at their end); "" without per-kind figures."""
    cols = {}
    for name, row in summary["arms"].items():
        kinds = row.get("kinds") or {}
        got = kinds.get("end") or kinds.get("none") or kinds.get("high")
        if got:
            cols[name] = got
    if not cols:
        return ""
    names = sorted({k for got in cols.values() for k in got})
    title = "success per task kind %"
    w = max(len(title) + 1, *(len(k) + 1 for k in names))
    width = {n: max(len(n), 5) + 2 for n in cols}
    rows = [f"{title:<{w}}" + "".join(f"{n:>{width[n]}}" for n in cols)]
    for k in names:
        cells = (
            f"{'-' if got.get(k) is None else f'{100 * got[k]:.1f}':>{width[n]}}"
            for n, got in cols.items()
        )
        rows.append(f"{k:<{w}}" + "".join(cells))
    return "\n".join(rows)


STAGE1 = ("base", "warm_start", "sft", "rctp")  # every other arm of a summary is an RL arm


def _degenerate(arms: Mapping[str, Mapping[str, Any]]) -> tuple[Any, Any]:
    """Mean degenerate-group fractions of RCTP → RC-GRPO and SFT → GRPO, both plain where both
    ran, else both dynamic (target 3 compares like with like); (None, None) without a pair."""
    for suffix in ("", "_dynamic"):
        rc, g = arms.get(f"rctp_rcgrpo{suffix}"), arms.get(f"sft_grpo{suffix}")
        if rc and g:
            return rc.get("degenerate_frac"), g.get("degenerate_frac")
    return None, None


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
    deg_rc, deg_g = _degenerate(arms)
    start = {
        name: row.get("start_success") if row.get("start_success") is not None
        else get(find(name).init, "heldout_success")
        for name, row in arms.items() if name not in STAGE1
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
    from rcgrpo_jax.stages.rl_report import run_stats

    setup.require_stage1_sources(config, demonstrations=int(config.train.warm_start_steps) > 0)
    t0 = time.time()
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not config.tokenizer_path and not config.model.hf_path:  # one tokenizer for every stage
        config = ml_collections.ConfigDict(config.to_dict())
        setup.tokenizer_from_config(config)
        config.tokenizer_path = str(workdir / "tokenizer")
    base = _base_success(config)
    print(f"base: held-out success {base['heldout_success']:.1%} (the initial model)", flush=True)
    arms: dict[str, dict[str, Any]] = {
        "base": {
            "heldout_success": base["heldout_success"],
            "kinds": {"none": base.get("kinds", {})},
        }
    }
    start = ""
    if int(config.train.warm_start_steps) > 0:
        c = _sub(config, "sft", "warm_start")
        c.train.steps = int(config.train.warm_start_steps)
        # golden trajectories (or demonstrations) alone: no rollouts of the base model
        c.rctp.rollouts_per_entry = 0
        if not config.model.hf_path:  # a random base is trained whole; LoRA adapts the result
            c.model.lora.rank = 0
        stop = sft.StopRule.from_config(config.train.warm_start_stop)
        stop_note = stop.until_note if stop else ""
        s = _run_once(
            c, functools.partial(sft.run, name="warm_start", stop=stop),
            f"{c.train.steps} steps on the golden trajectories{stop_note}",
        )  # fmt: skip
        arms["warm_start"] = _stage1_row(s)
        start = s["export"]
    for stage in ("sft", "rctp"):
        c = _sub(config, stage, stage)
        if start:
            c.model.hf_path = start  # both stage-1 arms continue from the same model
        if stage == "rctp" and config.rctp.train_steps > 0:
            c.train.steps = int(config.rctp.train_steps)  # e.g. the same epochs over more data
        # RCTP may stop once its tokens are learnt (rctp.stop), its steps the cap
        stop = sft.StopRule.from_config(config.rctp.stop, "token_gap") if stage == "rctp" else None
        stop_note = stop.until_note if stop else ""
        what = f"{c.train.steps} steps from {'the warm start' if start else 'the base'}{stop_note}"
        run_stage = functools.partial(sft.run, name=stage, stop=stop)
        arms[stage] = _stage1_row(_run_once(c, run_stage, what))
    arms_run = rl_arms(config)
    for arm in arms_run:
        init_from = str(workdir / arm.init / "export")
        c = _sub(config, arm.algo, arm.name, {**arm.rl, "init_from": init_from})
        budget = rl_loop.rollout_budget(c.rl)
        sampling = ", dynamic sampling" if arm.dynamic else ""
        what = f"{budget} trajectories from {arm.init}{sampling}"
        done = _run_once(c, functools.partial(rl_loop.run, name=arm.name), what)
        stats = run_stats(Path(c.workdir), budget)
        arms[arm.name] = {**stats, "ended": done.get("ended")}
        rl_loop.refresh_report(config)  # the arms so far, on one page

    runs = {arm.name: workdir / arm.name / "metrics.jsonl" for arm in arms_run}
    plots.plot_metrics(runs, DYNAMICS, workdir / "dynamics.png")
    plots.plot_rl(runs, workdir / "rl.png", title="RL arms: held-out success, reward, dynamics")
    summary = {
        "arms": arms,
        "targets": targets(arms),
        "rl_budget": int(rl_loop.rollout_budget(config.rl)),  # trajectories per arm
        "rollouts_per_iteration": int(config.rl.num_prompts) * int(config.rl.group_size),
        "wall_s": round(time.time() - t0, 1),  # this invocation (a resumed run: its part)
        "machine": machine.describe(),  # this invocation's; each stage's is in its summary
    }
    stages = {
        name: json.loads((workdir / name / "summary.json").read_text()).get("machine")
        for name in arms
    }
    table = "\n".join(
        part
        for part in (
            format_table(summary),
            format_kinds(summary),
            format_targets(summary["targets"]),
            format_machines(summary["machine"], stages),
        )
        if part
    )
    summary["table"] = table
    write_atomic(workdir / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(workdir / "table.txt", table + "\n")
    rl_loop.refresh_report(config)
    print(table)
    return summary
