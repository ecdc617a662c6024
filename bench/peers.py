"""rcgrpo_jax against the GRPO trainers users would pick instead, on one CPU: TRL's GRPOTrainer
(torch, `model.generate`) and Tunix's GRPO learners (JAX), on the same model doing the same work.

    python bench/peers.py                      # single- and multi-turn, 1 and 2 threads
    python bench/peers.py --modes single --threads 1 --max-new 32

The workload (bench/peer_runs/workload.py): a tiny Qwen2 (hidden 256, 4 layers, 1,024-token
BPE with Qwen2.5's chat template) built once by bench/peer_runs/build.py; P = 8 prompts x G = 8
samples at temperature 1; a programmatic reward; AdamW, one update per iteration, no KL.
Single-turn runs the random model at 32 and 64 new tokens; multi-turn runs the model
fine-tuned to call a tool twice and then answer, 3 generations per trajectory, through each
system's own tool loop (TRL `environment_factory`, Tunix's agentic learner, our environment
protocol).

Each system runs in its own process, one at a time, pinned with `taskset` to the same cores
(XLA:CPU and torch then use that many threads): TRL in this interpreter (our test extras pin
trl==1.16.0), Tunix in its own virtual environment (it pins safetensors<0.8, which our
transformers cannot share; created on first use under --cache from
bench/peer_runs/tunix_requirements.txt), ours as a user runs it (`python -m rcgrpo_jax.main`).
Printed per system: the first iteration (compilation/warm-up), the steady-state seconds per
iteration (median of the others) split into rollout and update, generated tokens per second of
rollout, and "ours faster": the peer's seconds per iteration over ours (> 1: ours is faster),
printed only when both generated about the same tokens (within 10%): a ratio over different
work is not one.
Run it on an otherwise idle machine; the header names the CPU and the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "peer_runs"
sys.path.insert(0, str(RUNS))
import build  # noqa: E402
import workload as w  # noqa: E402

from rcgrpo_jax import machine  # noqa: E402

SYSTEMS = ("ours", "trl", "tunix")
RUNNERS = {"ours": "ours_run.py", "trl": "trl_run.py", "tunix": "tunix_run.py"}
TOKEN_TOLERANCE = 0.10  # generated tokens may differ by this much for a ratio to be printed


def tunix_python(cache: Path) -> str:
    """The Tunix venv's python, created (or re-created when the requirements change)."""
    reqs = RUNS / "tunix_requirements.txt"
    env_dir, digest = cache / "tunix", hashlib.sha256(reqs.read_bytes()).hexdigest()
    python, stamp = env_dir / "bin" / "python", env_dir / "requirements.sha256"
    if not (python.exists() and stamp.exists() and stamp.read_text() == digest):
        print(f"creating the Tunix environment in {env_dir} (once)", file=sys.stderr)
        venv.create(env_dir, with_pip=True, clear=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "-r", str(reqs)], check=True)
        stamp.write_text(digest)
    return str(python)


def run_one(system: str, python: str, ckpt: Path, mode: str, max_new: int, iterations: int,
            cpus: str) -> dict:  # fmt: skip
    """One system's run, pinned to `cpus`; its result file as a dict."""
    with tempfile.TemporaryDirectory(prefix=f"peers_{system}_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = ["taskset", "-c", cpus, python, str(RUNS / RUNNERS[system]), "--ckpt", str(ckpt),
               "--mode", mode, "--max-new", str(max_new), "--iterations", str(iterations),
               "--out", str(out)]  # fmt: skip
        threads = str(len(cpus.split(",")))
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(HERE.parent))  # fmt: skip
        proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            return {"system": system, "error": (proc.stderr or proc.stdout)[-2000:]}
        return json.loads(out.read_text())


