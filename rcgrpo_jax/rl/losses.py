"""The RL policy losses (GRPO, Dr. GRPO, DAPO, GSPO), each registered by name
(`@register_objective`), over a [P, G, T] batch of rollouts. The names mean what TRL's
`GRPOConfig.loss_type` values mean (docs/objectives.md: the table, and how our settings map to
TRL's and Tunix's).

Batch (all leading dims [P, G]; P prompts × G rollouts):
- tokens, positions, segments [P, G, T]: the full trajectory (prompt + turns + tool results).
- loss_mask [P, G, T]: 1 on policy-generated tokens (assistant turns), aligned with tokens.
- old_logprobs [P, G, T]: log p_old(tokens[t] | < t) from the rollout (0 where not generated).
- ref_logprobs [P, G, T]: same under the frozen reference policy (only read when kl_beta > 0).
- rewards [P, G]: the trajectory rewards R(τ).
- advantages [P, G], group_signal [P]: the estimator's, from the rewards (`with_advantages`: the
  fused step's first step, over the whole batch; `policy_loss` adds them where missing).
- reward_token [P, G]: HIGH / LOW / NONE — only for metrics.
- group_mask [P] (optional, default all 1): 0 on a padding group, which then counts nowhere (no
  token, no group statistic): dynamic sampling keeps the step's shape at P groups with it.
- loss_index [P, G, K] (optional, `data.packing.loss_index`): the positions of the generated
  tokens (then 0s); the head runs only there and the per-token inputs are gathered to match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from rcgrpo_jax import models
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.models import ModelConfig
from rcgrpo_jax.rl.advantages import (
    ADVANTAGES,
    ESTIMATORS,
    GROUP_SIGNAL,
    degenerate_groups,
    estimate,
    group_signal,
)
from rcgrpo_jax.rl.registry import Registry

AGGREGATIONS = ("token", "sequence", "constant")


@dataclasses.dataclass(frozen=True)
class Declared:
    """A registered objective: its importance ratio, how its per-token terms are aggregated and
    the advantage estimator it uses unless `rl.estimator` names another."""

    ratio: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    # token: sum over the update's generated tokens / their count (DAPO's token-level loss; exact
    # over microbatches, so the global count TRL's `dapo` divides by);
    # sequence: the mean over sequences of each one's token mean (GRPO's original form);
    # constant: sum / (sequences x a fixed length), free of each sequence's length (Dr. GRPO)
    aggregation: str
    estimator: str
    # the config keys of its clip range, rl.<clip>_low / rl.<clip>_high (`objective_from_config`)
    clip: str = "clip"


OBJECTIVES: Registry[Declared] = Registry("objective")


def register_objective(
    name: str, *, aggregation: str, estimator: str = "grpo", clip: str = "clip"
) -> Callable:
    """Decorator: registers `ratio(logp, old, mask) -> [P, G, T]` (log-probs now and at the
    rollout, the loss mask; the ratio's value at every token) as objective `name` (`rl.objective`
    selects it). `objective_loss` clips the ratio to [1 - clip_low, 1 + clip_high] (from the
    config keys rl.<clip>_low / rl.<clip>_high), weighs it by the advantages, adds the KL term
    and aggregates as declared (one of AGGREGATIONS)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")
    ESTIMATORS[estimator]  # an unknown estimator: the registry's one-line ValueError

    def register(ratio: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> Callable:
        OBJECTIVES.add(name, Declared(ratio, aggregation, estimator, clip))
        return ratio

    return register


# Each name is TRL's `loss_type` of the same aggregation. TRL's `bnpo` (token mean of each
# micro-batch) has no name here: our token mean is exact over microbatches, which is `dapo`; the
# two agree when TRL runs one micro-batch per update (docs/objectives.md).
@register_objective("dapo", aggregation="token")  # the default (rl.objective), as TRL's
@register_objective("dr_grpo", aggregation="constant", estimator="dr_grpo")
@register_objective("grpo", aggregation="sequence")  # decorators apply bottom up
def token_ratio(logp: jax.Array, old: jax.Array, mask: jax.Array) -> jax.Array:
    """p / p_old per token."""
    del mask
    return jnp.exp(logp - old)


@register_objective("gspo", aggregation="sequence", clip="gspo_clip")
def sequence_ratio(logp: jax.Array, old: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO: one ratio per sequence, s_i = exp(mean_t (logp - old)) over its loss tokens, the
    same at every token of the sequence."""
    log_s = jnp.sum((logp - old) * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
    return jnp.broadcast_to(jnp.exp(log_s)[..., None], logp.shape)


@dataclasses.dataclass(frozen=True)
class Objective:
    """An RL objective as data: the registered objective and estimator it names, and every
    setting they read. It is the compiled step's key (`rl.train_step.make_rl_step`): whatever
    changes the loss must be a field here."""

    name: str = "dapo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (decoupled, as DAPO)
    kl_beta: float = 0.0  # weight of the k3 KL estimator to the reference policy
    adv_eps: float = 1e-6  # the std-normalising estimators' (r - mean) / (std + adv_eps)
    # their std's delta degrees of freedom: 0 the population std (this project's default), 1 the
    # sample std of TRL, Tunix and DeepSeekMath's GRPO (advantages sqrt(G / (G - 1)) smaller)
    adv_std_ddof: int = 0
    # dr_grpo: the fixed tokens per sequence of its divisor (the stage passes rl.max_len); 0 = the
    # step's T, which is bucketed to the batch's content and so not fixed across iterations
    norm_length: int = 0
    estimator: str = ""  # a registered advantage estimator; "": the objective's own

    def __post_init__(self) -> None:
        # an unknown name: the registry's one-line ValueError
        OBJECTIVES[self.name]
        if self.estimator:
            ESTIMATORS[self.estimator]
        if self.adv_std_ddof not in (0, 1):
            raise ValueError(f"adv_std_ddof={self.adv_std_ddof!r}; expected 0 or 1")

    @property
    def declared(self) -> Declared:
        return OBJECTIVES[self.name]

    @property
    def advantage_estimator(self) -> str:
        """The estimator's name: `estimator`, or the objective's own where that is empty."""
        return self.estimator or self.declared.estimator

    def advantages(self, rewards: jax.Array) -> jax.Array:
        """rewards [P, G] -> advantages [P, G] by the estimator, with its settings."""
        return estimate(self.advantage_estimator, rewards, self.adv_eps, self.adv_std_ddof)


def with_advantages(objective: Objective, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The batch with `advantages` [P, G] and `group_signal` [P] (1.0 where the group carries
    signal) from the objective's estimator over all of its groups: the fused step runs this on
    the whole batch before splitting it into microbatches."""
    rewards = batch["rewards"]
    return {
        **batch,
        ADVANTAGES: objective.advantages(rewards),
        GROUP_SIGNAL: group_signal(objective.advantage_estimator, rewards).astype(jnp.float32),
    }


def logprobs_and_entropy(
    cfg: ModelConfig,
    params: Any,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log p(tokens[t] | < t) and the policy entropy at t, both [B, T] (0 at t = 0),
    aligned with the rollout's tokens / loss mask / old log-probs; with `at` [B, K], both [B, K]
    at those positions only (`models.token_logprobs`)."""
    logp, entropy, _ = models.token_logprobs(cfg, params, tokens, positions, segments, at=at)
    if at is not None:
        return logp, entropy
    pad = jnp.zeros_like(logp[:, :1])
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, entropy], 1)


def policy_loss(
    cfg: ModelConfig, objective: Objective, params: Any, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`objective_loss` of the policy's current log-probs of the rollouts (at `loss_index`
    alone when the batch has it). A batch without `advantages` gets them here
    (`with_advantages`; the fused step adds them before its microbatch split)."""
    if ADVANTAGES not in batch:
        batch = with_advantages(objective, batch)
    p, g, _ = batch["tokens"].shape
    if "prompt_tokens" in batch:
        logp, entropy = _shared_prompt_logprobs(cfg, params, batch)
    else:
        flat = lambda x: x.reshape(p * g, *x.shape[2:])
        at = batch.get("loss_index")
        logp, entropy = logprobs_and_entropy(
            cfg, params, flat(batch["tokens"]), flat(batch["positions"]), flat(batch["segments"]),
            None if at is None else flat(at),
        )  # fmt: skip
    return objective_loss(objective, logp.reshape(p, g, -1), entropy.reshape(p, g, -1), batch)


def _shared_prompt_logprobs(
    cfg: ModelConfig, params: Any, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """`logprobs_and_entropy` of the batch's rows, at `loss_index` (else at every position of
    T), from its shared-prompt layout (`data.packing.shared_prompts`): each group's prompts run
    once. Positions before a row's rest (its prompt: never a loss token) hold don't-care
    values."""
    p, g, t = batch["tokens"].shape
    k, ts = batch["prompt_tokens"].shape[1], batch["rest_tokens"].shape[-1]
    flat = lambda x: x.reshape(p * g, *x.shape[2:])
    prefix = models.SharedPrefix(
        tokens=batch["prompt_tokens"].reshape(p * k, -1),
        length=batch["prompt_length"].reshape(p * k),
        of=batch["prompt_of"],
    )
    rest = (flat(batch["rest_tokens"]), flat(batch["rest_positions"]), flat(batch["rest_segments"]))
    start = flat(batch["rest_start"])[:, None]
    if "loss_index" in batch:  # into the rest: its token 0 is the prompt's last, so a loss
        at = jnp.clip(flat(batch["loss_index"]) - start, 0, ts - 1)  # token sits at >= 1
        logp, entropy, _ = models.shared_prefix_logprobs(cfg, params, prefix, *rest, at=at)
        return logp, entropy
    # every position: the rest's predictions (of its tokens 1..) laid back onto the row's T
    logp, entropy, _ = models.shared_prefix_logprobs(cfg, params, prefix, *rest)
    j = jnp.clip(jnp.arange(t, dtype=jnp.int32)[None, :] - start - 1, 0, ts - 2)
    return jnp.take_along_axis(logp, j, 1), jnp.take_along_axis(entropy, j, 1)


def objective_loss(
    objective: Objective, logp: jax.Array, entropy: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate (+ β·k3 KL) of log-probs `logp` [P, G, T] with the batch's
    `advantages` and `group_signal` (`with_advantages`); the registered objective gives the
    ratio (per token or per sequence) and how the per-token terms are aggregated.

    With batch["loss_index"] [P, G, K], `logp` and `entropy` are [P, G, K] at those positions,
    and loss_mask / old / ref log-probs [P, G, T] are gathered there: every sum runs over the
    same tokens, so each value (per sequence too) is the full [P, G, T] computation's."""
    p, g, _ = logp.shape
    t = batch["loss_mask"].shape[-1]
    index = batch.get("loss_index")
    at = (lambda x: x) if index is None else (lambda x: jnp.take_along_axis(x, index, -1))
    groups = batch.get("group_mask", jnp.ones((p,), jnp.float32)).astype(jnp.float32)
    mask = at(batch["loss_mask"]).astype(jnp.float32) * groups[:, None, None]
    # nothing predicts the first token (the index's padding points there)
    mask = mask.at[..., 0].set(0.0) if index is None else jnp.where(index > 0, mask, 0.0)
    old = at(batch["old_logprobs"])
    declared = objective.declared
    n_tok = jnp.sum(mask)
    seq_tok = jnp.sum(mask, axis=-1)

    adv = batch[ADVANTAGES][..., None]
    ratio = declared.ratio(logp, old, mask)
    clipped = jnp.clip(ratio, 1.0 - objective.clip_low, 1.0 + objective.clip_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(per_token)
    if objective.kl_beta > 0:
        log_r = at(batch["ref_logprobs"]) - logp
        kl = jnp.exp(log_r) - log_r - 1.0  # k3: unbiased, non-negative estimate of KL(π || ref)
        per_token = per_token + objective.kl_beta * kl

    has_tok = (seq_tok > 0).astype(jnp.float32)
    aggregation = declared.aggregation
    if aggregation == "token":
        weight = n_tok
        loss = jnp.sum(per_token * mask) / jnp.maximum(n_tok, 1.0)
    elif aggregation == "sequence":
        weight = jnp.sum(has_tok)
        seq_loss = jnp.sum(per_token * mask, -1) / jnp.maximum(seq_tok, 1.0)
        loss = jnp.sum(seq_loss * has_tok) / jnp.maximum(weight, 1.0)
    else:  # constant: every sequence counts the same fixed length, however long it is
        weight = jnp.sum(groups) * (g * (objective.norm_length or t))
        loss = jnp.sum(per_token * mask) / jnp.maximum(weight, 1.0)

    tok_mean = lambda x: jnp.sum(x * mask) / jnp.maximum(n_tok, 1.0)
    rewards = batch["rewards"].astype(jnp.float32)
    rt = batch.get("reward_token", jnp.full((p, g), NONE, jnp.int32))
    rows = jnp.broadcast_to(groups[:, None], (p, g))  # 1 on every rollout of a counted group
    # clipped: the min takes the clipped term strictly, so the token's surrogate has no gradient
    is_clipped = clipped * adv < ratio * adv
    # rollout-trainer agreement, over generated tokens: in an iteration's first update the params
    # are the sampler's, so |logp - old| is their numerical disagreement alone
    gap = jnp.abs(logp - old)
    on_mask = lambda x: jnp.where(mask > 0, x, 0.0)  # 0 on no token: below every real value
    aux = {
        "weight": weight,
        "tokens": n_tok,
        "entropy": tok_mean(entropy),
        "kl": tok_mean(kl),
        "clip_frac": tok_mean(is_clipped.astype(jnp.float32)),
        "ratio": tok_mean(ratio),
        "logp_gap_sum": jnp.sum(gap * mask),  # / tokens: exact over microbatches
        "logp_gap_max": jnp.max(on_mask(gap)),  # `_max`: the maximum over microbatches
        "ratio_dev_max": jnp.max(on_mask(jnp.abs(ratio - 1.0))),
        # group-level sums: exact over microbatches; the loop divides by groups_sum/rollouts_sum
        "groups_sum": jnp.sum(groups),
        "rollouts_sum": jnp.sum(rows),
        "degenerate_sum": jnp.sum(degenerate_groups(rewards) * groups),
        # 1 if a counted group carries signal (the estimator's rule); 0 skips the update
        "signal_max": jnp.max(batch[GROUP_SIGNAL] * groups),
        "reward_sum": jnp.sum(rewards * rows),
        "abs_adv_sum": jnp.sum(jnp.abs(adv[..., 0]) * rows),
        "high_sum": jnp.sum((rt == HIGH) * rows),
        "reward_high_sum": jnp.sum(rewards * (rt == HIGH) * rows),
        "low_sum": jnp.sum((rt == LOW) * rows),
        "reward_low_sum": jnp.sum(rewards * (rt == LOW) * rows),
    }
    return loss, aux


def summarize(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Turns the step's `_sum` aux values into the logged means (degenerate fraction, ...)."""
    m = {k: float(v) for k, v in metrics.items()}
    div = lambda a, b: m[a] / m[b] if m.get(b) else float("nan")
    out = {k: v for k, v in m.items() if not k.endswith("_sum")}
    out.update(
        degenerate_frac=div("degenerate_sum", "groups_sum"),
        reward_mean=div("reward_sum", "rollouts_sum"),
        abs_adv_mean=div("abs_adv_sum", "rollouts_sum"),
        logp_gap_mean=div("logp_gap_sum", "tokens"),
        reward_high=div("reward_high_sum", "high_sum"),
        reward_low=div("reward_low_sum", "low_sum"),
    )
    return out


def objective_from_config(rl: ml_collections.ConfigDict) -> Objective:
    """The `Objective` that `rl.objective` names, with its parameters from `rl.*` and the
    estimator `rl.estimator` ("": the objective's own) with rl.adv_eps and rl.adv_std_ddof: the
    clip range from the keys the objective declares (gspo's sequence ratio: its own, much
    narrower rl.gspo_clip_*), dr_grpo divides by sequences x rl.max_len (the fixed budget of a
    trajectory)."""
    clip = OBJECTIVES[rl.objective].clip
    return Objective(
        name=rl.objective,
        clip_low=float(rl[f"{clip}_low"]),
        clip_high=float(rl[f"{clip}_high"]),
        kl_beta=float(rl.kl_beta),
        adv_eps=float(rl.adv_eps),
        adv_std_ddof=int(rl.adv_std_ddof),
        norm_length=int(rl.max_len),
        estimator=str(rl.estimator),
    )
