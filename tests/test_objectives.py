"""The RL objectives (grpo, dr_grpo, dapo, gspo: TRL's loss_type meanings) against a plain
numpy reference, their gradients w.r.t. the per-token log-probs, and what sets them apart; the
registered advantage estimators (population or sample std) and their signal rule; dynamic
sampling's group filter on fake rewards. tests/test_trl_losses.py checks the same names
against TRL's own loss code."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rcgrpo_jax.config import base_config
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl import (
    ESTIMATORS,
    OBJECTIVES,
    Objective,
    estimate,
    group_advantages,
    group_signal,
)
from rcgrpo_jax.rl.advantages import Estimator, register_estimator
from rcgrpo_jax.rl.dynamic import fill_groups, padded_groups
from rcgrpo_jax.rl.losses import (
    objective_from_config,
    objective_loss,
    register_objective,
    token_ratio,
    with_advantages,
)
from rcgrpo_jax.stages.rl import has_signal

P, G, T = 3, 4, 12
EPS = 1e-6


def make_batch(seed: int = 0):
    """Ragged masks (one rollout generates nothing), group 0 degenerate, ratios spread wide
    enough that every objective clips some tokens or sequences."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T - 1, (P, G))
    start = rng.integers(1, 3, (P, G))
    t = np.arange(T)
    mask = ((t >= start[..., None]) & (t < (start + lengths)[..., None])).astype(np.int32)
    mask[1, 2] = 0  # a rollout with no generated token
    logp = rng.normal(-1.5, 0.5, (P, G, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32) * mask
    rewards = rng.random((P, G)).astype(np.float32)
    rewards[0] = 0.5  # degenerate
    batch = {
        "loss_mask": mask,
        "old_logprobs": old,
        "rewards": rewards,
        "ref_logprobs": (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32),
        "reward_token": np.full((P, G), NONE, np.int32),
    }
    return batch, logp


def np_advantages(
    rewards: np.ndarray, normalize: bool, eps: float = EPS, ddof: int = 0
) -> np.ndarray:
    out = np.zeros_like(rewards, np.float64)
    for i, r in enumerate(rewards.astype(np.float64)):
        if np.ptp(r) == 0:
            continue
        out[i] = (r - r.mean()) / (r.std(ddof=ddof) + eps) if normalize else r - r.mean()
    return out


def np_reference(o: Objective, batch, logp, length: int):
    """(loss, d loss / d logp, clip fraction) of objective `o` written out in float64; the
    clip fraction: of the loss's tokens, those whose surrogate the clip cuts off (no gradient)."""
    name, lo, hi, beta = o.name, o.clip_low, o.clip_high, o.kl_beta
    logp = logp.astype(np.float64)
    m = batch["loss_mask"].astype(np.float64)
    m[..., 0] = 0.0
    n_i = m.sum(-1)
    adv = np_advantages(batch["rewards"], name != "dr_grpo", o.adv_eps, o.adv_std_ddof)
    lr = batch["ref_logprobs"] - logp
    kl, dkl = np.exp(lr) - lr - 1, 1 - np.exp(lr)  # k3 and its derivative in logp
    if name == "gspo":
        s = np.exp((m * (logp - batch["old_logprobs"])).sum(-1) / np.maximum(n_i, 1))
        surr = np.minimum(s * adv, np.clip(s, 1 - lo, 1 + hi) * adv)
        active = (s * adv <= np.clip(s, 1 - lo, 1 + hi) * adv) | ((1 - lo < s) & (s < 1 + hi))
        has = n_i > 0
        per_seq = -surr + beta * (kl * m).sum(-1) / np.maximum(n_i, 1)
        loss = per_seq[has].mean()
        d_seq = -(active * adv * s)[..., None] * m / np.maximum(n_i, 1)[..., None]
        grad = (d_seq + beta * dkl * m / np.maximum(n_i, 1)[..., None]) * has[..., None]
        return loss, grad / has.sum(), ((~active)[..., None] * m).sum() / m.sum()
    adv = adv[..., None]
    ratio = np.exp(logp - batch["old_logprobs"])
    clipped = np.clip(ratio, 1 - lo, 1 + hi)
    per_tok = -np.minimum(ratio * adv, clipped * adv) + beta * kl
    active = (ratio * adv <= clipped * adv) | ((1 - lo < ratio) & (ratio < 1 + hi))
    d_tok = -(active * adv * ratio) + beta * dkl
    if name == "dapo":  # token level over the whole batch
        w = m / m.sum()
    elif name == "dr_grpo":  # a constant: sequences x the fixed length
        w = m / (P * G * length)
    else:  # grpo: the mean over sequences (with a token) of each one's token mean
        has = n_i > 0
        w = m / np.maximum(n_i, 1)[..., None] * has[..., None] / has.sum()
    return (per_tok * w).sum(), d_tok * w, ((~active) * m).sum() / m.sum()


def jax_loss_and_grad(objective: Objective, batch, logp):
    jb = with_advantages(objective, {k: jnp.asarray(v) for k, v in batch.items()})
    ent = jnp.zeros(logp.shape, jnp.float32)
    fn = jax.jit(
        jax.value_and_grad(lambda lp: objective_loss(objective, lp, ent, jb), has_aux=True)
    )
    (loss, aux), grad = fn(jnp.asarray(logp))
    return float(loss), np.asarray(grad, np.float64), aux


CASES = {  # id: objective (norm_length 20: the reference's fixed length)
    "grpo": Objective("grpo", kl_beta=0.05),
    "grpo_sample_std": Objective("grpo", kl_beta=0.05, adv_eps=1e-4, adv_std_ddof=1),
    "dr_grpo": Objective("dr_grpo", kl_beta=0.05, norm_length=20),
    "dapo": Objective("dapo", kl_beta=0.05),
    "dapo_sample_std": Objective("dapo", kl_beta=0.05, adv_std_ddof=1),
    "gspo": Objective("gspo", clip_low=0.02, clip_high=0.03, kl_beta=0.05),
}


@pytest.mark.parametrize("objective", CASES.values(), ids=CASES)
def test_loss_and_gradient_match_numpy(objective):
    batch, logp = make_batch()
    loss, grad, aux = jax_loss_and_grad(objective, batch, logp)
    want, want_grad, want_clip = np_reference(objective, batch, logp, 20)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-4, atol=1e-7)
    assert 0 < want_clip < 1  # the clipped branch is exercised
    assert float(aux["clip_frac"]) == pytest.approx(want_clip, rel=1e-6)
    assert float(aux["degenerate_sum"]) == 1.0
    no_token = batch["loss_mask"] == 0
    assert (grad[no_token] == 0).all() and np.abs(grad[~no_token]).max() > 0


