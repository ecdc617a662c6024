"""Multi-turn group rollouts: P prompts × G trajectories, each row with its own KV cache.

Every trajectory is an `Episode` of the environment (text in, messages out) driven by one row of
a sampler `Lanes` (one `Session`, or on one CPU device one per core whose decode steps run side
by side; the environment steps on the caller's thread). After each assistant step, only the
tokens that follow it (tool results, the next user message, the generation prompt) are appended
to that row's cache; the sampled tokens stay exactly as sampled, so the training sequence is the
sequence the policy conditioned on.

Multi-process (SPMD): the sampler is one program over the global mesh, driven by identical host
control on every process; the environment is not. Each process creates, steps and scores only the
`Episode`s of its own contiguous share of the P × G rows (`distributed.process_rows`), then the
per-row outcomes (prompt ids, appended tokens, finished/truncated, reward results) are all-gathered
so that every process holds the same host state. `Rollouts.env_process` records which process ran
each row's environment. In a single process nothing is gathered.

The environment never ends the rollout: an exception from a simulator, the parser or the reward
of one row, or a simulator call past `call_timeout_s` (`executor.CallTimeout`), is caught at that
row, which then ends, scores 0 (`reward.ENV_ERROR`) and is named in `Rollouts.errors`
("Type: message").
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rcgrpo_jax import distributed, models
from rcgrpo_jax.data.packing import loss_index, shared_prompts
from rcgrpo_jax.envs import Environment, Episode, EpisodeSettings, prompts
from rcgrpo_jax.envs.executor import CALL_TIMEOUT_S
from rcgrpo_jax.envs.reward import ENV_ERROR, RewardResult
from rcgrpo_jax.envs.reward_tokens import NONE
from rcgrpo_jax.models import ModelConfig, Params
from rcgrpo_jax.sampling import Lanes, Trajectory
from rcgrpo_jax.shapes import cache_capacity, length_bucket

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    chat_format: str = "qwen"
    max_new_tokens: int = 256  # per assistant step
    max_len: int = 4096  # tokens per trajectory (= the train step's T)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_steps_per_turn: int = 20
    call_timeout_s: float = CALL_TIMEOUT_S  # wall-clock limit of one simulator call
    # rows sampled at once, each chunk with its own KV cache (sampler memory bounded by it, not
    # by P x G); the same trajectories whatever it is. 0 = all rows at once
    max_rows: int = 0
    sampler_weights: str = "tensor"  # mesh.sampler_weights (`models.SAMPLER_WEIGHTS`)


@dataclasses.dataclass
class Rollouts:
    """A [P, G] batch of finished trajectories, padded to T = the length bucket of the longest
    (`shapes.length_bucket`, at most settings.max_len)."""

    tokens: np.ndarray  # [P, G, T] int32
    segments: np.ndarray  # [P, G, T] int32: 1 real, 0 padding
    loss_mask: np.ndarray  # [P, G, T] int32: 1 on sampled tokens
    old_logprobs: np.ndarray  # [P, G, T] float32: sampler log-probs (0 where not sampled)
    rewards: np.ndarray  # [P, G] float32
    reward_token: np.ndarray  # [P, G] int32 (HIGH / LOW / NONE)
    results: list[list[RewardResult]]
    # P*G, row-major: the conversations and decoded calls; multi-process: None for the rows whose
    # environment another process ran (see env_process)
    episodes: list[Episode | None]
    stats: dict[str, float]
    env_process: np.ndarray | None = None  # [P, G] int32: the process that ran each environment
    # P*G, row-major: "Type: message" of the row's environment failure, None where there was none
    errors: list[str | None] = dataclasses.field(default_factory=list)
    # P*G, row-major: whether the row was cut at max_len (the same on every process)
    truncated: list[bool] = dataclasses.field(default_factory=list)

    @property
    def positions(self) -> np.ndarray:
        return np.broadcast_to(np.arange(self.tokens.shape[-1], dtype=np.int32), self.tokens.shape)

    def batch(self, gather_head: bool = True, share_prompt: bool = True) -> dict[str, np.ndarray]:
        """The fused train step's inputs; with `gather_head`, the `loss_index` [P, G, K] of the
        sampled tokens (the loss applies the head there only): one K for all of these groups,
        so every minibatch of the iteration's update has it. With `share_prompt`, also the
        groups' shared-prompt layout (`data.packing.shared_prompts`): the loss then runs each
        group's prompt through the model once, not once per rollout."""
        out = {
            "tokens": self.tokens,
            "positions": np.ascontiguousarray(self.positions),
            "segments": self.segments,
            "loss_mask": self.loss_mask,
            "old_logprobs": self.old_logprobs,
            "rewards": self.rewards,
            "reward_token": self.reward_token,
        }
        if gather_head:
            out["loss_index"] = loss_index(self.loss_mask)
        if share_prompt:
            out.update(shared_prompts(self.tokens, self.segments, self.loss_mask))
        return out

    def conversations(self, rows: Sequence[int]) -> dict[int, list[dict[str, str]]]:
        """The conversations of rows `rows` (row-major ids), on every process: each message's
        role, content and (tool messages) name. A row's episode lives only on the process that
        ran its environment, so multi-process this gathers them (a collective: every process
        calls it with the same rows); a row whose environment failed to open has none ([])."""
        wanted = set(rows)
        mine = [
            (r, [{k: m[k] for k in ("role", "content", "name") if k in m} for m in e.messages])
            for r, e in enumerate(self.episodes)
            if r in wanted and e is not None
        ]
        held = {r: msgs for part in distributed.allgather_objects(mine) for r, msgs in part}
        return {r: held.get(r, []) for r in rows}


