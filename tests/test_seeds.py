"""tools.seeds and tools.seed_stats on synthetic summaries (no training): the intervals against
scipy's t quantile, bit-identical runs and arms counted once, paired differences, the controls'
rows, pooled labels and summaries older than the RL start's record."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from rcgrpo_jax.errors import UserError
from rcgrpo_jax.tools import seed_stats, seeds

RL = ("sft_grpo", "sft_rcgrpo", "rctp_rcgrpo", "rctp_grpo", "sft_grpo_dynamic")


def _summary(start: dict[str, float], end: dict[str, float], old: bool = False, **kw) -> dict:
    """A stage `all` summary: RL arms from `start`/`end` (`old`: no start_success, only the
    targets' `moved`, as runs before the start's record); `kw` adds to every RL row."""
    arms = {
        "base": {"heldout_success": 0.0},
        "sft": {"heldout_success": start.get("sft_grpo", 0.5)},
        "rctp": {"heldout_success": 0.6, "success_high": 0.6, "success_low": 0.0},
    }
    for name, e in end.items():
        arms[name] = {"heldout_success": e, "degenerate_frac": 0.5, "entropy": 0.1, **kw}
        if not old:
            arms[name]["start_success"] = start[name]
    moved = {name: end[name] - start[name] for name in end}
    targets = {"sft_in_band": True, "rctp_controllable": True, "rcgrpo_less_degenerate": True}
    return {"arms": arms, "targets": {**targets, "moved": moved}, "wall_s": 300.0, "table": "t"}


def _run(i: int, gain: float = 0.1) -> dict:
    """Run i: every arm starts at its stage-1 figure; RCTP → RC-GRPO gains `gain` more."""
    start = {n: (0.6 if n.startswith("rctp") else 0.5) for n in RL}
    end = {n: start[n] + 0.01 * i for n in RL}
    end["rctp_rcgrpo"] += gain + 0.02 * (i % 2)
    s = _summary(start, end)
    for name in ("base", "sft", "rctp"):  # each run's stage 1 its own (as each seed's is)
        s["arms"][name]["heldout_success"] += 0.001 * i
    return s


def _t(d: list[float]) -> float:
    return stats.t.ppf(0.975, len(d) - 1) * np.std(d, ddof=1) / np.sqrt(len(d))


def test_interval_is_the_student_t_half_width():
    got = seed_stats.interval([0.25, 0.5, 0.375, 0.625, 0.5])
    # by hand: mean 0.45, sum of squares 0.08125, sd = sqrt(0.08125 / 4), t(0.975, 4) = 2.7764
    assert stats.t.ppf(0.975, 4) == pytest.approx(2.7764451, rel=1e-6)
    assert got["mean"] == pytest.approx(0.45) and got["n"] == 5
    assert got["ci95"] == pytest.approx(2.7764451 * np.sqrt(0.08125 / 4) / np.sqrt(5), rel=1e-6)
    assert seed_stats.interval([0.3]) == {"mean": 0.3, "ci95": 0.0, "n": 1}


def test_a_bit_identical_run_is_counted_once_and_named():
    runs = {"seed_0": _run(0), "seed_1": _run(1), "seed_1@avx2": _run(1), "seed_0@avx2": _run(2)}
    runs["seed_1@avx2"].update(wall_s=1.0, table="other")  # timing is not a result
    runs["seed_1@avx2"]["arms"]["sft_grpo"]["tokens_per_s"] = 9.0
    kept, dropped = seed_stats.distinct(runs)
    assert list(kept) == ["seed_0", "seed_1", "seed_0@avx2"]
    assert dropped == [seed_stats.Repeat("seed_1@avx2", "seed_1")]
    agg = seed_stats.aggregate(kept, dropped)
    assert agg["arms"]["sft_grpo"]["heldout_success"]["n"] == 3
    report = seeds.format_report(runs, agg)
    assert "distinct runs: 3 (dropped: seed_1@avx2 is bit-identical to seed_1: counted once)" in (
        report
    )
    assert "all three 3/3" in report and "seed_1@avx2 " in report  # the table keeps every run


def test_a_repeated_arm_is_counted_once_and_pairs_with_it_are_left_out():
    """Another compile that perturbed SFT but not RCTP: its RCTP arms are the first run's
    again (one sample each), its SFT arms are new; a paired difference counts on that run only
    where both arms are new (half a repeat is not an independent difference)."""
    runs = {"seed_0": _run(0), "seed_1": _run(1), "seed_0@avx2": _run(0)}
    avx2 = runs["seed_0@avx2"]["arms"]
    avx2["sft"]["heldout_success"] = 0.45
    avx2["sft_grpo"]["heldout_success"], avx2["sft_rcgrpo"]["heldout_success"] = 0.40, 0.45
    avx2["sft_grpo_dynamic"]["heldout_success"] = 0.42
    kept, dropped = seed_stats.distinct(runs)
    repeated = ("base", "rctp", "rctp_rcgrpo", "rctp_grpo")
    assert dropped == [seed_stats.Repeat("seed_0@avx2", "seed_0", repeated)]
    assert list(kept) == list(runs) and set(kept["seed_0@avx2"]["arms"]).isdisjoint(repeated)
    assert "rctp" in runs["seed_0@avx2"]["arms"]  # the input is left whole
    other_seed = seed_stats.distinct({**runs, "seed_5": _run(0)})[1]  # the same numbers by
    assert other_seed == dropped  # chance on another seed are another sample
    agg = seed_stats.aggregate(kept, dropped)
    assert agg["arms"]["rctp_rcgrpo"]["heldout_success"]["n"] == 2
    assert agg["arms"]["sft_grpo"]["heldout_success"]["n"] == 3
    # by hand: rctp_rcgrpo − sft_grpo is 0.70 − 0.50 on seed 0 and 0.73 − 0.51 on seed 1; the
    # AVX2 run's rctp_rcgrpo repeats seed 0's, so that run has no such difference
    row = agg["paired"]["final rctp_rcgrpo - sft_grpo"]
    assert row["n"] == 2 and row["mean"] == pytest.approx(0.21)
    assert row["ci95"] == pytest.approx(12.7062047 * 0.01, rel=1e-6)  # t(0.975, 1) · sd / √2
    # sft_rcgrpo − sft_grpo: 0 on seeds 0 and 1, 0.45 − 0.40 on the AVX2 run (both arms new)
    row = agg["paired"]["final sft_rcgrpo - sft_grpo"]
    assert row["n"] == 3 and row["mean"] == pytest.approx(0.05 / 3)
    assert agg["dropped"] == [["seed_0@avx2", "seed_0", list(repeated)]]
    report = seeds.format_report(runs, agg)
    said = "seed_0@avx2's base, rctp, rctp_rcgrpo, rctp_grpo bit-identical to seed_0's"
    assert f"distinct runs: 3 (dropped: {said}: each counted once)" in report


def test_paired_difference_is_the_mean_of_per_run_differences():
    runs = {f"seed_{i}": _run(i) for i in range(4)}
    del runs["seed_3"]["arms"]["rctp_grpo"]  # a run without one of the arms: not in that pair
    paired = seed_stats.aggregate(runs)["paired"]
    end = lambda s, n: s["arms"][n]["heldout_success"]
    d = [end(s, "rctp_rcgrpo") - end(s, "sft_grpo") for s in runs.values()]
    row = paired["final rctp_rcgrpo - sft_grpo"]
    assert row["mean"] == pytest.approx(np.mean(d)) and row["ci95"] == pytest.approx(_t(d))
    assert row["n"] == 4 and row["verdict"] == "> 0"
    ch = lambda s, n: end(s, n) - s["arms"][n]["start_success"]
    d = [ch(s, "rctp_rcgrpo") - ch(s, "rctp_grpo") for k, s in runs.items() if k != "seed_3"]
    row = paired["change rctp_rcgrpo - rctp_grpo"]
    assert row["mean"] == pytest.approx(np.mean(d)) and row["ci95"] == pytest.approx(_t(d))
    assert row["n"] == 3
    assert paired["change sft_rcgrpo - sft_grpo"]["verdict"] == "includes 0"  # all exactly 0
    negative = seed_stats.aggregate({f"seed_{i}": _run(i, gain=-0.2) for i in range(4)})["paired"]
    assert negative["final rctp_rcgrpo - sft_grpo"]["verdict"] == "< 0"
    assert seed_stats.aggregate({"seed_0": _run(0)})["paired"]["final rctp_rcgrpo - sft_grpo"][
        "verdict"
    ] == "n < 2"  # fmt: skip


def _with_controls(i: int, lr0_end: float = 0.6) -> dict:
    s = _run(i)
    start = {"rctp_rcgrpo_shuffled": 0.6, "rctp_rcgrpo_lr0": 0.6, "sft_grpo_shuffled": 0.5}
    end = {"rctp_rcgrpo_shuffled": 0.6 - 0.01 * i, "rctp_rcgrpo_lr0": lr0_end}
    end["sft_grpo_shuffled"] = 0.5
    extra = _summary(start, end)
    s["arms"].update({k: extra["arms"][k] for k in end})
    s["targets"]["moved"].update(extra["targets"]["moved"])
    return s


def test_shuffled_and_lr0_controls():
    runs = {f"seed_{i}": _with_controls(i) for i in range(3)}
    paired = seed_stats.aggregate(runs)["paired"]
    ch = lambda s, n: s["arms"][n]["heldout_success"] - s["arms"][n]["start_success"]
    d = [ch(s, "rctp_rcgrpo") - ch(s, "rctp_rcgrpo_shuffled") for s in runs.values()]
    row = paired["change rctp_rcgrpo - rctp_rcgrpo_shuffled"]
    assert row["mean"] == pytest.approx(np.mean(d)) and row["ci95"] == pytest.approx(_t(d))
    assert "change sft_grpo - sft_grpo_shuffled" in paired
    lr0 = paired["change rctp_rcgrpo_lr0"]
    assert (lr0["mean"], lr0["ci95"], lr0["max_abs"], lr0["n"]) == (0.0, 0.0, 0.0, 3)
    assert lr0["verdict"] == "= 0 exactly"
    runs["seed_2"] = _with_controls(2, lr0_end=0.6 + 1 / 32)  # one task flipped without training
    lr0 = seed_stats.aggregate(runs)["paired"]["change rctp_rcgrpo_lr0"]
    assert lr0["max_abs"] == pytest.approx(1 / 32) and lr0["verdict"] == "NOT 0: max |x| 3.1"


def test_older_summaries_start_at_end_minus_moved():
    start = {n: 0.5 for n in RL}
    old = {f"seed_{i}": _summary(start, {n: 0.5 + 0.05 * i for n in RL}, old=True) for i in (1, 2)}
    assert "start_success" not in old["seed_1"]["arms"]["sft_grpo"]
    row = seed_stats.aggregate(old)["arms"]["sft_grpo"]
    assert row["start_success"]["mean"] == pytest.approx(0.5)
    assert row["change"]["mean"] == pytest.approx(0.075) and row["change"]["n"] == 2
    mixed = seed_stats.aggregate({**old, "seed_0": _run(0)})  # older and newer runs together
    assert mixed["arms"]["sft_grpo"]["change"]["n"] == 3
    assert "sft_grpo" in seeds.format_report(old, seed_stats.aggregate(old))


def test_read_runs_labels_the_pool(tmp_path):
    def write(d, seed, summary):
        (tmp_path / d / f"seed_{seed}").mkdir(parents=True)
        (tmp_path / d / f"seed_{seed}" / "summary.json").write_text(json.dumps(summary))

    for seed in (0, 1):
        write("main", seed, _run(seed))
        write("avx2", seed, _run(seed + 5))
    (tmp_path / "avx2" / "seed_7").mkdir()  # unfinished: not read
    write("main", 9, _run(9))  # not in --seeds: not read
    runs = seeds.read_runs(tmp_path / "main", [0, 1], [tmp_path / "avx2"])
    assert list(runs) == ["seed_0", "seed_1", "seed_0@avx2", "seed_1@avx2"]
    assert runs["seed_1@avx2"] == _run(6)
    made = []
    run = lambda seed: made.append(seed) or _run(seed)
    runs = seeds.read_runs(tmp_path / "main", [0, 2], (), run)
    assert made == [2] and list(runs) == ["seed_0", "seed_2"]
    with pytest.raises(UserError, match="seed 2"):
        seeds.read_runs(tmp_path / "main", [2])
    with pytest.raises(UserError, match="no finished"):  # checked before any seed runs
        seeds.read_runs(tmp_path / "main", [3], [tmp_path / "nowhere"], run)
    assert made == [2]


def test_report_tables_and_record():
    runs = {f"seed_{i}": _with_controls(i) for i in range(3)}
    runs["seed_1@avx2"] = _with_controls(1)
    for s in runs.values():
        for name, row in s["arms"].items():
            if "start_success" in row:
                row.update(sampled_start=0.4, sampled_success=0.4 + 0.02 * len(name))
    kept, dropped = seed_stats.distinct(runs)
    agg = seed_stats.aggregate(kept, dropped)
    assert agg["arms"]["sft_grpo"]["sampled_change"]["mean"] == pytest.approx(0.16)
    report = seeds.format_report(runs, agg)
    print(report)
    blocks = report.split("\n\n")
    assert len(blocks) == 3
    arm_lines = blocks[1].splitlines()
    assert len({len(line) for line in arm_lines}) == 1 and "sampled change" in arm_lines[0]
    assert arm_lines[1].split()[:3] == ["base", "3", "-"]
    assert blocks[2].splitlines()[0].startswith("paired")
    assert any(line.endswith("= 0 exactly") for line in blocks[2].splitlines())
    record = json.loads(json.dumps({"runs": runs, **agg}))
    assert record["dropped"] == [["seed_1@avx2", "seed_1", []]] and len(record["runs"]) == 4


def _curve(budget: int, *points: tuple[int, float, int]) -> dict:
    return {"budget": budget, "points": [
        {"rollouts": x, "success": y, "budget_point": k} for x, y, k in points
    ]}  # fmt: skip


def _cost_run(method: list[float], base: list[float], other: list[float]) -> dict:
    """A run with three RL arms whose curves take the given values at 0, 512, 1024 (= budget)."""
    xs = (0, 512, 1024)
    arms = {"base": {"heldout_success": 0.0}, "sft": {"heldout_success": base[0]}}
    for name, ys in (("rctp_rcgrpo", method), ("sft_grpo_dynamic", base), ("sft_grpo", other)):
        c = _curve(1024, *zip(xs, ys, range(3), strict=True))
        area = (512 * (ys[0] + ys[1]) / 2 + 512 * (ys[1] + ys[2]) / 2) / 1024
        arms[name] = {"start_success": ys[0], "heldout_success": ys[-1], "curve": c, "auc": area}
    return {"arms": arms, "targets": {}, "wall_s": 1.0}


def test_curves_cost_and_paired_area_by_hand():
    runs = {
        "seed_0": _cost_run([0.5, 0.7, 0.7], [0.5, 0.6, 0.7], [0.5, 0.5, 0.6]),
        "seed_1": _cost_run([0.4, 0.6, 0.8], [0.4, 0.4, 0.6], [0.4, 0.4, 0.4]),
    }
    agg = seed_stats.aggregate(runs)
    # the method's curve at each budget point: mean and t half-width over the two runs
    band = agg["curves"]["rctp_rcgrpo"]
    assert [r["point"] for r in band] == [0, 1, 2]
    assert [r["rollouts"] for r in band] == [0, 512, 1024]
    assert band[1]["mean"] == pytest.approx(0.65)
    assert band[1]["ci95"] == pytest.approx(_t([0.7, 0.6]))
    # trajectories to reach the dynamic SFT → GRPO's final (0.7 on seed 0, 0.6 on seed 1):
    # the method 512 and 512, the reference 1024 and 1024 (ratio 2x), sft_grpo never
    cost = agg["cost"]
    assert cost["rctp_rcgrpo"]["runs"]["seed_0"] == {"target": 0.7, "needed": 512, "ratio": 2.0}
    assert cost["rctp_rcgrpo"]["reached"] == 2 and cost["rctp_rcgrpo"]["needed_mean"] == 512
    assert cost["rctp_rcgrpo"]["ratio_geomean"] == pytest.approx(2.0)
    assert cost["sft_grpo_dynamic"]["ratio_geomean"] == pytest.approx(1.0)
    assert cost["sft_grpo"]["reached"] == 0 and cost["sft_grpo"]["needed_mean"] is None
    # paired area, method − each baseline, by hand: seed 0 areas 0.65 / 0.6 / 0.525,
    # seed 1 0.6 / 0.45 / 0.4
    area = agg["paired_cost"]["area rctp_rcgrpo - sft_grpo_dynamic"]
    assert area["mean"] == pytest.approx((0.05 + 0.15) / 2)
    assert area["ci95"] == pytest.approx(_t([0.05, 0.15]))
    final = agg["paired_cost"]["final rctp_rcgrpo - sft_grpo"]
    assert final["mean"] == pytest.approx((0.1 + 0.4) / 2) and final["n"] == 2
    report = seeds.format_report(runs, agg)
    assert "success % at trajectories" in report and "2.00x" in report
    assert "area rctp_rcgrpo - sft_grpo_dynamic" in report


def test_each_seed_runs_in_its_own_process_with_the_commands_config(tmp_path):
    argv = ["--seeds=0,1", "--config=configs/tiny.py", f"--workdir={tmp_path}",
            "--config.arms=('grid',)", "--config.seed=7"]  # fmt: skip
    cmd = seeds.child_command(argv, 3)
    assert cmd[1:] == ["-m", "rcgrpo_jax.tools.seeds", *argv, "--only_seed=3"]

    from configs.tiny import get_config

    config = get_config()
    config.rl.optim.lr = 1e-6
    c = seeds.seed_config(config, 3, tmp_path)
    assert (c.seed, c.workdir, c.env.synthetic.seed) == (3, str(tmp_path / "seed_3"), 3)
    assert config.seed != 3 and c.rl.optim.lr == 1e-6  # a copy, the rest unchanged
    c.seed, c.workdir, c.env.synthetic.seed = config.seed, config.workdir, config.env.synthetic.seed
    assert c.to_dict() == config.to_dict()
    config.env.benchmark = "bfcl"  # the BFCL entries do not depend on the seed
    assert seeds.seed_config(config, 3, tmp_path).env.synthetic.seed == config.env.synthetic.seed


def test_a_seeds_process_hands_back_its_summary_or_says_how_to_resume(tmp_path):
    import sys

    done = tmp_path / "seed_0"
    write = f"import json,os; os.makedirs({str(done)!r}); json.dump({{'arms': {{}}}}, " \
            f"open(os.path.join({str(done)!r}, 'summary.json'), 'w'))"  # fmt: skip
    assert seeds.run_child([sys.executable, "-c", write], done) == {"arms": {}}
    died = tmp_path / "seed_1"
    with pytest.raises(UserError, match=r"seed_1 failed \(exit 3\).*rerun this command"):
        seeds.run_child([sys.executable, "-c", "raise SystemExit(3)"], died)
    with pytest.raises(UserError, match=r"exit 0"):  # exited 0 without a summary
        seeds.run_child([sys.executable, "-c", "pass"], died)