def test_every_objective_keeps_the_aux_keys():
    batch, logp = make_batch(1)
    keys = {name: set(jax_loss_and_grad(Objective(name), batch, logp)[2]) for name in OBJECTIVES}
    assert all(k == keys["grpo"] for k in keys.values())
    assert {"weight", "degenerate_sum", "abs_adv_sum", "groups_sum"} <= keys["grpo"]


def test_gradient_matches_finite_differences():
    """Dr. GRPO and GSPO with wide clip ranges (no kink nearby): central differences along a
    random direction of the log-probs agree with autodiff."""
    batch, logp = make_batch(2)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    ent = jnp.zeros(logp.shape, jnp.float32)
    d = np.random.default_rng(3).normal(size=logp.shape).astype(np.float32)
    d /= np.linalg.norm(d)
    for objective in (
        Objective("dr_grpo", clip_low=0.9, clip_high=10.0, kl_beta=0.1),
        Objective("gspo", clip_low=0.9, clip_high=10.0, kl_beta=0.1),
    ):
        jbo = with_advantages(objective, jb)
        f = jax.jit(lambda lp, o=objective, b=jbo: objective_loss(o, lp, ent, b)[0])
        analytic = float(jnp.vdot(jax.grad(f)(jnp.asarray(logp)), d))
        h = 1e-2
        numeric = (float(f(logp + h * d)) - float(f(logp - h * d))) / (2 * h)
        assert abs(analytic) > 1e-4
        assert numeric == pytest.approx(analytic, rel=1e-2)


