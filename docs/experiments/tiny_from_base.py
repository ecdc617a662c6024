"""The demo as it would run from a shipped tiny instruct base (not the default; see
docs/experiments/tiny_default.md, "A shipped base instead of a from-scratch model").

Write a base first (`python -m rcgrpo_jax.tools.pretrain_tiny`, into rcgrpo_jax/assets/), then
`python -m rcgrpo_jax.main --config=docs/experiments/tiny_from_base.py`. With the bases made so
far, stage 1 stays at 0%: the stage-1 and RL settings below are the untried first guesses.
`configs/tiny.py` with what differs: the base (its architecture and tokenizer come with it),
the demo family it is made for, no warm start, fine-tuning rates, a longer RL budget.
"""

from pathlib import Path

from rcgrpo_jax import assets
from rcgrpo_jax.config import config_from_file
from rcgrpo_jax.envs.synthetic import BASE_DEMO_TEMPLATES

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.py"


def get_config():
    c = config_from_file(TINY)
    c.model.hf_path = str(assets.TINY_INSTRUCT)
    c.env.synthetic.num_test = 64
    c.env.synthetic.difficulty.templates = BASE_DEMO_TEMPLATES
    # the environment and rows the bases were made for (before the demo's names had roles)
    c.env.synthetic.difficulty.name_roles = False
    c.env.synthetic.difficulty.depth, c.env.synthetic.difficulty.distractors = 2, 1
    c.train.seq_len = c.rctp.max_tokens = 128
    c.rctp.eval_entries = c.eval.max_entries = 64
    c.train.warm_start_steps = 0
    c.train.steps, c.rctp.train_steps = 100, 150  # the same passes over the golden examples
    c.train.optim.lr, c.train.optim.warmup_steps = 1e-3, 10
    c.rl.steps = c.rl.eval_every = 24
    c.rl.checkpoint_every = 8
    c.rl.optim.lr = 1e-3
    return c
