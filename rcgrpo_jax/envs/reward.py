"""Trajectory reward R_state x R_action, judged exactly as bfcl-eval's `multi_turn_checker`.

Per turn: the model's decoded calls and the turn's ground truth run on two separate instance
sets (both carried over from the previous turns). On a turn with non-empty ground truth:
- an empty model turn fails (`multi_turn:empty_turn_model_response`);
- state check: public attributes of every instance equal (`multi_turn:instance_state_mismatch`);
- response check: each ground-truth result of the turn is found, as a multiset, among all the
  model's results so far (`multi_turn:execution_response_mismatch`).
A trajectory whose number of turns differs from the ground truth's was force-terminated
(`multi_turn:force_terminated`, as bfcl-eval's eval runner reports it).

bfcl-eval stops at the first failure; every turn is checked here so that `state_ok` and
`action_ok` describe the whole trajectory, while `error_type` is the one bfcl-eval reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rcgrpo_jax.envs.entries import Entry, hidden_functions
from rcgrpo_jax.envs.executor import (
    CALL_TIMEOUT_S,
    execute_all,
    load_instances,
    method_table,
    state_differences,
)

EMPTY_TURN = "multi_turn:empty_turn_model_response"
STATE_MISMATCH = "multi_turn:instance_state_mismatch"
RESPONSE_MISMATCH = "multi_turn:execution_response_mismatch"
FORCE_TERMINATED = "multi_turn:force_terminated"
ERROR_TYPES = (EMPTY_TURN, STATE_MISMATCH, RESPONSE_MISMATCH, FORCE_TERMINATED)
# Ours, not BFCL's: the environment itself failed for this trajectory (a simulator, parser or
# reward exception, or a call past its time limit), caught by the rollout; scored 0.
ENV_ERROR = "rollout:env_error"

Decoded = Sequence[Sequence[Sequence[str]]]  # [turn][step][call string]


@dataclass(frozen=True)
class RewardResult:
    """Verdict on one trajectory; `error_type` is None when valid."""

    reward: float
    state_ok: bool
    action_ok: bool
    error_type: str | None = None
    error_turn: int | None = None

    @property
    def valid(self) -> bool:
        return self.reward == 1.0


def is_empty_turn(steps: Sequence[Sequence[str]]) -> bool:
    """bfcl-eval's `is_empty_execute_response`: no step, or one step with no call."""
    return len(steps) == 0 or (len(steps) == 1 and len(steps[0]) == 0)


def contains_multiset(haystack: Sequence[str], needles: Sequence[str]) -> bool:
    """Every needle occurs in haystack, counting repeats (order free)."""
    remaining = list(haystack)
    for item in needles:
        if item not in remaining:
            return False
        remaining.remove(item)
    return True


def trajectory_reward(
    entry: Entry,
    decoded: Decoded,
    *,
    hide_missed: bool = True,
    call_timeout_s: float | None = CALL_TIMEOUT_S,
) -> RewardResult:
    """Reward of a decoded trajectory (`decoded[turn][step][call]`) for `entry`.

    `hide_missed`: a miss_func function called before its reveal turn fails as an unknown
    name, as it does in our environment (bfcl-eval would run it); False reproduces bfcl-eval.
    A replayed call past `call_timeout_s` raises `executor.CallTimeout`.
    """
    truth_turns = entry.ground_truth
    if len(decoded) != len(truth_turns):
        turn = min(len(decoded), len(truth_turns))
        return RewardResult(0.0, False, False, FORCE_TERMINATED, turn)

    model, truth = load_instances(
        entry.initial_config, entry.involved_classes, entry.long_context, copies=2
    )
    model_results: list[str] = []  # all model results so far, across turns
    state_ok = action_ok = True
    error_type: str | None = None
    error_turn: int | None = None
    for turn, (steps, truth_calls) in enumerate(zip(decoded, truth_turns, strict=True)):
        hidden = hidden_functions(entry, turn) if hide_missed else frozenset()
        model_table = method_table(model, hidden)
        for step in steps:
            model_results.extend(execute_all(step, model_table, call_timeout_s))
        truth_results = execute_all(truth_calls, method_table(truth, hidden), call_timeout_s)
        if not truth_calls:
            continue  # the model should decline here; bfcl-eval does not score it
        failures = []
        if is_empty_turn(steps):
            failures.append(EMPTY_TURN)
            action_ok = False
        if state_differences(model, truth):
            failures.append(STATE_MISMATCH)
            state_ok = False
        if not contains_multiset(model_results, truth_results):
            failures.append(RESPONSE_MISMATCH)
            action_ok = False
        if failures and error_type is None:
            error_type, error_turn = failures[0], turn
    reward = 1.0 if error_type is None else 0.0
    return RewardResult(reward, state_ok, action_ok, error_type, error_turn)