def collect(
    cfg: ModelConfig,
    params: Params,
    tokenizer: Any,
    env: Environment,
    entries: Sequence[Any],
    reward_tokens: np.ndarray,
    settings: RolloutSettings,
    *,
    seed: int = 0,
    mesh: Any = None,
) -> Rollouts:
    """Runs len(entries) × G trajectories of `env`'s tasks `entries` to the end and returns them
    padded for training.

    reward_tokens [P, G]: the token each rollout is conditioned on (NONE: no token, plain GRPO).
    A trajectory that would outgrow `max_len` is ended there and scored on what it decoded.
    """
    t0 = time.perf_counter()
    p, g = reward_tokens.shape
    if len(entries) != p:
        raise ValueError(f"{len(entries)} entries for reward_tokens of shape {reward_tokens.shape}")
    n = p * g
    owner = distributed.row_owner(n)
    mine = distributed.process_rows(n)
    stops = prompts.stop_ids(tokenizer)
    episodes: list[Episode | None] = [None] * n
    errors: list[str | None] = [None] * n
    local = []
    for r in mine:  # only this process's environments exist here
        i, j = divmod(r, g)
        token = None if int(reward_tokens[i, j]) == NONE else int(reward_tokens[i, j])
        opener = functools.partial(_open, env, entries[i], token, settings, tokenizer)
        opened = _guarded(errors, r, entries[i], opener)
        if opened is None:  # starts (and at once ends) on one token, never sampled from
            local.append(_Report(Outcome.FAILED, [stops[0]]))
        else:
            episodes[r], prompt_ids = opened
            local.append(_Report(Outcome.APPEND, prompt_ids))
    gathered = [
        _Report.from_row(row)
        for part in distributed.allgather_rows([x.to_row() for x in local])
        for row in part
    ]  # row order
    start = [report.append for report in gathered]
    failed_at_start = [r for r, x in enumerate(gathered) if x.outcome == Outcome.FAILED]
    too_long = [i for i, s in enumerate(start) if len(s) >= settings.max_len]
    if too_long:
        raise ValueError(
            f"prompt of {entries[too_long[0] // g].id} has {len(start[too_long[0]])} tokens, "
            f">= max_len={settings.max_len}"
        )
    eot = (
        stops[0]
        if len(stops) == 1
        else tokenizer.convert_tokens_to_ids(prompts.end_of_turn_token(tokenizer))
    )
    rows = _Rows(start, set(failed_at_start), episodes, errors, owner, entries, g, stops, eot)
    params = models.sampler_params(cfg, params, settings.sampler_weights)  # once for all chunks
    cfg = models.sampler_config(cfg, settings.sampler_weights)  # LoRA: merged, or on the fly
    chunk = settings.max_rows or n
    sampled = Sampled()
    for lo in range(0, n, chunk):  # each chunk of rows with its own cache, released after it
        part = range(lo, min(lo + chunk, n))
        sampled += _sample(cfg, params, tokenizer, rows, part, settings, seed, mesh)
    rollout_s = time.perf_counter() - t0
    results, errors = _row_results(episodes, errors, mine, entries, g)
    return pack(
        sampled, reward_tokens, results, max_len=settings.max_len, rollout_s=rollout_s,
        episodes=episodes, owner=owner, errors=errors,
    )  # fmt: skip


