"""PEFT's LoRA adapter directories (adapter_config.json + adapter_model.safetensors) both ways:
`save_adapter` writes what `peft.PeftModel.from_pretrained(base, path)` loads, and
`load_adapter_dir` (what `models.load_hf` does with such a directory) reads one onto its base.
Tensor names and layouts come from the LoRA rows of `models.weights` (PEFT's keys, torch
Linear layouts); what ours cannot compute the same way (DoRA, biases, per-layer ranks, module
patterns) is a one-line `CheckpointError`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from rcgrpo_jax.models import api, lora
from rcgrpo_jax.models.config import LORA_TARGETS as TARGET_NAMES
from rcgrpo_jax.models.config import LoraSpec, ModelConfig
from rcgrpo_jax.models.hf_io import (
    ADAPTER_CONFIG,
    CheckpointError,
    SafetensorsReader,
    hf_names,
    load_hf,
    to_hf,
    to_ours,
)
from rcgrpo_jax.models.weights import LORA_TARGETS, lookup, nest, weights

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_adapter_dir(
    path: Path, base: str | os.PathLike | None, merge: bool, **load_options: Any
) -> tuple[ModelConfig, api.Params]:
    """`models.load_hf` of adapter directory `path`: its base (`base`, else the adapter's
    `base_model_name_or_path`) with the adapter on top; merged (the base config) or not (the
    LoRA config and the base's tree plus the adapter's leaves)."""
    spec = spec_from_peft(path)
    base = base or json.loads((path / ADAPTER_CONFIG).read_text()).get(
        "base_model_name_or_path", ""
    )
    if not base:
        raise CheckpointError(f"{path}: a LoRA adapter without a base model; pass base=")
    cfg, params = load_hf(base, **load_options)
    if spec.token_ids and max(spec.token_ids) >= cfg.vocab_size:
        cfg, params = api.resize_vocab(cfg, params, max(spec.token_ids) + 1)
    cfg, params = load_adapter(path, cfg, params)
    mesh = load_options.get("mesh")
    if mesh is not None:
        params = jax.device_put(params, api.param_shardings(cfg, mesh))
    if not merge:
        return cfg, params
    return cfg.base(), jax.jit(lora.merge, static_argnums=0)(cfg, params)


def _module_names(targets: tuple[str, ...]) -> list[str]:
    return sorted(t.module.split(".")[-1] for t in LORA_TARGETS if t.name in targets)


def peft_config(cfg: ModelConfig, base_model: str) -> dict[str, Any]:
    """The adapter_config.json PEFT's `LoraConfig` reads back as this adapter."""
    spec = cfg.lora
    if spec is None:
        raise ValueError("peft_config needs a config with lora set")
    tokens: Any = None
    if spec.token_ids:
        ids = list(spec.token_ids)
        tokens = ids if cfg.tie_embeddings else {"embed_tokens": ids, "lm_head": ids}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": _module_names(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.rslora,
        "use_dora": False,
        "init_lora_weights": True if spec.init == "kaiming" else "gaussian",
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "trainable_token_indices": tokens,
        "inference_mode": True,
    }


def save_adapter(
    path: str | os.PathLike, cfg: ModelConfig, params: api.Params, base_model: str = ""
) -> None:
    """Writes `params`' adapters and token rows as a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors, float32), which
    `peft.PeftModel.from_pretrained(base, path)` loads onto the base model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for w in weights(cfg):
        if not w.lora:
            continue
        value = np.asarray(jax.device_get(lookup(params, w.path)), np.float32)
        for i, name in enumerate(hf_names(w, cfg)):
            tensors[name] = np.ascontiguousarray(to_hf(w, value[i] if w.per_layer else value))
    safetensors.numpy.save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, base_model), indent=2))


def spec_from_peft(path: str | os.PathLike) -> LoraSpec:
    """The `LoraSpec` of a PEFT adapter directory; a one-line CheckpointError for what ours
    cannot compute the same way (DoRA, biases, per-layer ranks, ...)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        c = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from e
    unsupported = {
        "peft_type": ("LORA",),
        "use_dora": (False, None),
        "bias": ("none", None),
        "fan_in_fan_out": (False, None),
        "modules_to_save": (None, []),
        "layers_to_transform": (None, []),
        "layers_pattern": (None, []),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
    }
    for key, ok in unsupported.items():
        if c.get(key, ok[0]) not in ok:
            raise CheckpointError(f"{file}: {key}={c[key]!r} is not supported (expected {ok[0]!r})")
    modules = c.get("target_modules") or []
    if isinstance(modules, str):
        raise CheckpointError(f"{file}: target_modules as a pattern ({modules!r}) is not supported")
    by_module = {t.module.split(".")[-1]: t.name for t in LORA_TARGETS}
    unknown = sorted(set(modules) - set(by_module))
    if unknown or not modules:
        raise CheckpointError(
            f"{file}: target_modules {modules}: expected a subset of {sorted(by_module)}"
        )
    tokens = c.get("trainable_token_indices") or []
    if isinstance(tokens, dict):
        if set(tokens) - {"embed_tokens", "lm_head"}:
            raise CheckpointError(f"{file}: trainable_token_indices for {sorted(tokens)}")
        ids = [tuple(v) for v in tokens.values()]
        if len(set(ids)) > 1:
            raise CheckpointError(f"{file}: embed_tokens and lm_head train different tokens")
        tokens = list(ids[0]) if ids else []
    init = c.get("init_lora_weights", True)
    return LoraSpec(
        rank=int(c["r"]),
        alpha=float(c.get("lora_alpha", 8)),
        targets=tuple(n for n in TARGET_NAMES if n in {by_module[m] for m in modules}),
        init="gaussian" if init == "gaussian" else "kaiming",
        token_ids=tuple(int(t) for t in tokens),
        rslora=bool(c.get("use_rslora", False)),
    )


def load_adapter(
    path: str | os.PathLike, cfg: ModelConfig, params: api.Params
) -> tuple[ModelConfig, api.Params]:
    """(the LoRA config, the base's `params` with the adapter of PEFT directory `path` added).
    `cfg`/`params` are the base's (`models.load_hf`), its vocabulary already as large as the
    adapter's token indices need (PEFT does not resize either)."""
    spec = spec_from_peft(path)
    if spec.token_ids and max(spec.token_ids) >= cfg.vocab_size:
        raise CheckpointError(
            f"{path}: trainable token {max(spec.token_ids)} is outside the base's vocabulary "
            f"({cfg.vocab_size}); resize the base first"
        )
    lcfg = cfg.replace(lora=spec)
    reader = SafetensorsReader(path)
    leaves = []
    for w in weights(lcfg):
        if not w.lora:
            continue
        names = hf_names(w, lcfg)
        per = [to_ours(w, reader.read(n), lcfg).astype(np.float32) for n in names]
        leaves.append((w.path, jnp.asarray(np.stack(per) if w.per_layer else per[0])))
    expected = {n for w in weights(lcfg) if w.lora for n in hf_names(w, lcfg)}
    extra = sorted(set(reader.tensors) - expected)
    if extra:
        raise CheckpointError(f"{path}: unexpected adapter tensors: {extra[:5]}")
    return lcfg, lora.join(nest(leaves), params)
