"""Host side of the sampler: multi-turn rollout sessions (`lanes` splits a batch over several).

A `Session` owns one `RolloutState` (the KV caches of a batch of trajectories) and drives the jitted
programs of `core`. A multi-turn RL rollout loop uses it like this::

    sess = Session(cfg, params, temperature=1.0, seed=step)
    sess.start(prompts)                        # rows 0..N-1, one per trajectory
    while sess.live_rows:
        turn = sess.decode_turn(max_new_tokens=256, stop_token_ids=stops)
        done, tool_out = run_environment(turn.tokens)   # {row: [int]} of tool / user tokens
        sess.finish(done)                      # finished rows drop out (batch is compacted)
        sess.append({r: tool_out[r] for r in sess.live_rows})
    traj = sess.trajectory(row)                # tokens, sampled mask, old log-probs

Nothing is recomputed across turns: `append` prefills only the new tokens on top of each row's
cache. Shapes are bucketed (batch, chunk length, cache length, decode steps, stop-set size; the
rules are `rcgrpo_jax.shapes`) so a long run compiles a small, bounded set of programs
(`compile_count()`).

Rows that stop early inside a decode call are masked; between decode segments and for appends,
only the rows involved are gathered into a smaller batch bucket when that bucket is smaller, so
finished rows stop costing compute wherever the shapes allow.

The module stays one file of ~500 lines because `Session` is one state machine (its rows,
caches, slots and histories change together in every method); the jitted programs it runs are
`core`'s, the bucket rules `rcgrpo_jax.shapes`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rcgrpo_jax import distributed, models
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.sampling import core
from rcgrpo_jax.shapes import (
    Buckets,
    batch_capacity,
    geom_bucket,
    length_bucket,
    pow2_bucket,
)

StopIds = Sequence[int] | Sequence[Sequence[int]] | Mapping[int, Sequence[int]]

# Programs a session dispatches before it waits for the last of them to finish. A long append is
# many programs in a row that the host never reads back (a 16k-token prompt: 128 prefill chunks);
# unbounded, they pile up to XLA:CPU's limit of 32 queued programs per device. The next launch
# then blocks, waiting for a slot, on one of the CPU client's worker threads, and there are only
# as many of those as devices when the cores are fewer (`PJRT_NPROC` sets their number). With an
# all-reduce over the tensor axis in every program, the blocked launch can hold the thread that
# one device's share of a queued program needs while the other device's share waits for it in the
# all-reduce: "Expected 2 threads to join the rendezvous, but only 1 of them arrived" (qwen7b's
# e2e on mesh (1, 1, 2)). A few programs in flight keep any backend's device busy.
MAX_PROGRAMS_AHEAD = 8


class CapacityError(ValueError):
    """A trajectory would outgrow the session's `max_len`."""


