"""The stages end to end on a shrunken configs/tiny.py: sft, rctp, grpo, rcgrpo, eval and `all`.

One `all` run (module fixture) produces every stage's outputs; the tests check they exist and
agree with each other, then resume an RL arm to check it continues exactly.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO

from rcgrpo_jax import experiment, models
from rcgrpo_jax.rl import loop as rl_loop
from rcgrpo_jax.train.metrics import read_jsonl


def tiny_config(workdir):
    spec = importlib.util.spec_from_file_location("tiny", REPO / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.workdir = str(workdir)
    c.mesh.shape = (2, 1, 1)
    c.env.synthetic.num_train = 160
    c.env.synthetic.num_test = 4
    c.model.arch.hidden_size = 64
    c.model.arch.intermediate_size = 128
    c.model.arch.num_layers = 2
    c.model.arch.head_dim = 16
    c.train.steps = 4
    c.train.batch_size = 4
    c.train.checkpoint_every = 2
    c.rctp.eval_entries = 4
    c.rl.steps = 2
    c.rl.num_prompts = 2
    c.rl.group_size = 2
    c.rl.max_new_tokens = 16
    c.rl.eval_every = 2
    c.rl.checkpoint_every = 1
    c.eval.max_new_tokens = 16
    c.eval.max_entries = 4
    return c


@pytest.fixture(scope="module")
def run_all(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("all"))
    return config, experiment.run(config)


def test_stage1_outputs(run_all):
    config, summary = run_all
    root = Path(config.workdir)
    for stage in ("sft", "rctp"):
        s = json.loads((root / stage / "summary.json").read_text())
        assert s["steps"] == config.train.steps and s["skipped_updates"] == 0
        assert len(read_jsonl(root / stage / "metrics.jsonl")) == config.train.steps
        cfg, params = models.load_hf(root / stage / "export")
        assert (root / stage / "export" / "tokenizer.json").exists()
        assert set(s["heldout_success"]) == ({"high", "low"} if stage == "rctp" else {"none"})
        data = s["data"]["train"]
        labels = {lab for counts in data.values() for lab, n in counts.items() if n}
        assert labels == ({"0", "1"} if stage == "rctp" else {"1"})  # SFT: high quality only


@pytest.mark.parametrize("arm", ["sft_grpo", "rctp_rcgrpo", "rctp_grpo"])
def test_rl_arm_logs_are_consistent(run_all, arm):
    config, _ = run_all
    root = Path(config.workdir) / arm
    metrics = read_jsonl(root / "metrics.jsonl")
    rollouts = read_jsonl(root / "rollouts.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and len(rollouts) == 2
    for m, r in zip(metrics, rollouts, strict=True):
        rewards = np.asarray(r["rewards"])
        tokens = np.asarray(r["reward_token"])
        assert rewards.shape == tokens.shape == (config.rl.num_prompts, config.rl.group_size)
        degenerate = (rewards == rewards[:, :1]).all(1).mean()
        assert m["degenerate_frac"] == pytest.approx(degenerate)
        assert m["reward_mean"] == pytest.approx(rewards.mean())
        if arm.endswith("rcgrpo"):  # stratified: both tokens in every group
            assert ((tokens == 1).any(1) & (tokens == 0).any(1)).all()
        else:
            assert (tokens == -1).all()
    assert "eval_success" in metrics[-1] and 0.0 <= metrics[-1]["eval_success"] <= 1.0
    assert (root / "export" / "config.json").exists() and (root / "dynamics.png").exists()


def test_experiment_summary_and_table(run_all):
    config, summary = run_all
    root = Path(config.workdir)
    on_disk = json.loads((root / "summary.json").read_text())
    assert on_disk["arms"].keys() == {"base", "sft", "rctp", "sft_grpo", "rctp_rcgrpo", "rctp_grpo"}
    assert (root / "table.txt").read_text().strip() == experiment.format_table(on_disk).strip()
    assert (root / "dynamics.png").stat().st_size > 0
    for name in ("sft_grpo", "rctp_rcgrpo", "rctp_grpo"):
        rows = read_jsonl(root / name / "metrics.jsonl")
        assert on_disk["arms"][name]["degenerate_frac"] == pytest.approx(
            np.mean([r["degenerate_frac"] for r in rows])
        )


def test_rl_resume_is_exact(run_all, tmp_path):
    """1 iteration, stop, resume to 2 == 2 iterations in one go (params and rewards)."""
    config, _ = run_all
    root = Path(config.workdir)
    init = str(root / "rctp" / "export")

    def arm(workdir, steps):
        c = experiment._sub(config, "rcgrpo", "x", init_from=init, steps=steps, eval_every=0)
        c.workdir = str(workdir)
        return rl_loop.run(c)

    arm(tmp_path / "once", 2)
    arm(tmp_path / "resumed", 1)
    arm(tmp_path / "resumed", 2)
    a = read_jsonl(tmp_path / "once" / "rollouts.jsonl")
    b = read_jsonl(tmp_path / "resumed" / "rollouts.jsonl")
    assert [r["rewards"] for r in a] == [r["rewards"] for r in b]
    _, pa = models.load_hf(tmp_path / "once" / "export")
    _, pb = models.load_hf(tmp_path / "resumed" / "export")
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
