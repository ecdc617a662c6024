"""Sampler correctness against transformers and against fresh prefills of the whole history."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_model_config

from rcgrpo_jax import models, sampling
from rcgrpo_jax.models import decoder
from rcgrpo_jax.sampling import core, forward

PROMPT_LENS = (5, 17, 11, 6)  # ragged: lengths differ by >= 5
NEW = 32
# One cache length and one prefill chunk length for every call in this module (longer histories
# are prefilled in several chunks), so the tests share a few compiled programs; rows from 4, so
# that compaction to fewer rows happens with the module's handful of prompts.
BUCKETS = sampling.Buckets(batch_min=4, cache_min=256, chunk_min=32, chunk_max=32)


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """transformers' generate is ~6x slower with oversubscribed threads on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hf_greedy(model, prompt: list[int], new: int, eos: list[int] | None) -> list[int]:
    """transformers greedy generation of one unpadded row (the exact reference)."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(model, prompt: list[int], new: list[int]) -> np.ndarray:
    """log p(new[j] | prompt + new[:j]) from one full transformers forward pass, in f32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1).numpy()
    return np.array([logp[len(prompt) - 1 + j, t] for j, t in enumerate(new)])


@pytest.fixture(scope="module")
def loaded(hf_models):
    return {name: models.load_hf(hf_models[name][1]) for name in ("qwen2", "llama")}


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_greedy_matches_transformers_with_stops(hf_models, loaded, name):
    torch_model = hf_models[name][0]
    cfg, params = loaded[name]
    prompts = _prompts(cfg.vocab_size)
    out = sampling.generate(cfg, params, prompts, NEW, buckets=BUCKETS)
    assert out.lengths == [NEW] * len(prompts)
    for p, got, lp in zip(prompts, out.tokens, out.logprobs, strict=True):
        assert got == _hf_greedy(torch_model, p, NEW, None)
        np.testing.assert_allclose(lp, _hf_logprobs(torch_model, p, got), atol=1e-4, rtol=0)

    # Stop tokens: two ids taken from the middle of two rows' greedy outputs.
    stops = [out.tokens[0][9], out.tokens[2][4]]
    cut = sampling.generate(cfg, params, prompts, NEW, stop_token_ids=stops, buckets=BUCKETS)
    assert any(n < NEW for n in cut.lengths)
    for p, full, got, hit in zip(prompts, out.tokens, cut.tokens, cut.stopped, strict=True):
        first = next((i for i, t in enumerate(full) if t in stops), None)
        assert got == (full if first is None else full[: first + 1])  # stop token kept
        assert hit == (first is not None)
        if first is not None:
            assert got == _hf_greedy(torch_model, p, NEW, stops)

    # Per-row stop sets: each row only honours its own.
    per_row = [[stops[0]], [], [stops[1]], []]
    own = sampling.generate(cfg, params, prompts, NEW, stop_token_ids=per_row, buckets=BUCKETS)
    for full, got, mine in zip(out.tokens, own.tokens, per_row, strict=True):
        first = next((i for i, t in enumerate(full) if t in mine), None)
        assert got == (full if first is None else full[: first + 1])


def test_sampled_logprobs_equal_full_forward(hf_models, loaded):
    """Log-probs of sampled (top-k filtered) tokens are the unfiltered policy's, at T=1."""
    torch_model = hf_models["qwen2"][0]
    cfg, params = loaded["qwen2"]
    prompts = _prompts(cfg.vocab_size)
    out = sampling.generate(
        cfg, params, prompts, NEW, temperature=0.8, top_k=20, seed=3, buckets=BUCKETS
    )
    for p, g, lp in zip(prompts, out.tokens, out.logprobs, strict=True):
        assert len(lp) == len(g) == NEW
        np.testing.assert_allclose(lp, _hf_logprobs(torch_model, p, g), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "llama"])
