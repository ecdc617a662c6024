"""Stage `all` over several seeds (and compiles): what RL did, per arm and arm against arm.

    python -m rcgrpo_jax.tools.seeds --config=configs/tiny.py --seeds=0,1,2,3,4 \\
        --workdir=runs/seeds [--pool=runs/avx2,...] [--config.model.scan_layers=True ...]

Each seed runs stage `all` with `--config.seed=N` in `<workdir>/seed_N`, in a process of its
own (this command again, with `--only_seed=N`): XLA:CPU's compiled programs keep their memory
maps, and one process would meet Linux's map limit within a few full-grid seeds.
Resumable: a finished seed is read back, not rerun; a seed that died resumes its finished arms.
`--pool` adds the finished `DIR/seed_N` runs of other workdirs, e.g. the same seeds compiled
under `XLA_FLAGS=--xla_cpu_max_isa=AVX2`: a different rounding is another sample of training's
chaos, so it joins the aggregate as `seed_N@<basename of DIR>`. Bit-identical results are one
sample, counted once (`seed_stats.distinct`), and the report says which.

The statistics (per arm, paired, curves, rollout ratio) are `tools.seed_stats`'s; `curves.png`
draws the curves (`tools.curves`: studies side by side). Printed, with the machine each run came
from (CPU, cores, `XLA_FLAGS`: each changes the rounding), and written to `<workdir>/seeds.txt`
and `<workdir>/seeds.json`, and as a page, `<workdir>/report.html` (`rcgrpo_jax.report`: the
intervals, the curves with their bands and a link to each run's own page). On the synthetic
environment each seed also draws its own tasks (`env.synthetic.seed` = the seed), so the
held-out set varies with the seed and is the same for every arm of one seed.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rcgrpo_jax import compilation, config_check, logs, machine
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.rl.arms import BASELINE
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.tools.seed_stats import TARGETS, Runs, aggregate, distinct, num


def _cell(iv: dict[str, float] | None, signed: bool = False, width: int = 15) -> str:
    """`mean ± ci` in percent (points for a change), right-aligned to `width`."""
    if iv is None:
        return "-".rjust(width)
    sign = "+" if signed else ""
    return f"{100 * iv['mean']:{sign}.1f} ± {100 * iv['ci95']:.1f}".rjust(width)


def format_report(per_run: Runs, agg: dict[str, Any]) -> str:
    """The per-run table, targets and distinct runs; per arm start, end and change; where the
    runs have curves, the curve table and the rollout-ratio table; the paired differences
    (blocks separated by blank lines)."""
    pct = lambda x: "  -  " if num(x) is None else f"{100 * x:5.1f}"
    mark = lambda ok: "-" if ok is None else "yes" if ok else "NO"
    get = lambda s, arm, key: s["arms"].get(arm, {}).get(key)
    lw = max(4, *(len(str(label)) for label in per_run))
    lines = [
        f"{'run':<{lw}} {'base':>5} {'sft':>5} {'high':>5} {'low':>5} {'deg g':>6} {'deg rc':>6}"
        f"  targets 1/2/3   wall s"
    ]
    for label, s in per_run.items():
        t = s.get("targets", {})
        wall = s.get("wall_s")
        lines.append(
            f"{label!s:<{lw}} {pct(get(s, 'base', 'heldout_success'))} "
            f"{pct(get(s, 'sft', 'heldout_success'))} {pct(get(s, 'rctp', 'success_high'))} "
            f"{pct(get(s, 'rctp', 'success_low'))} {pct(get(s, 'sft_grpo', 'degenerate_frac')):>6} "
            f"{pct(get(s, 'rctp_rcgrpo', 'degenerate_frac')):>6}  "
            f"{'/'.join(mark(t.get(k)) for k in TARGETS):<15} "
            f"{'-' if wall is None else f'{wall:.0f}':>6}"
        )
    n = len(agg["distinct"])
    lines.append(
        "targets met: "
        + ", ".join(f"{k} {v}/{n}" for k, v in agg["targets_met"].items())
        + f"; all three {agg['seeds_meeting_all']}/{n}"
    )
    same = "; ".join(
        f"{d}'s {', '.join(arms)} bit-identical to {k}'s: each counted once"
        if arms else f"{d} is bit-identical to {k}: counted once"
        for d, k, arms in agg["dropped"]
    )  # fmt: skip
    lines.append(f"distinct runs: {n} (dropped: {same or 'none'})")
    machines: dict[str, list[str]] = {}
    for label, s in per_run.items():
        machines.setdefault(machine.one_line(s.get("machine")), []).append(str(label))
    if len(machines) == 1:
        lines.append(f"machine: {next(iter(machines))}")
    else:
        lines += [f"machine: {m} ({', '.join(labels)})" for m, labels in machines.items()]

    arms = agg["arms"]
    cols = [("start_success", "start %"), ("heldout_success", "end %"), ("change", "change pts")]
    if any("auc" in row for row in arms.values()):
        cols += [("auc", "area %")]
    if any("sampled_success" in row for row in arms.values()):
        cols += [("sampled_start", "sampled start %"), ("sampled_success", "sampled end %"),
                 ("sampled_change", "sampled change")]  # fmt: skip
    w = max(17, *(len(name) + 1 for name in arms))
    table = [f"{'arm':<{w}}{'n':>3}" + "".join(f"{h:>16}" for _, h in cols)]
    for name, row in arms.items():
        table.append(
            f"{name:<{w}}{row['heldout_success']['n'] if 'heldout_success' in row else 0:>3}"
            + "".join(_cell(row.get(k), "change" in k, 16) for k, _ in cols)
        )
    blocks = [*_curve_blocks(agg)]
    paired_rows = {**agg["paired"], **agg.get("paired_cost", {})}
    pw = max(32, *(len(name) + 1 for name in paired_rows)) if paired_rows else 32
    pairs = [f"{'paired (per run, points)':<{pw}}{'mean ± 95% CI':>15}{'n':>4}  verdict"]
    for name, row in paired_rows.items():
        pairs.append(f"{name:<{pw}}{_cell(row, True)}{row['n']:>4}  {row['verdict']}")
    return "\n\n".join(["\n".join(lines), "\n".join(table), *blocks, "\n".join(pairs)])


def _curve_blocks(agg: dict[str, Any]) -> list[str]:
    """The curve table (per arm, held-out success at each budget point, mean ± 95% CI) and the
    rollout-ratio table; none where no run has a curve."""
    curves = {name: rows for name, rows in agg.get("curves", {}).items() if rows}
    if not curves:
        return []
    top = max(r["point"] for rows in curves.values() for r in rows)
    at = {k: [r["rollouts"] for rows in curves.values() for r in rows if r["point"] == k]
          for k in range(top + 1)}  # fmt: skip
    w = max(17, *(len(name) + 1 for name in curves))
    head = f"{'success % at trajectories':<{w}}" + "".join(
        f"{f'~{np.mean(at[k]):.0f}' if at[k] else '-':>14}" for k in range(top + 1)
    )
    rows = [head]
    for name, points in curves.items():
        by = {r["point"]: r for r in points}
        rows.append(f"{name:<{w}}" + "".join(_cell(by.get(k), width=14) for k in range(top + 1)))
    out = ["\n".join(rows)]
    cost_rows = agg.get("cost", {})
    if cost_rows:
        lines = [
            f"{f'trajectories to reach {BASELINE} final':<{w + 18}}{'reached':>9}{'at start':>9}"
            f"{'mean':>8}{'ratio (n)':>12}"
        ]
        for name, r in cost_rows.items():
            mean = "-" if r["needed_mean"] is None else f"{r['needed_mean']:.0f}"
            ratio_ = "-" if r["ratio_geomean"] is None else f"{r['ratio_geomean']:.2f}x"
            reached = f"{r['reached']}/{r['n']}"
            ratio_ += f" ({r['ratio_n']})"
            lines.append(f"{name:<{w + 18}}{reached:>9}{r['at_start']:>9}{mean:>8}{ratio_:>12}")
        out.append("\n".join(lines))
    return out


def _seed_of(path: Path) -> int | None:
    m = re.fullmatch(r"seed_(\d+)", path.name)
    return int(m.group(1)) if m else None


def read_runs(
    workdir: Path,
    seeds: Sequence[int],
    pool: Sequence[Path] = (),
    run: Callable[[int], dict[str, Any]] | None = None,
) -> Runs:
    """Every run, labelled: `seed_N` for `workdir`'s seeds (a missing one made by `run`) and
    `seed_N@<basename>` for every finished run in each pool directory. The pool is checked
    before anything runs, so a typo does not cost a training."""
    pooled: Runs = {}
    for d in map(Path, pool):
        found = sorted((s, p) for p in d.glob("seed_*") if (s := _seed_of(p)) is not None)
        found = [(s, p / "summary.json") for s, p in found if (p / "summary.json").exists()]
        if not found:
            raise UserError(f"--pool={d}: no finished seed_N/summary.json there")
        for seed, path in found:
            label = f"seed_{seed}@{d.name}"
            if label in pooled:
                raise UserError(f"--pool: two directories named {d.name!r}; rename one")
            pooled[label] = json.loads(path.read_text())
    runs: Runs = {}
    for seed in seeds:
        path = Path(workdir) / f"seed_{seed}" / "summary.json"
        if path.exists():
            runs[f"seed_{seed}"] = json.loads(path.read_text())
        elif run is not None:
            runs[f"seed_{seed}"] = run(seed)
        else:
            raise UserError(f"seed {seed}: {path} does not exist")
    return runs | pooled


def seed_config(config: Any, seed: int, workdir: Path) -> Any:
    """The config of one seed's run: `seed`, its workdir `<workdir>/seed_N` and, on the
    synthetic environment, the task seed (each seed draws its own tasks, held-out ones too)."""
    import ml_collections

    c = ml_collections.ConfigDict(config.to_dict())
    c.seed, c.workdir = seed, str(Path(workdir) / f"seed_{seed}")
    if c.env.benchmark == "synthetic":
        c.env.synthetic.seed = seed
    return c


def child_command(argv: Sequence[str], seed: int) -> list[str]:
    """This command again with `--only_seed`: the same flags, so the same config, one seed."""
    return [sys.executable, "-m", "rcgrpo_jax.tools.seeds", *argv, f"--only_seed={seed}"]


def run_child(cmd: Sequence[str], workdir: Path) -> dict[str, Any]:
    """Runs one seed's stage `all` in a process of its own (its output passes through) and
    reads back its summary; a failed run is a UserError naming the command to resume it."""
    import subprocess

    code = subprocess.run(list(cmd), check=False).returncode
    path = Path(workdir) / "summary.json"
    if code != 0 or not path.exists():
        msg = f"{workdir.name} failed (exit {code}): {shlex.join(cmd)}"
        raise UserError(f"{msg}; rerun this command to resume it (finished arms are read back)")
    return json.loads(path.read_text())


def main(argv: list[str]) -> int:
    del argv
    logs.configure(verbose=flags.FLAGS["verbosity"].present)
    config = _CONFIG.value
    workdir = Path(_WORKDIR.value)
    try:
        seeds = [int(s) for s in _SEEDS.value]
        config_check.validate(config)
        if config.stage != "all":
            raise UserError(f"config.stage={config.stage!r}; the seed table runs stage 'all'")
    except (ValueError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def run_seed(seed: int) -> dict[str, Any]:  # a process per seed: see the module's top
        print(f"seed {seed}: {workdir / f'seed_{seed}'}", flush=True)
        return run_child(child_command(sys.argv[1:], seed), workdir / f"seed_{seed}")

    try:
        if _ONLY_SEED.value is not None:  # one seed, in the process `run_child` started
            compilation.configure_from(config)
            experiment.run(seed_config(config, _ONLY_SEED.value, workdir))
            return 0
        per_run = read_runs(workdir, seeds, [Path(p) for p in _POOL.value], run_seed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kept, dropped = distinct(per_run)
    agg = aggregate(kept, dropped)
    report = format_report(per_run, agg)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "seeds.json").write_text(json.dumps({"runs": per_run, **agg}, indent=1) + "\n")
    (workdir / "seeds.txt").write_text(report + "\n")
    if any(agg["curves"].values()):  # held-out success against trajectories, mean and band
        from rcgrpo_jax.tools import curves

        curves.draw({workdir.name: agg["curves"]}, workdir / "curves.png")
    # the study's page: intervals, paired differences, curves with bands, each run's own page
    from rcgrpo_jax import report as page
    from rcgrpo_jax.config import base_config

    page.refresh(workdir, config.to_dict(), base_config().to_dict())
    print(report)
    return 0


def _define_flags() -> None:
    """Flags are defined only when run as a command (the module is also imported by tests)."""
    global _CONFIG, _SEEDS, _WORKDIR, _POOL, _ONLY_SEED
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Stage `all` config.")
    _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds to run.")
    _WORKDIR = flags.DEFINE_string("workdir", "runs/seeds", "One sub-directory per seed.")
    _POOL = flags.DEFINE_list(
        "pool", [], "Other workdirs whose finished seed_N runs join the aggregate (not run)."
    )
    _ONLY_SEED = flags.DEFINE_integer(
        "only_seed", None, "Run this one seed here and stop (what each seed's process is given)."
    )


if __name__ == "__main__":
    _define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
