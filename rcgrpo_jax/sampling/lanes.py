"""Lanes: one batch of rows split over several `Session`s whose device work runs side by side.

XLA:CPU runs one session's decode step, a chain of small GEMMs, on about one core; a batch split
into lanes, each lane's programs issued from a thread of its own, keeps every core busy. `Lanes`
has the rollout interface of a `Session` (`start`, `decode_turn`, `append`, `finish`,
`live_rows`, `trajectory`, `prefill_tokens`) with the rows numbered as in one session: the RL
rollout and `generate` drive it as they would drive one session. Only the device calls run on
the lanes' threads; the caller's own work between them (the environment's steps, tokenization)
stays on the caller's thread, where the simulator's SIGALRM time limit works.

Each row draws from its own random stream (seed, row), so the samples are the same whatever the
split, barring last-bit ties (a smaller batch may round a logit's last bit otherwise).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from rcgrpo_jax import distributed, machine, models
from rcgrpo_jax.models.config import ModelConfig
from rcgrpo_jax.sampling.session import (
    Session,
    StopIds,
    Trajectory,
    TurnOutput,
    checked_ids,
    stops_per_row,
)
from rcgrpo_jax.shapes import Buckets


class Lanes:
    """Rows 0..N-1 (numbered at `start`) split contiguously over `lanes` sessions: evenly, each
    cut moved to where the prompt changes when prompts are shared (`split_points`).

    `lanes`: None = one per usable core with at least `buckets.batch_min` rows each, on a
    single-process run on one CPU device (`generate_lanes`); more than one needs such a run,
    since programs with collectives issued from several threads could deadlock. The other
    keywords are `Session`'s, the same for every lane.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: models.Params,
        *,
        lanes: int | None = None,
        mesh: Mesh | None = None,
        buckets: Buckets = Buckets(),  # noqa: B008 (frozen dataclass)
        first_row: int = 0,
        **session_kwargs: Any,
    ) -> None:
        if lanes is not None and int(lanes) < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else models.params_mesh(params)
        if lanes is not None and int(lanes) > 1 and not one_device(self.mesh):
            raise ValueError("lanes > 1 needs a single-process run on one device")
        self._lanes = None if lanes is None else int(lanes)
        self._new_session = lambda first: Session(
            cfg, params, mesh=self.mesh, buckets=buckets, first_row=first_row + first,
            **session_kwargs,
        )  # fmt: skip
        self.buckets = buckets
        self._sessions: list[Session] = []
        self._starts: list[int] = []  # first row of each lane
        self._n = 0

    @property
    def lanes(self) -> int:
        """Sessions the rows are split over (known once `start` has run)."""
        return len(self._sessions)

    @property
    def live_rows(self) -> list[int]:
        """Rows not yet finished, lane by lane."""
        pairs = zip(self._starts, self._sessions, strict=True)
        return [lo + r for lo, sess in pairs for r in sess.live_rows]

    @property
    def prefill_tokens(self) -> list[int]:
        """Real tokens prefilled per row so far (see `Session.prefill_tokens`)."""
        return [t for s in self._sessions for t in s.prefill_tokens]

    def start(
        self, prompts: Sequence[Sequence[int]], *, reserve: int = 0, share_prompts: bool = True
    ) -> list[int]:
        """Splits the prompts over the lanes and prefills each lane's (`Session.start`)."""
        if self._sessions:
            raise RuntimeError("Lanes.start may only be called once")
        n = len(prompts)
        if not n:
            raise ValueError("no prompts")
        # checked here, so that an error names the caller's row before any lane starts
        vocab = self.cfg.vocab_size
        prompts = [checked_ids(p, vocab, f"prompt {i}") for i, p in enumerate(prompts)]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lanes = generate_lanes(n, self.mesh, self.buckets) if self._lanes is None else self._lanes
        bounds = split_points(prompts, min(lanes, n), share_prompts)
        self._n, self._starts = n, bounds[:-1]
        self._sessions = [self._new_session(lo) for lo in self._starts]
        parts = list(zip(self._sessions, bounds, bounds[1:], strict=False))

        def lane_start(part: tuple[Session, int, int]) -> None:
            sess, lo, hi = part
            sess.start(prompts[lo:hi], reserve=reserve, share_prompts=share_prompts)

        each_on_its_thread(lane_start, parts)
        return list(range(n))

    def decode_turn(
        self,
        max_new_tokens: int | Mapping[int, int],
        stop_token_ids: StopIds = (),
        rows: Iterable[int] | None = None,
    ) -> TurnOutput:
        """`Session.decode_turn` over the rows (default: all live), every lane at once."""
        rows = self._check_rows(self.live_rows if rows is None else rows)
        per_row = stops_per_row(stop_token_ids, self._n)
        # checked before any lane runs, naming the caller's rows
        for i, st in [(None, stop_token_ids)] if per_row is None else enumerate(per_row):
            what = "stop set" if i is None else f"stop set of row {i}"
            checked_ids(st, self.cfg.vocab_size, what)
        each = isinstance(max_new_tokens, Mapping)
        budgets = [max_new_tokens[r] for r in rows] if each else [max_new_tokens]
        if any(int(b) < 0 for b in budgets):
            raise ValueError("max_new_tokens must be >= 0")

        def lane_turn(lane: int, local: list[int]) -> TurnOutput:
            lo = self._starts[lane]
            budget = {r: int(max_new_tokens[lo + r]) for r in local} if each else max_new_tokens
            stops = stop_token_ids if per_row is None else {r: per_row[lo + r] for r in local}
            return self._sessions[lane].decode_turn(budget, stops, rows=local)

        outs = self._per_lane(rows, lane_turn)
        local = {r: (outs[self._lane(r)], r - self._starts[self._lane(r)]) for r in rows}
        return TurnOutput(
            tokens={r: out.tokens[i] for r, (out, i) in local.items()},
            logprobs={r: out.logprobs[i] for r, (out, i) in local.items()},
            stopped={r: out.stopped[i] for r, (out, i) in local.items()},
        )

    def append(self, row_tokens: Mapping[int, Sequence[int]]) -> None:
        """`Session.append`, every lane at once."""
        rows = self._check_rows(row_tokens.keys())
        for r in rows:  # before any lane appends, naming the caller's row
            checked_ids(row_tokens[r], self.cfg.vocab_size, f"row {r}")
        lo = self._starts
        self._per_lane(
            rows,
            lambda lane, local: self._sessions[lane].append(
                {r: row_tokens[lo[lane] + r] for r in local}
            ),
        )

    def finish(self, rows: Iterable[int]) -> None:
        """`Session.finish` (dispatch only: it runs on the caller's thread)."""
        for lane, local in self._split(self._check_rows(rows)).items():
            self._sessions[lane].finish(local)

    def trajectory(self, row: int) -> Trajectory:
        if not 0 <= row < self._n:
            raise KeyError(f"no row {row}")
        lane = self._lane(row)
        return self._sessions[lane].trajectory(row - self._starts[lane])

    # ----------------------------------------------------------------- internals

    def _lane(self, row: int) -> int:
        return bisect.bisect_right(self._starts, row) - 1

    def _split(self, rows: Sequence[int]) -> dict[int, list[int]]:
        """{lane: its local row ids}, in the order given."""
        out: dict[int, list[int]] = {}
        for r in rows:
            lane = self._lane(r)
            out.setdefault(lane, []).append(r - self._starts[lane])
        return out

    def _per_lane(self, rows: Sequence[int], fn: Callable[[int, list[int]], Any]) -> dict[int, Any]:
        """{lane: fn(lane, local rows)} for each lane holding some of `rows`, on threads."""
        split = self._split(rows)
        lanes = list(split)
        results = each_on_its_thread(lambda lane: fn(lane, split[lane]), lanes)
        return dict(zip(lanes, results, strict=True))

    def _check_rows(self, rows: Iterable[int]) -> list[int]:
        """The rows, deduplicated; an error names the caller's row id (not a lane's)."""
        rows = list(dict.fromkeys(int(r) for r in rows))
        live = set(self.live_rows)
        for r in rows:
            if r not in live:
                raise (ValueError(f"row {r} is finished") if 0 <= r < self._n else KeyError(
                    f"no live row {r}"
                ))  # fmt: skip
        return rows


