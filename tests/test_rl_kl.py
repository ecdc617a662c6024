"""The KL term's reference (`rl.kl_beta` > 0) is the frozen start policy, also after a resume.

An RC-GRPO run through the command line (test_kill_resume's: dynamic sampling, the coin rewards
of tests/forced_rewards.py) with one update per iteration, so each iteration's logged `kl` is
that one update's k3 KL to the reference: the first update's params are the start policy's, so
its KL is rounding; every later update's params have moved, so its KL is not. A reference taken
from the policy being trained (the params an iteration starts from, or those a resumed run
restores) would make every iteration's KL rounding. The run is killed once its first checkpoint
is on disk and started again, so the later updates are a resumed process's.
"""

from __future__ import annotations

from test_kill_resume import RCGRPO, run, run_killed_at

from rcgrpo_jax.train.metrics import read_jsonl

KL = {
    **RCGRPO, "rl.kl_beta": 0.1, "rl.epochs": 1, "rl.minibatches": 1, "rl.steps": 3,
    "rl.eval_every": 0,  # no evaluation: only the updates matter here
}  # fmt: skip
ROUNDING = 1e-9  # k3 KL of float32 log-prob rounding (~1e-7 per token): ~1e-14


def test_kl_reference_is_the_start_policy_across_a_resume(tmp_path):
    workdir = tmp_path / "run"
    run_killed_at(workdir, "saved:1", **KL)
    run(workdir, **KL)
    updated = [r for r in read_jsonl(workdir / "metrics.jsonl") if r.get("applied_frac")]
    print({r["step"]: r["kl"] for r in updated})
    assert len(updated) >= 2, "fewer than two iterations updated"
    first, *later = updated
    assert abs(first["kl"]) < ROUNDING, first["kl"]  # the start policy is the reference
    # an update from params one or more updates away from the start policy
    assert all(r["kl"] > 1e3 * ROUNDING for r in later), [r["kl"] for r in later]
