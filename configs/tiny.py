"""The embedded default: a tiny random model on CPU, seconds to minutes, no downloads."""

from rcgrpo_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "eval"
    c.model.dtype = "float32"
    c.model.chat_format = "python"
    c.eval.policy = "ground_truth"
    return c
