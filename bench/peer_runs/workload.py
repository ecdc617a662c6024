"""The one GRPO workload that bench/peers.py runs in TRL, Tunix and rcgrpo_jax.

Standard library only: each system's runner imports it in its own virtual environment.

Single-turn: P prompts x G samples, temperature 1, up to `max_new` new tokens, a programmatic
reward on the completion text, one AdamW update per iteration on all P*G trajectories.

Multi-turn: the same, but each trajectory is a tool loop of up to `TURNS` generations. The system
prompt offers one tool, `next_part()`; while the model calls it (Qwen's `<tool_call>` JSON) the
tool's result is appended and the model generates again; a generation without a call, or the
`TURNS`-th, ends the trajectory. The checkpoint for it is fine-tuned (bench/peer_runs/build.py)
to call the tool twice and then answer, so every system does about 3 generations per trajectory:
TRL through `environment_factory` (its tool loop, one environment per rollout), Tunix through its
agentic GRPO learner with a tool environment, rcgrpo_jax through the environment protocol.
"""

from __future__ import annotations

import json

P, G = 8, 8  # prompts per iteration, samples per prompt
TEMPERATURE = 1.0
ITERATIONS = 6  # the first compiles/warms up; the rest are steady state
TURNS = 3  # generations per multi-turn trajectory (2 tool calls, then an answer)

# AdamW as all three configure it; no KL term (TRL's default beta=0), PPO clip 0.2, one update
LR, BETAS, ADAM_EPS, WEIGHT_DECAY, CLIP_EPS, MAX_GRAD_NORM = 1e-6, (0.9, 0.999), 1e-8, 0.0, 0.2, 1.0

# The tiny Qwen2 every system loads (transformers' Qwen2ForCausalLM, float32, seed 0)
MODEL = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=1024, tie_word_embeddings=True, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-6,
)  # fmt: skip
VOCAB = 1024  # byte-level BPE, trained by build.py

TOPICS = ("rivers", "mountains", "bread", "music", "stars", "bridges", "gardens", "trains")
PROMPTS = tuple(f"Write a short note about {t}." for t in TOPICS)
assert len(PROMPTS) == P

TOOL_NAME = "next_part"
TOOL_DOC = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Returns the next part of the task.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}
TOOL_CALL_TEXT = (
    "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {}}) + "\n</tool_call>"
)


def tool_result(calls_so_far: int) -> str:
    """What `next_part()` returns on its n-th call (1-based)."""
    return f"Part {calls_so_far + 1}: add one more sentence."


def reward(text: str) -> float:
    """The share of letters in `text` that are vowels: continuous, so no group is degenerate
    (no system may skip an update for lack of signal) and cheap next to generation."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


# Qwen2.5's template writes this system message when a chat has none; it is written out, so that
# every system renders the same text (rcgrpo_jax's episodes open with a system message).
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def messages(prompt: str, multi_turn: bool) -> list[dict]:
    """The chat of one prompt; the multi-turn one asks for the parts through the tool."""
    ask = f"{prompt} Call {TOOL_NAME}() for each part first." if multi_turn else prompt
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


def iteration_record(rollout_s: float, update_s: float, generated_tokens: int,
                     trajectories: int, generations: int, mean_reward: float) -> dict:  # fmt: skip
    """One iteration as every runner reports it: seconds generating (and scoring) the
    trajectories, seconds in the update, model-generated tokens (no prompt, no tool result,
    no padding; the EOS that ends a generation counts), trajectories, model generations (P*G
    single-turn; up to TURNS*P*G multi-turn) and the mean reward."""
    return dict(rollout_s=float(rollout_s), update_s=float(update_s),
                generated_tokens=int(generated_tokens), trajectories=int(trajectories),
                generations=int(generations), mean_reward=float(mean_reward))  # fmt: skip


def write_result(path: str, system: str, version: str, mode: str, max_new: int,
                 iterations: list[dict], notes: str = "") -> None:  # fmt: skip
    """The runner's output file: bench/peers.py reads it."""
    import os

    threads = len(os.sched_getaffinity(0))
    with open(path, "w") as f:
        result = dict(system=system, version=version, mode=mode, max_new=max_new,
                      threads=threads, iterations=iterations, notes=notes)  # fmt: skip
        json.dump(result, f, indent=1)
