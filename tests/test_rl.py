"""RL core: group advantages, reward tokens, the policy loss and the fused train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config

from rcgrpo_jax import models, rl
from rcgrpo_jax.envs.reward import RewardResult
from rcgrpo_jax.rl.dynamic import padded_batch
from rcgrpo_jax.rl.rollout import RolloutSettings, Sampled, pack
from rcgrpo_jax.rl.train_step import make_rl_step
from rcgrpo_jax.sampling import Trajectory, length_bucket
from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
from rcgrpo_jax.train.state import init_train_state, state_shardings

P, G, T, PROMPT = 4, 4, 12, 5
CFG = tiny_model_config(qkv_bias=True)


def np_group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mu = rewards.mean(1, keepdims=True)
    sd = rewards.std(1, keepdims=True)  # ddof=0
    same = (rewards == rewards[:, :1]).all(1, keepdims=True)
    return np.where(same, 0.0, (rewards - mu) / (sd + eps))


def test_group_advantages_match_numpy():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (32, 8)).astype(np.float32)
    rewards[0], rewards[1] = 0.0, 1.0  # all-fail and all-succeed groups
    rewards[2] = rng.normal(size=8)  # continuous rewards too
    rewards[3] = 0.1  # equal non-binary rewards: mean has rounding error, still exactly 0
    adv = np.asarray(rl.group_advantages(rewards))
    assert np.isfinite(adv).all()
    np.testing.assert_allclose(adv, np_group_advantages(rewards.astype(np.float64)), atol=1e-5)
    assert (adv[[0, 1, 3]] == 0.0).all()
    assert np.asarray(rl.degenerate_groups(rewards))[:4].tolist() == [True, True, False, True]
    with pytest.raises(ValueError, match="groups, group_size"):
        rl.group_advantages(rewards[0])


def test_reward_tokens_stratified_and_iid():
    key = jax.random.key(0)
    strat = np.asarray(rl.sample_reward_tokens(key, 256, 4, 0.5, stratified=True))
    assert strat.shape == (256, 4)
    assert ((strat == rl.HIGH).any(1) & (strat == rl.LOW).any(1)).all()
    assert (strat.sum(1) == 2).all()
    assert len({tuple(r) for r in strat}) > 1  # shuffled within groups
    # even p_high = 0.9 keeps one low token per group when stratified
    assert (np.asarray(rl.sample_reward_tokens(key, 64, 4, 0.9, stratified=True)).sum(1) == 3).all()
    iid = np.asarray(rl.sample_reward_tokens(key, 512, 8, 0.25))
    assert abs(iid.mean() - 0.25) < 0.03  # 4096 Bernoulli draws: sd ≈ 0.007
    assert (iid.sum(1) == 0).any()  # i.i.d. sampling may give a one-token group


def make_batch(params, seed: int = 0, equal_rewards: bool = False, kl: bool = True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (P, G, T)).astype(np.int32)
    lengths = rng.integers(PROMPT + 3, T + 1, (P, G))
    segments = (np.arange(T)[None, None] < lengths[..., None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (P, G, T)).copy()
    loss_mask = segments * (np.arange(T)[None, None] >= PROMPT)
    flat = lambda x: x.reshape(P * G, T)
    logp = np.asarray(
        rl.train_step.sequence_logprobs(CFG, params, flat(tokens), flat(positions), flat(segments))
    ).reshape(P, G, T)
    # rollout log-probs a little off the current policy, so ratios != 1 and some clip
    old = (logp + rng.normal(0, 0.3, logp.shape)) * loss_mask
    rewards = rng.integers(0, 2, (P, G)).astype(np.float32)
    rewards[0] = 1.0  # one degenerate group
    if equal_rewards:
        rewards[:] = 1.0
    batch = dict(
        tokens=tokens,
        positions=positions,
        segments=segments,
        loss_mask=loss_mask,
        old_logprobs=old.astype(np.float32),
        rewards=rewards,
        reward_token=rng.integers(0, 2, (P, G)).astype(np.int32),
    )
    if kl:
        batch["ref_logprobs"] = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    return batch, logp


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(1))


def np_policy_loss(batch, logp, lc: rl.Objective):
    adv = np_group_advantages(batch["rewards"].astype(np.float64))[..., None]
    mask = batch["loss_mask"].astype(np.float64)
    ratio = np.exp(logp - batch["old_logprobs"])
    surr = np.minimum(ratio * adv, np.clip(ratio, 1 - lc.clip_low, 1 + lc.clip_high) * adv)
    log_r = batch["ref_logprobs"] - logp
    per_tok = -surr + lc.kl_beta * (np.exp(log_r) - log_r - 1)
    if lc.declared.aggregation == "token":
        return (per_tok * mask).sum() / mask.sum()
    return ((per_tok * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("name", ["dapo", "grpo"])  # token mean, sequence mean
def test_policy_loss_matches_numpy_reference(params, name):
    lc = rl.Objective(name, kl_beta=0.05)
    batch, logp = make_batch(params)
    loss_fn = jax.jit(lambda p, b: rl.policy_loss(CFG, lc, p, b))
    loss, aux = loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()})
    assert float(loss) == pytest.approx(np_policy_loss(batch, logp, lc), rel=1e-5, abs=1e-6)
    assert 0 < float(aux["clip_frac"]) < 1 and float(aux["kl"]) > 0
    assert float(aux["degenerate_sum"]) == float(
        np.asarray(rl.degenerate_groups(batch["rewards"])).sum()
    )


def _directional(loss, params, seed: int):
    """(autodiff, central-difference) derivative of `loss` along a random unit direction."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    d = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in d)))
    direction = treedef.unflatten([x / norm for x in d])
    grads = jax.jit(jax.grad(loss))(params)
    analytic = sum(
        float(jnp.vdot(g, v))
        for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True)
    )
    eps = 1e-2
    shifted = lambda s: jax.tree.map(lambda p, v: p + s * eps * v, params, direction)
    loss = jax.jit(loss)
    return analytic, (float(loss(shifted(1))) - float(loss(shifted(-1)))) / (2 * eps)


