"""The tiny instruct base's pretraining (`python -m rcgrpo_jax.tools.pretrain_tiny`).

The demo's model (`configs/tiny.py`: a 3-layer, 64-wide decoder, f32, RoPE base 100; rows of
128 tokens) trained from scratch with stage `sft` on everyday file-system chores
(`synthetic.PRETRAIN_TEMPLATES`: delete, show, move or back up the top file, make a folder
inside, make an empty file) that teach the copies the demo's tasks need. Everything the demo
sets for its own stages and arms is put back to the defaults, so this is the demo's model and
environment with the pretraining's data and schedule.
"""

from rcgrpo_jax.config import base_config, sibling_config
from rcgrpo_jax.envs.synthetic import PRETRAIN_TEMPLATES


def get_config():
    c, default = sibling_config(__file__, "tiny"), base_config()
    c.stage = "sft"
    for key in ("rl", "eval"):  # the demo's RL arms and evaluation are not pretraining's
        c[key] = default[key]
    for key in ("perturbations", "low_per_high", "train_steps"):
        c.rctp[key] = default.rctp[key]
    c.train.warm_start_steps = 0
    # Names without roles and the default depth and distractors: the environment the
    # pretraining was built and measured on (docs/experiments/tiny_default.md, "A shipped base
    # instead of a from-scratch model").
    c.env.synthetic.difficulty.name_roles = False
    c.env.synthetic.difficulty.depth = default.env.synthetic.difficulty.depth
    c.env.synthetic.difficulty.distractors = default.env.synthetic.difficulty.distractors
    c.train.seq_len = c.rctp.max_tokens = 128
    c.env.synthetic.num_train = 2000
    c.env.synthetic.num_test = 64
    c.env.synthetic.difficulty.templates = PRETRAIN_TEMPLATES
    c.rctp.eval_entries = 64
    c.train.steps = 12000
    c.train.checkpoint_every = 1000
    c.eval.policy = "model"
    c.eval.max_new_tokens = 32
    c.eval.max_len = 384
    return c
