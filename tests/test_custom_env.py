"""A user's own environment, registered from its own file (examples/calculator_env.py, the
walkthrough of docs/custom_env.md): its verdicts, its eval summary, stage 1's refusal, and one
`grpo` iteration on it through the command line with nothing changed outside that file."""

from __future__ import annotations

import importlib.util

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
def test_stage_1_refuses_an_environment_without_golden_trajectories(
    calculator, tmp_path, monkeypatch, stage
):
    """One line before any work: no workdir, no mesh, no model."""
    from rcgrpo_jax.stages import all as experiment
    from rcgrpo_jax.stages import setup, sft

    def built(*args, **kwargs):
        raise AssertionError("the stage built something before refusing")

    monkeypatch.setattr(setup, "mesh_from_config", built)
    monkeypatch.setattr(setup, "tokenizer_from_config", built)
    workdir = tmp_path / "run"
    run = experiment.run if stage == "all" else sft.run
    with pytest.raises(UserError) as e:
        run(calculator_config(workdir, stage))
    message, start = str(e.value), "env.benchmark='calculator' has no golden trajectories: stage"
    assert message.startswith(f"{start} {stage} needs them")
    assert "bfcl and synthetic" in message and "rl.init_from" in message and "\n" not in message
    assert not workdir.exists()


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