def test_surrogate_gradient_matches_finite_differences(params):
    # wide clip range: the surrogate is smooth, so central differences are accurate
    lc = rl.Objective(kl_beta=0.1, clip_low=0.9, clip_high=10.0)
    batch, _ = make_batch(params, seed=3)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    analytic, numeric = _directional(lambda p: rl.policy_loss(CFG, lc, p, batch)[0], params, 7)
    assert abs(analytic) > 1e-3
    assert numeric == pytest.approx(analytic, rel=1e-2)


def test_clipped_tokens_carry_no_gradient(params):
    """Ratios pushed beyond 1 + clip_high with positive advantage: the surrogate is flat there."""
    lc = rl.Objective(kl_beta=0.0)
    batch, logp = make_batch(params, seed=4, kl=False)
    batch["rewards"][:] = np.tile([1.0, 0.0, 0.0, 0.0], (P, 1))  # rollout 0 of each group: A > 0
    batch["old_logprobs"] = (logp - 5.0 * (np.arange(G) == 0)[None, :, None]) * batch["loss_mask"]
    batch["old_logprobs"][:, 1:] = (logp * batch["loss_mask"])[:, 1:]  # others: ratio 1
    batch["rewards"][:, 1:] = 0.0
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    grad = jax.jit(jax.grad(lambda p, b: rl.policy_loss(CFG, lc, p, b)[0]))
    g_all = grad(params, jb)
    only_clipped = dict(jb, loss_mask=jb["loss_mask"] * (jnp.arange(G) == 0)[None, :, None])
    g_clipped = grad(params, only_clipped)
    assert float(optax_norm(g_all)) > 0
    assert float(optax_norm(g_clipped)) == 0.0


def optax_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _state(params, mesh, wd=0.0):
    optimizer = make_optimizer(OptimConfig(lr=1e-2, weight_decay=wd, total_steps=10))
    psh = models.param_shardings(CFG, mesh)
    state = init_train_state(params, optimizer, 0, mesh=mesh, param_shardings=psh)
    return state, optimizer, state_shardings(optimizer, psh, mesh, params)


