"""The shared-prompt update (`rl.share_prompt`): each group's prompt runs through the model once
and every rollout's rest over it. Its layout (`data.packing.shared_prompts`) rebuilds every row;
`models.shared_prefix_logprobs` equals `token_logprobs` over the whole rows (scanned, unrolled,
rematerialised, flash); the RL objectives' loss, metrics and gradients and a grad-accumulated
fused step on a mesh equal the whole-row update's, for GRPO's one prompt per group and
RC-GRPO's two (the reward token is part of the prompt); the stage builds the layout when the
config says so."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model_config

from rcgrpo_jax import models
from rcgrpo_jax.data import packing
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.losses import Objective, policy_loss
from rcgrpo_jax.rl.rollout import Rollouts
from rcgrpo_jax.rl.train_step import make_rl_step, sequence_logprobs
from rcgrpo_jax.shapes import piece_bucket
from rcgrpo_jax.stages.rl import train_batch
from rcgrpo_jax.train.state import init_train_state, state_shardings

CFG = tiny_model_config(qkv_bias=True)
P, G, T = 4, 4, 96
REWARD_ID = {HIGH: 30, LOW: 31}  # the reward token's id, first in the prompt (envs.prompts)


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(0))


def rollouts(seed: int, conditioned: bool) -> dict[str, np.ndarray]:
    """A [P, G, T] rollout batch as the rollout packs it: per group one prompt (of its own
    length), under a reward token per row when `conditioned` (so two prompts per group), then
    sampled spans with tool tokens between them, right padding; one row that samples nothing."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((P, G, T), np.int32)
    segments = np.zeros((P, G, T), np.int32)
    mask = np.zeros((P, G, T), np.int32)
    reward_token = np.full((P, G), NONE, np.int32)
    for i in range(P):
        prompt = rng.integers(1, 29, rng.integers(9, 40)).astype(np.int32)
        for j in range(G):
            row = prompt.copy()
            if conditioned:
                reward_token[i, j] = HIGH if j % 2 else LOW
                row = np.concatenate([[REWARD_ID[reward_token[i, j]]], prompt])
            n = min(T, len(row) + int(rng.integers(4, 50)))
            tokens[i, j, :n] = np.concatenate([row, rng.integers(1, 29, n - len(row))])
            segments[i, j, :n] = 1
            sampled = np.arange(n) >= len(row)
            sampled &= (np.arange(n) - len(row)) % 11 < 7  # tool results between sampled spans
            mask[i, j, :n] = sampled
    mask[1, 2] = 0  # a row that sampled nothing
    mask[:, :, 0] = 1  # never read (nothing predicts the first token): must change nothing
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (P, G, T)).copy()
    return dict(
        tokens=tokens, positions=positions, segments=segments, loss_mask=mask,
        reward_token=reward_token,
    )  # fmt: skip


def rl_batch(params, seed: int, conditioned: bool) -> dict[str, np.ndarray]:
    """`rollouts` with old/ref log-probs near the policy's, rewards and a padding group."""
    batch = rollouts(seed, conditioned)
    rng = np.random.default_rng(seed + 100)
    flat = lambda x: x.reshape(P * G, T)
    rows = (flat(batch[k]) for k in ("tokens", "positions", "segments"))
    logp = np.asarray(sequence_logprobs(CFG, params, *rows)).reshape(P, G, T)
    batch["old_logprobs"] = ((logp + rng.normal(0, 0.3, logp.shape)) * batch["loss_mask"]).astype(
        np.float32
    )
    batch["ref_logprobs"] = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    batch["rewards"] = rng.random((P, G)).astype(np.float32)
    batch["group_mask"] = np.array([1, 1, 0, 1], np.float32)
    return batch


def shared(batch: dict, index: bool = True) -> dict:
    """The batch in the shared-prompt layout (with or without the head's `loss_index`)."""
    layout = packing.shared_prompts(batch["tokens"], batch["segments"], batch["loss_mask"])
    out = {**batch, **layout}
    if index:
        out["loss_index"] = packing.loss_index(batch["loss_mask"])
    return out


