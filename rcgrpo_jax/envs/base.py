"""What an environment is, to the stages and the rollout: the protocol and the registry.

An environment hands out the tasks of a split; an episode of one task renders the conversation
(messages + tool schemas for the chat template), takes the model's text for one assistant step
and answers with the messages that follow (tool results, the next user turn) or says that the
episode ended; at the end it reports a `RewardResult` (reward, error type). Everything else
(parsing, simulators, the checker) is the environment's own business.

`register(name, factory)` makes an environment selectable as `config.env.benchmark=name`; the
stage calls `factory(**options)` with the plain values of `config.env.<name>` (none if absent).
The built-in ones register when first asked for (`envs/builtin.py`); a user module registers
at import (`config.env.module` names it; docs/custom_env.md walks through one).

The protocol is all every stage needs: RL and eval roll the policy out through episodes, and
stage 1 (sft/rctp) labels the starting policy's own rollouts, plus the environment's optional
demonstrations, by the reward the episode gives them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rcgrpo_jax.envs.reward import RewardResult

Message = dict[str, Any]  # {"role", "content"} (+ "name" on tool messages)
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Step:
    """What `Episode.step` hands back: messages to append after the assistant's, and done."""

    messages: list[Message]
    done: bool


@dataclass(frozen=True)
class EpisodeSettings:
    """How the run drives every episode (config model.chat_format, env.*)."""

    chat_format: str = "qwen"  # the call syntax the model writes: python | qwen | llama
    max_steps_per_turn: int = 20  # executing assistant steps before a turn is force-quit
    call_timeout_s: float | None = 5.0  # wall-clock limit of one tool call


class Task(Protocol):
    """One task: what runs log and report by. A task may also carry a `kind` (str: what sort
    of task it is, finer than its category); evaluations report success per kind."""

    @property
    def id(self) -> str: ...

    @property
    def category(self) -> str: ...


def task_kind(task: Task) -> str:
    """What evaluations group a task's success by: its `kind` where it has one, else its
    category."""
    return getattr(task, "kind", "") or task.category


class Episode(Protocol):
    """One trajectory of a task. `messages[0]` is the system message, starting with the reward
    token of the episode (`prompts.with_reward_token`); the conversation only grows at its end."""

    entry: Task
    messages: list[Message]
    tools: list[dict] | None  # `tools=` for the chat template (None: listed in the prompt)
    decoded: list[list[list[str]]]  # call strings per turn and step (eval logs them)
    done: bool

    def step(self, assistant_text: str) -> Step: ...

    def result(self) -> RewardResult: ...


class Environment(Protocol):
    """What the stages need of an environment. Optional attributes, read where absent as:
    - `title: str` heads the eval table (default: its `env.benchmark` name);
    - `error_types: tuple[str, ...]`: the `RewardResult.error_type` values eval counts, in this
      order, even when none occurred (default ()); any other seen is counted after them;
    - `demonstration(task) -> Sequence[str] | None`: the assistant texts, one per assistant
      step, that solve `task` (None: no demonstration of that task). Stage 1 (sft/rctp/all)
      plays them through a fresh episode and labels each by the reward it gets, like its own
      rollouts of the starting policy (`data/trajectories.py`); without this method its data
      is those rollouts alone (`rctp.rollouts_per_entry`);
    - `golden_trajectories: bool`: its tasks are `envs.entries.Entry`s with ground truth, from
      which stage 1 builds its data the BFCL way instead (ground truth, executed perturbations,
      `data/perturb.py`) (default False; True for the built-ins)."""

    categories: tuple[str, ...]  # what its tasks' `category` can be (eval reports by these)

    def tasks(self, split: str) -> Sequence[Task]:
        """The tasks of `split` ("train" or "test"), the same list on every call."""
        ...

    def episode(
        self, task: Any, settings: EpisodeSettings, reward_token: int | None = None
    ) -> Episode: ...

    def tokenizer_corpus(self) -> Iterable[str] | None:
        """Texts to train a tokenizer from scratch on when the run has none (consumed only
        then: a generator keeps it lazy); None: the environment needs a pretrained one."""
        ...


Factory = Callable[..., Environment]
_FACTORIES: dict[str, Factory] = {}
_BUILTIN = {"bfcl": "rcgrpo_jax.envs.builtin", "synthetic": "rcgrpo_jax.envs.builtin"}


def register(name: str, factory: Factory) -> None:
    """Make `factory(**options) -> Environment` selectable as `name` (a later one replaces)."""
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    """Every selectable name: registered ones and the built-ins."""
    return tuple(sorted({*_FACTORIES, *_BUILTIN}))


def get(name: str) -> Factory:
    """The factory registered as `name`; ValueError naming the known ones if there is none."""
    if name not in _FACTORIES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _FACTORIES:
        raise ValueError(f"no environment {name!r}; registered: {', '.join(names())}")
    return _FACTORIES[name]
