"""Stage `all` over several seeds (and compiles): what RL did, per arm and arm against arm.

    python -m rcgrpo_jax.tools.seeds --config=configs/tiny.py --seeds=0,1,2,3,4 \\
        --workdir=runs/seeds [--pool=runs/avx2,...] [--config.model.scan_layers=True ...]

Each seed runs stage `all` with `--config.seed=N` in `<workdir>/seed_N`, in a process of its
own (this command again, with `--only_seed=N`): XLA:CPU's compiled programs keep their memory
maps, and one process would meet Linux's map limit within a few full-grid seeds.
Resumable: a finished seed is read back, not rerun; a seed that died resumes its finished arms.
`--pool` adds the finished `DIR/seed_N` runs of other workdirs, e.g. the same seeds compiled
under `XLA_FLAGS=--xla_cpu_max_isa=AVX2`: a different rounding is another sample of training's
chaos, so it joins the aggregate as `seed_N@<basename of DIR>`. Two runs whose results are
bit-identical (a seed the other compile did not perturb) are one sample, counted
once, and the report says which.

Per arm, over the distinct runs: held-out success at RL's start (under the arm's own evaluation
token), at the end, and the change, each mean ± 95% Student-t half-width. The comparison a
reader needs is paired (the same seed's arms share their stage-1 model and tasks), so the paired
table gives, per run, arm minus arm, then the interval of those differences: RCTP → RC-GRPO
against SFT → GRPO and against RCTP → GRPO (the same start without conditioned sampling),
SFT → RC-GRPO against SFT → GRPO; an arm against its shuffled-reward control (RL that learns
from the reward moves more than RL that does not); and the lr-0 control's change, which must be
exactly 0 (else the start and end evaluations differ for reasons other than training).
Where the runs recorded curves (`rl.eval_points`), also: per arm the curve's mean ± 95% CI at
each budget point; paired per run, the method (RCTP → RC-GRPO, plain and dynamic) minus every
other real arm in area under the curve and in final success; and the rollout ratio: the
trajectories each arm needed to reach the final held-out success of SFT → GRPO with dynamic
sampling on the same run ("not reached" within the budget counts as such), and the
reference's need over the arm's (> 1: the arm needed fewer; geometric mean over the runs
where both reached). `curves.png` draws the curves (`tools.curves`: studies side by side).
Printed, with the machine each run came from (CPU, cores, `XLA_FLAGS`: each changes the
rounding), and written to `<workdir>/seeds.txt` and `<workdir>/seeds.json`, and as a page,
`<workdir>/report.html` (`rcgrpo_jax.report`: the intervals, the curves with their bands and a
link to each run's own page). On the synthetic environment each seed also draws its own tasks
(`env.synthetic.seed` = the seed), so the held-out set varies with the seed and is the same for
every arm of one seed.
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
from rcgrpo_jax.rl.arms import BASELINE, METHOD, control_of
from rcgrpo_jax.rl.curve import Curve, ratio
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.stages.all import STAGE1

TARGETS = ("sft_in_band", "rctp_controllable", "rcgrpo_less_degenerate")
# (a, b): a − b per run; rctp_grpo is RC-GRPO's own start without conditioned sampling
PAIRS = (("rctp_rcgrpo", "sft_grpo"), ("rctp_rcgrpo", "rctp_grpo"), ("sft_rcgrpo", "sft_grpo"))
# the per-arm values, in the order the record lists them
KEYS = (
    "start_success", "heldout_success", "change", "auc", "sampled_start", "sampled_success",
    "sampled_change", "success_high", "success_low", "degenerate_frac", "entropy", "reward_mean",
)  # fmt: skip
Runs = dict[Any, dict[str, Any]]  # label -> a run's summary.json


def interval(values: list[float]) -> dict[str, float]:
    """Mean and half-width of the 95% Student-t interval (0 for a single value)."""
    from scipy import stats

    x = np.asarray(values, float)
    half = 0.0
    if len(x) > 1:
        half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return {"mean": float(x.mean()), "ci95": half, "n": len(x)}


def _results(obj: Any) -> Any:
    """`obj` without its timing (wall_s, tokens_per_s, ...) and printed tables: what must match
    for two runs to be one sample."""
    if isinstance(obj, dict):
        timing = lambda k, v: str(k).endswith("_s") and isinstance(v, int | float)
        return {k: _results(v) for k, v in obj.items() if k != "table" and not timing(k, v)}
    return obj


def distinct(per_run: Runs) -> tuple[Runs, list[tuple[Any, Any]]]:
    """The runs with distinct results (arms and targets), first label kept, and the
    (dropped, identical-to) pairs: a bit-identical repeat adds no information, and counting it
    would shrink the intervals."""
    seen: dict[str, Any] = {}
    kept: Runs = {}
    dropped: list[tuple[Any, Any]] = []
    for label, s in per_run.items():
        key = json.dumps(_results({"a": s.get("arms"), "t": s.get("targets")}), sort_keys=True)
        if key in seen:
            dropped.append((label, seen[key]))
        else:
            seen[key], kept[label] = label, s
    return kept, dropped


def _num(x: Any) -> float | None:
    return None if x is None or x != x else float(x)


def values(summary: dict[str, Any], name: str) -> dict[str, float]:
    """One run's numbers for arm `name` (absent or NaN: left out). An RL arm's change is its
    end minus its start; a run older than the start's record has only `targets.moved`, so its
    start is end − moved."""
    row = summary["arms"].get(name, {})
    out = {k: _num(row.get(k)) for k in KEYS}
    if name not in STAGE1:
        end, start = out["heldout_success"], out["start_success"]
        moved = _num(summary.get("targets", {}).get("moved", {}).get(name))
        if start is None and end is not None and moved is not None:
            start, out["change"] = end - moved, moved
        elif start is not None and end is not None:
            out["change"] = end - start
        out["start_success"] = start
        s0, s1 = out["sampled_start"], out["sampled_success"]
        out["sampled_change"] = None if s0 is None or s1 is None else s1 - s0
    return {k: v for k, v in out.items() if v is not None}


def verdict(row: dict[str, float]) -> str:
    """Where the 95% interval lies relative to 0 (one value has no interval)."""
    if row["n"] < 2:
        return "n < 2"
    lo, hi = row["mean"] - row["ci95"], row["mean"] + row["ci95"]
    return "> 0" if lo > 0 else "< 0" if hi < 0 else "includes 0"


def paired(vals: dict[Any, dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per-run differences over the runs that have both arms, as mean ± 95% CI: the seed's
    own noise (its stage-1 model, its task order) cancels, which unpaired intervals cannot see."""
    diff = lambda a, b, k: [
        v[a][k] - v[b][k] for v in vals.values() if k in v.get(a, {}) and k in v.get(b, {})
    ]
    test = lambda d: None if not d else {**(iv := interval(d)), "verdict": verdict(iv)}
    rows: dict[str, Any] = {}
    for a, b in PAIRS:
        rows[f"final {a} - {b}"] = test(diff(a, b, "heldout_success"))
        rows[f"change {a} - {b}"] = test(diff(a, b, "change"))
    names = list(dict.fromkeys(n for v in vals.values() for n in v))
    for n in names:
        if n.endswith("_shuffled") and n.removesuffix("_shuffled") in names:
            a = n.removesuffix("_shuffled")
            rows[f"change {a} - {n}"] = test(diff(a, n, "change"))
    for n in (n for n in names if n.endswith("_lr0")):
        if d := [v[n]["change"] for v in vals.values() if "change" in v.get(n, {})]:
            top = max(abs(x) for x in d)
            note = "= 0 exactly" if top == 0 else f"NOT 0: max |x| {100 * top:.1f}"
            rows[f"change {n}"] = {**interval(d), "verdict": note, "max_abs": top}
    return {k: v for k, v in rows.items() if v}


