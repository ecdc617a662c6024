"""The model a run config plans: its checkpoint's config.json, else an architecture preset named
by the checkpoint directory (the two paper models and Qwen3, so the planner needs no
checkpoint), else `model.arch`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    """A dense Qwen3 checkpoint's config.json (every size: 8 KV heads of 128, rope 1e6, 40k
    context, no sliding window); they differ in width, depth, heads and tied embeddings."""
    return {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": tied,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


# Architectures of the two paper models and of Qwen3 (their HF config.json), keyed by the
# checkpoint directory's name in lower case, so the planner needs no checkpoint.
HF_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b-instruct": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
}


def model_config(config, extra_vocab: int = 0, layers: int = 0):
    """ModelConfig for a run config: the checkpoint's config.json if present, else a preset named
    by the checkpoint directory, else `model.arch` (the random-init architecture); `layers` > 0
    cuts its depth (a quick check of everything but the per-layer memory). With
    `model.lora.rank` > 0 it carries the adapters (`LoraSpec`; only their shapes matter here)."""
    from rcgrpo_jax import models

    m = config.model
    common = dict(
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        scan_layers=bool(m.scan_layers),
        attention=m.attention,
    )
    hf_path = Path(m.hf_path) if m.hf_path else None
    if hf_path is not None and (hf_path / "config.json").is_file():
        cfg = models.config_from_hf(json.loads((hf_path / "config.json").read_text()), **common)
    elif hf_path is not None and hf_path.name.lower() in HF_PRESETS:
        cfg = models.config_from_hf(HF_PRESETS[hf_path.name.lower()], **common)
    elif hf_path is not None:
        raise ValueError(
            f"model.hf_path={m.hf_path!r}: no config.json there and not a known preset "
            f"({', '.join(HF_PRESETS)})"
        )
    else:
        cfg = models.ModelConfig.from_dict(dict(m.arch.to_dict(), **common))
    if layers:
        cfg = cfg.replace(num_layers=int(layers))
    if extra_vocab:
        cfg = cfg.replace(vocab_size=cfg.vocab_size + extra_vocab)
    if int(m.lora.rank) > 0:  # the two reward-token rows train: the vocabulary's last two
        ids = (cfg.vocab_size - 2, cfg.vocab_size - 1)
        cfg = cfg.replace(lora=models.LoraSpec(
            rank=int(m.lora.rank), alpha=float(m.lora.alpha), targets=tuple(m.lora.targets),
            init=str(m.lora.init), token_ids=ids,
        ))  # fmt: skip
    return cfg
