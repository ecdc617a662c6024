"""Environments whose rewards carry RL signal for a random model, for runs through the command line.

A random model never solves a task, so every group of a run from a random init is all-fail:
dynamic sampling keeps no group and no update runs. Imported as `env.module`
(`--config.env.module=tests.forced_rewards`), this module registers two environments under the
built-in names (same tasks, splits, prompts, options and tokenizer; only the reward differs):
- "synthetic": the reward is a coin, 1 or 0 from a hash of the text the model wrote (about half
  each, a function of the trajectory alone, so a resumed run scores as an uninterrupted one):
  groups are mixed about half the time, so dynamic sampling keeps some, drops others and draws
  later rounds;
- "bfcl": the real checker's verdict, raised to 1 for a row conditioned on <|high_reward|>: an
  RC-GRPO group (both tokens in every group) is always mixed, a GRPO group (one token for all
  rows) keeps the checker's all-fail verdict.

Never import it into the test process itself: it would replace the built-ins for every later test.
"""

from __future__ import annotations

import zlib

from rcgrpo_jax import envs
from rcgrpo_jax.envs.base import EpisodeSettings
from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.reward import RewardResult
from rcgrpo_jax.envs.reward_tokens import HIGH

TAILS = "coin:tails"


def coin(texts: list[str]) -> float:
    """1.0 or 0.0 from the CRC-32 of the texts (the same in every process, unlike `hash`)."""
    return float(zlib.crc32("\x00".join(texts).encode()) % 2 == 0)


class CoinEpisode(Episode):
    """Scored by `coin` of its assistant messages."""

    def result(self) -> RewardResult:
        reward = coin([m["content"] for m in self.messages if m["role"] == "assistant"])
        return RewardResult(reward, bool(reward), bool(reward), None if reward else TAILS)


class HighTokenEpisode(Episode):
    """Scored by the checker, then 1 where the row was conditioned on the high token."""

    def result(self) -> RewardResult:
        verdict = super().result()  # the checker runs on every row: its failures still show
        if self.reward_token == HIGH:
            return RewardResult(1.0, True, True)
        return verdict


def _registered(name: str, episode_class: type[Episode], error_types: tuple[str, ...]) -> None:
    """Registers `name` as the built-in environment of that name with `episode_class` episodes."""
    builtin = envs.get(name)

    class Forced(builtin):
        def episode(self, task, settings: EpisodeSettings, reward_token: int | None = None):
            return episode_class(
                task, settings.chat_format, max_steps_per_turn=settings.max_steps_per_turn,
                reward_token=reward_token, call_timeout_s=settings.call_timeout_s,
            )  # fmt: skip

    Forced.error_types = error_types
    envs.register(name, Forced)


_registered("synthetic", CoinEpisode, (TAILS,))
_registered("bfcl", HighTokenEpisode, envs.get("bfcl").error_types)
