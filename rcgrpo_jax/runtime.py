"""What every stage needs from a config: the mesh, the model, the workdir; and user errors."""

from __future__ import annotations

import os
from pathlib import Path

import ml_collections


class UserError(Exception):
    """A problem with the user's config or inputs: reported as one line, without a traceback."""


def workdir(config: ml_collections.ConfigDict, config_name: str = "run") -> Path:
    path = Path(config.workdir or os.path.join("runs", config_name))
    path.mkdir(parents=True, exist_ok=True)
    return path


def mesh_from_config(config: ml_collections.ConfigDict):
    """Builds the (data, fsdp, tensor) mesh; one -1 entry takes the remaining devices."""
    import jax
    import numpy as np

    from rcgrpo_jax import models

    shape = list(config.mesh.shape)
    n = jax.device_count()
    if shape.count(-1) > 1:
        raise UserError(f"mesh.shape={tuple(shape)}: at most one entry may be -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if n % rest:
            raise UserError(f"mesh.shape={tuple(shape)} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    if int(np.prod(shape)) != n:
        raise UserError(f"mesh.shape={tuple(shape)} uses {int(np.prod(shape))} of {n} devices")
    return models.make_mesh(shape)


def model_from_config(config: ml_collections.ConfigDict, mesh=None):
    """(cfg, params): the HF checkpoint at model.hf_path, or a random model from model.arch."""
    import jax
    import jax.numpy as jnp

    from rcgrpo_jax import models

    m = config.model
    common = dict(remat=m.remat)
    if m.hf_path:
        if not Path(m.hf_path).is_dir():
            raise UserError(f"model.hf_path={m.hf_path!r} does not exist")
        return models.load_hf(
            m.hf_path,
            dtype=jnp.dtype(m.param_dtype),
            mesh=mesh,
            compute_dtype=jnp.dtype(m.dtype),
            **common,
        )
    arch = dict(m.arch.to_dict(), dtype=m.dtype, param_dtype=m.param_dtype, **common)
    try:
        cfg = models.ModelConfig.from_dict(arch)
    except (TypeError, ValueError) as e:
        raise UserError(f"model.arch: {e}") from e
    return cfg, models.init_params(cfg, jax.random.key(config.seed), mesh)


def tokenizer_from_config(config: ml_collections.ConfigDict):
    """The transformers tokenizer at `tokenizer_path`, else the one saved with the model."""
    from transformers import AutoTokenizer

    path = config.tokenizer_path or config.model.hf_path
    if not path:
        raise UserError("no tokenizer: set tokenizer_path or model.hf_path")
    if not Path(path).is_dir():
        raise UserError(f"tokenizer path {path!r} does not exist")
    return AutoTokenizer.from_pretrained(path)
