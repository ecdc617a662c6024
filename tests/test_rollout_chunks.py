"""Chunked rollouts (`rl.max_rows`): the P x G rows sampled a chunk at a time, each chunk with its
own KV cache, give the trajectories of one batch: tokens, sampled mask, rewards and checker
results exactly (each row draws from its own random stream, seed x global row x token index,
whatever session it is in), log-probs to f32 rounding (a chunk runs other batch and cache-length
buckets, i.e. other XLA programs, whose reductions round differently: ~1e-7 relative here).
On the tiny demo's model and tokenizer, and on a tiny Qwen2 with the real
Qwen2.5 tokenizer and chat template (skipped without `../shared/tokenizers`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from conftest import shipped_config

from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
from rcgrpo_jax.rl.rollout import RolloutSettings, collect
from rcgrpo_jax.stages import setup

P, G = 2, 3
# [P, G] tokens: both kinds in every group, as RC-GRPO conditions them
TOKENS = np.array([[HIGH, LOW, HIGH]] * P, np.int32)


def tiny_config(workdir, **model):
    c = shipped_config("tiny")
    c.workdir = str(workdir)
    c.mesh.shape = (-1, 1, 1)  # rows sharded over 8 devices: chunks pad to the data axis too
    c.env.synthetic.num_train = 8
    c.env.synthetic.difficulty.turns = (2, 2)  # later user turns: the append path runs
    for k, v in model.items():
        c.model[k] = v
    return c


def rollouts(config, max_rows: int):
    s = setup.with_reward_tokens(setup.start(config))
    env = setup.environment(config)
    entries = list(env.tasks("train"))[:P]
    settings = RolloutSettings(
        chat_format=config.model.chat_format, max_new_tokens=8, max_len=1024,
        temperature=1.0, max_steps_per_turn=2, max_rows=max_rows,
    )  # fmt: skip
    return collect(
        s.cfg, s.params, s.tokenizer, env, entries, TOKENS, settings, seed=3, mesh=s.mesh
    )


def assert_same(a, b) -> None:
    for field in ("tokens", "segments", "loss_mask", "rewards", "reward_token"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.old_logprobs, b.old_logprobs, rtol=1e-6, atol=1e-6)
    assert [dataclasses.asdict(r) for row in a.results for r in row] == [
        dataclasses.asdict(r) for row in b.results for r in row
    ]
    for key in ("assistant_steps", "sampled_tokens", "trajectory_tokens", "truncated"):
        assert a.stats[key] == b.stats[key], key


def check_chunking(config, sizes: tuple[int, ...]) -> None:
    whole = rollouts(config, 0)
    assert whole.loss_mask.sum(-1).min() > 0 and whole.stats["assistant_steps"] > P * G
    for max_rows in sizes:
        assert_same(whole, rollouts(config, max_rows))


def test_chunked_rollout_equals_one_batch_on_the_demo_model(tmp_path):
    check_chunking(tiny_config(tmp_path), (4, 1))  # 4 splits a group; 1 row is the smallest


def test_chunked_rollout_equals_one_batch_with_the_real_qwen_tokenizer(tokenizer_root, tmp_path):
    from test_bfcl_e2e import make_checkpoint

    model = tmp_path / "model"
    make_checkpoint("qwen2", tokenizer_root / "qwen2.5", model)
    check_chunking(tiny_config(tmp_path / "run", hf_path=str(model)), (4,))


def test_rollout_in_lanes_equals_one_session(tmp_path, monkeypatch):
    """On one CPU device the rollout splits its rows over one `Session` per core (`Lanes`): the
    decode and append programs of the lanes run on threads of their own, the environment's steps
    on the caller's thread (where the simulator's SIGALRM limit works), and the trajectories are
    those of one session."""
    import threading

    import jax

    from rcgrpo_jax import models, sampling
    from rcgrpo_jax.rl import rollout

    config = tiny_config(tmp_path)
    s = setup.with_reward_tokens(setup.start(config))
    mesh = models.make_mesh((1, 1, 1), jax.devices()[:1])
    params = jax.device_put(
        s.params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    env = setup.environment(config)
    entries = list(env.tasks("train"))[:5]
    # 20 rows: 2 lanes of >= batch_min; the even cut (row 10) falls inside the prompt of rows
    # 8-10 (task 2 under the high token), so it moves to row 11 (the low token's prompt)
    tokens = np.array([[HIGH, HIGH, HIGH, LOW]] * 5, np.int32)
    settings = RolloutSettings(
        chat_format=config.model.chat_format, max_new_tokens=8, max_len=1024,
        temperature=1.0, max_steps_per_turn=2,
    )  # fmt: skip
    decode_calls, env_threads = [], set()  # (on the caller's thread, session's first row)
    decode_turn, advance = sampling.Session.decode_turn, rollout._advance

    def spy_decode(self, *args, **kwargs):
        decode_calls.append((threading.current_thread() is threading.main_thread(),
                             self._first_row))  # fmt: skip
        return decode_turn(self, *args, **kwargs)

    def spy_advance(*args, **kwargs):
        env_threads.add(threading.get_ident())
        return advance(*args, **kwargs)

    monkeypatch.setattr(sampling.Session, "decode_turn", spy_decode)
    monkeypatch.setattr(rollout, "_advance", spy_advance)
    runs = {}
    for cores in (1, 2):
        monkeypatch.setattr(sampling.lanes.machine, "usable_cores", lambda cores=cores: cores)
        decode_calls.clear()
        runs[cores] = collect(s.cfg, params, s.tokenizer, env, entries, tokens, settings, seed=3,
                              mesh=mesh)  # fmt: skip
        lanes = {first for _, first in decode_calls}
        assert lanes == ({0} if cores == 1 else {0, 11})  # the cut moved to a prompt's edge
        first_turn = decode_calls[:cores]  # every lane live: each on a thread of its own
        assert all(on_main == (cores == 1) for on_main, _ in first_turn)
    assert env_threads == {threading.get_ident()}
    assert runs[1].stats["assistant_steps"] > 20  # later turns: the append path ran in lanes
    assert_same(runs[1], runs[2])
