"""The RL update with each group's prompt run once (`rl.share_prompt`) vs once per rollout.

    python bench/shared_prompt.py [--prompt 274] [--rest 120] [--groups 8] [--group-size 8]
        [--conditioned] [--steps 3]

One loss-and-gradient program (`rl.policy_loss`, dapo, the head at the loss tokens) over the
same [P, G, T] rollouts, laid out whole and in the shared-prompt layout
(`data.packing.shared_prompts`), on bench/peers.py's model shape (a tiny Qwen2: hidden 256,
4 layers, 4 heads, 2 KV heads, intermediate 1024, 1,024-token vocabulary, float32). Each group
has one prompt of about `--prompt` tokens (two with `--conditioned`: RC-GRPO's reward token is
part of the prompt) and rollouts of about `--rest` more, 3 of every 4 sampled. Each layout is
compiled, run once to warm up, then `--steps` times; the medians and their ratio are printed
with the CPU, and the two losses must agree. The defaults are the multi-turn peers workload's
(a 274-token prompt, ~120 tokens of three generations and two tool results); the single-turn
one is `--prompt 37 --rest 34`. Pin it (`taskset -c 0`) to compare thread counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rollouts(p: int, g: int, prompt: int, rest: int, conditioned: bool, vocab: int, seed: int = 0):
    """[P, G, T] rollouts of ragged prompts and rests, with the losses' keys."""
    import numpy as np

    from rcgrpo_jax.data import packing

    rng = np.random.default_rng(seed)
    t = prompt + rest + 1
    tokens, segments, mask = (np.zeros((p, g, t), np.int32) for _ in range(3))
    for i in range(p):
        shared = rng.integers(3, vocab, prompt - int(rng.integers(0, 8)))
        for j in range(g):
            head = np.concatenate([[1 + (j % 2 if conditioned else 0)], shared])
            n = len(head) + rest - int(rng.integers(0, 10))
            tokens[i, j, :n] = np.concatenate([head, rng.integers(3, vocab, n - len(head))])
            segments[i, j, :n] = 1
            mask[i, j, len(head) : n] = np.arange(n - len(head)) % 4 < 3
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape).copy(),
        "segments": segments,
        "loss_mask": mask,
        "old_logprobs": np.where(mask > 0, -np.log(vocab), 0.0).astype(np.float32),
        "rewards": rng.random((p, g)).astype(np.float32),
        "loss_index": packing.loss_index(mask),
    }


def model_config():
    """bench/peers.py's model shape (bench/peer_runs/build.py)."""
    from rcgrpo_jax import models

    return models.ModelConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, qkv_bias=True, tie_embeddings=True,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=274, help="tokens per prompt (about)")
    ap.add_argument("--rest", type=int, default=120, help="tokens after the prompt (about)")
    ap.add_argument("--groups", type=int, default=8, help="P")
    ap.add_argument("--group-size", type=int, default=8, help="G")
    ap.add_argument("--conditioned", action="store_true", help="two prompts per group")
    ap.add_argument("--steps", type=int, default=3, help="timed runs per layout")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from rcgrpo_jax import machine, models
    from rcgrpo_jax.data import packing
    from rcgrpo_jax.rl.losses import Objective, policy_loss

    cfg = model_config()
    params = models.init_params(cfg, jax.random.key(0))
    whole = rollouts(a.groups, a.group_size, a.prompt, a.rest, a.conditioned, cfg.vocab_size)
    shared = {
        **whole,
        **packing.shared_prompts(*(whole[k] for k in ("tokens", "segments", "loss_mask"))),
    }
    step = jax.jit(jax.value_and_grad(lambda p, b: policy_loss(cfg, Objective(), p, b)[0]))
    print(f"{machine.cpu_line(machine.cpu())}, jax {jax.__version__}, {jax.device_count()} device")
    p, g, t = whole["tokens"].shape
    k, tp = shared["prompt_tokens"].shape[1:]
    ts = shared["rest_tokens"].shape[-1]
    print(f"whole rows: {p * g} x {t}; shared: {p * k} prompts x {tp} + {p * g} rests x {ts}")
    medians, losses = {}, {}
    for name, batch in (("whole", whole), ("shared", shared)):
        batch = {key: jnp.asarray(v) for key, v in batch.items()}
        losses[name] = float(jax.block_until_ready(step(params, batch))[0])
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, batch))
            times.append(time.perf_counter() - t0)
        medians[name] = statistics.median(times)
        print(f"{name:>7}: {medians[name]:.3f} s  ({', '.join(f'{x:.3f}' for x in times)})")
    if abs(losses["whole"] - losses["shared"]) > 1e-4 * max(1.0, abs(losses["whole"])):
        sys.exit(f"the losses differ: {losses}")
    print(f"shared prompt: {medians['whole'] / medians['shared']:.2f}x faster than whole rows")


if __name__ == "__main__":
    main()
