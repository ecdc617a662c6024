"""The whole method on a user's own environment: stage `all` on the calculator of
`examples/calculator_env.py` (docs/custom_env.md), which has only the protocol (tasks, episodes,
reward) and a demonstration per task. The demo's tiny model (`configs/tiny.py`) with a tokenizer
trained at start-up:

    base → warm start: SFT on the calculator's demonstrations (from a random model)
    warm start → SFT:  demonstrations + the warm start's own successful rollouts
    warm start → RCTP: demonstrations + the warm start's rollouts, each labelled by its reward
    SFT → GRPO, RCTP → RC-GRPO at one budget of trajectories

    python -m rcgrpo_jax.main --config=configs/calculator.py --config.workdir=runs/calculator
"""

from rcgrpo_jax.config import sibling_config


def get_config():
    # the model, its stage-1 optimizer and the RL recipe but its lr
    c = sibling_config(__file__, "tiny")
    c.workdir = "runs/calculator"
    c.env.module = "examples.calculator_env"
    c.env.benchmark = "calculator"
    # 512 training tasks, operands up to 99; 128 held-out tasks, never training tasks
    c.env.calculator = {"num_train": 512, "num_test": 128, "seed": 0, "max_operand": 99}
    c.env.max_steps_per_turn = 1  # one call answers a task: the episode ends at it
    c.rl.prompt_split = "train"  # the calculator has no third split

    # Stage 1. The warm start (300 steps on the 512 demonstrations) writes the call and copies
    # some of the operands: ~10% held-out. SFT (100 steps) and RCTP (600: its data has both
    # labels, and the low token must learn to undo a copy the warm start shares) continue on
    # the demonstrations plus one rollout per task of the warm start, labelled by reward. Its
    # failures are calls with the right operation and other numbers, so under <|low_reward|>
    # RCTP writes other numbers.
    c.train.warm_start_steps = 300
    c.train.steps = 100  # SFT's steps after the warm start
    c.rctp.train_steps = 600
    c.rctp.rollouts_per_entry = 1
    c.rctp.rollout_batch = 128  # rows per rollout call
    c.rctp.low_per_high = 1.0
    c.rctp.min_per_label = 16
    c.rctp.eval_entries = 128

    # RL: GRPO from SFT and RC-GRPO from RCTP, 2048 trajectories each (32 iterations of 8 x 8),
    # held-out success at the start and after every 512. At the demo's lr (1e-3) the training
    # reward here falls and held-out success with it; at 1e-4 both arms rise.
    c.arms = ("sft_grpo", "rctp_rcgrpo")
    c.rl.max_rollouts = 2048
    c.rl.steps = 32
    c.rl.eval_points = 4
    c.rl.optim.lr = 1e-4
    c.rl.max_new_tokens = 24  # the longest call is 24 characters
    c.rl.max_len = 192
    c.eval.max_new_tokens = 24
    c.eval.max_len = 192
    c.eval.max_entries = 128
    c.eval.samples = 0
    return c
