"""Page size and build time of the run report (`rcgrpo_jax.report`) on a synthetic run shaped
like configs/qwen7b.py's: 100 RL iterations of 8 prompts x 8 rollouts, BFCL-like conversations
(a ~4k-token system prompt of tool schemas, 3 user turns, 1-3 calls per assistant step with
their tool outputs), 80 held-out tasks evaluated 6 times, and `logging.report_groups` groups
kept per iteration.

    python bench/report_size.py [--groups=2,4,8] [--iterations=100] [--run=DIR ...]

Prints, per kept-groups setting, the files' size, the page's size and its build time for one
arm's page and for stage `all`'s over `--arms` such arms; `--run` adds real run directories
(e.g. the demo's workdir). Writes only under a temporary directory
(and each `--run` directory's report.html).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from rcgrpo_jax import report

APIS = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)
# 5,000 made-up words: text about as compressible as a model's (gzip ~3x), not a toy's ~10x
_rng = random.Random(1)
WORDS = tuple(
    "".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(3, 10)))
    for _ in range(5000)
)


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def system_prompt(apis: tuple[str, ...], chars: int = 16_000) -> str:
    """A BFCL-like system prompt: the involved APIs' function schemas as JSON, ~`chars`
    characters (~4k tokens), the same for every task with the same APIs."""
    rng = random.Random(hash(apis) % 2**32)
    funcs = []
    while sum(len(json.dumps(f)) for f in funcs) < chars:
        api = rng.choice(apis)
        funcs.append(
            {
                "name": f"{api}.{rng.choice(WORDS)}_{rng.choice(WORDS)}",
                "description": _text(rng, 30),
                "parameters": {
                    "type": "dict",
                    "properties": {
                        rng.choice(WORDS): {"type": "string", "description": _text(rng, 12)}
                        for _ in range(3)
                    },
                    "required": [],
                },
            }
        )
    return "You are an expert in composing functions. " + json.dumps(funcs)


def conversation(rng: random.Random, apis: tuple[str, ...], turns: int = 3) -> list[dict]:
    """One trajectory: system prompt, then per turn a user message and 1-3 assistant steps
    with calls, each followed by its tool outputs, and a closing assistant message."""
    msgs = [{"role": "system", "content": system_prompt(apis)}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": _text(rng, 40)})
        for _ in range(rng.randint(1, 3)):
            calls = [
                f"{rng.choice(WORDS)}(name='{rng.choice(WORDS)}.txt', "
                f"{rng.choice(WORDS)}={rng.randint(0, 999)})"
                for _ in range(rng.randint(1, 3))
            ]
            msgs.append({"role": "assistant", "content": "[" + ", ".join(calls) + "]"})
            for c in calls:
                out = {"result": _text(rng, 25), "status": rng.choice(["ok", "error"])}
                msgs.append({"role": "tool", "name": c.split("(")[0], "content": json.dumps(out)})
        msgs.append({"role": "assistant", "content": _text(rng, 30)})
    return msgs


def _line(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")


def _task(n: int) -> dict[str, str]:
    """Task n's id, category and kind, as trajectories.jsonl and heldout.jsonl name them."""
    return {
        "task_id": f"multi_turn_base_{n}",
        "category": "multi_turn_base",
        "kind": "multi_turn_base",
    }


