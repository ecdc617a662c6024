"""bench/peers.py's own logic (its timings are a benchmark, never a test): the workload as our
environment plays it, and the table that refuses a ratio between runs that did other work."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "peer_runs"))

import peers  # noqa: E402
import workload as w  # noqa: E402
from ours_env import Peers  # noqa: E402

from rcgrpo_jax import envs  # noqa: E402


def play(multi_turn: bool, texts: list[str], max_steps: int) -> tuple[object, list]:
    settings = envs.EpisodeSettings(chat_format="qwen", max_steps_per_turn=max_steps)
    episode = Peers(multi_turn).episode(Peers(multi_turn).tasks("train")[0], settings)
    steps = []
    for text in texts:
        steps.append(episode.step(text))
        if steps[-1].done:
            break
    return episode, steps


def test_multi_turn_is_two_tool_rounds_then_the_answer():
    answer = "Here is a short note about rivers."
    episode, steps = play(True, [w.TOOL_CALL_TEXT, w.TOOL_CALL_TEXT, answer], w.TURNS)
    assert [s.done for s in steps] == [False, False, True]
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert results == [w.tool_result(0), w.tool_result(1)]
    assert episode.tools == [w.TOOL_DOC] and episode.result().reward == w.reward(answer)


def test_the_turn_cap_ends_an_episode_that_keeps_calling():
    _, steps = play(True, [w.TOOL_CALL_TEXT] * 5, w.TURNS)
    assert len(steps) == w.TURNS and steps[-1].done


def test_single_turn_is_one_generation_even_with_a_call():
    episode, steps = play(False, [w.TOOL_CALL_TEXT, "more"], 1)
    assert len(steps) == 1 and steps[0].done and episode.tools is None
    assert not any(m["role"] == "tool" for m in episode.messages)


def test_reward_is_the_share_of_vowels():
    assert w.reward("aab") == 2 / 3 and w.reward("123") == 0.0


def result(system: str, total_s: float, tokens: int) -> dict:
    its = [w.iteration_record(total_s / 2, total_s / 2, tokens, 64, 64, 0.5) for _ in range(3)]
    return {"system": system, "version": "1", "iterations": its}


def test_a_ratio_only_between_runs_of_the_same_work():
    rows = [(name, r, peers.summary(r)) for name, r in (
        ("ours", result("ours", 1.0, 2000)), ("trl", result("TRL", 3.0, 2100)),
        ("tunix", result("Tunix", 2.0, 2500)),
    )]  # fmt: skip
    lines = peers.table(rows)
    assert lines[2].rstrip().endswith("3.00x")  # 5% more tokens: the same work
    assert lines[3].rstrip().endswith("n/a (other work)")  # 25% more: not comparable
