"""A user's own environment, registered from its own file (examples/calculator_env.py, the
walkthrough of docs/custom_env.md): its verdicts, its eval summary, stage 1's data from its
demonstrations and rollouts labelled by its verdicts (and the refusal when it has neither), one
`grpo` iteration and a shortened stage `all` (configs/calculator.py) on it through the command
line, with nothing changed outside that file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
from conftest import REPO
from test_stages import OVERRIDES, main

from rcgrpo_jax import config as config_lib
from rcgrpo_jax import envs
from rcgrpo_jax.envs.calls import format_call, parse_call
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.train.metrics import read_jsonl

FILE = REPO / "examples" / "calculator_env.py"


@pytest.fixture(scope="module")
def calculator():
    """The example module, imported by path (its import registers "calculator")."""
    spec = importlib.util.spec_from_file_location("calculator_env", FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def play(env, task, *texts: str):
    episode = env.episode(task, envs.EpisodeSettings(chat_format="python"), reward_token=1)
    for text in texts:
        if episode.done:
            break
        episode.step(text)
    return episode


def test_the_calculator_scores_what_the_tool_returned(calculator):
    env = envs.get("calculator")(num_train=8, num_test=2, seed=3)
    assert isinstance(env, calculator.Calculator)
    assert [t.id for t in env.tasks("test")] == ["calculator_test_0", "calculator_test_1"]
    for task in env.tasks("train"):
        op, args = task.truth.split("(", 1)
        a, b = (int(v.split("=")[1]) for v in args.rstrip(")").split(", "))
        answer = {"add": a + b, "subtract": a - b, "multiply": a * b}[op]
        right = play(env, task, f"[{op}(a={a}, b={b})]", "The answer is above.")
        assert right.result().reward == 1.0 and right.done
        assert right.messages[0]["content"].startswith("<|high_reward|>")
        tool = {"role": "tool", "name": op, "content": f'{{"result": {answer}}}'}
        assert right.messages[3] == tool  # what MathAPI itself returned
        assert right.decoded == [[[format_call(parse_call(task.truth))]]]  # as parsed
        wrong = play(env, task, f"[add(a={answer}, b=1)]", "done").result()
        assert (wrong.reward, wrong.error_type) == (0.0, "calculator:wrong_result")
    task = env.tasks("train")[0]
    for text, error in [
        ("[add(a=3", "calculator:no_call"),  # unparsable: no call, the episode ends
        ("[power(base=2, exponent=3)]", "calculator:call_error"),  # a MathAPI method not allowed
        ("[__import__(name='os')]", "calculator:call_error"),
        ("[add(a=open('/etc/passwd'), b=1)]", "calculator:call_error"),  # not a literal
    ]:
        result = play(env, task, text, "done").result()
        assert (result.reward, result.error_type) == (0.0, error), text


def calculator_config(workdir, stage: str):
    c = config_lib.base_config()
    c.workdir, c.stage, c.env.benchmark = str(workdir), stage, "calculator"
    c.model.chat_format = "python"
    return c


def test_eval_counts_the_calculators_own_error_types(calculator, tmp_path):
    from rcgrpo_jax.stages import eval as eval_stage

    config = calculator_config(tmp_path, "eval")
    config.eval.policy, config.eval.max_entries = "empty", 3
    summary = eval_stage.run(config)
    errors = summary["categories"]["calculator"]["errors"]
    assert list(errors.items()) == [
        ("calculator:no_call", 3), ("calculator:call_error", 0), ("calculator:wrong_result", 0),
    ]  # fmt: skip
    table = (tmp_path / "eval" / "test-empty" / "table.txt").read_text().splitlines()
    assert table[0].startswith("calculator | split=test policy=empty") and "BFCL" not in table[0]
    assert table[1].split()[-3:] == ["no_call", "call_error", "wrong_result"]


@pytest.mark.parametrize("stage", ["sft", "rctp", "all"])
def test_stage_1_refuses_an_environment_that_gives_it_no_data(
    calculator, tmp_path, monkeypatch, stage
):
    """Without demonstrations and without rollouts (or, for `all`'s warm start, without
    demonstrations) stage 1 has nothing to learn from: one line before any work (no workdir,
    no mesh, no model)."""
    from rcgrpo_jax.stages import all as experiment
    from rcgrpo_jax.stages import setup, sft

    def built(*args, **kwargs):
        raise AssertionError("the stage built something before refusing")

    monkeypatch.delattr(calculator.Calculator, "demonstration")
    monkeypatch.setattr(setup, "mesh_from_config", built)
    monkeypatch.setattr(setup, "tokenizer_from_config", built)
    workdir = tmp_path / "run"
    run = experiment.run if stage == "all" else sft.run
    config = calculator_config(workdir, stage)
    config.train.warm_start_steps = 5
    with pytest.raises(UserError) as e:
        run(config)
    message = str(e.value)
    if stage == "all":
        start = "env.benchmark='calculator' has no demonstration(task): stage all's warm start"
    else:
        start = f"env.benchmark='calculator' gives stage {stage} no data: it has no demonstration"
    assert message.startswith(start) and "\n" not in message, message
    assert not workdir.exists()
    if stage != "all":  # rollouts of the starting policy are data enough
        config.rctp.rollouts_per_entry = 1
        setup.require_stage1_sources(config, demonstrations=False)


def replay(env, task_id: str, decoded) -> float:
    """The calculator's verdict on a stored trajectory: its decoded calls replayed, step by step,
    through a fresh episode of its task."""
    (task,) = [t for t in env.tasks("train") if t.id == task_id]
    texts = ["[" + ", ".join(step) + "]" for step in decoded[0]]
    return play(env, task, *texts, "done").result().reward


def stand_in_rollouts(env, texts):
    """`rollouts` for `protocol_sources` without a model: each task played once per text."""
    from collections import Counter

    from rcgrpo_jax.data import trajectories as T

    def rollouts(tasks):
        out = []
        for task in tasks:
            for text in texts(task):
                e = play(env, task, text)
                episode = T.RecordedEpisode(task, e.messages, e.tools, e.decoded)
                out.append(T.Trajectory(T.ROLLOUT, episode, e.result()))
        return out, Counter()

    return rollouts


def test_protocol_data_are_labelled_by_the_environments_verdict(calculator, tmp_path):
    """Stage 1's data on an environment with only the protocol: its demonstrations and the
    (here: stand-in) rollouts, each stored with the label the environment gave it, counted per
    label, and refused in one line when a label has fewer than `min_per_label` examples."""
    from test_rctp_data import CharTokenizer, records

    from rcgrpo_jax.data import trajectories as T

    env = calculator.Calculator(num_train=6, num_test=1, seed=1)
    wrong = "[add(a=100000, b=1)]"  # above any task's answer (operands up to 99)
    right_and_wrong = lambda task: [f"[{task.truth}]", "no call", wrong]
    settings = T.DataSettings(chat_format="python", max_steps_per_turn=1, min_per_label=6)
    sources = T.protocol_sources(env, settings, stand_in_rollouts(env, right_and_wrong))
    tasks = env.tasks("train")
    report = T.build_rctp_dataset(settings, CharTokenizer(), tasks, tmp_path, sources=sources)
    assert report["pool"]["train"] == {"demonstration": {0: 0, 1: 6}, "rollout": {0: 12, 1: 6}}
    assert report["labels"]["train"] == {0: 12, 1: 12}  # low_per_high 1: every label-0 one
    stored = records(report["dataset_dir"])
    assert len(stored) == 24
    for rec in stored:
        meta = json.loads(rec["meta"])
        assert replay(env, rec["entry_id"], meta["decoded"]) == rec["label"] == meta["reward"]
        assert rec["reward_token"] == report["reward_tokens"][rec["label"]]
    # plain SFT keeps label 1 only (the rollouts' successes: rejection sampling)
    sft = dataclasses.replace(settings, enabled=False)
    sft_report = T.build_rctp_dataset(
        sft, CharTokenizer(), tasks, tmp_path / "sft", sources=sources
    )
    assert sft_report["labels"]["train"] == {0: 0, 1: 12}
    # too few label-0 examples: one line with the counts
    only_right = T.protocol_sources(
        env, settings, stand_in_rollouts(env, lambda t: [f"[{t.truth}]"])
    )
    with pytest.raises(T.TooFewExamples) as e:
        T.build_rctp_dataset(settings, CharTokenizer(), tasks, tmp_path / "x", sources=only_right)
    message = str(e.value)
    assert (
        message.startswith(
            "stage-1 data (rctp) has 0 label-0 (<|low_reward|>) training examples < "
            "rctp.min_per_label=6"
        )
        and "\n" not in message
    ), message
    assert not (tmp_path / "x").exists()


CALCULATOR_ALL = {
    "env.calculator.num_train": 12,
    "env.calculator.num_test": 4,
    "train.warm_start_steps": 2,
    "train.steps": 2,
    "rctp.train_steps": 2,
    "rctp.min_per_label": 1,
    "rl.steps": 1,
    "rl.max_rollouts": 0,
    "rl.eval_points": 1,
    "rl.max_len": 128,
    "eval.max_len": 128,
    "arms": "('sft_grpo','rctp_rcgrpo')",
    "controls": "()",
    "eval.samples": 0,
}


def test_stage_all_runs_the_whole_method_on_the_calculator(calculator, tmp_path):
    """configs/calculator.py shrunk to seconds: warm start on the demonstrations, SFT and RCTP
    on demonstrations + the warm start's rollouts labelled by the calculator's verdicts, then
    both RL arms."""
    from test_rctp_data import records

    main(tmp_path, config="configs/calculator.py", **CALCULATOR_ALL)
    env = calculator.Calculator(num_train=12, num_test=4)
    reports = {
        stage: json.loads((tmp_path / stage / "data_report.json").read_text())
        for stage in ("warm_start", "sft", "rctp")
    }
    # the warm start: the demonstrations alone
    assert reports["warm_start"]["pool"]["train"] == {"demonstration": {"0": 0, "1": 12}}
    for stage in ("sft", "rctp"):  # both continue on its own rollouts (one per task)
        pool = reports[stage]["pool"]["train"]
        assert pool["demonstration"] == {"0": 0, "1": 12}
        assert sum(pool["rollout"].values()) == 12
        labels = reports[stage]["labels"]["train"]
        assert labels["1"] == 12 + pool["rollout"]["1"]  # demonstrations + successes
        assert labels["0"] == (0 if stage == "sft" else min(pool["rollout"]["0"], labels["1"]))
        stored = records(reports[stage]["dataset_dir"])
        assert sum(labels.values()) == len(stored)
        for rec in stored:  # every label is the calculator's own verdict on the trajectory
            meta = json.loads(rec["meta"])
            assert replay(env, rec["entry_id"], meta["decoded"]) == rec["label"]
    assert pool["rollout"] == reports["sft"]["pool"]["train"]["rollout"]  # the same rollouts
    summary = json.loads((tmp_path / "summary.json").read_text())
    arms = summary["arms"]
    assert list(arms) == ["base", "warm_start", "sft", "rctp", "sft_grpo", "rctp_rcgrpo"]
    for arm in ("sft_grpo", "rctp_rcgrpo"):
        assert (
            arms[arm]["generated_rollouts"]
            == OVERRIDES["rl.num_prompts"] * OVERRIDES["rl.group_size"]
        )
    assert 0.0 <= arms["rctp"]["success_high"] <= 1.0 and 0.0 <= arms["rctp"]["success_low"] <= 1
    assert (tmp_path / "table.txt").read_text().startswith("arm ")


def test_grpo_trains_the_calculator_for_one_iteration(calculator, tmp_path):
    extra = {
        "stage": "grpo",
        "env.module": "examples.calculator_env",
        "env.benchmark": "calculator",
        "rl.prompt_split": "train",  # the demo's rl split exists only in the synthetic env
        "rl.steps": 1,
        "rl.eval_every": 1,
    }
    main(tmp_path, **extra)
    start, metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert start["step"] == 0 and 0.0 <= start["eval_success"] <= 1.0  # the start, evaluated
    (rollouts,) = read_jsonl(tmp_path / "rollouts.jsonl")
    assert metrics["step"] == rollouts["iteration"] == 1
    rewards = np.asarray(rollouts["rewards"])
    assert rewards.shape == (OVERRIDES["rl.num_prompts"], OVERRIDES["rl.group_size"])
    assert set(rewards.ravel()) <= {0.0, 1.0}
    assert metrics["reward_mean"] == pytest.approx(rewards.mean())
    assert 0.0 <= metrics["eval_success"] <= 1.0 and metrics["env_errors"] == 0
    train_ids = {t.id for t in calculator.Calculator().tasks("train")}
    assert set(rollouts["entry_ids"]) <= train_ids
    # the tokenizer was trained on the calculator's corpus: its system prompt is long pieces
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tokenizer"))
    assert len(tok.encode(calculator.SYSTEM, add_special_tokens=False)) < len(calculator.SYSTEM) / 5
