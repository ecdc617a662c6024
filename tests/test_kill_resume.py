"""Killed at fixed points, resumed exactly; a truncated checkpoint; a full disk.

Each test runs the real command line (`python -m rcgrpo_jax.main`, configs/tiny.py shrunk as in
test_stages, on 2 devices) in a subprocess, as the demo runs RC-GRPO: with dynamic sampling, so an
iteration draws later rounds (their prompts, reward tokens and sampler seeds) and updates on the
groups it kept, over 2 epochs x 2 minibatches. Its rewards are tests/forced_rewards.py's coin: a
random model's real rewards are all 0, and dynamic sampling would keep nothing and update nothing.
A kill is SIGKILL at a chosen point of what the run did (tests/kill_points.py: an update, a saved
checkpoint, an evaluation), not of the clock; the same command is then run again, and its logs,
summary and exported weights must equal an uninterrupted run's, up to the wall-clock fields.
Stage `all` killed inside a middle arm, and RC-GRPO under LoRA killed mid-update, are in
test_stages.py, which owns the uninterrupted runs (they use `run_killed_at` below).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, xla_flags
from kill_points import EVENTS, KILL_AT
from test_stages import OVERRIDES

from rcgrpo_jax import models
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
from rcgrpo_jax.train.metrics import read_jsonl

# Fields that measure time, not what the run computed.
VOLATILE = {"time", "rollout_s", "update_s", "tokens_per_s", "step_time_s", "mfu", "compile_s"}
# The rewards' module (`env.module`): imported by the runs, never by this process.
FORCED_REWARDS = "tests.forced_rewards"
P, G, STEPS, ROUNDS = OVERRIDES["rl.num_prompts"], OVERRIDES["rl.group_size"], 4, 4
RCGRPO = {
    "stage": "rcgrpo", "rl.init_from": "", "env.module": FORCED_REWARDS,
    "rl.dynamic_sampling": True, "rl.dynamic_max_rounds": ROUNDS,
    "rl.steps": STEPS, "rl.eval_every": 2, "rl.eval_points": 0,
    # every round of every iteration fits the budget: the run ends after rl.steps iterations
    "rl.max_rollouts": STEPS * ROUNDS * P * G,
    "rl.epochs": 2, "rl.minibatches": 2,  # the demo's: 4 updates per iteration
}  # fmt: skip


def command(workdir: Path, program: tuple[str, ...] = ("-m", "rcgrpo_jax.main"), **extra):
    """The command line of a run in `workdir` (`program`: the module or script python runs)."""
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]
    return [sys.executable, *program, "--config=configs/tiny.py",
            f"--config.workdir={workdir}", *args]  # fmt: skip


def environment() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags(2))


def run(workdir: Path, timeout: float = 900, **extra) -> subprocess.CompletedProcess:
    """The command to its end; asserts it succeeded."""
    out = subprocess.run(
        command(workdir, **extra), cwd=REPO, env=environment(), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def left_behind(rl_dir: Path) -> str:
    """What a killed RL run left: logged iterations, checkpoints, export/summary."""
    ckpts = rl_dir / "checkpoints"
    steps = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    done = [name for name in ("export", "summary.json") if (rl_dir / name).exists()]
    return (
        f"{lines(rl_dir / 'metrics.jsonl')} metrics lines, "
        f"{lines(rl_dir / 'rollouts.jsonl')} rollout lines, checkpoints {steps}, {done}"
    )


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


def assert_same_rl_run(a: Path, b: Path) -> None:
    """Two RL workdirs hold the same run: metrics, rollouts, summary, exported weights."""
    assert comparable(read_jsonl(a / "metrics.jsonl")) == comparable(
        read_jsonl(b / "metrics.jsonl")
    )
    assert read_jsonl(a / "rollouts.jsonl") == read_jsonl(b / "rollouts.jsonl")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert comparable([sa["final"]]) == comparable([sb["final"]])
    # "time": the invocation's wall and compile seconds
    own = ("final", "export", "time")
    assert {k: v for k, v in sa.items() if k not in own} == {
        k: v for k, v in sb.items() if k not in own
    }
    _, pa = models.load_hf(a / "export")
    _, pb = models.load_hf(b / "export")
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted RC-GRPO run with dynamic sampling from the random init: 4 iterations,
    evaluated at the start, 2 and 4."""
    workdir = tmp_path_factory.mktemp("reference")
    run(workdir, **RCGRPO)
    return workdir