def test_dr_grpo_scales_with_the_reward_spread_grpo_does_not():
    """Dr. GRPO drops the std division: rewards x 3 triple its loss; GRPO's is unchanged."""
    batch, logp = make_batch(4)
    wide = dict(batch, rewards=batch["rewards"] * 3)
    for name, factor in (("grpo", 1.0), ("dapo", 1.0), ("dr_grpo", 3.0)):
        o = Objective(name, clip_low=0.9, clip_high=10.0)  # no clipping: linear in A
        base = jax_loss_and_grad(o, batch, logp)[0]
        assert jax_loss_and_grad(o, wide, logp)[0] == pytest.approx(factor * base, rel=1e-4)


def _tokens(batch) -> np.ndarray:
    """[P, G, T] bool: the tokens the loss sees (generated, and not the first position)."""
    on = batch["loss_mask"] > 0
    on[..., 0] = False
    return on


def test_dr_grpo_weighs_every_token_alike_sequence_grpo_does_not():
    """Per-token gradient weight |d loss / d logp| / |A| at ratio 1: one constant for Dr. GRPO,
    1 / (its sequence's length) x a constant for GRPO (TRL's: a sequence mean)."""
    batch, logp = make_batch(5)
    batch["old_logprobs"] = (logp * batch["loss_mask"]).astype(np.float32)  # ratio 1
    n_i = np.broadcast_to(_tokens(batch).sum(-1, keepdims=True), logp.shape)
    for name, normalize in (("dr_grpo", False), ("grpo", True)):
        g = jax_loss_and_grad(Objective(name, norm_length=T), batch, logp)[1]
        a = np.broadcast_to(np.abs(np_advantages(batch["rewards"], normalize))[..., None], g.shape)
        on = _tokens(batch) & (a > 0)
        weight = np.abs(g)[on] / a[on]
        if name == "dr_grpo":
            np.testing.assert_allclose(weight, 1 / (P * G * T), rtol=1e-5)
        else:
            assert np.ptp(weight) > 0
            np.testing.assert_allclose(weight * n_i[on], weight[0] * n_i[on][0], rtol=1e-5)


def test_gspo_clips_whole_sequences_dapo_single_tokens():
    """One token of a positive-advantage rollout far above its old probability: DAPO clips that
    token only; GSPO's sequence ratio exceeds 1 + 4e-4, so the whole sequence carries no
    gradient, while a sequence whose ratio is exactly 1 keeps gradient on every token."""
    batch, logp = make_batch(6)
    batch["old_logprobs"] = (logp * batch["loss_mask"]).astype(np.float32)
    batch["rewards"][2] = [1.0, 0.0, 0.0, 0.0]  # group 2, rollout 0: A > 0
    on = _tokens(batch)
    t_hot = np.flatnonzero(on[2, 0])[0]
    batch["old_logprobs"][2, 0, t_hot] -= 1.0
    g_gspo = jax_loss_and_grad(Objective("gspo", clip_low=3e-4, clip_high=4e-4), batch, logp)[1]
    g_dapo = jax_loss_and_grad(Objective("dapo"), batch, logp)[1]
    assert (g_gspo[2, 0][on[2, 0]] == 0).all()
    assert (g_gspo[2, 1][on[2, 1]] != 0).all()
    others = on[2, 0] & (np.arange(T) != t_hot)
    assert g_dapo[2, 0, t_hot] == 0 and (g_dapo[2, 0][others] != 0).all()


