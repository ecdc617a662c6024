"""Sampler benchmark: our jitted KV-cache sampler vs transformers `generate`, same random model.

  PYTHONPATH=. python bench/sampler.py [--quick]

(a) batched greedy decoding at batch 8 and 32 (ragged prompts, left-padded for transformers);
(b) a 3-turn rollout of 8 prompts x 8 samples = 64 trajectories with per-row tool text: our
    session keeps each cache and prefills only the new tokens; the transformers loop re-prefills
    the whole history every turn (what a generate-per-turn rollout does).
Our compile time is excluded: every shape is run once before timing (warm-up), and the number of
programs compiled is printed. Times are the best of `--repeats` runs ((a): both sides warmed up,
then timed in turn) and of `--rollout-repeats` runs ((b)). torch gets as many threads as XLA
runs on (`--torch-threads` to change it). CPU only; ~2.5 min on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

try:  # bench/suite.py reuses this module where torch may be absent (our side only)
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

from rcgrpo_jax import models, sampling  # noqa: E402
from rcgrpo_jax.machine import usable_cores  # noqa: E402

VOCAB, HIDDEN, LAYERS = 1024, 256, 4
PAD = 0


def make_model(
    path: Path,
    *,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    heads: int = 8,
    kv_heads: int = 2,
    intermediate: int | None = None,
    tie: bool = False,
    max_positions: int = 2048,
):
    """A random Qwen2 model saved to `path` (defaults: this benchmark's shape; bench/suite.py
    passes others, e.g. Qwen2.5-0.5B's). `intermediate` defaults to 4 x hidden."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
    )
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    model.save_pretrained(str(path))
    model.generation_config.eos_token_id = None  # random weights: never stop early on eos
    model.generation_config.pad_token_id = PAD
    return model


