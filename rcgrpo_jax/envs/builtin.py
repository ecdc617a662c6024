"""The built-in environments over `Entry` tasks: "bfcl" (BFCL v4 multi-turn, the fixed split)
and "synthetic" (the tiny demo's generated file-system tasks, with a start-up tokenizer).

"synthetic" can also hand out a third split, "rl" (`num_rl > 0`, config env.synthetic.num_rl):
tasks whose names neither "train" (what stage 1 memorises) nor "test" (held out) use, for RL."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rcgrpo_jax.envs import synthetic, tiny_tokenizer
from rcgrpo_jax.envs.base import SPLITS, EpisodeSettings, register
from rcgrpo_jax.envs.entries import CATEGORIES, Entry, normalize_category
from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.reward import ERROR_TYPES
from rcgrpo_jax.envs.split import split_entries


class _EntryEnvironment:
    """Episodes of BFCL-shaped entries: `envs.episode.Episode` (our executor and checker)."""

    categories: tuple[str, ...]
    error_types = ERROR_TYPES  # what our BFCL checker reports
    golden_trajectories = True  # Entry tasks with ground truth: stage 1's data builder reads them

    def episode(
        self, task: Entry, settings: EpisodeSettings, reward_token: int | None = None
    ) -> Episode:
        return Episode(
            task, settings.chat_format, max_steps_per_turn=settings.max_steps_per_turn,
            reward_token=reward_token, call_timeout_s=settings.call_timeout_s,
        )  # fmt: skip

    def tokenizer_corpus(self) -> Iterator[str] | None:
        return None


def _check_split(split: str, splits: Sequence[str] = SPLITS) -> None:
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {tuple(splits)}")


class BfclEnvironment(_EntryEnvironment):
    """BFCL v4 multi-turn entries of `categories` ("base" or "multi_turn_base", ...)."""

    title = "BFCL v4 multi-turn"

    def __init__(self, categories: Sequence[str] = CATEGORIES) -> None:
        try:
            self.categories = tuple(normalize_category(c) for c in categories)
        except ValueError as e:
            raise ValueError(f"categories: {e}") from None

    def tasks(self, split: str) -> list[Entry]:
        _check_split(split)
        return [e for c in self.categories for e in split_entries(split, c)]


class SyntheticEnvironment(_EntryEnvironment):
    """`synthetic.make_tasks` of each split; `difficulty`: fields of `synthetic.Difficulty`.

    `num_rl > 0`: a third split "rl" of that many tasks, on names of neither "train" nor "test"
    (`synthetic.NAMES3`); "train" then excludes those names, "test" is unchanged. 0: no "rl"
    split, "train" keeps those names."""

    categories = (synthetic.CATEGORY,)
    title = "synthetic file-system tasks"

    def __init__(
        self,
        num_train: int = 512,
        num_test: int = 64,
        seed: int = 0,
        difficulty: Mapping[str, Any] | None = None,
        num_rl: int = 0,
    ) -> None:
        if int(num_rl) < 0:
            raise ValueError(f"num_rl must be >= 0 (0: no rl split), got {num_rl}")
        self.sizes = {"train": int(num_train), "test": int(num_test)}
        self.rl_split = int(num_rl) > 0
        if self.rl_split:
            self.sizes[synthetic.RL_SPLIT] = int(num_rl)
        self.seed = int(seed)
        self.difficulty = dict(difficulty or {})
        self._tasks: dict[str, list[Entry]] = {}

    def tasks(self, split: str) -> list[Entry]:
        _check_split(split, synthetic.SPLITS3)
        if split == synthetic.RL_SPLIT and not self.rl_split:
            raise ValueError("no 'rl' split: set env.synthetic.num_rl > 0 for one")
        if split not in self._tasks:
            self._tasks[split] = synthetic.make_tasks(
                split,
                self.sizes[split],
                seed=self.seed,
                rl_split=self.rl_split,
                **self.difficulty,
            )
        return self._tasks[split]

    def tokenizer_corpus(self) -> Iterator[str]:
        yield from tiny_tokenizer.corpus(self.tasks("train"))


register("bfcl", BfclEnvironment)
register("synthetic", SyntheticEnvironment)
