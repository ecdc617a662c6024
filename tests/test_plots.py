"""plot_rl: the RL summary PNG, and the series it draws from metrics.jsonl records."""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pytest

from rcgrpo_jax.train import plots


def _write(path, records):
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # NaN written as JSON NaN
    return path


def test_plot_rl_panels_and_series(tmp_path):
    nan = math.nan
    tok = [{"step": 0, "eval_success": 0.25, "eval_sampled": 0.2, "time": 1.0, "compile_s": 3.0}]
    plain = [{"step": 0, "eval_success": 0.1, "eval_sampled": nan, "time": 1.0}]
    for i in range(1, 7):
        tok.append(
            {
                "step": i,
                "reward_mean": 0.1 * i,
                "reward_high": nan if i == 2 else 0.2 * i,
                "reward_low": 0.05 * i,
                "degenerate_frac": 0.5,
                "entropy": 2.0 - 0.1 * i,
                "applied_frac": 1.0,
                "generated_rollouts": 64.0,  # x: the running sum (no cumulative `rollouts`)
                **({"eval_success": 0.5, "eval_sampled": None} if i == 6 else {}),
            }
        )
        plain.append(
            {
                "step": i,
                "reward_mean": nan if i == 3 else 0.3,
                "reward_high": nan,
                "reward_low": nan,
                "degenerate_frac": None,
                "entropy": 1.5,
                "generated_rollouts": 64.0,
                "rollouts": 100 * i,  # x: the cumulative count where the record has it
            }
        )
    runs = {
        "tokens": _write(tmp_path / "tokens" / "metrics.jsonl", tok),
        "plain": _write(tmp_path / "plain" / "metrics.jsonl", plain),
    }

    s = plots.rl_series(plots.read_jsonl(runs["tokens"]), smooth=1)
    # against trajectories generated: the start at 0 first, then where measured
    assert s["eval_success"] == ([0, 384], [0.25, 0.5])
    assert s["eval_sampled"] == ([0], [0.2])  # null dropped
    assert s["reward_high"][0] == [64, 192, 256, 320, 384]  # NaN dropped
    assert "reward_mean" not in s  # token arm: high/low, not the mixture
    ent, rew = s["entropy_reward"]
    assert ent == pytest.approx([1.9, 1.8, 1.7, 1.6, 1.5, 1.4])
    assert rew == pytest.approx([0.1 * i for i in range(1, 7)])
    low = plots.rl_series(plots.read_jsonl(runs["tokens"]), smooth=2)["reward_low"][1]
    assert low[:3] == pytest.approx([0.05, 0.075, 0.125])  # smoothed with window 2

    p = plots.rl_series(plots.read_jsonl(runs["plain"]), smooth=1)
    assert p["reward_mean"] == ([100, 200, 400, 500, 600], [0.3] * 5)
    assert not {"reward_high", "reward_low", "eval_sampled", "degenerate_frac"} & p.keys()
    assert p["entropy_reward"][0] == [1.5] * 5  # step 3's NaN reward drops the pair

    fig = plots._rl_figure({k: plots.read_jsonl(v) for k, v in runs.items()})
    try:
        assert len(fig.axes) == len(plots.RL_PANELS) == 5
        ax_eval, ax_rew = fig.axes[:2]
        assert len(ax_eval.get_lines()) == 3  # tokens: greedy + sampled; plain: greedy only
        assert [t.get_text() for t in ax_eval.get_legend().get_texts()][:2] == ["tokens", "plain"]
        assert [ln.get_linestyle() for ln in ax_rew.get_lines()] == ["-", ":", "-"]
        # One colour per arm, the same across panels.
        assert ax_eval.get_lines()[0].get_color() == ax_rew.get_lines()[0].get_color()
        assert (
            ax_eval.get_lines()[2].get_color()
            == ax_rew.get_lines()[2].get_color()
            != (ax_rew.get_lines()[0].get_color())
        )
    finally:
        plt.close(fig)

    png = plots.plot_rl(runs, tmp_path / "out" / "rl.png", title="arms")
    assert (
        png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    )


def test_curves_figure_pairs_colours_and_draws_controls_without_bands(tmp_path):
    rows = lambda *ys: [{"rollouts": 256.0 * k, "mean": y, "ci95": 0.05, "n": 3}
                        for k, y in enumerate(ys)]  # fmt: skip
    arms = {
        "sft_grpo": rows(0.5, 0.6), "rctp_rcgrpo": rows(0.5, 0.7),
        "sft_grpo_dynamic": rows(0.5, 0.65), "sft_grpo_shuffled": rows(0.5, 0.3),
    }  # fmt: skip
    panels = {"one-turn": arms, "multi-turn": {"rctp_rcgrpo": rows(0.4, 0.5)}}
    fig = plots.curves_figure(panels, controls={"sft_grpo_shuffled": "sft_grpo"})
    try:
        one, multi = fig.axes[:2]
        lines = {ln.get_label(): ln for ln in one.get_lines()}
        assert list(lines) == list(arms)
        colour = {k: ln.get_color() for k, ln in lines.items()}
        # an arm, its dynamic twin and its control share a colour; another arm has its own,
        # the same in every panel
        assert colour["sft_grpo"] == colour["sft_grpo_dynamic"] == colour["sft_grpo_shuffled"]
        assert colour["rctp_rcgrpo"] != colour["sft_grpo"]
        assert multi.get_lines()[0].get_color() == colour["rctp_rcgrpo"]
        styles = {k: ln.get_linestyle() for k, ln in lines.items()}
        assert styles == {"sft_grpo": "-", "rctp_rcgrpo": "-", "sft_grpo_dynamic": "--",
                          "sft_grpo_shuffled": ":"}  # fmt: skip
        assert len(one.collections) == 3  # a band per real arm, none for the control
        assert lines["rctp_rcgrpo"].get_ydata()[-1] == pytest.approx(70.0)
        assert [t.get_text() for t in multi.get_legend().get_texts()] == list(arms)  # each once
    finally:
        plt.close(fig)
    png = plots.plot_curves(panels, tmp_path / "curves.png", title="study")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
