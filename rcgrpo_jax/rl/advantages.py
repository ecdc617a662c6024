"""Advantage estimators and reward-token assignment, as vmapped per-group functions.

Both are written for one group and lifted over the P groups of a step with `jax.vmap`, and both
run inside the fused train step: the advantages of the step's rollouts (an `Estimator`,
registered by name with `@register_estimator`, run over the whole batch before it is split
into microbatches), and the reward tokens of the next iteration's (`TokenDraw`,
`draw_reward_tokens`; the same function, jitted, on the host for a run's first iteration and for
dynamic sampling's later rounds).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.registry import Registry

ADVANTAGES = "advantages"  # the batch field [P, G] the estimator step adds and the loss reads
GROUP_SIGNAL = "group_signal"  # [P] float: 1 where the estimator says the group carries signal


def rewards_differ(rewards: jax.Array) -> jax.Array:
    """One group [G] -> bool []: whether its rewards are not all equal: the signal rule of every
    group-relative estimator (equal rewards give exactly 0 advantages, hence no gradient)."""
    return ~jnp.all(rewards == rewards[0])  # not `sigma > 0`: float rounding must not decide


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: `advantage(rewards [G], eps, ddof) -> [G]` for one
    group (float32; vmapped over the groups of the whole batch; eps and ddof are the
    std-normalising estimators' settings, `Objective.adv_eps` / `adv_std_ddof`, which the others
    ignore), and `signal(rewards [G]) -> bool []`,
    whether that group's advantages can be non-zero. A batch whose valid groups all lack signal
    is not stepped (the RL loop) and leaves the state untouched if it is (`train.state`); dynamic
    sampling keeps only groups with signal."""

    advantage: Callable[[jax.Array, float, int], jax.Array]
    signal: Callable[[jax.Array], jax.Array]


ESTIMATORS: Registry[Estimator] = Registry("estimator")


def register_estimator(
    name: str, signal: Callable[[jax.Array], jax.Array] = rewards_differ
) -> Callable:
    """Decorator: registers `fn(rewards [G], eps, ddof) -> advantages [G]` as estimator `name`
    (`rl.estimator` selects it), with its signal rule (default: the group's rewards differ)."""

    def register(fn: Callable[[jax.Array, float, int], jax.Array]) -> Callable:
        ESTIMATORS.add(name, Estimator(fn, signal))
        return fn

    return register


@register_estimator("grpo")
def normalized_advantage(rewards: jax.Array, eps: float, ddof: int) -> jax.Array:
    """GRPO's (r - mean) / (std + eps), the std with `ddof` delta degrees of freedom (0: the
    population std; 1: the sample std TRL and Tunix use); exactly 0 when every reward is
    equal."""
    r = rewards.astype(jnp.float32)
    mu = jnp.mean(r)
    # sum / (G - ddof): at ddof 0 the same sum / G as jnp.mean; a group of one has no signal
    # (`rewards_differ`), and max(.., 1) keeps its unused branch finite at ddof 1
    sigma = jnp.sqrt(jnp.sum(jnp.square(r - mu)) / max(r.shape[0] - ddof, 1))
    return jnp.where(rewards_differ(r), (r - mu) / (sigma + eps), 0.0)


@register_estimator("dr_grpo")
def centered_advantage(rewards: jax.Array, eps: float, ddof: int) -> jax.Array:
    """Dr. GRPO's r - mean (no std division, so no eps or ddof); exactly 0 when every reward is
    equal."""
    del eps, ddof
    r = rewards.astype(jnp.float32)
    return jnp.where(rewards_differ(r), r - jnp.mean(r), 0.0)


@register_estimator("rloo")
def leave_one_out_advantage(rewards: jax.Array, eps: float, ddof: int) -> jax.Array:
    """RLOO: r_i minus the mean of the group's other rewards, (sum - r_i) / (G - 1); exactly 0
    when every reward is equal (and for a group of one, which has no baseline)."""
    del eps, ddof
    r = rewards.astype(jnp.float32)
    baseline = (jnp.sum(r) - r) / max(r.shape[0] - 1, 1)
    return jnp.where(rewards_differ(r), r - baseline, 0.0)


def _groups(rewards: jax.Array) -> jax.Array:
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {rewards.shape}")
    return rewards


# jitted (a name means one function: `Registry`), so the host's calls per iteration (the
# report's advantages, dynamic sampling's and the loop's signal checks) are one dispatch each,
# not one per op; inside the fused step they are inlined
@functools.partial(jax.jit, static_argnames=("name", "eps", "ddof"))
def estimate(name: str, rewards: jax.Array, eps: float = 1e-6, ddof: int = 0) -> jax.Array:
    """rewards [P, G] -> advantages [P, G] by estimator `name` (std-normalising ones: + eps,
    std with `ddof`), vmapped over the groups."""
    fn = ESTIMATORS[name].advantage
    return jax.vmap(lambda r: fn(r, eps, ddof))(_groups(rewards))


@functools.partial(jax.jit, static_argnames=("name",))
def group_signal(name: str, rewards: jax.Array) -> jax.Array:
    """rewards [P, G] -> [P] bool: the groups that carry signal under estimator `name`."""
    return jax.vmap(ESTIMATORS[name].signal)(_groups(rewards))


def group_advantages(rewards: jax.Array, eps: float = 1e-6) -> jax.Array:
    """rewards [P, G] -> advantages [P, G], centred and normalised by the population std
    (ddof 0) within each group (row): estimator "grpo"."""
    return estimate("grpo", rewards, eps)


def degenerate_groups(rewards: jax.Array) -> jax.Array:
    """[P] bool: groups whose rewards are all equal (the reward statistic the logs report)."""
    return ~jax.vmap(rewards_differ)(_groups(rewards))