@dataclasses.dataclass
class Sampled:
    """What the sampler made of some rows, in row order: their trajectories, the tokens
    prefilled, whether each was cut at `max_len`, and the assistant steps decoded."""

    trajectories: list[Trajectory] = dataclasses.field(default_factory=list)
    prefill_tokens: list[int] = dataclasses.field(default_factory=list)
    truncated: list[bool] = dataclasses.field(default_factory=list)
    assistant_steps: int = 0

    def __add__(self, other: Sampled) -> Sampled:
        """The rows of `self` followed by those of `other`."""
        return Sampled(
            self.trajectories + other.trajectories,
            self.prefill_tokens + other.prefill_tokens,
            self.truncated + other.truncated,
            self.assistant_steps + other.assistant_steps,
        )


@dataclasses.dataclass
class _Rows:
    """Host state of all P x G rows, indexed by global row (prompts, rows whose environment
    failed at the start, episodes, errors, owning processes), and the stop / end-of-turn ids."""

    start: list[list[int]]
    failed: set[int]
    episodes: list[Episode | None]
    errors: list[str | None]
    owner: list[int]
    entries: Sequence[Any]
    g: int
    stops: list[int]
    eot: int


def _sample(
    cfg, params, tokenizer, rows: _Rows, part: range, settings: RolloutSettings, seed, mesh
) -> Sampled:
    """Rows `part` (global ids) to the end of their trajectories in one `Lanes` (one session per
    core on one CPU device) whose row r is global row part.start + r (so each draws its own
    random stream, whatever the chunking). The environment steps run here, between turns."""
    lo = part.start
    # Trajectories end below max_len (checked above), but a padded prefill chunk may write past a
    # row's last real token: the cache gets that much headroom (CapacityError otherwise).
    session = Lanes(
        cfg, params, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, seed=seed, mesh=mesh,
        max_len=cache_capacity(settings.max_len), first_row=lo,
    )  # fmt: skip
    session.start([rows.start[r] for r in part], reserve=settings.max_new_tokens)
    session.finish([r - lo for r in part if r in rows.failed])
    length = [len(rows.start[r]) for r in part]
    truncated = [False] * len(part)
    assistant_steps = 0
    while session.live_rows:  # session row i is global row lo + i
        # 2 slots of headroom: the sampler writes one padding token after a row's last token
        budget = {
            i: min(settings.max_new_tokens, settings.max_len - 2 - length[i])
            for i in session.live_rows
        }
        full = [i for i, b in budget.items() if b <= 0]
        for i in full:
            truncated[i] = True
        session.finish(full)
        live = session.live_rows
        if not live:
            break
        out = session.decode_turn({i: budget[i] for i in live}, rows.stops)  # on every process
        for i in live:
            length[i] += len(out.tokens[i])
            # a message max_len cut short (not the per-message cap): the trajectory is cut
            # there, whether or not the episode goes on
            cut = budget[i] < settings.max_new_tokens and len(out.tokens[i]) >= budget[i]
            truncated[i] = truncated[i] or (cut and not out.stopped[i])
        assistant_steps += len(live)
        # The environment steps this process's rows; each reports what became of its row.
        reports = []
        for i in live:
            r = lo + i
            if rows.owner[r] != distributed.process_index():
                continue
            advance = functools.partial(
                _advance, rows.episodes[r], tokenizer, out.tokens[i], out.stopped[i], length[i],
                rows.eot, settings,
            )  # fmt: skip
            entry = rows.entries[r // rows.g]
            reports.append(_guarded(rows.errors, r, entry, advance) or _Report(Outcome.FAILED))
        gathered = distributed.allgather_rows([x.to_row() for x in reports])
        by_process = [iter(p) for p in gathered]
        done, appends = [], {}
        for i in live:  # every process lists its rows in this same order
            report = _Report.from_row(next(by_process[rows.owner[lo + i]]))
            if report.outcome == Outcome.APPEND:
                appends[i] = report.append
                length[i] += len(report.append)
                continue
            truncated[i] = truncated[i] or report.outcome == Outcome.TRUNCATED
            done.append(i)
        session.finish(done)
        session.append(appends)
    trajs = [session.trajectory(i) for i in range(len(part))]  # copies: fetch each once
    return Sampled(trajs, session.prefill_tokens, truncated, assistant_steps)


class Outcome(enum.IntEnum):
    """What became of a row after one assistant step and its environment step, or after its
    episode was opened (APPEND its prompt, or FAILED)."""

    APPEND = 0  # the conversation goes on: tokens to append to the row's cache
    DONE = 1  # the episode ended
    TRUNCATED = 2  # the next tokens would not fit max_len: ended there
    FAILED = 3  # the environment raised: ended, scored 0


@dataclasses.dataclass(frozen=True)
class _Report:
    """One row's `Outcome` and, for APPEND, the tokens to append; travels between processes as
    one int row [outcome, *append] (`distributed.allgather_rows`)."""

    outcome: Outcome
    append: list[int] = dataclasses.field(default_factory=list)

    def to_row(self) -> list[int]:
        return [int(self.outcome), *self.append]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> _Report:
        return cls(Outcome(row[0]), list(row[1:]))


def _open(env, entry, token, settings, tokenizer) -> tuple[Episode, list[int]]:
    """A row's episode and its prompt tokens."""
    episode = env.episode(
        entry,
        EpisodeSettings(settings.chat_format, settings.max_steps_per_turn, settings.call_timeout_s),
        reward_token=token,
    )
    return episode, prompts.prompt_ids(tokenizer, episode.messages, episode.tools)


def _advance(episode, tokenizer, token_ids, stopped, length, eot, settings) -> _Report:
    """One environment step of a row after its assistant step."""
    text_ids = token_ids[:-1] if stopped else token_ids
    step = episode.step(tokenizer.decode(text_ids, skip_special_tokens=False))
    if step.done:
        return _Report(Outcome.DONE)
    # an unfinished message is closed by the template: the model did not sample that
    more = ([] if stopped else [eot]) + prompts.continuation_ids(
        tokenizer, episode.messages, episode.tools
    )
    if length + len(more) + 2 >= settings.max_len:
        return _Report(Outcome.TRUNCATED)
    return _Report(Outcome.APPEND, more)


def _guarded(errors: list[str | None], r: int, entry: Any, fn: Callable[[], Any]) -> Any:
    """fn() for row r; an environment failure is recorded in errors[r] and gives None.

    Anything but Ctrl-C counts: also a `CallTimeout` and a simulator's SystemExit."""
    try:
        return fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - one row must not end the rollout
        first = str(e).splitlines()[0] if str(e) else ""
        errors[r] = f"{type(e).__name__}: {first}"[:300]
        log.warning("rollout row %d (%s): environment failed, scored 0: %s", r, entry.id, errors[r])
        return None


def _row_results(episodes, errors, mine, entries, g):
    """Every row's RewardResult and error (gathered from the process that ran the row)."""
    local = []
    for r in mine:
        result = None
        if errors[r] is None:
            result = _guarded(errors, r, entries[r // g], episodes[r].result)
        if result is None:
            result = RewardResult(0.0, False, False, ENV_ERROR)
        local.append((result, errors[r]))
    if distributed.process_count() > 1:
        fields = [{**dataclasses.asdict(x), "env_error": err} for x, err in local]
        local = [
            (RewardResult(**{k: v for k, v in d.items() if k != "env_error"}), d["env_error"])
            for part in distributed.allgather_objects(fields)
            for d in part
        ]
    return [x for x, _ in local], [err for _, err in local]


def pack(
    sampled: Sampled,
    reward_tokens: np.ndarray,
    results: Sequence[RewardResult],
    *,
    max_len: int,
    rollout_s: float,
    episodes: Sequence[Episode | None] | None = None,
    owner: Sequence[int] | None = None,
    errors: Sequence[str | None] | None = None,
) -> Rollouts:
    """The [P, G] `Rollouts` of `sampled`'s P x G rows (row-major) and their `results`, padded
    to the length bucket of the longest (at most `max_len`). Rows without `episodes`, `owner`
    or `errors`: none recorded, all run by process 0, no environment failure."""
    p, g = reward_tokens.shape
    n = p * g
    episodes = [None] * n if episodes is None else list(episodes)
    owner = [0] * n if owner is None else owner
    errors = [None] * n if errors is None else list(errors)
    trajs = sampled.trajectories
    longest = max(len(traj.tokens) for traj in trajs)
    t = min(length_bucket(longest), max_len)  # rows sized to their content
    tokens = np.zeros((p, g, t), np.int32)
    segments = np.zeros((p, g, t), np.int32)
    loss_mask = np.zeros((p, g, t), np.int32)
    old = np.zeros((p, g, t), np.float32)
    rewards = np.zeros((p, g), np.float32)
    sampled_tokens = 0
    for r, traj in enumerate(trajs):
        i, j = divmod(r, g)
        length = len(traj.tokens)
        tokens[i, j, :length] = traj.tokens
        segments[i, j, :length] = 1
        mask = np.asarray(traj.sampled, bool)
        loss_mask[i, j, :length] = mask
        old[i, j, :length] = np.where(
            mask, np.nan_to_num(np.asarray(traj.logprobs, np.float32)), 0.0
        )
        sampled_tokens += int(mask.sum())
    grouped = [list(results[i * g : (i + 1) * g]) for i in range(p)]
    for i in range(p):
        for j in range(g):
            rewards[i, j] = grouped[i][j].reward
    stats = {
        "rollout_s": rollout_s,
        "assistant_steps": float(sampled.assistant_steps),
        "sampled_tokens": float(sampled_tokens),
        "prefill_tokens": float(sum(sampled.prefill_tokens)),
        "trajectory_tokens": float(segments.sum()),
        "truncated": float(sum(sampled.truncated)),
        "env_errors": float(sum(e is not None for e in errors)),
        "sampled_tokens_per_s": sampled_tokens / max(rollout_s, 1e-9),
    }
    return Rollouts(
        tokens=tokens, segments=segments, loss_mask=loss_mask, old_logprobs=old,
        rewards=rewards, reward_token=np.asarray(reward_tokens, np.int32), results=grouped,
        episodes=episodes, stats=stats,
        env_process=np.asarray(owner, np.int32).reshape(p, g), errors=list(errors),
        truncated=list(sampled.truncated),
    )  # fmt: skip


def concat_groups(parts: Sequence[Rollouts]) -> Rollouts:
    """The groups of several rollout rounds as one batch, right-padded to the longest T (as
    `pack` pads); stats summed (rates recomputed)."""
    if len(parts) == 1:
        return parts[0]
    t = max(x.tokens.shape[-1] for x in parts)
    cat = lambda key: np.concatenate(
        [np.pad(getattr(x, key), [(0, 0), (0, 0), (0, t - x.tokens.shape[-1])]) for x in parts]
    )
    stats = {k: sum(x.stats[k] for x in parts) for k in parts[0].stats}
    stats["sampled_tokens_per_s"] = stats["sampled_tokens"] / max(stats["rollout_s"], 1e-9)
    owners = [x.env_process for x in parts]
    return Rollouts(
        tokens=cat("tokens"), segments=cat("segments"), loss_mask=cat("loss_mask"),
        old_logprobs=cat("old_logprobs"), rewards=np.concatenate([x.rewards for x in parts]),
        reward_token=np.concatenate([x.reward_token for x in parts]),
        results=[r for x in parts for r in x.results],
        episodes=[e for x in parts for e in x.episodes], stats=stats,
        env_process=None if any(o is None for o in owners) else np.concatenate(owners),
        errors=[e for x in parts for e in x.errors],
        truncated=[t for x in parts for t in x.truncated],
    )  # fmt: skip
