"""Per-task pass rates of a policy by template: which tasks RL can get a signal from.

    PYTHONPATH=. python docs/experiments/pass_rates.py <HF export dir> [--split test]
        [--temperature 1.0] [--samples 8] [--entries 128] [--num_rl 0] [--seed 100]
        [--token none|high|low] [--config configs/tiny.py]

Samples `samples` rollouts of each of the first `entries` tasks of `split` and prints, per
template (read off the ground truth's calls), the mean success and the fractions of tasks
solved by every sample, by none, and in between: a group of G rollouts carries a GRPO signal
only in between. `--num_rl` must match the stage-1 run's `env.synthetic.num_rl` (it changes
the train split). An ad-hoc probe behind docs/experiments/tiny_default.md (not in the tests).
"""

import argparse
import collections

import numpy as np

from rcgrpo_jax import logs
from rcgrpo_jax.config import config_from_file
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.rollout import RolloutSettings, collect
from rcgrpo_jax.stages import setup


def template(entry) -> str:
    """The synthetic template that made `entry`, from its ground-truth calls."""
    calls = " ".join(entry.ground_truth[0])
    if "echo(" in calls:
        return "clone_text"
    if "mv(" in calls:
        return "rename_by_ext" if calls.startswith("cd(") else "rename_top"
    return "copy_top" if "cp(" in calls else "count_top" if "wc(" in calls else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export")
    ap.add_argument("--split", default="test")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--entries", type=int, default=128)
    ap.add_argument("--num_rl", type=int, default=0)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--token", choices=("none", "high", "low"), default="none")
    ap.add_argument("--config", default="configs/tiny.py")
    a = ap.parse_args()
    logs.configure(verbose=False)
    c = config_from_file(a.config)
    c.workdir, c.seed, c.tokenizer_path = "/tmp/pass_rates", a.seed, ""
    c.env.synthetic.seed, c.env.synthetic.num_rl = a.seed, a.num_rl
    s = setup.with_reward_tokens(setup.start(c, a.export))
    env = setup.environment(c)
    entries = setup.task_entries(c, a.split)[: a.entries]
    settings = RolloutSettings(
        chat_format=c.model.chat_format, max_new_tokens=int(c.rl.max_new_tokens),
        max_len=int(c.rl.max_len), temperature=a.temperature,
        max_steps_per_turn=int(c.env.max_steps_per_turn),
    )  # fmt: skip
    token = {"none": NONE, "high": HIGH, "low": LOW}[a.token]
    tokens = np.full((len(entries), a.samples), token, np.int32)
    ro = collect(s.cfg, s.params, s.tokenizer, env, entries, tokens, settings, seed=7, mesh=s.mesh)
    rates = collections.defaultdict(list)
    for entry, r in zip(entries, ro.rewards, strict=True):
        rates[template(entry)].append(float(r.mean()))
    rates["all"] = [x for v in list(rates.values()) for x in v]
    print(f"{a.split} split, T={a.temperature}, {a.samples} samples per task")
    for name, v in sorted(rates.items()):
        v = np.asarray(v)
        between = ((v > 0) & (v < 1)).mean()
        print(
            f"{name:14s} n={len(v):3d} success {v.mean():.2f}  all-pass {(v == 1).mean():.2f}"
            f"  all-fail {(v == 0).mean():.2f}  in between {between:.2f}"
        )


if __name__ == "__main__":
    main()
