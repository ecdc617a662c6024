"""BFCL v4 multi-turn environment: the public entry point.

    from rcgrpo_jax.envs import bfcl
    entries = bfcl.load_entries("multi_turn_base")       # also miss_func, miss_param, long_context
    episode = bfcl.Episode(entries[0], "qwen")            # messages = episode.messages
    step = episode.step(assistant_text)                   # step.messages to append, step.done
    result = bfcl.trajectory_reward(entry, decoded)       # .reward .state_ok .action_ok .error_type

Data and simulators come from bfcl-eval; execution (`executor`), parsing (`calls`) and the
checker (`reward`) are ours: model text is never compiled or run.
"""

from rcgrpo_jax.envs.calls import Call, CallError, extract_calls, format_call, parse_call
from rcgrpo_jax.envs.entries import CATEGORIES, Entry, load_all, load_entries
from rcgrpo_jax.envs.episode import MAX_STEPS_PER_TURN, Episode, Step
from rcgrpo_jax.envs.policies import (
    REFERENCE_POLICIES,
    GenerateFn,
    Policy,
    empty,
    ground_truth,
    model_policy,
    run_episodes,
)
from rcgrpo_jax.envs.prompts import render_with_mask, set_reward_token
from rcgrpo_jax.envs.reward import ERROR_TYPES, RewardResult, trajectory_reward
from rcgrpo_jax.envs.reward_tokens import REWARD_TOKENS
from rcgrpo_jax.envs.split import split_entries, split_ids

__all__ = [
    "CATEGORIES",
    "ERROR_TYPES",
    "MAX_STEPS_PER_TURN",
    "REFERENCE_POLICIES",
    "REWARD_TOKENS",
    "Call",
    "CallError",
    "Entry",
    "Episode",
    "GenerateFn",
    "Policy",
    "RewardResult",
    "Step",
    "empty",
    "extract_calls",
    "format_call",
    "ground_truth",
    "load_all",
    "load_entries",
    "model_policy",
    "parse_call",
    "render_with_mask",
    "run_episodes",
    "set_reward_token",
    "split_entries",
    "split_ids",
    "trajectory_reward",
]
