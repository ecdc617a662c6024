"""Attention kernels: flash / splash / the cuDNN wrapper equal the dense path (values and
gradients, f32; flash also in bf16) under the one masking rule, with packing and left/right
padding; flash through the model matches transformers at T >= 2048, the sampler's prefill/decode
and, sharded, the dense gradients; the `auto` choice per backend (and what the model really
runs); its memory grows linearly with T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, make_hf_model

from rcgrpo_jax import models, sampling
from rcgrpo_jax.models import attention

H, KV, D = 4, 2, 8
CFG = models.ModelConfig(64, 32, 64, 1, H, KV, D)


def _qkv(b: int, t: int, s: int, d: int = D, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, H, d)), jnp.float32)
    keys_t = jnp.asarray(rng.standard_normal((b, KV, d, s)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, KV, s, d)), jnp.float32)
    return q, keys_t, values


def _segments(t: int) -> jnp.ndarray:
    """Row 0: two packed examples; row 1: right padding; row 2: left padding; row 3: full."""
    seg = np.ones((4, t), np.int32)
    seg[0, t // 3 :] = 2
    seg[1, 3 * t // 4 :] = 0
    seg[2, : t // 5] = 0
    return jnp.asarray(seg)


def _assert_same(fn, ref, q, keys_t, values, real, tol=1e-5):
    """Values at the real queries and the gradients of a loss over them (padding queries'
    outputs are never read, so the loss weights them 0)."""
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    w = w * jnp.asarray(real)[..., None, None]

    @jax.jit
    def value_and_grads(q, keys_t, values):
        out = {}
        for name, f in (("fn", fn), ("ref", ref)):
            loss = lambda *x, f=f: (f(*x) * w).sum()  # noqa: E731
            out[name] = (f(q, keys_t, values), jax.grad(loss, (0, 1, 2))(q, keys_t, values))
        return out

    res = value_and_grads(q, keys_t, values)
    (out, grads), (want, refs) = res["fn"], res["ref"]
    assert out.shape == want.shape == q.shape
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want)[real], rtol=tol, atol=tol)
    for g, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=tol, atol=tol)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("t, block", [(200, 64), (131, 32), (96, 512)])
def test_flash_self_attention_equals_dense(t, block):
    """Several blocks, lengths that are not a multiple of the block, one block only."""
    seg = _segments(t)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    mask = attention.segment_mask(slots, seg, seg)
    q, keys_t, values = _qkv(4, t, t)

    def fn(*x):
        return attention.flash(CFG, *x, slots, seg, seg, block=block)

    _assert_same(fn, lambda *x: attention.attend(CFG, *x, mask), q, keys_t, values, seg > 0)
    out = jax.jit(fn)(q, keys_t, values)
    assert float(jnp.abs(out[~np.asarray(seg > 0)]).max()) == 0.0  # padding queries: zeros


def test_flash_bf16_close_to_f32_dense():
    """bf16 q/k/v through flash (f32 softmax statistics and accumulators inside) against the f32
    dense path on the same rounded inputs: values and gradients within bf16's rounding (~2^-8
    per element, so 2e-2 of the norm), padding queries still exactly zero."""
    t = 200
    seg = _segments(t)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    mask = attention.segment_mask(slots, seg, seg)
    bf16 = [x.astype(jnp.bfloat16) for x in _qkv(4, t, t)]
    real = np.asarray(seg > 0)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(bf16[0].shape), jnp.float32)
    w = w * jnp.asarray(real)[..., None, None]

    def flash(*x):
        return attention.flash(CFG.replace(dtype="bfloat16"), *x, slots, seg, seg, block=64)

    def dense(*x):
        return attention.attend(CFG, *(y.astype(jnp.float32) for y in x), mask)

    @jax.jit
    def run(*x):
        out = {}
        for name, f in (("flash", flash), ("dense", dense)):
            loss = lambda *y, f=f: (f(*y).astype(jnp.float32) * w).sum()  # noqa: E731
            out[name] = (f(*x), jax.grad(loss, (0, 1, 2))(*x))
        return out

    res = run(*bf16)
    (out, grads), (want, refs) = res["flash"], res["dense"]
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    assert _rel_err(np.asarray(out, np.float32)[real], np.asarray(want)[real]) < 2e-2
    assert float(jnp.abs(out.astype(jnp.float32)[~real]).max()) == 0.0
    for g, r in zip(grads, refs, strict=True):
        assert _rel_err(g, r) < 2e-2


def test_flash_skips_blocks_nobody_sees():
    """Causal diagonal, a padded tail and disjoint packed segments each remove blocks."""
    t = 256
    seg = np.zeros((2, t), np.int32)
    seg[0, :64], seg[0, 64:160] = 1, 2  # row 0: two examples, then padding
    seg[1, :100] = 1
    seg = jnp.asarray(seg)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    live = np.asarray(attention.block_liveness(slots, seg, seg, attention.flash_blocks(t, t, 32)))
    assert live.shape == (8, 8)
    assert not np.triu(live, 1).any()  # above the diagonal
    assert not live[5:].any() and not live[:, 5:].any()  # slots >= 160: padding in both rows
    # Query block 4 (slots 128..159) holds only row 0's example 2, which starts at slot 64:
    # key blocks 0-1 (example 1 in row 0, nothing row 1's padding queries could use) are dead.
    assert not live[4, :2].any() and live[4, 2:5].all()
    assert live[3, :4].all()  # row 1's example spans blocks 0..3


def test_flash_cached_chunk_equals_dense():
    """Prefill shape: a chunk of queries at per-row cache offsets over a longer cache whose
    tail is empty; also a one-query decode step."""
    s, t = 320, 24
    start = jnp.asarray([0, 37, 150, 290], jnp.int32)
    lens = jnp.asarray([24, 10, 24, 5], jnp.int32)
    kv_seg = (jnp.arange(s)[None] < (start + lens)[:, None]).astype(jnp.int32)
    for tq in (t, 1):
        q_slot = start[:, None] + jnp.arange(tq, dtype=jnp.int32)[None]
        q_seg = (jnp.arange(tq)[None] < lens[:, None]).astype(jnp.int32)
        mask = attention.segment_mask(q_slot, q_seg, kv_seg)
        q, keys_t, values = _qkv(4, tq, s, seed=tq)

        def fn(*x, q_slot=q_slot, q_seg=q_seg):
            return attention.flash(CFG, *x, q_slot, q_seg, kv_seg, block=64)

        ref = lambda *x, mask=mask: attention.attend(CFG, *x, mask)  # noqa: E731
        _assert_same(fn, ref, q, keys_t, values, q_seg > 0)


def test_splash_interpret_equals_dense():
    """Pallas splash attention in interpret mode (CPU), unsharded and shard_mapped over a
    (data, fsdp, tensor) mesh; its causal + segment-id mask gives the rule's real rows."""
    t = 200  # padded to 256 inside: two 128-blocks
    seg = _segments(t)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    mask = attention.segment_mask(slots, seg, seg)
    q, keys_t, values = _qkv(4, t, t, d=16)
    cfg = CFG.replace(head_dim=16, attention="splash")

    def fn(*x):
        return attention.splash(cfg, *x, seg, seg, interpret=True)

    _assert_same(fn, lambda *x: attention.attend(cfg, *x, mask), q, keys_t, values, seg > 0)
    with models.use_mesh(models.make_mesh((2, 2, 2), jax.devices()[:8])):
        sharded = jax.jit(fn)(q, keys_t, values)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(sharded)[real], np.asarray(fn(q, keys_t, values))[real],
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    # off a TPU only the explicit test switch runs the (slow) Pallas interpreter
    with pytest.raises(ValueError, match="splash attention needs a TPU"):
        attention.splash(cfg, q, keys_t, values, seg, seg)


