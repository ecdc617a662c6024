"""The sampler on the 2x2x2 virtual CPU mesh gives the tokens of the unsharded run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rcgrpo_jax import models, sampling

BUCKETS = sampling.Buckets(cache_min=256, chunk_min=32, chunk_max=32)  # as in test_sampler.py
PROMPT_LENS = (5, 17, 11, 6)


@pytest.fixture(scope="module")
def pair(hf_models):
    mesh = models.make_mesh((2, 2, 2))
    return models.load_hf(hf_models["qwen2"][1]), models.load_hf(hf_models["qwen2"][1], mesh=mesh)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("kw", [{}, dict(temperature=0.8, top_k=20, seed=3)])
def test_sharded_generate_matches_unsharded(pair, kw):
    (cfg, params), (_, sharded) = pair
    prompts = _prompts(cfg.vocab_size)
    want = sampling.generate(cfg, params, prompts, 32, buckets=BUCKETS, **kw)
    got = sampling.generate(cfg, sharded, prompts, 32, buckets=BUCKETS, **kw)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_sharded_session_keeps_cache_sharded(pair):
    (cfg, params), (_, sharded) = pair
    prompts = _prompts(cfg.vocab_size)
    turns = []
    for p in (params, sharded):
        sess = sampling.Session(cfg, p, buckets=BUCKETS)
        sess.start(prompts)
        a = sess.decode_turn(8)
        sess.append({0: [4, 5, 6], 2: list(range(3, 30))})
        b = sess.decode_turn(8)
        turns.append((a.tokens, b.tokens))
    assert turns[0] == turns[1]
    assert sess.mesh is not None
    for buf in sess.state.cache.k + sess.state.cache.v:  # [B, KV, S, D] per layer
        spec = buf.sharding.spec
        assert tuple(spec)[:2] == (("data", "fsdp"), "tensor"), spec


def test_the_tensor_layout_copy_samples_the_tokens_of_the_training_weights(pair):
    """`models.sampler_params(..., "tensor")`: per-layer weights over the tensor axis only (no
    FSDP gather in the sampler's programs), the same tokens as the training layout's."""
    (cfg, params), (_, sharded) = pair
    copy = models.sampler_params(cfg, sharded, "tensor")
    assert isinstance(copy["layers"], tuple) and len(copy["layers"]) == cfg.num_layers
    for w in jax.tree.leaves(copy):
        assert not {"data", "fsdp"} & set(jax.tree.leaves(tuple(w.sharding.spec))), w.sharding
    prompts = _prompts(cfg.vocab_size)
    kw = dict(temperature=0.8, top_k=20, seed=3, buckets=BUCKETS)
    want = sampling.generate(cfg, sharded, prompts, 32, **kw)
    got = sampling.generate(cfg, copy, prompts, 32, **kw)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
