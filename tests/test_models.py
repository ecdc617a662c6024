"""Model layer: parity with transformers, checkpoint round trips, sharding invariance, errors."""

from __future__ import annotations

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, hf_model_names

from rcgrpo_jax import models, sampling
from rcgrpo_jax.models import attention, decoder, flops, hf_io, sharding
from rcgrpo_jax.models.families import FAMILIES

B, T = 3, 24
# (2, 2, 2): every mesh axis > 1, the rows split over ("data", "fsdp") and the residual's embed
# dimension over "tensor" (`act_embed`), where XLA once swapped the middle rows' shards.
MESHES = [(1, 1, 1), (2, 4, 1), (1, 2, 4), (8, 1, 1), (2, 2, 2)]


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY_VOCAB, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :5] = 0  # left padding of different lengths per row
    mask[2, :13] = 0
    return tokens, mask


@pytest.fixture(scope="module")
def batch8():
    """8 rows of 16 tokens, left-padded by different lengths: every mesh's batch axes divide 8
    rows (3 would be replicated), and at 16 tokens the activations are small beside the
    weights, where the partitioner's choices (and XLA's mistakes) are those of decoding and of
    7B models."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, TINY_VOCAB, (8, 16))
    mask = np.arange(16)[None] >= np.array([0, 5, 13, 0, 3, 7, 1, 10])[:, None]
    return tokens, mask.astype(np.int64)


def torch_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def max_diff(a, b, mask) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask.astype(bool)].max())


@pytest.mark.parametrize("name", hf_model_names())
def test_logits_match_transformers(hf_models, batch, name):
    """Every family, tied and untied, read from transformers' own save: its config as the
    family declares it, its parameter and matmul-weight counts as transformers' modules have
    them (Qwen3's q/k norms in the first, not the second), and its logits."""
    model, path = hf_models[name]
    cfg, params = models.load_hf(path)
    family = name.removesuffix("_tied")
    assert cfg.family == family and cfg.tie_embeddings == name.endswith("_tied")
    assert cfg.qkv_bias == FAMILIES[family].qkv_bias
    assert (cfg.rope_scaling is not None) == (family == "llama")
    assert ("q_norm" in params["layers"]["attn"]) == (family == "qwen3")
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 8
    assert cfg.head_dim == (16 if family == "qwen3" else 8)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert flops.matmul_params(cfg) == sum(w.numel() for w in linear)
    tokens, mask = batch
    ours = models.forward(cfg, params, tokens, mask)
    assert ours.dtype == jnp.float32 and ours.shape == (B, T, TINY_VOCAB)
    assert max_diff(ours, torch_logits(model, tokens, mask), mask) <= 1e-4


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied"])
def test_greedy_generation_matches_transformers(hf_models, batch, name):
    """`sampling.generate` at temperature 0 writes the tokens transformers' greedy `generate`
    writes, on ragged prompts decoded together (the KV cache, q/k norms and rope at every
    position past the prompt)."""
    model, path = hf_models[name]
    cfg, params = models.load_hf(path)
    tokens, _ = batch
    prompts = [[int(t) for t in tokens[i, :n]] for i, n in enumerate((5, 11, 19))]
    out = sampling.generate(cfg, params, prompts, 12)
    want = []
    for p in prompts:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        want.append(g[0, len(p) :].tolist())
    assert len({t for row in want for t in row}) >= 3  # not one token everywhere
    assert np.asarray(out.lengths).tolist() == [12] * 3
    assert np.asarray(out.tokens)[:, :12].tolist() == want


def test_dense_vjp_equals_autodiff():
    """`decoder.dense` only reorders the weight-gradient dot: values equal plain autodiff's. The
    cases cover both orientations (input smaller than the output gradient, and larger)."""
    rng = np.random.default_rng(0)
    cases = [((2, 3, 5), (5, 4), 1, None, jnp.float32), ((2, 3, 4, 6), (4, 6, 5), 2, None,
             jnp.float32), ((2, 3, 5), (5, 7), 1, jnp.float32, jnp.bfloat16)]  # fmt: skip
    for xs, ws, k, out_dtype, dt in cases:
        x = jnp.asarray(rng.standard_normal(xs), dt)
        w = jnp.asarray(rng.standard_normal(ws), dt)
        dims = ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ()))
        ref = lambda x, w, dims=dims, o=out_dtype: jax.lax.dot_general(
            x, w, dims, preferred_element_type=o
        )
        ours = lambda x, w, k=k, o=out_dtype: decoder.dense(x, w, k, o)
        y, vjp = jax.vjp(ours, x, w)
        y_ref, vjp_ref = jax.vjp(ref, x, w)
        assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
        g = jnp.asarray(rng.standard_normal(y.shape), y.dtype)
        tol = 1e-5 if dt == jnp.float32 else 2e-2
        for a, b in zip(vjp(g), vjp_ref(g), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=tol, atol=tol)  # fmt: skip


