"""The environment loop: turns, tool messages, step limit, miss_func reveal, isolation."""

from __future__ import annotations

import copy
import json

import pytest
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

from rcgrpo_jax.envs import bfcl, prompts
from rcgrpo_jax.envs.calls import bind_positional, format_call, parse_call
from rcgrpo_jax.envs.executor import (
    ERROR_PREFIX,
    load_instances,
    parameter_names,
    public_state,
)
from rcgrpo_jax.envs.reward import EMPTY_TURN, FORCE_TERMINATED


def entry_by_id(entry_id):
    category = entry_id.rsplit("_", 1)[0]
    return next(e for e in bfcl.load_entries(category) if e.id == entry_id)


@pytest.mark.parametrize("fmt", ["python", "qwen", "llama"])
def test_ground_truth_policy_scores_100_on_test_split(fmt):
    episodes = [
        bfcl.Episode(e, fmt) for c in bfcl.CATEGORIES for e in bfcl.split_entries("test", c)
    ]
    bfcl.run_episodes(episodes, bfcl.ground_truth)
    assert all(e.done and not e.force_quit for e in episodes)
    results = [e.result() for e in episodes]
    assert [r.reward for r in results] == [1.0] * 80
    # The recorded trajectory is the ground truth (arguments named), one step per turn.
    for e in episodes:
        assert [len(s) for s in e.decoded] == [1 if t else 0 for t in e.entry.ground_truth]
        recorded = [named(e.entry, c) for steps in e.decoded for step in steps for c in step]
        assert recorded == [named(e.entry, c) for t in e.entry.ground_truth for c in t]


def named(entry, call_text):
    call = parse_call(call_text)
    return bind_positional(call, parameter_names(entry.involved_classes, call.name))


def test_turn_loop_messages():
    entry = entry_by_id("multi_turn_base_0")
    episode = bfcl.Episode(entry, "qwen", reward_token=1)
    assert [m["role"] for m in episode.messages] == ["system", "user"]
    assert episode.messages[0]["content"].startswith(prompts.REWARD_TOKENS[1])
    assert episode.tools and all(t["type"] == "function" for t in episode.tools)
    step = episode.step(bfcl.ground_truth([episode])[0])
    assert not step.done
    assert [m["role"] for m in step.messages] == ["tool"] * 3
    assert [m["name"] for m in step.messages] == ["cd", "mkdir", "mv"]
    assert json.loads(step.messages[0]["content"]) == {"current_working_directory": "document"}
    step = episode.step("All done.")  # no call: the turn ends, the next user message follows
    assert step.messages == entry.question[1] and episode.turn == 1
    assert episode.messages[-1] == entry.question[1][0]
    assert episode.decoded == [[[format_call(parse_call(c)) for c in entry.ground_truth[0]]], []]
    roles = [m["role"] for m in episode.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "tool", "assistant", "user"]
    while not episode.done:
        episode.step("Nothing to do.")
    r = episode.result()
    assert (r.reward, r.error_type, r.error_turn) == (0.0, EMPTY_TURN, 1)
    with pytest.raises(RuntimeError):
        episode.step("more")


def test_step_limit_force_quits_like_bfcl():
    entry = entry_by_id("multi_turn_base_0")
    episode = bfcl.Episode(entry, "python", max_steps_per_turn=20)
    steps = 0
    while not episode.done:
        episode.step("[pwd()]")
        steps += 1
    assert steps == 21 and episode.force_quit  # bfcl-eval: count > MAXIMUM_STEP_LIMIT quits
    assert len(episode.decoded) == 1 < entry.num_turns
    assert episode.result().error_type == FORCE_TERMINATED


def test_step_limit_in_last_turn_is_scored_normally():
    """bfcl-eval keeps the turn count when it force-quits in the last turn, so it is scored."""
    entry = entry_by_id("multi_turn_base_0")
    episode = bfcl.Episode(entry, "python", max_steps_per_turn=3)
    while episode.turn < entry.num_turns - 1:
        episode.step(bfcl.ground_truth([episode])[0])
    for _ in range(4):
        episode.step(bfcl.ground_truth([episode])[0] if episode.steps_in_turn == 0 else "[pwd()]")
    assert episode.done and episode.force_quit
    assert len(episode.decoded) == entry.num_turns
    assert episode.result().reward == 1.0


