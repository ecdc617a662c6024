"""Architecture config shared by the families (`models.families`): one decoder, a few flags."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from rcgrpo_jax.models import weights
from rcgrpo_jax.models.families import FAMILIES, Family

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_KINDS = ("auto", "dense", "flash", "splash", "cudnn")  # see models/attention.py
# mesh.sampler_weights: the weights the sampler reads.
#   "tensor": a compute-dtype copy, sharded over the tensor axis only (replicated over data and
#     fsdp), made once per rollout. Each decode step reads local weights; the cost is the copy.
#   "train": the training state's own weights. Under FSDP, XLA gathers every layer's weights in
#     the parameter dtype before the decode loop (they are loop-invariant), so the sampler holds
#     them whole anyway, in f32 (the planner's figures: docs/benchmarks.md, "TPU slices, planned").
SAMPLER_WEIGHTS = ("tensor", "train")
# The projections LoRA can adapt (`model.lora.targets`), by their short names.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
LORA_INITS = ("kaiming", "gaussian")  # PEFT's default (`init_lora_weights=True`) | "gaussian"


def known_fields(cls: type, d: Mapping[str, Any], what: str) -> dict[str, Any]:
    """`d` as a dict, after checking every key is a field of dataclass `cls` (typos are bugs)."""
    d = dict(d)
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {what} config keys: {', '.join(unknown)}")
    return d


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1's "llama3" frequency scaling (low frequencies stretched by `factor`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the base's projections (PEFT's LoRA: y = x W + (x A) B * scale, with
    A [in, rank] and B [rank, out], B = 0 at the start), plus the embedding rows of `token_ids`
    (the reward tokens) trainable as whole rows (PEFT's `trainable_token_indices`); the rest of
    the base is frozen."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    init: str = "kaiming"
    token_ids: tuple[int, ...] = ()
    rslora: bool = False  # scale alpha / sqrt(rank) (PEFT's `use_rslora`), else alpha / rank

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank} must be >= 1 (rank 0 is no LoRA: lora=None)")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad or not self.targets:
            raise ValueError(f"lora targets {self.targets}: expected a subset of {LORA_TARGETS}")
        if self.init not in LORA_INITS:
            raise ValueError(f"lora init={self.init!r}; expected one of {LORA_INITS}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable, so it can be a static argument of jitted functions."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    family: str = "qwen2"  # a key of FAMILIES: the HF model_type and architecture on export
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: str = "float32"  # compute dtype of matmuls; norms and softmax always accumulate in f32
    param_dtype: str = "float32"
    remat: str = "none"  # one of REMAT_POLICIES
    # False: the layers run as an unrolled Python loop over the same stacked [L, ...] weights.
    # The compiled program grows with L, but no scan carries the residuals, so the backward
    # pass skips stacking them into [L, ...] buffers (zero-fill, update-slice, slice back).
    scan_layers: bool = True
    # The attention kernel (one of ATTENTION_KINDS; `models.attention.resolve` says what `auto`
    # picks per backend). Every kind computes the same masking rule; only memory/speed differ.
    attention: str = "auto"
    # `flash`'s query/key block length (shorter for short sequences). A field, not a module
    # constant: the config is the jitted programs' static key, so a program compiled at one
    # block length is never reused at another.
    flash_block: int = 512
    lora: LoraSpec | None = None  # None: every weight trains (full fine-tuning)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_KINDS}")
        if self.flash_block < 1:
            raise ValueError(f"flash_block={self.flash_block} must be >= 1")
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; expected one of {tuple(FAMILIES)}")

    @property
    def family_spec(self) -> Family:
        """What the family fixes (`models.families`): the weights' `when` and the math read it."""
        return FAMILIES[self.family]

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def lora_rank(self) -> int:
        """The "lora_rank" axis' size (`models.weights.DIMS`)."""
        return self.lora.rank if self.lora else 0

    @property
    def lora_tokens(self) -> int:
        """The "lora_tokens" axis' size: how many embedding rows train under LoRA."""
        return len(self.lora.token_ids) if self.lora else 0

    def base(self) -> ModelConfig:
        """This model without adapters: what a merged checkpoint and the sampler's copy are."""
        return dataclasses.replace(self, lora=None)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count, for FLOP and memory estimates."""
        return weights.num_params(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """From a flat mapping (e.g. an ml_collections section); unknown keys raise."""
        d = known_fields(cls, d, "model")
        if d.get("rope_scaling") is not None and not isinstance(d["rope_scaling"], RopeScaling):
            d["rope_scaling"] = RopeScaling(**dict(d["rope_scaling"]))
        if d.get("lora") is not None and not isinstance(d["lora"], LoraSpec):
            lora = dict(d["lora"])
            lora["targets"] = tuple(lora.get("targets", LORA_TARGETS))
            lora["token_ids"] = tuple(lora.get("token_ids", ()))
            d["lora"] = LoraSpec(**lora)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**d)