def test_auto_choice_per_backend_and_cudnn_errors(hf_models):
    kw = dict(self_attn=True, head_dim=128, dtype=jnp.bfloat16)
    assert attention.resolve("auto", backend="cpu", kv_len=1024, **kw) == "dense"
    assert attention.resolve("auto", backend="cpu", kv_len=1025, **kw) == "flash"
    assert attention.resolve("auto", backend="tpu", kv_len=64, **kw) == "splash"
    assert attention.resolve("auto", backend="tpu", kv_len=64, **dict(kw, head_dim=16)) == "flash"
    assert attention.resolve("auto", backend="gpu", kv_len=64, **kw) == "cudnn"
    assert attention.resolve("auto", backend="gpu", kv_len=64, **dict(kw, dtype=jnp.float32)) == (
        "flash"
    )
    cached = dict(kw, self_attn=False)
    for kind in ("auto", "flash", "splash"):  # per-row cache offsets: dense or flash only
        assert attention.resolve(kind, backend="tpu", kv_len=4096, **cached) == "flash"
    assert attention.resolve("cudnn", backend="gpu", kv_len=64, **cached) == "flash"
    for backend in ("cpu", "tpu", "gpu"):  # cached under auto: CPU's rule on every backend
        assert attention.resolve("auto", backend=backend, kv_len=1024, **cached) == "dense"
        assert attention.resolve("auto", backend=backend, kv_len=1025, **cached) == "flash"
    with pytest.raises(ValueError, match="splash.*needs a TPU"):
        attention.resolve("splash", backend="cpu", kv_len=64, **kw)
    assert attention.resolve("cudnn", backend="gpu", kv_len=64, **kw) == "cudnn"
    with pytest.raises(ValueError, match="cudnn.*GPU"):
        attention.resolve("cudnn", backend="cpu", kv_len=64, **kw)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        attention.resolve("cudnn", backend="gpu", kv_len=64, **dict(kw, dtype=jnp.float32))
    with pytest.raises(ValueError, match="attention="):
        models.ModelConfig(64, 32, 64, 1, H, KV, D, attention="fast")
    cfg, params = models.load_hf(hf_models["qwen2"][1], attention="cudnn")
    with pytest.raises(ValueError, match="needs a GPU backend"):
        models.forward(cfg, params, np.ones((1, 8), np.int32))
    seg = jnp.asarray([[1, 1, 0], [1, 1, 1]])
    assert bool(attention.one_segment_rows(seg))
    assert not bool(attention.one_segment_rows(seg.at[0, 0].set(0)))  # left padding
    assert not bool(attention.one_segment_rows(seg.at[1, 2].set(2)))  # packed