def test_sampled_evaluation_is_at_the_start_and_the_end_only(reference):
    """Greedy held-out success at every evaluation; the k-sample mean (k times its rollouts)
    at the start and the end, the figures the summary reports."""
    evals = {r["step"]: r for r in read_jsonl(reference / "metrics.jsonl") if "eval_success" in r}
    assert sorted(evals) == [0, 2, 4]
    assert [("eval_sampled" in evals[s]) for s in (0, 2, 4)] == [True, False, True]


def test_dynamic_sampling_draws_both_tokens_in_every_round(reference):
    """rollouts.jsonl holds each iteration's rounds in order, P groups each (the budget cuts
    none): every round's groups carry both reward tokens (stratified: one high and one low per
    group of 2), later rounds included; a group is trained only if its rewards differ, and the
    run made later rounds and applied updates."""
    rows = read_jsonl(reference / "rollouts.jsonl")
    metrics = {r["step"]: r for r in read_jsonl(reference / "metrics.jsonl")}
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        tokens, rewards = np.asarray(row["reward_token"]), np.asarray(row["rewards"])
        assert tokens.shape == rewards.shape and tokens.shape[0] % P == 0, row
        assert tokens.size == metrics[row["iteration"]]["generated_rollouts"]
        for start in range(0, len(tokens), P):  # one round
            assert {HIGH, LOW} <= set(tokens[start : start + P].ravel()), (row["iteration"], start)
        assert (np.sort(tokens, 1) == [LOW, HIGH]).all()
        mixed = rewards.min(1) < rewards.max(1)
        assert not (np.asarray(row["trained"]) & ~mixed).any(), row
    assert any(len(r["reward_token"]) > P for r in rows), "no iteration drew a later round"
    assert any(metrics[r["iteration"]]["applied_frac"] > 0 for r in rows), "no update applied"


