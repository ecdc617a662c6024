"""Stage `all`'s RL arms: one table, and the controls run beside them.

The grid is stage 1 × algorithm × sampling:

    sft  | rctp        the stage-1 policy the arm starts from
    grpo | rcgrpo      every rollout under one token (RCTP: <|high_reward|>, which is all an RCTP
                       model has seen; SFT: none), or each under a token drawn from P_sample(r)
    plain | _dynamic   one round of P × G rollouts per iteration, an update only where a group
                       carries signal (the paper's); or DAPO's dynamic sampling, degenerate
                       groups dropped and refilled by further rounds

Every arm spends the same budget of generated trajectories (`rl.max_rollouts`), so a comparison
between arms is at equal cost. `config.arms` names the arms (or the sets `ARM_SETS`);
`config.controls` adds, beside each chosen arm it controls, "shuffled" (rewards permuted within
the batch: what the reward signal adds) and "lr0" (lr 0: the measurement alone, change exactly 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    init: str  # the stage-1 run it starts from: "sft" | "rctp"
    algo: str  # the RL stage: "grpo" | "rcgrpo"
    rl: Mapping[str, Any]  # its `rl` settings ("optim.lr": rl.optim.lr)

    @property
    def dynamic(self) -> bool:
        return bool(self.rl.get("dynamic_sampling"))


def _grid() -> dict[str, Arm]:
    arms = {}
    for dynamic in (False, True):
        for init, algo in (
            ("sft", "grpo"),
            ("sft", "rcgrpo"),
            ("rctp", "rcgrpo"),
            ("rctp", "grpo"),
        ):
            rl: dict[str, Any] = {"dynamic_sampling": dynamic}
            if init == "rctp" and algo == "grpo":
                rl["grpo_token"] = "high"
            name = f"{init}_{algo}" + ("_dynamic" if dynamic else "")
            arms[name] = Arm(name, init, algo, rl)
    return arms


ARMS: dict[str, Arm] = _grid()
ARM_SETS: dict[str, tuple[str, ...]] = {
    "paper": tuple(n for n, a in ARMS.items() if not a.dynamic),
    "dynamic": tuple(n for n, a in ARMS.items() if a.dynamic),
    "grid": tuple(ARMS),
}
# Control kind -> (suffix, rl settings, the arms it controls: each chosen one gets a copy).
CONTROLS: dict[str, tuple[str, Mapping[str, Any], tuple[str, ...]]] = {
    "shuffled": (
        "shuffled",
        {"shuffle_rewards": True},
        ("sft_grpo", "rctp_rcgrpo", "sft_grpo_dynamic", "rctp_rcgrpo_dynamic"),
    ),
    "lr0": ("lr0", {"optim.lr": 0.0}, ("rctp_rcgrpo", "rctp_rcgrpo_dynamic")),
}
METHOD = ("rctp_rcgrpo", "rctp_rcgrpo_dynamic")  # RC-GRPO as the paper runs it, and with DAPO's
BASELINE = "sft_grpo_dynamic"  # the reference of `tools.seeds`' rollout ratio


def chosen(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The arm names `config.arms` selects, sets expanded, in the table's order, once each."""
    picked = {a for n in names for a in ARM_SETS.get(n, (n,))}
    unknown = picked - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; have {sorted((*ARMS, *ARM_SETS))}")
    return tuple(n for n in ARMS if n in picked)


def rl_arms(config: ml_collections.ConfigDict) -> tuple[Arm, ...]:
    """The arms stage `all` runs: `config.arms`, then each control of `config.controls` for
    every chosen arm it controls."""
    arms = [ARMS[n] for n in chosen(tuple(config.arms))]
    for kind in config.controls:
        suffix, _, controlled = CONTROLS[kind]
        arms += [find(f"{a.name}_{suffix}") for a in list(arms) if a.name in controlled]
    return tuple(arms)


def find(name: str) -> Arm:
    """The arm `name` stands for: a cell of the table, or a control of one (with its settings)."""
    if name in ARMS:
        return ARMS[name]
    control = control_of(name)
    if control is None:
        raise ValueError(f"unknown arm {name!r}; have {sorted(ARMS)} and their controls")
    base, kind = control
    suffix, rl, _ = CONTROLS[kind]
    return Arm(name, ARMS[base].init, ARMS[base].algo, {**ARMS[base].rl, **rl})


def control_of(name: str) -> tuple[str, str] | None:
    """(the arm, the control kind) a control arm's name stands for; None for a real arm."""
    for kind, (suffix, _, controlled) in CONTROLS.items():
        base = name.removesuffix(f"_{suffix}")
        if base != name and base in controlled:
            return base, kind
    return None
