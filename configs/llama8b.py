"""LLaMA-3.1-8B-Instruct on a TPU slice (the paper's second model).

`--config.model.hf_path=/mnt/models/Llama-3.1-8B-Instruct`.
"""

from rcgrpo_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "all"
    c.model.hf_path = "/mnt/models/Llama-3.1-8B-Instruct"
    c.model.chat_format = "llama"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    c.mesh.shape = (1, -1, 1)
    return c
