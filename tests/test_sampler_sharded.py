"""The sampler on the 2x2x2 virtual CPU mesh gives the tokens of the unsharded run; on a 1x1x2
mesh it never runs far ahead of the device (the XLA:CPU hang of `session.MAX_PROGRAMS_AHEAD`)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config

from rcgrpo_jax import models, sampling
from rcgrpo_jax.sampling import core, session

# As in test_sampler.py.
BUCKETS = sampling.Buckets(batch_min=4, cache_min=256, chunk_min=32, chunk_max=32)
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


def _stalled(params, gate: threading.Event, waited_out: list):
    """`params` again, as the output of a program that waits on the host until `gate` is set:
    every program that reads them queues behind it, however fast the host dispatches. A wait
    that ends without the gate (60 s) is recorded in `waited_out`."""

    def wait() -> np.ndarray:
        if not gate.wait(60):
            waited_out.append(True)
        return np.ones((), np.float32)

    def stall(p):
        one = jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32))
        return jax.tree.map(lambda w: w * one.astype(w.dtype), p)

    return jax.jit(stall, out_shardings=jax.tree.map(lambda w: w.sharding, params))(params)


def test_a_long_prompt_is_prefilled_at_most_a_few_programs_ahead_of_the_device(monkeypatch):
    """A 40-chunk prompt on a 1x1x2 mesh (tensor axis 2): while the device is held up, the host
    dispatches at most MAX_PROGRAMS_AHEAD programs, then waits. Unpaced, it queued 31 chunks, up
    to XLA:CPU's limit per device, where with as many client threads as devices the next launch
    and half of an all-reduce could wait on each other for ever (qwen7b's e2e on mesh (1, 1, 2)).

    The device is released by whichever comes first: the host waiting for it (the pacing), or
    the host dispatching one program more than allowed (which fails below). Neither depends on
    how fast the host is."""
    cfg = tiny_model_config(qkv_bias=True)
    mesh = models.make_mesh((1, 1, 2))
    params = models.init_params(cfg, jax.random.key(0), mesh)
    buckets = sampling.Buckets(chunk_min=16, chunk_max=16, cache_min=64)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 40 * 16).tolist()
    want = sampling.generate(cfg, params, [prompt], 2, mesh=mesh, buckets=buckets)  # compiles

    gate, waited_out = threading.Event(), []
    stalled = _stalled(params, gate, waited_out)
    while_stalled, opened_by = [], []
    prefill, block = core.prefill, jax.block_until_ready

    def counted(*args, **kwargs):
        while_stalled.append(not gate.is_set())
        if sum(while_stalled) > session.MAX_PROGRAMS_AHEAD and not gate.is_set():
            opened_by.append("too far ahead")
            gate.set()
        return prefill(*args, **kwargs)

    def host_waits(x):
        if not gate.is_set():
            opened_by.append("host waited")
            gate.set()
        return block(x)

    monkeypatch.setattr(core, "prefill", counted)
    monkeypatch.setattr(jax, "block_until_ready", host_waits)
    try:
        got = sampling.generate(cfg, stalled, [prompt], 2, mesh=mesh, buckets=buckets)
    finally:
        gate.set()
    assert len(while_stalled) == 40 and while_stalled[0]
    assert sum(while_stalled) <= session.MAX_PROGRAMS_AHEAD
    assert opened_by == ["host waited"] and not waited_out
    assert got.tokens == want.tokens