def test_cached_forward_equals_training_forward(hf_models, name, monkeypatch):
    """Logits of a ragged prefill chunk, then of 3 one-token decode steps written at each row's
    end, equal the training forward's (scanned and unrolled) over the same tokens; both run
    through `decoder.decoder_layer`."""
    cfg, params = models.load_hf(hf_models[name][1])
    lens, steps, width = np.array([5, 11, 8], np.int32), 3, 12  # chunk [3, 12], right-padded
    rng = np.random.default_rng(4)
    seqs = [rng.integers(3, cfg.vocab_size, n + steps).astype(np.int32) for n in lens]
    chunk = np.zeros((3, width), np.int32)
    for r, n in enumerate(lens):
        chunk[r, :n] = seqs[r][:n]
    new = np.stack([s[n:] for s, n in zip(seqs, lens, strict=True)])
    calls = {"cached": 0, "training": 0}
    layer = decoder.decoder_layer

    def spy(cfg, p, x, positions, mask, slot=None, kv_write=None):
        calls["training" if slot is None else "cached"] += 1
        return layer(cfg, p, x, positions, mask, slot, kv_write)

    monkeypatch.setattr(decoder, "decoder_layer", spy)

    @jax.jit
    def cached(params, chunk, lens, new):
        weights = decoder.unstack_layers(cfg, params)
        cache = forward.init_cache(cfg, 3, 32)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), chunk.shape)
        segments = (positions < lens[:, None]).astype(jnp.int32)
        logits, cache = forward.apply_cached(cfg, weights, chunk, positions, segments, cache)
        cache = cache.replace(end=lens)  # as `core.prefill`: the padding slots are free again
        out = [jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0]]
        for j in range(steps):
            end = cache.end[:, None]
            step, cache = forward.apply_cached(
                cfg, weights, new[:, j : j + 1], end, jnp.ones_like(end), cache
            )
            out.append(step[:, 0])
        return jnp.stack(out, axis=1)  # [B, 1 + steps, V]: after the prompt, then each new token

    got = np.asarray(cached(params, chunk, lens, new))
    assert calls == {"cached": cfg.num_layers * (1 + steps), "training": 0}
    for scan in (True, False):
        c = cfg.replace(scan_layers=scan)
        train = jax.jit(
            lambda p, t, c=c: models.apply(c, p, t, jnp.arange(t.shape[1])[None], jnp.ones_like(t))
        )
        for r, n in enumerate(lens):
            full = np.asarray(train(params, seqs[r][None]))[0]
            np.testing.assert_allclose(got[r], full[n - 1 : n + steps], rtol=1e-5, atol=1e-5)
    assert calls["training"] > 0


def test_multi_turn_continuation_equals_fresh_prefill(loaded):
    """3 turns, per-row tool text of different lengths, rows finishing at different turns: every
    turn's tokens equal greedy decoding after a fresh prefill of the whole history."""
    cfg, params = loaded["qwen2"]
    rng = np.random.default_rng(1)
    prompts = _prompts(cfg.vocab_size, lens=(4, 9, 15, 6, 12, 20), seed=1)
    budgets = [{r: 6 + 2 * r for r in range(6)}, 10, {r: 12 - r for r in range(6)}]
    # After turn 1 only row 5 ends and only rows 0-3 get tool text (row 4 just continues), so
    # the append runs on a gathered sub-batch; after turn 2 three more rows end (compaction).
    tool_lens = [{0: 3, 1: 11, 2: 1, 3: 20}, {1: 25, 3: 5}]
    finish_after = [[5], [0, 2, 4]]
    batch_before = [8, 8, 4]

    sess = sampling.Session(cfg, params, buckets=BUCKETS)
    sess.start(prompts)
    history = [list(p) for p in prompts]
    prefill = [len(p) for p in prompts]
    for turn, budget in enumerate(budgets):
        live = sess.live_rows
        assert sess.state.batch == batch_before[turn]
        stop = [int(history[live[0]][-1])]  # a token likely to recur, so some rows stop early
        got = sess.decode_turn(budget, stop_token_ids=stop)
        assert sorted(got.tokens) == live
        ref_budget = (
            budget if isinstance(budget, int) else {i: budget[r] for i, r in enumerate(live)}
        )
        fresh = sampling.Session(cfg, params, buckets=BUCKETS)
        fresh.start([history[r] for r in live])
        ref = fresh.decode_turn(ref_budget, stop_token_ids=stop)
        for i, r in enumerate(live):
            assert got.tokens[r] == ref.tokens[i], (turn, r)
            np.testing.assert_allclose(got.logprobs[r], ref.logprobs[i], atol=1e-4)
            history[r] += got.tokens[r]
        if turn == len(budgets) - 1:
            break
        sess.finish(finish_after[turn])
        tool = {r: rng.integers(3, cfg.vocab_size, n).tolist() for r, n in tool_lens[turn].items()}
        for r, t in tool.items():
            history[r] += t
            prefill[r] += len(t)
        sess.append(tool)

    assert sess.live_rows == [1, 3]
    for r in range(len(prompts)):
        traj = sess.trajectory(r)
        assert traj.tokens == history[r]
        assert traj.prefill_tokens == prefill[r]  # each token prefilled once, never recomputed
        assert sum(traj.sampled) == len(history[r]) - prefill[r]
    assert sess.prefill_tokens == prefill


