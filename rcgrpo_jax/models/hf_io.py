"""Hugging Face checkpoints in and out, tensor by tensor.

Loading never materialises the whole model on the host: each weight is read from its
memory-mapped safetensors file when a device asks for its slice (`jax.make_array_from_callback`),
converted, and placed on the mesh; saving fetches one weight at a time and holds at most one
output file's tensors. Files go through the safetensors library (numpy arrays, so bf16 needs no
torch); its errors are re-raised as `CheckpointError`s naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from jax.sharding import Mesh

from rcgrpo_jax.models import api, lora
from rcgrpo_jax.models.config import ModelConfig, RopeScaling
from rcgrpo_jax.models.families import FAMILIES, qkv_bias_mismatch
from rcgrpo_jax.models.weights import Weight, base_weights, lookup, nest, weights


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; names file and tensor."""


_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
# Buffers some old exports carry; recomputed here, so skipping them loses nothing.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config mapping


# config.json values where a key is absent (transformers' config classes' defaults), unless the
# family declares its own (`Family.hf_defaults`); head_dim None: hidden_size / heads.
HF_DEFAULTS: dict[str, Any] = {
    "head_dim": None,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Maps a transformers config.json (v4 `rope_scaling` or v5 `rope_parameters`) to ours,
    as its family (`models.families`, by `model_type`) declares it."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"config.json: model_type {model_type!r} is not supported ({', '.join(FAMILIES)})"
        )
    family = FAMILIES[model_type]
    defaults = {**HF_DEFAULTS, **dict(family.hf_defaults)}
    get = lambda key: hf.get(key, defaults[key])
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu)"
        )
    on = [k for k in dict.fromkeys(("mlp_bias", *family.off_flags)) if hf.get(k)]
    if on:
        raise CheckpointError(f"config.json: {model_type} {'/'.join(on)} not supported")
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json: use_sliding_window=true is not supported")
    windowed = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if windowed:
        raise CheckpointError(
            f"config.json: layer_types {'/'.join(windowed)} not supported (full_attention)"
        )
    rope = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", get("rope_theta")))
    scaling = rope if rope.get("rope_type", "default") != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in family.rope_types:
        raise CheckpointError(
            f"config.json: rope type {rope_type!r} is not supported for {model_type} "
            f"({', '.join(family.rope_types)})"
        )
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    else:
        rope_scaling = None
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        qkv_bias=family.qkv_bias,
        tie_embeddings=bool(get("tie_word_embeddings")),
        max_position_embeddings=int(get("max_position_embeddings")),
        family=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope.update(dataclasses.asdict(cfg.rope_scaling), rope_type="llama3")
    eos = cfg.eos_token_id
    family = FAMILIES[cfg.family]
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "dtype": dtype,
    }
    out.update(dict.fromkeys(family.off_flags, False))
    need = qkv_bias_mismatch(cfg.family, cfg.qkv_bias)
    if need:
        raise CheckpointError(f"cannot export qkv_bias={cfg.qkv_bias}: expected {need}")
    return out


# ----------------------------------------------------------------------------- weight mapping
# Names and layouts come from `models.weights` (`Weight.hf_name`, `Weight.hf_dims`).


def to_hf(w: Weight, x: np.ndarray) -> np.ndarray:
    """One layer's (or an unstacked) weight in transformers' layout."""
    order = [d for group in w.hf_dims for d in group]
    return x.transpose(order).reshape([math.prod(x.shape[d] for d in g) for g in w.hf_dims])


