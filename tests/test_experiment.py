"""Stage `all`'s bookkeeping without running it: the ablation arms, the demo's three targets,
and the seed table over stage `all`'s summaries (its intervals: tests/test_seeds.py)."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from rcgrpo_jax.envs.reward_tokens import HIGH, NONE
from rcgrpo_jax.rl import arms as arms_lib
from rcgrpo_jax.rl.draws import reward_tokens_for, shuffled, token_draw
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.stages.rl import evaluation_token
from rcgrpo_jax.tools import seed_stats, seeds


def _rl(**kw) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {"num_prompts": 3, "group_size": 4, "p_high": 0.75, "stratified": True,
         "grpo_token": "none", **kw}
    )  # fmt: skip


def test_grpo_rows_carry_the_configured_token():
    tokens = lambda algo, **kw: reward_tokens_for(token_draw(algo, _rl(**kw), 0), 1)
    assert (tokens("grpo") == NONE).all() and tokens("grpo").shape == (3, 4)
    assert (tokens("grpo", grpo_token="high") == HIGH).all()
    rc = tokens("rcgrpo", grpo_token="high")  # RC-GRPO ignores it
    assert ((rc == HIGH).sum(1) == 3).all()


def test_each_arm_is_evaluated_under_its_own_token():
    """Start and end of an arm are measured under one token: none for the GRPO arms from SFT,
    the high token for every arm whose rollouts carry tokens (controls as the arm they copy)."""
    want = {"sft_grpo": None, "sft_rcgrpo": HIGH, "rctp_rcgrpo": HIGH, "rctp_grpo": HIGH}
    arms = arms_lib.rl_arms(_experiment_config(arms=("grid",)))
    assert len(arms) == 8 + 4 + 2  # the grid, shuffled for 4 of its arms, lr 0 for 2
    for arm in arms:
        rl = _rl(**{k: v for k, v in arm.rl.items() if k == "grpo_token"})
        cell = arm.name.removesuffix("_shuffled").removesuffix("_lr0").removesuffix("_dynamic")
        assert evaluation_token(arm.algo, rl) == want[cell], arm.name


def _experiment_config(arms=("paper", "sft_grpo_dynamic")) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"arms": arms, "controls": ("shuffled", "lr0")})


def test_arm_sets_and_controls():
    """`config.arms` takes names and sets, in the table's order, each once; each control
    copies every chosen arm it controls, with its settings laid over the arm's."""
    names = lambda arms, controls=(): [
        a.name for a in arms_lib.rl_arms(ml_collections.ConfigDict(
            {"arms": arms, "controls": controls}))
    ]  # fmt: skip
    assert names(("paper",)) == ["sft_grpo", "sft_rcgrpo", "rctp_rcgrpo", "rctp_grpo"]
    assert names(("rctp_rcgrpo_dynamic", "sft_grpo", "paper")) == [
        "sft_grpo", "sft_rcgrpo", "rctp_rcgrpo", "rctp_grpo", "rctp_rcgrpo_dynamic",
    ]  # fmt: skip
    assert names(("dynamic",)) == [f"{n}_dynamic" for n in names(("paper",))]
    got = names(("sft_grpo", "rctp_rcgrpo_dynamic"), ("lr0", "shuffled"))
    assert got == ["sft_grpo", "rctp_rcgrpo_dynamic", "rctp_rcgrpo_dynamic_lr0",
                   "sft_grpo_shuffled", "rctp_rcgrpo_dynamic_shuffled"]  # fmt: skip
    arms = {a.name: a for a in arms_lib.rl_arms(ml_collections.ConfigDict(
        {"arms": ("rctp_rcgrpo_dynamic",), "controls": ("lr0", "shuffled")}))}  # fmt: skip
    assert arms["rctp_rcgrpo_dynamic_lr0"].rl == {"dynamic_sampling": True, "optim.lr": 0.0}
    assert arms["rctp_rcgrpo_dynamic_shuffled"].dynamic
    assert arms_lib.control_of("rctp_rcgrpo_dynamic_lr0") == ("rctp_rcgrpo_dynamic", "lr0")
    assert arms_lib.control_of("sft_grpo_dynamic") is None
    with pytest.raises(ValueError, match="unknown arms"):
        arms_lib.chosen(("sft_gpro",))


