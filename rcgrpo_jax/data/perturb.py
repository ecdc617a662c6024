"""Perturbed ground truth for RCTP's low-quality pool: plans of calls that differ from the
ground truth in one named way, and a scripted policy that plays them through `Episode`.

A plan is the list of calls emitted at the first step of each turn (what the ground-truth
policy does); a perturbation changes the plan at one turn (premature stop also empties the
turns after it). The episode then executes the modified calls, so tool results, follow-up
turns and the reward are real; whether the perturbation actually hurts is left to the reward
(swapping two independent calls, or repeating a read-only one, still scores 1).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rcgrpo_jax.envs import prompts
from rcgrpo_jax.envs.calls import Call, bind_positional, format_call, parse_call, render_calls
from rcgrpo_jax.envs.entries import FUNC_DOC_FILES, Entry
from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.executor import parameter_names, public_methods, simulator_class

Step = tuple[Call, ...]  # the calls of one assistant message
Plan = tuple[tuple[Step, ...], ...]  # per turn, its assistant steps (BFCL: at most one)

PERTURBATIONS = (
    "wrong_arg",  # one argument value changed
    "missing_step",  # one call dropped
    "extra_step",  # one call of the entry's ground truth inserted (may repeat one)
    "wrong_order",  # two different calls of a turn swapped
    "premature_stop",  # a turn cut short and no calls after it
    "foreign_call",  # one call replaced by a function of a class the entry does not offer
)


@dataclass(frozen=True)
class Perturbation:
    """A perturbed plan: which kind, at which turn, and what changed (for the record's meta)."""

    kind: str
    turn: int
    plan: Plan
    detail: str


def truth_steps(entry: Entry, turn: int) -> tuple[tuple[str, ...], ...]:
    """Ground-truth call strings of `turn` as assistant steps: BFCL gives a turn's calls as one
    step; entries with `ground_truth_steps` (synthetic look-then-act tasks) give several."""
    steps = getattr(entry, "ground_truth_steps", ())
    if steps:
        return tuple(tuple(step) for step in steps[turn])
    calls = tuple(entry.ground_truth[turn])
    return (calls,) if calls else ()


def ground_truth_plan(entry: Entry, chat_format: str) -> Plan:
    """The ground truth as calls; positionals named for the JSON call formats."""

    def convert(text: str) -> Call:
        call = parse_call(text)
        if chat_format == "python":
            return call
        return bind_positional(call, parameter_names(entry.involved_classes, call.name))

    return tuple(
        tuple(tuple(convert(c) for c in step) for step in truth_steps(entry, t))
        for t in range(entry.num_turns)
    )


def plan_key(plan: Plan) -> tuple:
    """Comparable form of a plan (calls hold dicts, so plans are not hashable)."""
    return tuple(tuple(tuple(format_call(c) for c in step) for step in turn) for turn in plan)


# ---------------------------------------------------------------------------------------------
# Value and call mutations


def _string_values(plan: Plan) -> list[str]:
    """String arguments of a plan: plausible confusions for a wrong string argument."""
    out = []
    for call in (c for turn in plan for step in turn for c in step):
        out += [v for v in (*call.args, *call.kwargs.values()) if isinstance(v, str)]
    return sorted(set(out))


def wrong_value(value: Any, rng: random.Random, strings: Sequence[str]) -> Any:
    """A different value of the same kind; strings prefer another string of the entry."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice((1, -1, 10))
    if isinstance(value, float):
        return round(value * 2 + 1.5, 2)
    if isinstance(value, str):
        others = [s for s in strings if s != value]
        if others:
            return rng.choice(others)
        return value[:-1] if len(value) > 1 else value + "x"
    if isinstance(value, (list, tuple)):
        return type(value)(value[:-1]) if value else type(value)(["x"])
    if isinstance(value, dict):
        return dict(list(value.items())[:-1]) if value else {"x": 1}
    return "x"


def with_wrong_arg(call: Call, rng: random.Random, strings: Sequence[str]) -> Call:
    """`call` with one (positional or named) argument changed."""
    slots = [("arg", i) for i in range(len(call.args))] + [("kw", k) for k in call.kwargs]
    where, key = rng.choice(slots)
    if where == "arg":
        args = list(call.args)
        args[key] = wrong_value(args[key], rng, strings)
        return Call(call.name, tuple(args), dict(call.kwargs))
    kwargs = dict(call.kwargs)
    kwargs[key] = wrong_value(kwargs[key], rng, strings)
    return Call(call.name, call.args, kwargs)


_PLACEHOLDERS = {int: 1, float: 1.0, bool: True, list: [], dict: {}}


def foreign_functions(involved_classes: Sequence[str]) -> list[tuple[str, str]]:
    """(class, function) pairs of classes not involved whose names none of them offers."""
    offered = {name for c in involved_classes for name in public_methods(c)}
    return [
        (c, name)
        for c in sorted(FUNC_DOC_FILES)
        if c not in involved_classes
        for name in public_methods(c)
        if name not in offered
    ]


def foreign_call(class_name: str, function: str) -> Call:
    """A call of `function` with placeholder values for its required parameters."""
    method = getattr(simulator_class(class_name), function)
    kwargs = {}
    for name, p in inspect.signature(method).parameters.items():
        if name == "self" or p.default is not inspect.Parameter.empty:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kwargs[name] = _PLACEHOLDERS.get(p.annotation, "test")
    return Call(function, (), kwargs)


# ---------------------------------------------------------------------------------------------
# Perturbations


Site = tuple[int, int, int]  # (turn, step, call index)


def _sites(plan: Plan) -> list[Site]:
    return [
        (t, s, i)
        for t, turn in enumerate(plan)
        for s, step in enumerate(turn)
        for i in range(len(step))
    ]


def _call(plan: Plan, site: Site) -> Call:
    t, s, i = site
    return plan[t][s][i]


def _edit(plan: Plan, t: int, steps: Sequence[Sequence[Call]]) -> Plan:
    """`plan` with turn `t` replaced by `steps`; steps left empty are dropped (an empty step
    would end the turn early instead of just missing a call)."""
    turn = tuple(tuple(step) for step in steps if step)
    return tuple(turn if u == t else plan[u] for u in range(len(plan)))


def _with_call(plan: Plan, site: Site, call: Call | None, insert: bool = False) -> Plan:
    """Replace (None: drop) the call at `site`, or insert `call` before it (`insert`)."""
    t, s, i = site
    steps = [list(step) for step in plan[t]]
    if insert:
        steps[s].insert(i, call)
    elif call is None:
        del steps[s][i]
    else:
        steps[s][i] = call
    return _edit(plan, t, steps)


def perturb(entry: Entry, plan: Plan, kind: str, rng: random.Random) -> Perturbation | None:
    """One perturbation of `kind` of the ground-truth `plan`, or None where it cannot apply
    (e.g. no turn with two different calls to swap)."""
    if kind not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {PERTURBATIONS}")
    sites = _sites(plan)
    if kind == "wrong_arg":
        sites = [x for x in sites if _call(plan, x).args or _call(plan, x).kwargs]
    if not sites:
        return None
    if kind == "wrong_order":
        pairs = [
            (a, b)
            for a in sites
            for b in sites
            if a < b and a[0] == b[0] and format_call(_call(plan, a)) != format_call(_call(plan, b))
        ]
        if not pairs:
            return None
        a, b = rng.choice(pairs)
        swapped = _with_call(_with_call(plan, a, _call(plan, b)), b, _call(plan, a))
        return Perturbation(kind, a[0], swapped, f"swap {a[1:]}<->{b[1:]}")
    site = rng.choice(sites)
    t, s, i = site
    old = _call(plan, site)
    if kind == "wrong_arg":
        new = with_wrong_arg(old, rng, _string_values(plan))
        detail = f"{format_call(old)} -> {format_call(new)}"
        return Perturbation(kind, t, _with_call(plan, site, new), detail)
    if kind == "missing_step":
        return Perturbation(kind, t, _with_call(plan, site, None), f"drop {format_call(old)}")
    if kind == "extra_step":
        extra = _call(plan, rng.choice(_sites(plan)))
        where = (t, s, rng.randint(0, len(plan[t][s])))
        detail = f"insert {format_call(extra)} at {where[1:]}"
        return Perturbation(kind, t, _with_call(plan, where, extra, insert=True), detail)
    if kind == "premature_stop":
        kept = [x for x in sites if x[0] == t and x[1:] < (s, i)]
        steps = [
            [c for j, c in enumerate(step) if (t, k, j) in kept] for k, step in enumerate(plan[t])
        ]
        cut = _edit(plan, t, steps)
        cut = tuple(turn if u <= t else () for u, turn in enumerate(cut))
        return Perturbation(kind, t, cut, f"stop before {format_call(old)}")
    # foreign_call
    foreign = foreign_functions(entry.involved_classes)
    if not foreign:
        return None
    new = foreign_call(*rng.choice(foreign))
    detail = f"{format_call(old)} -> {format_call(new)}"
    return Perturbation(kind, t, _with_call(plan, site, new), detail)


# ---------------------------------------------------------------------------------------------
# Playing plans


def plan_text(plan: Plan, episode: Episode) -> str:
    """Assistant text for `episode`'s next step under `plan`: the turn's planned steps, then
    a message without calls, which ends the turn."""
    steps = plan[episode.turn] if episode.turn < len(plan) else ()
    if episode.steps_in_turn >= len(steps):
        return prompts.NO_CALL_TEXT
    return render_calls(steps[episode.steps_in_turn], episode.chat_format)


class ScriptedPolicy:
    """A `Policy` that plays a fixed plan per episode (episodes compare by identity)."""

    def __init__(self, plans: Mapping[Episode, Plan]) -> None:
        self.plans = dict(plans)

    def __call__(self, episodes: Sequence[Episode]) -> list[str]:
        return [plan_text(self.plans[e], e) for e in episodes]
