"""GRPO learns: the sampler and the fused step together raise the probability of rewarded actions.

A one-step bandit on a random tiny model: each of P prompts gets G sampled first tokens; a
token scores 1 if it is in the rewarded half of the vocabulary. The policy's exact probability of
that half (from the logits, not from samples) must rise, and with the reward flipped it must fall:
a sign error anywhere between the sampler's log-probs, the advantages and the update fails it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rcgrpo_jax import models, rl, sampling
from rcgrpo_jax.rl.train_step import make_rl_step
from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
from rcgrpo_jax.train.state import init_train_state, state_shardings

P, G, PROMPT, STEPS = 4, 8, 5, 8
CFG = models.ModelConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def _rewarded_mass(params, prompts: np.ndarray, rewarded: np.ndarray) -> float:
    """Mean over prompts of p(first token is rewarded), exactly, from the last position."""
    logits = models.forward(CFG, params, prompts)[:, -1]
    probs = np.asarray(jax.nn.softmax(logits, -1))
    return float((probs * rewarded).sum(-1).mean())


def _batch(params, prompts: np.ndarray, rewarded: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    rows = [list(map(int, p)) for p in prompts for _ in range(G)]
    out = sampling.generate(CFG, params, rows, 1, temperature=1.0, seed=seed)
    first = np.array([t[0] for t in out.tokens], np.int32)
    tokens = np.concatenate([np.repeat(prompts, G, 0), first[:, None]], 1).reshape(P, G, -1)
    t = tokens.shape[-1]
    loss_mask = np.zeros((P, G, t), np.int32)
    loss_mask[..., -1] = 1
    old = np.zeros((P, G, t), np.float32)
    old[..., -1] = np.array([lp[0] for lp in out.logprobs], np.float32).reshape(P, G)
    return dict(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (P, G, t)).copy(),
        segments=np.ones((P, G, t), np.int32),
        loss_mask=loss_mask,
        old_logprobs=old,
        rewards=rewarded[first].reshape(P, G).astype(np.float32),
    )


@pytest.mark.parametrize("flip", [False, True])
def test_grpo_moves_probability_toward_the_reward(flip):
    params = models.init_params(CFG, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, CFG.vocab_size, (P, PROMPT)).astype(np.int32)
    rewarded = (np.arange(CFG.vocab_size) % 2 == int(flip)).astype(np.float32)
    mesh = models.make_mesh((1, 1, 1))
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, total_steps=STEPS))
    psh = models.param_shardings(CFG, mesh)
    state = init_train_state(params, optimizer, 0, mesh=mesh, param_shardings=psh)
    shardings = state_shardings(optimizer, psh, mesh, params)
    step = make_rl_step(CFG, rl.Objective(), optimizer, mesh=mesh, shardings=shardings)

    before = _rewarded_mass(params, prompts, rewarded)
    for it in range(STEPS):
        state, _ = step(state, _batch(state.params, prompts, rewarded, seed=it))
    after = _rewarded_mass(state.params, prompts, rewarded)
    assert 0.3 < before < 0.7  # a random model: about half its mass on either half
    assert after > before + 0.15, (before, after)
