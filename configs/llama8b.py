"""LLaMA-3.1-8B-Instruct on a TPU slice (the paper's second model).

`--config.model.hf_path=/mnt/models/Llama-3.1-8B-Instruct`.
"""

from rcgrpo_jax.config import base_config, bfcl_rl_recipe


def get_config():
    c = base_config()
    c.stage = "all"
    c.model.hf_path = "/mnt/models/Llama-3.1-8B-Instruct"
    c.model.chat_format = "llama"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    # FSDP x 2-way tensor: the train step's activations split over 2 (GiB/chip: v5p-16 53.9 of
    # 95, v6e-16 27.8 of 32). v5e-32 needs 1x8x4 with rl.optim.grad_accum=8, which
    # `--config.mesh.shape=auto` finds
    # (`python -m rcgrpo_jax.tools.plan --config=configs/llama8b.py --topology=v5e-32`).
    c.mesh.shape = (1, -1, 2)
    # auto = Pallas splash attention on a TPU (flash on CPU beyond 1k tokens): memory O(T * block)
    c.model.attention = "auto"
    # RL at rl.max_len = 16384: 4 microbatches of 2 groups (16 rows), 4 rows per FSDP
    # shard on v5p-16 (`python -m rcgrpo_jax.tools.plan --config=configs/llama8b.py` fits).
    c.rl.optim.grad_accum = 4
    # Stage 1 packs whole trajectories into 16384-token rows: with Qwen's tokenizer 66% of BFCL's
    # golden trajectories pass 4096 tokens, 9% 8192 and 5% (long_context) 16384; those last are
    # dropped (data_report.json counts them as too_long). A step of 8 such rows ~ the planner's
    # `--prompts=1 --group=8 --grad_accum=1 --programs=train`: 33.1 GiB/chip on v5p-16.
    c.train.seq_len = 16384
    c.rctp.max_tokens = 16384
    bfcl_rl_recipe(c)  # dynamic sampling, 2 epochs, warm-up, own failures in RCTP's data
    return c
