"""The multi-turn set (`configs/tiny_multiturn.py`) with a stage 1 that ends with headroom: a
good share of held-out tasks solved by some samples but not all, after SFT and after RCTP, the
prompts on which a group can carry signal. Both stage-1 ends are stopped on measured quantities
of the synthetic `rl` split (names neither stage 1 nor the held-out tasks use), never on
held-out results:

- the warm start stops once sampled rl-split success reaches 30% (1000 steps at most), and SFT
  is that warm start (no further steps: 200 more took the headroom away);
- RCTP, from the same warm start, stops once sampled rl-split success under <|high_reward|>
  minus under <|low_reward|> reaches 20 points (300 steps at most: at 300 it is peaked, at a
  fixed 100 it had not learnt the tokens on three seeds of five).

Probe 4 (docs/experiments/tiny_default.md): on the study's seeds 0-4 under two compiles (the
default and XLA_FLAGS=--xla_cpu_max_isa=AVX, an AMD EPYC Zen 3), SFT 24.2-57.0% held out with
31.2-48.4% of tasks solved sometimes, RCTP-high 33.6-53.9% solved sometimes; RCTP's greedy
high - low gap >= 20 points on 8 of 10. Everything else, the RL recipe included, is the
multi-turn set's.

    python -m rcgrpo_jax.main --config=configs/tiny_headroom.py
"""

from rcgrpo_jax.config import sibling_config


def get_config():
    c = sibling_config(__file__, "tiny_multiturn")
    warm = c.train.warm_start_stop
    warm.level, warm.split = 0.3, "rl"  # every 50 steps, 64 tasks, 4 samples; cap 1000
    c.train.steps = 0  # SFT = the warm start at its stop
    rctp = c.rctp.stop
    rctp.level, rctp.every, rctp.split = 0.2, 25, "rl"  # 64 tasks, 4 samples; cap 300
    return c
