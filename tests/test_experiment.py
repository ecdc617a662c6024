"""Stage `all`'s bookkeeping without running it: the ablation arms, the demo's three targets,
and the seed table's intervals (against scipy's t quantiles)."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from rcgrpo_jax.envs.reward_tokens import HIGH, NONE
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.stages.rl import evaluation_token, reward_tokens_for, shuffled, token_draw
from rcgrpo_jax.tools import seeds


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
    want = {"sft_grpo": None, "sft_rcgrpo": HIGH, "rctp_rcgrpo": HIGH, "rctp_grpo": HIGH,
            "sft_grpo_dynamic": None, "sft_grpo_shuffled": None, "rctp_rcgrpo_shuffled": HIGH,
            "rctp_rcgrpo_lr0": HIGH}  # fmt: skip
    config = _experiment_config(dynamic_sampling=False)
    arms = experiment.rl_arms(config)
    assert [a[0] for a in arms] == [*(a[0] for a in experiment.RL_ARMS), *list(want)[5:]]
    for name, _, algo, overrides in arms:
        rl = _rl(**{k: v for k, v in overrides.items() if k == "grpo_token"})
        assert evaluation_token(algo, rl) == want[name], name


def _experiment_config(**rl) -> ml_collections.ConfigDict:
    base = {"dynamic_sampling": False, "grpo_token": "none", "shuffle_rewards": False,
            "optim": {"lr": 1e-3}}  # fmt: skip
    return ml_collections.ConfigDict({"controls": ("shuffled", "lr0"), "rl": {**base, **rl}})


def test_an_arm_that_repeats_the_config_is_left_out():
    """With dynamic sampling on for every arm the dynamic arm would be sft_grpo run twice; an
    override that differs from the config (lr 0, shuffled rewards) keeps its arm."""
    names = lambda **rl: [a[0] for a in experiment.rl_arms(_experiment_config(**rl))]
    assert "sft_grpo_dynamic" in names()
    dynamic = names(dynamic_sampling=True)
    assert "sft_grpo_dynamic" not in dynamic and len(dynamic) == len(names()) - 1
    assert "rctp_rcgrpo_lr0" not in names(optim={"lr": 0.0})
    assert {"sft_grpo", "rctp_rcgrpo_lr0", "sft_grpo_shuffled"} <= set(dynamic)


def test_shuffled_rewards_keep_the_batch_and_break_the_link():
    rewards = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a, b = shuffled(rewards, 0, 3), shuffled(rewards, 0, 3)
    np.testing.assert_array_equal(a, b)  # seeded by (seed, iteration)
    assert a.shape == rewards.shape and sorted(a.ravel()) == sorted(rewards.ravel())
    assert any(not np.array_equal(shuffled(rewards, 0, i), rewards) for i in range(5))


def test_every_ablation_cell_is_an_arm():
    arms = {name: (init, algo, o) for name, init, algo, o in experiment.RL_ARMS}
    assert arms["sft_grpo"] == ("sft", "grpo", {})
    assert arms["sft_rcgrpo"] == ("sft", "rcgrpo", {})
    assert arms["rctp_rcgrpo"] == ("rctp", "rcgrpo", {})
    assert arms["rctp_grpo"] == ("rctp", "grpo", {"grpo_token": "high"})
    assert arms["sft_grpo_dynamic"] == ("sft", "grpo", {"dynamic_sampling": True})


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
    assert {k for k in seeds.TARGETS if not t[k]} == failed
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


def test_seed_table_intervals():
    from scipy import stats

    values = [0.25, 0.5, 0.375, 0.625, 0.5]
    got = seeds.interval(values)
    half = stats.t.ppf(0.975, 4) * np.std(values, ddof=1) / np.sqrt(5)
    assert got["mean"] == pytest.approx(0.45) and got["ci95"] == pytest.approx(half)
    assert stats.t.ppf(0.975, 4) == pytest.approx(2.776, abs=1e-3)
    per_seed = {}
    for i, v in enumerate(values):
        arms = _arms(sft=v, deg_rc=0.95 if i == 0 else 0.3, final=v + 0.1)
        per_seed[i] = {"arms": arms, "targets": experiment.targets(arms), "wall_s": 1.0}
    agg = seeds.aggregate(per_seed)
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
