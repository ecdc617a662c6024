"""LoRA (`ModelConfig.lora`) against PEFT: the same forward and gradients as a PEFT-wrapped
transformers model with the same adapters, PEFT's adapter files both ways, the merged export
equal to PEFT's `merge_and_unload()`, and the base frozen (no weight gradient computed)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from conftest import TINY_VOCAB, hf_model_names

from rcgrpo_jax.models import api, decoder, hf_io, lora, peft_io, weights
from rcgrpo_jax.models.config import LORA_TARGETS, LoraSpec

TOKENS = np.random.default_rng(0).integers(0, TINY_VOCAB, (2, 12)).astype(np.int32)
TOKEN_IDS = (5, 9)  # the "reward tokens" whose embedding rows train
MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
MODULES |= {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _peft_model(base, targets, tied: bool, seed: int = 1):
    """`base` (a copy) under PEFT's LoRA on `targets`, adapters and token rows all random."""
    ids = list(TOKEN_IDS)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[MODULES[t] for t in targets],
        init_lora_weights=False,  # random B too: the adapters change the logits
        trainable_token_indices=ids if tied else {"embed_tokens": ids, "lm_head": ids},
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "trainable_tokens_delta" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def _logits(cfg, params) -> np.ndarray:
    return np.asarray(api.forward(cfg, params, jnp.asarray(TOKENS)))


@pytest.mark.parametrize("name", hf_model_names())
def test_a_peft_adapter_loads_and_computes_what_peft_does(name, hf_models, tmp_path):
    """PEFT -> ours, every family tied and untied: load_hf of PEFT's saved adapter on its base
    gives PEFT's logits, unmerged (adapters applied in the forward) and merged."""
    base, base_dir = hf_models[name]
    targets = LORA_TARGETS if name.startswith("qwen2") else ("q", "v", "o", "down")
    model = _peft_model(base, targets, tied=name.endswith("_tied"))
    model.save_pretrained(str(tmp_path))
    want = _torch_logits(model)

    cfg, params = hf_io.load_hf(tmp_path, base=base_dir, merge=False)
    assert cfg.lora == LoraSpec(4, 8.0, targets, token_ids=TOKEN_IDS)
    np.testing.assert_allclose(_logits(cfg, params), want, atol=1e-4, rtol=1e-4)
    mcfg, merged = hf_io.load_hf(tmp_path, base=base_dir)
    assert mcfg.lora is None
    np.testing.assert_allclose(_logits(mcfg, merged), want, atol=1e-4, rtol=1e-4)


def _our_adapter(base_dir, targets, key: int = 3):
    """The base of `base_dir` with LoRA on `targets` added by `init_lora`, then B and the token
    rows moved off their init (as training would)."""
    cfg, params = hf_io.load_hf(base_dir)
    cfg = cfg.replace(lora=LoraSpec(4, 8.0, targets, token_ids=TOKEN_IDS))
    params = lora.init_lora(cfg, params, jax.random.key(key))
    trainable, frozen = lora.split(cfg, params)
    leaves, tree = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(key + 1), len(leaves))
    moved = [x + 0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return cfg, lora.join(jax.tree.unflatten(tree, moved), frozen)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "llama"])
def test_our_adapter_loads_in_peft_and_the_merged_export_is_merge_and_unload(
    name, hf_models, tmp_path
):
    """Ours -> PEFT: `save_adapter` loads with `PeftModel.from_pretrained` and gives our logits;
    `save_hf` of the LoRA model equals PEFT's `merge_and_unload()` weight for weight."""
    from transformers import AutoModelForCausalLM

    base, base_dir = hf_models[name]
    cfg, params = _our_adapter(base_dir, ("q", "k", "o", "up", "down"))
    ours = _logits(cfg, params)
    peft_io.save_adapter(tmp_path / "adapter", cfg, params, base_model=str(base_dir))
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(_torch_logits(model), ours, atol=1e-4, rtol=1e-4)

    hf_io.save_hf(tmp_path / "merged", cfg, params)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    unloaded = model.merge_and_unload().state_dict()
    assert set(exported) - {"lm_head.weight"} == set(unloaded) - {"lm_head.weight"}
    for k in unloaded:
        if k in exported:
            np.testing.assert_allclose(exported[k].numpy(), unloaded[k].numpy(), atol=1e-6)
    reread = hf_io.load_hf(tmp_path / "adapter", merge=False)[0]  # base from the adapter's config
    assert reread.lora == cfg.lora