@pytest.mark.parametrize("kl_beta, grad_accum", [(0.0, 1), (0.05, 2)])
def test_a_batch_without_signal_after_a_step_changes_nothing(params, kl_beta, grad_accum):
    """After an informative step (Adam's moments non-zero), a batch of only degenerate groups
    leaves params and optimizer state bit-identical and counts as skipped: Adam fed its zero
    gradient would still move every weight along its moments (and the KL term alone would too).
    The next informative step is applied."""
    mesh = models.make_mesh((4, 1, 2))
    state, optimizer, shardings = _state(params, mesh)
    step = make_rl_step(
        CFG, rl.Objective(kl_beta=kl_beta), optimizer, mesh=mesh, shardings=shardings,
        grad_accum=grad_accum,
    )  # fmt: skip
    kl = kl_beta > 0
    state, m = step(state, make_batch(params, seed=1, kl=kl)[0])
    assert int(m["update_skipped"]) == 0 and float(m["grad_norm"]) > 0
    before = jax.tree.map(np.array, (state.params, state.opt_state))
    state, m = step(state, make_batch(params, seed=2, equal_rewards=True, kl=kl)[0])
    assert int(m["update_skipped"]) == 1 and int(m["skipped"]) == 1 and int(state.step) == 2
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    state, m = step(state, make_batch(params, seed=3, kl=kl)[0])
    assert int(m["update_skipped"]) == 0 and int(m["skipped"]) == 1
    moved = jax.tree.map(np.asarray, state.params)
    assert not np.array_equal(before[0]["embedding"], moved["embedding"])


def test_fused_step_equal_on_two_meshes_and_compiles_once(params):
    lc = rl.Objective(kl_beta=0.05)
    results = []
    for shape in [(8, 1, 1), (1, 2, 4)]:
        mesh = models.make_mesh(shape)
        state, optimizer, shardings = _state(params, mesh, wd=0.01)
        step = make_rl_step(CFG, lc, optimizer, mesh=mesh, shardings=shardings, grad_accum=2)
        losses = []
        for s in range(3):
            batch, _ = make_batch(params, seed=10 + s)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        assert step.jitted._cache_size() == 1  # one program for every step
        results.append((losses, jax.tree.map(np.asarray, state.params)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    # The meshes reduce in different orders, and Adam divides each gradient by its own scale, so
    # an element whose gradient is at rounding level can move by more than rounding: allow 0.1%
    # of the largest movement 3 steps can make (3 x lr 1e-2). A real sharding bug is O(lr).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=3e-5), results[0][1], results[1][1]
    )


def test_masked_padding_groups_train_like_the_kept_groups_alone(params):
    """Dynamic sampling's batch: 2 kept groups laid out as P = 4 (`padded_groups`, the copies
    masked by `group_mask`), data-parallel over 4 devices with 2 accumulated microbatches, takes
    the same steps as the 2 groups alone on 2 devices: the padding counts nowhere."""
    lc = rl.Objective(kl_beta=0.05)
    trained = np.array([False, True, False, True])
    runs = []
    for shape, take in [((4, 1, 1), "padded"), ((2, 1, 1), "kept")]:
        mesh = models.make_mesh(shape)
        state, optimizer, shardings = _state(params, mesh)
        step = make_rl_step(CFG, lc, optimizer, mesh=mesh, shardings=shardings, grad_accum=2)
        out = []
        for s in range(2):
            batch, _ = make_batch(params, seed=20 + s)
            if take == "padded":
                batch = padded_batch(batch, trained, P, 1, 2)
            else:
                batch = {k: v[trained] for k, v in batch.items()}
            state, m = step(state, batch)
            out.append([float(m[k]) for k in ("loss", "grad_norm", "tokens", "groups_sum")])
        runs.append((out, jax.tree.map(np.asarray, state.params)))
    (padded, p_params), (kept, k_params) = runs
    assert padded[0][3] == kept[0][3] == 2  # two groups counted, not four
    np.testing.assert_allclose(padded, kept, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-5), p_params, k_params)


