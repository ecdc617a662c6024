"""`python -m rcgrpo_jax.main` for tests/test_multihost.py, with a reward that varies.

A random tiny policy never solves a synthetic task, so every group would be degenerate, every
advantage 0 and every update a no-op: a multi-host run could not differ from a single-host one.
Here each rollout's reward is instead one bit of a checksum of the assistant text it sampled
(deterministic, the same in every process), so groups disagree and the updates are real. The
environment still runs (parsing, executing, the BFCL checker); only its verdict is replaced.

Each `Episode` the rollouts create appends one line per scored trajectory to
$RCGRPO_TEST_ENV_LOG: which entry and reward token it was, the checksum and the reward — the
record of which rows this process ran the environment for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

from absl import app

from rcgrpo_jax import main
from rcgrpo_jax.envs import builtin


class ChecksumRewardEpisode(builtin.Episode):
    def result(self):
        res = super().result()
        text = "\n".join(m["content"] for m in self.messages if m["role"] == "assistant")
        crc = zlib.crc32(text.encode())
        reward = float(crc & 1)
        line = {"entry": self.entry.id, "reward_token": self.reward_token, "crc": crc}
        line["reward"] = reward
        with open(os.environ["RCGRPO_TEST_ENV_LOG"], "a") as f:
            f.write(json.dumps(line) + "\n")
        return dataclasses.replace(res, reward=reward)


# the environment's episodes (rollouts, prompt lengths), not those of task verification
builtin.Episode = ChecksumRewardEpisode

if __name__ == "__main__":
    app.run(main.main, flags_parser=main.parse_flags)
