"""The model families: everything that differs between Qwen2.5, Qwen3 and LLaMA-3.1, in one table.

One decoder serves every family; a `Family` declares what its transformers class hard-codes or
defaults, and everything else reads it from here: `hf_io.config_from_hf` (model_type, which rope
types and config.json flags are accepted, the class's defaults for absent keys),
`hf_io.config_to_hf` (architecture, flags written off), the weights a model has
(`models.weights`: a row's `when` reads the family, e.g. Qwen3's q/k norms), the decoder's math
(`models.decoder.project_qkv`), the config check (`config_check`: family names, the q/k/v bias
rule) and the test checkpoints (`tests/conftest.make_hf_model`). What a checkpoint chooses per
model (tied embeddings: Qwen2.5 <= 3B and Qwen3 <= 4B tie, larger ones do not; "llama3" rope
scaling and its factors) is read from its config.json into `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROPE_TYPES = ("default", "llama3")  # the rope types `models.decoder.rope_inv_freq` implements


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # transformers class named in an exported config.json
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2 always, LLaMA and Qwen3 never)
    # Per-head RMSNorm over head_dim on q and k, after the projection and before rope (Qwen3):
    # weights `q_norm`/`k_norm` [head_dim] per layer.
    qk_norm: bool = False
    # The `model.chat_format` (call syntax and template) its instruct checkpoints are trained for.
    chat_format: str = "qwen"
    rope_types: tuple[str, ...] = ("default",)  # of ROPE_TYPES, what its checkpoints use
    # config.json flags this family must have false (read: an error otherwise; export: written)
    off_flags: tuple[str, ...] = ()
    # config.json values its transformers config class defaults to, used where a key is absent
    # (over `hf_io.HF_DEFAULTS`): Qwen3Config's head_dim is 128 whatever hidden/heads is.
    hf_defaults: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rope_types) - set(ROPE_TYPES))
        if unknown:
            raise ValueError(f"{self.architecture}: rope types {unknown} not in {ROPE_TYPES}")


FAMILIES: dict[str, Family] = {  # keyed by transformers' `model_type`
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "llama": Family(
        "LlamaForCausalLM", qkv_bias=False, chat_format="llama",
        rope_types=("default", "llama3"), off_flags=("attention_bias", "mlp_bias"),
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
        off_flags=("attention_bias",), hf_defaults=(("head_dim", 128),),
    ),
}  # fmt: skip


def qkv_bias_mismatch(family: str, qkv_bias: bool) -> str | None:
    """None when a `family` checkpoint can have `qkv_bias`, else what it needs: its
    transformers class hard-codes the q/k/v biases, so HF export refuses any other value
    (config_check says so before training)."""
    f = FAMILIES[family]
    if qkv_bias == f.qkv_bias:
        return None
    has = "has" if f.qkv_bias else "has no"
    return f"{f.qkv_bias} for a {family} model ({f.architecture} {has} q/k/v biases)"