def test_objective_from_config():
    """The default config's objective is the loss every shipped config has run (token mean
    over the batch, population std, eps 1e-6: `dapo`); every rl.* setting reaches its field."""
    rl = base_config().rl
    assert objective_from_config(rl) == Objective(norm_length=rl.max_len)
    default = objective_from_config(rl)
    assert (default.name, default.declared.aggregation) == ("dapo", "token")
    assert (default.adv_eps, default.adv_std_ddof, default.advantage_estimator) == (
        1e-6, 0, "grpo",
    )  # fmt: skip
    rl.objective = "gspo"
    o = objective_from_config(rl)
    assert (o.name, o.clip_low, o.clip_high) == ("gspo", rl.gspo_clip_low, rl.gspo_clip_high)
    rl.objective, rl.adv_eps, rl.adv_std_ddof = "dr_grpo", 1e-4, 1
    o = objective_from_config(rl)
    assert (o.clip_high, o.adv_eps, o.adv_std_ddof) == (rl.clip_high, 1e-4, 1)
    with pytest.raises(ValueError, match="expected one of grpo, dr_grpo, dapo, gspo"):
        Objective("ppo")
    with pytest.raises(ValueError, match="^adv_std_ddof=2; expected 0 or 1$"):
        Objective(adv_std_ddof=2)


