"""A calculator over bfcl-eval's MathAPI (docs/custom_env.md): a task ("add 3 and 4") scores 1
when the result of the last tool call equals that of the task's own call ("add(a=3, b=4)").
It also demonstrates each task (that call, then a closing message): stage 1's golden data."""

import random
from dataclasses import dataclass

from rcgrpo_jax import envs
from rcgrpo_jax.envs import calls, entries, prompts
from rcgrpo_jax.envs.executor import ERROR_PREFIX, execute, method_table, simulator_class
from rcgrpo_jax.envs.reward import RewardResult

QUESTIONS = {"add": "add {a} and {b}", "subtract": "{a} minus {b}", "multiply": "{a} times {b}"}
DOCS = [d for d in entries.function_docs("MathAPI") if d["name"] in QUESTIONS]  # for `tools=`
SYSTEM = "Tools: add(a, b), subtract(a, b), multiply(a, b). Reply with a call like [add(a=1, b=2)]."
CLOSING = prompts.NO_CALL_TEXT  # a step without a call ends the episode


def allowed_methods() -> dict:  # only these methods of a fresh MathAPI: text is parsed, never run
    table = method_table({"MathAPI": simulator_class("MathAPI")()})
    return {name: method for name, method in table.items() if name in QUESTIONS}


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    truth: str  # the call whose result is the answer, e.g. "add(a=3, b=4)"
    category: str = "calculator"


class Episode:
    def __init__(self, task: Task, settings: envs.EpisodeSettings, token: int | None) -> None:
        self.entry, self.settings, self.done, table = task, settings, False, allowed_methods()
        self.run = lambda call: execute(call, table, settings.call_timeout_s)  # -> result text
        system = {"role": "system", "content": prompts.with_reward_token(SYSTEM, token)}
        self.messages = [system, {"role": "user", "content": task.question}]
        self.tools = prompts.template_tools(DOCS, settings.chat_format)
        self.decoded, self.results = [[]], []  # one turn: the calls of each step; all results

    def step(self, text: str) -> envs.Step:
        found = calls.extract_calls(text, self.settings.chat_format)
        new = [prompts.tool_message(calls.call_name(c), self.run(c)) for c in found]
        self.messages += [{"role": "assistant", "content": text}, *new]
        self.results += [m["content"] for m in new]
        self.decoded[0] += [found] if found else []
        self.done = not found or len(self.decoded[0]) >= self.settings.max_steps_per_turn
        return envs.Step(new, self.done)

    def result(self) -> RewardResult:
        last = self.results[-1] if self.results else None
        if last == self.run(self.entry.truth):
            return RewardResult(1.0, True, True)
        error = "no_call" if last is None else "wrong_result"
        error = "call_error" if last and last.startswith(ERROR_PREFIX) else error
        return RewardResult(0.0, False, False, f"calculator:{error}")


class Calculator:
    categories = ("calculator",)
    error_types = ("calculator:no_call", "calculator:call_error", "calculator:wrong_result")

    def __init__(
        self, num_train: int = 64, num_test: int = 16, seed: int = 0, max_operand: int = 99
    ) -> None:
        self._tasks = {"train": [], "test": []}
        for split, n in (("train", num_train), ("test", num_test)):
            rng, seen = random.Random(f"{split}/{seed}"), {t.truth for t in self._tasks["train"]}
            if n and len(seen) == len(QUESTIONS) * (max_operand + 1) ** 2:
                raise ValueError(f"max_operand={max_operand}: the training tasks are all there are")
            while len(self._tasks[split]) < n:  # a test task is never a training task
                op = rng.choice(list(QUESTIONS))
                a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
                question, truth = QUESTIONS[op].format(a=a, b=b), f"{op}(a={a}, b={b})"
                if truth not in seen:
                    i = len(self._tasks[split])
                    self._tasks[split].append(Task(f"calculator_{split}_{i}", question, truth))

    def tasks(self, split: str) -> list[Task]:
        return self._tasks[split]

    def episode(self, task: Task, settings, reward_token: int | None = None) -> Episode:
        return Episode(task, settings, reward_token)

    def demonstration(self, task: Task) -> list[str]:  # the assistant's texts, step by step
        return [f"[{task.truth}]", CLOSING]

    def tokenizer_corpus(self) -> list[str]:  # texts for the tokenizer a fresh model needs
        texts = (SYSTEM, CLOSING)
        return [text for t in self.tasks("train") for text in (*texts, t.question, f"[{t.truth}]")]


envs.register("calculator", Calculator)
