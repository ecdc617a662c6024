"""A user's own environment, registered from its own file (examples/calculator_env.py, the
walkthrough of docs/custom_env.md): its verdicts, and one `grpo` iteration on it through the
command line with nothing changed outside that file."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import REPO
from test_stages import OVERRIDES, main

from rcgrpo_jax import envs
from rcgrpo_jax.envs.calls import format_call, parse_call
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


def test_grpo_trains_the_calculator_for_one_iteration(calculator, tmp_path):
    extra = {
        "stage": "grpo",
        "env.module": "examples.calculator_env",
        "env.benchmark": "calculator",
        "rl.steps": 1,
        "rl.eval_every": 1,
    }
    main(tmp_path, **extra)
    (metrics,) = read_jsonl(tmp_path / "metrics.jsonl")
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
