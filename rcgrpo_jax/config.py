"""The base experiment config; `configs/*.py` start from it and change what differs.

Every key a run reads is declared here (ml_collections rejects unknown overrides), with the
meaning next to it. Overrides: `--config.train.lr=1e-6`.
"""

from __future__ import annotations

import ml_collections

STAGES = ("sft", "rctp", "grpo", "rcgrpo", "eval", "all")
BFCL_CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.stage = "eval"  # one of STAGES
    c.workdir = ""  # everything a run writes goes here; empty = runs/<config name>
    c.seed = 0

    # (data, fsdp, tensor); product must equal the number of devices in use, -1 fills one axis.
    c.mesh = ml_collections.ConfigDict({"shape": (-1, 1, 1)})

    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # Hugging Face model dir (config.json + *.safetensors); "" = random init
    c.model.dtype = "bfloat16"  # compute dtype (norms/softmax accumulate in f32 regardless)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = "none"  # none | full | dots | dots_no_batch
    c.model.chat_format = "qwen"  # qwen | llama | python: how tool calls are written and parsed
    # Architecture of a randomly initialised model (used only when hf_path is empty).
    c.model.arch = ml_collections.ConfigDict(
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "rope_theta": 10000.0,
            "qkv_bias": True,
            "tie_embeddings": True,
            "max_position_embeddings": 4096,
            "family": "qwen2",
        }
    )
    c.tokenizer_path = ""  # "" = model.hf_path

    c.env = ml_collections.ConfigDict()
    c.env.benchmark = "bfcl"  # bfcl | synthetic
    c.env.max_steps_per_turn = 20  # BFCL's MAXIMUM_STEP_LIMIT

    c.eval = ml_collections.ConfigDict()
    c.eval.policy = "model"  # model | ground_truth | empty
    c.eval.split = "test"  # test | train | all
    c.eval.categories = BFCL_CATEGORIES
    c.eval.max_entries = 0  # 0 = all entries of the split
    c.eval.max_new_tokens = 512  # per assistant step
    c.eval.max_len = 16384  # tokens per trajectory (prompt + all turns)
    c.eval.temperature = 0.0  # greedy
    c.eval.batch_size = 0  # entries decoded together (0 = all at once)
    c.eval.reward_token = ml_collections.config_dict.placeholder(int)  # None | 1 high | 0 low

    return c