def write_run(
    workdir: Path,
    iterations: int,
    keep: int,
    prompts: int = 8,
    size: int = 8,
    heldout_tasks: int = 80,
    evaluations: int = 6,
    seed: int = 0,
) -> Path:
    """An RL arm's files of that shape under `workdir`, its draws from `seed`."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    task_apis = lambda i: tuple(sorted(random.Random(i).sample(APIS, 2)))
    with (
        open(workdir / "metrics.jsonl", "w") as m,
        open(workdir / "rollouts.jsonl", "w") as r,
        open(workdir / "trajectories.jsonl", "w") as t,
    ):
        _line(m, {"step": 0, "rollouts": 0, "eval_success": 0.3})
        for it in range(1, iterations + 1):
            rewards = [[float(rng.random() < 0.4) for _ in range(size)] for _ in range(prompts)]
            # per iteration the metrics the page plots, at a 7B run's orders of magnitude
            times = {"rollout_s": 60.0, "update_s": 30.0, "generated_rollouts": prompts * size}
            rates = {"reward_mean": 0.4, "reward_high": 0.5, "reward_low": 0.2, "kl": 0.0}
            noise = {"degenerate_frac": rng.random(), "entropy": rng.random(), "clip_frac": 0.01}
            gaps = {"logp_gap_mean": 1e-3, "logp_gap_max": 1e-2}
            step = {"step": it, "rollouts": it * prompts * size}
            _line(m, {**step, **rates, **noise, **gaps, **times})
            _line(r, {"iteration": it, "rewards": rewards})
            for g in range(min(keep, prompts) if keep >= 0 else prompts):
                task = rng.randrange(720)
                rows = [
                    {
                        "reward_token": rng.choice(["high", "low"]),
                        "reward": rewards[g][j],
                        "state_ok": bool(rewards[g][j]),
                        "action_ok": bool(rewards[g][j]),
                        "error_type": None if rewards[g][j] else "state_mismatch",
                        "env_error": None,
                        "advantage": rng.gauss(0, 1),
                        "truncated": False,
                        "messages": conversation(rng, task_apis(task)),
                    }
                    for j in range(size)
                ]
                group = {"iteration": it, "round": 0, "group": g, "groups_in_iteration": prompts}
                _line(t, {**group, **_task(task), "trained": True, "dropped": False, "rows": rows})
    with open(workdir / "heldout.jsonl", "w") as h:
        for e in range(evaluations):
            it = e * iterations // (evaluations - 1)
            tasks = [
                {
                    **_task(i),
                    "success": rng.random() < 0.3 + 0.05 * e,
                    "error_type": None,
                    "messages": conversation(rng, task_apis(i)),
                }
                for i in range(heldout_tasks)
            ]
            at = {"iteration": it, "trajectories": it * prompts * size}
            _line(h, {**at, "token": "high", "success": 0.3, "tasks": tasks})
    return workdir


def measure(run_dir: Path, out: Path | None = None) -> tuple[float, float, float]:
    """(the run's files in MB, the page in MB, the build's seconds)."""
    files = sum(p.stat().st_size for p in run_dir.rglob("*.jsonl")) / 1e6
    t0 = time.perf_counter()
    page = report.build(run_dir, out)
    return files, page.stat().st_size / 1e6, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", default="1,2,4,8", help="logging.report_groups settings")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--arms", type=int, default=4, help="RL arms of the stage `all` page")
    parser.add_argument("--run", action="append", default=[], help="a real run directory")
    args = parser.parse_args()
    for run in args.run:
        files, page, s = measure(Path(run))
        print(f"{run}: jsonl files {files:.1f} MB, page {page:.1f} MB, built in {s:.1f} s")
    with tempfile.TemporaryDirectory() as tmp:
        for keep in (int(g) for g in args.groups.split(",")):
            # stage `all`'s page over --arms such arms (the first also measured on its own)
            root = Path(tmp) / f"keep{keep}"
            for arm in range(args.arms):
                run = write_run(root / f"arm_{arm}", args.iterations, keep, seed=arm)
                if arm == 0:
                    files, page, s = measure(run)
                    print(
                        f"qwen7b-shaped arm, {args.iterations} iterations, report_groups={keep}:"
                        f" jsonl files {files:.1f} MB, page {page:.1f} MB, built in {s:.1f} s"
                    )
            files, page, s = measure(root)
            print(
                f"  stage all over {args.arms} such arms: jsonl files {files:.1f} MB, "
                f"page {page:.1f} MB, built in {s:.1f} s"
            )


if __name__ == "__main__":
    main()