def test_stage_all_refuses_a_config_wide_dynamic_sampling():
    """In stage `all` each arm sets its own sampling: a config-wide rl.dynamic_sampling would
    be silently overridden, so it is an error naming the arms to use instead; unknown arm
    names are one line too."""
    from rcgrpo_jax import config_check
    from rcgrpo_jax.config import base_config
    from rcgrpo_jax.errors import UserError

    c = base_config()
    c.stage, c.env.benchmark = "all", "synthetic"
    config_check.validate(c)
    c.rl.dynamic_sampling = True
    with pytest.raises(UserError, match=r"rl.dynamic_sampling=True: expected False for stage all"):
        config_check.validate(c)
    c.rl.dynamic_sampling = False
    c.arms = ("rctp_rcgrpo", "grpo")
    with pytest.raises(UserError, match=r"config.arms=.*expected a non-empty tuple of: sft_grpo"):
        config_check.validate(c)
    # the budget: a plain arm must be able to spend it within rl.steps; at least one group
    c.arms = ("sft_grpo",)
    c.rl.steps, c.rl.num_prompts, c.rl.group_size, c.rl.max_rollouts = 4, 8, 8, 257
    with pytest.raises(UserError, match=r"config.rl.steps=4: expected >= .* = 5 for stage all"):
        config_check.validate(c)
    c.rl.max_rollouts = 7
    with pytest.raises(UserError, match=r"config.rl.max_rollouts=7: expected 0 .* >= rl.group"):
        config_check.validate(c)
    c.rl.max_rollouts = 256
    config_check.validate(c)
    # a control of none of the chosen arms would run nothing
    c.controls = ("shuffled", "lr0")
    with pytest.raises(UserError, match=r"'lr0' controls rctp_rcgrpo, rctp_rcgrpo_dynamic"):
        config_check.validate(c)


def test_shuffled_rewards_keep_the_batch_and_break_the_link():
    rewards = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a, b = shuffled(rewards, 0, 3), shuffled(rewards, 0, 3)
    np.testing.assert_array_equal(a, b)  # seeded by (seed, iteration)
    assert a.shape == rewards.shape and sorted(a.ravel()) == sorted(rewards.ravel())
    assert any(not np.array_equal(shuffled(rewards, 0, i), rewards) for i in range(5))


def test_every_ablation_cell_is_an_arm():
    arms = {name: (a.init, a.algo, dict(a.rl)) for name, a in arms_lib.ARMS.items()}
    assert arms["sft_grpo"] == ("sft", "grpo", {"dynamic_sampling": False})
    assert arms["sft_rcgrpo"] == ("sft", "rcgrpo", {"dynamic_sampling": False})
    assert arms["rctp_rcgrpo"] == ("rctp", "rcgrpo", {"dynamic_sampling": False})
    assert arms["rctp_grpo"] == ("rctp", "grpo", {"dynamic_sampling": False, "grpo_token": "high"})
    assert arms["sft_grpo_dynamic"] == ("sft", "grpo", {"dynamic_sampling": True})
    assert arms["rctp_grpo_dynamic"][2] == {"dynamic_sampling": True, "grpo_token": "high"}
    assert len(arms) == 8 and arms_lib.ARM_SETS["grid"] == tuple(arms)


def _arms(base=0.0, sft=0.5, high=0.5, low=0.0, deg_g=0.9, deg_rc=0.3, final=0.6):
    rl = lambda deg: {"heldout_success": final, "degenerate_frac": deg, "entropy": 0.1}
    return {
        "base": {"heldout_success": base},
        "sft": {"heldout_success": sft},
        "rctp": {"heldout_success": high, "success_high": high, "success_low": low},
        "sft_grpo": rl(deg_g), "sft_rcgrpo": rl(0.5), "rctp_rcgrpo": rl(deg_rc),
        "rctp_grpo": rl(0.95), "sft_grpo_dynamic": rl(0.9),
    }  # fmt: skip


@pytest.mark.parametrize(
    "change, failed",
    [
        ({}, set()),
        ({"sft": 0.85}, {"sft_in_band"}),
        ({"sft": 0.15}, {"sft_in_band"}),
        ({"base": 0.2}, {"sft_in_band"}),
        ({"low": 0.31}, {"rctp_controllable"}),
        ({"deg_rc": 0.9}, {"rcgrpo_less_degenerate"}),
    ],
)
def test_targets(change, failed):
    t = experiment.targets(_arms(**change))
    assert {k for k in seed_stats.TARGETS if not t[k]} == failed
    sft_start = change.get("sft", 0.5)
    assert t["moved"]["sft_grpo"] == pytest.approx(0.6 - sft_start)
    assert t["moved"]["rctp_grpo"] == pytest.approx(0.1)  # from RCTP's high-token success
    assert t["moved"]["sft_grpo_dynamic"] == pytest.approx(0.6 - sft_start)


