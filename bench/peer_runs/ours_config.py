"""rcgrpo_jax's run of bench/peers.py's workload: stage `grpo` from the bench's checkpoint on
`ours_env`. bench/peer_runs/ours_run.py sets the checkpoint, mode and lengths by overrides."""

import sys
from pathlib import Path

from rcgrpo_jax.config import base_config

sys.path.insert(0, str(Path(__file__).parent))
import workload as w  # noqa: E402


def get_config():
    c = base_config()
    c.stage = "grpo"
    c.mesh.shape = (-1, 1, 1)
    c.env.module = "bench.peer_runs.ours_env"
    c.env.benchmark = "peers"
    c.env.peers = {"multi_turn": False}
    c.env.max_steps_per_turn = 1  # w.TURNS multi-turn
    c.model.chat_format = "qwen"
    c.model.dtype = "float32"  # as TRL and Tunix run it
    c.model.scan_layers = False
    c.model.gather_head = False
    c.rl.init_from = ""
    c.rl.steps = w.ITERATIONS
    c.rl.num_prompts, c.rl.group_size = w.P, w.G
    c.rl.temperature = w.TEMPERATURE
    c.rl.epochs = c.rl.minibatches = 1  # one update per iteration
    c.rl.objective = "dapo"  # TRL's loss_type="dapo"
    c.rl.clip_low = c.rl.clip_high = w.CLIP_EPS
    c.rl.kl_beta = 0.0
    c.rl.eval_every = 0
    c.rl.eval_points = 0
    c.rl.checkpoint_every = 1000
    c.rl.optim.lr = w.LR
    c.rl.optim.b1, c.rl.optim.b2 = w.BETAS
    c.rl.optim.eps = w.ADAM_EPS
    c.rl.optim.weight_decay = w.WEIGHT_DECAY
    c.rl.optim.clip_norm = w.MAX_GRAD_NORM
    c.logging.report_groups = w.P  # every group in trajectories.jsonl: the generations count
    return c