def test_shared_prompts_are_prefilled_once(loaded):
    """G rollouts of one prompt: the prompt is prefilled once and copied, and every row samples
    exactly what it samples without sharing (its own random stream), over two turns."""
    cfg, params = loaded["qwen2"]
    base = _prompts(cfg.vocab_size, lens=(9, 14, 6), seed=3)
    prompts = [base[i] for i in (0, 0, 1, 0, 2, 2)]  # 3 distinct prompts, 6 rows
    tool = {r: [3 + r] * (r + 1) for r in range(6)}
    runs = {}
    for share in (True, False):
        sess = sampling.Session(cfg, params, temperature=1.0, seed=5, buckets=BUCKETS)
        sess.start(prompts, reserve=8, share_prompts=share)
        first = sess.decode_turn(8)
        sess.append(tool)
        second = sess.decode_turn(8)
        runs[share] = (sess, first, second)
    (shared, *turns_s), (plain, *turns_p) = runs[True], runs[False]
    for got, ref in zip(turns_s, turns_p, strict=True):
        assert got.tokens == ref.tokens
        for r in range(6):
            np.testing.assert_allclose(got.logprobs[r], ref.logprobs[r], atol=1e-5)
    assert [shared.trajectory(r).tokens for r in range(6)] == [
        plain.trajectory(r).tokens for r in range(6)
    ]
    assert len({tuple(turns_s[0].tokens[r]) for r in (0, 1, 3)}) > 1  # copies sample apart
    tool_lens = [len(tool[r]) for r in range(6)]
    assert plain.prefill_tokens == [len(p) + t for p, t in zip(prompts, tool_lens, strict=True)]
    assert shared.prefill_tokens == [9 + 1, 2, 14 + 3, 4, 6 + 5, 6]  # copies: tool text only
    assert shared.stats["prefill_tokens"] == sum(map(len, base)) + sum(tool_lens)


