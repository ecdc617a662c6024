"""The fused RL train step under LoRA beside full fine-tuning: XLA's memory and the step time.

    python bench/lora_step.py [--rank 8] [--repeats 10] [--hidden 64]

At the demo's shapes (configs/tiny.py: its model, one update's P x G x T = 4 x 8 x 384 rollout
batch, f32) on one CPU device: both steps are compiled ahead of time for their memory (XLA's
buffer assignment: arguments, temporaries) and then timed in turn, `--repeats` times each, the
best of each reported with the ratio. `--hidden` widens the model (intermediate 4x), to see
where the adapters' extra matmuls stop costing more than the skipped weight gradients save.
The qwen7b-shape comparison is the planner's (`python -m rcgrpo_jax.tools.plan`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _steps(cfg, params, rank: int, batch):
    """{"full": (run, memory), "lora": (run, memory)}: each a function running one more step."""
    import jax
    from suite import train_settings

    from rcgrpo_jax import models
    from rcgrpo_jax.models import lora
    from rcgrpo_jax.rl.train_step import make_rl_step
    from rcgrpo_jax.train.optim import make_optimizer
    from rcgrpo_jax.train.state import init_train_state, shard_batch, state_shardings

    objective, optim_cfg = train_settings()
    mesh = models.make_mesh((1, 1, 1), jax.devices()[:1])
    v = cfg.vocab_size
    spec = models.LoraSpec(rank, 2.0 * rank, token_ids=(v - 2, v - 1))
    specs = {"full": cfg, "lora": cfg.replace(lora=spec)}
    out = {}
    for name, c in specs.items():
        whole = params if c.lora is None else lora.init_lora(c, params, jax.random.key(1))
        trainable, frozen = lora.split(c, whole)
        optimizer = make_optimizer(optim_cfg)
        psh = lora.split(c, models.param_shardings(c, mesh))[0]
        state = init_train_state(trainable, optimizer, 0, mesh=mesh, param_shardings=psh)
        shardings = state_shardings(optimizer, psh, mesh, trainable)
        frozen = frozen or None
        step = make_rl_step(c, objective, optimizer, mesh=mesh, shardings=shardings, frozen=frozen)
        jbatch = shard_batch(batch, mesh)
        with models.use_mesh(mesh):
            memory = step.jitted.lower(state, frozen, jbatch).compile().memory_analysis()
        state, m = step(state, jbatch)  # compiles (the jit's own cache)
        holder = {"state": state}

        def run(step=step, holder=holder, jbatch=jbatch) -> None:
            holder["state"], metrics = step(holder["state"], jbatch)
            jax.block_until_ready(metrics["loss"])

        out[name] = (run, memory, float(m["loss"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=0, help="model width (0: the demo's)")
    args = ap.parse_args(argv)

    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, *sys.argv])
    from suite import rl_batch

    from rcgrpo_jax import machine
    from rcgrpo_jax.config import config_from_file
    from rcgrpo_jax.stages import setup

    config = config_from_file(HERE.parent / "configs" / "tiny.py")
    if args.hidden:
        config.model.arch.hidden_size = args.hidden
        config.model.arch.intermediate_size = 4 * args.hidden
        config.model.arch.head_dim = args.hidden // config.model.arch.num_heads
    cfg, params = setup.model_from_config(config)
    p = int(config.rl.num_prompts) // int(config.rl.minibatches)
    g, t = int(config.rl.group_size), int(config.rl.max_len)
    batch = rl_batch(cfg, params, p, g, t)
    steps = _steps(cfg, params, args.rank, batch)
    best = {name: float("inf") for name in steps}
    for _ in range(args.repeats):  # in turn, so that both see the same machine
        for name, (run, _, _) in steps.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    model = f"{cfg.num_layers}L/{cfg.hidden_size} ({cfg.num_params():,} params)"
    print(
        f"# {machine.one_line(machine.describe())}; model {model}, batch {p} x {g} x {t}, "
        f"f32, LoRA rank {args.rank} on all projections; best of {args.repeats} steps each"
    )
    print("| step | trainable params | arguments MiB | temporaries MiB | ms per step |")
    print("|---|---|---|---|---|")
    for name, (_, mem, _) in steps.items():
        n = cfg.num_params() if name == "full" else _lora_count(cfg, args.rank)
        print(f"| {name} | {n:,} | {mem.argument_size_in_bytes / 2**20:.1f} | "
              f"{mem.temp_size_in_bytes / 2**20:.1f} | {best[name] * 1e3:.1f} |")  # fmt: skip
    print(f"LoRA / full step time: {best['lora'] / best['full']:.2f}")
    return 0


def _lora_count(cfg, rank: int) -> int:
    from rcgrpo_jax import models

    v = cfg.vocab_size
    spec = models.LoraSpec(rank, 2.0 * rank, token_ids=(v - 2, v - 1))
    return models.weights.num_lora_params(cfg.replace(lora=spec))


if __name__ == "__main__":
    sys.exit(main())
