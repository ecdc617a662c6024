"""Stochastic sampling: distribution checks on a tiny vocabulary, seeds, top-k=1 vs greedy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rcgrpo_jax import models, sampling
from rcgrpo_jax.sampling import core

CFG = models.ModelConfig(
    vocab_size=8,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
)
N = 2048  # rows, each its own random stream: one call draws N independent first tokens
PROMPT = [1, 2, 3]
BUCKETS = sampling.Buckets(cache_min=64)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.fixture(scope="module")
def model():
    # Random weights drawn on the host (no init program to compile).
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: (
            rng.normal(0.0, 0.3, s.shape) + ("scale" in jax.tree_util.keystr(path))
        ).astype(np.float32),
        models.param_shapes(CFG),
    )

    def last_logits():
        return np.asarray(models.forward(CFG, params, np.array([PROMPT])))[0, -1].astype(float)

    # Random init gives a near-uniform softmax: rescale the head so the logits have std 1.2,
    # spread enough that temperature / top-k / top-p change the distribution a lot.
    params["lm_head"] = params["lm_head"] * (1.2 / last_logits().std())
    logits = last_logits()
    assert _softmax(logits).max() < 0.6
    return params, logits


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; bins expecting < 5 draws are pooled, and any
    draw of a token with probability 0 makes the statistic infinite."""
    if np.any(counts[probs == 0] > 0):
        return float("inf"), 1
    exp = probs * counts.sum()
    small = (exp < 5) & (probs > 0)
    obs_b = list(counts[exp >= 5]) + ([counts[small].sum()] if small.any() else [])
    exp_b = list(exp[exp >= 5]) + ([exp[small].sum()] if small.any() else [])
    obs_b, exp_b = np.array(obs_b, float), np.array(exp_b, float)
    return float(((obs_b - exp_b) ** 2 / exp_b).sum()), len(obs_b) - 1


def _first_tokens(params, **kw) -> np.ndarray:
    out = sampling.generate(CFG, params, [PROMPT] * N, 1, buckets=BUCKETS, **kw)
    toks = np.array([t[0] for t in out.tokens])
    return np.bincount(toks, minlength=CFG.vocab_size)


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = order[before < top_p]
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def _top_k(p: np.ndarray, k: int) -> np.ndarray:
    q = np.where(p >= np.sort(p)[-k], p, 0.0)
    return q / q.sum()


def _assert_fits(counts: np.ndarray, want: np.ndarray, wrong: np.ndarray) -> None:
    stat, dof = _chi2(counts, want)
    assert stat < CHI2_999[dof], (stat, dof, counts, want * N)
    # The same draws reject the distribution a plausible bug would produce: the test has power.
    bad, bad_dof = _chi2(counts, wrong)
    assert bad > CHI2_999[bad_dof], (bad, counts, wrong * N)


def test_temperature_follows_distribution(model):
    params, logits = model
    counts = _first_tokens(params, temperature=0.6, seed=0)
    _assert_fits(counts, _softmax(logits / 0.6), wrong=_softmax(logits))


def test_top_k_and_top_p_follow_filtered_distribution(model):
    params, logits = model
    p = _softmax(logits)
    counts = _first_tokens(params, temperature=1.0, top_k=3, seed=1)
    assert np.count_nonzero(counts) == 3
    _assert_fits(counts, _top_k(p, 3), wrong=p)
    counts = _first_tokens(params, temperature=1.0, top_p=0.7, seed=2)
    assert np.count_nonzero(counts) == np.count_nonzero(_nucleus(p, 0.7)) < CFG.vocab_size
    _assert_fits(counts, _nucleus(p, 0.7), wrong=p)


@pytest.fixture(scope="module")
def varied_prompts():
    rng = np.random.default_rng(0)
    return rng.integers(0, CFG.vocab_size, (N, len(PROMPT))).tolist()


def test_seed_reproducible_and_top1_is_greedy(model, varied_prompts):
    params, _ = model
    kw = dict(temperature=1.0, buckets=BUCKETS)
    a = sampling.generate(CFG, params, varied_prompts, 6, seed=5, **kw)
    b = sampling.generate(CFG, params, varied_prompts, 6, seed=5, **kw)
    c = sampling.generate(CFG, params, varied_prompts, 6, seed=6, **kw)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert np.mean([x != y for x, y in zip(a.tokens, c.tokens, strict=True)]) > 0.5

    greedy = sampling.generate(CFG, params, varied_prompts, 6, buckets=BUCKETS)
    top1 = sampling.generate(CFG, params, varied_prompts, 6, top_k=1, seed=7, **kw)
    assert top1.tokens == greedy.tokens
    assert a.tokens != greedy.tokens


def test_argmax_categorical_and_token_logprob_are_jax_own():
    """`core.argmax`/`core.categorical` (two plain reductions, faster on CPU) give exactly the
    indices of `jnp.argmax` and the draws of `jax.random.categorical` (ties, NaN, -inf rows,
    signed zeros and filtered (-inf) logits included), and `core.token_logprob` exactly the
    picked entries of `jax.nn.log_softmax`."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 64, 257)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, 3, [10, 200]] = np.nan
    x[2, 4, :] = -np.inf
    x[2, 5, :] = np.nan
    x[3] = 0.0
    x[3, :, ::3] = -0.0
    x[4] = np.where(x[4] < 0.5, -np.inf, x[4])  # a filtered row
    x = x.reshape(-1, 257)
    fast, ref = jax.jit(core.argmax)(x), jax.jit(lambda v: jnp.argmax(v, axis=-1))(x)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(ref))
    assert fast.dtype == np.int32

    keys = jax.random.split(jax.random.key(3), x.shape[0])
    finite = np.where(np.isnan(x), 0.0, x)
    got = jax.jit(core.categorical)(keys, finite)
    want = jax.jit(jax.vmap(jax.random.categorical))(keys, finite)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    tok = rng.integers(0, 257, finite.shape[0])
    got_lp = jax.jit(core.token_logprob)(finite, tok)
    pick = lambda v, t: jnp.take_along_axis(jax.nn.log_softmax(v), t[:, None], axis=1)[:, 0]
    want_lp = jax.jit(pick)(finite, tok)
    np.testing.assert_array_equal(np.asarray(got_lp), np.asarray(want_lp))
