"""Stage `all` over several seeds: the demo's targets per seed and each arm's mean ± 95% CI.

    python -m rcgrpo_jax.tools.seeds --config=configs/tiny.py --seeds=0,1,2,3,4 \
        --workdir=runs/seeds [--config.model.scan_layers=True ...]

Each seed runs `--config.seed=N` in `<workdir>/seed_N` (resumable: a finished seed is read back,
not rerun). The table and `<workdir>/seeds.json` give, per seed, every arm's held-out success,
the degenerate-group fractions, the three targets and the wall time; per arm, the mean and a 95%
Student-t interval over the seeds of its final held-out success and of its change from its
stage-1 start. One seed is one sample of everything that is random in training (data order,
sampling, RL); the tasks are `env.synthetic.seed`'s and stay fixed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rcgrpo_jax import config_check, logs

TARGETS = ("sft_in_band", "rctp_controllable", "rcgrpo_less_degenerate")


def interval(values: list[float]) -> dict[str, float]:
    """Mean and half-width of the 95% Student-t interval (0 for a single value)."""
    from scipy import stats

    x = np.asarray(values, float)
    half = 0.0
    if len(x) > 1:
        half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return {"mean": float(x.mean()), "ci95": half, "n": len(x)}


def aggregate(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: final held-out success and RL change, as mean ± 95% CI over the seeds."""
    from rcgrpo_jax.stages.all import RL_ARMS

    arms: dict[str, Any] = {}
    names = list(next(iter(per_seed.values()))["arms"])
    for name in names:
        rows = [s["arms"][name] for s in per_seed.values()]
        arms[name] = {"heldout_success": interval([r["heldout_success"] for r in rows])}
        for key in ("success_high", "success_low", "degenerate_frac"):
            if rows[0].get(key) is not None:
                arms[name][key] = interval([r[key] for r in rows])
    for name, *_ in RL_ARMS:
        if name in arms:
            moved = [s["targets"]["moved"][name] for s in per_seed.values()]
            arms[name]["change"] = interval(moved)
    met = {t: sum(bool(s["targets"][t]) for s in per_seed.values()) for t in TARGETS}
    all_met = sum(all(s["targets"][t] for t in TARGETS) for s in per_seed.values())
    return {"arms": arms, "targets_met": met, "seeds_meeting_all": all_met}


def format_report(per_seed: dict[int, dict[str, Any]], agg: dict[str, Any]) -> str:
    pct = lambda x: "  -  " if x is None else f"{100 * x:5.1f}"
    mark = lambda ok: "yes" if ok else "NO"
    lines = [
        f"{'seed':>4} {'base':>5} {'sft':>5} {'high':>5} {'low':>5} {'deg g':>6} {'deg rc':>6}"
        f"  targets 1/2/3   wall s"
    ]
    for seed, s in per_seed.items():
        a, t = s["arms"], s["targets"]
        lines.append(
            f"{seed:>4} {pct(a['base']['heldout_success'])} {pct(a['sft']['heldout_success'])} "
            f"{pct(a['rctp']['success_high'])} {pct(a['rctp']['success_low'])} "
            f"{pct(a['sft_grpo']['degenerate_frac']):>6} "
            f"{pct(a['rctp_rcgrpo']['degenerate_frac']):>6}  "
            f"{'/'.join(mark(t[k]) for k in TARGETS):<15} {s['wall_s']:6.0f}"
        )
    n = len(per_seed)
    lines.append(
        "targets met: "
        + ", ".join(f"{k} {v}/{n}" for k, v in agg["targets_met"].items())
        + f"; all three {agg['seeds_meeting_all']}/{n}"
    )
    w = max(14, *(len(name) + 1 for name in agg["arms"]))
    lines.append(f"\n{'arm':<{w}}{'held-out % (mean ± 95% CI)':>28}{'RL change, points':>22}")
    for name, row in agg["arms"].items():
        h = row["heldout_success"]
        ch = row.get("change")
        change = f"{100 * ch['mean']:+6.1f} ± {100 * ch['ci95']:4.1f}" if ch else "-"
        lines.append(f"{name:<{w}}{100 * h['mean']:>19.1f} ± {100 * h['ci95']:4.1f}{change:>24}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    del argv
    logs.configure(verbose=flags.FLAGS["verbosity"].present)
    from rcgrpo_jax.errors import UserError
    from rcgrpo_jax.stages import all as experiment

    config = _CONFIG.value
    workdir = Path(_WORKDIR.value)
    try:
        seeds = [int(s) for s in _SEEDS.value]
        config_check.validate(config)
        if config.stage != "all":
            raise UserError(f"config.stage={config.stage!r}; the seed table runs stage 'all'")
        from rcgrpo_jax import compilation

        compilation.configure_from(config)
    except (ValueError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_seed: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        c = ml_collections.ConfigDict(config.to_dict())
        c.seed, c.workdir = seed, str(workdir / f"seed_{seed}")
        done = Path(c.workdir) / "summary.json"
        print(f"seed {seed}: {c.workdir}", flush=True)
        per_seed[seed] = json.loads(done.read_text()) if done.exists() else experiment.run(c)
    agg = aggregate(per_seed)
    report = format_report(per_seed, agg)
    record = {"seeds": per_seed, **agg}
    (workdir / "seeds.json").write_text(json.dumps(record, indent=1) + "\n")
    (workdir / "seeds.txt").write_text(report + "\n")
    print(report)
    return 0


def _define_flags() -> None:
    """Flags are defined only when run as a command (the module is also imported by tests)."""
    global _CONFIG, _SEEDS, _WORKDIR
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Stage `all` config.")
    _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds to run.")
    _WORKDIR = flags.DEFINE_string("workdir", "runs/seeds", "One sub-directory per seed.")


if __name__ == "__main__":
    _define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
