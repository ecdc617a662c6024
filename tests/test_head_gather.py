"""The head only where the loss is: `loss_index` (`data.packing`) and the gathered paths of
`models.token_logprobs(at=...)`, the RL objectives and the SFT loss equal the full [.., T]
computation — values, metrics, gradients, a grad-accumulated jitted step — with padding entries
inert; K is bucketed, never above T, one per SFT loader and per RL iteration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model_config

from rcgrpo_jax import models
from rcgrpo_jax.data import loader, packing
from rcgrpo_jax.envs.reward_tokens import NONE
from rcgrpo_jax.rl.dynamic import padded_batch
from rcgrpo_jax.rl.losses import Objective, policy_loss
from rcgrpo_jax.rl.rollout import Rollouts
from rcgrpo_jax.rl.train_step import make_rl_step, sequence_logprobs
from rcgrpo_jax.sampling import length_bucket
from rcgrpo_jax.stages.rl import _minibatches
from rcgrpo_jax.train import losses
from rcgrpo_jax.train.state import init_train_state, make_train_step, state_shardings

CFG = tiny_model_config()
P, G, T = 4, 2, 128  # at most 60 loss tokens a row: K = 64 < T
TRAP = 3.0  # at position 0: loss_mask 1, old / ref log-probs 3; a leaking padding entry shows


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(0))


def _spans(rng, n_rows: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(segments, loss_mask) [n_rows, t]: ragged rows, two sampled spans after a prompt, the
    trap's 1 at position 0, and one row that samples nothing."""
    lengths = rng.integers(t // 2, t + 1, n_rows)
    segments = (np.arange(t) < lengths[:, None]).astype(np.int32)
    mask = np.zeros((n_rows, t), np.int32)
    for r in range(n_rows):
        start, a, gap, b = rng.integers(20, 40), rng.integers(1, 30), rng.integers(1, 8), 30
        mask[r, start : start + a] = 1
        mask[r, start + a + gap : start + a + gap + rng.integers(1, b)] = 1
    mask *= segments
    mask[1] = 0
    mask[:, 0] = 1
    return segments, mask


def rl_batch(params, seed: int = 0) -> dict[str, np.ndarray]:
    """A [P, G, T] rollout batch with every key the losses read, `loss_index` included."""
    rng = np.random.default_rng(seed)
    segments, mask = (x.reshape(P, G, T) for x in _spans(rng, P * G, T))
    tokens = rng.integers(0, CFG.vocab_size, (P, G, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (P, G, T)).copy()
    flat = lambda x: x.reshape(P * G, T)
    logp = np.asarray(
        sequence_logprobs(CFG, params, flat(tokens), flat(positions), flat(segments))
    ).reshape(P, G, T)
    old = ((logp + rng.normal(0, 0.3, logp.shape)) * mask).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    old[..., 0] = ref[..., 0] = TRAP
    rewards = rng.random((P, G)).astype(np.float32)
    rewards[0] = 0.5  # a degenerate group
    batch = dict(
        tokens=tokens, positions=positions, segments=segments, loss_mask=mask,
        old_logprobs=old, ref_logprobs=ref, rewards=rewards,
        reward_token=np.full((P, G), NONE, np.int32),
        group_mask=np.array([1, 1, 0, 1], np.float32),  # a padding group counts nowhere
    )  # fmt: skip
    batch["loss_index"] = packing.loss_index(mask)
    return batch


def without_index(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "loss_index"}


def _close_trees(a, b, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Leaves equal within f32 rounding: rtol, and atol relative to the tree's largest value
    (the two paths add the same terms in different orders)."""
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(a))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol * scale)


def test_loss_index_bucket_rule():
    mask = np.zeros((3, 200), np.int32)
    mask[0, [0, 5, 6, 150]] = 1  # position 0 is never an index: nothing predicts it
    mask[2, 1:66] = 1  # 65 loss tokens: the bucket above 64 is 96
    index = packing.loss_index(mask)
    assert index.shape == (3, 96) and index.dtype == np.int32
    assert index[0, :3].tolist() == [5, 6, 150] and not index[0, 3:].any()
    assert not index[1].any()  # no loss token: all padding
    assert index[2, :65].tolist() == list(range(1, 66)) and not index[2, 65:].any()
    for n, t in [(0, 200), (1, 200), (64, 200), (65, 200), (99, 100), (5000, 9000), (3, 10)]:
        m = np.zeros((2, t), np.int32)
        m[1, 1 : n + 1] = 1
        k = packing.loss_index(m).shape[-1]
        assert k == min(length_bucket(max(n, 1)), t) and n <= k <= t
    assert packing.loss_index(np.ones((2, 5, 100))).shape == (2, 5, 100)  # 99 tokens: K = T
    assert packing.loss_index(np.ones((4, 4, 300))).shape == (4, 4, 300)  # one K for all rows


def test_token_logprobs_at_equals_full(params):
    rng = np.random.default_rng(1)
    segments, mask = _spans(rng, 4, T)
    segments[:, 70:] *= 2  # packed: a second segment, whose first target is not valid
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (4, T))
    mask[:, 70] = 1
    index = packing.loss_index(mask)
    assert index.shape[-1] < T
    full = models.token_logprobs(CFG, params, tokens, positions, jnp.asarray(segments))
    src = np.maximum(index - 1, 0)  # full's entry t - 1 predicts token t
    want = [np.take_along_axis(np.asarray(x), src, 1) for x in full]
    real = index > 0  # padding entries predict token 0 from itself: never valid, never read
    want[2] &= real
    for chunk in (512, 16):  # one chunk; 4 checkpointed chunks over the K axis
        got = models.token_logprobs(
            CFG, params, tokens, positions, jnp.asarray(segments), chunk=chunk,
            at=jnp.asarray(index),
        )  # fmt: skip
        for g, w in zip(got[:2], want[:2], strict=True):
            np.testing.assert_allclose(np.asarray(g)[real], w[real], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got[2]), want[2])
    assert not want[2][index == 70].any()  # a segment's first token predicts nothing


OBJECTIVES = [
    Objective("dapo", kl_beta=0.05),
    Objective("grpo"),
    Objective("dr_grpo"),  # norm_length 0: the divisor's length is the batch's T, not K
    Objective("dapo"),
    Objective("gspo", clip_low=0.02, clip_high=0.03),
]


@pytest.mark.parametrize(
    "objective", OBJECTIVES, ids=["dapo_kl", "grpo", "dr_grpo", "dapo", "gspo"]
)
def test_policy_loss_gathered_equals_full(params, objective):
    batch = {k: jnp.asarray(v) for k, v in rl_batch(params).items()}
    assert batch["loss_index"].shape[-1] < T and (batch["loss_index"] == 0).any()
    fn = jax.jit(jax.value_and_grad(lambda p, b: policy_loss(CFG, objective, p, b), has_aux=True))
    (loss, aux), grads = fn(params, batch)
    (want, want_aux), want_grads = fn(params, without_index(batch))
    assert float(want_aux["tokens"]) > 0 and 0 < float(want_aux["clip_frac"]) < 1
    assert float(loss) == pytest.approx(float(want), rel=1e-6, abs=1e-7)
    assert aux.keys() == want_aux.keys()
    for k in aux:
        assert float(aux[k]) == pytest.approx(float(want_aux[k]), rel=1e-6, abs=1e-7), k
    _close_trees(grads, want_grads)


def sft_batch(seed: int = 0, n_examples: int = 12) -> dict[str, np.ndarray]:
    """Packed rows of T tokens, loss_weight and `loss_index`; the trap's 1 at position 0."""
    rng = np.random.default_rng(seed)
    examples = []
    for n in rng.integers(10, 50, n_examples):
        loss = (np.arange(n) >= n // 2) & (rng.random(n) > 0.2)
        tokens = rng.integers(0, CFG.vocab_size, n).astype(np.int32)
        examples.append({"tokens": tokens, "loss_mask": loss.astype(np.int32)})
    packed = packing.pack_examples(examples, T)
    batch = {k: packed[k] for k in ("tokens", "loss_mask", "segments", "positions")}
    batch["loss_mask"][:, 0] = 1
    batch["loss_weight"] = rng.uniform(0.5, 2.0, len(batch["tokens"])).astype(np.float32)
    batch["loss_index"] = packing.loss_index(batch["loss_mask"])
    return batch


def test_sft_loss_gathered_equals_full(params):
    batch = {k: jnp.asarray(v) for k, v in sft_batch().items()}
    assert batch["loss_index"].shape[-1] < T and (batch["loss_index"] == 0).any()
    fn = jax.jit(jax.value_and_grad(lambda p, b: losses.masked_nll(CFG, p, b), has_aux=True))
    (loss, aux), grads = fn(params, batch)
    (want, want_aux), want_grads = fn(params, without_index(batch))
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert float(aux["tokens"]) == float(want_aux["tokens"]) > 0
    assert float(aux["nll_sum"]) == pytest.approx(float(want_aux["nll_sum"]), rel=1e-6)
    _close_trees(grads, want_grads)


def _step_twice(params, make_step, batches):
    """Two steps of a fresh SGD state (plain SGD: params move by exactly lr x the gradient)."""
    mesh = models.make_mesh((2, 1, 1), jax.devices()[:2])
    opt = optax.sgd(0.1)
    psh = models.param_shardings(CFG, mesh)
    state = init_train_state(params, opt, 0, mesh=mesh, param_shardings=psh)
    step = make_step(opt, mesh, state_shardings(opt, psh, mesh, params))
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    assert step.jitted._cache_size() == 1
    return jax.device_get(state.params), metrics


def _same_steps(params, make_step, batches):
    got = _step_twice(params, make_step, batches)
    want = _step_twice(params, make_step, [without_index(b) for b in batches])
    for m, w in zip(got[1], want[1], strict=True):
        assert m.keys() == w.keys()
        for k in m:
            assert float(m[k]) == pytest.approx(float(w[k]), rel=1e-6, abs=1e-7), k
    _close_trees(got[0], want[0])


def test_rl_step_grad_accum_gathered_equals_full(params):
    objective = Objective("grpo", kl_beta=0.05)
    make = lambda opt, mesh, sh: make_rl_step(
        CFG, objective, opt, mesh=mesh, shardings=sh, grad_accum=2
    )
    trained = np.array([True, False, False, True])  # 2 kept groups laid out as 4
    batches = [padded_batch(rl_batch(params, s), trained, P, 1, 2) for s in (1, 2)]
    _same_steps(params, make, batches)


def test_sft_step_grad_accum_gathered_equals_full(params):
    make = lambda opt, mesh, sh: make_train_step(
        losses.make_sft_loss(CFG), opt, mesh=mesh, shardings=sh, grad_accum=2
    )
    rows = sft_batch(3, n_examples=40)  # one row set, one K: two batches of 4 rows
    assert len(rows["tokens"]) >= 8
    batches = [{k: v[i : i + 4] for k, v in rows.items()} for i in (0, 4)]
    _same_steps(params, make, batches)


def test_sft_loader_one_k_for_every_batch_and_host():
    rng = np.random.default_rng(5)
    examples = []
    for n in rng.integers(4, 60, 40):
        # a few examples with many loss tokens: the row set's largest count sets K
        loss = rng.random(n) > (0.1 if rng.random() < 0.2 else 0.8)
        examples.append({"tokens": rng.integers(1, 50, n), "loss_mask": loss.astype(np.int32)})
    rows = loader.packed_rows(examples, T, seed=0)
    k = rows[0]["loss_index"].shape[-1]
    assert k < T and k == packing.loss_index(np.stack([r["loss_mask"] for r in rows])).shape[-1]
    for shard in (0, 1):
        it = iter(loader.train_loader(
            examples, batch_size=2, row_len=T, seed=0, shard_index=shard, shard_count=2
        ))  # fmt: skip
        for _ in range(3 * len(rows)):  # several epochs
            b = next(it)
            assert b["loss_index"].shape == (2, k)
            for idx, m in zip(b["loss_index"], b["loss_mask"], strict=True):
                np.testing.assert_array_equal(idx[idx > 0], np.flatnonzero(m[1:]) + 1)
    # model.gather_head=False: the plain rows, and the loss runs the head everywhere
    off = iter(loader.train_loader(examples, batch_size=2, row_len=T, seed=0, gather_head=False))
    assert set(next(off)) == set(loader.ROW_FIELDS)


def test_rl_iteration_one_k_for_every_minibatch(params):
    """The stage's update: `Rollouts.batch()` over the drawn groups, `padded_batch`, then the
    minibatches: all of one K, gathered at the loss mask's positions."""
    b = rl_batch(params)
    ro = Rollouts(
        tokens=b["tokens"], segments=b["segments"], loss_mask=b["loss_mask"],
        old_logprobs=b["old_logprobs"], rewards=b["rewards"], reward_token=b["reward_token"],
        results=[], episodes=[], stats={},
    )  # fmt: skip
    batch = padded_batch(ro.batch(), np.array([False, True, False, True]), P, 2, 1)
    np.testing.assert_array_equal(batch["loss_index"], b["loss_index"][[1, 1, 3, 3]])
    parts = _minibatches(batch, 2)
    assert {mb["loss_index"].shape for mb in parts} == {(P // 2, G, b["loss_index"].shape[-1])}
