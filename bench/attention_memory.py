"""Peak memory and step time of the fused RL step against T, `dense` vs `flash` attention (CPU).

    python bench/attention_memory.py [--lengths 1024,2048,4096,8192,16384] [--kinds dense,flash]
        [--budget-gib 12] [--hidden 64] [--layers 2] [--vocab 512] [--prompts 1] [--group 2]
        [--remat full] [--steps 2] [--json out.json]

For every (kind, T) a fresh process builds a small random Qwen2-shaped model (`model.attention`
set to the kind), the fused RC-GRPO step (`rl.train_step.make_rl_step`, AdamW, the 7B configs'
`remat`) and a [P, G, T] batch of full-length rows (a prompt, then assistant spans under the loss
mask), AOT-compiles the step and reads the compiler's memory analysis. Where the compiled
temporaries exceed `--budget-gib` the kind is not run at that T (the table says so); otherwise
one warm-up step and `--steps` timed steps run, and the process reports its peak RSS over those
steps above its RSS just before the first (the kernel's high-water mark is reset with
/proc/self/clear_refs after the compile, so compile-time memory is not counted). A fresh
process per row keeps each high-water mark its own. The vocabulary is small on purpose: the
chunked head's memory does not grow with T beyond its [B, T, E] inputs, so what grows is the
attention's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GIB = 2**30
MIB = 2**20


def _status(key: str) -> float:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1]) * 1024
    return float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def child(a: argparse.Namespace) -> dict:
    """One (kind, T) row, in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rcgrpo_jax import models
    from rcgrpo_jax.config import base_config
    from rcgrpo_jax.envs.reward_tokens import LOW
    from rcgrpo_jax.rl.losses import objective_from_config
    from rcgrpo_jax.train.optim import OptimConfig

    t, kind = a.length, a.kind
    heads = a.heads
    cfg = models.ModelConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_layers=a.layers, num_heads=heads, num_kv_heads=a.kv_heads,
        head_dim=a.hidden // heads, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=max(t, 4096), rope_theta=1e6, remat=a.remat, attention=kind,
    )  # fmt: skip
    from steps import compile_step, fresh_step

    params = models.init_params(cfg, jax.random.key(0))
    objective = objective_from_config(base_config().rl)
    step, state, mesh = fresh_step(cfg, params, OptimConfig(lr=1e-6), objective=objective)

    rng = np.random.default_rng(0)
    p, g = a.prompts, a.group
    shape = (p, g, t)
    mask = np.zeros(shape, np.float32)
    for i in range(p):
        for j in range(g):
            s = int(rng.integers(t // 4, t // 2))  # the prompt, then assistant spans + tool text
            while s < t:
                n = int(rng.integers(8, 33))
                mask[i, j, s : s + n] = 1.0
                s += n + int(rng.integers(4, 17))
    batch = {
        "tokens": rng.integers(1, a.vocab, shape).astype(np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), shape).copy(),
        "segments": np.ones(shape, np.int32),
        "loss_mask": mask,
        # near log(1/V) as a random model gives, so ratios stay near 1
        "old_logprobs": np.where(
            mask > 0, -np.log(a.vocab) + rng.normal(0, 0.2, shape), 0.0
        ).astype(np.float32),
        "rewards": np.tile(np.array([1.0, 0.0] * g, np.float32)[:g], (p, 1)),
        "reward_token": np.full((p, g), LOW, np.int32),
    }
    compiled, batch, compile_s, mem = compile_step(step, state, batch, mesh)
    temp = float(mem.temp_size_in_bytes)
    out = {
        "kind": kind, "T": t, "rows": p * g, "temp_bytes": temp,
        "arg_bytes": float(mem.argument_size_in_bytes),
        "out_bytes": float(mem.output_size_in_bytes), "compile_s": compile_s,
        "resolved": models.attention.resolve(
            kind, backend=jax.default_backend(), self_attn=True, kv_len=t,
            head_dim=cfg.head_dim, dtype=jnp.dtype(cfg.dtype),
        ),
    }  # fmt: skip
    if temp > a.budget_gib * GIB:
        out["skipped"] = f"compiled temp {temp / GIB:.1f} GiB > budget {a.budget_gib:g} GiB"
        return out
    base = _status("VmRSS")  # after the compile, before the first execution
    reset = _reset_peak()
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(a.steps):
        s = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - s)
    peak = _status("VmHWM")
    out.update(
        step_s=float(np.median(times)), loss=float(m["loss"]), base_rss=base, peak_rss=peak,
        peak_above_base=peak - base if reset else float("nan"),
    )  # fmt: skip
    return out


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _fmt_mib(x: float | None) -> str:
    return "—" if x is None or x != x else f"{x / MIB:,.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a != a or b != b or not b:
        return "—"
    return f"{a / b:.2f}×"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--kinds", default="dense,flash")
    ap.add_argument("--budget-gib", type=float, default=12.0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=1, help="P")
    ap.add_argument("--group", type=int, default=2, help="G")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="flash", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=1024, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0

    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, *sys.argv])  # as rcgrpo_jax.main runs
    lengths = [int(x) for x in a.lengths.split(",")]
    kinds = a.kinds.split(",")
    load0 = _load()
    print(
        f"# attention memory bench, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"load average {load0}"
    )
    print(
        f"# model: hidden {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} heads, vocab "
        f"{a.vocab}, f32, remat={a.remat}; batch P={a.prompts} x G={a.group} rows of T tokens; "
        f"budget {a.budget_gib:g} GiB",
        flush=True,
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device
    rows: dict[tuple[str, int], dict] = {}
    t_start = time.perf_counter()
    for t in lengths:
        for kind in kinds:
            cmd = [
                sys.executable, __file__, "--child", "--kind", kind, "--length", str(t),
                "--budget-gib", str(a.budget_gib), "--hidden", str(a.hidden),
                "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
                "--vocab", str(a.vocab), "--prompts", str(a.prompts), "--group", str(a.group),
                "--remat", a.remat, "--steps", str(a.steps),
            ]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            got = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not got:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                r = {"kind": kind, "T": t, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
            else:
                r = json.loads(got[-1][len("RESULT ") :])
            r["load"] = _load()
            rows[kind, t] = r
            what = (
                r.get("error")
                or r.get("skipped")
                or (
                    f"step {r['step_s']:.2f} s, peak +{_fmt_mib(r['peak_above_base'])} MiB, "
                    f"compile {r['compile_s']:.1f} s"
                )
            )
            temp = _fmt_mib(r.get("temp_bytes"))
            print(f"  {kind:>6} T={t:>6}: compiled temp {temp} MiB; {what}", flush=True)

    head = ["T"]
    for kind in kinds:
        head += [f"{kind} temp MiB", f"{kind} peak RSS MiB", f"{kind} step s"]
    if "dense" in kinds and "flash" in kinds:
        head += ["dense/flash temp", "dense/flash step"]
    for kind in kinds:
        head += [f"{kind} temp vs T/2"]
    table = []
    for i, t in enumerate(lengths):
        row = [f"{t:,}"]
        for kind in kinds:
            r = rows[kind, t]
            if "error" in r:
                row += ["error", "—", "—"]
                continue
            ran = "skipped" not in r
            row += [
                _fmt_mib(r["temp_bytes"]),
                _fmt_mib(r["peak_above_base"]) if ran else "not run (> budget)",
                f"{r['step_s']:.2f}" if ran else "—",
            ]
        if "dense" in kinds and "flash" in kinds:
            d, f = rows["dense", t], rows["flash", t]
            row += [
                _ratio(d.get("temp_bytes"), f.get("temp_bytes")),
                _ratio(d.get("step_s"), f.get("step_s")),
            ]
        for kind in kinds:
            prev = rows.get((kind, lengths[i - 1])) if i else None
            row += [_ratio(rows[kind, t].get("temp_bytes"), prev and prev.get("temp_bytes"))]
        table.append(row)
    widths = [max(len(str(r[c])) for r in [head, *table]) for c in range(len(head))]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True))
    print()
    print(line(head) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table:
        print(line(r) + " |")
    wall = time.perf_counter() - t_start
    print(
        f"\npeak RSS = the process's high-water mark over the steps above its RSS after the "
        f"compile; temp = XLA's compiled temporaries (memory_analysis). Wall {wall:.0f} s; load "
        f"average at start {load0}, at end {_load()}."
    )
    flash = [rows["flash", t].get("temp_bytes") for t in lengths] if "flash" in kinds else []
    ok = True
    if len(flash) >= 2 and all(x for x in flash):
        # linear: doubling T at most ~doubles the temporaries (2.3x allows fixed-size parts)
        worst = max(flash[i + 1] / flash[i] for i in range(len(flash) - 1))
        ok = worst <= 2.3
        print(f"flash temp growth per doubling of T: at most {worst:.2f}x -> linear: {ok}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"rows": [rows[k, t] for t in lengths for k in kinds]}, indent=1) + "\n"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
