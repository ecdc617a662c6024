"""The run report's records of an RL stage: trajectories.jsonl and heldout.jsonl.

One RC-GRPO stage with dynamic sampling (`stages.rl.run` in this process, configs/tiny.py shrunk
to a 1-layer random model, 2 prompts x 2 rollouts, up to 2 rounds per iteration, evaluated on 4
held-out tasks at the start, at budget points and at the end, one rollout per task at
eval.temperature 1 and, at the start and the end, 2 more samples per task), run for 1
iteration, then resumed to 2 as a run killed after writing part of iteration 2's records
would be. A random model never solves a task, so every episode is scored
by `parity` (the parity of its assistant text's length): groups are mixed or not, dynamic
sampling keeps some and drops others, and held-out tasks pass and fail.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import shipped_config

from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.reward import RewardResult
from rcgrpo_jax.envs.reward_tokens import REWARD_TOKENS
from rcgrpo_jax.stages import eval as eval_stage
from rcgrpo_jax.stages import rl as loop
from rcgrpo_jax.stages import rl_report
from rcgrpo_jax.train.metrics import read_jsonl

P, G = 2, 2
TOKENS = {"high": REWARD_TOKENS[1], "low": REWARD_TOKENS[0]}


def parity(episode: Episode) -> RewardResult:
    """1 where the assistant's texts have an even length in all, else 0 (a function of the
    trajectory alone)."""
    text = "".join(m["content"] for m in episode.messages if m["role"] == "assistant")
    reward = float(len(text) % 2 == 0)
    return RewardResult(reward, bool(reward), bool(reward), None if reward else "parity:odd")


def small_config(workdir, steps: int, report_groups: int):
    c = shipped_config("tiny")
    c.stage = "rcgrpo"
    c.workdir = str(workdir)
    c.env.synthetic.num_train = c.env.synthetic.num_rl = 40
    c.env.synthetic.num_test = 4
    c.model.arch.num_layers = 1
    c.rl.steps = steps
    c.rl.num_prompts, c.rl.group_size = P, G
    c.rl.dynamic_sampling, c.rl.dynamic_max_rounds = True, 2
    c.rl.max_rollouts = 16  # 2 iterations of 2 rounds: rl.steps ends the first run
    c.rl.epochs = c.rl.minibatches = 1
    c.rl.max_new_tokens = 8
    c.rl.eval_every, c.rl.eval_points = 0, 2  # the start, 8 and 16 trajectories, the end
    c.rl.checkpoint_every = 1
    c.eval.max_entries, c.eval.max_new_tokens, c.eval.samples = 4, 8, 2
    c.eval.temperature = 1.0  # the random model's greedy text is the same for every task
    c.logging.report_groups = report_groups
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run (iteration 1 keeping every group, iteration 2 one), each call of
    `trajectory_records` it made, and the records it left."""
    workdir = tmp_path_factory.mktemp("run")
    calls = []
    original = rl_report.trajectory_records

    def spy(*args):
        calls.append(args)
        return original(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Episode, "result", parity)
        mp.setattr(eval_stage, "_MEASURED", {})  # no measurement of another test's rewards
        mp.setattr(rl_report, "trajectory_records", spy)
        loop.run(small_config(workdir, 1, -1))
        # what a run killed after its checkpoint of iteration 1, while writing iteration 2's
        # records, leaves: iteration 2's lines, the last one torn
        for name in ("trajectories.jsonl", "heldout.jsonl"):
            with open(workdir / name, "a") as f:
                f.write(json.dumps({"iteration": 2, "stale": True}) + '\n{"iteration": 2, ')
        loop.run(small_config(workdir, 2, 1))
    names = ("metrics", "rollouts", "trajectories", "heldout")
    return workdir, calls, {n: read_jsonl(workdir / f"{n}.jsonl") for n in names}


def test_trajectories_are_the_rollouts_groups(run):
    """Per iteration, the lines are rollouts.jsonl's groups in order (entries, reward tokens,
    rewards, environment errors, trained), their round and whether dynamic sampling dropped
    them; a resumed run rewrote the killed run's lines of iteration 2."""
    _, _, logs = run
    lines, rollouts = logs["trajectories"], logs["rollouts"]
    assert not any("stale" in line for line in lines)
    assert [r["iteration"] for r in rollouts] == [1, 2]
    for r in rollouts:
        mine = [line for line in lines if line["iteration"] == r["iteration"]]
        n = len(r["entry_ids"])
        assert [line["group"] for line in mine] == list(range(len(mine)))
        for i, line in enumerate(mine):
            assert line["groups_in_iteration"] == n and line["task_id"] == r["entry_ids"][i]
            assert line["trained"] == r["trained"][i]
            rows = line["rows"]
            assert [x["reward"] for x in rows] == r["rewards"][i]
            assert [x["env_error"] for x in rows] == r["env_errors"][i]
            names = {1: "high", 0: "low", -1: "none"}
            assert [x["reward_token"] for x in rows] == [names[t] for t in r["reward_token"][i]]
            degenerate = len(set(r["rewards"][i])) == 1
            assert line["dropped"] == degenerate and not (line["dropped"] and line["trained"])
            assert line["round"] == i // P  # every round draws P groups (the budget cuts none)