@pytest.mark.parametrize("stratified", [True, False])
def test_step_draws_the_next_iterations_reward_tokens(params, stratified):
    """The fused step's tokens for iteration it + 1 are the host draw's, key fold_in(key(seed),
    it): the same whichever update of the iteration, and from a fresh state (a resumed run)."""
    mesh = models.make_mesh((8, 1, 1))
    state, optimizer, shardings = _state(params, mesh)
    draw = rl.TokenDraw(seed=3, num_groups=P, group_size=G, p_high=0.75, stratified=stratified)
    step = make_rl_step(
        CFG, rl.Objective(), optimizer, reward_token_draw=draw, mesh=mesh, shardings=shardings
    )
    expected = lambda it: np.asarray(
        rl.sample_reward_tokens(jax.random.fold_in(jax.random.key(3), it), P, G, 0.75, stratified)
    )
    first = np.asarray(rl.draw_reward_tokens_jit(draw, 0))  # a run's first iteration: the host
    np.testing.assert_array_equal(first, expected(0))
    drawn = []
    for it in range(3):
        for seed in (2 * it, 2 * it + 1):  # two updates in the iteration
            batch, _ = make_batch(params, seed=seed)
            state, metrics = step(state, {**batch, "iteration": np.int32(it)})
            drawn.append(np.asarray(metrics[rl.train_step.NEXT_REWARD_TOKENS]))
        np.testing.assert_array_equal(drawn[-2], drawn[-1])
        np.testing.assert_array_equal(drawn[-1], expected(it + 1))
    assert len({d.tobytes() for d in drawn}) == 3  # a new draw every iteration
    resumed, _, _ = _state(params, mesh)  # a restored run's step knows only the iteration
    _, metrics = step(resumed, {**make_batch(params, seed=9)[0], "iteration": np.int32(1)})
    np.testing.assert_array_equal(np.asarray(metrics[rl.train_step.NEXT_REWARD_TOKENS]), drawn[3])
    assert step.jitted._cache_size() == 1  # the iteration is data, not a new program
    with pytest.raises(ValueError, match="iteration"):
        step(state, make_batch(params)[0])


class _FakeSession:
    """What `rollout.pack` reads of a sampling Session: each row's whole trajectory."""

    def __init__(self, lengths, seed: int):
        rng = np.random.default_rng(seed)
        self.rows = []
        for n in lengths:
            sampled = [i >= PROMPT for i in range(n)]
            logp = [float(-rng.random()) if s else float("nan") for s in sampled]
            toks = rng.integers(0, CFG.vocab_size, n).tolist()
            self.rows.append(Trajectory(toks, sampled, logp, PROMPT))
        self.prefill_tokens = [PROMPT] * len(lengths)

    def trajectory(self, r):
        return self.rows[r]


def test_rl_rows_sized_to_content_one_program_per_bucket(params):
    """T is the length bucket of the batch's longest trajectory (the sampler's cache rule, at
    most rl.max_len), so the fused step compiles once per bucket, not once per length."""
    buckets = {length_bucket(n) for n in range(1, 16385)}
    assert len(buckets) <= 16 and all(length_bucket(n) >= n for n in (1, 63, 64, 65, 5000))
    settings = RolloutSettings(chat_format="python", max_len=112)
    mesh = models.make_mesh((8, 1, 1))
    state, optimizer, shardings = _state(params, mesh)
    step = make_rl_step(CFG, rl.Objective(), optimizer, mesh=mesh, shardings=shardings)
    seen = []
    for seed, longest in enumerate([20, 60, 70, 90, 130]):
        lengths = np.random.default_rng(seed).integers(PROMPT + 2, longest + 1, P * G)
        lengths[0] = longest
        lengths = np.minimum(lengths, settings.max_len)  # collect ends a row at max_len
        flat = [RewardResult(float(i % 2), True, True) for i in range(P * G)]
        fake = _FakeSession(lengths, seed)
        trajs = [fake.trajectory(r) for r in range(P * G)]
        sampled = Sampled(trajs, fake.prefill_tokens, [False] * (P * G), assistant_steps=1)
        ro = pack(sampled, np.zeros((P, G), np.int32), flat, max_len=settings.max_len, rollout_s=1)
        t = ro.tokens.shape[-1]
        assert t == min(length_bucket(int(lengths.max())), settings.max_len) and t >= lengths.max()
        assert (ro.segments.sum(-1) == lengths.reshape(P, G)).all()
        # whole rows (the shared-prompt layout's shapes: tests/test_shared_prompt.py)
        state, metrics = step(state, ro.batch(share_prompt=False))
        assert np.isfinite(float(metrics["loss"]))
        seen.append(t)
    assert seen == [64, 64, 96, 96, 112]  # 130 > max_len: capped at rl.max_len itself
    assert step.jitted._cache_size() == len(set(seen))


