"""Rollouts cut at `rl.max_len`, through the real `collect`: a tiny random model on synthetic tasks
of one and of three turns (the random model never calls a tool, so each turn is one assistant
message and a three-turn trajectory is long).

The same rollout at a large max_len is the reference: each row draws from its own random stream
(seed x row x token index), so at a small max_len a row is that reference row, cut or whole. A
row is cut (`Rollouts.stats["truncated"]` counts it) exactly when it is shorter than its
reference row; no row holds a token past max_len; each row's reward is what a fresh episode of
the environment scores for the messages decoded from the row's own sampled tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import mask_runs, tiny_model_config

from rcgrpo_jax import envs, models
from rcgrpo_jax.envs import prompts, tiny_tokenizer
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
from rcgrpo_jax.rl.rollout import RolloutSettings, collect

G, MAX_NEW = 2, 8
TOKENS = np.array([[HIGH, LOW]] * 2, np.int32)  # [P = 2, G]: a one-turn and a three-turn task


@dataclasses.dataclass(frozen=True)
class Setup:
    env: object
    entries: list
    tokenizer: object
    cfg: models.ModelConfig
    params: object
    whole: object  # the rollout at a max_len no row reaches


def rollout(s: Setup, max_len: int):
    settings = RolloutSettings(
        chat_format="python", max_new_tokens=MAX_NEW, max_len=max_len, temperature=1.0,
        max_steps_per_turn=2,
    )  # fmt: skip
    return collect(s.cfg, s.params, s.tokenizer, s.env, s.entries, TOKENS, settings, seed=5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    env = envs.get("synthetic")(num_train=16, num_test=1, difficulty={"turns": (1, 3)})
    tasks = env.tasks("train")
    entries = [next(t for t in tasks if t.num_turns == n) for n in (1, 3)]
    tokenizer = tiny_tokenizer.load_or_train(tmp_path_factory.mktemp("tok"), tasks)
    cfg = tiny_model_config(vocab_size=len(tokenizer))
    params = models.init_params(cfg, jax.random.key(0))
    s = Setup(env, entries, tokenizer, cfg, params, None)
    whole = rollout(s, 1024)
    assert whole.stats["truncated"] == 0 and whole.tokens.shape[-1] < 1024 - MAX_NEW
    return dataclasses.replace(s, whole=whole)


def last_message_start(s: Setup, row: tuple[int, int]) -> int:
    """Where a reference row's last sampled message starts."""
    return mask_runs(s.whole.loss_mask[row])[-1][0]


def replayed(s: Setup, ro, i: int, j: int):
    """(assistant texts, RewardResult) of a fresh episode of row (i, j)'s task and token, stepped
    with the messages decoded from the row's sampled tokens (the stop token dropped)."""
    stops = set(prompts.stop_ids(s.tokenizer))
    episode = s.env.episode(
        s.entries[i], envs.EpisodeSettings("python", max_steps_per_turn=2), int(TOKENS[i, j])
    )
    texts = []
    for a, b in mask_runs(ro.loss_mask[i, j]):
        ids = ro.tokens[i, j, a:b].tolist()
        texts.append(s.tokenizer.decode(ids[:-1] if ids[-1] in stops else ids))
        if not episode.done:
            episode.step(texts[-1])
    return texts, episode.result()


def check_cut_at(s: Setup, max_len: int) -> tuple[int, int]:
    """The properties at `max_len`; returns (rows cut, rows counted truncated)."""
    ro = rollout(s, max_len)
    whole, length = s.whole, ro.segments.sum(-1)
    assert ro.tokens.shape[-1] <= max_len and (length <= max_len).all(), length
    cut = 0
    for i, j in np.ndindex(*TOKENS.shape):
        n = int(length[i, j])
        assert (ro.segments[i, j, :n] == 1).all() and not ro.segments[i, j, n:].any()
        for key in ("tokens", "loss_mask"):  # the reference row, maybe cut
            np.testing.assert_array_equal(getattr(ro, key)[i, j, :n], getattr(whole, key)[i, j, :n])
        np.testing.assert_allclose(
            ro.old_logprobs[i, j, :n], whole.old_logprobs[i, j, :n], rtol=1e-5, atol=1e-5
        )
        cut += n < whole.segments[i, j].sum()
        texts, result = replayed(s, ro, i, j)
        episode = ro.episodes[i * G + j]
        assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == texts
        assert ro.results[i][j] == result and ro.rewards[i, j] == result.reward
    print(f"max_len {max_len}: lengths {length.tolist()} of {whole.segments.sum(-1).tolist()}")
    print(f"  {cut} rows cut, {ro.stats['truncated']:.0f} counted; rewards {ro.results}")
    return cut, int(ro.stats["truncated"])


def test_rows_cut_before_their_last_message_are_counted(setup):
    """max_len 3 past the one-turn task's longest row: those rows fit whole; the three-turn
    rows are cut before their last message (no room for a turn's next message or the one
    after it), each counted."""
    one, three = setup.whole.segments.sum(-1)
    max_len = int(one.max()) + 3
    assert max_len <= min(last_message_start(setup, (1, j)) for j in range(G)) + 2
    assert check_cut_at(setup, max_len) == (G, G)


def test_a_row_cut_in_its_last_message_is_counted(setup):
    """max_len leaves 4 of a three-turn row's 8 new tokens for its last message: the message
    is cut, the episode ends on it, and the row is shorter than its reference: truncated."""
    row = (1, 0)
    max_len = last_message_start(setup, row) + 2 + 4
    if mask_runs(setup.whole.loss_mask[row])[-1][1] - last_message_start(setup, row) <= 4:
        raise RuntimeError("the reference row's last message fits in 4 tokens: not cut")
    cut, counted = check_cut_at(setup, max_len)
    assert cut >= 1 and counted == cut, (cut, counted)