def to_ours(w: Weight, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    shape = w.shape(cfg)
    order = [d for group in w.hf_dims for d in group]
    return x.reshape([shape[d] for d in order]).transpose(np.argsort(order))


# ----------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]


class SafetensorsReader:
    """Every tensor of a checkpoint directory (one file, or shards listed in an index), read
    with the safetensors library; its errors are re-raised naming the file and the tensor."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map_ = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from e
            files = sorted({self.directory / f for f in weight_map_.values()})
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        self.tensors: dict[str, _TensorInfo] = {}
        self._handles: dict[Path, Any] = {}  # one open (memory-mapped) file each
        for f in files:
            self.tensors.update(self._index(f))

    def _index(self, path: Path) -> dict[str, _TensorInfo]:
        if not path.exists():
            raise CheckpointError(f"{path}: listed in the index but missing")
        try:
            handle = self._handles[path] = safetensors.safe_open(str(path), framework="numpy")
        except safetensors.SafetensorError as e:
            raise CheckpointError(
                f"{path}: not a readable safetensors file ({e}; truncated?)"
            ) from e
        out = {}
        for name in handle.keys():
            view = handle.get_slice(name)
            if view.get_dtype() not in _ST_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has unsupported dtype {view.get_dtype()}"
                )
            out[name] = _TensorInfo(path, _ST_DTYPES[view.get_dtype()], tuple(view.get_shape()))
        return out

    def info(self, name: str) -> _TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        t = self.info(name)
        try:
            return self._handles[t.file].get_tensor(name)
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"{t.file}: tensor {name!r} unreadable ({e})") from e


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, tuple[int, ...], np.dtype]],
    fetch: Callable[[str], np.ndarray],
) -> None:
    """Writes one file of tensors fetched one at a time (the file's tensors are held until
    it is written: `save_hf`'s `max_shard_bytes` bounds the host memory)."""
    arrays = {}
    for name, shape, dtype in tensors:
        arr = np.ascontiguousarray(fetch(name), dtype=dtype)
        if arr.shape != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {arr.shape}, expected {shape}"
            )
        arrays[name] = arr
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- load / save

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory (`models.peft_io`)


def hf_names(w: Weight, cfg: ModelConfig) -> list[str]:
    return [w.hf_name.format(i=i) for i in range(cfg.num_layers)] if w.per_layer else [w.hf_name]


def load_hf(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    compute_dtype: Any = None,
    base: str | os.PathLike | None = None,
    merge: bool = True,
    **config_overrides: Any,
) -> tuple[ModelConfig, api.Params]:
    """Reads config.json + safetensors into (cfg, params), sharded over `mesh` when given.

    `dtype` is the parameter dtype; `compute_dtype` defaults to it (e.g. f32 params with bf16
    compute for training). Other ModelConfig fields (remat, ...) can be overridden by keyword.

    A PEFT LoRA adapter directory (adapter_config.json, no config.json) loads on top of its base:
    `base`, else the adapter's `base_model_name_or_path`. With `merge` the adapter is folded
    into the base (the base config; what `save_hf` of the LoRA model writes), else the LoRA
    config and the base's tree plus the adapter's leaves.
    """
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").exists():
        from rcgrpo_jax.models import peft_io  # it reads the base through this function

        return peft_io.load_adapter_dir(
            path, base, merge, dtype=dtype, mesh=mesh, compute_dtype=compute_dtype,
            **config_overrides,
        )  # fmt: skip
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: unreadable ({e})") from e
    overrides = {
        "param_dtype": jnp.dtype(dtype).name,
        "dtype": jnp.dtype(compute_dtype or dtype).name,
        **config_overrides,
    }
    cfg = config_from_hf(hf, **overrides)
    reader = SafetensorsReader(path)
    shardings = api.param_shardings(cfg, mesh) if mesh is not None else None
    device = jax.devices()[0]
    table = weights(cfg)

    expected = {n for w in table for n in hf_names(w, cfg)}
    if cfg.tie_embeddings:
        expected.add("lm_head.weight")  # some tied exports carry it; it equals the embedding
    extra = sorted(
        n for n in reader.tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
    )
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors for a {cfg.family} config: {extra[:5]}")

    leaves = []
    for w in table:
        names = hf_names(w, cfg)
        for n in names:
            got = reader.info(n).shape
            want = to_hf(w, np.empty(w.shape(cfg), np.bool_)).shape
            if tuple(got) != tuple(want):
                raise CheckpointError(
                    f"{reader.info(n).file}: tensor {n!r} has shape {tuple(got)}, "
                    f"config expects {tuple(want)}"
                )
        target_dtype = cfg.weight_dtype

        def load_slice(index: tuple[slice, ...], w=w, names=names, dtype=target_dtype):
            if not w.per_layer:
                return to_ours(w, reader.read(names[0]), cfg)[index].astype(dtype)
            layers = range(len(names))[index[0]]
            return np.stack(
                [to_ours(w, reader.read(names[i]), cfg)[index[1:]].astype(dtype) for i in layers]
            )

        sharding = (
            lookup(shardings, w.path)
            if shardings is not None
            else jax.sharding.SingleDeviceSharding(device)
        )
        leaves.append((w.path, _make_array(w.full_shape(cfg), sharding, load_slice)))
    return cfg, nest(leaves)


def _make_array(shape, sharding, load_slice) -> jax.Array:
    memo: dict[Any, np.ndarray] = {}  # replicated shards ask for the same slice on every device

    def cb(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in memo:
            memo[key] = load_slice(index)
        return memo[key]

    return jax.make_array_from_callback(tuple(shape), sharding, cb)


def save_hf(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: api.Params,
    *,
    dtype: Any = None,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads. A LoRA
    model is written merged (its adapters folded into the base on the host, one weight at a
    time: `lora.merged_weight`); `lora.save_adapter` writes the adapter alone."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    if out_dtype not in _ST_NAMES:
        raise CheckpointError(f"cannot write dtype {out_dtype} to safetensors")
    table = base_weights(cfg)
    tensors: list[tuple[str, tuple[int, ...], np.dtype]] = []
    source: dict[str, tuple[Weight, int | None]] = {}
    for w in table:
        leaf = lookup(params, w.path)
        layer_shape = leaf.shape[1:] if w.per_layer else leaf.shape
        shape = to_hf(w, np.empty(layer_shape, np.bool_)).shape
        for i, n in enumerate(hf_names(w, cfg)):
            tensors.append((n, tuple(shape), out_dtype))
            source[n] = (w, i if w.per_layer else None)

    shards = list(_split_shards(tensors, max_shard_bytes))
    cache: dict[tuple[str, ...], np.ndarray] = {}

    def fetch(name: str) -> np.ndarray:
        w, i = source[name]
        if w.path not in cache:
            cache.clear()  # one of our (stacked) weights on the host at a time
            value = np.asarray(jax.device_get(lookup(params, w.path)))
            cache[w.path] = lora.merged_weight(cfg, w, value, params, np)
        arr = cache[w.path] if i is None else cache[w.path][i]
        return to_hf(w, arr)

    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for fname, shard in zip(files, shards, strict=True):
        _write_safetensors(path / fname, shard, fetch)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(int(np.prod(s)) * d.itemsize for _, s, d in tensors)},
            "weight_map": {
                n: f for f, shard in zip(files, shards, strict=True) for n, _, _ in shard
            },
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    elif (path / "model.safetensors.index.json").exists():
        (path / "model.safetensors.index.json").unlink()
    hf = config_to_hf(cfg.base(), dtype=jnp.dtype(out_dtype).name)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def _split_shards(tensors, max_bytes: int) -> Iterator[list]:
    shard: list = []
    size = 0
    for t in tensors:
        nbytes = int(np.prod(t[1])) * t[2].itemsize
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(t)
        size += nbytes
    if shard:
        yield shard