def test_arms_with_the_same_settings_compile_the_fused_step_once(params):
    """Stage `all`'s arms differ only in their reward-token draw (GRPO's fixed token, RC-GRPO's
    p_high): steps made with the same key share one jitted program, compiled once per shape, and
    each still draws its own tokens. A different optimizer config is another program."""
    from rcgrpo_jax import compilation

    mesh = models.make_mesh((8, 1, 1))
    optim = OptimConfig(lr=1e-2, total_steps=10)
    draw = lambda **kw: rl.TokenDraw(seed=3, num_groups=P, group_size=G, stratified=True, **kw)
    draws = {"grpo": draw(fixed=rl.NONE), "rcgrpo": draw(p_high=0.75), "high": draw(fixed=rl.HIGH)}
    batch = {**make_batch(params, kl=False)[0], "iteration": np.int32(0)}
    steps, tokens = {}, {}
    before = compilation.programs("jit(step_fn)")
    for arm, draw in draws.items():  # what each arm's stage builds: its own optimizer object
        state, optimizer, shardings = _state(params, mesh)
        steps[arm] = make_rl_step(
            CFG,
            rl.Objective(),
            optimizer,
            reward_token_draw=draw,
            mesh=mesh,
            shardings=shardings,
            key=optim,
        )
        _, metrics = steps[arm](state, batch)
        tokens[arm] = np.asarray(metrics[rl.train_step.NEXT_REWARD_TOKENS])
    jitted = {id(s.jitted) for s in steps.values()}
    assert len(jitted) == 1 and steps["grpo"].jitted._cache_size() == 1
    assert compilation.programs("jit(step_fn)") - before == 1  # counted by JAX's own events
    assert (tokens["grpo"] == rl.NONE).all() and (tokens["high"] == rl.HIGH).all()
    host = rl.draw_reward_tokens_jit(draws["rcgrpo"], 1)  # the draw's own (static) program
    np.testing.assert_array_equal(tokens["rcgrpo"], host)
    state, optimizer, shardings = _state(params, mesh)
    other = make_rl_step(
        CFG, rl.Objective(), optimizer, reward_token_draw=draws["grpo"], mesh=mesh,
        shardings=shardings, key=OptimConfig(lr=1e-3, total_steps=10),
    )  # fmt: skip
    assert other.jitted is not steps["grpo"].jitted


def test_the_step_is_keyed_by_the_objectives_declared_settings(params):
    """The compiled-step cache keys a program by the `Objective`'s fields (objective and
    estimator names, every setting), not by the loss function's code: equal objectives share
    one program (compiled once), and objectives that differ only in one setting (a clip bound,
    the estimator, its eps) compile one each."""
    from rcgrpo_jax import compilation

    mesh = models.make_mesh((8, 1, 1))
    optim = OptimConfig(lr=1e-2, total_steps=10)
    batch = make_batch(params, kl=False)[0]

    def make(objective):
        state, optimizer, shardings = _state(params, mesh)
        step = make_rl_step(CFG, objective, optimizer, mesh=mesh, shardings=shardings, key=optim)
        return state, step

    before = compilation.programs("jit(step_fn)")
    (state_a, a), (state_b, b) = make(rl.Objective()), make(rl.Objective())
    wider = make(rl.Objective(clip_high=0.3))
    a(state_a, batch), b(state_b, batch), wider[1](wider[0], batch)
    assert a.jitted is b.jitted and wider[1].jitted is not a.jitted
    assert compilation.programs("jit(step_fn)") - before == 2  # by JAX's own events
    others = [rl.Objective(estimator="dr_grpo"), rl.Objective(adv_eps=1e-5)]
    programs = {id(make(o)[1].jitted) for o in others}
    assert (
        len(programs) == 2 and id(a.jitted) not in programs and id(wider[1].jitted) not in programs
    )
