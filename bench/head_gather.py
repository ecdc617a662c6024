"""The fused RL step with the LM head over all T positions vs only the loss's (`loss_index`).

    python bench/head_gather.py [--quick] [--prompt 4096] [--sampled 512] [--rows 2]
        [--vocab 152064] [--hidden 256] [--layers 2] [--steps 3] [--json out.json]

A BFCL-shaped batch: P = 1 prompt x G = `--rows` rollouts of T = prompt + sampled tokens, the
sampled ones last and under the loss mask, over a small random Qwen2-shaped model (f32, tied
embeddings) with Qwen2.5's vocabulary. At this width the head ([B, T, E] @ [E, 152064]) is the
largest single cost, and the loss reads only K = `data.packing.loss_index`'s bucket of the
sampled count of its T - 1 targets. Both variants run the same step (`rl.train_step.make_rl_step`,
AdamW, the configs' objective) on the same batch, one with `loss_index`, one without; each is
AOT-compiled (its memory: XLA's `memory_analysis`, temporaries + arguments + outputs), run once
to warm up, then `--steps` times (the median is reported). The two first-step losses must agree.
`--quick` is a small shape for checking that the bench runs, not for timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MIB = 2**20
QUICK = dict(prompt=192, sampled=64, vocab=8192, hidden=64, steps=1)


def rl_batch(rows: int, prompt: int, sampled: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """[1, rows, prompt + sampled] rollouts: the prompt, then `sampled` tokens under the loss."""
    import numpy as np

    from rcgrpo_jax.envs.reward_tokens import LOW

    t = prompt + sampled
    rng = np.random.default_rng(seed)
    shape = (1, rows, t)
    mask = np.zeros(shape, np.int32)
    mask[..., prompt:] = 1
    return {
        "tokens": rng.integers(1, vocab, shape).astype(np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), shape).copy(),
        "segments": np.ones(shape, np.int32),
        "loss_mask": mask,
        # near log(1/V) as a random model gives, so ratios stay near 1
        "old_logprobs": np.where(mask > 0, -np.log(vocab) + rng.normal(0, 0.2, shape), 0.0).astype(
            np.float32
        ),
        "rewards": np.tile(np.array([1.0, 0.0] * rows, np.float32)[:rows], (1, 1)),
        "reward_token": np.full((1, rows), LOW, np.int32),
    }


def measure(cfg, batch: dict[str, Any], steps: int) -> dict[str, float]:
    """Compiled memory and median step time of a fresh state's fused RL step on `batch`."""
    import jax
    import numpy as np
    from steps import compile_step, fresh_step

    from rcgrpo_jax import models
    from rcgrpo_jax.config import base_config
    from rcgrpo_jax.rl.losses import objective_from_config
    from rcgrpo_jax.train.optim import OptimConfig

    params = models.init_params(cfg, jax.random.key(0))
    objective = objective_from_config(base_config().rl)
    step, state, mesh = fresh_step(cfg, params, OptimConfig(lr=1e-6), objective=objective)
    compiled, batch, compile_s, mem = compile_step(step, state, batch, mesh)
    state, m = compiled(state, batch)  # warm-up
    loss = float(m["loss"])
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - s)
    temp, arg = float(mem.temp_size_in_bytes), float(mem.argument_size_in_bytes)
    out = float(mem.output_size_in_bytes)
    return {
        "step_s": float(np.median(times)), "compile_s": compile_s, "loss": loss,
        "temp_bytes": temp, "arg_bytes": arg, "out_bytes": out, "total_bytes": temp + arg + out,
    }  # fmt: skip


def table(full: dict[str, float], gathered: dict[str, float], t: int, k: int) -> list[str]:
    """The side-by-side markdown table, with full / gathered ratios."""
    cols = [
        ("step s", "step_s", lambda x: f"{x:.3f}"),
        ("temp MiB", "temp_bytes", lambda x: f"{x / MIB:,.0f}"),
        ("argument MiB", "arg_bytes", lambda x: f"{x / MIB:,.0f}"),
        ("output MiB", "out_bytes", lambda x: f"{x / MIB:,.0f}"),
        ("total MiB", "total_bytes", lambda x: f"{x / MIB:,.0f}"),
    ]
    ratio = lambda a, b: f"{a / b:.2f}×" if b else "—"
    rows = [
        ["head", "positions", *(c[0] for c in cols)],
        ["full", f"{t - 1:,}", *(f(full[key]) for _, key, f in cols)],
        ["gathered", f"{k:,}", *(f(gathered[key]) for _, key, f in cols)],
        ["full / gathered", ratio(t - 1, k), *(ratio(full[c], gathered[c]) for _, c, _ in cols)],
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) + " |"
    return [
        line(rows[0]),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *map(line, rows[1:]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a small check: {QUICK}")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--sampled", type=int, default=512)
    ap.add_argument("--rows", type=int, default=2, help="G rollouts of one prompt")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.quick:
        for key, value in QUICK.items():
            setattr(a, key, value)

    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.data.packing import loss_index

    heads = max(1, a.hidden // 64)
    t = a.prompt + a.sampled
    cfg = models.ModelConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
        num_layers=a.layers, num_heads=heads, num_kv_heads=1 if heads == 1 else 2,
        head_dim=a.hidden // heads, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=max(t, 4096), rope_theta=1e6,
    )  # fmt: skip
    batch = rl_batch(a.rows, a.prompt, a.sampled, a.vocab)
    index = loss_index(batch["loss_mask"])
    print(
        f"# head gather bench, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node()}, {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{os.cpu_count()} cores, load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"# model: hidden {a.hidden}, {a.layers} layers, {heads} heads, vocab {a.vocab:,}, f32; "
        f"batch 1 x {a.rows} rows of T = {a.prompt} prompt + {a.sampled} sampled = {t} tokens, "
        f"K = {index.shape[-1]}; {a.steps} timed steps",
        flush=True,
    )
    full = measure(cfg, batch, a.steps)
    gathered = measure(cfg, {**batch, "loss_index": index}, a.steps)
    same = abs(full["loss"] - gathered["loss"]) <= 1e-5 * max(1.0, abs(full["loss"]))
    print()
    print("\n".join(table(full, gathered, t, index.shape[-1])))
    print(
        f"\nfirst-step loss: full {full['loss']:.7g}, gathered {gathered['loss']:.7g} "
        f"({'equal' if same else 'DIFFERENT'}); compile s: full {full['compile_s']:.1f}, "
        f"gathered {gathered['compile_s']:.1f}"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": vars(a), "full": full, "gathered": gathered}, indent=1) + "\n"
        )
    return 0 if same else 1


if __name__ == "__main__":
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # as rcgrpo_jax.main runs
    sys.exit(main())
