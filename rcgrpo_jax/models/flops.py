"""Analytic FLOPs of the decoder: the one count behind the train loop's MFU (`train.metrics.mfu`
over `flops_per_token`) and the planner's roofline (`planning.cost`). It is derived from the
config because XLA's cost analysis counts a scanned layer body once.

Model FLOPs follow PaLM's MFU convention (appendix B): per token, 2 per matmul weight forward
and 4 more backward, and attention (QKᵀ and PV) over the full T×T score matrix whatever a
kernel skips. Hardware FLOPs (`train_hardware_flops_per_token`) are what a train step computes
with a given attention kernel and remat policy.

Under LoRA (`cfg.lora`) no base weight gradient is computed: per token the base costs 2 forward
and 2 backward (the input's gradient) per weight, and the adapters (A and B, `lora_matmul_params`)
the full 6; the token rows are an embedding gather and two columns of the head (not counted).
"""

from __future__ import annotations

from rcgrpo_jax.models.attention import flop_units
from rcgrpo_jax.models.config import ModelConfig


def _projections(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each layer projection, by its LoRA target name."""
    e, m = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e),
            "gate": (e, m), "up": (e, m), "down": (m, e)}  # fmt: skip


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every layer's projections plus the LM head
    (tied or not). Not counted: the embedding lookup (a gather), the norms' scales and Qwen2's
    q/k/v biases (elementwise)."""
    per_layer = sum(i * o for i, o in _projections(cfg).values())
    return cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size


def lora_matmul_params(cfg: ModelConfig) -> int:
    """Adapter weights in a matmul per token: A [in, r] and B [r, out] of every adapted
    projection of every layer; 0 without LoRA."""
    if cfg.lora is None:
        return 0
    sides = sum(i + o for t, (i, o) in _projections(cfg).items() if t in cfg.lora.targets)
    return cfg.num_layers * cfg.lora.rank * sides


def _weight_flops(cfg: ModelConfig) -> int:
    """Per-token train FLOPs of the matmul weights: 6·N, or under LoRA 4·N + 6·N_lora."""
    n = matmul_params(cfg)
    return 6 * n if cfg.lora is None else 4 * n + 6 * lora_matmul_params(cfg)


def attention_flops(cfg: ModelConfig, kv_len: int) -> int:
    """Forward attention FLOPs of one token over `kv_len` keys: QKᵀ and PV, 2·2·H·D per key
    per layer."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * kv_len


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token: 6·N + 12·L·H·D·T for training (under LoRA 4·N + 6·N_lora for the
    weights), 2·N + 4·L·H·D·T forward only (T then being the keys attended, e.g. a decode
    step's cache; 2·N_lora more with adapters applied on the fly), N = `matmul_params`."""
    attn = attention_flops(cfg, seq_len)
    if training:
        return float(_weight_flops(cfg) + 3 * attn)
    return float(2 * (matmul_params(cfg) + lora_matmul_params(cfg)) + attn)


def train_hardware_flops_per_token(cfg: ModelConfig, seq_len: int, kind: str) -> float:
    """FLOPs per token a train step at T = `seq_len` computes with attention kernel `kind`: the
    attention only over the blocks on or below the causal diagonal, `attention.flop_units`
    passes of it (dense 3, flash/cuDNN 3.5, splash 4.5), plus what the remat policy recomputes
    in the backward pass (`remat_recompute`)."""
    fraction, passes = flop_units(kind, seq_len, cfg.flash_block)
    attn_hw = attention_flops(cfg, seq_len) * fraction
    return _weight_flops(cfg) + passes * attn_hw + remat_recompute(cfg, kind, attn_hw)


def remat_recompute(cfg: ModelConfig, kind: str, attn_hw: float) -> float:
    """Per-token FLOPs the remat policy recomputes in the backward pass. full: one more forward
    of the layers (2·N_layers + attention). dots_no_batch: the attention, whose einsums all have
    batch dims. dots: nothing for dense (its einsums are saved), but the other kernels'
    attention forward: flash's out/lse come out of a loop, splash's and cuDNN's out of a kernel
    call, none of them a dot, so the policy saves none and the backward reruns the forward
    (the grad's program holds flash's forward loop twice). none: nothing."""
    n_layers = matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size + lora_matmul_params(cfg)
    if cfg.remat == "full":
        return 2 * n_layers + attn_hw
    if cfg.remat == "dots_no_batch" or (cfg.remat == "dots" and kind != "dense"):
        return attn_hw
    return 0.0