def test_change_is_measured_from_the_arms_own_start():
    """An arm whose RL stage evaluated its start (under its own token) moves from that start,
    not from the stage-1 figure (SFT's was measured without a token, sft_rcgrpo's end under
    the high one)."""
    arms = _arms()
    arms["sft_rcgrpo"]["start_success"] = 0.25
    arms["rctp_rcgrpo_lr0"] = {"start_success": 0.4, "heldout_success": 0.4}
    moved = experiment.targets(arms)["moved"]
    assert moved["sft_rcgrpo"] == pytest.approx(0.35) and moved["rctp_rcgrpo_lr0"] == 0.0
    assert moved["sft_grpo"] == pytest.approx(0.1)  # no start record: SFT's own figure


def test_table_columns_fit_every_arm_name():
    table = experiment.format_table({"arms": _arms()})
    assert len({len(line) for line in table.splitlines()}) == 1  # aligned columns
    assert any(line.startswith("sft_grpo_dynamic ") for line in table.splitlines())


def test_seed_table_counts_the_targets_of_stage_all():
    """tools.seeds over summaries whose targets `experiment.targets` computed: targets met per
    seed, seeds meeting all three, each arm's change from its start, one report line per arm."""
    values = [0.25, 0.5, 0.375, 0.625, 0.5]
    per_seed = {}
    for i, v in enumerate(values):
        arms = _arms(sft=v, deg_rc=0.95 if i == 0 else 0.3, final=v + 0.1)
        per_seed[i] = {"arms": arms, "targets": experiment.targets(arms), "wall_s": 1.0}
    agg = seed_stats.aggregate(per_seed)
    assert agg["targets_met"] == {
        "sft_in_band": 5, "rctp_controllable": 5, "rcgrpo_less_degenerate": 4
    }  # fmt: skip
    assert agg["seeds_meeting_all"] == 4
    assert agg["arms"]["sft"]["heldout_success"]["mean"] == pytest.approx(0.45)
    assert agg["arms"]["sft_grpo"]["change"]["mean"] == pytest.approx(0.1)
    assert agg["arms"]["sft_grpo"]["change"]["ci95"] == pytest.approx(0.0, abs=1e-12)
    report = seeds.format_report(per_seed, agg)
    assert "all three 4/5" in report and "sft_rcgrpo" in report
    assert agg["arms"]["sft_grpo_dynamic"]["change"]["mean"] == pytest.approx(0.1)
    arm_lines = report.split("\n\n")[1].splitlines()
    assert len({len(line) for line in arm_lines}) == 1  # the longest arm name fits its column


def test_target_3_compares_arms_of_one_sampling():
    """RC-GRPO against SFT+GRPO, both plain where both ran, else both dynamic; no target
    from a plain arm against a dynamic one."""
    arms = _arms()
    t = lambda a: experiment.targets(a)["rcgrpo_less_degenerate"]
    dyn = {k: v for k, v in arms.items() if k not in ("sft_grpo", "rctp_rcgrpo")}
    dyn["rctp_rcgrpo_dynamic"] = {"heldout_success": 0.6, "degenerate_frac": 0.95}
    assert t(arms) is True and t(dyn) is False  # 0.95 > sft_grpo_dynamic's 0.9
    mixed = {k: v for k, v in dyn.items() if k != "sft_grpo_dynamic"}
    mixed["sft_grpo"] = arms["sft_grpo"]
    assert t(mixed) is None


def test_an_update_without_signal_is_not_called():
    """A minibatch whose valid groups are all degenerate has no signal (the fused step would
    compute it and leave the state as it was: `test_rl`'s no-signal test), so the RL loop does
    not call the step; a masked padding group's rewards do not count."""
    from rcgrpo_jax.stages.rl import has_signal

    batch = lambda rewards, mask: {"rewards": np.array(rewards), "group_mask": np.array(mask)}
    assert not has_signal(batch([[1.0, 1.0], [0.0, 0.0]], [1.0, 1.0]))
    assert has_signal(batch([[1.0, 0.0], [0.0, 0.0]], [1.0, 1.0]))
    assert not has_signal(batch([[1.0, 1.0], [1.0, 0.0]], [1.0, 0.0]))  # the padding has it
