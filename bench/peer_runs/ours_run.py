"""rcgrpo_jax's side of bench/peers.py: the workload as a user runs it, `python -m
rcgrpo_jax.main` (stage `grpo`, bench/peer_runs/ours_config.py), then the per-iteration
times, tokens and rewards read back from the run's metrics.jsonl and trajectories.jsonl.

    python bench/peer_runs/ours_run.py --ckpt DIR --mode single|multi --max-new N
        --iterations K --out result.json   (one command line)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as w  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def trajectory_len(ckpt: str, multi_turn: bool, max_new: int) -> int:
    """The train step's T: the longest trajectory the workload can make (the rendered prompt,
    `max_new` per generation, and the tool results between them), as TRL pads to the longest."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    tools = [w.TOOL_DOC] if multi_turn else None

    def length(chat: list[dict], **kwargs) -> int:
        return len(tok.apply_chat_template(chat, tools=tools, **kwargs)["input_ids"])

    chat = w.messages(w.PROMPTS[0], multi_turn)
    longest = max(length(w.messages(p, multi_turn), add_generation_prompt=True) for p in w.PROMPTS)
    total = longest + max_new
    if multi_turn:  # each tool round: the call's end, the tool result, the next generation prompt
        call = {"role": "assistant", "content": w.TOOL_CALL_TEXT}
        result = {"role": "tool", "content": w.tool_result(w.TURNS)}
        added = length([*chat, call, result], add_generation_prompt=True) - length([*chat, call])
        total += (w.TURNS - 1) * (added + 2 + max_new)
    return total


def run(ckpt: str, multi_turn: bool, max_new: int, iterations: int, workdir: Path) -> None:
    overrides = {
        "workdir": workdir, "model.hf_path": ckpt, "rl.steps": iterations,
        "rl.max_new_tokens": max_new, "rl.max_len": trajectory_len(ckpt, multi_turn, max_new),
        "env.peers.multi_turn": multi_turn, "env.max_steps_per_turn": w.TURNS if multi_turn else 1,
    }  # fmt: skip
    cmd = [sys.executable, "-m", "rcgrpo_jax.main", "--config=bench/peer_runs/ours_config.py"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"rcgrpo_jax run failed:\n{out.stderr[-4000:]}")


def records(workdir: Path) -> list[dict]:
    """One `workload.iteration_record` per RL iteration of the run in `workdir`."""
    steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout_s" in s]
    generations: dict[int, int] = {}
    for line in (workdir / "trajectories.jsonl").read_text().splitlines():
        group = json.loads(line)
        turns = sum(m["role"] == "assistant" for r in group["rows"] for m in r["messages"])
        generations[group["iteration"]] = generations.get(group["iteration"], 0) + turns
    return [
        w.iteration_record(s["rollout_s"], s["update_s"], s["sampled_tokens"],
                           s["generated_rollouts"], generations[s["step"]], s["reward_mean"])
        for s in steps
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--mode", choices=("single", "multi"), required=True)
    ap.add_argument("--max-new", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=w.ITERATIONS)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import rcgrpo_jax

    with tempfile.TemporaryDirectory(prefix="peers_ours_") as tmp:
        workdir = Path(tmp) / "run"
        run(os.path.abspath(a.ckpt), a.mode == "multi", a.max_new, a.iterations, workdir)
        recs = records(workdir)
    version = getattr(rcgrpo_jax, "__version__", "dev")
    note = "first iteration includes XLA compilation of the sampler and the train step"
    w.write_result(a.out, "rcgrpo_jax", version, a.mode, a.max_new, recs, note)
    for i, r in enumerate(recs):
        print(f"ours {a.mode} it{i}: rollout {r['rollout_s']:.2f}s update {r['update_s']:.2f}s "
              f"tokens {r['generated_tokens']}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
