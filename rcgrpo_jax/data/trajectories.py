"""RCTP's mixed-quality trajectory dataset (stage 1) and the plain-SFT dataset, from one builder.

Sources, over training-split entries only, all played through episodes so tool results and
follow-up turns are the environment's own. For the built-in environments (BFCL-shaped
`Entry` tasks, `golden_trajectories`):
- `ground_truth`: the ground-truth calls;
- `perturb:<kind>`: ground truth changed in one way (`data.perturb.PERTURBATIONS`);
- `rollout`: a given policy (e.g. the base model via `envs.policies.model_policy`).
For any other environment (the protocol alone, `envs.base`), `protocol_sources`:
- `demonstration`: the environment's own demonstrations (`Environment.demonstration`), if any;
- `rollout`: the starting policy's rollouts, made by the stage (`rl.rollout.collect`) and
  handed in as `RecordedEpisode`s.

Every trajectory's label is the reward it received (`Episode.result()`), never its source: a
perturbation that still scores 1 is high quality. RCTP keeps all label-1 trajectories plus
`low_per_high` label-0 ones per label-1 one, and renders each with its label's reward token at
the start of the system prompt; plain SFT (`DataSettings.enabled=False`) keeps label-1
trajectories only, without a token (rejection sampling, where the pool holds rollouts). Records
go to `data.store.write_dataset`; `meta` holds the decoded calls so a label can be recomputed
from the stored record (`recompute_reward`, BFCL). A split with fewer than
`min_per_label` stored examples of a label it needs is refused (`check_label_counts`).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rcgrpo_jax.data import store
from rcgrpo_jax.data.perturb import (
    PERTURBATIONS,
    ScriptedPolicy,
    ground_truth_plan,
    perturb,
    plan_key,
)
from rcgrpo_jax.envs import EpisodeSettings, prompts
from rcgrpo_jax.envs.entries import CATEGORIES, Entry
from rcgrpo_jax.envs.episode import MAX_STEPS_PER_TURN, Episode
from rcgrpo_jax.envs.policies import Policy, run_episodes
from rcgrpo_jax.envs.reward import RewardResult, trajectory_reward
from rcgrpo_jax.envs.split import split_ids

log = logging.getLogger(__name__)

GROUND_TRUTH = "ground_truth"
DEMONSTRATION = "demonstration"
ROLLOUT = "rollout"
PERTURB_PREFIX = "perturb:"
TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "heldout"
Counts = dict[str, dict[int, int]]  # source -> label -> number of trajectories


@dataclass(frozen=True)
class DataSettings:
    """How the builder makes the dataset; the stage fills it from the config key named beside
    each field (`stages.sft.data_settings`)."""

    enabled: bool = True  # the stage is rctp: reward tokens + low pool; False = plain SFT
    low_per_high: float = 1.0  # rctp.low_per_high: label-0 per label-1 kept; < 0 keeps all
    perturbations: tuple[str, ...] = PERTURBATIONS  # rctp.perturbations: kinds to generate
    perturbations_per_entry: int = 1  # rctp.perturbations_per_entry: per kind and entry
    rollouts_per_entry: int = 0  # rctp.rollouts_per_entry: policy trajectories per entry
    rollout_batch: int = 64  # rctp.rollout_batch: episodes stepped together per policy call
    heldout_entries: int = 0  # rctp.heldout_entries: entries moved to the "heldout" split
    max_tokens: int = 0  # rctp.max_tokens: longer rendered trajectories dropped; 0 = no limit
    seed: int = 0  # seed
    chat_format: str = "qwen"  # model.chat_format
    max_steps_per_turn: int = MAX_STEPS_PER_TURN  # env.max_steps_per_turn
    call_timeout_s: float | None = 5.0  # env.call_timeout_s (demonstrations' episodes)
    min_per_label: int = 0  # rctp.min_per_label: fewer stored examples of a label is an error

    def __post_init__(self) -> None:
        unknown = set(self.perturbations) - set(PERTURBATIONS)
        if unknown:
            raise ValueError(f"unknown perturbations {sorted(unknown)}; expected {PERTURBATIONS}")


@dataclass(frozen=True)
class RecordedEpisode:
    """What a record needs of a finished episode (`envs.base.Episode`), kept as plain data:
    a rollout's episode, possibly run by another process (`rl.rollout.Rollouts.episodes`)."""

    entry: Any  # the task
    messages: list[dict[str, Any]]
    tools: list[dict] | None
    decoded: list[list[list[str]]]


