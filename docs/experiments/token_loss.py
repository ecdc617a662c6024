"""Per-token loss of one golden trajectory under a model: where a base is surprised.

    PYTHONPATH=. python docs/experiments/token_loss.py <HF export dir> <template> [config]

Prints `piece nats` for every assistant token of the first train task of `template` (one turn),
rendered with the export's tokenizer. `config` (default configs/tiny.py) supplies the rest of
the environment. An ad-hoc probe behind docs/experiments/tiny_default.md (not in the tests).
"""

import sys

import jax
import numpy as np

from rcgrpo_jax import logs, models
from rcgrpo_jax.config import config_from_file
from rcgrpo_jax.envs import policies, prompts, synthetic
from rcgrpo_jax.stages import setup

logs.configure(verbose=False)
export, template = sys.argv[1], sys.argv[2]
config_file = sys.argv[3] if len(sys.argv) > 3 else "configs/tiny.py"
c = config_from_file(config_file)
c.model.hf_path, c.tokenizer_path = export, ""
tokenizer = setup.tokenizer_from_config(c)
cfg, params = models.load_hf(export)
task = synthetic.make_tasks("train", 1, turns=(1, 1), templates=(template,))[0]
messages = synthetic.play(task, policies.ground_truth).messages
ids, mask = prompts.render_with_mask(tokenizer, messages)
logp = jax.nn.log_softmax(np.asarray(models.forward(cfg, params, np.asarray([ids])))[0], -1)
print(" | ".join(
    f"{tokenizer.decode([ids[i + 1]])!r} {-float(logp[i, ids[i + 1]]):.2f}"
    for i in range(len(ids) - 1) if mask[i + 1]
))  # fmt: skip
