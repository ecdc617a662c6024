"""Device side of the sampler: a rollout-state pytree and the pure jitted programs that act on it.

The model runs through `forward.apply_cached` (per-layer cache buffers, see there).

Cache layout ("compact rows"): row b holds its real tokens at slots [0, end[b]) with no gaps, so a
token's position equals its slot. Chunks are right-padded and written at `end`; afterwards `end`
advances by the row's real length only, so padding slots sit beyond `end` and are overwritten by
the next write. Invariant: `cache.segments[b, s] == 0` for every `s >= end[b]`. Rows therefore
have independent lengths — ragged prompts, early-stopping rows and per-row tool results of any
length never leave holes, and no left-padding is needed.

Every jitted function bumps a trace counter (a Python side effect that only runs while tracing),
so tests can bound how many programs a long run compiles.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from rcgrpo_jax import models
from rcgrpo_jax.models import decoder
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.models.sharding import constrain
from rcgrpo_jax.sampling import forward
from rcgrpo_jax.sampling.forward import Cache

_TRACES: collections.Counter[str] = collections.Counter()
_TRACES_LOCK = threading.Lock()  # `lanes.Lanes` traces from several threads


def compile_count(name: str | None = None) -> int:
    """Number of programs traced (= compiled) so far, in total or for one jitted function."""
    return sum(_TRACES.values()) if name is None else _TRACES[name]


def _traced(name: str) -> None:
    with _TRACES_LOCK:
        _TRACES[name] += 1


@flax.struct.dataclass
class RolloutState:
    """Everything a batch of trajectories needs on device between turns.

    `logits` are each row's next-token logits (from its last real token), so decoding resumes
    without recomputing anything; `traj`/`n_sampled` name each row's random stream, which makes
    samples independent of batch composition, compaction and sharding.
    """

    cache: Cache
    logits: jax.Array  # [B, V] float32
    traj: jax.Array  # [B] int32 trajectory id; -1 = empty slot
    n_sampled: jax.Array  # [B] int32 tokens sampled so far by this trajectory

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    @property
    def capacity(self) -> int:
        return self.cache.capacity


class SampleMode(NamedTuple):
    """The static part of the sampling settings: one program per kind.

    "greedy" takes the argmax; "sample" draws from softmax(logits / temperature); "filtered" also
    applies top-k and top-p (values passed at run time), which costs a sort of the vocabulary.
    """

    kind: str  # "greedy" | "sample" | "filtered"


class DecodeOut(NamedTuple):
    tokens: jax.Array  # [B, K] int32, -1 after a row stopped
    logprobs: jax.Array  # [B, K] float32
    n_new: jax.Array  # [B] int32
    stopped: jax.Array  # [B] bool: the row sampled one of its stop tokens


def _constrain_state(state: RolloutState) -> RolloutState:
    return RolloutState(
        cache=forward.constrain_cache(state.cache),
        logits=constrain(state.logits, ("cache_batch", None)),
        traj=constrain(state.traj, ("cache_batch",)),
        n_sampled=constrain(state.n_sampled, ("cache_batch",)),
    )


def state_logical_axes(cfg: ModelConfig) -> RolloutState:
    """Logical axes of every leaf of a `RolloutState` (for shardings and memory planning)."""
    return RolloutState(
        cache=Cache(
            k=(forward.K_AXES,) * cfg.num_layers,
            v=(forward.V_AXES,) * cfg.num_layers,
            segments=("cache_batch", "cache_len"),
            end=("cache_batch",),
        ),
        logits=("cache_batch", None),
        traj=("cache_batch",),
        n_sampled=("cache_batch",),
    )


def state_shapes(cfg: ModelConfig, batch: int, capacity: int) -> RolloutState:
    """The state as ShapeDtypeStructs (no memory allocated)."""
    return jax.eval_shape(
        lambda: init_state.__wrapped__(cfg, capacity, jnp.zeros((batch,), jnp.int32))
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_state(cfg: ModelConfig, capacity: int, traj: jax.Array) -> RolloutState:
    """An empty state with one row per entry of `traj` [B] (trajectory ids, -1 = unused row)."""
    _traced("init_state")
    batch = traj.shape[0]
    return _constrain_state(
        RolloutState(
            cache=forward.init_cache(cfg, batch, capacity),
            logits=jnp.zeros((batch, cfg.vocab_size), jnp.float32),
            traj=traj.astype(jnp.int32),
            n_sampled=jnp.zeros((batch,), jnp.int32),
        )
    )


@functools.partial(jax.jit, static_argnums=0, static_argnames="kv_len", donate_argnums=2)
def prefill(
    cfg: ModelConfig,
    params: models.Params,
    state: RolloutState,
    tokens: jax.Array,
    lens: jax.Array,
    *,
    kv_len: int | None = None,
) -> RolloutState:
    """Appends a right-padded chunk `tokens` [B, T] with real lengths `lens` [B] to every row.

    Rows with `lens == 0` are untouched (their logits are kept). The caller guarantees
    `end + T <= kv_len <= capacity` for every row (checked on the host); attention reads only
    the first `kv_len` slots (None: all).
    """
    _traced("prefill")
    t = tokens.shape[1]
    end = state.cache.end
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = end[:, None] + steps
    segments = (steps < lens[:, None]).astype(jnp.int32)
    weights = decoder.unstack_layers(cfg, params)
    logits, cache = forward.apply_cached(
        cfg, weights, tokens, positions, segments, state.cache, jnp.maximum(lens - 1, 0), kv_len
    )
    cache = cache.replace(end=end + lens)
    logits = jnp.where(lens[:, None] > 0, logits[:, 0], state.logits)
    return _constrain_state(state.replace(cache=cache, logits=logits))


def _filter_logits(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k (0 = off), then nucleus (top-p) filtering of temperature-scaled logits [B, V].

    Same order as transformers; ties at either cut-off are kept. One sort serves both cuts, and
    both thresholds are traced values, so changing them never recompiles.
    """
    vocab = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jax.lax.dynamic_slice_in_dim(desc, k - 1, 1, axis=-1)
    desc = jnp.where(desc < kth, -jnp.inf, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p  # the smallest prefix whose mass reaches top_p (>= 1 token)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x < kth) | (x < cutoff), -jnp.inf, x)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32, the same index in every case (first maximum; first NaN
    if any), from two plain reductions. XLA:CPU lowers argmax's paired (value, index) reduction
    to a scalar loop, several times slower than these two (docs/benchmarks.md, "The sampler's
    token choice")."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def categorical(keys: jax.Array, x: jax.Array) -> jax.Array:
    """`vmap(jax.random.categorical)(keys, x)`, the same draws (Gumbel noise from each row's key,
    plus the logits, argmax), with the argmax above."""
    noise = jax.vmap(lambda key: jax.random.gumbel(key, x.shape[1:], x.dtype))(keys)
    return argmax(noise + x)


def token_logprob(logits: jax.Array, tok: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(logits)[b, tok[b]]` by its own steps (shift by the row's maximum,
    log-sum-exp of the shifted row), the last subtraction at the picked token only: the same
    value, without a [B, V] row of log-probs to write and gather from on every decode step."""
    top = jnp.max(logits, axis=-1, initial=-jnp.inf, keepdims=True)
    shifted = logits - top
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    return (jnp.take_along_axis(shifted, tok[:, None], axis=-1) - lse)[:, 0]


def sample(
    logits: jax.Array,
    keys: jax.Array,
    mode: SampleMode,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row from `logits` [B, V]; returns (tokens, log p(token) at temperature 1).

    The log-prob is under the unfiltered policy, which is what the RL loss uses as old log-probs.
    """
    if mode.kind == "greedy":
        tok = argmax(logits)
    else:
        x = logits / temperature
        if mode.kind == "filtered":
            x = _filter_logits(x, top_k, top_p)
        tok = categorical(keys, x)
    return tok, token_logprob(logits, tok)


def _row_keys(base: jax.Array, traj: jax.Array, n_sampled: jax.Array) -> jax.Array:
    return jax.vmap(lambda t, n: jax.random.fold_in(jax.random.fold_in(base, t), n))(
        traj, n_sampled
    )


# XLA's default dot path on every backend: on CPU that is YNNPACK, the fastest at decode's small M
# (`python bench/dot_paths.py`). A decode step is a chain of such GEMMs that keeps about one core
# busy whatever the path, so on one CPU device a batch is split into lanes (`lanes.Lanes`).
@functools.partial(
    jax.jit,
    static_argnums=(0, 1, 2),
    static_argnames=("kv_len", "slice_once"),
    donate_argnums=4,
)
def decode(
    cfg: ModelConfig,
    mode: SampleMode,
    steps: int,
    params: models.Params,
    state: RolloutState,
    base_key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    budget: jax.Array,
    stop_ids: jax.Array,
    *,
    kv_len: int | None = None,
    slice_once: bool = False,
) -> tuple[RolloutState, DecodeOut]:
    """Samples up to `steps` tokens per row in one `lax.while_loop`.

    budget [B]: tokens this row may still sample (0 = row idle); stop_ids [B, M]: per-row stop
    tokens, -1 padded. A row stops after sampling a stop token (kept, and written to the cache)
    or when its budget is spent; stopped rows no longer advance their cache (their writes are
    padding at `end`, overwritten later); the loop exits as soon as every row has stopped. Every
    sampled token is fed through the model, so the state is ready for an append or more decoding.
    Attention reads the first `kv_len` slots (None: all): the caller guarantees that every row's
    `end + steps + 1` fits.

    `slice_once`: the loop runs on a copy of the first `kv_len` slots, written back after it,
    rather than reading those slots out of the whole cache in every step. XLA:CPU copies such a
    slice of the slot axis for the attention dot on every step and layer (at bench/peers.py's
    shape ~18% of a decode call, docs/benchmarks.md, "The decode loop's cache window"); the copy
    costs the window's memory, so sessions ask for it on CPU only. The numbers are the same.
    """
    _traced("decode")
    weights = decoder.unstack_layers(cfg, params)  # once per call, outside the loop
    full, windowed = state, slice_once and kv_len is not None and kv_len < state.capacity
    if windowed:
        state = state.replace(cache=forward.first_slots(state.cache, kv_len))
        kv_len = None
    b = state.batch
    done0 = budget <= 0
    init = (
        jnp.int32(0),
        state,
        done0,
        jnp.full((b, steps), -1, jnp.int32),
        jnp.zeros((b, steps), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), jnp.bool_),
    )

    def cond(carry):
        i, _, done, *_ = carry
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, st, done, toks, lps, n_new, stopped = carry
        keys = _row_keys(base_key, st.traj, st.n_sampled)
        tok, lp = sample(st.logits, keys, mode, temperature, top_k, top_p)
        live = ~done
        toks = jax.lax.dynamic_update_slice_in_dim(toks, jnp.where(live, tok, -1)[:, None], i, 1)
        lps = jax.lax.dynamic_update_slice_in_dim(lps, jnp.where(live, lp, 0.0)[:, None], i, 1)
        n_new = n_new + live
        hit = live & jnp.any(tok[:, None] == stop_ids, axis=-1)
        seg = live.astype(jnp.int32)
        end = st.cache.end
        logits, cache = forward.apply_cached(
            cfg, weights, tok[:, None], end[:, None], seg[:, None], st.cache, kv_len=kv_len
        )
        st = RolloutState(
            cache=cache.replace(end=end + seg),
            logits=jnp.where(live[:, None], logits[:, 0], st.logits),
            traj=st.traj,
            n_sampled=st.n_sampled + seg,
        )
        done = done | hit | (n_new >= budget)
        return i + 1, _constrain_state(st), done, toks, lps, n_new, stopped | hit

    _, state, _, toks, lps, n_new, stopped = jax.lax.while_loop(cond, body, init)
    if windowed:
        state = state.replace(cache=forward.with_first_slots(full.cache, state.cache))
    return _constrain_state(state), DecodeOut(toks, lps, n_new, stopped)


def _take_rows(state: RolloutState, idx: jax.Array) -> RolloutState:
    """Rows `idx` of the state; an index past the end gives an empty row."""

    def take(x: jax.Array, fill=0) -> jax.Array:
        return jnp.take(x, idx, axis=0, mode="fill", fill_value=fill)

    return RolloutState(
        cache=jax.tree.map(take, state.cache),
        logits=take(state.logits),
        traj=take(state.traj, -1),
        n_sampled=take(state.n_sampled),
    )


@functools.partial(jax.jit, static_argnums=0)
def gather_rows(
    cfg: ModelConfig, state: RolloutState, idx: jax.Array, traj: jax.Array | None = None
) -> RolloutState:
    """A state made of rows `idx` [B'] (indices >= B give empty rows): sub-batches, compaction
    after rows finish, and copies of a shared prompt's row. `traj` [B'], if given, renumbers the
    rows' trajectories (a copy must draw from its own random stream)."""
    del cfg  # only keys the compile cache per model
    _traced("gather_rows")
    out = _take_rows(state, idx)
    if traj is not None:
        out = out.replace(traj=traj.astype(jnp.int32))
    return _constrain_state(out)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def scatter_rows(
    cfg: ModelConfig, state: RolloutState, sub: RolloutState, idx: jax.Array
) -> RolloutState:
    """Writes the rows of `sub` back to rows `idx` of `state` (indices >= B are dropped)."""
    del cfg
    _traced("scatter_rows")
    put = lambda x, y: x.at[idx].set(y, mode="drop")
    return _constrain_state(jax.tree.map(put, state, sub))


@functools.partial(jax.jit, static_argnums=(0, 2))  # no donation: the output is larger
def grow(cfg: ModelConfig, state: RolloutState, capacity: int) -> RolloutState:
    """The same state with a longer cache (new slots empty)."""
    del cfg
    _traced("grow")
    return _constrain_state(state.replace(cache=forward.pad_cache(state.cache, capacity)))
