"""The embedded default: the paper's experiment at toy scale on a laptop CPU, no downloads.

Synthetic multi-turn file-system tasks over bfcl-eval's GorillaFileSystem simulator (the same
executor and reward as BFCL), a SentencePiece tokenizer trained at start-up, and a tiny decoder
trained from scratch: base → warm start (SFT) → SFT → GRPO, warm start → RCTP → RC-GRPO, each
RL arm plain and with dynamic sampling, all at one budget of trajectories (`rl.arms.ARMS`).
"""

from rcgrpo_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "all"
    c.mesh.shape = (-1, 1, 1)
    c.env.benchmark = "synthetic"
    c.env.synthetic.num_train = 400
    c.env.synthetic.num_test = 128
    # RL's prompts: 400 tasks over a third set of names that neither stage 1 nor the held-out
    # tasks use (`rl.prompt_split`). On stage 1's own prompts the policy is mostly right and its
    # held-out failures (names it has not seen) do not occur, so RL there has nothing the
    # held-out set measures to fix (docs/experiments/tiny_default.md, "Why RL does not move
    # held-out success").
    c.env.synthetic.num_rl = 400
    # One-turn tasks of three kinds (`synthetic.MAIN_TEMPLATES`):
    # - count_top / copy_top / rename_top: act on the top folder's only file (listed by `ls`),
    #   maybe naming a new file the user quotes;
    # - rename_by_ext: enter a named folder, list it, rename its file of a given extension;
    # - clone_text: enter, list, read a file, write its words into a new file.
    # Folders, files and new names come from disjoint syllables (`name_roles`): the agent finds
    # a name by its role (and, in a folder of two files, its extension), not by its position:
    # a copy the 1000 warm-start steps form, where a copy by position waits out a plateau
    # whose length rides on the seed and the rounding (docs/experiments/tiny_default.md, "Names
    # found by role, not by position"; on 1 core: "Seeds 0–4 on one core"). clone_text's words
    # share one role and must be copied in order, which the tiny model does not learn: it
    # keeps stage 1 below the ceiling.
    c.env.synthetic.difficulty.turns = (1, 1)
    c.env.synthetic.difficulty.templates = (
        "count_top", "copy_top", "rename_top", "rename_by_ext", "clone_text",
    )  # fmt: skip
    c.env.synthetic.difficulty.name_roles = True
    c.env.synthetic.difficulty.depth = 1
    c.env.synthetic.difficulty.distractors = 1
    c.env.max_steps_per_turn = 6  # the ground truth needs at most 4 per turn

    c.model.chat_format = "python"
    c.model.dtype = "float32"
    c.model.scan_layers = False  # 3 layers: the unrolled loop is the faster step on CPU
    # A 1024-token head on 64 wide rows is a small part of the step here: gathering saves little
    # and costs a program per (T, K) bucket (docs/benchmarks.md, "The head only where the loss
    # is").
    c.model.gather_head = False
    c.model.arch.vocab_size = 1024
    c.model.arch.hidden_size = 64  # 128 (0.72M params): ~4x slower per step on 2 cores
    c.model.arch.intermediate_size = 256
    c.model.arch.num_layers = 3
    c.model.arch.num_heads = 4
    c.model.arch.num_kv_heads = 2
    c.model.arch.head_dim = 16
    c.model.arch.max_position_embeddings = 1024
    # RoPE base 100: with head_dim 16 the default base 10000 barely tells offsets 5, 6 and 7
    # apart, and the fixed-offset name copy the tasks need does not form in minutes at 10000.
    c.model.arch.rope_theta = 100.0

    c.rctp.eval_entries = 128  # stage 1 held out on the same 128 tasks as RL
    # Stage 1. Both arms start from one warm start (1000 SFT steps on the 400 golden
    # trajectories, a stand-in for the instruct model the paper's arms share), then split: SFT
    # 200 more steps, RCTP 300 steps on 400 golden + 200 label-0 examples (the same epochs per
    # golden trajectory). docs/experiments/tiny_default.md has the measurements behind this.
    # Low-reward pool: only `premature_stop` (look, then stop without acting). On these tasks
    # `extra_step` and `wrong_order` mostly still score 1 while acting on a name not yet seen,
    # and `missing_step`/`wrong_arg` put unseen or swapped names into the low examples.
    c.rctp.perturbations = ("premature_stop",)
    c.rctp.low_per_high = 0.5
    c.rctp.max_tokens = 256  # every example fits one row (the longest golden one: 165)
    c.rctp.train_steps = 300  # stage `all`: RCTP's steps after the warm start
    c.train.warm_start_steps = 1000
    c.train.steps = 200  # SFT's steps after the warm start
    c.train.batch_size = 8  # rows of one example each
    c.train.seq_len = 256
    c.train.checkpoint_every = 500
    c.train.optim.lr = 1e-2
    c.train.optim.warmup_steps = 20

    # The arms, at equal cost: the paper's GRPO and RC-GRPO (one round of 8 x 8 rollouts per
    # iteration, an update only where a group carries signal) and both again with DAPO's
    # dynamic sampling (degenerate groups dropped and refilled: up to 4 rounds per iteration).
    # `--config.arms="('grid',)"` runs all eight cells (`rcgrpo_jax/rl/arms.py`).
    c.arms = ("sft_grpo", "rctp_rcgrpo", "sft_grpo_dynamic", "rctp_rcgrpo_dynamic")
    # Every arm generates the same 2048 trajectories however many iterations that takes (a
    # plain arm 32, a dynamic one 8-32); rl.steps is only a cap, set above any arm's need.
    c.rl.max_rollouts = 2048
    c.rl.steps = 64
    c.rl.num_prompts = 8
    c.rl.prompt_split = "rl"
    c.rl.dynamic_max_rounds = 4
    # 8 rollouts per prompt: at 4, a policy that solves a prompt 90% of the time makes a
    # degenerate group two times in three; at 8, one in two (docs/experiments/tiny_default.md).
    c.rl.group_size = 8
    # RL samples from the policy itself (temperature 1) and draws the high token with p 0.75.
    # When SFT learns the copy fully, its policy is peaked on its own and most SFT+GRPO groups
    # are degenerate: the situation RC-GRPO addresses.
    c.rl.p_high = 0.75
    c.rl.temperature = 1.0
    c.rl.max_new_tokens = 32  # the longest ground-truth message is 21 tokens
    c.rl.max_len = 384  # the longest ground-truth trajectory is 165 tokens
    # 2 epochs x 2 minibatches: four updates per batch, so the later ones see ratios != 1 and
    # the clip bounds how far one batch moves the policy.
    c.rl.epochs = 2
    c.rl.minibatches = 2
    # Held-out success at the start and after 512, 1024, 1536 and 2048 trajectories: the
    # curve the arms are compared by (summary.json, rl.png).
    c.rl.eval_every = 0
    c.rl.eval_points = 4
    c.rl.checkpoint_every = 4
    # A fresh Adam's first update is lr x sign(g) on every weight whatever the gradient's size,
    # and clip_norm acts before Adam, so the rate alone sets how far the first updates move the
    # policy: too high and one update collapses it. 1e-3 after a 4-update warm-up, on groups
    # that carry signal, moves held-out success while the shuffled-reward control does not
    # (docs/experiments/tiny_default.md, "An RL recipe that does not collapse" and "The recipe
    # that learns").
    c.rl.optim.lr = 1e-3
    c.rl.optim.warmup_steps = 4

    c.eval.policy = "model"
    c.eval.max_new_tokens = 32
    c.eval.max_len = 384
    # 128 held-out tasks (0.8 points each; 32 would give 3.1-point steps, too coarse for RL's
    # change), and each RL arm's start and end also as the mean success of 4 samples at
    # temperature 1.
    c.eval.max_entries = 128
    c.eval.samples = 4
    return c
