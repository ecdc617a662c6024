"""XLA:CPU's dot paths side by side: YNNPACK (XLA's default), Eigen, XNNPACK and oneDNN.

    python bench/dot_paths.py [--repeats 5] [--rounds 2] [--paths ynnpack,eigen,...]

Which path is fastest decides how we compile: `sampling.core.decode` takes XLA's default
(docs/benchmarks.md has the history), and a path that beat the default at the train step's
GEMMs (on an Intel Xeon torch's MKL/oneDNN GEMMs outrun XLA's) would be turned on for CPU runs.
Each path runs in its own child process (XLA_FLAGS differ), the paths alternating for `--rounds`
rounds, one at a time:
- a 2048 x 2048 f32 matmul;
- bench/suite.py's train step (fused RC-GRPO step + AdamW, 2 x 4 x 256 tokens, hidden 256);
- a loop of 200 x ([32, 256] @ [256, 1024] @ [1024, 256]) under `lax.fori_loop`;
- `sampling.generate`, greedy, 64 new tokens, batch 8 and 32, on bench/suite.py's model (hidden
  256, 4 layers) and on the tiny demo's (hidden 64, 3 layers).
Printed: per row, each path's best time and its ratio to the first path's (YNNPACK by default;
> 1: the first is faster), and the train step's first loss per path (a path must not change the
arithmetic beyond rounding).
A path XLA cannot compile is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="  # YNNPACK's dot fusions off
PATHS = {
    "ynnpack": "",
    "eigen": NO_YNN,
    "xnnpack": f"{NO_YNN} --xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_fusion_type=dot",
    "onednn": f"{NO_YNN} --xla_cpu_use_onednn=true",
    "onednn_fusion": (
        f"{NO_YNN} --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"
    ),
}
MODELS = {  # name: (hidden, layers, heads, head_dim), the suite's and configs/tiny.py's shapes
    "suite": (256, 4, 8, 32),
    "demo": (64, 3, 4, 16),
}
LOSS = "train step's first loss"


def _best(fn, repeats: int) -> float:
    """Best seconds of `fn` run to completion, after one call that compiles and warms up."""
    import jax
    from sampler import best_times_interleaved

    return best_times_interleaved((lambda: jax.block_until_ready(fn()),), repeats)[0][0]


def model_config(models, name: str):
    """`MODELS[name]` as a ModelConfig (vocab 1024, layers unrolled as the suite's train step)."""
    hidden, layers, heads, head_dim = MODELS[name]
    return models.ModelConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=2, head_dim=head_dim, qkv_bias=True, tie_embeddings=False,
        scan_layers=False,
    )  # fmt: skip


def child(repeats: int) -> dict[str, float]:
    """Seconds per row, in this process's XLA_FLAGS."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    import suite

    from rcgrpo_jax import models, sampling

    out = {"matmul, f32 2048 x 2048": 2 * 2048**3 / suite.jax_peak(2048, jnp.float32, repeats)}
    cfg = model_config(models, "suite")
    params = models.init_params(cfg, jax.random.key(0))
    batch = suite.rl_batch(cfg, params, 2, 4, 256)
    train, out[LOSS], _ = suite.ours_train(cfg, params, batch, *suite.train_settings())
    out["train step, 2 x 4 x 256 tokens, suite's model"] = _best(train, repeats)
    w1 = jax.random.normal(jax.random.key(0), (256, 1024)) / 16
    w2 = jax.random.normal(jax.random.key(1), (1024, 256)) / 32
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, h: jnp.tanh(h @ w1 @ w2), x))
    x = jnp.ones((32, 256))
    out["GEMM loop, 200 x [32,256]@[256,1024]@[1024,256]"] = _best(lambda: loop(x), repeats)
    rng = np.random.default_rng(0)
    for name in MODELS:
        cfg = model_config(models, name)
        params = models.init_params(cfg, jax.random.key(0))
        for bsz in (8, 32):
            lens = rng.integers(16, 49, bsz)
            prompts = [rng.integers(1, 1024, int(n)).tolist() for n in lens]
            run = lambda p=prompts: sampling.generate(cfg, params, p, 64).tokens  # noqa: B023
            out[f"greedy decode, {name}'s model, batch {bsz}"] = _best(run, repeats)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.repeats)))
        return 0
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        ap.error(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(PATHS)}")
    best: dict[str, dict[str, float]] = {p: {} for p in paths}
    failed: dict[str, str] = {}
    base = os.environ.get("XLA_FLAGS", "")
    for _ in range(args.rounds):
        for path in paths:
            if path in failed:
                continue
            env = {**os.environ, "XLA_FLAGS": f"{base} {PATHS[path]}".strip()}
            env["JAX_PLATFORMS"] = "cpu"
            cmd = [sys.executable, __file__, "--child", f"--repeats={args.repeats}"]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                failed[path] = (res.stderr.strip().splitlines() or ["no output"])[-1][-160:]
                continue
            for row, s in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[path][row] = s if row == LOSS else min(best[path].get(row, float("inf")), s)
    print(f"# XLA_FLAGS={base!r}; best of {args.repeats} x {args.rounds} rounds per path")
    for path, why in failed.items():
        print(f"# {path} ({PATHS[path]}): failed: {why}")
    ok = [p for p in paths if p not in failed]
    if not ok:
        return 1
    ref = ok[0]
    head = [f"{p} ms" for p in ok] + [f"{p} / {ref}" for p in ok[1:]]
    print(f"\n| row | {' | '.join(head)} |\n" + "|---" * (1 + len(head)) + "|")
    for row in best[ref]:
        if row == LOSS:
            continue
        ms = " | ".join(f"{best[p][row] * 1e3:.1f}" for p in ok)
        rel = "".join(f" | {best[p][row] / best[ref][row]:.2f}x" for p in ok[1:])
        print(f"| {row} | {ms}{rel} |")
    print(f"\n{LOSS}: " + ", ".join(f"{p} {best[p][LOSS]:.8f}" for p in ok))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # as rcgrpo_jax.main runs
    sys.exit(main())
