"""The tiny instruct base's pretraining (`python -m rcgrpo_jax.tools.pretrain_tiny`).

A 3-layer, 64-wide decoder trained from scratch on everyday file-system chores
(`synthetic.PRETRAIN_TEMPLATES`: delete, show, make a folder inside, write a note) that teach
the two copies every demo task needs — a name listed by `ls` and a name quoted by the user —
through functions the demo's templates never call. The result is shipped in
`rcgrpo_jax/assets/tiny_instruct/`, and `configs/tiny.py` starts every arm from it, as the
paper's arms start from an instruct model: the slow, seed-dependent formation of the copy
happens here, once, and not in the demo.
"""

from rcgrpo_jax.config import base_config
from rcgrpo_jax.envs.synthetic import PRETRAIN_TEMPLATES


def get_config():
    c = base_config()
    c.stage = "sft"
    c.mesh.shape = (-1, 1, 1)
    c.env.benchmark = "synthetic"
    c.env.synthetic.num_train = 2000
    c.env.synthetic.num_test = 64
    c.env.synthetic.difficulty.turns = (1, 1)
    c.env.synthetic.difficulty.templates = PRETRAIN_TEMPLATES
    c.env.max_steps_per_turn = 6

    c.model.chat_format = "python"
    c.model.dtype = "float32"
    c.model.scan_layers = False
    c.model.arch.vocab_size = 1024
    c.model.arch.hidden_size = 64
    c.model.arch.intermediate_size = 256
    c.model.arch.num_layers = 3
    c.model.arch.num_heads = 4
    c.model.arch.num_kv_heads = 2
    c.model.arch.head_dim = 16
    c.model.arch.max_position_embeddings = 1024
    # RoPE base 100: with head_dim 16 the default base 10000 barely tells offsets 5, 6 and 7
    # apart, and the fixed-offset copy of a listed name does not form in minutes at 10000.
    c.model.arch.rope_theta = 100.0

    c.rctp.eval_entries = 64
    c.rctp.max_tokens = 128
    c.train.steps = 12000
    c.train.batch_size = 8
    c.train.seq_len = 128
    c.train.checkpoint_every = 1000
    c.train.optim.lr = 1e-2
    c.train.optim.warmup_steps = 20

    c.eval.policy = "model"
    c.eval.max_new_tokens = 32
    c.eval.max_len = 384
    return c