def test_preallocated_caches_sample_what_growing_ones_do(loaded, monkeypatch):
    """A session with a small max_len allocates its caches once (no grow programs, one cache
    length for every program) and still attends over the slots the growing schedule would use:
    tokens and log-probs are bit-identical to a session that grows its caches bucket by bucket,
    over turns that cross several cache buckets, with sub-batches and finished rows; and so are
    they when its decode reads those slots out of the whole cache in every step rather than
    from a copy made once per call (`core.decode`'s slice_once, the CPU default)."""
    cfg, params = loaded["qwen2"]
    small = sampling.Buckets(cache_min=16, chunk_min=16, chunk_max=16)
    max_len = sampling.cache_capacity(112, small)
    prompts = _prompts(cfg.vocab_size, lens=(4, 9, 15, 6, 12, 20), seed=2)
    tool = {r: [3 + r] * (2 + 3 * r) for r in range(6)}
    calls = []  # (program, its static attention length or cache size) in call order

    def spy(name):
        real = getattr(core, name)

        def wrapped(*a, **kw):
            calls.append((name, kw.get("kv_len", a[2] if name == "grow" else None)))
            return real(*a, **kw)

        monkeypatch.setattr(core, name, wrapped)

    for name in ("grow", "prefill", "decode", "gather_rows"):
        spy(name)
    runs = {}
    for prealloc, slice_once in ((max_len, True), (0, True), (max_len, False)):
        buckets = dataclasses.replace(small, preallocate_max=prealloc)
        sess = sampling.Session(
            cfg, params, temperature=1.0, seed=7, max_len=max_len, buckets=buckets
        )
        assert sess._slice_once  # on CPU
        sess._slice_once = slice_once
        sess.start(prompts, reserve=12)
        capacities = [sess.state.capacity]
        for _ in range(3):
            sess.decode_turn(12)
            sess.finish(sess.live_rows[-1:])
            sess.append({r: tool[r] for r in sess.live_rows[: len(sess.live_rows) // 2 + 1]})
            capacities.append(sess.state.capacity)
        runs[prealloc, slice_once] = (
            [sess.trajectory(r) for r in range(6)],
            capacities,
            list(calls),
        )
        calls.clear()
    (pre, pre_caps, pre_calls), (grown, grown_caps, grown_calls) = (
        runs[max_len, True],
        runs[0, True],
    )
    per_step = runs[max_len, False][0]
    attention = lambda cs: [c for c in cs if c[0] in ("prefill", "decode")]  # noqa: E731
    assert attention(pre_calls) == attention(grown_calls)  # the same kv_len, call by call
    assert set(pre_caps) == {max_len} and not any(c[0] == "grow" for c in pre_calls)
    assert sum(c[0] == "grow" for c in grown_calls) >= 2 and grown_caps[0] < grown_caps[-1]
    assert any(c[0] == "gather_rows" for c in pre_calls)  # sub-batches and compaction ran
    for a, b, c in zip(pre, grown, per_step, strict=True):
        assert a.tokens == b.tokens == c.tokens and a.sampled == b.sampled == c.sampled
        np.testing.assert_array_equal(a.logprobs, b.logprobs)  # bit-identical, NaNs included
        np.testing.assert_array_equal(a.logprobs, c.logprobs)


def test_compile_count_bounded(loaded):
    """20 calls with 20 different prompt lengths compile a handful of programs, then none."""
    cfg, params = loaded["qwen2"]
    calls = [_prompts(cfg.vocab_size, lens=(n, max(1, n - 2), n + 1), seed=n) for n in range(2, 22)]
    assert len({max(map(len, c)) for c in calls}) == 20
    before = sampling.compile_count()
    outs = [sampling.generate(cfg, params, c, NEW, stop_token_ids=[7], buckets=BUCKETS)
            for c in calls]  # fmt: skip
    first = sampling.compile_count() - before
    assert first <= 3, dict(core._TRACES)  # at most init + prefill + decode here
    for c, o in zip(calls[::5], outs[::5], strict=True):
        again = sampling.generate(cfg, params, c, NEW, stop_token_ids=[7], buckets=BUCKETS)
        assert again.tokens == o.tokens
    assert sampling.compile_count() - before == first


def test_generate_lanes_split_rows_over_threads(loaded, monkeypatch):
    """`generate` with lanes > 1 runs one Session per lane (contiguous rows, split evenly, each
    on its own thread) and returns the rows in order, with the tokens, stop hits and sampled
    streams of one session; log-probs to 1e-6 (a smaller batch may round the last bit
    otherwise). The default is one lane per core, each of at least `batch_min` rows, and one on
    a multi-device mesh; bad input is named by the caller's row before any lane starts."""
    import threading

    cfg, params = loaded["qwen2"]
    prompts = _prompts(cfg.vocab_size, lens=(5, 17, 11, 6, 9, 3, 14, 8, 12, 4), seed=8)
    seen: list[tuple[str, int, int]] = []  # (thread, first row, rows) of each session's turn
    decode_turn = sampling.Session.decode_turn

    def spy(self, *args, **kwargs):
        # a thread's name, not its ident: an ident is reused once its thread has ended
        seen.append((threading.current_thread().name, self._first_row, len(self.live_rows)))
        return decode_turn(self, *args, **kwargs)

    monkeypatch.setattr(sampling.Session, "decode_turn", spy)
    mesh1, mesh2 = (models.make_mesh((n, 1, 1), jax.devices()[:n]) for n in (1, 2))
    # the last: lanes on a one-device mesh, each thread under its own (thread-local) mesh context
    for kw in ({}, {"temperature": 1.0, "seed": 4}, {"temperature": 1.0, "seed": 4, "mesh": mesh1}):
        free = sampling.generate(cfg, params, prompts, 12, buckets=BUCKETS, lanes=1, **kw)
        # per-row sets keyed by generate's row ids, taken from the rows' own tokens so that rows
        # of the later lanes (4, 9) stop, and row 0 stops on a token row 4 draws
        stops = {0: [free.tokens[4][2]], 4: [free.tokens[4][3]], 9: [free.tokens[9][5]]}
        one = sampling.generate(cfg, params, prompts, 12, stop_token_ids=stops, buckets=BUCKETS,
                                lanes=1, **kw)  # fmt: skip
        assert one.stopped[4] and one.stopped[9] and one.lengths[4] <= 4
        for lanes, sizes in ((2, (5, 5)), (3, (3, 3, 4))):
            seen.clear()
            got = sampling.generate(cfg, params, prompts, 12, stop_token_ids=stops,
                                    buckets=BUCKETS, lanes=lanes, **kw)  # fmt: skip
            starts = np.cumsum((0, *sizes[:-1])).tolist()
            assert sorted(s[1:] for s in seen) == list(zip(starts, sizes, strict=True))
            assert len({s[0] for s in seen}) == lanes  # each lane on a thread of its own
            assert (got.tokens, got.stopped, got.lengths) == (one.tokens, one.stopped, one.lengths)
            for a, b in zip(got.logprobs, one.logprobs, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    cores = sampling.lanes.machine.usable_cores()
    assert sampling.generate_lanes(10, None, BUCKETS) == min(cores, 10 // BUCKETS.batch_min)
    assert sampling.generate_lanes(3, None, BUCKETS) == 1
    assert sampling.generate_lanes(64, mesh1) == min(cores, 8)
    assert sampling.generate_lanes(64, mesh2) == 1
    seen.clear()
    with pytest.raises(ValueError, match="lanes must be >= 1"):
        sampling.generate(cfg, params, prompts, 4, buckets=BUCKETS, lanes=0)
    with pytest.raises(ValueError, match="lanes > 1 needs a single-process run on one device"):
        sampling.generate(cfg, params, prompts, 4, buckets=BUCKETS, lanes=2, mesh=mesh2)
    with pytest.raises(ValueError, match="2 per-row stop sets for 10 rows"):
        sampling.generate(cfg, params, prompts, 4, stop_token_ids=[[1], [2]], buckets=BUCKETS)
    bad = [*prompts[:7], [cfg.vocab_size], *prompts[8:]]
    with pytest.raises(ValueError, match=r"^prompt 7: token ids"):
        sampling.generate(cfg, params, bad, 4, buckets=BUCKETS, lanes=3)
    with pytest.raises(ValueError, match=r"^stop set of row 9: token ids"):
        sampling.generate(cfg, params, prompts, 4, stop_token_ids={9: [-1]}, buckets=BUCKETS)
    assert not seen  # every error came before any lane decoded


def test_capacity_and_input_errors(loaded):
    cfg, params = loaded["qwen2"]
    # trajectories of up to 224 tokens: 224 + one (padded) prefill chunk of 32 slots
    capacity = sampling.cache_capacity(224, BUCKETS)
    assert capacity == 256
    sess = sampling.Session(cfg, params, max_len=capacity, buckets=BUCKETS)
    sess.start([[5] * 230])  # prefilled in 8 chunks
    assert sess.prefill_tokens == [230]
    assert sess.state.capacity <= capacity
    assert sess.state.batch == sampling.batch_capacity(1, 1, BUCKETS) == BUCKETS.batch_min
    assert sampling.batch_capacity(5, 8, BUCKETS) == 8 and sampling.batch_capacity(9) == 16
    with pytest.raises(sampling.CapacityError, match="max_len=256"):
        sess.decode_turn(64)
    with pytest.raises(ValueError, match="outside"):
        sampling.generate(cfg, params, [[cfg.vocab_size]], 4, buckets=BUCKETS)
    sess2 = sampling.Session(cfg, params, buckets=BUCKETS)
    sess2.start([[5, 6], [7]])
    sess2.finish([1])
    with pytest.raises(ValueError, match="finished"):
        sess2.append({1: [3]})


def test_kv_cache_is_held_in_the_compute_dtype():
    """What the planner counts and the sampler allocates: the KV cache in the model's compute
    dtype (bf16 on the 7B/8B configs, f32 where a run asks for f32); segments and ends int32."""
    for dtype in ("bfloat16", "float32"):
        cfg = tiny_model_config(dtype=dtype)
        cache = sampling.state_shapes(cfg, 4, 64).cache
        assert {x.dtype for x in (*cache.k, *cache.v)} == {jnp.dtype(dtype)}
        assert cache.segments.dtype == cache.end.dtype == jnp.int32
        assert cache.k[0].shape == (4, cfg.num_kv_heads, cfg.head_dim, 64)


def test_state_shapes_describe_the_real_state(loaded):
    """`state_shapes` / `state_logical_axes` (for memory planning) match a live session's state."""
    cfg, params = loaded["qwen2"]
    sess = sampling.Session(cfg, params, buckets=BUCKETS)
    sess.start(_prompts(cfg.vocab_size))
    real = sess.state
    abstract = sampling.state_shapes(cfg, real.batch, real.capacity)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(
        lambda x: (x.shape, x.dtype), real
    )
    axes = sampling.state_logical_axes(cfg)
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
    assert [len(a) for a in flat_axes] == [x.ndim for x in jax.tree.leaves(real)]


def test_padding_rows_and_chunks_changes_no_number():
    """`Buckets`' minimum rows and chunk length only pad: the demo's model, sampling at
    temperature 1 from three ragged prompts, then a tool output appended to two rows and a second
    turn for them, samples the same tokens with the same log-probs whether rows and chunks are
    padded to 4 / 16 or to the defaults (8 / 32). Bit-equal on this project's AMD machines
    (docs/benchmarks.md); held here to 1e-6, as kernels at other shapes may round otherwise."""
    cfg = models.ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=256, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=100.0, scan_layers=False,
    )  # fmt: skip
    params = models.init_params(cfg, jax.random.key(3))
    prompts = _prompts(cfg.vocab_size, lens=(9, 20, 13), seed=4)
    runs = []
    for buckets in (sampling.Buckets(batch_min=4, chunk_min=16), sampling.Buckets()):
        sess = sampling.Session(cfg, params, temperature=1.0, seed=5, buckets=buckets)
        sess.start(prompts)
        sess.decode_turn(12)
        sess.append({0: [7, 8, 9], 2: [11] * 5})
        sess.decode_turn(12, rows=[0, 2])
        runs.append([sess.trajectory(r) for r in range(3)])
    assert (sampling.Buckets().batch_min, sampling.Buckets().chunk_min) == (8, 32)
    for small, default in zip(*runs, strict=True):
        assert small.tokens == default.tokens and small.sampled == default.sampled
        assert sum(small.sampled) >= 12
        np.testing.assert_allclose(small.logprobs, default.logprobs, rtol=0, atol=1e-6)


def test_lanes_drive_several_sessions_as_one(loaded):
    """`Lanes` numbers rows as one session does: a multi-turn round (decode, finish, append,
    decode) over 3 lanes gives each row the trajectory one session gives it (tokens exactly,
    log-probs to 1e-6), and a bad row is named by its own number, not a lane's."""
    cfg, params = loaded["qwen2"]
    prompts = _prompts(cfg.vocab_size, lens=(5, 17, 11, 6, 9, 3, 14, 8, 12, 4), seed=9)
    kw = dict(temperature=1.0, seed=5, buckets=BUCKETS)
    runs = {}
    for lanes in (1, 3):
        sess = sampling.Lanes(cfg, params, lanes=lanes, **kw)
        sess.start(prompts, reserve=6)
        sess.decode_turn({r: 3 + r % 4 for r in range(10)}, stop_token_ids={8: [1, 2]})
        sess.finish([0, 7])
        assert sess.live_rows == [1, 2, 3, 4, 5, 6, 8, 9] and sess.lanes == lanes
        sess.append({r: [r + 1, r + 2] for r in (1, 5, 9)})
        sess.decode_turn(4, rows=[1, 4, 9])
        with pytest.raises(ValueError, match="row 7 is finished"):
            sess.decode_turn(2, rows=[7])
        with pytest.raises(KeyError, match="no live row 12"):
            sess.append({12: [1]})
        with pytest.raises(ValueError, match=r"^row 9: token ids \[-1\]"):  # before any lane
            sess.append({1: [3], 9: [-1]})
        with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
            sess.decode_turn({1: 2, 9: -1}, rows=[1, 9])
        runs[lanes] = [sess.trajectory(r) for r in range(10)]
    for a, b in zip(runs[1], runs[3], strict=True):
        assert (a.tokens, a.sampled, a.prefill_tokens) == (b.tokens, b.sampled, b.prefill_tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)


def test_lanes_cut_where_the_prompt_changes():
    """With shared prompts a lane boundary moves to the nearest row where the prompt changes (a
    group is prefilled in one lane whatever the core count); lanes left empty are dropped."""
    groups = lambda *sizes: [[k + 1] for k, n in enumerate(sizes) for _ in range(n)]
    split = sampling.lanes.split_points
    assert split(groups(4, 4, 4, 4, 4), 2, True) == [0, 8, 20]  # 10 is inside a group: 8 or 12
    assert split(groups(4, 4, 4, 4, 4), 2, False) == [0, 10, 20]
    assert split(groups(8, 8), 3, True) == [0, 8, 16]  # 2 groups: 2 lanes
    assert split(groups(16), 2, True) == [0, 16]  # one prompt: one lane
    assert split(groups(1, 1, 1, 1, 1, 1), 3, True) == [0, 2, 4, 6]
