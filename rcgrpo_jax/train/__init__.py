"""Training infrastructure shared by stage 1 (SFT/RCTP) and stage 2 (RL).

- optim: OptimConfig, make_optimizer (AdamW + warmup/cosine + clipping), make_schedule.
- state: TrainState, state_shardings, make_init_state/init_train_state, make_train_step (one
  jitted, sharded step with microbatch scan and skip-on-non-finite), shard_batch.
- losses: masked next-token CE (SFT/RCTP) over rows packed by `data.packing`.
- checkpoint: Checkpointer (orbax; data-iterator state; corrupt-latest fallback).
- metrics: MetricsWriter (jsonl + TensorBoard + tqdm), mfu (over `models.flops`). plots: PNG
  plots.
- loop: restore_or_init, train_loop.

Submodules are imported explicitly (`from rcgrpo_jax.train import state`), so importing the
package stays cheap (no orbax/matplotlib until needed).
"""
