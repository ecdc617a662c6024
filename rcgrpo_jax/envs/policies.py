"""Policies for driving episodes: a function from a batch of episodes (each exposing
`.messages` and `.tools`) to one assistant text per episode.

`ground_truth` and `empty` are references for the eval stage and tests; `model_policy` turns
a token-level `generate_fn` (the JAX sampler) into a policy by rendering prompts with the
model's chat template and decoding the new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rcgrpo_jax.envs import prompts
from rcgrpo_jax.envs.calls import bind_positional, parse_call, render_calls
from rcgrpo_jax.envs.entries import truth_steps
from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.executor import parameter_names

# prompts (ragged token ids) -> new token ids per prompt, cut after the first stop token.
GenerateFn = Callable[[list[list[int]]], list[list[int]]]


class Policy(Protocol):
    def __call__(self, episodes: Sequence[Episode]) -> list[str]: ...


def ground_truth_text(episode: Episode) -> str:
    """The turn's ground-truth calls, one assistant step at a time (BFCL: all on the first
    step), then a no-call message."""
    steps = truth_steps(episode.entry, episode.turn)
    if episode.steps_in_turn >= len(steps):
        return prompts.NO_CALL_TEXT
    parsed = [parse_call(c) for c in steps[episode.steps_in_turn]]
    if episode.chat_format != "python":
        classes = episode.entry.involved_classes
        parsed = [bind_positional(c, parameter_names(classes, c.name)) for c in parsed]
    return render_calls(parsed, episode.chat_format)


def ground_truth(episodes: Sequence[Episode]) -> list[str]:
    """Reference policy that replays the ground truth (scores 100% by construction)."""
    return [ground_truth_text(e) for e in episodes]


def empty(episodes: Sequence[Episode]) -> list[str]:
    """Reference policy that never calls a function."""
    return [prompts.NO_CALL_TEXT for _ in episodes]


REFERENCE_POLICIES: dict[str, Policy] = {"ground_truth": ground_truth, "empty": empty}


def model_policy(generate_fn: GenerateFn, tokenizer: Any, batch_size: int = 0) -> Policy:
    """Policy that samples with `generate_fn` from prompts rendered by `tokenizer`'s template.

    `batch_size` > 0 splits the active episodes into chunks of at most that many prompts.
    """
    eot = prompts.end_of_turn_token(tokenizer)

    def policy(episodes: Sequence[Episode]) -> list[str]:
        batch = [prompts.prompt_ids(tokenizer, e.messages, e.tools) for e in episodes]
        size = batch_size if batch_size > 0 else max(len(batch), 1)
        outputs = [o for i in range(0, len(batch), size) for o in generate_fn(batch[i : i + size])]
        texts = [tokenizer.decode(list(o), skip_special_tokens=False) for o in outputs]
        return [t.split(eot, 1)[0] for t in texts]

    return policy


def run_episodes(episodes: Sequence[Episode], policy: Policy) -> int:
    """Step all episodes to completion in lockstep; returns the number of policy calls.

    Terminates: every step either executes (bounded per turn) or ends a turn.
    """
    rounds = 0
    active = [e for e in episodes if not e.done]
    while active:
        texts = policy(active)
        if len(texts) != len(active):
            raise ValueError(f"policy returned {len(texts)} texts for {len(active)} episodes")
        for episode, text in zip(active, texts, strict=True):
            episode.step(text)
        rounds += 1
        active = [e for e in active if not e.done]
    return rounds