def test_miss_func_reveal_turn():
    entry = entry_by_id("multi_turn_miss_func_0")
    ((reveal, (name,)),) = entry.missed_function.items()
    episode = bfcl.Episode(entry, "qwen")
    assert name not in {t["function"]["name"] for t in episode.tools}
    # Before its turn the hidden function is an unknown name.
    step = episode.step(
        f'<tool_call>{{"name": "{name}", "arguments": {{"file_name": "x"}}}}</tool_call>'
    )
    assert step.messages[0]["content"] == f"{ERROR_PREFIX}name '{name}' is not defined"
    while episode.turn < reveal:
        episode.step("No call.")
    reveal_message = episode.messages[-1]
    assert reveal_message["role"] == "user"
    assert reveal_message["content"].endswith(prompts.ADDED_FUNCTIONS_PROMPT)
    listed = json.loads(reveal_message["content"].split("\n", 1)[0])
    assert [t["function"]["name"] for t in listed] == [name]
    step = episode.step(
        f'<tool_call>{{"name": "{name}", "arguments": {{"file_name": "x"}}}}</tool_call>'
    )
    assert not step.messages[0]["content"].endswith("is not defined")
    # bfcl-eval's behaviour (everything callable) is one flag away.
    open_episode = bfcl.Episode(entry, "python", hide_missed=False)
    step = open_episode.step(f"[{name}(file_name='x')]")
    assert "is not defined" not in step.messages[0]["content"]


def test_episodes_do_not_share_or_leak_state():
    """Long-context TravelAPI puts module-level cards into its state: a booking with such a card
    must change only this episode's copy."""
    entry = entry_by_id("multi_turn_long_context_151")
    card = next(iter(long_context.CREDIT_CARD_EXTENSION))
    snapshot = copy.deepcopy(long_context.CREDIT_CARD_EXTENSION)
    (fresh,) = load_instances(entry.initial_config, entry.involved_classes, True)
    before = copy.deepcopy(public_state(fresh["TravelAPI"]))
    assert before["credit_card_list"][card]["balance"] == snapshot[card]["balance"]

    episode = bfcl.Episode(entry, "python")
    book = (
        f"[book_flight(access_token='abc123xyz', card_id='{card}', travel_date='2026-11-10', "
        "travel_from='SFO', travel_to='LAX', travel_class='economy')]"
    )
    result = episode.step(book).messages[0]["content"]
    assert "booking_id" in result
    balance = episode._instances["TravelAPI"].credit_card_list[card]["balance"]
    assert balance < snapshot[card]["balance"]
    assert long_context.CREDIT_CARD_EXTENSION == snapshot  # module untouched
    (again,) = load_instances(entry.initial_config, entry.involved_classes, True)
    assert public_state(again["TravelAPI"]) == before  # the next trajectory starts clean
    other = bfcl.Episode(entry, "python")
    assert (
        other._instances["TravelAPI"].credit_card_list[card]["balance"] == snapshot[card]["balance"]
    )


def test_reward_token_relabel():
    entry = entry_by_id("multi_turn_base_3")
    episode = bfcl.Episode(entry, "qwen", reward_token=0)
    bfcl.run_episodes([episode], bfcl.ground_truth)
    high = bfcl.set_reward_token(episode.messages, 1)
    assert high[0]["content"] == prompts.REWARD_TOKENS[1] + prompts.SYSTEM_PROMPT_FC
    assert high[1:] == episode.messages[1:]
    assert bfcl.set_reward_token(high, None)[0]["content"] == prompts.SYSTEM_PROMPT_FC
    assert episode.messages[0]["content"].startswith(prompts.REWARD_TOKENS[0])  # not mutated
