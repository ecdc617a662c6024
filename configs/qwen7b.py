"""Qwen2.5-7B-Instruct on a TPU slice (the paper's main model).

Point `model.hf_path` at a local copy of the Hugging Face checkpoint (e.g. copied to the VM's disk
or a mounted bucket): `--config.model.hf_path=/mnt/models/Qwen2.5-7B-Instruct`.
"""

from rcgrpo_jax.config import base_config, bfcl_rl_recipe


def get_config():
    c = base_config()
    c.stage = "all"
    c.model.hf_path = "/mnt/models/Qwen2.5-7B-Instruct"
    c.model.chat_format = "qwen"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"  # 7B with full-length multi-turn trajectories needs it on 16 GiB chips
    c.mesh.shape = (1, -1, 1)  # FSDP over the whole slice
    # auto = Pallas splash attention on a TPU (flash on CPU beyond 1k tokens): memory O(T * block)
    c.model.attention = "auto"
    # RL at rl.max_len = 16384: 4 microbatches of 2 groups (16 rows), 2 rows per chip
    # on v5p-16, 1 on v6e-16 (`python -m rcgrpo_jax.tools.plan --config=configs/qwen7b.py`).
    # v5e-32 has more chips than a microbatch has rows: `--config.mesh.shape=auto` finds 1x16x2.
    c.rl.optim.grad_accum = 4
    # Stage 1 packs whole trajectories into 16384-token rows: with Qwen's tokenizer 66% of BFCL's
    # golden trajectories pass 4096 tokens, 9% 8192 and 5% (long_context) 16384; those last are
    # dropped (data_report.json counts them as too_long). A step of 8 such rows ~ the planner's
    # `--prompts=1 --group=8 --grad_accum=1 --programs=train`: 31.6 GiB/chip on v5p-16.
    c.train.seq_len = 16384
    c.rctp.max_tokens = 16384
    bfcl_rl_recipe(c)  # dynamic sampling, 2 epochs, warm-up, own failures in RCTP's data
    return c