@dataclass
class Trajectory:
    """One finished episode with where it came from and the reward it received."""

    source: str
    episode: Any  # an `envs.base.Episode` (BFCL's `Episode`, a `RecordedEpisode`, ...)
    result: RewardResult
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> int:
        return int(self.result.reward == 1.0)


def check_training_entries(entries: Iterable[Entry]) -> None:
    """Raises if a BFCL entry is outside the training split (test scenarios must stay unseen).
    Entries of other benchmarks (synthetic tasks) come from their own train generator."""
    train = {c: set(split_ids("train", c)) for c in CATEGORIES}
    bad = [e.id for e in entries if e.category in train and e.id not in train[e.category]]
    if bad:
        raise ValueError(f"{len(bad)} entries are not in the training split, e.g. {bad[:3]}")


# ---------------------------------------------------------------------------------------------
# Sources


def _episode(entry: Entry, settings: DataSettings) -> Episode:
    return Episode(entry, settings.chat_format, max_steps_per_turn=settings.max_steps_per_turn)


def _finish(source: str, episode: Episode, info: dict[str, Any]) -> Trajectory:
    return Trajectory(source, episode, episode.result(), info)


def scripted_trajectories(
    entries: Sequence[Entry], settings: DataSettings
) -> tuple[list[Trajectory], Counter]:
    """Ground truth and its perturbations, played through episodes.

    Each (entry, kind, k) draws from its own seeded RNG, so an entry's trajectories do not
    depend on which other entries are built. Returns the trajectories and, per source, how
    many perturbations could not apply or repeated an earlier one.
    """
    plans: dict[Episode, Any] = {}
    infos: list[tuple[str, Episode, dict[str, Any]]] = []
    skipped: Counter = Counter()
    for entry in entries:
        truth = ground_truth_plan(entry, settings.chat_format)
        episode = _episode(entry, settings)
        plans[episode] = truth
        infos.append((GROUND_TRUTH, episode, {}))
        seen = {plan_key(truth)}
        for kind in settings.perturbations:
            for k in range(settings.perturbations_per_entry):
                rng = random.Random(f"{settings.seed}:{entry.id}:{kind}:{k}")
                p = perturb(entry, truth, kind, rng)
                if p is None or plan_key(p.plan) in seen:
                    skipped[PERTURB_PREFIX + kind] += 1
                    continue
                seen.add(plan_key(p.plan))
                episode = _episode(entry, settings)
                plans[episode] = p.plan
                info = {"perturbation": {"kind": kind, "turn": p.turn, "detail": p.detail}}
                infos.append((PERTURB_PREFIX + kind, episode, info))
    run_episodes(list(plans), ScriptedPolicy(plans))
    return [_finish(source, ep, info) for source, ep, info in infos], skipped


def rollout_trajectories(
    entries: Sequence[Entry], policy: Policy, settings: DataSettings
) -> list[Trajectory]:
    """`rollouts_per_entry` trajectories of `policy` per entry, `rollout_batch` at a time."""
    episodes = [
        _episode(entry, settings) for entry in entries for _ in range(settings.rollouts_per_entry)
    ]
    size = max(settings.rollout_batch, 1)
    for i in range(0, len(episodes), size):
        run_episodes(episodes[i : i + size], policy)
    return [_finish(ROLLOUT, ep, {}) for ep in episodes]