def test_at_init_lora_computes_the_base_exactly(hf_models):
    """B = 0 and token rows copied from the base: the logits are the base's, bit for bit but for
    the token rows' own columns (a separate [E, n] product: another summation order)."""
    cfg, params = hf_io.load_hf(hf_models["qwen2"][1])
    lcfg = cfg.replace(lora=LoraSpec(4, 8.0, token_ids=TOKEN_IDS))
    with_lora = lora.init_lora(lcfg, params, jax.random.key(0))
    ours, base = _logits(lcfg, with_lora), _logits(cfg, params)
    others = np.setdiff1d(np.arange(cfg.vocab_size), TOKEN_IDS)
    np.testing.assert_array_equal(ours[..., others], base[..., others])
    np.testing.assert_allclose(ours[..., list(TOKEN_IDS)], base[..., list(TOKEN_IDS)], atol=1e-6)


def _nll(cfg, params):
    tokens = jnp.asarray(TOKENS)
    logits = api.apply(cfg, params, tokens, *(jnp.broadcast_to(x, tokens.shape) for x in (
        jnp.arange(tokens.shape[1]), jnp.ones((), jnp.int32))))  # fmt: skip
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).sum()


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied"])
def test_gradients_equal_peft(name, hf_models, tmp_path):
    """d(next-token NLL) w.r.t. every adapter and token row equals PEFT's torch gradient."""
    base, base_dir = hf_models[name]
    model = _peft_model(base, LORA_TARGETS, tied=name.endswith("_tied")).train()
    model.save_pretrained(str(tmp_path))
    tokens = torch.tensor(TOKENS, dtype=torch.long)
    logp = torch.log_softmax(model(tokens).logits[:, :-1].float(), -1)
    (-logp.gather(-1, tokens[:, 1:, None]).sum()).backward()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.requires_grad}

    cfg, params = hf_io.load_hf(tmp_path, base=base_dir, merge=False)
    trainable, frozen = lora.split(cfg, params)
    grads = jax.grad(lambda t: _nll(cfg, lora.join(t, frozen)))(trainable)
    checked = 0
    for w in weights.weights(cfg):
        if not w.lora:
            continue
        g = np.asarray(weights.lookup(grads, w.path))
        for i, key in enumerate(hf_io.hf_names(w, cfg)):
            delta = "trainable_tokens_delta"
            torch_key = key.replace(".weight", ".default.weight").replace(delta, delta + ".default")
            ours = hf_io.to_hf(w, g[i] if w.per_layer else g)
            np.testing.assert_allclose(ours, theirs[torch_key], atol=2e-4, rtol=2e-3, err_msg=key)
            checked += 1
    assert checked == len(theirs)


def _dots(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of every dot_general in a jaxpr, sub-jaxprs (scan, remat, ...) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(eqn.outvars[0].aval.shape))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            out.extend(_dots(sub))
    return out


@pytest.mark.parametrize("scan", [True, False])
def test_no_base_weight_gradient_is_computed(scan, hf_models):
    """Under LoRA the backward has no dot with a base weight's shape (the frozen base's dW is
    not computed, `decoder.dense(frozen=True)`), while full fine-tuning's has one per weight."""
    cfg, params = hf_io.load_hf(hf_models["llama"][1], scan_layers=scan)
    lcfg = cfg.replace(lora=LoraSpec(4, 8.0, token_ids=TOKEN_IDS))
    lparams = lora.init_lora(lcfg, params, jax.random.key(0))
    trainable, frozen = lora.split(lcfg, lparams)
    base_shapes = {w.shape(cfg) for w in weights.base_weights(cfg) if len(w.shape(cfg)) > 1}

    full = _dots(jax.make_jaxpr(jax.grad(lambda p: _nll(cfg, p)))(params).jaxpr)
    lora_grad = jax.grad(lambda t: _nll(lcfg, lora.join(t, frozen)))
    adapters = _dots(jax.make_jaxpr(lora_grad)(trainable).jaxpr)
    assert base_shapes & set(full)
    assert not base_shapes & set(adapters), base_shapes & set(adapters)


def test_frozen_dense_passes_the_input_gradient_only():
    x = jax.random.normal(jax.random.key(0), (3, 5, 4))
    w = jax.random.normal(jax.random.key(1), (4, 6))
    f = lambda x, w, frozen: decoder.dense(x, w, 1, None, frozen).sum()
    gx, gw = jax.grad(f, (0, 1))(x, w, True)
    gx_full, gw_full = jax.grad(f, (0, 1))(x, w, False)
    np.testing.assert_array_equal(gx, gx_full)
    assert not np.any(np.asarray(gw)) and np.any(np.asarray(gw_full))


