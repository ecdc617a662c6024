"""XLA:CPU's dot paths at the sampler's shapes: YNNPACK (XLA's default) against Eigen.

    python bench/dot_paths.py [--repeats 5] [--rounds 2]

Which path is faster at decode's small-M GEMMs decides how `sampling.core.decode` is compiled
(it takes XLA's default; docs/benchmarks.md has the history). Each setting runs in its own
child process (XLA_FLAGS differ), the two alternating for `--rounds` rounds, one at a time:
- a loop of 200 x ([32, 256] @ [256, 1024] @ [1024, 256]) under `lax.fori_loop`;
- `sampling.generate`, greedy, 64 new tokens, batch 8 and 32, on bench/suite.py's model (hidden
  256, 4 layers) and on the tiny demo's (hidden 64, 3 layers).
Printed: per row, the best time of each setting and Eigen / YNNPACK (> 1: YNNPACK faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EIGEN = "--xla_cpu_experimental_ynn_fusion_type="  # YNNPACK's dot fusions off: Eigen's GEMMs
SETTINGS = {"ynnpack": "", "eigen": EIGEN}
MODELS = {  # name: (hidden, layers, heads, head_dim), the suite's and configs/tiny.py's shapes
    "suite": (256, 4, 8, 32),
    "demo": (64, 3, 4, 16),
}


def _best(fn, repeats: int) -> float:
    """Best seconds of `fn` run to completion, after one call that compiles and warms up."""
    import jax
    from sampler import best_times_interleaved

    return best_times_interleaved((lambda: jax.block_until_ready(fn()),), repeats)[0][0]


def child(repeats: int) -> dict[str, float]:
    """Seconds per row, in this process's XLA_FLAGS."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    from rcgrpo_jax import models, sampling

    out = {}
    w1 = jax.random.normal(jax.random.key(0), (256, 1024)) / 16
    w2 = jax.random.normal(jax.random.key(1), (1024, 256)) / 32
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, h: jnp.tanh(h @ w1 @ w2), x))
    x = jnp.ones((32, 256))
    out["GEMM loop, 200 x [32,256]@[256,1024]@[1024,256]"] = _best(lambda: loop(x), repeats)
    rng = np.random.default_rng(0)
    for name, (hidden, layers, heads, head_dim) in MODELS.items():
        cfg = models.ModelConfig(
            vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=2, head_dim=head_dim, qkv_bias=True,
            tie_embeddings=False,
        )  # fmt: skip
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
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.repeats)))
        return 0
    best: dict[str, dict[str, float]] = {s: {} for s in SETTINGS}
    base = os.environ.get("XLA_FLAGS", "")
    for _ in range(args.rounds):
        for setting, flag in SETTINGS.items():
            env = {**os.environ, "XLA_FLAGS": f"{base} {flag}".strip(), "JAX_PLATFORMS": "cpu"}
            cmd = [sys.executable, __file__, "--child", f"--repeats={args.repeats}"]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for row, s in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[setting][row] = min(best[setting].get(row, float("inf")), s)
    print(f"# XLA_FLAGS={base!r}; best of {args.repeats} x {args.rounds} rounds per setting\n")
    print("| row | YNNPACK (default) ms | Eigen ms | Eigen / YNNPACK |\n|---|---|---|---|")
    for row, t_y in best["ynnpack"].items():
        t_e = best["eigen"][row]
        print(f"| {row} | {t_y * 1e3:.1f} | {t_e * 1e3:.1f} | {t_e / t_y:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # as rcgrpo_jax.main runs
    sys.exit(main())