@pytest.mark.parametrize("conditioned", [False, True], ids=["grpo", "rcgrpo"])
def test_layout_rebuilds_every_row(conditioned):
    batch = rollouts(1, conditioned)
    out = packing.shared_prompts(batch["tokens"], batch["segments"], batch["loss_mask"])
    assert out.keys() == set(packing.SHARED_PROMPT_KEYS)
    k = 2 if conditioned else 1
    assert out["prompt_tokens"].shape[:2] == (P, k) and out["prompt_of"].shape == (P, G)
    length = batch["segments"].sum(-1)
    mask = batch["loss_mask"].copy()
    mask[..., 0] = 0
    for i in range(P):
        for j in range(G):
            n = length[i, j]
            start = out["rest_start"][i, j]
            rest = out["rest_segments"][i, j].sum()
            if not mask[i, j].any():  # nothing of it is read: an empty rest
                assert rest == 0 and start == 0
                continue
            assert start == np.argmax(mask[i, j]) - 1 and start + rest == n
            which = out["prompt_of"][i, j]
            assert out["prompt_length"][i, which] == start
            row = np.concatenate(
                [out["prompt_tokens"][i, which, :start], out["rest_tokens"][i, j, :rest]]
            )
            np.testing.assert_array_equal(row, batch["tokens"][i, j, :n])
            np.testing.assert_array_equal(out["rest_positions"][i, j, :rest], np.arange(start, n))
        # rows under one reward token share their prompt; the two tokens' prompts differ
        rows = [j for j in range(G) if mask[i, j].any()]
        tokens_of = {int(batch["reward_token"][i, j]) for j in rows}
        assert len({int(out["prompt_of"][i, j]) for j in rows}) == len(tokens_of)
    starts = out["rest_start"][mask.any(-1)]
    rests = out["rest_segments"].sum(-1)
    assert out["prompt_tokens"].shape[-1] == min(piece_bucket(int(starts.max())), T)
    # the stack runs over Ts - 1 positions: a bucket of the longest rest less its last token
    assert out["rest_tokens"].shape[-1] == min(piece_bucket(int(rests.max()) - 1) + 1, T)
    # the pieces are what sharing saves: each prompt once, not G times
    assert out["prompt_tokens"].size + out["rest_tokens"].size < batch["tokens"].size


CONFIGS = {
    "scan": {},
    "unrolled_remat": dict(scan_layers=False, remat="full"),
    "qwen3_flash": dict(family="qwen3", qkv_bias=False, attention="flash", flash_block=16),
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_shared_prefix_logprobs_equal_whole_rows(overrides):
    """Log-probs, entropies and the gradient of a loss over both, against `token_logprobs`
    over the whole rows (prefix ++ rest, right-padded), with prefixes of several lengths, one
    continued by no row, and rests of several lengths, one empty."""
    cfg = CFG.replace(**overrides)
    params = models.init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(2)
    n, tp, b, ts = 4, 24, 8, 20  # 2 groups x 2 prefixes, 2 groups x 4 rows
    plen = np.array([17, 24, 5, 11], np.int32)  # prefix 2 (group 1's first) has no row
    of = np.array([[0, 0, 1, 0], [1, 1, 1, 1]], np.int32)
    row_prefix = (np.arange(2)[:, None] * 2 + of).reshape(-1)
    rlen = np.array([20, 4, 13, 1, 9, 20, 0, 7])
    pre = rng.integers(1, cfg.vocab_size, (n, tp)).astype(np.int32)
    rest = rng.integers(1, cfg.vocab_size, (b, ts)).astype(np.int32)
    whole = np.zeros((b, tp + ts), np.int32)
    for r, q in enumerate(row_prefix):
        whole[r, : plen[q]] = pre[q, : plen[q]]
        whole[r, plen[q] : plen[q] + rlen[r]] = rest[r, : rlen[r]]
    seg = (np.arange(tp + ts) < (plen[row_prefix] + rlen)[:, None]).astype(np.int32)
    rseg = (np.arange(ts) < rlen[:, None]).astype(np.int32)
    at = np.broadcast_to(np.arange(1, ts), (b, ts - 1))
    prefix = models.SharedPrefix(jnp.asarray(pre), jnp.asarray(plen), jnp.asarray(of))
    positions = jnp.asarray(plen[row_prefix][:, None] + np.arange(ts))

    def loss(fn, p):
        logp, ent, valid = fn(p)
        return jnp.sum(jnp.where(valid, 0.7 * logp + 0.3 * ent, 0.0)), (logp, ent, valid)

    def by_rest(p):
        return models.shared_prefix_logprobs(
            cfg, p, prefix, jnp.asarray(rest), positions, jnp.asarray(rseg), at=jnp.asarray(at)
        )

    def by_row(p):
        pos = jnp.broadcast_to(jnp.arange(tp + ts), whole.shape)
        at_row = jnp.asarray(plen[row_prefix][:, None] + at)
        return models.token_logprobs(cfg, p, jnp.asarray(whole), pos, jnp.asarray(seg), at=at_row)

    grad = lambda fn: jax.jit(jax.value_and_grad(lambda p: loss(fn, p), has_aux=True))(params)
    (got, (logp, ent, valid)), g_got = grad(by_rest)
    (want, (w_logp, w_ent, w_valid)), g_want = grad(by_row)
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(w_valid))
    assert int(np.sum(valid)) == int(np.sum(np.maximum(rlen - 1, 0)))
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(logp)[v], np.asarray(w_logp)[v], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[v], np.asarray(w_ent)[v], rtol=1e-5, atol=1e-5)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    _close_trees(g_got, g_want, 1e-5)