def hf_generate(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers greedy generate on a left-padded batch; returns the new tokens per row."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    return out[:, width:].tolist()


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(best time, last result) of `repeats` calls of `fn`; the caller has warmed it up."""
    return best_times_interleaved((fn,), repeats, warm_up=False)[0]


def best_times_interleaved(fns, repeats: int, warm_up: bool = True) -> list[tuple[float, object]]:
    """(best time, last result) of each of `fns`, run in turn for `repeats` rounds after one
    untimed call each (`warm_up`): both sides of a comparison see the same moments of a host whose
    speed drifts, and neither is timed on its first call (allocator and library warm-up)."""
    results = [fn() for fn in fns] if warm_up else [None] * len(fns)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return list(zip(best, results, strict=True))


def rollout_plan(seed: int = 0, prompt_len: tuple[int, int] = (192, 320), variants: int = 2):
    """8 prompts x 8 samples, 3 turns: per-row tool text lengths and which rows end when.

    As in RC-GRPO, the 8 samples of a prompt come in `variants` versions that differ in one
    early token (the reward token sits at the start of the system message), so only
    8 x `variants` distinct prompts exist. Prompt lengths are drawn from `prompt_len`.
    """
    rng = np.random.default_rng(seed)
    lo, hi = prompt_len
    base = [rng.integers(1, VOCAB - 2, int(rng.integers(lo, hi + 1))).tolist() for _ in range(8)]
    prompts = []
    for p in base:
        for j in range(8):
            prompts.append(p[:3] + [VOCAB - 1 - j % variants] + p[4:])
    tools = [
        {r: rng.integers(1, VOCAB, int(rng.integers(8, 41))).tolist() for r in range(64)}
        for _ in range(2)
    ]
    ends = [set(rng.choice(64, 16, replace=False).tolist())]  # a quarter end after turn 1
    ends.append(set(rng.choice(sorted(set(range(64)) - ends[0]), 16, replace=False).tolist()))
    return prompts, tools, ends


NEW_PER_TURN = 32


def ours_rollout(cfg, params, plan, share_prompts: bool = True):
    prompts, tools, ends = plan
    sess = sampling.Session(cfg, params, temperature=1.0, seed=1)
    sess.start(prompts, reserve=NEW_PER_TURN, share_prompts=share_prompts)
    generated = 0
    for turn in range(3):
        out = sess.decode_turn(NEW_PER_TURN)
        generated += sum(map(len, out.tokens.values()))
        if turn < 2:
            sess.finish(ends[turn])
            sess.append({r: tools[turn][r] for r in sess.live_rows})
    return generated, sum(sess.prefill_tokens)


def hf_rollout(model, plan):
    prompts, tools, ends = plan
    history = {r: list(p) for r, p in enumerate(prompts)}
    generated = prefill = 0
    for turn in range(3):
        rows = sorted(history)
        width = max(len(history[r]) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(history[r]) :] = torch.tensor(history[r])
            mask[i, width - len(history[r]) :] = 1
        prefill += sum(len(history[r]) for r in rows)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=NEW_PER_TURN,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
            )
        for i, r in enumerate(rows):
            history[r] += out[i, width:].tolist()
        generated += (out.shape[1] - width) * len(rows)
        if turn < 2:
            for r in ends[turn]:
                del history[r]
            for r in history:
                history[r] += tools[turn][r]
    return generated, prefill


def _span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


def rollout_rows(cfg, params, model, prompt_len: tuple[int, int], reps: int) -> list[tuple]:
    """(b) at one prompt-length range: ours (continuation + shared prompts), ours with
    continuation only, and the transformers re-prefill loop; tokens/s and prefill tokens."""
    plan = rollout_plan(prompt_len=prompt_len)
    compiles = sampling.compile_count()
    for share in (True, False):
        ours_rollout(cfg, params, plan, share)  # warm-up
    compiles = sampling.compile_count() - compiles
    t_o, (gen_o, pre_o) = best_time(lambda: ours_rollout(cfg, params, plan), reps)
    t_c, (gen_c, pre_c) = best_time(lambda: ours_rollout(cfg, params, plan, False), reps)
    t_h, (gen_h, pre_h) = best_time(lambda: hf_rollout(model, plan), reps)
    what = f"(b) 3-turn rollout, 8x8 traj., prompts {prompt_len[0]}-{prompt_len[1]}"
    rate = lambda g, t: f"{g / t:,.0f} tok/s"
    return [
        (
            what,
            rate(gen_o, t_o),
            rate(gen_h, t_h),
            f"{(gen_o / t_o) / (gen_h / t_h):.2f}x",
            f"wall {t_o:.1f}s vs {t_h:.1f}s; {compiles} programs compiled in warm-up",
        ),
        (
            "    same, without prompt sharing",
            rate(gen_c, t_c),
            rate(gen_h, t_h),
            f"{(gen_c / t_c) / (gen_h / t_h):.2f}x",
            f"cache continuation alone; wall {t_c:.1f}s",
        ),
        (
            "    prefill tokens (total)",
            f"{pre_o:,} ({pre_c:,} unshared)",
            f"{pre_h:,}",
            f"{pre_h / pre_o:.1f}x fewer",
            f"generated tokens: ours {gen_o:,}, HF {gen_h:,}",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of (a); best is kept")
    ap.add_argument("--rollout-repeats", type=int, default=1, help="timed runs of (b)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row in (a)")
    ap.add_argument(
        "--rollout-lens",
        type=_span,
        nargs="+",
        default=[(192, 320), (512, 1024)],
        help="prompt-length ranges of (b), e.g. 192-320 512-1024 (BFCL's are ~1k-4.5k)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the cores JAX uses, for a fair ratio)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads or usable_cores())

    tmp = Path(tempfile.mkdtemp())
    model = make_model(tmp)
    cfg, params = models.load_hf(tmp)
    print(
        f"model: qwen2-style, hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, 8 heads / 2 KV "
        f"heads, f32 | jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    rows = []

    rng = np.random.default_rng(0)
    for batch in (8, 32):
        prompts = [rng.integers(1, VOCAB, int(rng.integers(16, 49))).tolist() for _ in range(batch)]
        run_ours = lambda p=prompts: sampling.generate(cfg, params, p, args.new)  # noqa: B023
        compiles = sampling.compile_count()
        run_ours()  # compiles this batch's shapes
        compiles = sampling.compile_count() - compiles
        run_hf = lambda p=prompts: hf_generate(model, p, args.new)  # noqa: B023
        timed = best_times_interleaved((run_ours, run_hf), args.repeats)
        (t_ours, ours_out), (t_hf, hf_out) = timed
        same = np.mean([a == b for a, b in zip(ours_out.tokens, hf_out, strict=True)])
        n = batch * args.new
        rows.append(
            (
                f"(a) greedy, batch {batch}, {args.new} new",
                f"{n / t_ours:,.0f} tok/s",
                f"{n / t_hf:,.0f} tok/s",
                f"{t_hf / t_ours:.2f}x",
                f"rows identical to HF: {same:.0%}; {compiles} programs compiled in warm-up",
            )
        )

    for lens in args.rollout_lens:
        rows += rollout_rows(cfg, params, model, lens, args.rollout_repeats)

    head = ("benchmark", "ours (jax)", "transformers", "speed-up", "notes")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # host malloc setting: both sides
    main()