def demonstration_trajectories(
    env: Any, tasks: Sequence[Any], settings: DataSettings
) -> list[Trajectory]:
    """The environment's demonstrations (`Environment.demonstration(task)`: assistant texts, one
    per step), each played through a fresh episode without a reward token until the texts run
    out or the episode ends, and labelled by the reward it gets (a demonstration that fails is
    a label-0 trajectory). Tasks without one, and environments without the method, give none."""
    demonstration = getattr(env, "demonstration", None)
    if demonstration is None:
        return []
    episode_settings = EpisodeSettings(
        settings.chat_format, settings.max_steps_per_turn, settings.call_timeout_s
    )
    out = []
    for task in tasks:
        texts = demonstration(task)
        if texts is None:
            continue
        episode = env.episode(task, episode_settings, reward_token=None)
        for text in texts:
            if episode.done:
                break
            episode.step(text)
        out.append(_finish(DEMONSTRATION, episode, {}))
    return out


Sources = Callable[[Sequence[Any]], tuple[list[Trajectory], Counter]]  # tasks -> (pool, skipped)


def protocol_sources(env: Any, settings: DataSettings, rollouts: Sources | None = None) -> Sources:
    """Stage 1's sources on an environment that has only the protocol: its demonstrations, then
    `rollouts(tasks)` (the starting policy's, labelled by reward; None: none)."""

    def sources(tasks: Sequence[Any]) -> tuple[list[Trajectory], Counter]:
        pool = demonstration_trajectories(env, tasks, settings)
        if rollouts is None:
            return pool, Counter()
        more, skipped = rollouts(tasks)
        return pool + more, skipped

    return sources


def collect_trajectories(
    entries: Sequence[Entry], settings: DataSettings, policy: Policy | None = None
) -> tuple[list[Trajectory], Counter]:
    """All sources for `entries`: scripted ones, then the policy's rollouts if one is given."""
    trajectories, skipped = scripted_trajectories(entries, settings)
    if settings.rollouts_per_entry > 0:
        if policy is None:
            log.warning("rctp.rollouts_per_entry > 0 but no policy given: no rollouts")
        else:
            trajectories += rollout_trajectories(entries, policy, settings)
    return trajectories, skipped


# ---------------------------------------------------------------------------------------------
# Records


def trajectory_meta(t: Trajectory) -> dict[str, Any]:
    """What the record keeps besides tokens: enough to recompute and explain the label."""
    return {
        "entry_id": t.episode.entry.id,
        "category": t.episode.entry.category,
        "chat_format": getattr(t.episode, "chat_format", None),  # BFCL's episodes keep it
        "decoded": t.episode.decoded,
        "reward": t.result.reward,
        "error_type": t.result.error_type,
        "error_turn": t.result.error_turn,
        **t.info,
    }


def to_example(
    t: Trajectory, tokenizer: Any, reward_tokens: Mapping[int, int] | None
) -> dict[str, Any]:
    """Store record of a trajectory: rendered with its label's reward token at the start of the
    system prompt when `reward_tokens` is given (RCTP), without any token otherwise (SFT)."""
    label = t.label
    reward = label if reward_tokens is not None else None
    messages = prompts.set_reward_token(t.episode.messages, reward)
    tokens, mask = prompts.render_with_mask(tokenizer, messages, t.episode.tools)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "label": label,
        "reward_token": -1 if reward_tokens is None else int(reward_tokens[label]),
        "source": t.source,
        "entry_id": t.episode.entry.id,
        "meta": json.dumps(trajectory_meta(t)),
    }


def recompute_reward(record: Mapping[str, Any], entry: Entry) -> RewardResult:
    """The reward of a stored record, from its decoded calls (checks a label independently)."""
    meta = json.loads(record["meta"])
    if meta["entry_id"] != entry.id:
        raise ValueError(f"record of {meta['entry_id']} checked against {entry.id}")
    return trajectory_reward(entry, meta["decoded"])


def _fits(example: Mapping[str, Any], max_tokens: int) -> bool:
    return max_tokens <= 0 or len(example["tokens"]) <= max_tokens