def _curves(summary: dict[str, Any]) -> dict[str, Curve]:
    """The RL arms' curves of one run (arms without one, from older runs, left out)."""
    return {
        name: Curve.from_dict(row["curve"])
        for name, row in summary["arms"].items()
        if name not in STAGE1 and (row.get("curve") or {}).get("points")
    }


def curve_bands(per_run: Runs) -> dict[str, list[dict[str, Any]]]:
    """Per arm, per budget point k = 0 (the start) .. N: held-out success across the runs as
    mean ± 95% CI, at the mean of the trajectories actually generated at that measurement
    (`rollouts`); a point a run did not reach (its run ended on rl.steps) leaves that run out."""
    out: dict[str, list[dict[str, Any]]] = {}
    curves = [_curves(s) for s in per_run.values()]
    for name in dict.fromkeys(n for c in curves for n in c):
        ours = [c[name] for c in curves if name in c]
        top = max(p.budget_point for c in ours for p in c.points)
        rows = []
        for k in range(top + 1):
            got = [p for c in ours if (p := c.at(k)) is not None]
            if got:
                iv = interval([p.success for p in got])
                rows.append({"point": k, "rollouts": float(np.mean([p.rollouts for p in got])),
                             **iv})  # fmt: skip
        out[name] = rows
    return out


