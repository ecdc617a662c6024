"""Train machinery: exact resume, skip on non-finite, mesh invariance, checkpoint fallback,
packing isolation, gradient accumulation. Tiny model, CPU, f32."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config

from rcgrpo_jax import models
from rcgrpo_jax.data import loader, packing
from rcgrpo_jax.train import checkpoint, losses, optim
from rcgrpo_jax.train import state as st

CFG = tiny_model_config(vocab_size=64)
ROW = 16
OCFG = optim.OptimConfig(lr=3e-3, warmup_steps=2, total_steps=20, weight_decay=0.1, clip_norm=1.0)


def _examples(n: int = 40, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(3, ROW, n):
        out.append(
            {
                "tokens": rng.integers(1, CFG.vocab_size, length).astype(np.int32),
                "loss_mask": (rng.random(length) > 0.3).astype(np.int32),
            }
        )
    return out


@pytest.fixture(scope="module")
def host_params():
    """Unsharded init, so every mesh starts from bit-identical values."""
    return jax.device_get(models.init_params(CFG, jax.random.key(0)))


class Setup:
    """Mesh, optimizer, shardings and one compiled step (built once per configuration)."""

    def __init__(self, mesh_shape, grad_accum=1):
        self.mesh = models.make_mesh(mesh_shape)
        self.ps = models.param_shardings(CFG, self.mesh)
        ocfg = OCFG.__class__(**{**OCFG.__dict__, "grad_accum": grad_accum})
        self.opt = optim.make_optimizer(ocfg)
        self.shardings = st.state_shardings(self.opt, self.ps, self.mesh, models.param_shapes(CFG))
        self.step = st.make_train_step(
            losses.make_sft_loss(CFG),
            self.opt,
            mesh=self.mesh,
            shardings=self.shardings,
            grad_accum=grad_accum,
            schedule=optim.make_schedule(ocfg),
        )
        self.init = st.make_init_state(
            self.opt, mesh=self.mesh, param_shardings=self.ps, params_like=models.param_shapes(CFG)
        )

    def fresh(self, params) -> st.TrainState:
        return self.init(jax.device_put(params, self.ps), 7)


# One compiled step per configuration for the whole module (CPU compiles dominate runtime).
@pytest.fixture(scope="module")
def setup_124():
    return Setup((1, 2, 4))


@pytest.fixture(scope="module")
def setup_811_accum2():
    return Setup((8, 1, 1), grad_accum=2)


def _loader(seed=3):
    return loader.train_loader(_examples(), batch_size=8, row_len=ROW, seed=seed)


def _weighted(batch, weight=None):
    """Every batch carries loss_weight, so all tests share the same compiled steps."""
    w = np.ones(batch["tokens"].shape[0], np.float32) if weight is None else weight
    return {**batch, "loss_weight": np.asarray(w, np.float32)}


def _bitwise_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_exact_resume(tmp_path: Path, host_params, setup_811_accum2):
    """2k uninterrupted steps == k steps, checkpoint, fresh objects, restore, k more steps."""
    k = 3
    s = setup_811_accum2

    state, it, ref_losses = s.fresh(host_params), iter(_loader()), []
    for _ in range(2 * k):
        state, m = s.step(state, _weighted(next(it)))
        ref_losses.append(float(m["loss"]))
    ref = jax.device_get(state)

    state, it, losses_b = s.fresh(host_params), iter(_loader()), []
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", save_every=k, keep=2)
    for i in range(k):
        state, m = s.step(state, _weighted(next(it)))
        losses_b.append(float(m["loss"]))
        ckpt.save(i + 1, state, it.get_state())
    ckpt.close()
    del state, it, ckpt

    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", save_every=k, keep=2)
    target = st.abstract_train_state(s.opt, models.param_shapes(CFG), s.shardings)
    state, data_state, step = ckpt.restore_latest(target)
    assert step == k and int(state.step) == k
    it = iter(_loader())
    it.set_state(data_state)
    leaf = state.params["layers"]["attn"]["wq"]
    assert leaf.sharding == s.ps["layers"]["attn"]["wq"]
    for _ in range(k):
        state, m = s.step(state, _weighted(next(it)))
        losses_b.append(float(m["loss"]))
    ckpt.save(2 * k, state, it.get_state(), force=True)
    ckpt.close()

    assert losses_b == ref_losses
    got = jax.device_get(state)
    assert _bitwise_equal(got.params, ref.params)
    assert _bitwise_equal(got.opt_state, ref.opt_state)
    assert np.array_equal(got.rng, ref.rng) and int(got.step) == 2 * k


def test_nonfinite_update_is_skipped(setup_124, host_params):
    s = setup_124
    batch = _weighted(next(iter(_loader())))
    state, m = s.step(s.fresh(host_params), batch)
    assert int(m["update_skipped"]) == 0
    before = jax.device_get(state)

    bad = {**batch, "loss_weight": np.array([1, 1, np.nan, 1, 1, 1, 1, 1], np.float32)}
    state, m = s.step(state, bad)
    after = jax.device_get(state)
    assert not np.isfinite(float(m["loss"]))
    assert int(m["update_skipped"]) == 1 and int(m["skipped"]) == 1
    assert int(after.skipped) == 1 and int(after.step) == int(before.step) + 1
    assert _bitwise_equal(after.params, before.params)
    assert _bitwise_equal(after.opt_state, before.opt_state)

    state, m = s.step(state, batch)  # training continues normally afterwards
    assert int(m["update_skipped"]) == 0 and int(m["skipped"]) == 1
    assert not _bitwise_equal(jax.device_get(state.params), after.params)


def test_a_batch_without_loss_tokens_is_a_zero_update_with_or_without_accumulation(
    setup_124, setup_811_accum2, host_params
):
    """No loss token at all: one microbatch gives loss 0 and zero gradients; accumulated
    microbatches must give the same (not 0 / 0 = NaN, which would count as a skipped update)."""
    batch = _weighted(next(iter(_loader())))
    batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
    for s in (setup_124, setup_811_accum2):
        _, m = s.step(s.fresh(host_params), batch)
        assert int(m["update_skipped"]) == 0
        assert float(m["loss"]) == 0.0 and float(m["grad_norm"]) == 0.0


def test_mesh_shapes_and_grad_accum_agree(setup_124, setup_811_accum2, host_params):
    """A 1x2x4 (fsdp x tensor) mesh with one microbatch and an 8x1x1 (data) mesh with 2
    accumulated microbatches give the same losses and params (~1e-5): both the partitioning and
    the token-weighted accumulation are exact. (Two compiles instead of three: CPU budget.)"""
    batches = [_weighted(b) for _, b in zip(range(2), iter(_loader()), strict=False)]
    runs = {}
    for name, s in [("dp8_accum2", setup_811_accum2), ("fsdp2_tp4", setup_124)]:
        state, ls = s.fresh(host_params), []
        for b in batches:
            state, m = s.step(state, b)
            ls.append((float(m["loss"]), float(m["grad_norm"]), float(m["tokens"])))
        runs[name] = (ls, jax.device_get(state.params))
    (ref_l, ref_p), (ls, p) = runs["dp8_accum2"], runs["fsdp2_tp4"]
    assert ref_l[0] != ref_l[1]  # the params did move between the two steps
    np.testing.assert_allclose(ls, ref_l, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# orbax's aborted async reads of the corrupt checkpoint report to an already-closed event loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_falls_back(tmp_path: Path, setup_124, host_params, capsys):
    s = setup_124
    state = s.fresh(host_params)
    target = st.abstract_state(state, s.shardings)
    with checkpoint.Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:
        ckpt.save(1, state.replace(step=jnp.int32(1)), {"next_index": 1})
        ckpt.save(2, state.replace(step=jnp.int32(2)), {"next_index": 2})
    data_files = sorted(p for p in (tmp_path / "2" / "state").rglob("*") if p.parent.name == "d")
    assert data_files
    with open(data_files[0], "r+b") as f:  # truncate one array-data file
        f.truncate(0)
    ckpt = checkpoint.Checkpointer(tmp_path, save_every=1, keep=3)
    capsys.readouterr()
    restored, data_state, step = ckpt.restore_latest(target)
    assert step == 1 and int(restored.step) == 1 and data_state == {"next_index": 1}
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "could not be restored" in line]
    assert len(said) == 1 and "step 2" in said[0] and "resuming from step 1" in said[0], said
    assert (tmp_path / "corrupt" / "2").is_dir() and ckpt.all_steps() == [1]
    assert _bitwise_equal(jax.device_get(restored.params), host_params)
    assert ckpt.save(2, restored, {"next_index": 2})  # the run can save step 2 again
    ckpt.close()


@pytest.fixture(scope="module")
def nll_fn():
    return jax.jit(lambda p, b: losses.masked_nll(CFG, p, b)[1]["nll_sum"])


def test_packing_equals_separate_examples(host_params, nll_fn):
    exs = _examples(6, seed=1)
    packed = packing.pack_examples(exs, 32)
    assert packed["tokens"].shape[0] < len(exs)  # something was actually packed together
    for i, ex in enumerate(exs):  # layout: segment ids 1..n, positions restart at 0
        r, seg = packed["example_row"][i], packed["example_segment"][i]
        sel = packed["segments"][r] == seg
        np.testing.assert_array_equal(packed["tokens"][r][sel], ex["tokens"])
        np.testing.assert_array_equal(packed["positions"][r][sel], np.arange(len(ex["tokens"])))
    fields = ("tokens", "loss_mask", "segments", "positions")
    total_packed = float(nll_fn(host_params, {k: packed[k] for k in fields}))
    single = packing.pad_examples(exs, [32])
    per_example = [
        float(nll_fn(host_params, {k: single[k][i : i + 1] for k in fields}))
        for i in range(len(exs))
    ]
    np.testing.assert_allclose(total_packed, sum(per_example), rtol=1e-5)
    # the isolation is what makes this hold: the same rows with one segment id do not match
    merged = {k: packed[k] for k in fields}
    merged["segments"] = (packed["segments"] > 0).astype(np.int32)
    assert abs(float(nll_fn(host_params, merged)) - total_packed) > 1e-3


def test_packing_never_splits():
    with pytest.raises(ValueError, match="never split"):
        packing.pack_examples([{"tokens": np.arange(20), "loss_mask": np.ones(20)}], 16)
    assert packing.bucket_length(17, [16, 32, 64]) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        packing.bucket_length(65, [16, 32, 64])


def test_optimizer_schedule_and_decay_mask():
    sched = optim.make_schedule(OCFG)
    assert np.isclose(float(sched(0)), OCFG.lr / 2) and np.isclose(float(sched(1)), OCFG.lr)
    assert float(sched(5)) < OCFG.lr and float(sched(19)) < 1e-9
    mask = optim.decay_mask(models.param_shapes(CFG))
    assert mask["layers"]["attn"]["wq"] and not mask["layers"]["attn_norm"]["scale"]
    with pytest.raises(ValueError, match="unknown optimizer config keys"):
        optim.OptimConfig.from_dict({"lr": 1.0, "learning_rate": 2.0})


class _WeightedIter:
    """A grain iterator whose batches gain loss_weight; checkpointable like the one it wraps."""

    def __init__(self, it):
        self.it = it

    def __next__(self):
        return _weighted(next(self.it))

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def test_train_loop_writes_metrics_and_resumes(tmp_path: Path, setup_124, host_params):
    from rcgrpo_jax.models import flops
    from rcgrpo_jax.train import loop, metrics

    s = setup_124
    target = st.abstract_train_state(s.opt, models.param_shapes(CFG), s.shardings)
    fpt = flops.flops_per_token(CFG, ROW)

    def run(num_steps, until=None):
        it = _WeightedIter(iter(_loader()))
        ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", save_every=2, keep=5)
        state, _ = loop.restore_or_init(ckpt, target, lambda: s.fresh(host_params), it)
        with metrics.MetricsWriter(
            tmp_path, total_steps=num_steps, initial_step=int(state.step), progress=False
        ) as w:
            state, hist = loop.train_loop(
                s.step,
                state,
                it,
                num_steps,
                checkpointer=ckpt,
                writer=w,
                flops_per_token=fpt,
                peak_flops=1e12,
                until=until,
            )
        ckpt.close()
        return state, hist, ckpt.all_steps()

    state, hist, steps = run(3)
    assert int(state.step) == 3 and [h["step"] for h in hist] == [1, 2, 3]
    assert steps == [2, 3]  # every 2 steps, plus the forced final save
    assert all(h["tokens_per_s"] > 0 and h["mfu"] > 0 for h in hist)
    state, hist, steps = run(4)  # resumes at 3: one more step, from the saved batch position
    assert int(state.step) == 4 and [h["step"] for h in hist] == [1, 2, 3, 4]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and steps == [2, 3, 4]
    asked = []
    until = lambda step, state: asked.append(step) or step >= 5  # noqa: E731
    state, hist, steps = run(8, until)  # stops before step 6, its checkpoint forced
    assert int(state.step) == 5 and asked == [4, 5] and steps[-1] == 5
    state, hist, steps = run(8, until)  # resumed at the stopping step: stops there again
    assert int(state.step) == 5 and asked == [4, 5, 5] and len(hist) == 5
    state, hist, steps = run(6, lambda step, state: asked.append(step) or False)
    assert int(state.step) == 6 and asked == [4, 5, 5, 5]  # not asked at num_steps


def test_prepare_sees_the_whole_batch_before_the_microbatch_split():
    """`make_train_step`'s `prepare` (where the RL step computes its advantages) runs inside
    the jit on the whole batch before it is split into microbatches: a batch-wide statistic it
    adds (the sum over every row) reaches each microbatch's loss whole, not the microbatch's
    own sum (56 and 64 here, rows a, a + 2, ...)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = models.make_mesh((8, 1, 1))
    rep = {"w": NamedSharding(mesh, PartitionSpec())}
    params = {"w": jnp.ones((2,), jnp.float32)}
    opt = optim.make_optimizer(OCFG)
    shardings = st.state_shardings(opt, rep, mesh, params)
    init = st.make_init_state(opt, mesh=mesh, param_shardings=rep, params_like=params)

    def loss_fn(p, batch, rng):
        del rng
        aux = {"total_max": jnp.max(batch["total"]), "rows_sum": jnp.sum(batch["x"] * 0 + 1)}
        return jnp.sum(p["w"]) * jnp.mean(batch["x"]), aux

    prepare = lambda b: {**b, "total": jnp.full_like(b["x"], jnp.sum(b["x"]))}
    step = st.make_train_step(
        loss_fn, opt, mesh=mesh, shardings=shardings, grad_accum=2, prepare=prepare
    )
    x = np.arange(16, dtype=np.float32)
    _, metrics = step(init(params, 0), {"x": x})
    assert float(metrics["total_max"]) == x.sum() == 120
    assert float(metrics["rows_sum"]) == 16  # both microbatches ran
