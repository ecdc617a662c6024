"""The embedded default: the paper's experiment at toy scale on a laptop CPU, no downloads.

Synthetic multi-turn file-system tasks over bfcl-eval's GorillaFileSystem simulator (the same
executor and reward as BFCL), a SentencePiece tokenizer trained at start-up, and a tiny decoder
trained from scratch: base → SFT → GRPO, RCTP → RC-GRPO, RCTP → GRPO.
"""

from rcgrpo_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "all"
    c.mesh.shape = (-1, 1, 1)
    c.env.benchmark = "synthetic"
    c.env.synthetic.num_train = 400
    c.env.synthetic.num_test = 32
    c.env.synthetic.difficulty.turns = (1, 2)  # (1, 3): trajectories to ~440 tokens
    c.env.max_steps_per_turn = 6  # the ground truth needs at most 4 per turn

    c.model.chat_format = "python"
    c.model.dtype = "float32"
    c.model.arch.vocab_size = 1024
    c.model.arch.hidden_size = 64  # 128 (0.72M params): ~4x slower per step on 2 cores
    c.model.arch.intermediate_size = 256
    c.model.arch.num_layers = 3
    c.model.arch.num_heads = 4
    c.model.arch.num_kv_heads = 2
    c.model.arch.head_dim = 16
    c.model.arch.max_position_embeddings = 1024

    c.rctp.eval_entries = 32
    c.train.steps = 150
    c.train.batch_size = 4
    c.train.seq_len = 512
    c.train.checkpoint_every = 100
    c.train.optim.lr = 5e-3
    c.train.optim.warmup_steps = 20

    c.rl.steps = 8
    c.rl.num_prompts = 8
    c.rl.group_size = 4
    c.rl.p_high = 0.5
    c.rl.max_new_tokens = 32  # the longest ground-truth message is 23 tokens
    c.rl.max_len = 384  # the longest ground-truth trajectory is ~330 tokens
    c.rl.eval_every = 8
    c.rl.checkpoint_every = 4
    c.rl.optim.lr = 1e-4

    c.eval.policy = "model"
    c.eval.max_new_tokens = 32
    c.eval.max_len = 384
    c.eval.max_entries = 32
    return c