def cost(per_run: Runs, reference: str = BASELINE) -> dict[str, dict[str, Any]]:
    """The rollout ratio, per arm: on each run, the trajectories the arm needed to reach the
    final held-out success of `reference` on that run (`Curve.to_reach`; "not reached" within
    the budget is None), and reference's need over the arm's (> 1: the arm needed fewer).
    Summarised as how many runs reached (`at_start`: of them, how many at the start already,
    where a ratio is 0 or infinite), the mean need where reached, and the geometric mean of
    the finite, positive ratios (a ratio's natural average) with their count `ratio_n`."""
    per_arm: dict[str, dict[str, Any]] = {}
    for label, s in per_run.items():
        curves = _curves(s)
        if reference not in curves or curves[reference].final is None:
            continue
        target = curves[reference].final
        need_ref = curves[reference].to_reach(target)
        for name, c in curves.items():
            row = per_arm.setdefault(name, {"runs": {}})
            need = c.to_reach(target)
            row["runs"][str(label)] = {"target": target, "needed": need,
                                       "ratio": ratio(need_ref, need)}  # fmt: skip
    for row in per_arm.values():
        runs = row["runs"].values()
        needs = [r["needed"] for r in runs if r["needed"] is not None]
        ratios = [r["ratio"] for r in runs if r["ratio"] is not None and 0 < r["ratio"] < np.inf]
        row.update(
            reached=len(needs), at_start=sum(x == 0 for x in needs), n=len(row["runs"]),
            needed_mean=float(np.mean(needs)) if needs else None,
            ratio_geomean=float(np.exp(np.mean(np.log(ratios)))) if ratios else None,
            ratio_n=len(ratios),
        )  # fmt: skip
    return per_arm


def paired_cost(vals: dict[Any, dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """The method (each `METHOD` arm present) minus every other real arm, per run, in area
    under the curve and in final held-out success, as mean ± 95% CI of the differences."""
    names = list(dict.fromkeys(n for v in vals.values() for n in v))
    real = [n for n in names if n not in STAGE1 and control_of(n) is None]
    rows: dict[str, Any] = {}
    for m in (m for m in METHOD if m in real):
        for b in (b for b in real if b != m):
            for key, what in (("auc", "area"), ("heldout_success", "final")):
                d = [v[m][key] - v[b][key] for v in vals.values()
                     if key in v.get(m, {}) and key in v.get(b, {})]  # fmt: skip
                if d:
                    rows[f"{what} {m} - {b}"] = {**(iv := interval(d)), "verdict": verdict(iv)}
    return rows


def aggregate(per_run: Runs, dropped: Sequence[tuple[Any, Any]] = ()) -> dict[str, Any]:
    """Per arm every value as mean ± 95% CI, the paired differences, and how many runs meet
    each target, over the runs given (the caller passes `distinct`'s kept runs and its pairs)."""
    names = list(dict.fromkeys(n for s in per_run.values() for n in s["arms"]))
    vals = {label: {n: values(s, n) for n in s["arms"]} for label, s in per_run.items()}
    arms: dict[str, Any] = {}
    for name in names:
        rows = [v[name] for v in vals.values() if name in v]
        arms[name] = {
            k: interval([r[k] for r in rows if k in r]) for k in KEYS if any(k in r for r in rows)
        }
    targets = [s.get("targets", {}) for s in per_run.values()]
    return {
        "distinct": list(per_run),
        "dropped": [list(p) for p in dropped],
        "arms": arms,
        "paired": paired(vals),
        "paired_cost": paired_cost(vals),
        "curves": curve_bands(per_run),
        "cost": cost(per_run),
        "targets_met": {t: sum(bool(g.get(t)) for g in targets) for t in TARGETS},
        "seeds_meeting_all": sum(all(g.get(t) for t in TARGETS) for g in targets),
    }


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
    pct = lambda x: "  -  " if _num(x) is None else f"{100 * x:5.1f}"
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
    same = "; ".join(f"{d} is bit-identical to {k}: counted once" for d, k in agg["dropped"])
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
