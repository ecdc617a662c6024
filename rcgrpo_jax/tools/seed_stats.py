"""The study's statistics over runs of stage `all` (seeds, compiles): what `tools.seeds` reports.

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
where both reached).

Bit-identical results of one seed are one sample, counted once, and the report says which: a
whole run (a seed that another compile did not perturb) or one arm of a run (the other compile
perturbed SFT but not RCTP, say). A paired difference or a rollout ratio counts on a run only
where both of its arms are new samples there (half a repeat is not an independent difference).
A new RL arm counts whole, its start figure included, even if its stage-1 model repeats (not met
so far: every compile that perturbed an RL arm had perturbed its stage 1). The demo's targets
are counted per distinct run as that run recorded them: whether a run met them is a fact about
the run, not a sample of a statistic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rcgrpo_jax.rl.arms import BASELINE, METHOD, control_of
from rcgrpo_jax.rl.curve import Curve, ratio
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


class Repeat(NamedTuple):
    """Results of `label` bit-identical to those of `same_as`: its `arms`, or the whole run
    (arms and targets) where `arms` is empty."""

    label: Any
    same_as: Any
    arms: tuple[str, ...] = ()


def distinct(per_run: Runs) -> tuple[Runs, list[Repeat]]:
    """The runs with their repeated results left out, and what was left out. Among the runs of
    one seed (`seed_N`, `seed_N@DIR`: the same seed under other compiles), a run whose arms and
    targets all match an earlier one's is left out whole, and an arm whose row matches the same
    arm's in an earlier run is left out of its run: a compile that did not perturb it repeated
    the same computation, which adds no information, and counting it would shrink the
    intervals. The runs given are not modified."""
    key = lambda label, x: json.dumps([str(label).split("@")[0], _results(x)], sort_keys=True)
    runs_seen: dict[str, Any] = {}
    arms_seen: dict[str, Any] = {}
    kept: Runs = {}
    repeats: list[Repeat] = []
    for label, s in per_run.items():
        whole = key(label, {"a": s.get("arms"), "t": s.get("targets")})
        if whole in runs_seen:
            repeats.append(Repeat(label, runs_seen[whole]))
            continue
        runs_seen[whole] = label
        arms, same = {}, {}
        for name, row in s["arms"].items():
            if (k := key(label, [name, row])) in arms_seen:
                same.setdefault(arms_seen[k], []).append(name)
            else:
                arms_seen[k], arms[name] = label, row
        kept[label] = {**s, "arms": arms}
        repeats += [Repeat(label, other, tuple(names)) for other, names in same.items()]
    return kept, repeats


def num(x: Any) -> float | None:
    return None if x is None or x != x else float(x)


def values(summary: dict[str, Any], name: str) -> dict[str, float]:
    """One run's numbers for arm `name` (absent or NaN: left out). An RL arm's change is its
    end minus its start; a run older than the start's record has only `targets.moved`, so its
    start is end − moved."""
    row = summary["arms"].get(name, {})
    out = {k: num(row.get(k)) for k in KEYS}
    if name not in STAGE1:
        end, start = out["heldout_success"], out["start_success"]
        moved = num(summary.get("targets", {}).get("moved", {}).get(name))
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
    the finite, positive ratios (a ratio's natural average) with their count `ratio_n`. A run
    without the reference's curve (absent, or left out by `distinct` as a repeat) counts for no
    arm."""
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


def aggregate(per_run: Runs, dropped: Sequence[Repeat] = ()) -> dict[str, Any]:
    """Per arm every value as mean ± 95% CI, the paired differences, the curves and rollout
    ratios, and how many runs met each target, over the runs given (the caller passes
    `distinct`'s kept runs and its repeats)."""
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
        "dropped": [[r.label, r.same_as, list(r.arms)] for r in dropped],
        "arms": arms,
        "paired": paired(vals),
        "paired_cost": paired_cost(vals),
        "curves": curve_bands(per_run),
        "cost": cost(per_run),
        "targets_met": {t: sum(bool(g.get(t)) for g in targets) for t in TARGETS},
        "seeds_meeting_all": sum(all(g.get(t) for t in TARGETS) for g in targets),
    }