def _close_trees(a, b, tol: float) -> None:
    """Leaves equal within f32 rounding (atol relative to the tree's largest value: the two
    paths add the same terms in different orders)."""
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(a))
    assert scale > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("conditioned", [False, True], ids=["grpo_prompts", "rcgrpo_prompts"])
def test_policy_loss_shared_equals_whole_rows(params, conditioned):
    """The loss, every metric and the gradients (with the KL term, so the reference log-probs
    are gathered too), the head at the loss tokens only and, GRPO's prompts, at every
    position. The objectives differ only after the log-probs (`objective_loss`)."""
    batch = rl_batch(params, 3, conditioned)
    objective = Objective("dapo", kl_beta=0.05)
    fn = jax.jit(jax.value_and_grad(lambda p, b: policy_loss(CFG, objective, p, b), has_aux=True))
    as_jax = lambda b: {k: jnp.asarray(v) for k, v in b.items()}
    (want, want_aux), want_grads = fn(params, as_jax(batch))
    assert float(want_aux["tokens"]) > 0 and float(want_aux["clip_frac"]) > 0
    for index in (True,) if conditioned else (True, False):
        (loss, aux), grads = fn(params, as_jax(shared(batch, index)))
        assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
        for k in want_aux:
            assert float(aux[k]) == pytest.approx(float(want_aux[k]), rel=1e-5, abs=1e-6), k
        _close_trees(grads, want_grads, 1e-5)


def test_fused_step_shared_equals_whole_rows_on_a_mesh(params):
    """Two grad-accumulated RC-GRPO steps on a 4-device (data 2, tensor 2) mesh: the params
    after them equal the whole-row update's."""
    mesh = models.make_mesh((2, 1, 2), jax.devices()[:4])
    opt = optax.adam(1e-3)
    psh = models.param_shardings(CFG, mesh)
    batches = [rl_batch(params, 4, True)] * 2  # the second step: other params, same batch
    out = []
    for layout in (lambda b: b, shared):
        state = init_train_state(params, opt, 0, mesh=mesh, param_shardings=psh)
        step = make_rl_step(
            CFG, Objective(), opt, mesh=mesh, shardings=state_shardings(opt, psh, mesh, params),
            grad_accum=2,
        )  # fmt: skip
        for b in batches:
            state, metrics = step(state, layout(b))
            assert np.isfinite(float(metrics["loss"]))
        assert step.jitted._cache_size() == 1
        out.append(jax.device_get(state.params))
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), out[0], params)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the steps did update
    _close_trees(out[1], out[0], 1e-4)


@pytest.mark.parametrize("share", [True, False])
def test_the_stage_builds_the_layout_its_config_names(share):
    batch = rollouts(6, True)
    fake = types.SimpleNamespace(
        tokens=batch["tokens"], segments=batch["segments"], loss_mask=batch["loss_mask"],
        positions=batch["positions"], old_logprobs=np.zeros((P, G, T), np.float32),
        rewards=np.zeros((P, G), np.float32), reward_token=batch["reward_token"],
    )  # fmt: skip
    fake.batch = types.MethodType(Rollouts.batch, fake)
    ctx = types.SimpleNamespace(
        config=types.SimpleNamespace(model=types.SimpleNamespace(gather_head=True)),
        rl=types.SimpleNamespace(share_prompt=share), num_prompts=P, minibatches=1,
        microbatches=1, ref_params=None,
    )  # fmt: skip
    generated = types.SimpleNamespace(rollouts=fake, trained=np.ones(P, bool))
    out = train_batch(ctx, generated, fake.rewards)
    assert ("prompt_tokens" in out) == share and "loss_index" in out
    assert all(k in out for k in packing.SHARED_PROMPT_KEYS) == share