def run_killed_at(workdir: Path, at: str, **extra) -> list[str]:
    """The command under tests/kill_points.py, killed at its event `at` ("<event>:<n>");
    returns the events it made, in order (the kill's last)."""
    events = workdir.parent / f"{workdir.name}.{at.replace(':', '-')}.events"
    env = {**environment(), KILL_AT: at, EVENTS: str(events)}
    out = subprocess.run(
        command(workdir, ("tests/kill_points.py",), **extra), cwd=REPO, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    tail = out.stderr[-3000:]
    assert out.returncode == -signal.SIGKILL, f"rc {out.returncode}, no kill at {at}:\n{tail}"
    print(f"killed at {at}; left {left_behind(workdir)}")
    return events.read_text().splitlines()


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*"))


def assert_prefix_of(reference: Path, workdir: Path) -> list[int]:
    """What a killed run left in its logs is the start of the uninterrupted run's; returns the
    steps of the metrics records it left."""
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        left = comparable(read_jsonl(workdir / name)) if (workdir / name).exists() else []
        assert left == comparable(read_jsonl(reference / name))[: len(left)], name
    return [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")]


def test_rcgrpo_killed_at_fixed_points_resumes_exactly(reference, tmp_path):
    """One run killed three times, each time started again: mid-update (the second of an
    iteration's updates: its state in memory only), just after a checkpoint is on disk (the
    iteration the first kill cut short, done again), and mid-evaluation (the last one, its
    greedy half measured, its sampled half begun: the last iteration's record and checkpoint
    not yet written). What each kill left is a prefix of the uninterrupted run's logs; the
    fourth start ends as that run did."""
    workdir = tmp_path / "run"
    *_, before, last = run_killed_at(workdir, "update:2", **RCGRPO)
    assert before == last and last.startswith("update "), (before, last)  # mid-iteration
    cut = int(last.split()[1])
    assert saved_steps(workdir) == list(range(1, cut)), left_behind(workdir)
    assert assert_prefix_of(reference, workdir) == list(range(cut))  # the start's evaluation

    *_, last = run_killed_at(workdir, "saved:1", **RCGRPO)
    assert last == f"saved {cut}" and max(saved_steps(workdir)) == cut
    assert assert_prefix_of(reference, workdir) == list(range(cut + 1))

    events = run_killed_at(workdir, "sampled_eval:1", **RCGRPO)
    assert events[-1] == f"sampled_eval {OVERRIDES['eval.samples']}"
    assert max(saved_steps(workdir)) == STEPS - 1 and f"saved {STEPS}" not in events
    assert assert_prefix_of(reference, workdir) == list(range(STEPS))

    run(workdir, **RCGRPO)
    assert_same_rl_run(reference, workdir)


def test_truncated_checkpoint_falls_back_with_one_line(reference, tmp_path):
    """A file of the latest step deleted (a write cut short): the run says so in one line,
    resumes from the previous step, and ends as the uninterrupted run did."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    latest = workdir / "checkpoints" / str(RCGRPO["rl.steps"])
    biggest = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.unlink()
    (workdir / "summary.json").unlink()
    out = run(workdir, **RCGRPO)
    said = [line for line in out.stderr.splitlines() if "could not be restored" in line]
    assert len(said) == 1, out.stderr[-3000:]
    assert f"step {RCGRPO['rl.steps']} " in said[0]
    assert f"resuming from step {RCGRPO['rl.steps'] - 1}" in said[0]
    assert (workdir / "checkpoints" / "corrupt" / str(RCGRPO["rl.steps"])).is_dir()
    assert_same_rl_run(reference, workdir)


def _can_mount_tmpfs() -> bool:
    probe = "mkdir -p /tmp/.rcgrpo_probe && mount -t tmpfs -o size=64k tmpfs /tmp/.rcgrpo_probe"
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="cannot mount a tmpfs (unshare -rm)")
def test_full_disk_stops_with_one_line(reference, tmp_path):
    """The workdir on a 2 MB tmpfs: the run stops with one `error:` line naming the path, exit
    2; the checkpoints saved before stay readable (a rerun on a larger disk resumes from the
    latest without a fallback line) and metrics.jsonl holds whole lines only."""
    mount, saved = tmp_path / "small", tmp_path / "saved"
    mount.mkdir()
    shutil.copytree(reference / "tokenizer", tmp_path / "tokenizer")  # trained already
    script = (
        'mount -t tmpfs -o size=2m tmpfs "$0" && cp -a "$1" "$0/tokenizer" && '
        '"${@:3}"; rc=$?; cp -a "$0/." "$2"; exit $rc'
    )
    full = subprocess.run(
        ["unshare", "-rm", "bash", "-c", script, str(mount), str(tmp_path / "tokenizer"),
         str(saved), *command(mount, **RCGRPO)],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert full.returncode == 2 and len(errors) == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    assert str(mount) in errors[0] and "No space left on device" in errors[0], errors
    print(errors[0])
    text = (saved / "metrics.jsonl").read_text()
    assert text == "" or text.endswith("\n")
    steps = sorted(int(p.name) for p in (saved / "checkpoints").iterdir() if p.name.isdigit())
    assert steps, "no checkpoint was saved before the disk filled up"
    # the same command on a disk with room: resumes from the latest step without a fallback
    workdir = tmp_path / "roomy"
    shutil.copytree(saved, workdir)
    out = run(workdir, **RCGRPO)
    assert "could not be restored" not in out.stderr, out.stderr[-3000:]
    assert_same_rl_run(reference, workdir)


ASYNC_SAVE_ON_FULL_DISK = """
import sys
import jax.numpy as jnp
import numpy as np
from rcgrpo_jax.train.checkpoint import Checkpointer
from rcgrpo_jax.train.metrics import OutputError
# 4 MiB of incompressible floats, the first step (no earlier step to size the space check by):
# the disk fills inside orbax's background commit, not in the caller's thread
state = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024)), jnp.float32)}
try:
    with Checkpointer(sys.argv[1], save_every=1) as ckpt:
        assert ckpt.save(1, state, force=True)
except OutputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_full_disk_inside_the_async_save_is_one_line(tmp_path):
    """The disk fills while orbax commits in its background threads (each of which logs a
    traceback of the failure): the caller gets one `error:` line and nothing else on stderr."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = 'mount -t tmpfs -o size=1m tmpfs "$0" && "${@:1}"'
    out = subprocess.run(
        ["unshare", "-rm", "bash", "-c", script, str(mount), sys.executable, "-c",
         ASYNC_SAVE_ON_FULL_DISK, str(mount / "checkpoints")],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert (
        lines[0]
        == f"error: cannot write checkpoints in {mount}/checkpoints: No space left on device"
    )
