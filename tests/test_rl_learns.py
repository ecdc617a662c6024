"""GRPO learns: the sampler and the fused step together raise the probability of rewarded actions.

A one-step bandit on a random tiny model: each of P prompts gets G sampled first tokens; a
token scores 1 if it is in the rewarded half of the vocabulary. The policy's exact probability of
that half (from the logits, not from samples) must rise, and with the reward flipped it must fall:
a sign error anywhere between the sampler's log-probs, the advantages and the update fails it.
And the two agree: the step's log-probs of a real sampler's multi-turn rollouts are the
sampler's, to float32 rounding (the `logp_gap_*` metrics).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import shipped_config, tiny_model_config

from rcgrpo_jax import models, rl, sampling
from rcgrpo_jax.envs.reward import RewardResult
from rcgrpo_jax.rl.rollout import Sampled, pack
from rcgrpo_jax.rl.train_step import make_rl_step
from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
from rcgrpo_jax.train.state import init_train_state, state_shardings

P, G, PROMPT, STEPS = 4, 8, 5, 8
CFG = tiny_model_config()


def _rl_step(
    cfg, params, total_steps: int, grad_accum: int = 1, *, lr=1e-2, warmup=0, clip=(0.2, 0.28)
):
    """A fresh train state from `params` and the fused GRPO step (Adam, one device)."""
    mesh = models.make_mesh((1, 1, 1))
    optimizer = make_optimizer(OptimConfig(lr=lr, warmup_steps=warmup, total_steps=total_steps))
    psh = models.param_shardings(cfg, mesh)
    state = init_train_state(params, optimizer, 0, mesh=mesh, param_shardings=psh)
    shardings = state_shardings(optimizer, psh, mesh, params)
    objective = rl.Objective(clip_low=clip[0], clip_high=clip[1])
    step = make_rl_step(
        cfg, objective, optimizer, mesh=mesh, shardings=shardings, grad_accum=grad_accum
    )
    return state, step


def _rewarded_mass(params, prompts: np.ndarray, rewarded: np.ndarray) -> float:
    """Mean over prompts of p(first token is rewarded), exactly, from the last position."""
    logits = models.forward(CFG, params, prompts)[:, -1]
    probs = np.asarray(jax.nn.softmax(logits, -1))
    return float((probs * rewarded).sum(-1).mean())


def _batch(
    params, prompts: np.ndarray, rewarded: np.ndarray, seed: int, group_size: int = G
) -> dict[str, np.ndarray]:
    rows = [list(map(int, p)) for p in prompts for _ in range(group_size)]
    out = sampling.generate(CFG, params, rows, 1, temperature=1.0, seed=seed)
    first = np.array([t[0] for t in out.tokens], np.int32)
    tokens = np.concatenate([np.repeat(prompts, group_size, 0), first[:, None]], 1).reshape(
        P, group_size, -1
    )
    t = tokens.shape[-1]
    loss_mask = np.zeros((P, group_size, t), np.int32)
    loss_mask[..., -1] = 1
    old = np.zeros((P, group_size, t), np.float32)
    old[..., -1] = np.array([lp[0] for lp in out.logprobs], np.float32).reshape(P, group_size)
    return dict(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (P, group_size, t)).copy(),
        segments=np.ones((P, group_size, t), np.int32),
        loss_mask=loss_mask,
        old_logprobs=old,
        rewards=rewarded[first].reshape(P, group_size).astype(np.float32),
    )


@pytest.mark.parametrize("flip", [False, True])
def test_grpo_moves_probability_toward_the_reward(flip):
    params = models.init_params(CFG, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, CFG.vocab_size, (P, PROMPT)).astype(np.int32)
    rewarded = (np.arange(CFG.vocab_size) % 2 == int(flip)).astype(np.float32)
    state, step = _rl_step(CFG, params, STEPS)

    before = _rewarded_mass(params, prompts, rewarded)
    for it in range(STEPS):
        state, _ = step(state, _batch(state.params, prompts, rewarded, seed=it))
    after = _rewarded_mass(state.params, prompts, rewarded)
    assert 0.3 < before < 0.7  # a random model: about half its mass on either half
    assert after > before + 0.15, (before, after)


def session_batch(cfg, params, seed: int = 0) -> dict[str, np.ndarray]:
    """A real sampler's [P, G, T] batch, packed as `rl.rollout` packs it: P ragged prompts with
    G rows each, a turn, appended (tool) tokens, a second turn."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(3, 9))).tolist() for _ in range(P)]
    sess = sampling.Session(cfg, params, temperature=1.0, seed=seed)
    sess.start([p for p in prompts for _ in range(G)], reserve=6)
    sess.decode_turn(6)
    sess.append({r: rng.integers(0, cfg.vocab_size, 3).tolist() for r in sess.live_rows})
    sess.decode_turn(6)
    n = P * G
    flat = [RewardResult(float(r % 3 == 0), True, True) for r in range(n)]
    trajs = [sess.trajectory(r) for r in range(n)]
    sampled = Sampled(trajs, sess.prefill_tokens, [False] * n, assistant_steps=2)
    ro = pack(sampled, np.zeros((P, G), np.int32), flat, max_len=64, rollout_s=1.0)
    return ro.batch()


