"""Kill anywhere, resume exactly; a truncated checkpoint; a full disk.

Each test runs the real command line (`python -m rcgrpo_jax.main`, configs/tiny.py shrunk as in
test_stages, on 2 devices) in a subprocess. A kill is `SIGKILL` at a random point of the run
(seeded: the seed is printed and `RCGRPO_KILL_SEED` replays it); the same command is then run
again, and its logs, summary and exported weights must equal an uninterrupted run's, up to the
wall-clock fields. Stage `all` killed inside a middle arm is in test_stages.py, which owns the
uninterrupted `all` run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, xla_flags
from test_stages import OVERRIDES

from rcgrpo_jax import models
from rcgrpo_jax.train.metrics import read_jsonl

# Fields that measure time, not what the run computed.
VOLATILE = {"time", "rollout_s", "update_s", "tokens_per_s", "step_time_s", "mfu", "compile_s"}
RCGRPO = {"stage": "rcgrpo", "rl.steps": 4, "rl.eval_every": 2, "rl.init_from": ""}


def command(workdir: Path, **extra) -> list[str]:
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]
    return [sys.executable, "-m", "rcgrpo_jax.main", "--config=configs/tiny.py",
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


def kill_seed() -> int:
    seed = int(os.environ.get("RCGRPO_KILL_SEED", time.time_ns() % 1_000_000))
    print(f"kill seed {seed} (RCGRPO_KILL_SEED={seed} replays it)")
    return seed


def run_and_kill(workdir: Path, ready, delay_s: float, timeout: float = 900, **extra) -> None:
    """Starts the command, waits until `ready()` holds, then `delay_s` more, and kills it with
    SIGKILL; fails if the run finished first."""
    log = open(workdir.parent / f"{workdir.name}.killed.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        command(workdir, **extra), cwd=REPO, env=environment(), stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay_s)
        assert proc.poll() is None, f"the run ended before the kill (rc {proc.returncode})"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


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
    """An uninterrupted rcgrpo run from the random init: 4 iterations, eval at 2 and 4."""
    workdir = tmp_path_factory.mktemp("reference")
    run(workdir, **RCGRPO)
    return workdir


def test_sampled_evaluation_is_at_the_start_and_the_end_only(reference):
    """Greedy held-out success at every evaluation; the k-sample mean (k times its rollouts)
    at the start and the end, the figures the summary reports."""
    evals = {r["step"]: r for r in read_jsonl(reference / "metrics.jsonl") if "eval_success" in r}
    assert sorted(evals) == [0, 2, 4]
    assert [("eval_sampled" in evals[s]) for s in (0, 2, 4)] == [True, False, True]


def test_rcgrpo_killed_anywhere_resumes_exactly(reference, tmp_path):
    rng = random.Random(kill_seed())
    workdir = tmp_path / "run"
    after = rng.randrange(RCGRPO["rl.steps"])  # iterations logged before the kill timer starts
    delay = rng.uniform(0.0, 0.6)
    held = run_and_kill(workdir, lambda: lines(workdir / "metrics.jsonl") >= after, delay, **RCGRPO)
    print(f"killed {delay:.2f} s after {after} iterations were logged; held: {held}")
    assert not (workdir / "summary.json").exists()
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
