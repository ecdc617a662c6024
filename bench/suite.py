"""Benchmark suite (issue 8): ours vs PyTorch/transformers, side by side in one run, one table.

    python bench/suite.py [--quick | --smoke] [--shape tiny|micro|qwen0.5b] [--device cpu|gpu]
                          [--dtype f32|bf16] [--torch-threads N] [--json out.json]

Rows (same random Qwen2 weights on both sides; our compile time excluded by a warm-up call):
- matmul peak: the best of a large square matmul in the compute dtype, jnp vs torch, measured
  here — the denominator of each side's MFU.
- train step: our jitted fused RC-GRPO step (`rl.train_step.make_rl_step`: clipped surrogate with
  in-step group advantages, clip-by-global-norm, AdamW) vs the same loss + optimizer written in
  PyTorch eager on transformers' Qwen2ForCausalLM; ours applies the LM head at the loss's
  positions only (`loss_index`, as the RL stage does under `model.gather_head`), PyTorch's at
  every position, as TRL does; tokens/s and MFU = analytic model FLOPs
  (`planning.train_flops`: 6·N·tokens + attention, the full head on both sides) / step time /
  that side's measured peak.
  The first step's loss and gradient norm must agree on both sides (asserted, printed); the
  later steps are timed on the two sides in turn.
- greedy decode at batch 8 and 32 vs transformers `generate` (`bench/sampler.py`'s functions),
  each side warmed up, then timed in turn (`best_times_interleaved`).
- 3-turn group rollout (8 prompts x 8 samples) with KV-cache continuation vs transformers
  re-prefilling the whole history every turn (`bench/sampler.py`'s rollout plan and loops).
- prefill tokens per trajectory vs trajectory length: our Session over a growing multi-turn
  conversation (counted by the session) vs what re-prefilling each turn processes (sub-table).

On the CPU both sides get the same threads: torch as many as the cores XLA:CPU runs on (this
process's CPU affinity), unless `--torch-threads` says otherwise; the header prints both counts.
A ratio at unequal threads is not a fair comparison.
Without torch/transformers (or, on a GPU, without CUDA torch) the PyTorch columns are skipped
and the header says why. bench/gpu.sh runs this on a CUDA device with a Qwen2.5-0.5B shape.

The file stays ~750 lines long because it is one command printing one table whose rows share one
set-up (the shape, the same weights on both sides, the measured peaks that divide every MFU);
the decode and rollout loops it times are bench/sampler.py's.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Architectures. "tiny" is bench/sampler.py's default model (make_model without shape keywords).
SHAPES = {
    "micro": dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    "tiny": {},
    "qwen0.5b": dict(
        vocab=151936,
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        tie=True,
        max_positions=32768,
    ),
}

# Workloads per mode: train batch P x G x T and timed steps; decode new tokens and repeats;
# rollout repeats; prefill table (rows, prompt, generated and tool tokens per turn, turns).
MODES = {
    "smoke": dict(
        P=1, G=2, T=64, steps=1, new=8, repeats=1, rollout=False, peak_n=256, pf=(4, 32, 8, 8, 3)
    ),
    "quick": dict(
        P=2,
        G=2,
        T=256,
        steps=2,
        new=32,
        repeats=1,
        rollout=True,
        rollout_len=(192, 320),
        peak_n=1024,
        pf=(8, 128, 16, 16, 4),
    ),
    "full": dict(
        P=2,
        G=4,
        T=256,
        steps=4,
        new=64,
        repeats=3,
        rollout=True,
        rollout_len=(512, 1024),  # BFCL prompts are ~1k-4.5k tokens
        peak_n=2048,
        pf=(8, 128, 16, 16, 8),
    ),
    "gpu": dict(
        P=4,
        G=4,
        T=1024,
        steps=5,
        new=64,
        repeats=3,
        rollout=True,
        rollout_len=(1024, 1536),  # + 3 turns stays within 2048 positions
        peak_n=8192,
        pf=(8, 512, 64, 64, 8),
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller workloads (~3 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="micro workloads, no rollout (tests)")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="model shape (default: micro with --smoke, qwen0.5b on gpu, else tiny)",
    )
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument(
        "--dtype",
        choices=("f32", "bf16"),
        default=None,
        help="compute dtype (default: f32 on cpu, bf16 on gpu)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the cores JAX uses, for a fair ratio)",
    )
    ap.add_argument(
        "--scan-layers",
        action="store_true",
        help="train step with nn.scan over layers (default: unrolled, model.scan_layers=False)",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    ap.add_argument("--json", default="", help="also write rows and checks to this file")
    args = ap.parse_args(argv)
    args.mode = (
        "smoke"
        if args.smoke
        else "quick"
        if args.quick
        else ("gpu" if args.device == "gpu" else "full")
    )
    args.shape = args.shape or (
        "micro" if args.smoke else "qwen0.5b" if args.device == "gpu" else "tiny"
    )
    args.dtype = args.dtype or ("bf16" if args.device == "gpu" else "f32")
    return args


# --------------------------------------------------------------------------- helpers


def fmt_rate(x: float | None, unit: str = "tok/s") -> str:
    return "—" if x is None else f"{x:,.0f} {unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt_ratio(r: float | None, suffix: str = "x") -> str:
    return "—" if r is None else f"{r:.2f}{suffix}"


def target(ok: bool | None, text: str) -> str:
    return text + ("" if ok is None else " ✓" if ok else " ✗")


def print_table(head, rows) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
    print("\n".join([line(head) + " |", "|" + "|".join("-" * (w + 2) for w in widths) + "|"]))
    for r in rows:
        print(line(r) + " |")


class OnDevice:
    """A transformers model whose `generate` takes CPU tensors (as bench/sampler.py builds them)
    and runs on `device`."""

    def __init__(self, model, device):
        self.model, self.device = model, device

    def generate(self, ids, **kw):
        import torch

        kw = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kw.items()}
        return self.model.generate(ids.to(self.device), **kw)


# --------------------------------------------------------------------------- peak


def jax_peak(n: int, dtype, reps: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), dtype)
    b = jax.random.normal(k2, (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def torch_peak(n: int, dtype, device, reps: int = 5) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b)
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# --------------------------------------------------------------------------- train step


def rl_batch(cfg, params, P: int, G: int, T: int, seed: int = 0) -> dict:
    """A [P, G, T] rollout batch: full-length rows, a prompt then assistant turns (loss mask 1)
    separated by tool text (0), old log-probs = the current policy's plus noise (so ratios move
    off 1 and some clip), rewards 0/1 with every group holding both; with `loss_index`, as the
    RL stage builds it under `model.gather_head` (the default: our head runs at the sampled
    positions only; PyTorch's reference computes it everywhere, as TRL does)."""
    import numpy as np

    from rcgrpo_jax.data.packing import loss_index
    from rcgrpo_jax.rl.train_step import sequence_logprobs

    rng = np.random.default_rng(seed)
    B = P * G
    tokens = rng.integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    segments = np.ones((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        t = int(rng.integers(T // 4, T // 2))
        while t < T:
            gen = int(rng.integers(8, 33))
            mask[b, t : t + gen] = 1.0
            t += gen + int(rng.integers(4, 17))
    logp = np.asarray(sequence_logprobs(cfg, params, tokens, positions, segments))
    old = np.where(mask > 0, logp + rng.normal(0, 0.2, (B, T)), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, (P, G)).astype(np.float32)
    rewards[:, 0], rewards[:, -1] = 1.0, 0.0
    shape = lambda x: x.reshape(P, G, T)
    return {
        "tokens": shape(tokens),
        "positions": shape(positions),
        "segments": shape(segments),
        "loss_mask": shape(mask),
        "old_logprobs": shape(old),
        "rewards": rewards,
        "loss_index": loss_index(shape(mask)),
    }


def train_settings():
    """(objective, optimizer config) of the timed train step: the base config's objective (grpo,
    what torch_train mirrors), AdamW at lr 1e-5 without decay, clipping at 1."""
    from rcgrpo_jax.config import base_config
    from rcgrpo_jax.rl.losses import objective_from_config
    from rcgrpo_jax.train.optim import OptimConfig

    objective = objective_from_config(base_config().rl)
    return objective, OptimConfig(lr=1e-5, total_steps=10**6, weight_decay=0.0, clip_norm=1.0)


def ours_train(cfg, params, batch, objective, optim_cfg):
    """(one more step, synchronous; first-step loss; first-step grad norm) of our fused step."""
    import jax
    from steps import fresh_step

    step, state, _ = fresh_step(cfg, params, optim_cfg, objective=objective)
    jbatch = {k: jax.device_put(v) for k, v in batch.items()}
    state, m = step(state, jbatch)  # the first step (compiles)

    def run() -> None:
        nonlocal state
        state, out = step(state, jbatch)
        jax.block_until_ready(out["loss"])

    return run, float(m["loss"]), float(m["grad_norm"])


def torch_train(model, batch, objective, optim_cfg, device, bf16: bool):
    """The same clipped surrogate + clip-by-global-norm + AdamW in PyTorch eager on transformers'
    model; (one more step, synchronous; first-step loss; first-step grad norm)."""
    import contextlib

    import torch

    P, G, T = batch["tokens"].shape
    t = lambda k, dt=None: torch.as_tensor(batch[k]).reshape(P * G, T).to(device, dt)
    tokens, positions = t("tokens", torch.long), t("positions", torch.long)
    mask, old = t("loss_mask", torch.float32), t("old_logprobs", torch.float32)
    mask[:, 0] = 0.0  # nothing predicts the first token
    rewards = torch.as_tensor(batch["rewards"], device=device)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=optim_cfg.lr,
        betas=(optim_cfg.b1, optim_cfg.b2),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=tokens, position_ids=positions).logits
        logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = torch.gather(logp_all, -1, tokens[:, 1:, None])[..., 0]
        logp = torch.nn.functional.pad(logp, (1, 0))
        mu = rewards.mean(1, keepdim=True)
        sigma = (rewards - mu).square().mean(1, keepdim=True).sqrt()
        degenerate = (rewards == rewards[:, :1]).all(1, keepdim=True)
        adv = torch.where(degenerate, 0.0, (rewards - mu) / (sigma + objective.adv_eps))
        adv = adv.reshape(P * G, 1)
        ratio_ = torch.exp(logp - old)
        clipped = ratio_.clamp(1.0 - objective.clip_low, 1.0 + objective.clip_high)
        per_token = -torch.minimum(ratio_ * adv, clipped * adv)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.clip_norm)
        opt.step()
        return loss.item(), gnorm.item()

    loss, gnorm = step()  # first step: the one compared with ours

    def run() -> None:
        step()
        sync()

    return run, loss, gnorm


# --------------------------------------------------------------------------- prefill vs length


def prefill_growth(cfg, params, rows: int, prompt: int, gen: int, tool: int, turns: int):
    """Our Session over `turns` turns (decode `gen`, append `tool` tokens per turn): per turn,
    the mean trajectory length, our prefilled tokens per trajectory (counted by the session) and
    what re-prefilling the whole history before every turn would process."""
    import numpy as np

    from rcgrpo_jax import sampling

    rng = np.random.default_rng(1)
    vocab = min(cfg.vocab_size, 1024)
    sess = sampling.Session(cfg, params, temperature=0.0)
    sess.start([rng.integers(1, vocab, prompt).tolist() for _ in range(rows)], reserve=gen)
    length = [prompt] * rows
    reprefill = [0] * rows
    out = []
    for k in range(1, turns + 1):
        for r in range(rows):
            reprefill[r] += length[r]  # a generate-per-turn loop re-reads the whole history
        res = sess.decode_turn(gen)
        for r in range(rows):
            length[r] += len(res.tokens[r])
        ours = sess.prefill_tokens
        out.append(
            dict(
                turns=k,
                length=float(np.mean(length)),
                ours=float(np.mean(ours)),
                reprefill=float(np.mean(reprefill)),
                exact=all(o == n - k * gen for o, n in zip(ours, length, strict=True)),
            )
        )
        if k < turns:
            sess.append({r: rng.integers(1, vocab, tool).tolist() for r in range(rows)})
            length = [n + tool for n in length]
    return out


def linear_fit_residual(xs, ys) -> float:
    """max |y - (a·x + b)| / max |y| of the least-squares line: 0 for exactly linear growth."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    a, b = np.polyfit(x, y, 1)
    return float(np.max(np.abs(y - (a * x + b))) / np.max(np.abs(y)))


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import sampler as sb  # bench/sampler.py: make_model, hf_generate, rollout plan and loops

    from rcgrpo_jax import models, planning, sampling
    from rcgrpo_jax.machine import cpu, cpu_line, usable_cores

    mode = MODES[args.mode]
    bf16 = args.dtype == "bf16"
    jdtype = jnp.bfloat16 if bf16 else jnp.float32
    shape_kw = SHAPES[args.shape]

    jax_threads = usable_cores()
    # ---- the PyTorch side: available? where?
    torch = None
    why_no_torch = ""
    if args.no_torch:
        why_no_torch = "--no-torch"
    else:
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError as e:
            torch, why_no_torch = None, f"not installed ({e.name})"
    tdevice = None
    if torch is not None:
        if args.device == "gpu" and not torch.cuda.is_available():
            torch, why_no_torch = None, f"torch {torch.__version__} has no CUDA device"
        else:
            tdevice = torch.device("cuda" if args.device == "gpu" else "cpu")
            torch.set_num_threads(args.torch_threads or jax_threads)

    # ---- the model: transformers' random init saved, and loaded by us (same weights)
    tmp = Path(tempfile.mkdtemp(prefix="rcgrpo_suite_"))
    hf_model = None
    if torch is not None:
        hf_model = sb.make_model(tmp, **shape_kw)
        cfg, params = models.load_hf(tmp)  # f32
    else:
        kw = {
            "vocab": sb.VOCAB,
            "hidden": sb.HIDDEN,
            "layers": sb.LAYERS,
            "heads": 8,
            "kv_heads": 2,
            "intermediate": None,
            "tie": False,
            **shape_kw,
        }
        cfg = models.ModelConfig(
            vocab_size=kw["vocab"],
            hidden_size=kw["hidden"],
            intermediate_size=kw["intermediate"] or 4 * kw["hidden"],
            num_layers=kw["layers"],
            num_heads=kw["heads"],
            num_kv_heads=kw["kv_heads"],
            head_dim=kw["hidden"] // kw["heads"],
            qkv_bias=True,
            tie_embeddings=kw["tie"],
            max_position_embeddings=kw.get("max_positions", 2048),
        )
        params = models.init_params(cfg, jax.random.key(0))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # decode/rollout run in the compute dtype; training keeps f32 master weights
    cfg_dec, params_dec = cfg, params
    if bf16:
        cfg_dec = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
        params_dec = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    cfg_train = cfg.replace(dtype="bfloat16" if bf16 else cfg.dtype, scan_layers=args.scan_layers)

    dev = jax.devices()[0]
    machine = f"{cpu_line(cpu())}, {os.cpu_count()} cores"
    if dev.platform != "cpu":
        machine = f"{dev.device_kind} ({dev.platform}); host {machine}"
    torch_desc = (
        f"torch {torch.__version__} on {tdevice} ({torch.get_num_threads()} threads)"
        if torch is not None
        else f"PyTorch columns skipped: {why_no_torch}"
    )
    print(
        f"# rcgrpo_jax benchmark suite — {datetime.date.today().isoformat()} — {machine}\n"
        f"# mode {args.mode}, shape {args.shape} (hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, "
        f"{n_params / 1e6:.1f}M params), {args.dtype}, train step with layers "
        f"{'scanned' if args.scan_layers else 'unrolled'} | jax {jax.__version__} on "
        f"{dev.platform} ({jax_threads} threads) | {torch_desc} | load average "
        f"{load_start[0]:.2f} | GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} "
        "(both sides; rcgrpo_jax/host_memory.py)",
        flush=True,
    )

    rows: list[tuple] = []

    def add(row: tuple) -> None:  # printed at once too, so a run cut short still reports
        rows.append(row)
        print(f"# {time.perf_counter() - t_start:4.0f} s: " + " | ".join(map(str, row)), flush=True)

    checks: dict = {"torch": torch is not None, "why_no_torch": why_no_torch}

    # ---- matmul peak (the MFU denominators)
    n = mode["peak_n"]

    def peaks() -> tuple[float, float | None]:  # (ours, torch's) square-matmul FLOP/s, now
        if torch is None:
            return jax_peak(n, jdtype), None
        tdtype = torch.bfloat16 if bf16 else torch.float32
        return jax_peak(n, jdtype), torch_peak(n, tdtype, tdevice)

    peak_j, peak_t = peaks()
    add(
        (
            f"matmul peak, {args.dtype} {n}x{n}",
            fmt_rate(peak_j / 1e9, "GFLOP/s"),
            fmt_rate(peak_t / 1e9 if peak_t else None, "GFLOP/s"),
            fmt_ratio(ratio(peak_j, peak_t)),
            "—",
            "best of 5; measured again after the train step, MFU uses the higher",
        )
    )

    # ---- train step
    P, G, T = mode["P"], mode["G"], mode["T"]
    objective, optim_cfg = train_settings()
    batch = rl_batch(cfg, params, P, G, T)
    # Both sides' steps timed in turn (best of `steps`), so a drift in the host's speed meets both.
    run_o, loss_o, gn_o = ours_train(cfg_train, params, batch, objective, optim_cfg)
    t_hf = loss_h = gn_h = None
    if torch is None:
        t_ours = sb.best_time(run_o, mode["steps"])[0]
    else:
        train_model = copy.deepcopy(hf_model).to(tdevice, torch.float32)
        run_h, loss_h, gn_h = torch_train(train_model, batch, objective, optim_cfg, tdevice, bf16)
        (t_ours, _), (t_hf, _) = sb.best_times_interleaved((run_o, run_h), mode["steps"])
        del train_model, run_h
    tokens = P * G * T
    flops = planning.train_flops(cfg, planning.Shape(prompts=P, group=G, seq=T))[0]
    tps_o, tps_h = tokens / t_ours, (tokens / t_hf if t_hf else None)
    # The host's speed drifts between seconds (a shared VM): measure each peak again right after
    # its train step and divide by the higher of the two, so a slow moment during the first
    # measurement cannot inflate the MFU.
    peak_j2, peak_t2 = peaks()
    peaks_note = f"peaks before/after: {peak_j / 1e9:.0f}/{peak_j2 / 1e9:.0f} GFLOP/s ours" + (
        f", {peak_t / 1e9:.0f}/{peak_t2 / 1e9:.0f} torch" if peak_t else ""
    )
    print(f"# train step MFU denominators: the higher of the {peaks_note}", flush=True)
    mfu_o = flops / t_ours / max(peak_j, peak_j2)
    mfu_h = flops / t_hf / max(peak_t, peak_t2) if t_hf else None
    # bf16: the loss is a mean of ±advantage-weighted ratios, so it sits near 0 and bf16 logits
    # move it by ~1e-3 in absolute terms; an absolute tolerance is the meaningful one there.
    rtol, atol = (3e-2, 5e-3) if bf16 else (1e-4, 1e-6)
    loss_ok = None
    if loss_h is not None:
        loss_ok = bool(
            np.isclose(loss_o, loss_h, rtol=rtol, atol=atol)
            and np.isclose(gn_o, gn_h, rtol=10 * rtol)
        )
    checks.update(loss_ours=loss_o, loss_torch=loss_h, grad_norm_ours=gn_o, grad_norm_torch=gn_h)
    checks["loss_match"] = loss_ok
    print(
        f"# train step, first step: loss ours {loss_o:.6f} vs torch "
        f"{'—' if loss_h is None else f'{loss_h:.6f}'}; grad norm ours {gn_o:.5f} vs torch "
        f"{'—' if gn_h is None else f'{gn_h:.5f}'}; match (rtol {rtol}, atol {atol}): {loss_ok}",
        flush=True,
    )
    r = ratio(tps_o, tps_h)
    add(
        (
            f"train step (RC-GRPO loss + AdamW), {P}x{G}x{T} tokens",
            fmt_rate(tps_o),
            fmt_rate(tps_h),
            fmt_ratio(r),
            target(None if r is None else r >= 1.25, "≥ 1.25x"),
            f"first-step loss {loss_o:.5f} vs "
            f"{'—' if loss_h is None else f'{loss_h:.5f}'}"
            f" ({'match' if loss_ok else 'n/a' if loss_ok is None else 'MISMATCH'}); "
            f"best of {mode['steps']}",
        )
    )
    add(
        (
            "train step MFU (of the higher peak, before/after)",
            f"{mfu_o:.0%}",
            "—" if mfu_h is None else f"{mfu_h:.0%}",
            "—",
            target(mfu_o >= 0.6, "≥ 60%"),
            f"{flops / 1e9:,.1f} GFLOP/step (6·N·tokens + attention, models.flops); " + peaks_note,
        )
    )

    # ---- greedy decode at batch 8 and 32 (transformers' model in the compute dtype, on its device;
    # converted only now so that the train step above started from the same f32 weights as ours)
    hf_dec = None
    if hf_model is not None:
        hf_dec = hf_model.to(tdevice, torch.bfloat16 if bf16 else torch.float32)
        if tdevice.type == "cuda":
            hf_dec = OnDevice(hf_dec, tdevice)
    rng = np.random.default_rng(0)
    new, reps = mode["new"], mode["repeats"]
    vocab = min(cfg.vocab_size, sb.VOCAB)
    for bsz in (8, 32):
        prompts = [rng.integers(1, vocab, int(rng.integers(16, 49))).tolist() for _ in range(bsz)]
        run_ours = lambda p=prompts: sampling.generate(cfg_dec, params_dec, p, new)  # noqa: B023
        lanes = sampling.generate_lanes(bsz, models.params_mesh(params_dec))
        compiles = sampling.compile_count()
        run_ours()  # compiles this batch's shapes
        compiles = sampling.compile_count() - compiles
        t_h = same = None
        if hf_dec is None:
            t_o, out_o = sb.best_time(run_ours, reps)
        else:
            run_hf = lambda p=prompts: sb.hf_generate(hf_dec, p, new)  # noqa: B023
            (t_o, out_o), (t_h, out_h) = sb.best_times_interleaved((run_ours, run_hf), reps)
            same = np.mean([a == b for a, b in zip(out_o.tokens, out_h, strict=True)])
        k = bsz * new
        r = ratio(t_h, t_o)
        add(
            (
                f"greedy decode, batch {bsz}, {new} new tokens",
                fmt_rate(k / t_o),
                fmt_rate(k / t_h if t_h else None),
                fmt_ratio(r),
                target(None if r is None else r >= 2.0, "≥ 2.0x") if bsz == 32 else "—",
                ("" if same is None else f"rows identical: {same:.0%}; best of {reps}, in turn; ")
                + f"ours in {lanes} lane(s) (`sampling.generate_lanes`); "
                + f"{compiles} programs compiled in warm-up",
            )
        )
        checks[f"decode_{bsz}_identical"] = None if same is None else float(same)

    # ---- 3-turn group rollout: cache continuation vs re-prefill
    if mode["rollout"]:
        lo, hi = mode["rollout_len"]
        rplan = sb.rollout_plan(prompt_len=(lo, hi))
        sb.ours_rollout(cfg_dec, params_dec, rplan)  # warm-up
        t_o, (gen_o, pre_o) = sb.best_time(lambda: sb.ours_rollout(cfg_dec, params_dec, rplan), 1)
        t_h = gen_h = pre_h = None
        if hf_dec is not None:
            t_h, (gen_h, pre_h) = sb.best_time(lambda: sb.hf_rollout(hf_dec, rplan), 1)
        r = ratio(gen_o / t_o, gen_h / t_h if t_h else None)
        n_traj = len(rplan[0])
        add(
            (
                f"3-turn group rollout, {n_traj} trajectories, {lo}-{hi}-token prompts",
                fmt_rate(gen_o / t_o),
                fmt_rate(gen_h / t_h if t_h else None),
                fmt_ratio(r),
                target(None if r is None else r >= 3.0, "≥ 3x"),
                f"wall {t_o:.2f}s vs {'—' if t_h is None else f'{t_h:.2f}s'}; "
                f"generated {gen_o:,} vs {'—' if gen_h is None else f'{gen_h:,}'}",
            )
        )
        add(
            (
                "  rollout prefill tokens (total)",
                f"{pre_o:,}",
                "—" if pre_h is None else f"{pre_h:,}",
                fmt_ratio(ratio(pre_h, pre_o), "x fewer"),
                "—",
                "transformers re-prefills the whole history every turn",
            )
        )

    # ---- prefill tokens per trajectory vs trajectory length
    n_rows, prompt, gen, tool, turns = mode["pf"]
    growth = prefill_growth(cfg_dec, params_dec, n_rows, prompt, gen, tool, turns)
    lin_o = linear_fit_residual([g["length"] for g in growth], [g["ours"] for g in growth])
    lin_h = linear_fit_residual([g["length"] for g in growth], [g["reprefill"] for g in growth])
    exact = all(g["exact"] for g in growth)
    last = growth[-1]
    add(
        (
            f"prefill tokens / trajectory at {last['turns']} turns ({last['length']:.0f} tokens)",
            f"{last['ours']:,.0f}",
            f"{last['reprefill']:,.0f}",
            fmt_ratio(ratio(last["reprefill"], last["ours"]), "x fewer"),
            target(exact and lin_o < 1e-6, "linear in length"),
            f"off-line fit: ours {lin_o:.1%}, re-prefill {lin_h:.1%} (sub-table below)",
        )
    )
    checks.update(prefill_linear=bool(exact and lin_o < 1e-6), prefill=growth)

    print()
    print_table(
        ("benchmark", "ours (jax)", "PyTorch / transformers", "ratio", "target", "notes"), rows
    )
    print(
        f"\nPrefill tokens per trajectory vs trajectory length ({n_rows} trajectories, "
        f"{prompt}-token prompt, per turn {gen} generated + {tool} tool tokens; ours counted by "
        f"the Session, re-prefill = the history before every turn):\n"
    )
    print_table(
        ("turns", "trajectory length", "ours: prefill / traj", "re-prefill / traj", "ratio"),
        [
            (
                g["turns"],
                f"{g['length']:.0f}",
                f"{g['ours']:,.0f}",
                f"{g['reprefill']:,.0f}",
                fmt_ratio(ratio(g["reprefill"], g["ours"])),
            )
            for g in growth
        ],
    )
    wall = time.perf_counter() - t_start
    load_end = os.getloadavg()
    print(
        f"\n# wall {wall:.0f} s; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at "
        f"end; jax on {jax_threads} threads, {torch_desc}"
    )
    checks.update(wall_s=wall, load=[load_start[0], load_end[0]])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))
    if loss_ok is False:
        print("ERROR: the two sides computed different losses", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, __file__, *sys.argv[1:]])  # host malloc setting: both sides
    sys.exit(main())