@dataclasses.dataclass
class TurnOutput:
    """What one `decode_turn` sampled, per row: tokens (cut after the stop token, which is kept),
    their log-probs under the policy at temperature 1, and whether a stop token ended the row."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    stopped: dict[int, bool]


@dataclasses.dataclass
class Trajectory:
    """A row's whole history: every token in order, which of them were sampled (the RL loss
    mask), their log-probs (NaN where not sampled), and how many tokens were prefilled."""

    tokens: list[int]
    sampled: list[bool]
    logprobs: list[float]
    prefill_tokens: int


class Session:
    """A batch of trajectories whose KV caches live on device across turns.

    Rows are numbered 0..N-1 in `start` order and keep their number for the session; `live_rows`
    lists those not finished. Sampling settings are fixed per session: temperature 0 is greedy;
    otherwise temperature, then top-k (0 = off), then top-p (1 = off) filter the distribution.
    Each row draws from its own random stream (seed, row, token index), so a fixed seed gives the
    same samples whatever the batch composition, bucketing or sharding; `first_row` numbers a
    session's rows from there, so that a batch split over several sessions draws as one does.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: models.Params,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        mesh: Mesh | None = None,
        max_len: int | None = None,
        buckets: Buckets = Buckets(),  # noqa: B008 (frozen dataclass)
        first_row: int = 0,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.cfg = cfg
        self.params = params
        self.mesh = mesh if mesh is not None else models.params_mesh(params)
        self.max_len = max_len
        self.buckets = buckets
        greedy = temperature == 0.0
        filtered = top_k > 0 or top_p < 1.0
        self._mode = core.SampleMode("greedy" if greedy else "filtered" if filtered else "sample")
        self._temperature = np.float32(temperature if not greedy else 1.0)
        self._top_k = np.int32(top_k)
        self._top_p = np.float32(top_p)
        self._key = jax.random.key(seed)
        self._first_row = int(first_row)  # row r draws from stream (seed, first_row + r)
        self._shard = 1
        if self.mesh is not None:
            self._shard = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        self._slice_once = next(iter(devices)).platform == "cpu"  # `core.decode`'s slice_once
        self._state: core.RolloutState | None = None
        self._room = 0  # cache slots in use by the bucket schedule (<= the state's capacity)
        self._live: list[int] = []  # row at each state slot (slots >= len are empty)
        self._finished: set[int] = set()
        self._hist: list[list[int]] = []
        self._sampled: list[list[bool]] = []
        self._logprobs: list[list[float]] = []
        self._prefill: list[int] = []
        self._ahead = 0  # programs dispatched since the host last waited for the device
        self.stats = {"prefill_tokens": 0, "prefill_padded_tokens": 0, "decode_row_steps": 0}

    # ----------------------------------------------------------------- public API

    @property
    def live_rows(self) -> list[int]:
        """Rows not yet finished, in slot order."""
        return list(self._live)

    @property
    def prefill_tokens(self) -> list[int]:
        """Real tokens prefilled per trajectory so far (prompt + appended; never recomputed)."""
        return list(self._prefill)

    @property
    def state(self) -> core.RolloutState | None:
        """The device pytree (caches of the live rows, in `live_rows` order, then empty rows)."""
        return self._state

    def start(
        self, prompts: Sequence[Sequence[int]], *, reserve: int = 0, share_prompts: bool = True
    ) -> list[int]:
        """Prefills the prompts as rows 0..N-1 and returns the row ids.

        `reserve`: tokens per row expected to follow (sizes the first cache to avoid a regrow).
        `share_prompts`: a prompt given to several rows (GRPO's G rollouts of one prompt) is
        prefilled once, in its first row, and the other rows start from a copy of that cache;
        their `prefill_tokens` do not count it, since nothing was computed for them.
        """
        if self._state is not None or self._hist:
            raise RuntimeError("Session.start may only be called once")
        prompts = [self._check_tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if not prompts:
            raise ValueError("no prompts")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = len(prompts)
        first: dict[tuple[int, ...], int] = {}
        source = [
            first.setdefault(tuple(p), i) if share_prompts else i for i, p in enumerate(prompts)
        ]
        unique = sorted(set(source))
        self._hist = [[] for _ in range(n)]
        self._sampled = [[] for _ in range(n)]
        self._logprobs = [[] for _ in range(n)]
        self._prefill = [0] * n
        longest = max(len(p) for p in prompts)
        first_decode = min(reserve, self.buckets.decode_steps) + 1 if reserve > 0 else 0
        capacity = self._cache_bucket(max(self._chunk_bucket(longest), longest + first_decode))
        self._live = unique
        traj = np.full((self._batch_bucket(unique),), -1, np.int32)
        traj[: len(unique)] = np.asarray(unique) + self._first_row
        self._room = capacity
        self._state = self._in_mesh(core.init_state, self.cfg, self._allocation(capacity), traj)
        self._append({r: prompts[r] for r in unique})
        if len(unique) < n:
            slot = {r: i for i, r in enumerate(unique)}
            batch = self._batch_bucket(prompts)
            traj = np.full((batch,), -1, np.int32)
            traj[:n] = np.arange(n) + self._first_row
            idx = self._index([slot[s] for s in source], batch)
            self._state = self._in_mesh(core.gather_rows, self.cfg, self._state, idx, traj)
            for r, s in enumerate(source):
                if r != s:
                    self._record_prefilled(r, prompts[r], computed=False)
            self._live = list(range(n))
        return list(range(n))

    def decode_turn(
        self,
        max_new_tokens: int | Mapping[int, int],
        stop_token_ids: StopIds = (),
        rows: Iterable[int] | None = None,
    ) -> TurnOutput:
        """Samples one turn for `rows` (default: all live rows).

        max_new_tokens: one budget, or {row: budget}. stop_token_ids: one set for every row, a
        list of per-row sets (indexed by row id), or {row: set}. Each row's sampled tokens are
        in its cache when this returns, so `append` or another `decode_turn` continues from them.
        """
        rows = self._check_rows(self._live if rows is None else rows)
        budget = {
            r: int(max_new_tokens[r] if isinstance(max_new_tokens, Mapping) else max_new_tokens)
            for r in rows
        }
        if any(b < 0 for b in budget.values()):
            raise ValueError("max_new_tokens must be >= 0")
        stops = self._per_row_stops(stop_token_ids, rows)
        out = TurnOutput(
            tokens={r: [] for r in rows},
            logprobs={r: [] for r in rows},
            stopped=dict.fromkeys(rows, False),
        )
        running = [r for r in rows if budget[r] > 0]
        while running:
            steps = self.buckets.decode_steps
            width = pow2_bucket(max(len(stops[r]) for r in running), self.buckets.stops_min)

            def seg(state, slot_rows, steps=steps, width=width):
                b = len(slot_rows)
                bud = np.zeros((b,), np.int32)
                stop_arr = np.full((b, width), -1, np.int32)
                for i, r in enumerate(slot_rows):
                    if r is not None and r in budget:
                        bud[i] = budget[r]
                        stop_arr[i, : len(stops[r])] = stops[r]
                state, res = core.decode(
                    self.cfg, self._mode, steps, self.params, state, self._key,
                    self._temperature, self._top_k, self._top_p, bud, stop_arr,
                    kv_len=self._kv_bucket(slot_rows, steps + 1), slice_once=self._slice_once,
                )  # fmt: skip
                return state, tuple(distributed.host_tree(tuple(res)))  # gathered if sharded

            # +1: after its last token a row keeps writing padding at its end until all stop.
            extra = {r: min(budget[r], steps) + 1 for r in running}
            results = self._run(running, extra, 1, seg)
            still = []
            for r, (toks, lps, n_new, hit) in results.items():
                n = int(n_new)
                out.tokens[r] += [int(t) for t in toks[:n]]
                out.logprobs[r] += [float(x) for x in lps[:n]]
                budget[r] -= n
                self._record(r, toks[:n], lps[:n])
                if hit:
                    out.stopped[r] = True
                elif budget[r] > 0:
                    still.append(r)
            running = [r for r in running if r in still]
        return out

    def append(self, row_tokens: Mapping[int, Sequence[int]]) -> None:
        """Prefills each row's new tokens (tool results, the next user message, ...) on top of
        its cache, in chunks; rows not named (or given no tokens) are left as they are."""
        rows = self._check_rows(row_tokens.keys())
        toks = {r: self._check_tokens(row_tokens[r], f"row {r}") for r in rows}
        self._append({r: t for r, t in toks.items() if t})

    def finish(self, rows: Iterable[int]) -> None:
        """Drops rows from the batch: their caches are released and the live rows compacted."""
        rows = self._check_rows(rows)
        if not rows:
            return
        self._finished.update(rows)
        idx = [i for i, r in enumerate(self._live) if r not in self._finished]
        keep = [self._live[i] for i in idx]
        self._live = keep
        if not keep:
            self._state = None
            return
        self._state = self._in_mesh(
            core.gather_rows, self.cfg, self._state, self._index(idx, self._batch_bucket(keep))
        )

    def trajectory(self, row: int) -> Trajectory:
        if not 0 <= row < len(self._hist):
            raise KeyError(f"no row {row}")
        return Trajectory(
            tokens=list(self._hist[row]),
            sampled=list(self._sampled[row]),
            logprobs=list(self._logprobs[row]),
            prefill_tokens=self._prefill[row],
        )

    # ----------------------------------------------------------------- internals

    def _in_mesh(self, fn: Callable, *args: Any):
        """`fn(*args)` under the session's mesh: every program the session runs goes through here,
        and every MAX_PROGRAMS_AHEAD-th waits until its output is computed."""
        with models.use_mesh(self.mesh):
            out = fn(*args)
        self._ahead += 1
        if self._ahead >= MAX_PROGRAMS_AHEAD:
            jax.block_until_ready(out)
            self._ahead = 0
        return out

    def _batch_bucket(self, rows: Sequence[Any]) -> int:
        return batch_capacity(len(rows), self._shard, self.buckets)

    def _chunk_bucket(self, n: int) -> int:
        return min(geom_bucket(n, self.buckets.chunk_min), self.buckets.chunk_max)

    def _cache_bucket(self, n: int) -> int:
        size = length_bucket(n, self.buckets)
        if self.max_len is not None:
            if n > self.max_len:
                raise CapacityError(
                    f"a trajectory needs {n} cache slots, more than max_len={self.max_len}"
                )
            size = min(size, self.max_len)
        return size

    def _allocation(self, room: int) -> int:
        """Cache slots to allocate for `room` slots in use: all of max_len at once when it is
        small (`Buckets.preallocate_max`), else the room itself."""
        if self.max_len is not None and self.max_len <= self.buckets.preallocate_max:
            return self.max_len
        return room

    def _kv_bucket(self, slot_rows: Sequence[int | None], new: int) -> int:
        """Cache slots the next program must attend over: every row's tokens plus `new` writes,
        rounded up to a power of two (>= cache_min) so that few programs are compiled, and at
        most the room in use, whatever was allocated."""
        longest = max((len(self._hist[r]) for r in slot_rows if r is not None), default=0)
        return min(pow2_bucket(longest + new, self.buckets.cache_min), self._room)

    def _index(self, slots: Sequence[int], size: int) -> np.ndarray:
        """Slot indices padded to `size` with an out-of-range index (= empty row / dropped)."""
        assert self._state is not None
        idx = np.full((size,), self._state.batch, np.int32)
        idx[: len(slots)] = slots
        return idx

    def _check_rows(self, rows: Iterable[int]) -> list[int]:
        rows = list(dict.fromkeys(int(r) for r in rows))
        live = set(self._live)
        for r in rows:
            if r in self._finished:
                raise ValueError(f"row {r} is finished")
            if r not in live:
                raise KeyError(f"no live row {r}")
        return rows

    def _check_tokens(self, toks: Sequence[int], what: str) -> list[int]:
        return checked_ids(toks, self.cfg.vocab_size, what)

    def _per_row_stops(self, stop_token_ids: StopIds, rows: Sequence[int]) -> dict[int, list[int]]:
        per = stops_per_row(stop_token_ids, len(self._hist))
        return {
            r: self._check_tokens(
                sorted(set(stop_token_ids if per is None else per[r])), f"stop set of row {r}"
            )
            for r in rows
        }

    def _ensure_capacity(self, rows: Sequence[int], extra: Mapping[int, int], idle: int) -> None:
        """Grows the caches so that every row of the batch about to run has room for its writes:
        `extra[r]` slots for the rows involved, `idle` for the others (idle rows still write
        padding at their end). A jitted write past the end would be clamped by XLA and silently
        overwrite the row's last tokens, so this is checked here, on the host."""
        assert self._state is not None
        need = max(len(self._hist[r]) + extra.get(r, idle) for r in rows)
        if need > self._room:
            self._room = self._cache_bucket(need)
            if self._room > self._state.capacity:
                self._state = self._in_mesh(core.grow, self.cfg, self._state, self._room)

    def _run(
        self, rows: Sequence[int], extra: Mapping[int, int], idle: int, fn: Callable
    ) -> dict[int, Any]:
        """Runs `fn(state, slot_rows) -> (state, tuple of per-slot arrays)` on the smallest batch
        bucket holding `rows`: the full state when that is the same size (other rows idle), else a
        gathered sub-batch that is scattered back. `extra`/`idle`: cache slots each row writes
        (see `_ensure_capacity`). Returns {row: tuple of that row's entries}."""
        assert self._state is not None
        sub_size = self._batch_bucket(rows)
        if sub_size < self._state.batch:
            self._ensure_capacity(rows, extra, idle)
            slot = {r: i for i, r in enumerate(self._live)}
            idx = self._index([slot[r] for r in rows], sub_size)
            sub = self._in_mesh(core.gather_rows, self.cfg, self._state, idx)
            slot_rows: list[int | None] = list(rows) + [None] * (sub_size - len(rows))
            sub, res = self._in_mesh(fn, sub, slot_rows)
            self._state = self._in_mesh(core.scatter_rows, self.cfg, self._state, sub, idx)
        else:
            self._ensure_capacity(self._live, extra, idle)
            slot_rows = list(self._live) + [None] * (self._state.batch - len(self._live))
            self._state, res = self._in_mesh(fn, self._state, slot_rows)
        at = {r: i for i, r in enumerate(slot_rows) if r is not None}
        return {r: tuple(x[at[r]] for x in res) for r in rows}

    def _append(self, row_tokens: dict[int, list[int]]) -> None:
        offset = 0
        while True:
            rows = [r for r, t in row_tokens.items() if len(t) > offset]
            if not rows:
                return
            t = self._chunk_bucket(max(len(row_tokens[r]) - offset for r in rows))

            def chunk(state, slot_rows, t=t, offset=offset):
                toks = np.zeros((len(slot_rows), t), np.int32)
                lens = np.zeros((len(slot_rows),), np.int32)
                for i, r in enumerate(slot_rows):
                    if r is not None and r in row_tokens:
                        part = row_tokens[r][offset : offset + t]
                        toks[i, : len(part)] = part
                        lens[i] = len(part)
                self.stats["prefill_padded_tokens"] += toks.size
                kv_len = self._kv_bucket(slot_rows, t)
                return core.prefill(self.cfg, self.params, state, toks, lens, kv_len=kv_len), (
                    lens,
                )

            self._run(rows, {}, t, chunk)
            for r in rows:
                self._record_prefilled(r, row_tokens[r][offset : offset + t])
            offset += t

    def _record_prefilled(self, row: int, toks: Sequence[int], computed: bool = True) -> None:
        """History of tokens now in `row`'s cache that were not sampled; `computed=False` for a
        copied shared prompt (counted in its first row's prefill only)."""
        self._hist[row] += toks
        self._sampled[row] += [False] * len(toks)
        self._logprobs[row] += [float("nan")] * len(toks)
        if computed:
            self._prefill[row] += len(toks)
            self.stats["prefill_tokens"] += len(toks)

    def _record(self, row: int, toks: np.ndarray, lps: np.ndarray) -> None:
        self._hist[row] += [int(t) for t in toks]
        self._sampled[row] += [True] * len(toks)
        self._logprobs[row] += [float(x) for x in lps]
        self.stats["decode_row_steps"] += len(toks)


def checked_ids(toks: Sequence[int], vocab_size: int, what: str) -> list[int]:
    toks = [int(t) for t in toks]
    bad = [t for t in toks if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids {bad[:5]} outside [0, {vocab_size})")
    return toks


def stops_per_row(stop_token_ids: StopIds, n: int) -> list[list[int]] | None:
    """Per-row stop sets indexed by row, or None when one set serves every row."""
    if isinstance(stop_token_ids, Mapping):
        return [list(stop_token_ids.get(r, ())) for r in range(n)]
    if len(stop_token_ids) and not isinstance(stop_token_ids[0], int | np.integer):
        if len(stop_token_ids) != n:
            raise ValueError(f"{len(stop_token_ids)} per-row stop sets for {n} rows")
        return [list(s) for s in stop_token_ids]
    return None


__all__ = [
    "CapacityError",
    "Session",
    "Trajectory",
    "TurnOutput",
    "checked_ids",
    "stops_per_row",
]