def test_an_unsupported_peft_adapter_is_one_clear_error(hf_models, tmp_path):
    base, base_dir = hf_models["qwen2"]
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    )
    model.save_pretrained(str(tmp_path))
    with pytest.raises(hf_io.CheckpointError, match="use_dora=True is not supported"):
        hf_io.load_hf(tmp_path, base=base_dir)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_the_train_step_trains_the_adapters_and_token_rows_only(base_dtype, hf_models):
    """The generic train step with `frozen`: the state (and Adam's moments) hold the adapters and
    token rows only, in f32 whatever the base's dtype (a bf16 base stays bf16), the base comes
    out bit-identical, and the reward tokens' rows learn (their targets' loss falls) while every
    other embedding row stays the base's."""
    from rcgrpo_jax.models import sharding
    from rcgrpo_jax.train import losses, optim, state

    cfg, params = hf_io.load_hf(hf_models["qwen2"][1], dtype=base_dtype)
    assert cfg.param_dtype == base_dtype
    lcfg = cfg.replace(lora=LoraSpec(4, 8.0, ("q", "v", "down"), token_ids=TOKEN_IDS))
    trainable, frozen = lora.split(lcfg, lora.init_lora(lcfg, params, jax.random.key(0)))
    frozen_before = jax.tree.map(np.asarray, frozen)
    mesh = sharding.make_mesh((1, 1, 1))
    psh = lora.split(lcfg, api.param_shardings(lcfg, mesh))[0]
    opt = optim.make_optimizer(optim.OptimConfig(lr=1e-2, total_steps=20))
    shardings = state.state_shardings(opt, psh, mesh, trainable)
    st = state.init_train_state(trainable, opt, 0, mesh=mesh, param_shardings=psh)
    step = state.make_train_step(
        losses.make_sft_loss(lcfg), opt, mesh=mesh, shardings=shardings, frozen=frozen
    )
    tokens = np.tile(np.array([[3, TOKEN_IDS[0], 7, TOKEN_IDS[1], 11, 2]], np.int32), (4, 1))
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(6, dtype=np.int32), tokens.shape).copy(),
        "segments": np.ones_like(tokens),
        "loss_mask": np.ones_like(tokens),
    }
    first = None
    for _ in range(10):
        st, metrics = step(st, batch)
        first = float(metrics["loss"]) if first is None else first
    assert float(metrics["loss"]) < 0.8 * first
    paths = lambda t: {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)}
    moments = lambda x: hasattr(x, "mu")  # Adam's state: mu and nu, one leaf per param
    adam = [s for s in jax.tree.leaves(st.opt_state, is_leaf=moments) if moments(s)]
    assert adam and all(paths(s.mu) == paths(s.nu) == paths(trainable) for s in adam)
    dtypes = lambda t: {str(x.dtype) for x in jax.tree.leaves(t)}
    assert dtypes(frozen) == {base_dtype}
    assert dtypes(st.params) == {"float32"} == set().union(*(dtypes((s.mu, s.nu)) for s in adam))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, frozen), frozen_before)
    rows = np.asarray(st.params["lora_tokens"]["embedding"])
    assert not np.allclose(rows, np.asarray(params["embedding"])[list(TOKEN_IDS)])
    merged = lora.merge(lcfg, lora.join(st.params, frozen))
    others = np.setdiff1d(np.arange(cfg.vocab_size), TOKEN_IDS)
    np.testing.assert_array_equal(
        np.asarray(merged["embedding"])[others], np.asarray(params["embedding"])[others]
    )


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_the_sampler_reads_merged_or_applies_the_adapters_the_same(name, hf_models):
    """`mesh.sampler_weights`: "tensor"'s copy folds the adapters and token rows into the base
    (`sampler_config` is the base's), "train" applies them on the fly; greedy tokens equal,
    log-probs to f32 rounding, and neither equals the base's own (the adapters are used)."""
    from rcgrpo_jax import models, sampling

    base_cfg, base = hf_io.load_hf(hf_models[name][1])
    cfg, params = _our_adapter(hf_models[name][1], LORA_TARGETS)
    prompts = [list(TOKENS[0][:7]), list(TOKENS[1]), [int(TOKEN_IDS[0]), *TOKENS[0][:4]]]
    out = {}
    for layout in models.SAMPLER_WEIGHTS:
        scfg = models.sampler_config(cfg, layout)
        assert (scfg.lora is None) == (layout == "tensor")
        sp = models.sampler_params(cfg, params, layout)
        out[layout] = sampling.generate(scfg, sp, prompts, 10, lanes=1)
    own = sampling.generate(base_cfg, base, prompts, 10, lanes=1)
    assert out["tensor"].tokens == out["train"].tokens != own.tokens
    for a, b in zip(out["tensor"].logprobs, out["train"].logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