def test_cudnn_lengths_and_padding_rows():
    """The cuDNN wrapper's per-row lengths are >= 1 (an all-padding row, which counts as a
    one-segment row, would otherwise normalise over no keys) and its padding queries come out
    zero. The same call through XLA (cuDNN needs a GPU) checks the wrapper on CPU: right-padded
    rows equal dense, values and gradients finite."""
    t = 40
    seg = np.ones((3, t), np.int32)
    seg[0], seg[1, 25:] = 0, 0
    seg = jnp.asarray(seg)
    np.testing.assert_array_equal(np.asarray(attention.cudnn_lengths(seg)), [1, 25, 40])
    assert bool(attention.one_segment_rows(seg))
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    mask = attention.segment_mask(slots, seg, seg)
    q, keys_t, values = _qkv(3, t, t)

    def fn(*x):
        return attention.cudnn(CFG, *x, seg, implementation="xla")

    real = np.asarray(seg > 0)
    _assert_same(fn, lambda *x: attention.attend(CFG, *x, mask), q, keys_t, values, real)
    out = np.asarray(jax.jit(fn)(q, keys_t, values))
    assert np.isfinite(out).all() and float(np.abs(out[~real]).max()) == 0.0


def test_auto_runs_flash_in_the_model_beyond_dense_max_len(monkeypatch):
    """`auto` on CPU: the decoder's attention really is dense at 1024 keys and flash at 1025
    (the kind of the `Mask` the model builds, seen while tracing)."""
    assert jax.default_backend() == "cpu"
    cfg = models.ModelConfig(TINY_VOCAB, 32, 64, 1, H, KV, D)
    assert cfg.attention == "auto"
    params = models.param_shapes(cfg)  # (init builds a mask of its own)
    seen = []
    prepare = attention.prepare

    def spy(*args, **kw):
        m = prepare(*args, **kw)
        seen.append((m.kind, m.kv_seg.shape[1], m.live is not None))
        return m

    monkeypatch.setattr(attention, "prepare", spy)

    def logprobs(p, tok):
        pos = jnp.broadcast_to(jnp.arange(tok.shape[1]), tok.shape)
        return models.token_logprobs(cfg, p, tok, pos, jnp.ones_like(tok))

    for t in (1024, 1025):
        jax.eval_shape(logprobs, params, jax.ShapeDtypeStruct((1, t), jnp.int32))
    assert seen == [("dense", 1024, False), ("flash", 1025, True)]


