"""Peak host memory while loading a ~1 GB checkpoint with `models.load_hf`.

Writes a random Qwen2-shaped f32 checkpoint (`--layers 12` ≈ 1.07 GB), then loads it in a fresh
process and reports peak RSS above the post-import baseline, next to the size of the params.
On the CPU backend the loaded params themselves live in host memory, so the figure that shows
streaming is the *transient* overhead: peak − baseline − params.

    python bench/load_rss.py [--layers 12] [--dir /tmp/rcgrpo_rss_ckpt]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(path: str, mesh: str) -> None:
    import jax

    from rcgrpo_jax import models

    base = _rss_mb()
    t0 = time.perf_counter()
    m = None if mesh == "none" else models.make_mesh(tuple(int(x) for x in mesh.split("x")))
    cfg, params = models.load_hf(path, mesh=m)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "mesh": mesh,
                "baseline_mb": base,
                "peak_mb": peak,
                "params_mb": nbytes / 2**20,
                "transient_mb": peak - base - nbytes / 2**20,
                "seconds": dt,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default="/tmp/rcgrpo_rss_ckpt")
    ap.add_argument("--child", default="")
    ap.add_argument("--mesh", default="none")
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.mesh)
        return
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        import jax

        from rcgrpo_jax import models

        cfg = models.ModelConfig(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=4096,
            num_layers=a.layers,
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
            qkv_bias=True,
        )
        models.save_hf(a.dir, cfg, models.init_params(cfg, jax.random.key(0)))
    size = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir)) / 2**20
    print(f"checkpoint: {a.dir} ({size:.0f} MB on disk)")
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    cols = ("mesh", "baseline MB", "peak MB", "params MB", "transient MB", "s")
    print(" ".join(f"{c:>{w}}" for c, w in zip(cols, (8, 12, 9, 10, 13, 6), strict=True)))
    for mesh in ("none", "1x8x1", "1x2x4"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", a.dir, "--mesh", mesh],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"{mesh:>8} {r['baseline_mb']:12.0f} {r['peak_mb']:9.0f} {r['params_mb']:10.0f} "
            f"{r['transient_mb']:13.0f} {r['seconds']:6.1f}"
        )


if __name__ == "__main__":
    main()