@dataclasses.dataclass
class Generation:
    """Result of `generate`: per row, the new tokens (cut after the first stop token, kept),
    their log-probs under the policy at temperature 1, lengths, and whether a stop token hit."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    lengths: list[int]
    stopped: list[bool]


def generate(
    cfg: ModelConfig,
    params: models.Params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: StopIds = (),
    seed: int = 0,
    mesh: Mesh | None = None,
    buckets: Buckets = Buckets(),  # noqa: B008 (frozen dataclass)
    lanes: int | None = None,
) -> Generation:
    """Samples up to `max_new_tokens` per prompt (ragged prompts, one jitted prefill + decode).

    stop_token_ids: one set for all rows or one per row; a row stops after its first stop token,
    which is kept. Log-probs are under the policy at temperature 1 (the RL "old log-probs").
    `lanes`: see `Lanes` (None: one per usable core on one CPU device). The lanes' threads do not
    see the caller's thread-local JAX settings (`jax.default_device` and the like): params and
    `mesh` decide where the programs run.
    """
    if not len(prompts):
        raise ValueError("no prompts")
    stops_per_row(stop_token_ids, len(prompts))  # a count mismatch is named before any lane runs
    sess = Lanes(
        cfg, params, lanes=lanes, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        mesh=mesh, buckets=buckets,
    )  # fmt: skip
    rows = sess.start(prompts, reserve=max_new_tokens)
    out = sess.decode_turn(max_new_tokens, stop_token_ids)
    return Generation(
        tokens=[out.tokens[r] for r in rows],
        logprobs=[out.logprobs[r] for r in rows],
        lengths=[len(out.tokens[r]) for r in rows],
        stopped=[out.stopped[r] for r in rows],
    )


def each_on_its_thread(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """[fn(item) for item in items], each on a thread of its own, all started at once (a pool
    may hand a worker that finished early the next item, and then two lanes run one after the
    other); the first exception is raised once every thread has ended. One item runs here."""
    if len(items) == 1:
        return [fn(items[0])]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)

    def target(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 (re-raised below, on the caller's thread)
            errors[i] = e

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def split_points(prompts: Sequence[Sequence[int]], lanes: int, share_prompts: bool) -> list[int]:
    """[0, ..., len(prompts)]: the first row of each lane, then the end. Even (sizes differ by
    at most 1), except that with `share_prompts` each cut moves to the nearest row where the
    prompt changes, so that a prompt shared by consecutive rows (GRPO's group) is prefilled in
    one lane only, whatever the core count (one that recurs further on, in another lane, is
    prefilled there again); lanes that would be left empty are dropped."""
    n = len(prompts)
    even = [n * i // lanes for i in range(1, lanes)]
    if not share_prompts:
        return [0, *even, n]
    edges = [i for i in range(1, n) if prompts[i] != prompts[i - 1]]
    cuts: list[int] = []
    for c in even:
        later = [e for e in edges if e > (cuts[-1] if cuts else 0)]
        if later:
            cuts.append(min(later, key=lambda e: (abs(e - c), e)))
    return [0, *sorted(set(cuts)), n]


def generate_lanes(rows: int, mesh: Mesh | None, buckets: Buckets = Buckets()) -> int:  # noqa: B008
    """The default split: one lane per usable core, each of at least `buckets.batch_min` rows
    (smaller lanes would be padded to it), on a single-process run on one CPU device; 1
    elsewhere (a mesh of several devices already spreads the rows)."""
    if not one_device(mesh) or jax.default_backend() != "cpu":
        return 1
    return max(1, min(machine.usable_cores(), rows // buckets.batch_min))


def one_device(mesh: Mesh | None) -> bool:
    """Whether this is a single-process run on one device: the only place lanes may run, since
    programs with collectives issued from several threads could deadlock."""
    return (mesh is None or mesh.size == 1) and distributed.process_count() == 1


__all__ = ["Generation", "Lanes", "generate_lanes", "each_on_its_thread", "generate", "one_device"]