def test_weighted_values_vjp_equals_autodiff():
    """The attention's probs @ values with its reordered dValues: same values as autodiff."""
    rng = np.random.default_rng(1)
    probs = jnp.asarray(rng.random((2, 2, 3, 5, 7)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((2, 2, 7, 4)), jnp.float32)
    ref = lambda p, v: jnp.einsum("bkgts,bksd->bkgtd", p, v)
    y, vjp = jax.vjp(attention._weighted_values, probs, values)
    y_ref, vjp_ref = jax.vjp(ref, probs, values)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    for a, b in zip(vjp(g), vjp_ref(g), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_attend_causal_equals_dense_attend():
    """Query blocks against their key prefixes (the causal blocks skipped): the dense attention's
    outputs and gradients wherever a query sees a key, with packed segments and a padded tail."""
    b, t, h, kv, d = 2, 200, 4, 2, 8
    assert attention.causal_blocks(t) == 6  # blocks of 34 queries, the last one shorter (30)
    cfg = models.ModelConfig(64, 32, 64, 1, h, kv, d)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    keys_t = jnp.asarray(rng.standard_normal((b, kv, d, t)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, kv, t, d)), jnp.float32)
    seg = np.ones((b, t), np.int32)
    seg[0, 90:] = 2  # a second packed example from slot 90
    seg[1, 150:] = 0  # padding
    seg = jnp.asarray(seg)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention.segment_mask(slots, seg, seg)
    w = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) * (seg > 0)[..., None, None]

    def loss(fn, *xs):
        return (fn(cfg, *xs, mask) * w).sum()

    out = {
        fn: np.asarray(jax.jit(fn, static_argnums=0)(cfg, q, keys_t, values, mask))
        for fn in (attention.attend_causal, attention.attend)
    }
    assert all(o.shape == (b, t, h, d) for o in out.values())
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(
        out[attention.attend_causal][real],
        out[attention.attend][real],
        rtol=1e-5,
        atol=1e-6,
    )
    grad = lambda fn: jax.jit(jax.grad(lambda *xs: loss(fn, *xs), (0, 1, 2)))  # one program each
    grads = grad(attention.attend_causal)(q, keys_t, values)
    refs = grad(attention.attend)(q, keys_t, values)
    for g, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_token_logprobs_chunked_equals_one_chunk(batch):
    """The checkpointed chunks (uneven, padded) give the one-chunk path's values and gradients."""
    cfg = models.ModelConfig(TINY_VOCAB, 32, 64, 2, 4, 2, 8, tie_embeddings=True)
    params = models.init_params(cfg, jax.random.key(0), None)
    tokens, mask = batch
    tokens, segments = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def run(chunk):
        def loss(p):
            logp, ent, valid = models.token_logprobs(
                cfg, p, tokens, positions, segments, chunk=chunk
            )
            return ((logp + 0.1 * ent) * valid).sum(), (logp, ent, valid)

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    (g1, out1), (g5, out5) = run(512), run(5)  # 23 targets: one chunk vs 5 chunks of 5
    for a, b in zip(out1, out5, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g5), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_head_chunk_bounds_logits_bytes():
    """Head chunks shrink when [B, chunk, V] f32 logits per device would pass the byte bound (a
    152k vocabulary at 64 rows: 27 positions, not 512); a mesh divides batch and vocab first."""
    big = models.ModelConfig(152064, 64, 128, 2, 4, 2, 16)
    assert models.api.head_chunk(big.replace(vocab_size=1024), 32) == 512
    assert models.api.head_chunk(big, 64) == (1 << 30) // (4 * 64 * 152064) == 27
    assert models.api.head_chunk(big, 1 << 20) == 16  # never below 16 positions
    with sharding.use_mesh(models.make_mesh((2, 2, 2), jax.devices()[:8])):
        assert models.api.head_chunk(big, 64) == (1 << 30) // (4 * 16 * 76032) == 220


