"""Forward-pass tokens/s: ours (jit, f32) vs transformers (PyTorch eager, f32), same weights.

Both sides run the same random Qwen2-shaped checkpoint on this machine's CPU; our compile time is
excluded (one warm-up call each side). Prints a table and the ratio.

    python bench/forward.py [--batch 8] [--seq 256] [--hidden 256] [--layers 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _time(fn, reps: int) -> float:
    fn()  # warm-up (compiles ours)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()

    import jax
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rcgrpo_jax import models

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 32,
        num_key_value_heads=max(1, a.hidden // 128),
        max_position_embeddings=4096,
    )
    hf = AutoModelForCausalLM.from_config(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        cfg, params = models.load_hf(d)
    tokens = np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq))
    mask = np.ones_like(tokens)
    t_tokens, t_mask = torch.tensor(tokens), torch.tensor(mask)

    def ours():
        jax.block_until_ready(models.forward(cfg, params, tokens, mask))

    def theirs():
        with torch.no_grad():
            hf(input_ids=t_tokens, attention_mask=t_mask)

    n = a.batch * a.seq
    t_ours, t_hf = _time(ours, a.reps), _time(theirs, a.reps)
    print(
        f"forward, f32, batch {a.batch} x seq {a.seq}, hidden {a.hidden}, {a.layers} layers, "
        f"vocab {a.vocab}; torch threads {torch.get_num_threads()}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform}"
    )
    print(f"{'impl':<22}{'best s':>10}{'tokens/s':>12}")
    print(f"{'rcgrpo_jax (jit)':<22}{t_ours:10.4f}{n / t_ours:12.0f}")
    print(f"{'transformers (eager)':<22}{t_hf:10.4f}{n / t_hf:12.0f}")
    print(f"ratio ours/transformers: {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # as rcgrpo_jax.main runs
    main()
