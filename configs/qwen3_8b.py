"""Qwen3-8B on a TPU slice: the paper's recipe on the model most 2026 agentic-RL recipes start from.

`--config.model.hf_path=/mnt/models/Qwen3-8B`. Qwen3 writes tool calls as Qwen2.5 does
(`<tool_call>` JSON: chat format "qwen"); its architecture differs by per-head q/k RMSNorm and
no q/k/v biases (`rcgrpo_jax/models/families.py`). Everything else is `configs/llama8b.py`: the
same width and 8 KV heads (36 layers, a narrower MLP), so the same FSDP x 2-way tensor mesh,
remat, lengths and RL recipe. On v5p-16 the planner gives train / decode / prefill 56.4 / 38.3 /
39.0 GiB per chip of 95 (`python -m rcgrpo_jax.tools.plan --config=configs/qwen3_8b.py`).
"""

from rcgrpo_jax.config import sibling_config


def get_config():
    c = sibling_config(__file__, "llama8b")
    c.model.hf_path = "/mnt/models/Qwen3-8B"
    c.model.chat_format = "qwen"
    return c
