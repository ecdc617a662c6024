"""Where a step's time goes on XLA:CPU: per-op times from the JAX profiler, grouped.

    python bench/xla_profile.py [--what train|decode|sft|peers_single|peers_multi|
        peers_multi_whole] [--repeats 5] [--top 20]

`train` is bench/suite.py's train step (fused RC-GRPO step, 2 x 4 x 256 tokens, hidden 256,
4 layers, vocab 1024, f32); `decode` its batch-32 greedy decode (64 tokens); `sft` the tiny
demo's stage-1 step (model, optimizer, batch rows and length from configs/tiny.py);
`peers_single` / `peers_multi` the fused step on bench/peers.py's single-turn (64 new tokens,
as bench/peer_runs/ours_config.py runs it) / multi-turn shapes in the shared-prompt layout
(`peers_multi_whole`: whole rows), bench/shared_prompt.py's batch. The program runs under
`jax.profiler.trace` with XLA:CPU's per-thunk trace events on (`--xla_cpu_enable_xprof_traceme`);
each event is an HLO op of the executed module, joined with its shape and `op_name` metadata
from that module's optimized HLO as XLA dumps it (the JAX primitive and its transforms: `jvp`
forward, `transpose` backward). Printed: wall time per call, the sum of op times (above the wall
when ops run on both threads), the wall split by what was running (a dot: YNNPACK's or XLA's
own; only other ops; nothing: gaps between calls count as nothing), the time per (primitive,
pass) and the slowest ops.
Like `rcgrpo_jax.main`, it runs with glibc's huge-page tunable (`rcgrpo_jax/host_memory.py`):
without it, page faults on each call's fresh temporaries land in whichever op first touches
them, and a stage-1 step takes ~1.5x as long (timed without the profiler).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _program(what: str):
    """(jitted function, args, module name, label) of the program to profile."""
    import jax
    import numpy as np
    from steps import fresh_step

    from rcgrpo_jax import models
    from rcgrpo_jax.config import config_from_file
    from rcgrpo_jax.train.optim import OptimConfig
    from rcgrpo_jax.train.state import make_train_step

    if what == "decode":
        from rcgrpo_jax import sampling

        cfg = models.ModelConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=4,
            num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True, tie_embeddings=False,
        )  # fmt: skip
        params = models.init_params(cfg, jax.random.key(0))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 1024, int(rng.integers(16, 49))).tolist() for _ in range(32)]
        run = lambda: sampling.generate(cfg, params, prompts, 64)
        return run, "jit_decode", "greedy decode, batch 32, 64 new tokens (whole generate call)"
    if what.startswith("peers_"):
        from shared_prompt import model_config, rollouts

        from rcgrpo_jax import rl
        from rcgrpo_jax.data import packing

        cfg = model_config()
        single = what == "peers_single"  # the rendered prompts are ~38 tokens
        objective = None
        if single:  # as bench/peer_runs/ours_config.py runs it: no scan, the head everywhere
            cfg, objective = cfg.replace(scan_layers=False), rl.Objective(clip_high=0.2)
        params = models.init_params(cfg, jax.random.key(0))
        batch = rollouts(8, 8, *((38, 64) if single else (274, 120)), False, cfg.vocab_size)
        if single:
            del batch["loss_index"]
        if not what.endswith("whole"):
            pieces = (batch[k] for k in ("tokens", "segments", "loss_mask"))
            batch = {**batch, **packing.shared_prompts(*pieces)}
        optim = OptimConfig(lr=1e-6, total_steps=100)
        step, state, _ = fresh_step(cfg, params, optim, objective=objective)
        label = f"fused GRPO step, bench/peers.py's {'single' if single else 'multi'}-turn "
        label += "shapes (bench/shared_prompt.py), "
        label += "whole rows" if what.endswith("whole") else "shared prompts"
    elif what == "train":
        import suite

        cfg = models.ModelConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=4,
            num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True, tie_embeddings=False,
            rope_theta=1e6, scan_layers=False,
        )  # fmt: skip
        params = models.init_params(cfg, jax.random.key(0))
        batch = suite.rl_batch(cfg, params, 2, 4, 256)
        step, state, _ = fresh_step(cfg, params, OptimConfig(lr=1e-5, total_steps=100))
        label = "fused RC-GRPO train step, 2 x 4 x 256 tokens, hidden 256, 4 layers"
    else:
        from rcgrpo_jax.stages import setup
        from rcgrpo_jax.train.losses import make_sft_loss

        # the demo's own model and stage-1 optimizer
        config = config_from_file(HERE.parent / "configs" / "tiny.py")
        cfg, params = setup.model_from_config(config)
        steps = int(config.train.warm_start_steps)
        optim = OptimConfig.from_dict(config.train.optim.to_dict(), default_total_steps=steps)
        make = lambda opt, **kw: make_train_step(make_sft_loss(cfg), opt, **kw)
        step, state, _ = fresh_step(cfg, params, optim, make)
        rng = np.random.default_rng(0)
        b, t = int(config.train.batch_size), int(config.train.seq_len)
        batch = {
            "tokens": rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32),
            "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
            "segments": np.ones((b, t), np.int32),
            "loss_mask": (rng.random((b, t)) < 0.1).astype(np.int32),
        }
        label = f"tiny demo's stage-1 (SFT) step, {b} x {t} tokens, hidden {cfg.hidden_size}, "
        label += f"{cfg.num_layers} layers, vocab {cfg.vocab_size}"
    batch = {k: jax.device_put(v) for k, v in batch.items()}
    holder = {"state": state}

    def run():
        holder["state"], m = step(holder["state"], batch)
        return m

    return run, "jit_step_fn", label


def _op_metadata(dump: str, module: str, names: set[str]) -> dict[str, tuple[str, str]]:
    """{op: (shape, op_name)} from the optimized HLO XLA dumped of the module `module`
    (several compiles may share the name: the one that defines most of the traced `names`)."""
    best: dict[str, tuple[str, str]] = {}
    for path in Path(dump).glob(f"*.{module}.cpu_after_optimizations.txt"):
        meta = {}
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", line)
            if m:
                meta[m.group(1)] = (m.group(2), m.group(3))
        if len(names & meta.keys()) > len(names & best.keys()):
            best = meta
    return best


def timeline(events: list[dict], is_dot: list[bool]) -> dict[str, float]:
    """Microseconds of the traced span (first op start to last op end, all calls) with a dot
    (`is_dot[i]`: event i is one) running, with only other ops running, with nothing running,
    and with two or more ops at once: where the step's wall goes, which per-op sums (counted on
    both threads) do not say."""
    edges = sorted((t, d, i) for i, e in enumerate(events)
                   for t, d in ((e["ts"], 1), (e["ts"] + e["dur"], -1)))  # fmt: skip
    out = dict.fromkeys(("a dot running", "only other ops", "nothing", "two ops or more"), 0.0)
    running: set[int] = set()
    last = edges[0][0] if edges else 0.0
    for t, d, i in edges:
        span = t - last
        if any(is_dot[j] for j in running):
            out["a dot running"] += span
        else:
            out["only other ops" if running else "nothing"] += span
        if len(running) >= 2:
            out["two ops or more"] += span
        last = t
        (running.add if d == 1 else running.discard)(i)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    whats = ("train", "decode", "sft", "peers_single", "peers_multi", "peers_multi_whole")
    ap.add_argument("--what", choices=whats, default="train")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_xprof_traceme" not in flags:
        flags = f"{flags} --xla_cpu_enable_xprof_traceme=true".strip()
    # the executed modules' optimized HLO, for each traced op's shape and JAX op_name
    dump = tempfile.mkdtemp(prefix="rcgrpo_hlo_")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    run, module, label = _program(args.what)
    jax.block_until_ready(run())  # compile + warm up
    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t)
    logdir = tempfile.mkdtemp(prefix="rcgrpo_profile_")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(args.repeats):
            jax.block_until_ready(run())
    trace = next(Path(logdir).rglob("perfetto_trace.json.gz"))
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    traced = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    mine = [e for e in traced if e["args"].get("hlo_module", "").startswith(module)]
    meta = _op_metadata(dump, module, {e["name"] for e in mine})
    for folder in (dump, logdir):  # tens of MB of HLO text and trace per run
        shutil.rmtree(folder, ignore_errors=True)
    per_op: collections.Counter[str] = collections.Counter()
    for e in mine:
        per_op[e["name"]] += e["dur"] / 1e3 / args.repeats  # ms per call
    groups: collections.Counter[tuple[str, str]] = collections.Counter()
    for name, ms in per_op.items():
        shape, op = meta.get(name, ("", ""))
        prim = op.rsplit("/", 1)[-1] if op else re.sub(r"[._]\d+$", "", name).split("_")[0]
        groups[(prim, "backward" if "transpose(" in op else "forward")] += ms
    ops = len(traced)
    print(f"# {label}: {best * 1e3:.1f} ms per call (best of {args.repeats}); "
          f"op time {sum(per_op.values()):.1f} ms over {ops / args.repeats:.0f} ops per call; "
          f"jax {jax.__version__}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}")  # fmt: skip
    # a dot: YNNPACK's fusions and XLA's own dot ops (named after the transpose they came from)
    is_dot = [e["name"].startswith(("dot", "ynn_fusion")) for e in mine]
    wall = timeline(mine, is_dot)
    print("# wall per call, from the trace's op intervals: "
          + ", ".join(f"{k} {v / 1e3 / args.repeats:.1f} ms" for k, v in wall.items()))  # fmt: skip
    print("\n| primitive | pass | ms per call | share |\n|---|---|---|---|")
    total = sum(groups.values()) or 1.0
    for (prim, side), ms in groups.most_common(args.top):
        print(f"| {prim} | {side} | {ms:.2f} | {ms / total:.0%} |")
    print("\n| op | ms per call | shape | op_name |\n|---|---|---|---|")
    for name, ms in per_op.most_common(args.top):
        shape, op = meta.get(name, ("", ""))
        print(f"| {name} | {ms:.2f} | {shape} | {op} |")
    return 0


if __name__ == "__main__":
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # as rcgrpo_jax.main runs
    sys.exit(main())
