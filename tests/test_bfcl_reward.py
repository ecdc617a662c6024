"""Our reward equals bfcl-eval's `multi_turn_checker` verdict.

The official checker is the reference here only: it `eval`s call strings, and every string we
hand it is ground truth or a perturbation of ground truth generated below, never model text.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import tempfile
from contextlib import contextmanager

import pytest

os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl_root_"))

from bfcl_eval.eval_checker.multi_turn_eval import (  # noqa: E402
    multi_turn_checker as official,
)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import (  # noqa: E402
    long_context,
)

from rcgrpo_jax.envs import bfcl  # noqa: E402
from rcgrpo_jax.envs.calls import Call, format_call, parse_call  # noqa: E402
from rcgrpo_jax.envs.entries import hidden_functions  # noqa: E402
from rcgrpo_jax.envs.reward import (  # noqa: E402
    EMPTY_TURN,
    FORCE_TERMINATED,
    RESPONSE_MISMATCH,
    STATE_MISMATCH,
)

KINDS = ("drop", "duplicate", "reorder", "wrong_value", "extra_call", "empty_turn", "split")
PER_CATEGORY = 140  # 4 x 140 = 560 perturbed trajectories
_counter = itertools.count()


def ground_truth_decoded(entry):
    return [[list(turn)] if turn else [] for turn in entry.ground_truth]


# bfcl-eval's long-context module objects as imported (copied once: they are large).
_LONG_CONTEXT = {k: copy.deepcopy(v) for k, v in vars(long_context).items() if k.isupper()}


@contextmanager
def long_context_restored():
    """bfcl-eval's simulators mutate long-context module objects; undo after each official run
    so that one official verdict cannot leak into the next. Compared first, copied only where
    changed: most runs leave them as they were."""
    try:
        yield
    finally:
        for k, v in _LONG_CONTEXT.items():
            obj = getattr(long_context, k)
            if obj == v:
                continue
            if isinstance(obj, dict):
                obj.clear()
                obj.update(copy.deepcopy(v))
            elif isinstance(obj, list):
                obj[:] = copy.deepcopy(v)


def official_verdict(entry, decoded):
    """(valid, error_type) from bfcl-eval, with a fresh instance cache key per call."""
    if len(decoded) != len(entry.ground_truth):  # eval_runner's check before the checker
        return False, FORCE_TERMINATED
    name = f"rcgrpo_ref_{next(_counter)}"
    with long_context_restored():
        out = official.multi_turn_checker(
            copy.deepcopy(decoded), entry.ground_truth, entry.bfcl_dict(), entry.category, name
        )
    for key in [k for k in vars(multi_turn_utils) if k.startswith(name + "_")]:
        del vars(multi_turn_utils)[key]
    return out["valid"], out.get("error_type")


def ours(entry, decoded, hide_missed=False):
    r = bfcl.trajectory_reward(entry, decoded, hide_missed=hide_missed)
    return r.reward == 1.0, r.error_type


def _wrong(value, rng):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([1, -1, 7])
    if isinstance(value, float):
        return value + 1.5
    if isinstance(value, str):
        return rng.choice([value + "_x", value.upper() + "1", ""])
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {**value, "extra": 1}
    return "x"


def perturb(entry, kind, rng):
    """A ground-truth trajectory with one perturbation of `kind`, or None if not applicable."""
    decoded = ground_truth_decoded(entry)
    turns = [t for t, calls in enumerate(entry.ground_truth) if calls]
    t = rng.choice(turns)
    calls = list(entry.ground_truth[t])
    if kind == "drop":
        calls.pop(rng.randrange(len(calls)))
        decoded[t] = [calls]  # [[]] when nothing is left: an empty turn for bfcl-eval too
    elif kind == "duplicate":
        i = rng.randrange(len(calls))
        calls.insert(i + 1, calls[i])
        decoded[t] = [calls]
    elif kind == "reorder":
        if len(set(calls)) < 2:
            return None
        shuffled = calls[:]
        while shuffled == calls:
            rng.shuffle(shuffled)
        decoded[t] = [shuffled]
    elif kind == "wrong_value":
        with_args = [i for i, c in enumerate(calls) if parse_call(c).args or parse_call(c).kwargs]
        if not with_args:
            return None
        i = rng.choice(with_args)
        call = parse_call(calls[i])
        if call.kwargs:
            key = rng.choice(sorted(call.kwargs))
            call = Call(call.name, call.args, {**call.kwargs, key: _wrong(call.kwargs[key], rng)})
        else:
            j = rng.randrange(len(call.args))
            args = list(call.args)
            args[j] = _wrong(args[j], rng)
            call = Call(call.name, tuple(args), call.kwargs)
        calls[i] = format_call(call)
        decoded[t] = [calls]
    elif kind == "extra_call":
        pool = [c for turn in entry.ground_truth for c in turn]
        calls.insert(rng.randrange(len(calls) + 1), rng.choice(pool))
        decoded[t] = [calls]
    elif kind == "empty_turn":
        decoded[t] = []
    elif kind == "split":  # same calls over several steps: should stay valid
        if len(calls) < 2:
            return None
        cut = rng.randrange(1, len(calls))
        decoded[t] = [calls[:cut], calls[cut:]]
    return decoded


def perturbed_trajectories(seed=0):
    rng = random.Random(seed)
    out = []
    for category in bfcl.CATEGORIES:
        entries = bfcl.load_entries(category)
        made = 0
        for n in itertools.count():
            if made == PER_CATEGORY:
                break
            entry = entries[rng.randrange(len(entries))]
            kind = KINDS[n % len(KINDS)]
            decoded = perturb(entry, kind, rng)
            if decoded is not None:
                out.append((entry, kind, decoded))
                made += 1
    return out


def test_agrees_with_official_checker_on_perturbed_trajectories():
    trajectories = perturbed_trajectories()
    assert len(trajectories) >= 500
    assert {e.category for e, _, _ in trajectories} == set(bfcl.CATEGORIES)
    assert {k for _, k, _ in trajectories} == set(KINDS)
    verdicts = []
    for entry, kind, decoded in trajectories:
        reference = official_verdict(entry, decoded)
        assert ours(entry, decoded) == reference, (entry.id, kind, decoded)
        early_hidden = any(
            parse_call(c).name in hidden_functions(entry, t)
            for t, steps in enumerate(decoded)
            for step in steps
            for c in step
        )
        if not early_hidden:  # the environment's default agrees wherever it can
            assert ours(entry, decoded, hide_missed=True) == reference, (entry.id, kind)
        verdicts.append(reference)
    # The sample exercises every verdict the checker gives.
    kinds_seen = {error for _, error in verdicts}
    assert {None, EMPTY_TURN, STATE_MISMATCH, RESPONSE_MISMATCH} <= kinds_seen
    assert 0.05 < sum(valid for valid, _ in verdicts) / len(verdicts) < 0.6


def test_breakdown_matches_error():
    entry = bfcl.load_entries("base")[0]
    decoded = ground_truth_decoded(entry)
    decoded[1] = []
    r = bfcl.trajectory_reward(entry, decoded)
    assert (r.reward, r.action_ok, r.error_type, r.error_turn) == (0.0, False, EMPTY_TURN, 1)
    assert not r.state_ok  # turn 1's cd + grep left the model in another directory
    # A read-only call dropped: state intact, action fails.
    decoded = ground_truth_decoded(entry)
    decoded[1] = [["cd(folder='temp')"]]  # grep dropped
    r = bfcl.trajectory_reward(entry, decoded)
    assert (r.state_ok, r.action_ok, r.error_type) == (True, False, RESPONSE_MISMATCH)
    assert official_verdict(entry, decoded) == (False, RESPONSE_MISMATCH)


@pytest.mark.parametrize("cut", [1, -1])
def test_wrong_number_of_turns_is_force_terminated(cut):
    entry = bfcl.load_entries("miss_param")[3]
    decoded = ground_truth_decoded(entry)
    decoded = decoded[:cut] if cut > 0 else decoded + [[]]
    r = bfcl.trajectory_reward(entry, decoded)
    assert (r.reward, r.error_type) == (0.0, FORCE_TERMINATED)


def test_calling_a_missed_function_early():
    """bfcl-eval runs a hidden function if the model guesses it; our env (default) does not."""
    entry = next(e for e in bfcl.load_entries("miss_func") if e.id == "multi_turn_miss_func_0")
    ((reveal, (name,)),) = entry.missed_function.items()
    sort_call = next(c for c in entry.ground_truth[reveal] if parse_call(c).name == name)
    decoded = ground_truth_decoded(entry)
    decoded[reveal - 1] = [[sort_call]]  # guessed one turn early ...
    # ... and not redone at its turn, where a read-only call keeps the turn non-empty.
    decoded[reveal] = [[c for c in entry.ground_truth[reveal] if c != sort_call] + ["ls()"]]
    assert official_verdict(entry, decoded) == (True, None)
    assert ours(entry, decoded, hide_missed=False) == (True, None)
    hidden = bfcl.trajectory_reward(entry, decoded)
    # `sort` only returns the sorted text: its early result was an error, so it is missing.
    assert (hidden.reward, hidden.error_type, hidden.error_turn) == (0.0, RESPONSE_MISMATCH, reveal)


def _demo_env():
    """The demo's environment (configs/tiny.py) and how its runs drive an episode."""
    from conftest import shipped_config

    from rcgrpo_jax.envs.base import EpisodeSettings
    from rcgrpo_jax.stages import setup

    config = shipped_config("tiny")
    settings = EpisodeSettings(
        chat_format=config.model.chat_format,
        max_steps_per_turn=config.env.max_steps_per_turn,
        call_timeout_s=config.env.call_timeout_s,
    )
    return setup.environment(config), settings


