"""The demo as it would run from a shipped tiny instruct base (not the default; see
docs/experiments/tiny_default.md, "A shipped base instead of a from-scratch model").

Write a base first (`python -m rcgrpo_jax.tools.pretrain_tiny`, into rcgrpo_jax/assets/), then
`python -m rcgrpo_jax.main --config=docs/experiments/tiny_from_base.py`. With the bases made so
far, stage 1 stays at 0%: the stage-1 and RL settings below are the untried first guesses.
"""

from rcgrpo_jax import assets
from rcgrpo_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "all"
    c.mesh.shape = (-1, 1, 1)
    c.env.benchmark = "synthetic"
    c.env.synthetic.num_train = 400
    c.env.synthetic.num_test = 64
    # One-turn tasks on the file at the top (the last `ls` entry): copy it into the first or
    # the second folder, or move it into the second. The base learned every piece (listing,
    # copying listed names, the cp/mv syntax, these words) but none of these combinations.
    c.env.synthetic.difficulty.turns = (1, 1)
    c.env.synthetic.difficulty.templates = (
        "copy_into_first",
        "copy_into_second",
        "move_into_second",
    )
    c.env.max_steps_per_turn = 6  # the ground truth needs 2

    c.model.hf_path = str(assets.TINY_INSTRUCT)  # its architecture and tokenizer come with it
    c.model.chat_format = "python"
    c.model.dtype = "float32"
    c.model.scan_layers = False  # 3 layers: the unrolled loop is the faster step on CPU

    # Stage 1, both arms from the base. SFT: the golden trajectories. RCTP: golden + label-0
    # examples (`premature_stop`: look, then stop without acting), each behind its reward
    # token, for the same number of passes over the golden ones.
    c.rctp.eval_entries = 64
    c.rctp.perturbations = ("premature_stop",)
    c.rctp.low_per_high = 0.5
    c.rctp.max_tokens = 128  # every example fits one row (the longest golden one: 122 tokens)
    c.rctp.train_steps = 150  # stage `all`: RCTP's steps
    c.train.steps = 100  # SFT's steps
    c.train.batch_size = 8  # rows of one example each
    c.train.seq_len = 128
    c.train.checkpoint_every = 500
    c.train.optim.lr = 1e-3
    c.train.optim.warmup_steps = 10

    # Stage 2, the same budget for every arm: 24 iterations x 8 prompts x 4 rollouts, sampled
    # from the policy itself (temperature 1); RC-GRPO puts 3 high tokens and 1 low in a group.
    c.rl.steps = 24
    c.rl.num_prompts = 8
    c.rl.group_size = 4
    c.rl.p_high = 0.75
    c.rl.temperature = 1.0
    c.rl.max_new_tokens = 32  # the longest ground-truth message is 23 tokens
    c.rl.max_len = 384
    c.rl.eval_every = 24
    c.rl.checkpoint_every = 8
    c.rl.optim.lr = 1e-3

    c.eval.policy = "model"
    c.eval.max_new_tokens = 32
    c.eval.max_len = 384
    c.eval.max_entries = 64
    return c