def stratified_high(p_high: float, group_size: int) -> int:
    """High tokens per stratified group: round(p_high * G) (in float32, half to even), clamped
    to [1, G - 1] so that both tokens appear."""
    return int(np.clip(np.round(np.float32(p_high * group_size)), 1, group_size - 1))


def _group_tokens(key: jax.Array, group_size: int, p_high, stratified: bool, n_high) -> jax.Array:
    if not stratified:
        high = jax.random.bernoulli(key, p_high, (group_size,))
        return jnp.where(high, HIGH, LOW).astype(jnp.int32)
    # Stratified: n_high high tokens, then shuffled.
    tokens = jnp.where(jnp.arange(group_size) < n_high, HIGH, LOW).astype(jnp.int32)
    return jax.random.permutation(key, tokens)


def sample_reward_tokens(
    key: jax.Array,
    num_groups: int,
    group_size: int,
    p_high: float | jax.Array,
    stratified: bool = False,
    n_high: int | jax.Array | None = None,
) -> jax.Array:
    """[P, G] int32 of HIGH/LOW: r_j ~ P_sample(r) i.i.d., or stratified within every group
    (`n_high` high tokens each; default `stratified_high(p_high, G)`)."""
    if stratified and group_size < 2:
        raise ValueError("stratified reward tokens need group_size >= 2")
    if not isinstance(p_high, jax.Array) and not 0.0 <= p_high <= 1.0:
        raise ValueError(f"p_high={p_high} is not a probability")
    if stratified and n_high is None:
        n_high = stratified_high(p_high, group_size)
    keys = jax.random.split(key, num_groups)
    return jax.vmap(lambda k: _group_tokens(k, group_size, p_high, stratified, n_high))(keys)


DRAWN = -2  # `TokenDraw.inputs()["token_fixed"]` when the tokens are drawn, not fixed


@dataclasses.dataclass(frozen=True)
class TokenDraw:
    """How an RL run assigns reward tokens: a pure function of (seed, iteration, round), so
    nothing about it is carried in a checkpoint and a resumed run draws what an uninterrupted
    one does."""

    seed: int
    num_groups: int  # P: the groups of an iteration's first round
    group_size: int
    p_high: float = 0.5
    stratified: bool = False
    fixed: int | None = None  # every row this token, nothing drawn (GRPO: NONE or HIGH)

    def __post_init__(self) -> None:
        if self.fixed not in (None, HIGH, LOW, NONE):
            raise ValueError(f"fixed={self.fixed!r}: expected None, HIGH, LOW or NONE")

    def inputs(self) -> dict[str, np.ndarray]:
        """The draw's run-time values (its seed's key words, p_high, the stratified high
        count, the fixed token) as scalar step inputs: the fused step reads them as data, so
        every RL arm of one shape shares one program, and the draws are those of
        `jax.random.key(seed)` for any seed."""
        hi, lo = _key_words(self.seed)
        n_high = stratified_high(self.p_high, self.group_size) if self.group_size > 1 else 1
        return {
            "token_key_hi": np.asarray(hi, np.uint32),
            "token_key_lo": np.asarray(lo, np.uint32),
            "token_p_high": np.asarray(self.p_high, np.float32),
            "token_n_high": np.asarray(n_high, np.int32),
            "token_fixed": np.asarray(DRAWN if self.fixed is None else self.fixed, np.int32),
        }

    def shape(self) -> TokenDraw:
        """The draw with only what shapes the program (P, G, stratified): a program key."""
        return TokenDraw(0, self.num_groups, self.group_size, stratified=self.stratified)


def draw_reward_tokens(
    draw: TokenDraw,
    iteration: int | jax.Array,
    rnd: int = 0,
    num_groups: int | None = None,
    inputs: dict[str, jax.Array] | None = None,
) -> jax.Array:
    """[num_groups (default P), G] int32 tokens of one iteration's round `rnd`, keyed by
    fold_in(key(seed), iteration) (folded with `rnd` too for a later round). Traceable in
    `iteration`: the fused RL step draws the next iteration's tokens inside its jit, with the
    seed, p_high and fixed token from `inputs` (`TokenDraw.inputs()`, traced) in place of the
    draw's own, which then only gives the shape."""
    shape = (draw.num_groups if num_groups is None else num_groups, draw.group_size)
    if inputs is None:
        if draw.fixed is not None:
            return jnp.full(shape, draw.fixed, jnp.int32)
        base, p_high, n_high = jax.random.key(draw.seed), draw.p_high, None
    else:
        words = jnp.stack([inputs["token_key_hi"], inputs["token_key_lo"]]).astype(jnp.uint32)
        base, p_high = jax.random.wrap_key_data(words), inputs["token_p_high"]
        n_high = inputs["token_n_high"] if draw.stratified else None
    key = jax.random.fold_in(base, iteration)
    if rnd:
        key = jax.random.fold_in(key, rnd)
    drawn = sample_reward_tokens(key, *shape, p_high, draw.stratified, n_high)
    if inputs is None:
        return drawn
    fixed = inputs["token_fixed"]
    return jnp.where(fixed == DRAWN, drawn, jnp.full(shape, fixed, jnp.int32))


@functools.lru_cache(maxsize=64)
def _key_words(seed: int) -> tuple[int, int]:
    """The two uint32 words of `jax.random.key(seed)` (threefry)."""
    hi, lo = np.asarray(jax.random.key_data(jax.random.key(seed))).tolist()
    return hi, lo


# The host-side entry point: the same program the step inlines, compiled once per shape.
draw_reward_tokens_jit = jax.jit(draw_reward_tokens, static_argnames=("draw", "rnd", "num_groups"))
