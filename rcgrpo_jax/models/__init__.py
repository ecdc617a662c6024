"""Model layer: one decoder for Qwen2.5, Qwen3 and LLaMA-3.1 (`families`), HF checkpoint I/O, mesh
sharding, LoRA (`lora`)."""

from rcgrpo_jax.models.api import (
    SAMPLER_WEIGHTS,
    Params,
    SharedPrefix,
    apply,
    forward,
    init_params,
    mean_init_rows,
    param_logical_axes,
    param_shapes,
    param_shardings,
    params_mesh,
    positions_from_mask,
    resize_vocab,
    sampler_config,
    sampler_param_shapes,
    sampler_param_shardings,
    sampler_params,
    shared_prefix_logprobs,
    token_logprobs,
)
from rcgrpo_jax.models.config import LoraSpec, ModelConfig, RopeScaling
from rcgrpo_jax.models.hf_io import CheckpointError, config_from_hf, load_hf, save_hf
from rcgrpo_jax.models.lora import init_lora
from rcgrpo_jax.models.peft_io import save_adapter
from rcgrpo_jax.models.sharding import make_mesh, use_mesh

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "Params",
    "RopeScaling",
    "apply",
    "config_from_hf",
    "forward",
    "init_lora",
    "init_params",
    "mean_init_rows",
    "load_hf",
    "LoraSpec",
    "make_mesh",
    "param_logical_axes",
    "param_shapes",
    "params_mesh",
    "param_shardings",
    "positions_from_mask",
    "resize_vocab",
    "SAMPLER_WEIGHTS",
    "sampler_param_shapes",
    "sampler_param_shardings",
    "sampler_config",
    "sampler_params",
    "save_adapter",
    "save_hf",
    "SharedPrefix",
    "shared_prefix_logprobs",
    "token_logprobs",
    "use_mesh",
]