def select_examples(
    trajectories: Sequence[Trajectory],
    tokenizer: Any,
    settings: DataSettings,
    reward_tokens: Mapping[int, int] | None,
    rng: random.Random,
) -> tuple[list[dict[str, Any]], int]:
    """Rendered examples of one split in trajectory order, and how many were too long.

    All label-1 trajectories that fit; for RCTP, label-0 ones drawn at random until
    `low_per_high` x (label-1 kept) fit (all of them if `low_per_high` < 0). Only what is kept
    is rendered, so plain SFT never renders the low pool.
    """
    kept: dict[int, dict[str, Any]] = {}
    too_long = 0
    for i, t in enumerate(trajectories):
        if t.label == 1:
            ex = to_example(t, tokenizer, reward_tokens)
            if _fits(ex, settings.max_tokens):
                kept[i] = ex
            else:
                too_long += 1
    if settings.enabled:
        low = [i for i, t in enumerate(trajectories) if t.label == 0]
        rng.shuffle(low)
        n_high = len(kept)
        quota = len(low) if settings.low_per_high < 0 else round(settings.low_per_high * n_high)
        n_low = 0
        for i in low:
            if n_low >= quota:
                break
            ex = to_example(trajectories[i], tokenizer, reward_tokens)
            if _fits(ex, settings.max_tokens):
                kept[i] = ex
                n_low += 1
            else:
                too_long += 1
    return [kept[i] for i in sorted(kept)], too_long


# ---------------------------------------------------------------------------------------------
# Counts


def count_labels(items: Iterable[Any]) -> Counts:
    """source -> {0: n, 1: n} for trajectories or records (anything with source and label)."""
    out: dict[str, dict[int, int]] = {}
    for x in items:
        source, label = (x["source"], x["label"]) if isinstance(x, Mapping) else (x.source, x.label)
        row = out.setdefault(source, {0: 0, 1: 0})
        row[int(label)] += 1
    return {s: out[s] for s in sorted(out, key=_source_order)}


def _source_order(source: str) -> tuple[int, str]:
    rank = {GROUND_TRUTH: 0, DEMONSTRATION: 0, ROLLOUT: 2}.get(source, 1)
    return rank, source


def label_totals(counts: Counts) -> dict[int, int]:
    """{0: n, 1: n} over every source of `counts`."""
    return {label: sum(row[label] for row in counts.values()) for label in (0, 1)}


LABEL_NAMES = {0: "label-0 (<|low_reward|>)", 1: "label-1 (<|high_reward|>)"}


class TooFewExamples(ValueError):
    """The stored training split lacks examples the stage needs (the message is one line)."""


def check_label_counts(report: Mapping[str, Any], minimum: int) -> None:
    """TooFewExamples (one line) when the stored training split holds fewer than `minimum` examples
    of a label the mode trains on: label 1 for SFT, both for RCTP."""
    labels = (0, 1) if report["mode"] == "rctp" else (1,)
    stored = label_totals(report["splits"][TRAIN_SPLIT])
    pool = label_totals(report["pool"][TRAIN_SPLIT])
    for label in labels:
        if stored[label] < minimum:
            raise TooFewExamples(
                f"stage-1 data ({report['mode']}) has {stored[label]} {LABEL_NAMES[label]} "
                f"training examples < rctp.min_per_label={minimum} (trajectories made: "
                f"{pool[0]} label 0, {pool[1]} label 1; stored per source: "
                f"{json.dumps(report['splits'][TRAIN_SPLIT])})"
            )