def test_model_flash_equals_dense_packed_and_padded():
    """The decoder through flash (3 blocks of 367 at T = 1100): token log-probs and every
    weight's gradient equal the dense decoder's, with packing and left/right padding."""
    cfg = models.ModelConfig(TINY_VOCAB, 32, 64, 1, H, KV, D, attention="dense")
    params = models.init_params(cfg, jax.random.key(0), None)
    t = 1100
    seg = _segments(t)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TINY_VOCAB, seg.shape), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg > 0, axis=1) - 1, 0)

    def run(kind):
        def loss(p):
            c = cfg.replace(attention=kind)
            logp, ent, valid = models.token_logprobs(c, p, tokens, positions, seg)
            return ((logp + 0.1 * ent) * valid).sum(), (logp, valid)

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    (g_flash, (lp_flash, valid)), (g_dense, (lp_dense, _)) = run("flash"), run("dense")
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(lp_flash)[valid], np.asarray(lp_dense)[valid],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    for a, b in zip(jax.tree.leaves(g_flash), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_flash_logits_match_transformers_long(tmp_path):
    """T = 2048 (4 blocks of 512) through flash, left padding on one row: transformers' logits."""
    model = make_hf_model("qwen2", tmp_path, layers=1, seed=1)
    cfg, params = models.load_hf(tmp_path, attention="flash")
    t = 2048
    tokens = np.random.default_rng(4).integers(0, TINY_VOCAB, (2, t))
    mask = np.ones((2, t), np.int64)
    mask[1, :700] = 0
    ours = np.asarray(models.forward(cfg, params, tokens, mask))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
    ref = ref.logits.float().numpy()
    real = mask.astype(bool)
    assert float(np.abs(ours - ref)[real].max()) <= 1e-4


def test_sampler_flash_equals_dense(hf_models, monkeypatch):
    """Prefill chunks and decode steps through flash (32-slot blocks: several per cache) give
    the dense sampler's greedy tokens and log-probs. The block length is a config field, so
    the sampler's jitted programs are traced (and cached) for it: the masks they build hold
    several key blocks."""
    cfg, params = models.load_hf(hf_models["llama"][1], attention="dense")
    prompts = [np.random.default_rng(i).integers(3, TINY_VOCAB, n).tolist()
               for i, n in enumerate((70, 33, 101))]  # fmt: skip
    buckets = sampling.Buckets(cache_min=64, chunk_min=32, chunk_max=32)
    dense = sampling.generate(cfg, params, prompts, 12, buckets=buckets)
    key_blocks = []
    prepare = attention.prepare

    def spy(*args, **kw):
        m = prepare(*args, **kw)
        if not m.self_attn:  # the sampler's cached attention only
            key_blocks.append(m.live.shape[1] if m.kind == "flash" else 0)
        return m

    monkeypatch.setattr(attention, "prepare", spy)
    flash_cfg = cfg.replace(attention="flash", flash_block=32)
    flash = sampling.generate(flash_cfg, params, prompts, 12, buckets=buckets)
    assert key_blocks and min(key_blocks) >= 2, key_blocks  # prefill and decode traced, blocked
    assert flash.tokens == dense.tokens
    for a, b in zip(flash.logprobs, dense.logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_flash_memory_grows_linearly():
    """Compiled temp memory of a train-style gradient at T = 1k/2k/4k: flash's grows linearly
    (the 2k -> 4k increment is twice the 1k -> 2k one; block-sized buffers are a constant); the
    dense path's [T, T] scores make its increment grow ~4x."""
    cfg = models.ModelConfig(TINY_VOCAB, 32, 64, 1, H, KV, D, remat="full", attention="flash")
    params = models.param_shapes(cfg)

    def temps(c, lengths):
        out = []
        for t in lengths:

            def loss(p, tok, t=t):
                pos = jnp.broadcast_to(jnp.arange(t), tok.shape)
                logp, _, valid = models.token_logprobs(c, p, tok, pos, jnp.ones_like(tok))
                return (logp * valid).sum()

            tok = jax.ShapeDtypeStruct((1, t), jnp.int32)
            compiled = jax.jit(jax.grad(loss)).lower(params, tok).compile()
            out.append(compiled.memory_analysis().temp_size_in_bytes)
        return out

    flash = temps(cfg, (1024, 2048, 4096))
    assert 1.6 < (flash[2] - flash[1]) / (flash[1] - flash[0]) < 2.8, flash
    dense = temps(cfg.replace(attention="dense"), (512, 1024, 2048))
    assert (dense[2] - dense[1]) / (dense[1] - dense[0]) > 3.5, dense
    assert dense[2] > 4 * flash[1], (dense, flash)  # both at T = 2048


def test_flash_sharded_equals_dense(hf_models):
    """Flash on a (2, 2, 2) mesh (batch over data x fsdp, heads over tensor) at T = 320 (three
    128-blocks), left and right padding: the unsharded dense token log-probs and every weight's
    gradient (the backward's dq/dk/dv loops under the same sharding constraints)."""
    cfg, params = models.load_hf(hf_models["qwen2"][1], attention="dense")
    t = 320
    seg = np.ones((4, t), np.int32)
    seg[1, :50], seg[2, 200:] = 0, 0
    seg = jnp.asarray(seg)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, TINY_VOCAB, (4, t)), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)

    def grads(c, p):
        def loss(p):
            logp, _, valid = models.token_logprobs(c, p, tokens, positions, seg)
            return (logp * valid).sum(), (logp, valid)

        return jax.jit(jax.grad(loss, has_aux=True))(p)

    g_dense, (lp_dense, valid) = grads(cfg, params)
    mesh = models.make_mesh((2, 2, 2), jax.devices()[:8])
    sharded = jax.device_put(params, models.param_shardings(cfg, mesh))
    with models.use_mesh(mesh):
        g_flash, (lp_flash, _) = grads(cfg.replace(attention="flash", flash_block=128), sharded)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(lp_flash)[valid], np.asarray(lp_dense)[valid],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    for a, b in zip(jax.tree.leaves(g_flash), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
