"""bench/peers.py's workload as an rcgrpo_jax environment (docs/custom_env.md's protocol).

Tasks are `workload.PROMPTS`; single-turn, an episode is one generation; multi-turn, each
`next_part()` call the model writes (Qwen's `<tool_call>` JSON) is answered with
`workload.tool_result(n)` and the model generates again, up to `workload.TURNS` generations
(`env.max_steps_per_turn`). The reward is `workload.reward` of the last assistant text.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rcgrpo_jax import envs
from rcgrpo_jax.envs import calls, prompts
from rcgrpo_jax.envs.reward import RewardResult

sys.path.insert(0, str(Path(__file__).parent))
import workload as w  # noqa: E402


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    multi_turn: bool
    category: str = "peers"


class Episode:
    def __init__(self, task: Task, settings: envs.EpisodeSettings, token: int | None) -> None:
        self.entry, self.settings, self.done = task, settings, False
        self.messages = w.messages(task.prompt, task.multi_turn)
        self.messages[0]["content"] = prompts.with_reward_token(self.messages[0]["content"], token)
        self.tools = [w.TOOL_DOC] if task.multi_turn else None
        self.decoded, self.calls, self.last_text = [[]], 0, ""

    def step(self, text: str) -> envs.Step:
        self.last_text = text
        self.messages.append({"role": "assistant", "content": text})
        found = (
            calls.extract_calls(text, self.settings.chat_format) if self.entry.multi_turn else []
        )
        new = []
        for call in found:
            name = calls.call_name(call)
            result = w.tool_result(self.calls) if name == w.TOOL_NAME else f"unknown tool {name}"
            self.calls += name == w.TOOL_NAME
            new.append(prompts.tool_message(name, result))
        self.messages += new
        self.decoded[0] += [found] if found else []
        steps = sum(m["role"] == "assistant" for m in self.messages)
        self.done = not found or steps >= self.settings.max_steps_per_turn
        return envs.Step(new, self.done)

    def result(self) -> RewardResult:
        return RewardResult(w.reward(self.last_text), True, True)


class Peers:
    categories = ("peers",)

    def __init__(self, multi_turn: bool = False) -> None:
        self._tasks = [Task(f"peers_{i}", p, bool(multi_turn)) for i, p in enumerate(w.PROMPTS)]

    def tasks(self, split: str) -> list[Task]:
        return self._tasks

    def episode(self, task: Task, settings, reward_token: int | None = None) -> Episode:
        return Episode(task, settings, reward_token)

    def tokenizer_corpus(self) -> list[str]:  # the checkpoint brings its tokenizer
        return list(w.PROMPTS)


envs.register("peers", Peers)
