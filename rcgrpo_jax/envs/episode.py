"""One trajectory of a BFCL multi-turn entry: text in, messages out, as bfcl-eval's inference
loop runs it. Pure Python and independent per trajectory, so a batched rollout keeps one
`Episode` per row and steps them in lockstep.

Loop (bfcl-eval `inference_multi_turn_*`): each turn starts with its user message (miss_func's
reveal turn gets the "functions added" message); the assistant answers; output that decodes to
calls is executed, one tool message per call, and the assistant answers again; output with no
call ends the turn. More than `max_steps_per_turn` executing steps in a turn force-quits the
entry (scored `multi_turn:force_terminated` unless it was the last turn, as in bfcl-eval).

`step` does not raise on any assistant text (malformed calls become error tool messages), but
a simulator call past `call_timeout_s` raises `executor.CallTimeout`: the instances may be half
updated, so the caller ends the trajectory (`rl.rollout` scores it 0).
"""

from __future__ import annotations

from rcgrpo_jax.envs import prompts
from rcgrpo_jax.envs.base import Step
from rcgrpo_jax.envs.calls import FORMATS, call_name, extract_calls
from rcgrpo_jax.envs.entries import Entry, docs_added, docs_at_start, hidden_functions
from rcgrpo_jax.envs.executor import CALL_TIMEOUT_S, execute_all, load_instances, method_table
from rcgrpo_jax.envs.reward import RewardResult, trajectory_reward

MAX_STEPS_PER_TURN = 20  # bfcl-eval's MAXIMUM_STEP_LIMIT


class Episode:
    """A trajectory of `entry` under one chat format; records decoded calls for the reward."""

    def __init__(
        self,
        entry: Entry,
        chat_format: str = "qwen",
        *,
        max_steps_per_turn: int = MAX_STEPS_PER_TURN,
        reward_token: int | None = None,
        hide_missed: bool = True,
        call_timeout_s: float | None = CALL_TIMEOUT_S,
    ) -> None:
        if chat_format not in FORMATS:
            raise ValueError(f"unknown chat format {chat_format!r}; expected one of {FORMATS}")
        self.entry = entry
        self.chat_format = chat_format
        self.max_steps_per_turn = max_steps_per_turn
        self.reward_token = reward_token
        self.hide_missed = hide_missed
        self.call_timeout_s = call_timeout_s
        self.tools = prompts.template_tools(docs_at_start(entry), chat_format)
        self.reset()

    def reset(self) -> list[prompts.Message]:
        """Fresh simulators and the opening messages (system prompt + first user turn)."""
        (self._instances,) = load_instances(
            self.entry.initial_config, self.entry.involved_classes, self.entry.long_context
        )
        self.turn = 0
        self.steps_in_turn = 0  # executing steps so far in this turn
        self.done = False
        self.force_quit = False
        self.decoded: list[list[list[str]]] = [[]]
        system = prompts.system_message(
            self.chat_format,
            docs_at_start(self.entry),
            self.reward_token,
            compact=self.entry.compact_prompt,
        )
        self.messages: list[prompts.Message] = [system, *self._turn_messages(0)]
        return list(self.messages)

    def _turn_messages(self, turn: int) -> list[prompts.Message]:
        if turn in self.entry.missed_function:
            added = docs_added(self.entry, turn)
            return [prompts.added_functions_message(added, self.chat_format)]
        return [dict(m) for m in self.entry.question[turn]]

    def _table(self):
        hidden = hidden_functions(self.entry, self.turn) if self.hide_missed else ()
        return method_table(self._instances, hidden)

    def step(self, assistant_text: str) -> Step:
        """Append the assistant's text, act on it, and return the messages that follow."""
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.messages.append({"role": "assistant", "content": assistant_text})
        calls = extract_calls(assistant_text, self.chat_format)
        if calls:
            results = execute_all(calls, self._table(), self.call_timeout_s)
            self.decoded[self.turn].append(calls)
            self.steps_in_turn += 1
            new = [
                prompts.tool_message(call_name(c), r) for c, r in zip(calls, results, strict=True)
            ]
            if self.steps_in_turn > self.max_steps_per_turn:
                self.force_quit = self.done = True
            self.messages.extend(new)
            return Step(new, self.done)
        self.turn += 1
        self.steps_in_turn = 0
        if self.turn == self.entry.num_turns:
            self.done = True
            return Step([], True)
        self.decoded.append([])
        new = self._turn_messages(self.turn)
        self.messages.extend(new)
        return Step(new, False)

    def result(self) -> RewardResult:
        """The reward of what was decoded so far (call when done)."""
        return trajectory_reward(
            self.entry,
            self.decoded,
            hide_missed=self.hide_missed,
            call_timeout_s=self.call_timeout_s,
        )
