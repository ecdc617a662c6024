"""The model families: what differs between Qwen2.5 and LLaMA-3.1, in one table.

One decoder serves both; a family only fixes what its transformers class hard-codes. What a
checkpoint's config.json chooses per model (tied embeddings: Qwen2.5 <= 3B; "llama3" rope
scaling: LLaMA-3.1) is read by `hf_io.config_from_hf` into `ModelConfig` flags, whose weights
and math live in `models.weights` (`when` conditions) and `models.decoder`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # transformers class named in an exported config.json
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2 always, LLaMA never)
    # config.json flags this family must have false (read: an error otherwise; export: written)
    off_flags: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {  # keyed by transformers' `model_type`
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "llama": Family("LlamaForCausalLM", qkv_bias=False, off_flags=("attention_bias", "mlp_bias")),
}


def qkv_bias_mismatch(family: str, qkv_bias: bool) -> str | None:
    """None when a `family` checkpoint can have `qkv_bias`, else what it needs: its
    transformers class hard-codes the q/k/v biases, so HF export refuses any other value
    (config_check says so before training)."""
    f = FAMILIES[family]
    if qkv_bias == f.qkv_bias:
        return None
    has = "has" if f.qkv_bias else "has no"
    return f"{f.qkv_bias} for a {family} model ({f.architecture} {has} q/k/v biases)"