@pytest.mark.parametrize(
    "name, scan", [("qwen2_tied", True), ("llama", True), ("llama", False), ("qwen3", True)]
)
def test_gradients_match_transformers(hf_models, batch, tmp_path, name, scan):
    """d(mean NLL)/d(every weight) equals PyTorch autograd on transformers' model; the torch
    gradients are saved as a checkpoint and read back by our loader, so names and layouts are
    mapped by the same code as the weights. `scan=False`: the unrolled layer loop over the same
    stacked weights (`ModelConfig.scan_layers`)."""
    model, path = hf_models[name]
    tokens, mask = batch
    valid = (mask[:, 1:] * mask[:, :-1]).astype(np.float32)

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -torch.gather(logp, -1, torch.tensor(tokens[:, 1:, None]))[..., 0]
    (nll * torch.tensor(valid)).sum().div(valid.sum()).backward()
    grad_model = copy.deepcopy(model)
    with torch.no_grad():
        for p_grad, p in zip(grad_model.parameters(), model.parameters(), strict=True):
            p_grad.copy_(p.grad)
    model.zero_grad(set_to_none=True)
    grad_model.save_pretrained(str(tmp_path))
    _, torch_grads = models.load_hf(tmp_path)

    cfg, params = models.load_hf(path, scan_layers=scan)

    def loss(params):
        lg = models.forward(cfg, params, tokens, mask)
        lp = jax.nn.log_softmax(lg[:, :-1], -1)
        nll = -jnp.take_along_axis(lp, jnp.asarray(tokens[:, 1:, None]), -1)[..., 0]
        return (nll * valid).sum() / valid.sum()

    ours = jax.grad(loss)(params)
    flat_ours = jax.tree_util.tree_leaves_with_path(ours)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(torch_grads))
    assert len(flat_ours) == len(flat_ref)
    for key, g in flat_ours:
        ref = np.asarray(flat_ref[key])
        scale = max(float(np.abs(ref).max()), 1e-6)
        err = float(np.abs(np.asarray(g) - ref).max()) / scale
        assert err <= 1e-4, (jax.tree_util.keystr(key), err)