def format_counts(counts: Counts, title: str = "") -> str:
    """A small text table: source | low (0) | high (1) | total, with a total row."""
    width = max([len("source"), *(len(s) for s in counts)]) + 2
    lines = [title] if title else []
    lines.append(f"{'source':<{width}}{'low':>7}{'high':>7}{'total':>7}")
    for source, row in counts.items():
        lines.append(f"{source:<{width}}{row[0]:>7}{row[1]:>7}{row[0] + row[1]:>7}")
    low = sum(r[0] for r in counts.values())
    high = sum(r[1] for r in counts.values())
    lines.append(f"{'total':<{width}}{low:>7}{high:>7}{low + high:>7}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Builder


def split_by_entry(entries: Sequence[Entry], heldout: int, seed: int) -> dict[str, list[Entry]]:
    """Train entries and `heldout` entries drawn at random (whole entries, all sources)."""
    if heldout <= 0:
        return {TRAIN_SPLIT: list(entries)}
    if heldout >= len(entries):
        raise ValueError(f"heldout_entries={heldout} leaves no training entries of {len(entries)}")
    held = set(random.Random(f"{seed}:heldout").sample(range(len(entries)), heldout))
    return {
        TRAIN_SPLIT: [e for i, e in enumerate(entries) if i not in held],
        HELDOUT_SPLIT: [e for i, e in enumerate(entries) if i in held],
    }


def build_examples(
    settings: DataSettings,
    tokenizer: Any,
    entries: Sequence[Entry],
    policy: Policy | None = None,
    sources: Sources | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Records per split and the counts report, without writing anything. `sources` makes each
    split's trajectory pool (`protocol_sources`); default: the BFCL-shaped entries' ground truth,
    perturbations and `policy`'s rollouts (`collect_trajectories`)."""
    check_training_entries(entries)
    if sources is None:
        sources = lambda part: collect_trajectories(part, settings, policy)
    reward_tokens = prompts.add_reward_tokens(tokenizer) if settings.enabled else None
    report: dict[str, Any] = {
        "mode": "rctp" if settings.enabled else "sft",
        "reward_tokens": dict(reward_tokens or {}),
        "pool": {},
        "splits": {},
        "skipped": {},
        "too_long": {},
    }
    splits: dict[str, list[dict[str, Any]]] = {}
    for name, part in split_by_entry(entries, settings.heldout_entries, settings.seed).items():
        trajectories, skipped = sources(part)
        rng = random.Random(f"{settings.seed}:mix:{name}")
        examples, too_long = select_examples(trajectories, tokenizer, settings, reward_tokens, rng)
        splits[name] = examples
        report["pool"][name] = count_labels(trajectories)
        report["splits"][name] = count_labels(examples)
        report["skipped"][name] = dict(sorted(skipped.items()))
        report["too_long"][name] = too_long
    return splits, report


def build_rctp_dataset(
    settings: DataSettings,
    tokenizer: Any,
    entries: Sequence[Entry],
    out_dir: str | Path,
    policy: Policy | None = None,
    *,
    overwrite: bool = False,
    sources: Sources | None = None,
) -> dict[str, Any]:
    """Build, log and write the RCTP (or, with `settings.enabled=False`, plain SFT) dataset.

    `tokenizer` gains the reward tokens in RCTP mode (resize the model's vocab to
    `len(tokenizer)` afterwards). Returns the counts report plus `dataset_dir` (pass it to
    `data.store.load_split`); with `sources` (`protocol_sources`) the report also holds the
    stored examples per label of each split (`labels`, {0: n, 1: n}).
    """
    splits, report = build_examples(settings, tokenizer, entries, policy, sources)
    if sources is not None:  # the built-ins' report keeps its form
        report["labels"] = {name: label_totals(c) for name, c in report["splits"].items()}
    check_label_counts(report, settings.min_per_label)
    if not splits[TRAIN_SPLIT]:
        raise TooFewExamples(f"no training examples kept; pool: {report['pool'][TRAIN_SPLIT]}")
    nonempty = {name: examples for name, examples in splits.items() if examples}
    report["dataset_dir"] = str(store.write_dataset(out_dir, nonempty, overwrite=overwrite))
    for name in splits:
        log.info("%s", format_counts(report["pool"][name], f"trajectories ({name}, all)"))
        log.info("%s", format_counts(report["splits"][name], f"stored ({name})"))
    return report