def test_report_groups_bounds_the_groups_kept(run):
    """Iteration 1 (report_groups -1) keeps every group, iteration 2 (1) the first only; any
    count keeps the first ones in generation order, those of all."""
    _, calls, logs = run
    lines = logs["trajectories"]
    n = {r["iteration"]: len(r["entry_ids"]) for r in logs["rollouts"]}
    assert n[1] > 1 and n[2] > 1  # the bound leaves groups out
    assert sum(line["iteration"] == 1 for line in lines) == n[1]
    assert sum(line["iteration"] == 2 for line in lines) == 1
    # the calls' own arguments again: k groups are the first k of all of them
    iteration, generated, update, _ = calls[0]
    every = rl_report.trajectory_records(iteration, generated, update, -1)
    assert every == [line for line in lines if line["iteration"] == 1]
    for k in (0, 1, n[1], n[1] + 3):
        assert rl_report.trajectory_records(iteration, generated, update, k) == every[:k]


def np_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO's per-group (r - mean) / (std + eps), 0 in a group of equal rewards."""
    same = (rewards == rewards[:, :1]).all(1, keepdims=True)
    mu, sd = rewards.mean(1, keepdims=True), rewards.std(1, keepdims=True)
    return np.where(same, 0.0, (rewards - mu) / (sd + eps))


def test_advantages_are_the_estimators_of_the_trained_groups(run):
    _, _, logs = run
    trained = 0
    for line in logs["trajectories"]:
        rewards = np.asarray([[x["reward"] for x in line["rows"]]], np.float64)
        got = np.asarray([x["advantage"] for x in line["rows"]])
        want = np_advantages(rewards)[0] if line["trained"] else np.zeros(G)
        np.testing.assert_allclose(got, want, atol=1e-5)
        trained += line["trained"] and bool(np.any(got != 0))
    assert trained  # some group was trained on, with advantages not 0


def test_every_row_holds_its_conversation_under_its_token(run):
    """A row's conversation opens with the system message carrying its reward token, then
    the user's turn and the assistant's sampled text; its verdicts are its reward's."""
    _, _, logs = run
    for line in logs["trajectories"]:
        for row in line["rows"]:
            messages = row["messages"]
            assert [m["role"] for m in messages[:3]] == ["system", "user", "assistant"]
            assert messages[0]["content"].startswith(TOKENS[row["reward_token"]])
            assert row["state_ok"] == row["action_ok"] == (row["reward"] == 1.0)
            assert row["truncated"] is False and row["env_error"] is None


def test_heldout_lines_are_the_logged_evaluations(run):
    """One line per evaluation (the start, each budget point, the end), the resumed run's
    iteration 2 once; its tasks' successes average to the logged eval_success (the one rollout
    per task behind it, also where the sampled measurement ran), each under the arm's token."""
    _, _, logs = run
    evals = {m["step"]: m for m in logs["metrics"] if "eval_success" in m}
    lines = logs["heldout"]
    assert [line["iteration"] for line in lines] == sorted(evals) == [0, 1, 2]
    assert "eval_sampled" in evals[0] and "eval_sampled" in evals[2]
    for line in lines:
        m = evals[line["iteration"]]
        assert line["trajectories"] == m["rollouts"] and line["token"] == "high"
        assert line["success"] == m["eval_success"]
        tasks = line["tasks"]
        assert len(tasks) == 4 and len({t["task_id"] for t in tasks}) == 4
        assert np.mean([t["success"] for t in tasks]) == pytest.approx(m["eval_success"])
        for t in tasks:
            assert t["messages"][0]["content"].startswith(TOKENS["high"])
            assert t["error_type"] == (None if t["success"] else "parity:odd")
    outcomes = [t["success"] for line in lines for t in line["tasks"]]
    assert any(outcomes) and not all(outcomes)  # the check above can tell them apart