def test_family_declaration_is_what_config_json_is_read_and_written_by():
    """An absent key takes the family's transformers default (Qwen3's head_dim is 128, not
    hidden / heads as Qwen2's); what the family cannot run is refused in one line: a
    sliding-window layer, attention biases, a rope type its checkpoints do not use."""
    base = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 1024,
            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 16,
            "num_key_value_heads": 8}  # fmt: skip
    cfg = hf_io.config_from_hf(base)
    assert (cfg.head_dim, cfg.qkv_bias, cfg.family_spec.qk_norm) == (128, False, True)
    assert hf_io.config_from_hf(dict(base, model_type="qwen2")).head_dim == 1024 // 16
    out = hf_io.config_to_hf(cfg, "float32")
    assert out["architectures"] == ["Qwen3ForCausalLM"] and out["attention_bias"] is False
    assert hf_io.config_from_hf(out) == cfg
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    bad = [
        ({"layer_types": ["full_attention", "sliding_attention"]},
         "layer_types sliding_attention not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ({"attention_bias": True}, "qwen3 attention_bias not supported"),
        ({"rope_parameters": llama3}, "rope type 'llama3' is not supported for qwen3"),
    ]  # fmt: skip
    for extra, message in bad:
        with pytest.raises(models.CheckpointError, match=message) as e:
            hf_io.config_from_hf(dict(base, **extra))
        assert "\n" not in str(e.value)
    assert hf_io.config_from_hf(dict(base, model_type="llama", rope_parameters=llama3))


def test_weights_declare_the_dtype_they_are_read_in():
    """`Weight.stored_dtype`: norm scales, Qwen3's per-head q/k norms over head_dim included,
    are read as stored (f32) by the layers and kept so in the sampler's copy; every other
    weight is read in the compute dtype (bf16)."""
    cfg = models.ModelConfig(64, 32, 64, 1, 4, 2, 8, family="qwen3", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.key(0))
    assert params["layers"]["attn"]["q_norm"]["scale"].shape == (1, 8)
    read = decoder.layer_weights(cfg, jax.tree.map(lambda w: w[0], params["layers"]))
    copy = models.sampler_params(cfg, params)
    shapes = models.sampler_param_shapes(cfg)
    assert jax.tree.map(lambda x: x.dtype, copy) == jax.tree.map(lambda s: s.dtype, shapes)
    for layer in (read, copy["layers"][0], shapes["layers"][0]):
        for norm in (layer["attn"]["q_norm"], layer["attn"]["k_norm"], layer["mlp_norm"]):
            assert norm["scale"].dtype == jnp.float32
        assert layer["attn"]["wq"].dtype == layer["mlp"]["w_up"].dtype == jnp.bfloat16


def test_right_padding_matches_unpadded(hf_models):
    """A right-padded row gives the logits of the same tokens alone (positions unaffected)."""
    _, path = hf_models["llama"]
    cfg, params = models.load_hf(path)
    tokens = np.arange(1, 17)[None] % TINY_VOCAB
    alone = models.forward(cfg, params, tokens[:, :10])
    mask = (np.arange(16) < 10).astype(np.int32)[None]
    padded = models.forward(cfg, params, tokens, mask)
    np.testing.assert_allclose(padded[:, :10], alone, atol=1e-5)


@pytest.mark.parametrize("name", hf_model_names())
def test_save_hf_round_trip(hf_models, batch, tmp_path, name):
    from transformers import AutoModelForCausalLM

    _, path = hf_models[name]
    cfg, params = models.load_hf(path)
    models.save_hf(tmp_path / "out", cfg, params)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens, mask = batch
    ours = models.forward(cfg, params, tokens, mask)
    assert max_diff(ours, torch_logits(reloaded, tokens, mask), mask) <= 1e-4
    cfg2, params2 = models.load_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_sharded_checkpoint_files(hf_models, batch, tmp_path):
    """save_hf splits into several files with an index; load_hf reads them back identically."""
    _, path = hf_models["qwen2"]
    cfg, params = models.load_hf(path)
    models.save_hf(tmp_path / "sharded", cfg, params, max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    _, params2 = models.load_hf(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_legacy_rope_scaling_spelling(hf_models, tmp_path):
    """transformers v4 wrote `rope_theta` + `rope_scaling`; v5 writes `rope_parameters`."""
    _, path = hf_models["llama"]
    hf = json.loads((path / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    legacy = dict(hf, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert hf_io.config_from_hf(legacy) == hf_io.config_from_hf(
        json.loads((path / "config.json").read_text())
    )
    assert hf_io.config_from_hf(legacy).rope_scaling.factor == 8.0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sharded_forward_equal_across_meshes(hf_models, batch8, mesh_shape):
    _, path = hf_models["qwen2"]
    cfg, params = models.load_hf(path)
    tokens, mask = batch8
    reference = models.forward(cfg, params, tokens, mask)
    mesh = models.make_mesh(mesh_shape)
    _, sharded = models.load_hf(path, mesh=mesh)  # streamed straight onto the mesh
    wq = sharded["layers"]["attn"]["wq"]
    assert wq.sharding.mesh.shape == dict(zip(sharding.MESH_AXES, mesh_shape, strict=True))
    if mesh_shape[2] > 1:  # heads really are split over the tensor axis
        assert wq.addressable_shards[0].data.shape[2] == cfg.num_heads // mesh_shape[2]
    tok = jax.device_put(jnp.asarray(tokens, jnp.int32))
    with models.use_mesh(mesh):
        out = models.forward(cfg, sharded, tok, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3"])
def test_sharded_gradients_equal_unsharded(hf_models, batch8, name):
    """The training loss's log-probs and gradients (`token_logprobs`, head chunks included) on
    the (2, 2, 2) mesh equal the unsharded ones: the backward has matmuls of its own (dX of
    every projection and of the head) for the partitioner to get wrong. Tied embeddings: the
    head is the transposed embedding, so both of its uses are checked. Qwen3: the per-head
    q/k norms between the head-split projections and rope."""
    _, path = hf_models[name]
    cfg, params = models.load_hf(path)
    tokens, mask = (jnp.asarray(x, jnp.int32) for x in batch8)
    positions = models.positions_from_mask(mask)

    def loss(p):
        logp, ent, valid = models.token_logprobs(cfg, p, tokens, positions, mask, chunk=8)
        return ((logp + 0.1 * ent) * valid).sum(), logp

    step = jax.jit(jax.grad(loss, has_aux=True))
    want_g, want_logp = step(params)
    mesh = models.make_mesh((2, 2, 2))
    _, sharded = models.load_hf(path, mesh=mesh)
    with models.use_mesh(mesh):
        got_g, got_logp = step(sharded)
    np.testing.assert_allclose(np.asarray(got_logp), np.asarray(want_logp), atol=1e-5, rtol=0)
    for (key, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True
    ):
        b = np.asarray(b)
        err = float(np.abs(np.asarray(a) - b).max()) / max(float(np.abs(b).max()), 1e-6)
        assert err <= 1e-5, (jax.tree_util.keystr(key), err)


def test_uneven_axes_are_replicated_and_reported():
    """2 KV heads on a 4-way tensor axis cannot split: replicated, and explain_sharding says so."""
    cfg = models.ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    mesh = models.make_mesh((1, 2, 4))
    shardings = models.param_shardings(cfg, mesh)
    assert shardings["layers"]["attn"]["wk"].spec == jax.sharding.PartitionSpec(
        None, "fsdp", None, None
    )
    assert shardings["layers"]["attn"]["wq"].spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor", None
    )
    notes = sharding.explain_sharding(
        mesh, models.param_logical_axes(cfg), models.param_shapes(cfg)
    )
    assert any("wk" in n for n in notes) and not any("'wq'" in n for n in notes)


def test_resize_vocab_mean_init(hf_models, batch):
    _, path = hf_models["qwen2"]
    cfg, params = models.load_hf(path)
    cfg2, params2 = models.resize_vocab(cfg, params, cfg.vocab_size + 2)
    assert cfg2.vocab_size == cfg.vocab_size + 2
    emb, head = np.asarray(params2["embedding"]), np.asarray(params2["lm_head"])
    np.testing.assert_allclose(
        emb[-2:], np.repeat(emb[:-2].mean(0, keepdims=True), 2, 0), atol=1e-7
    )
    np.testing.assert_allclose(head[:, -1], head[:, :-2].mean(1), atol=1e-7)
    tokens, mask = batch
    old = models.forward(cfg, params, tokens, mask)
    new = models.forward(cfg2, params2, tokens, mask)
    np.testing.assert_allclose(np.asarray(new)[..., : cfg.vocab_size], np.asarray(old), atol=1e-6)


def test_remat_and_bf16(hf_models, batch):
    """Remat changes memory, not results; bf16 compute stays close to f32 with f32 logits."""
    _, path = hf_models["llama"]
    tokens, mask = batch
    cfg, params = models.load_hf(path)
    ref = np.asarray(models.forward(cfg, params, tokens, mask))
    for scan in (True, False):
        cfg_r, params_r = models.load_hf(path, remat="full", scan_layers=scan)
        np.testing.assert_allclose(
            np.asarray(models.forward(cfg_r, params_r, tokens, mask)), ref, atol=1e-6
        )
    cfg_b, params_b = models.load_hf(path, compute_dtype=jnp.bfloat16)
    out = models.forward(cfg_b, params_b, tokens, mask)
    assert out.dtype == jnp.float32 and params_b["embedding"].dtype == jnp.float32
    assert 0 < max_diff(out, ref, mask) < 0.1


def test_bf16_params_load_and_save(hf_models, tmp_path, batch):
    _, path = hf_models["qwen2_tied"]
    cfg, params = models.load_hf(path, dtype=jnp.bfloat16)
    assert params["layers"]["mlp"]["w_up"].dtype == jnp.bfloat16
    models.save_hf(tmp_path / "bf16", cfg, params)
    header_len = int.from_bytes(
        (tmp_path / "bf16" / "model.safetensors").read_bytes()[:8], "little"
    )
    header = json.loads((tmp_path / "bf16" / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16"
    _, again = models.load_hf(tmp_path / "bf16", dtype=jnp.bfloat16)
    jax.tree.map(np.testing.assert_array_equal, params, again)


# ----------------------------------------------------------------------------- bad checkpoints


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_error_missing_or_extra_tensor(hf_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path = hf_models["qwen2"]
    tensors = load_file(str(path / "model.safetensors"))
    d = _copy(path, tmp_path / "missing")
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"},
        str(d / "model.safetensors"),
    )
    with pytest.raises(
        models.CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"
    ):
        models.load_hf(d)
    save_file(
        dict(tensors, **{"model.layers.9.mlp.up_proj.weight": tensors["lm_head.weight"]}),
        str(d / "model.safetensors"),
    )
    with pytest.raises(models.CheckpointError, match=r"unexpected tensors .*model\.layers\.9"):
        models.load_hf(d)


def test_error_wrong_shape_names_file_and_tensor(hf_models, tmp_path):
    _, path = hf_models["qwen2"]
    d = _copy(path, tmp_path / "shape")
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(hf, intermediate_size=80)))
    with pytest.raises(
        models.CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
        r"has shape \(96, 64\), config expects \(80, 64\)",
    ):
        models.load_hf(d)


def test_error_truncated_file(hf_models, tmp_path):
    _, path = hf_models["qwen2"]
    d = _copy(path, tmp_path / "trunc")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(
        models.CheckpointError, match=r"model\.safetensors: not a readable .*truncated"
    ):
        models.load_hf(d)


def test_error_not_a_checkpoint(tmp_path):
    with pytest.raises(models.CheckpointError, match="no config.json"):
        models.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(models.CheckpointError, match="model_type 'gpt2' is not supported"):
        models.load_hf(tmp_path)


# ----------------------------------------------------------------------------- real tokenizers


@pytest.mark.parametrize(
    "name,text,expected",
    [("qwen2.5", "Hello world", [9707, 1879]), ("llama3.1", "hello", [128000, 15339])],
)
def test_real_tokenizers_load(tokenizer_root, name, text, expected):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_root / name))
    assert tok.encode(text) == expected
    assert tok.chat_template and "tools" in tok.chat_template
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert (
        ("<|im_start|>assistant" in rendered)
        if name == "qwen2.5"
        else ("assistant<|end_header_id|>" in rendered)
    )
