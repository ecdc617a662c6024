"""The stages end to end on a shrunken configs/tiny.py: sft, rctp, grpo, rcgrpo, eval and `all`.

One `all` run of the command line (module fixture) produces every stage's outputs; the tests
check they exist and agree with each other, then kill runs and check that they continue exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import REPO, xla_flags

from rcgrpo_jax import machine, models
from rcgrpo_jax.rl.advantages import sample_reward_tokens
from rcgrpo_jax.rl.arms import rl_arms
from rcgrpo_jax.rl.curve import Curve
from rcgrpo_jax.rl.draws import shuffled
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.train.metrics import read_jsonl

# the arms and controls the run below asks for: every plain cell, dynamic SFT → GRPO, and the
# controls of SFT → GRPO and RCTP → RC-GRPO
ARM_NAMES = ("paper", "sft_grpo_dynamic")
ARMS = {
    a.name: a
    for a in rl_arms(
        SimpleNamespace(arms=ARM_NAMES, controls=("shuffled", "lr0"))  # what rl_arms reads
    )
}

# configs/tiny.py shrunk to seconds per stage; run through the real command line, on 2 devices.
OVERRIDES = {
    "mesh.shape": "(2,1,1)",
    "env.synthetic.num_train": 160,
    "env.synthetic.num_test": 4,
    "model.arch.hidden_size": 64,
    "model.arch.intermediate_size": 128,
    "model.arch.num_layers": 2,
    "model.arch.head_dim": 16,
    "train.steps": 4,
    "train.batch_size": 4,
    "train.checkpoint_every": 2,
    "train.warm_start_steps": 2,
    "rctp.train_steps": 0,  # RCTP takes train.steps too
    "rctp.eval_entries": 4,
    "rl.steps": 2,
    "rl.num_prompts": 2,
    "rl.group_size": 2,
    "rl.max_new_tokens": 16,
    # held-out success at the start and after 4 and 8 trajectories (the budget: 2 x 2 x 2)
    "rl.eval_every": 0,
    "rl.eval_points": 2,
    "rl.checkpoint_every": 1,
    "rl.max_rollouts": 0,
    "arms": repr(ARM_NAMES),
    "eval.max_new_tokens": 16,
    "eval.max_entries": 4,
    "eval.samples": 2,
    "controls": "('shuffled','lr0')",
}

# the run below only (stage `all`; other stages refuse the rules): the warm start's stopping
# rule, checked once (step 1) on 4 tasks of the rl split; SFT of 0 steps after the warm start
# (its start exported and evaluated as it is); RCTP of 4 steps at most, its rule (the token
# gap) checked at step 2
ALL_RUN = {
    "train.warm_start_stop.level": 0.5,
    "train.warm_start_stop.every": 1,
    "train.warm_start_stop.entries": 4,
    "train.warm_start_stop.samples": 2,
    "train.warm_start_stop.split": "rl",
    "train.steps": 0,
    "rctp.train_steps": 4,
    "rctp.stop.level": 0.5,
    "rctp.stop.every": 2,
    "rctp.stop.entries": 4,
    "rctp.stop.samples": 2,
    "rctp.stop.split": "rl",
}


def main(workdir, config: str = "configs/tiny.py", **extra) -> subprocess.CompletedProcess:
    """The command line on `config` (a config file) with OVERRIDES and `extra`."""
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags(2))
    out = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.main", f"--config={config}",
         f"--config.workdir={workdir}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def run_all(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("all")
    out = main(workdir, **ALL_RUN)
    return SimpleNamespace(
        workdir=str(workdir),
        stdout=out.stdout,
        stderr=out.stderr,
        sft_steps=ALL_RUN["train.steps"],
        rl=SimpleNamespace(
            num_prompts=OVERRIDES["rl.num_prompts"], group_size=OVERRIDES["rl.group_size"]
        ),
    ), None


def stopped_stage(config, stage: str, key: str, at: int, cap: int, measured: str) -> dict:
    """The summary of a stage of the `all` run under a stopping rule (level 0.5) asked once, at
    step `at` of `cap`, after checking what the rule left: the check in the summary and in
    stop_checks.jsonl, the steps run, the end line's note and the all-summary's row."""
    root = Path(config.workdir)
    summary = json.loads((root / stage / "summary.json").read_text())
    checks = summary["stop"]["checks"]
    assert [c["step"] for c in checks] == [at]
    assert summary["stop"]["reached"] == (checks[0][key] >= 0.5)
    assert summary["steps"] == (at if summary["stop"]["reached"] else cap)
    assert read_jsonl(root / stage / "stop_checks.jsonl") == checks
    end = [x for x in config.stdout.splitlines() if x.startswith(f"{stage}: held-out")]
    reached = summary["stop"]["reached"]
    outcome = f"stopped at step {at}" if reached else f"ran to its cap, step {cap}"
    assert len(end) == 1 and f"({outcome}: {measured} " in end[0], end
    row = json.loads((root / "summary.json").read_text())["arms"][stage]
    assert row["steps"] == summary["steps"] and row["stopped"] == summary["stop"]["reached"]
    return summary


def test_stage1_outputs(run_all):
    config, summary = run_all
    root = Path(config.workdir)
    warm = stopped_stage(config, "warm_start", "success", at=1, cap=2, measured="rl-split success")
    assert warm["init_from"] == ""  # from the random init
    assert 0 <= warm["stop"]["checks"][0]["sometimes"] <= 1
    rctp = stopped_stage(config, "rctp", "gap", at=2, cap=4, measured="rl-split success high - low")
    check = rctp["stop"]["checks"][0]
    assert check["gap"] == pytest.approx(check["high"] - check["low"])
    for stage in ("sft", "rctp"):
        s = json.loads((root / stage / "summary.json").read_text())
        steps = rctp["steps"] if stage == "rctp" else config.sft_steps
        assert s["steps"] == steps and s["skipped_updates"] == 0
        assert s["init_from"] == warm["export"]  # both arms continue from the warm start
        assert len(read_jsonl(root / stage / "metrics.jsonl")) == steps
        cfg, params = models.load_hf(root / stage / "export")
        start = models.load_hf(root / "warm_start" / "export")[1]
        same = jax.tree_util.tree_map(np.array_equal, params, start)
        # SFT of 0 steps exports its start as it is (and measures it as the warm start did)
        assert all(jax.tree_util.tree_leaves(same)) == (stage == "sft")
        if stage == "sft":
            assert s["heldout_success"]["none"] == warm["heldout_success"]["none"]
        assert (root / stage / "export" / "tokenizer.json").exists()
        assert set(s["heldout_success"]) == ({"high", "low"} if stage == "rctp" else {"none"})
        data = s["data"]["train"]
        labels = {lab for counts in data.values() for lab, n in counts.items() if n}
        assert labels == ({"0", "1"} if stage == "rctp" else {"1"})  # SFT: high quality only


def test_warm_start_stop_rule_checks_and_resumes(tmp_path):
    """The stopping rule measures every `every` steps, stops at the first check that reaches
    its level, and a stage resumed at step s keeps the checks made before s (the one at s is
    made again, by the resumed loop)."""
    import ml_collections

    from rcgrpo_jax.stages import sft
    from rcgrpo_jax.stages.eval import Success

    rule = sft.StopRule(level=0.3, every=2, entries=4, samples=2)
    rates = iter([0.1, 0.2, 0.35])

    def measure(state):  # the sampled success with no reward token
        token_measure = lambda token: Success(  # noqa: E731
            rate=next(rates) if token is None else float("nan"), by_kind={}, sometimes=0.5
        )
        return sft.check_fields(rule, token_measure)

    path = tmp_path / "stop_checks.jsonl"
    until, checks, log = sft._stop_checks(rule, measure, path, resumed_at=0)
    assert [until(step, None) for step in range(7)] == [False] * 6 + [True]
    log.close()
    assert [(c["step"], c["success"], c["reached"]) for c in checks] == [
        (2, 0.1, False), (4, 0.2, False), (6, 0.35, True),
    ]  # fmt: skip
    assert sft.stop_report(rule, checks, 6)[1] == (
        " (stopped at step 6: training success 35.0% >= 30%)"
    )
    with path.open("a") as f:
        f.write('{"step": 8, "succ')  # a line torn by a kill
    rates = iter([0.25, 0.4])
    until, checks, log = sft._stop_checks(rule, measure, path, resumed_at=4)
    assert [c["step"] for c in checks] == [2]
    assert until(4, None) is False and until(5, None) is False and until(6, None) is True
    log.close()
    assert [r["step"] for r in read_jsonl(path)] == [2, 4, 6] and checks[-1]["success"] == 0.4
    record, note = sft.stop_report(rule, checks[:2], 7)  # ran to a cap of 7 below the level
    assert record["reached"] is False and record["level"] == 0.3 and len(record["checks"]) == 2
    assert note == " (ran to its cap, step 7: training success 25.0% at step 4 < 30%)"
    assert sft.stop_report(rule, [], 1)[1] == " (ran to its cap, step 1: never checked)"
    rl = sft.StopRule(level=0.125, every=2, entries=4, samples=2, split="rl")
    assert sft.stop_report(rl, checks[:1], 2)[1] == (
        " (ran to its cap, step 2: rl-split success 10.0% at step 2 < 12.5%)"
    )
    off = ml_collections.ConfigDict({"level": 0.0, "every": 1, "entries": 1, "samples": 1})
    assert sft.StopRule.from_config(off) is None


def test_rctp_stop_rule_measures_the_token_gap(tmp_path):
    """RCTP's rule (`rctp.stop`) measures success under each reward token and stops at the
    first check where high minus low reaches its level."""
    import ml_collections

    from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
    from rcgrpo_jax.stages import sft
    from rcgrpo_jax.stages.eval import Success

    c = ml_collections.ConfigDict(
        {"level": 0.2, "every": 1, "entries": 4, "samples": 2, "split": "rl"}
    )
    rule = sft.StopRule.from_config(c, "token_gap")
    assert (rule.key, rule.until_note) == ("gap", ", or until rl-split success high - low 20%")
    rates, asked = {HIGH: iter([0.5, 0.75]), LOW: iter([0.5, 0.25])}, []

    def measure(state):
        def token_measure(token):
            asked.append(token)
            return Success(rate=next(rates[token]), by_kind={}, sometimes=0.25)

        return sft.check_fields(rule, token_measure)

    until, checks, log = sft._stop_checks(rule, measure, tmp_path / "checks.jsonl", 0)
    assert [until(step, None) for step in range(3)] == [False, False, True]
    log.close()
    assert asked == [HIGH, LOW, HIGH, LOW]
    got = [(r["step"], r["gap"], r["high"], r["low"], r["sometimes"], r["reached"]) for r in checks]
    assert got == [(1, 0.0, 0.5, 0.5, 0.25, False), (2, 0.5, 0.75, 0.25, 0.25, True)]
    assert read_jsonl(tmp_path / "checks.jsonl") == checks
    record, note = sft.stop_report(rule, checks, 2)
    assert record["quantity"] == "token_gap" and record["reached"] is True
    assert note == " (stopped at step 2: rl-split success high - low 50.0% >= 20%)"


def test_every_stage_reports_its_wall_and_compile_time(run_all):
    """Each training stage's end line, summary.json (`time`) and metrics records say what it
    spent compiling: arms after the first share its programs (one RL step per shape)."""
    config, _ = run_all
    root = Path(config.workdir)
    stages = ["warm_start", "sft", "rctp", *ARMS]
    times = {}
    for stage in stages:
        t = json.loads((root / stage / "summary.json").read_text())["time"]
        assert 0 <= t["compile_s"] <= t["wall_s"] and t["programs"] >= t["cache_hits"] >= 0
        times[stage] = t
        records = read_jsonl(root / stage / "metrics.jsonl")
        assert all(r["compile_s"] >= 0 for r in records)
        line = [x for x in config.stdout.splitlines() if x.startswith(f"{stage}: ")][-1]
        assert f"s, compile {t['compile_s']:.1f} s ({t['programs']} programs" in line, line
    assert times["warm_start"]["programs"] > 0  # the first stage compiles its step
    # a later arm finds the first arm's programs made (same model, objective, optimizer and
    # draw shape): it compiles only shapes its own rollouts add
    assert times["rctp_grpo"]["programs"] < times["sft_grpo"]["programs"]


@pytest.mark.parametrize("arm", list(ARMS))
def test_rl_arm_logs_are_consistent(run_all, arm):
    config, _ = run_all
    root = Path(config.workdir) / arm
    metrics = read_jsonl(root / "metrics.jsonl")
    rollouts = read_jsonl(root / "rollouts.jsonl")
    p, g = config.rl.num_prompts, config.rl.group_size
    init, algo, overrides = ARMS[arm].init, ARMS[arm].algo, ARMS[arm].rl
    dynamic = overrides.get("dynamic_sampling")
    # the start's evaluation (iteration 0), greedy and sampled, before any update
    start, metrics = metrics[0], metrics[1:]
    assert start["step"] == 0 and {"eval_success", "eval_sampled"} <= start.keys()
    # and the end's, also where the budget ends the run early (the dynamic arm)
    assert "eval_sampled" in [m for m in metrics if "eval_success" in m][-1]
    # the same budget of generated trajectories; the dynamic arm may spend it in fewer iterations
    steps = [m["step"] for m in metrics]
    assert steps == ([1, 2][: len(steps)] if dynamic else [1, 2]) and len(rollouts) == len(steps)
    assert sum(m["generated_rollouts"] for m in metrics) <= 2 * p * g
    for m, r in zip(metrics, rollouts, strict=True):
        rewards = np.asarray(r["rewards"])
        tokens = np.asarray(r["reward_token"])
        assert rewards.shape == tokens.shape == ((len(r["entry_ids"]) if dynamic else p), g)
        assert m["generated_rollouts"] == rewards.size
        degenerate = (rewards == rewards[:, :1]).all(1).mean()
        assert m["degenerate_frac"] == pytest.approx(degenerate)
        assert m["reward_mean"] == pytest.approx(rewards.mean())  # real rewards, shuffled or not
        if algo == "rcgrpo":  # stratified: both tokens in every group
            assert ((tokens == 1).any(1) & (tokens == 0).any(1)).all()
            if not dynamic:  # configs/tiny.py: seed 0, p_high 0.75; fold_in(key(seed), it)
                key = jax.random.fold_in(jax.random.key(0), m["step"] - 1)
                assert r["reward_token"] == sample_reward_tokens(key, p, g, 0.75, True).tolist()
        elif overrides.get("grpo_token") == "high":  # GRPO under one fixed token
            assert (tokens == 1).all()
        else:
            assert (tokens == -1).all()
        # an update runs only for a batch with an informative group
        if overrides.get("shuffle_rewards"):  # the step sees the shuffled ones (seed 0)
            rewards = shuffled(rewards, 0, m["step"] - 1)
        informative = (~(rewards == rewards[:, :1]).all(1)).any()
        assert m["applied_frac"] == (1.0 if informative else 0.0)
    assert "eval_success" in metrics[-1] and 0.0 <= metrics[-1]["eval_success"] <= 1.0
    # the budget, spent to within one round; the count per record is cumulative
    budget = 2 * p * g
    total = sum(m["generated_rollouts"] for m in metrics)
    assert budget - g < total <= budget
    assert [m["rollouts"] for m in metrics] == list(
        np.cumsum([m["generated_rollouts"] for m in metrics])
    )
    # the curve: the start, then a measurement each time a budget point (4, 8) is first
    # reached, the last standing for the budget; in summary.json as in the metrics
    summary = json.loads((root / "summary.json").read_text())
    curve = Curve.from_dict(summary["curve"])
    assert summary["ended"] == "budget" and summary["generated_rollouts"] == total
    assert curve == Curve.from_records([start, *metrics], budget)
    assert curve.points[0].rollouts == 0 and curve.points[-1].budget_point == 2
    marks = [pt.budget_point for pt in curve.points]
    assert marks == sorted(set(marks))  # one measurement per point reached, in order
    assert summary["auc"] == pytest.approx(curve.area())
    # success per task kind beside every evaluation
    kinds = {k: v for k, v in metrics[-1].items() if k.startswith("eval_by_kind/")}
    assert kinds and all(0.0 <= v <= 1.0 for v in kinds.values())
    assert (root / "export" / "config.json").exists() and (root / "dynamics.png").exists()
    if arm.endswith("_lr0"):  # lr 0: the export is its start, bit for bit, and so is its score
        _, start_params = models.load_hf(Path(config.workdir) / init / "export")
        _, end_params = models.load_hf(root / "export")
        jax.tree.map(np.testing.assert_array_equal, start_params, end_params)
        assert metrics[-1]["eval_success"] == start["eval_success"]


def test_experiment_summary_and_table(run_all):
    config, summary = run_all
    root = Path(config.workdir)
    on_disk = json.loads((root / "summary.json").read_text())
    rl_names = list(ARMS)
    assert on_disk["arms"].keys() == {"base", "warm_start", "sft", "rctp", *rl_names}
    assert set(rl_names) == {
        "sft_grpo", "sft_rcgrpo", "rctp_rcgrpo", "rctp_grpo", "sft_grpo_dynamic",
        "sft_grpo_shuffled", "rctp_rcgrpo_shuffled", "sft_grpo_dynamic_shuffled",
        "rctp_rcgrpo_lr0",
    }  # fmt: skip
    parts = (experiment.format_table(on_disk), experiment.format_kinds(on_disk),
             experiment.format_targets(on_disk["targets"]))  # fmt: skip
    table = "\n".join(part for part in parts if part)
    assert experiment.format_kinds(on_disk)  # success per task kind, every arm a column
    *head, last = (root / "table.txt").read_text().strip().splitlines()
    assert "\n".join(head) == table.strip()
    # every stage ran here, so the table names one machine: the one the figures came from
    assert last == f"figures from: {machine.one_line(on_disk['machine'])}"
    assert on_disk["machine"]["cores"] == machine.usable_cores()
    for name in on_disk["arms"]:
        stage = json.loads((root / name / "summary.json").read_text())
        assert stage["machine"] == on_disk["machine"], name
    assert on_disk["targets"] == experiment.targets(on_disk["arms"])
    for row in on_disk["arms"].values():
        assert 0.0 <= row["heldout_success"] <= 1.0
    assert on_disk["arms"]["rctp"].keys() >= {"success_high", "success_low"}
    assert (root / "dynamics.png").stat().st_size > 0
    for name in rl_names:
        rows = read_jsonl(root / name / "metrics.jsonl")
        arm = on_disk["arms"][name]
        assert arm.keys() >= {"degenerate_frac", "entropy", "start_success", "sampled_success"}
        assert arm["degenerate_frac"] == pytest.approx(
            np.mean([r["degenerate_frac"] for r in rows[1:]])
        )
        # the change is from the arm's own start (iteration 0, under its evaluation token)
        assert arm["start_success"] == rows[0]["eval_success"]
        assert on_disk["targets"]["moved"][name] == pytest.approx(
            arm["heldout_success"] - arm["start_success"]
        )
    assert on_disk["targets"]["moved"]["rctp_rcgrpo_lr0"] == 0.0


# absl's line format (I1201 12:00:00.123 ...), transformers' and TFDS's notices, JAX's probing.
LIBRARY_LINE = re.compile(
    r"^[IWEF]\d{4} |^\[transformers\]|Downloading and preparing|Unable to initialize backend"
    r"|^WARNING:|^INFO:"
)


def test_default_output_is_quiet(run_all):
    """Progress bars, a line per arm and the table; no library log line."""
    config, _ = run_all
    lines = (config.stdout + config.stderr.replace("\r", "\n")).splitlines()
    noise = [line for line in lines if LIBRARY_LINE.search(line)]
    assert noise == [], noise[:5]
    out = config.stdout.splitlines()
    for arm in ("base", "warm_start", "sft", "rctp", *ARMS):
        assert any(re.match(rf"{arm}( \([^)]+\))?: ", line) for line in out), (arm, out)
    assert config.stdout.rstrip().endswith(
        (Path(config.workdir) / "table.txt").read_text().rstrip()
    )
    assert len(out) < 48, out  # one or two lines per arm, then the table


def test_dynamic_sampling_trains_informative_groups_within_budget(tmp_path):
    """GRPO with dynamic sampling from the random model: 1 iteration, then resumed to 2. Every
    trained group has unequal rewards, every generated trajectory is in rollouts.jsonl and
    counted, and the count survives the resume (it reaches the budget of 20 mid-iteration)."""
    p, g, budget = OVERRIDES["rl.num_prompts"], OVERRIDES["rl.group_size"], 20
    run = {"stage": "grpo", "rl.dynamic_sampling": True, "rl.dynamic_max_rounds": 3,
           "rl.max_rollouts": budget, "rl.eval_every": 0, "rl.eval_points": 0}  # fmt: skip
    main(tmp_path, **run, **{"rl.steps": 1})
    main(tmp_path, **run, **{"rl.steps": 2})
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and len(rollouts) == 2
    for m, r in zip(metrics, rollouts, strict=True):
        rewards, trained = np.asarray(r["rewards"]), np.asarray(r["trained"], bool)
        assert m["generated_rollouts"] == rewards.size == g * len(r["entry_ids"])
        assert len(set(r["entry_ids"])) == len(r["entry_ids"])  # later rounds: fresh prompts
        informative = ~(rewards == rewards[:, :1]).all(1)
        assert (informative[trained]).all()
        assert m["trained_groups"] == trained.sum() == min(p, informative.sum())
        assert m["degenerate_frac"] == pytest.approx(1 - informative.mean())
    generated = sum(m["generated_rollouts"] for m in metrics)
    assert generated <= budget
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["generated_rollouts"] == generated  # the first run's count, restored


def test_all_killed_in_a_middle_arm_resumes_exactly(run_all, tmp_path):
    """Stage `all` killed (SIGKILL) inside its middle RL arm, at that arm's final evaluation
    (its iterations logged, no checkpoint after the start), then run again: summary, table and
    every RL arm's logs equal the uninterrupted run's. The stages before that arm are copied
    from the uninterrupted run: they are what the killed run would have written (the runs are
    deterministic), and it saves a minute."""
    import shutil

    from test_kill_resume import comparable, lines, run_killed_at

    config, _ = run_all
    ref, workdir = Path(config.workdir), tmp_path / "all"
    names = list(ARMS)
    later = {*names[names.index("rctp_rcgrpo") :], "summary.json", "table.txt", "dynamics.png"}
    shutil.copytree(
        ref, workdir, ignore=lambda d, names: later & set(names) if d == str(ref) else ()
    )
    arm = workdir / "rctp_rcgrpo"
    # the arm's start evaluation is the first sampled one of this process, its end the second
    events = run_killed_at(workdir, "sampled_eval:2", **ALL_RUN)  # the reference's config
    assert events.count(f"sampled_eval {OVERRIDES['eval.samples']}") == 2, events
    assert lines(arm / "metrics.jsonl") == 2  # the start and iteration 1 of 2
    assert not (arm / "summary.json").exists() and not (workdir / "rctp_grpo").exists()
    main(workdir, **ALL_RUN)
    assert (workdir / "table.txt").read_text() == (ref / "table.txt").read_text()
    summaries = [json.loads((d / "summary.json").read_text()) for d in (workdir, ref)]
    for s in summaries:
        assert s.pop("wall_s") > 0  # the one field that differs: the time each invocation took
    assert summaries[0] == summaries[1]
    for name in names:
        for log in ("metrics.jsonl", "rollouts.jsonl"):
            assert comparable(read_jsonl(workdir / name / log)) == comparable(
                read_jsonl(ref / name / log)
            ), (name, log)


def test_report_page_in_chromium(run_all):
    """Stage `all`'s report.html, built by the run, in headless Chromium against the run's own
    files (tests/test_report.py's `check_page`): trajectories per iteration, the reward-token
    filter, a conversation, held-out tasks fixed by RL, no console error."""
    from test_report import check_page, chromium

    config, _ = run_all
    driver = chromium()
    try:
        check_page(driver, Path(config.workdir), "rctp_rcgrpo")
    finally:
        driver.quit()


def test_rctp_then_rcgrpo_under_lora_train_adapters_and_export_both_ways(run_all, tmp_path):
    """RCTP, then RC-GRPO (2 iterations of 4 updates; dynamic sampling and coin rewards, so that
    every iteration updates), with `model.lora.rank` on q and v, from the warm start's export:
    the checkpoints hold the adapters and reward-token rows (and Adam's moments of them) only;
    killed in the second iteration's second update and started again from the first one's LoRA
    checkpoint, the RL run ends as the uninterrupted one does (logs, summary, merged export, PEFT
    adapter); each merged export leaves every untargeted weight bit-identical to the model it
    started from; the PEFT adapter (export/adapter) loads with `PeftModel.from_pretrained` on
    that model and computes the merged export's logits; and `--config.stage=eval` on the adapter
    directory (loaded onto the base its adapter_config.json names) decodes and scores what the
    merged export does."""
    import orbax.checkpoint as ocp
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from test_kill_resume import assert_prefix_of, assert_same_rl_run, run_killed_at, saved_steps
    from transformers import AutoModelForCausalLM

    lora = {"model.lora.rank": 4, "model.lora.targets": "('q','v')"}
    warm = Path(run_all[0].workdir) / "warm_start" / "export"
    rctp, rl = tmp_path / "rctp", tmp_path / "rl"
    main(rctp, stage="rctp", **{"model.hf_path": str(warm), "train.checkpoint_every": 4}, **lora)
    rounds, steps = 4, OVERRIDES["rl.steps"]
    rows = OVERRIDES["rl.num_prompts"] * OVERRIDES["rl.group_size"]
    run = {"stage": "rcgrpo", "rl.init_from": str(rctp / "export"), "rl.eval_every": 0,
           "rl.eval_points": 0, "env.module": "tests.forced_rewards",
           "rl.dynamic_sampling": True, "rl.dynamic_max_rounds": rounds,
           "rl.max_rollouts": steps * rounds * rows,
           "rl.epochs": 2, "rl.minibatches": 2, **lora}  # fmt: skip
    main(rl, **run)
    assert json.loads((rl / "summary.json").read_text())["iterations"] == steps == 2
    assert all(m["applied_frac"] > 0 for m in read_jsonl(rl / "metrics.jsonl"))  # mixed groups

    killed = tmp_path / "killed"
    *_, last = run_killed_at(killed, "update:6", **run)  # 4 updates per iteration
    assert last == "update 2" and saved_steps(killed) == [1]  # resumes from a LoRA checkpoint
    assert assert_prefix_of(rl, killed) == [1]
    main(killed, **run)
    assert_same_rl_run(rl, killed)
    adapters = [load_file(d / "export" / "adapter" / "adapter_model.safetensors")
                for d in (rl, killed)]  # fmt: skip
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for k in adapters[0]:
        np.testing.assert_array_equal(adapters[0][k], adapters[1][k])

    for workdir, step in ((rctp, 4), (rl, 1)):
        meta = ocp.PyTreeCheckpointer().metadata(workdir / "checkpoints" / str(step) / "state")
        leaves = jax.tree_util.tree_leaves_with_path(meta.item_metadata.tree)
        params = {jax.tree_util.keystr(p) for p, _ in leaves}
        params = {p for p in params if p.startswith("['params']")}
        assert params and all("_lora']" in p or "['lora_tokens']" in p for p in params), params

    tokens = torch.arange(3, 19)[None]
    for start_dir, workdir in ((warm, rctp), (rctp / "export", rl)):
        start = AutoModelForCausalLM.from_pretrained(str(start_dir)).eval()
        merged = AutoModelForCausalLM.from_pretrained(str(workdir / "export")).eval()
        before, after = start.state_dict(), merged.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        trained = (".q_proj.", ".v_proj.", "embed_tokens", "lm_head")  # the head: the token rows
        assert changed and all(any(t in k for t in trained) for k in changed), changed
        adapter = PeftModel.from_pretrained(start, str(workdir / "export" / "adapter")).eval()
        with torch.no_grad():
            np.testing.assert_allclose(
                adapter(tokens).logits.numpy(), merged(tokens).logits.numpy(), atol=1e-4
            )
    scores = {}
    for name in ("export", "export/adapter"):
        out = tmp_path / "eval" / name.replace("/", "_")
        main(out, stage="eval", **{"model.hf_path": str(rl / name)})
        (path,) = (out / "eval").glob("*/summary.json")
        summary = json.loads(path.read_text())
        entries = read_jsonl(path.parent / "entries.jsonl")  # each task's decoded turns
        scores[name] = (summary["num_entries"], summary["accuracy"], entries)
    assert scores["export"][0] > 0 and scores["export"] == scores["export/adapter"]