def first_update_agreement(cfg, params, batch, grad_accum: int = 1) -> dict[str, float]:
    """The agreement metrics of one fused step on `batch` from `params` (those of the sampler)."""
    state, step = _rl_step(cfg, params, 1, grad_accum)
    m = rl.summarize(step(state, batch)[1])
    return {k: m[k] for k in ("logp_gap_mean", "logp_gap_max", "ratio_dev_max", "tokens")}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_rollout_and_trainer_log_probs_agree(grad_accum):
    """float32: the first update's |log p_train - log p_sampler| over generated tokens is
    rounding (a token off by one position or mis-masked is O(1)). A 0.1 gap planted in one
    token of the last group is reported as the max and adds 0.1/tokens to the mean, whichever
    microbatch holds it (`_max` is a max over microbatches, not a weighted mean)."""
    params = models.init_params(CFG, jax.random.key(0))
    batch = session_batch(CFG, params)
    m = first_update_agreement(CFG, params, batch, grad_accum)
    assert m["tokens"] == batch["loss_mask"].sum() == P * G * 12
    assert m["logp_gap_max"] <= 1e-5 and m["logp_gap_mean"] <= 1e-5, m
    assert m["ratio_dev_max"] <= 1e-5, m
    t = np.flatnonzero(batch["loss_mask"][P - 1, G - 1])[-1]
    before = float(batch["old_logprobs"][P - 1, G - 1, t])
    batch["old_logprobs"][P - 1, G - 1, t] -= 0.1
    plant = before - float(batch["old_logprobs"][P - 1, G - 1, t])  # 0.1 rounded in float32
    planted = first_update_agreement(CFG, params, batch, grad_accum)
    assert planted["logp_gap_max"] == pytest.approx(0.1, abs=1e-4)
    assert planted["ratio_dev_max"] == pytest.approx(np.expm1(0.1), abs=1e-4)
    # The planted token's own gap (at most the unplanted max) is replaced, so the summed gap
    # rises by the plant give or take twice that max (it is rounding, and differs by CPU).
    rise = (planted["logp_gap_mean"] - m["logp_gap_mean"]) * m["tokens"]
    assert rise == pytest.approx(plant, abs=2 * m["logp_gap_max"] + 1e-6)


def _demo_rl():
    """configs/tiny.py's RL settings (the recipe the demo runs)."""
    return shipped_config("tiny").rl


@pytest.fixture(scope="module")
def peaked_policy():
    """(prompts, rewarded half of the vocabulary, a policy peaked on it): built once for both
    directions of the test below."""
    prompts = np.random.default_rng(0).integers(0, CFG.vocab_size, (P, PROMPT)).astype(np.int32)
    rewarded = (np.arange(CFG.vocab_size) % 2 == 0).astype(np.float32)
    return prompts, rewarded, _peaked_params(prompts, rewarded)


@pytest.mark.parametrize("flip", [False, True])
def test_the_demo_recipe_moves_a_peaked_policy_toward_the_reward(flip, peaked_policy):
    """The sign test again, at the demo's RL settings (its lr and warm-up, G, epochs x
    minibatches, clip), from a peaked policy as SFT leaves one: most groups all-correct, a few
    informative. The rewarded mass must rise; with the reward flipped (the policy's favourite
    half now scores 0) it must fall."""
    rl_cfg = _demo_rl()
    g, epochs, mbs, iters = int(rl_cfg.group_size), int(rl_cfg.epochs), int(rl_cfg.minibatches), 8
    prompts, rewarded, peaked = peaked_policy
    assert 0.85 < _rewarded_mass(peaked, prompts, rewarded) < 0.97  # SFT-like, not saturated
    target = 1.0 - rewarded if flip else rewarded
    optim = rl_cfg.optim
    state, step = _rl_step(
        CFG, peaked, iters * epochs * mbs, lr=float(optim.lr), warmup=int(optim.warmup_steps),
        clip=(float(rl_cfg.clip_low), float(rl_cfg.clip_high)),
    )  # fmt: skip
    before = _rewarded_mass(peaked, prompts, target)
    for it in range(iters):
        batch = _batch(state.params, prompts, target, seed=100 + it, group_size=g)
        for _ in range(epochs):
            for k in range(mbs):
                part = slice(k * P // mbs, (k + 1) * P // mbs)
                state, _ = step(state, {key: v[part] for key, v in batch.items()})
    after = _rewarded_mass(state.params, prompts, target)
    print(f"demo recipe, flip={flip}: rewarded mass {before:.4f} -> {after:.4f}")
    assert after > before, (before, after)


def _peaked_params(prompts: np.ndarray, rewarded: np.ndarray):
    """A policy with ~90% of its first-token mass on the rewarded half: GRPO at lr 1e-2 from
    the random model, stopped once it gets there (as SFT stops short of the ceiling)."""
    params = models.init_params(CFG, jax.random.key(0))
    state, step = _rl_step(CFG, params, 40)
    for it in range(40):
        if _rewarded_mass(state.params, prompts, rewarded) > 0.88:
            break
        state, _ = step(state, _batch(state.params, prompts, rewarded, seed=it))
    return state.params
