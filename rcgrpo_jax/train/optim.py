"""Optimizer from a config section: AdamW, linear warmup + cosine decay, global-norm clipping.

Gradient accumulation is *not* an optax wrapper here: `state.make_train_step` scans over
`grad_accum` microbatches inside one jit, so one call = one optimizer update and the schedule,
the clipping and the skip-on-non-finite logic all see the accumulated gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax

from rcgrpo_jax.models.config import known_fields

# Leaves that are not decayed: norm scales and q/k/v biases (decaying them pulls norms to 0).
NO_DECAY_NAMES = frozenset({"scale", "bq", "bk", "bv"})


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = 1000
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # <= 0 disables clipping
    grad_accum: int = 1
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"need total_steps >= 1 and warmup_steps >= 0, got "
                f"{self.total_steps}, {self.warmup_steps}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, default_total_steps: int = 0) -> OptimConfig:
        """From a mapping or ml_collections section; unknown keys raise. A `total_steps` of 0
        (the configs' "derive it") takes `default_total_steps` (the stage's update count)."""
        d = known_fields(cls, d, "optimizer")
        if not d.get("total_steps") and default_total_steps:
            d["total_steps"] = int(default_total_steps)
        return cls(**d)

    def init_key(self) -> tuple:
        """What `make_optimizer(self).init` depends on: its state is zeros and zero counts,
        whatever the rates and schedule, and only clipping adds a (stateless) element. Stages
        whose optimizers differ in lr or steps share one jitted state init by this key."""
        return ("clip_adamw", self.clip_norm > 0)


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """lr·(n+1)/warmup_steps for update n < warmup_steps (so the first update is not wasted at
    lr 0), then cosine to lr·min_lr_ratio, reached at update total_steps-1."""
    warmup = min(cfg.warmup_steps, cfg.total_steps)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    return lambda count: base(count + 1)


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: every weight except norm scales and biases."""

    def keep(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", None))
        return name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig | Mapping[str, Any]) -> optax.GradientTransformation:
    """clip(global norm) → AdamW(schedule). Built from an `OptimConfig` or a config section."""
    if not isinstance(cfg, OptimConfig):
        cfg = OptimConfig.from_dict(cfg)
    adamw = optax.adamw(
        make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.clip_norm and cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