def summary(result: dict) -> dict | None:
    """First iteration and the steady state (median of the rest) of one result."""
    its = result.get("iterations") or []
    if len(its) < 2:
        return None
    steady = its[1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    total = statistics.median(r["rollout_s"] + r["update_s"] for r in steady)
    tokens = med("generated_tokens")
    return dict(first_s=its[0]["rollout_s"] + its[0]["update_s"], rollout_s=med("rollout_s"),
                update_s=med("update_s"), total_s=total, tokens=tokens,
                tokens_per_s=tokens / med("rollout_s"), generations=med("generations"),
                reward=statistics.fmean(r["mean_reward"] for r in steady))  # fmt: skip


def table(rows: list[tuple[str, dict, dict | None]]) -> list[str]:
    """The printed lines of one workload: each system, and how much faster ours is."""
    ours = next((s for name, _, s in rows if name == "ours" and s), None)
    lines = [f"  {'system':<18}{'first it':>9}{'it (s)':>8}{'rollout':>9}{'update':>8}"
             f"{'tokens':>8}{'gen tok/s':>10}{'gens':>6}  ours faster"]  # fmt: skip
    for name, result, s in rows:
        label = f"{result.get('system', name)} {result.get('version', '')}".strip()
        if s is None:
            why = result.get("error") or result.get("notes") or "no iterations"
            lines.append(f"  {label:<18} did not run: {why.strip().splitlines()[-1][:160]}")
            continue
        ratio = ""
        if ours and name != "ours":
            same = abs(s["tokens"] - ours["tokens"]) <= TOKEN_TOLERANCE * ours["tokens"]
            ratio = f"{s['total_s'] / ours['total_s']:.2f}x" if same else "n/a (other work)"
        lines.append(f"  {label:<18}{s['first_s']:>9.1f}{s['total_s']:>8.2f}{s['rollout_s']:>9.2f}"
                     f"{s['update_s']:>8.2f}{s['tokens']:>8.0f}{s['tokens_per_s']:>10.0f}"
                     f"{s['generations']:>6.0f}  {ratio}")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="single,multi")
    ap.add_argument("--max-new", default="32,64", help="single-turn new-token caps")
    ap.add_argument("--multi-max-new", type=int, default=32, help="per generation, multi-turn")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--iterations", type=int, default=w.ITERATIONS, help="single-turn")
    ap.add_argument("--multi-iterations", type=int, default=4, help="multi-turn (slower)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/rcgrpo_jax/peers")
    ap.add_argument("--json", type=Path, help="write every result here")
    a = ap.parse_args()
    systems = a.systems.split(",")
    cores = sorted(os.sched_getaffinity(0))
    threads = [int(t) for t in a.threads.split(",") if int(t) <= len(cores)]

    ckpt = build.build(a.cache / "ckpt")
    pythons = {"ours": sys.executable, "trl": sys.executable}
    if "tunix" in systems:
        pythons["tunix"] = tunix_python(a.cache)
    cpu, load = machine.cpu_line(machine.cpu()), os.getloadavg()[0]
    print(f"{cpu}, {len(cores)} cores; load average {load:.2f} at start; "
          f"P={w.P} x G={w.G}, temperature {w.TEMPERATURE}, {a.iterations} iterations "
          f"(the first is compile/warm-up)")  # fmt: skip
    workloads = [("single", n) for n in map(int, a.max_new.split(","))] * ("single" in a.modes)
    workloads += [("multi", a.multi_max_new)] * ("multi" in a.modes)
    everything = []
    for mode, max_new in workloads:
        for n in threads:
            cpus = ",".join(map(str, cores[:n]))
            title = (f"{mode}-turn, {max_new} new tokens"
                     + (f" per generation, up to {w.TURNS} generations" if mode == "multi" else "")
                     + f", {n} thread{'s' * (n > 1)}")  # fmt: skip
            rows, iterations = [], a.multi_iterations if mode == "multi" else a.iterations
            for system in systems:
                model = ckpt / ("tool_caller" if mode == "multi" else "random")
                result = run_one(system, pythons[system], model, mode, max_new, iterations, cpus)
                rows.append((system, result, summary(result)))
                everything.append(dict(result, workload=title))
            print(f"\n{title} (load average {os.getloadavg()[0]:.2f})")
            print("\n".join(table(rows)), flush=True)
    print("\nHow each system ran (its runner's notes):")
    notes = {(r.get("system"), r.get("mode")): r.get("notes") for r in everything if r.get("notes")}
    for (system, mode), note in notes.items():
        print(f"  {system}, {mode}-turn: {note}")
    if a.json:
        a.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