@pytest.mark.parametrize("objective", CASES.values(), ids=CASES)
def test_masked_padding_groups_change_nothing(objective):
    """The batch with extra groups marked `group_mask` 0 (copies of real ones, rewards changed
    so that they would count if they were seen) gives the real batch's loss, gradient and
    group statistics: what dynamic sampling's padding to P groups relies on."""
    batch, logp = make_batch(7)
    batch["reward_token"] = np.tile([HIGH, LOW], (P, G // 2)).astype(np.int32)
    pad = np.array([2, 1])  # two padding groups, copies of groups 2 and 1
    padded = {k: np.concatenate([v, v[pad]]) for k, v in batch.items()}
    # what would show if they counted: another reward spread, one all-equal (degenerate) group,
    # only high tokens, and log-probs far from the old ones (agreement maxima, clipping)
    padded["rewards"][P:] = [np.arange(G, dtype=np.float32), np.full(G, 0.5, np.float32)]
    padded["reward_token"][P:] = HIGH
    padded["group_mask"] = np.array([1.0] * P + [0.0, 0.0], np.float32)
    plogp = np.concatenate([logp, logp[pad] - 3.0])
    loss, grad, aux = jax_loss_and_grad(objective, batch, logp)
    ploss, pgrad, paux = jax_loss_and_grad(objective, padded, plogp)
    assert ploss == pytest.approx(loss, rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(pgrad[:P], grad, rtol=1e-5, atol=1e-9)
    assert (pgrad[P:] == 0).all()
    for key in aux:
        assert float(paux[key]) == pytest.approx(float(aux[key]), rel=1e-6, abs=1e-9), key


# ----------------------------------------------------------------------------- estimators


# groups: all equal, one reward apart, all 0, spread, one float32 ulp apart
SIGNAL_REWARDS = np.array(
    [
        [0.5] * 4,
        [1, 1, 1, 0],
        [0] * 4,
        [0.1, 0.7, 0.4, 0.9],
        [2, 2, 2, np.nextafter(np.float32(2), np.float32(3))],
    ],
    np.float32,
)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("name, normalize", [("grpo", True), ("dr_grpo", False)])
def test_registered_estimators_match_numpy(name, normalize, ddof):
    rewards = np.random.default_rng(9).random((5, 6)).astype(np.float32)
    rewards[1] = 0.25  # degenerate: exactly 0
    adv = np.asarray(estimate(name, rewards, EPS, ddof))
    assert adv.dtype == np.float32 and (adv[1] == 0).all()
    want = np_advantages(rewards, normalize, EPS, ddof)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)


def test_the_std_convention_is_a_setting_and_the_default_is_unchanged():
    """ddof 1 (TRL's and Tunix's sample std) gives advantages sqrt((G - 1) / G) times the
    population std's (eps aside); ddof 0, the default and `group_advantages`, is bit for bit
    the formula every earlier run used, so their numbers stay what they were."""
    # G = 6: 1 / G is inexact, so another way to divide by G would show in the last bits
    rewards = np.random.default_rng(13).random((64, 6)).astype(np.float32)
    rewards[3] = 1.0  # degenerate
    pop, sample = (np.asarray(estimate("grpo", rewards, 0.0, d)) for d in (0, 1))
    np.testing.assert_allclose(sample, pop * np.sqrt(5 / 6), rtol=1e-6)
    assert (pop[3] == 0).all() and (sample[3] == 0).all()

    def before(r):  # the population-std formula of every earlier run, as it was written
        mu = jnp.mean(r)
        sigma = jnp.sqrt(jnp.mean(jnp.square(r - mu)))
        return jnp.where(jnp.all(r == r[0]), 0.0, (r - mu) / (sigma + EPS))

    want = np.asarray(jax.jit(jax.vmap(before))(rewards))
    for got in (
        jax.jit(lambda r: estimate("grpo", r, EPS))(rewards),
        jax.jit(group_advantages)(rewards),
        jax.jit(Objective().advantages)(rewards),
    ):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_declares_the_signal_its_advantages_carry(name, ddof):
    """A registered estimator's signal rule (what the step's skip, the RL loop's `has_signal`
    and dynamic sampling read) says exactly which groups get a non-zero advantage; every one
    registered is group-relative: a group of equal rewards gets exactly 0."""
    adv = np.asarray(estimate(name, SIGNAL_REWARDS, EPS, ddof))
    signal = np.asarray(group_signal(name, SIGNAL_REWARDS))
    np.testing.assert_array_equal(signal, (adv != 0).any(1))
    assert signal.tolist() == [False, True, False, True, True]


def test_rloo_matches_a_hand_computed_and_a_numpy_leave_one_out_baseline():
    """RLOO's A_i = r_i - mean_{j != i} r_j: by hand on small groups, by a numpy loop on random
    ones (a degenerate group exactly 0); in a batch with padding groups (`group_mask` 0, other
    rewards) the real groups' advantages are the same and only they count in the loss."""
    hand = [[1, 0, 0, 0], [1, 0, 0, 1], [0, 1, 0.5, 0.5]]
    np.testing.assert_allclose(
        estimate("rloo", np.array(hand, np.float32)),
        [[1, -1 / 3, -1 / 3, -1 / 3], [2 / 3, -2 / 3, -2 / 3, 2 / 3], [-2 / 3, 2 / 3, 0, 0]],
        atol=1e-6,
    )
    # equal rewards whose float32 leave-one-out mean rounds off their value: still exactly 0
    assert (np.asarray(estimate("rloo", np.full((1, G), 0.1, np.float32))) == 0).all()
    batch, logp = make_batch(12)  # group 0 degenerate
    r = batch["rewards"].astype(np.float64)
    want = np.array([[g[i] - np.delete(g, i).mean() for i in range(G)] for g in r])
    assert (want[0] == 0).all() and (want[1:] != 0).all()
    o = Objective("grpo", estimator="rloo")
    pad = {k: np.concatenate([v, v[[2, 1]]]) for k, v in batch.items()}
    pad["rewards"][P:] = [np.arange(G, dtype=np.float32), np.full(G, 0.5, np.float32)]
    pad["group_mask"] = np.array([1.0] * P + [0.0, 0.0], np.float32)
    plogp = np.concatenate([logp, logp[[2, 1]]])
    jb = with_advantages(o, {k: jnp.asarray(v) for k, v in pad.items()})
    np.testing.assert_allclose(jb["advantages"][:P], want, rtol=1e-5, atol=1e-6)
    aux = objective_loss(o, plogp, jnp.zeros(plogp.shape, jnp.float32), jb)[1]
    assert float(aux["abs_adv_sum"]) == pytest.approx(np.abs(want).sum(), rel=1e-5)
    assert float(aux["groups_sum"]) == P and float(aux["signal_max"]) == 1.0


def test_objectives_read_the_batch_advantages_not_the_rewards():
    """The loss takes `advantages` as the batch carries them (the step computes them once, over
    the whole batch): negated, they negate the unclipped surrogate; other rewards under the same
    advantages change nothing."""
    batch, logp = make_batch(8)
    o = Objective("grpo", clip_low=0.9, clip_high=10.0)  # no clipping: linear in A
    jb = with_advantages(o, {k: jnp.asarray(v) for k, v in batch.items()})
    ent = jnp.zeros(logp.shape, jnp.float32)
    loss = float(objective_loss(o, logp, ent, jb)[0])
    flipped = float(objective_loss(o, logp, ent, {**jb, "advantages": -jb["advantages"]})[0])
    assert abs(loss) > 1e-4 and flipped == pytest.approx(-loss, rel=1e-6)
    other = float(objective_loss(o, logp, ent, {**jb, "rewards": jb["rewards"] * 5 + 1})[0])
    assert other == loss


def test_objective_names_its_estimator_and_config_can_override_it():
    """dr_grpo's own estimator is the mean-centred one, the others' GRPO's; `rl.estimator`
    replaces it; an unknown estimator is a one-line ValueError."""
    assert [Objective(n).advantage_estimator for n in OBJECTIVES] == [
        "grpo", "dr_grpo", "grpo", "grpo",
    ]  # fmt: skip
    rl = base_config().rl
    rl.objective, rl.estimator = "grpo", "dr_grpo"
    o = objective_from_config(rl)
    assert (o.name, o.advantage_estimator) == ("grpo", "dr_grpo")
    batch, logp = make_batch(10)
    adv = np.asarray(
        with_advantages(o, {k: jnp.asarray(v) for k, v in batch.items()})["advantages"]
    )
    np.testing.assert_allclose(adv, np_advantages(batch["rewards"], False), atol=1e-6)
    with pytest.raises(ValueError, match="^estimator 'ppo'; expected one of grpo, dr_grpo"):
        Objective(estimator="ppo")


def test_a_name_is_registered_once():
    """The compiled step is keyed by names and declared settings, so a name always means one
    function: a second registration under a taken name (a variant with a setting captured in a
    closure, say) is refused."""
    with pytest.raises(ValueError, match="^objective 'grpo' is already registered$"):
        register_objective("grpo", aggregation="sequence")(token_ratio)
    with pytest.raises(ValueError, match="^estimator 'grpo' is already registered$"):
        register_estimator("grpo")(lambda r, eps, ddof: r)
    assert list(OBJECTIVES) == ["grpo", "dr_grpo", "dapo", "gspo"]


def test_the_estimators_signal_rule_decides_the_skip_the_loop_and_dynamic_sampling(monkeypatch):
    """One rule, from the estimator: with a (test-only) estimator whose baseline is not the
    group's own, a group of equal rewards carries signal, so the loss does not ask for a skip,
    `has_signal` steps the minibatch and dynamic sampling keeps the group; GRPO's rule says no
    to all three. A padding group (`group_mask` 0) counts for neither."""
    const = Estimator(lambda r, eps, ddof: r - 0.5, lambda r: jnp.any(r != 0.5))
    monkeypatch.setitem(ESTIMATORS._items, "test_fixed_baseline", const)
    batch, logp = make_batch(11)
    batch["rewards"][:] = 1.0  # every group degenerate
    batch["group_mask"] = np.array([1.0, 1.0, 0.0], np.float32)
    ent = jnp.zeros(logp.shape, jnp.float32)
    for name, signal in (("grpo", False), ("test_fixed_baseline", True)):
        o = Objective(estimator=name)
        jb = with_advantages(o, {k: jnp.asarray(v) for k, v in batch.items()})
        assert float(objective_loss(o, logp, ent, jb)[1]["signal_max"]) == float(signal)
        assert has_signal(batch, name) is signal
        draw, _ = fake_draws([[False] * 4])  # all-0 rewards: degenerate
        filled = fill_groups(draw, 4, 3, budget=12, dynamic=True, estimator=name, max_rounds=1)
        assert filled.num_trained == (4 if signal else 0)
    padding_only = dict(batch, rewards=batch["rewards"].copy())
    padding_only["rewards"][:2] = 0.5  # the rule's "no signal" on every valid group
    assert not has_signal(padding_only, "test_fixed_baseline")


# ----------------------------------------------------------------------------- dynamic sampling


@dataclasses.dataclass
class Fake:
    rewards: np.ndarray


def fake_draws(informative_per_round: list[list[bool]], group_size: int = 3):
    """draw(round, n) returning the given rounds' groups: informative -> rewards 0, 1, 0, ..."""
    calls = []

    def draw(rnd: int, n: int) -> Fake:
        calls.append((rnd, n))
        flags = informative_per_round[rnd][:n]
        assert len(flags) == n
        r = np.zeros((n, group_size), np.float32)
        r[np.asarray(flags), 1] = 1.0
        return Fake(r)

    return draw, calls


def trained_rewards(filled) -> np.ndarray:
    return np.concatenate(
        [d.rewards[t] for d, t in zip(filled.rounds, filled.trained, strict=True)]
    )


def test_fill_groups_keeps_only_informative_groups_and_counts_the_extra_rollouts():
    rounds = [[True, False, True, False], [False, True, False, False], [True, False, True, True]]
    draw, calls = fake_draws(rounds)
    filled = fill_groups(draw, 4, 3, budget=10**6, dynamic=True, estimator="grpo", max_rounds=4)
    assert calls == [(0, 4), (1, 4), (2, 4)]  # one round shape, until 4 are in hand
    kept = trained_rewards(filled)
    assert kept.shape == (4, 3) and (kept.max(1) != kept.min(1)).all()
    assert filled.trained[2].tolist() == [True, False, False, False]  # only the one missing
    assert filled.generated == 3 * 4 * 3 and filled.num_trained == 4


def test_fill_groups_cap_budget_minibatches_and_plain_grpo():
    never = [[False] * 4] * 4
    draw, calls = fake_draws(never)
    capped = fill_groups(draw, 4, 3, budget=10**6, dynamic=True, estimator="grpo", max_rounds=3)
    assert calls == [(0, 4), (1, 4), (2, 4)] and capped.num_trained == 0
    assert capped.generated == 36
    draw, calls = fake_draws(never)
    assert (
        fill_groups(draw, 4, 3, budget=20, dynamic=True, estimator="grpo").generated == 18
    )  # 4 + 2 groups
    assert calls == [(0, 4), (1, 2)]  # the budget, not the shape, cuts the last round
    draw, _ = fake_draws([[True, True, False, True], [False]])
    cut = fill_groups(draw, 4, 3, budget=15, dynamic=True, estimator="grpo", multiple_of=2)
    assert cut.num_trained == 2 and cut.trained[0].tolist() == [True, True, False, False]
    draw, calls = fake_draws([[True, False, False, True]])
    plain = fill_groups(draw, 4, 3, budget=10**6, dynamic=False, estimator="grpo")
    assert calls == [(0, 4)] and plain.num_trained == 4 and plain.generated == 12


def test_padded_groups_lay_out_every_minibatch_and_microbatch_alike():
    """k = 4 trained groups of 9 drawn, P = 8, 2 minibatches: each minibatch starts with 2
    trained groups and is filled with copies of its own, masked; with 2 microbatches (rows a,
    a + 2, ...) each microbatch holds exactly one trained group."""
    trained = np.zeros(9, bool)
    trained[[0, 3, 4, 8]] = True
    index, valid = padded_groups(trained, 8, 2, 2)
    assert index.shape == valid.shape == (8,)
    assert trained[index].all()  # only trained groups' content, padding included
    assert index[valid].tolist() == [0, 3, 4, 8]  # each trained group once, in order
    assert valid.tolist() == [True, True, False, False] * 2
    for part in np.split(valid, 2):
        assert [part[a::2].sum() for a in range(2)] == [1, 1]
    all_in, valid = padded_groups(np.ones(8, bool), 8, 2)
    assert all_in.tolist() == list(range(8)) and valid.all()  # nothing dropped: the batch as drawn
    with pytest.raises(ValueError, match="2 trained groups do not fill 2 minibatches x 2 micro"):
        padded_groups(np.array([True] * 2 + [False] * 6), 8, 2, 2)
