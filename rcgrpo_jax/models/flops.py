"""Analytic FLOPs of the decoder: the one count behind the train loop's MFU (`train.metrics.mfu`
over `flops_per_token`) and the planner's roofline (`planning.cost`). It is derived from the
config because XLA's cost analysis counts a scanned layer body once.

Model FLOPs follow PaLM's MFU convention (appendix B): per token, 2 per matmul weight forward
and 4 more backward, and attention (QKᵀ and PV) over the full T×T score matrix whatever a
kernel skips. Hardware FLOPs (`train_hardware_flops_per_token`) are what a train step computes
with a given attention kernel and remat policy.
"""

from __future__ import annotations

from rcgrpo_jax.models.attention import flop_units
from rcgrpo_jax.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every layer's projections plus the LM head
    (tied or not). Not counted: the embedding lookup (a gather), the norms' scales and Qwen2's
    q/k/v biases (elementwise)."""
    e, h, kv, d, m = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    return cfg.num_layers * (2 * e * h * d + 2 * e * kv * d + 3 * e * m) + e * cfg.vocab_size


def attention_flops(cfg: ModelConfig, kv_len: int) -> int:
    """Forward attention FLOPs of one token over `kv_len` keys: QKᵀ and PV, 2·2·H·D per key
    per layer."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * kv_len


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token: 6·N + 12·L·H·D·T for training (2·N + 4·L·H·D·T forward only, T
    then being the keys attended, e.g. a decode step's cache), N = `matmul_params`."""
    n = matmul_params(cfg)
    attn = attention_flops(cfg, seq_len)
    return float(6 * n + 3 * attn) if training else float(2 * n + attn)


def train_hardware_flops_per_token(cfg: ModelConfig, seq_len: int, kind: str) -> float:
    """FLOPs per token a train step at T = `seq_len` computes with attention kernel `kind`: the
    attention only over the blocks on or below the causal diagonal, `attention.flop_units`
    passes of it (dense 3, flash/cuDNN 3.5, splash 4.5), plus what the remat policy recomputes
    in the backward pass (`remat_recompute`)."""
    fraction, passes = flop_units(kind, seq_len, cfg.flash_block)
    attn_hw = attention_flops(cfg, seq_len) * fraction
    return 6 * matmul_params(cfg) + passes * attn_hw + remat_recompute(cfg, kind, attn_hw)


def remat_recompute(cfg: ModelConfig, kind: str, attn_hw: float) -> float:
    """Per-token FLOPs the remat policy recomputes in the backward pass. full: one more forward
    of the layers (2·N_layers + attention). dots_no_batch: the attention, whose einsums all have
    batch dims. dots: nothing for dense (its einsums are saved), but the other kernels'
    attention forward: flash's out/lse come out of a loop, splash's and cuDNN's out of a kernel
    call, none of them a dot, so the policy saves none and the backward reruns the forward
    (the grad's program holds flash's forward loop twice). none: nothing."""
    n_layers = matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size
    if cfg.remat == "full":
        return 2 * n_layers + attn_hw
    if cfg.remat == "dots_no_batch" or (cfg.remat == "dots" and kind != "dense"):
        return attn_hw
    return 0.0