def test_agrees_with_official_checker_on_the_demo_episodes():
    """The demo's synthetic tasks are scored by the same reward as BFCL's. Played through the
    demo's environment, each episode's reward is bfcl-eval's `multi_turn_checker` verdict on
    what the episode recorded, under the reference policies (ground truth: every one succeeds;
    no calls; acting without looking: every one fails) and under every RCTP perturbation of the
    ground truth (look, then act, over several steps), played as a scripted policy. Our verdict
    on each scripted plan, as written, is the checker's too."""
    from rcgrpo_jax.data import perturb as rctp_perturb
    from rcgrpo_jax.envs import policies, synthetic

    env, settings = _demo_env()
    memo: dict[tuple, tuple] = {}

    def verdict(entry, decoded):  # one official run per distinct trajectory of a task
        key = (entry.id, repr(decoded))
        if key not in memo:
            memo[key] = official_verdict(entry, decoded)
        return memo[key]

    def played(entry, policy):
        episode = env.episode(entry, settings)
        policies.run_episodes([episode], policy)
        return episode

    rng = random.Random(0)
    scripted, by_policy = [], {}
    for entry in (e for split in ("train", "test", "rl") for e in env.tasks(split)[:24]):
        plan = rctp_perturb.ground_truth_plan(entry, settings.chat_format)
        plans = [("ground_truth", plan)]
        for kind in rctp_perturb.PERTURBATIONS:
            p = rctp_perturb.perturb(entry, plan, kind, rng)
            if p is not None:
                plans.append((kind, p.plan))
        episodes = [
            ("reference ground_truth", played(entry, policies.ground_truth)),
            ("reference empty", played(entry, policies.empty)),
            ("reference act_without_looking", played(entry, synthetic.act_without_looking)),
        ]
        for kind, steps in plans:
            episode = env.episode(entry, settings)
            policies.run_episodes([episode], rctp_perturb.ScriptedPolicy({episode: steps}))
            episodes.append((kind, episode))
            decoded = [[[format_call(c) for c in step] for step in turn] for turn in steps]
            reference = verdict(entry, decoded)
            if decoded != episode.decoded:  # else the episode's reward, below, is this one
                assert ours(entry, decoded) == reference, (entry.id, kind, decoded)
            scripted.append((kind, reference))
        for kind, episode in episodes:
            result = episode.result()
            reference = verdict(entry, episode.decoded)
            assert (result.reward == 1.0, result.error_type) == reference, (
                entry.id, kind, episode.decoded,
            )  # fmt: skip
            by_policy.setdefault(kind, []).append(reference)
    assert {k for k, _ in scripted} == {"ground_truth", *rctp_perturb.PERTURBATIONS}
    assert {r for k, r in scripted if k == "ground_truth"} == {(True, None)}
    assert {None, STATE_MISMATCH, RESPONSE_MISMATCH, EMPTY_TURN} <= {e for _, (_, e) in scripted}
    assert 0.2 < sum(valid for _, (valid, _) in scripted) / len(scripted) < 0.9
    # success and failure both played: the references succeed and fail as they must
    assert set(by_policy["reference ground_truth"]) == {(True, None)}
    assert {v for v, _ in by_policy["reference empty"]} == {False}
    assert {e for _, e in by_policy["reference empty"]} == {EMPTY_TURN}
    blind = by_policy["reference act_without_looking"]
    assert {v for v, _ in blind} == {False}
    assert {e for _, e in blind} <= {RESPONSE_MISMATCH, STATE_MISMATCH}
    assert {v for kind in rctp_perturb.PERTURBATIONS for v, _ in by_policy[kind]} == {
        True, False,
    }  # fmt: skip
