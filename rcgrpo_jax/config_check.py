"""Validates a whole experiment config before any work starts.

Every key declared in `config.base_config()` has one rule in `RULES` (a test checks that none is
missing), and `CROSS_CHECKS` hold what involves several keys. `validate` raises `UserError` with
one line naming the key, its value and what is allowed, so a bad override costs seconds, not a
stage of training. It runs before any backend starts: the tables it checks against (families,
remat policies, objectives, ...) are imported from their modules, and nothing is compiled.
It is long because it stays one module: the rules table and the cross-key checks are read
together, one place that says what every key may be.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_collections

from rcgrpo_jax.config import BFCL_CATEGORIES, STAGES
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
from rcgrpo_jax.errors import UserError

# A rule returns None when the value is fine, else what is allowed ("an integer >= 0").
Rule = Callable[[Any], str | None]

RL_STAGES = ("grpo", "rcgrpo", "all")
CHAT_FORMATS = ("qwen", "llama", "python")
DTYPES = ("float32", "bfloat16", "float16")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def integer(lo: int | None = None, hi: int | None = None) -> Rule:
    bounds = " and ".join(
        b for b in (f">= {lo}" if lo is not None else "", f"<= {hi}" if hi is not None else "") if b
    )
    want = f"an integer {bounds}".strip()

    def rule(v: Any) -> str | None:
        ok = _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
        return None if ok else want

    return rule


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Rule:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"<= {hi:g}")
    want = f"a finite number {' and '.join(parts)}".strip()

    def rule(v: Any) -> str | None:
        if not _is_num(v):
            return want
        if lo is not None and (v <= lo if lo_open else v < lo):
            return want
        return want if hi is not None and v > hi else None

    return rule


def choice(options: Iterable[Any]) -> Rule:
    options = tuple(options)

    def rule(v: Any) -> str | None:
        return None if v in options else f"one of {', '.join(map(str, options))}"

    return rule


def subset(
    options: Iterable[str] | Callable[[], Iterable[str]], *, allow_empty: bool = False
) -> Rule:
    """A non-empty tuple of known names; `options` may be a function (names from a library)."""

    def rule(v: Any) -> str | None:
        known = tuple(options() if callable(options) else options)
        want = f"a {'' if allow_empty else 'non-empty '}tuple of: {', '.join(known)}"
        if not isinstance(v, tuple | list) or (not v and not allow_empty):
            return want
        return None if all(x in known for x in v) else want

    return rule


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


def text(v: Any) -> str | None:
    return None if isinstance(v, str) else "a string"


def existing_path(v: Any) -> str | None:
    """An empty string (unset) or a path that exists."""
    if not isinstance(v, str):
        return "a path (string)"
    return None if not v or Path(v).exists() else "an existing path (or empty)"


def optional(rule: Rule) -> Rule:
    def wrapped(v: Any) -> str | None:
        return None if v is None else rule(v)

    return wrapped


def int_pair(lo: int) -> Rule:
    def rule(v: Any) -> str | None:
        ok = isinstance(v, tuple | list) and len(v) == 2 and all(_is_int(x) for x in v)
        ok = ok and lo <= v[0] <= v[1]
        return None if ok else f"a pair (min, max) of integers with {lo} <= min <= max"

    return rule


def mesh_shape(v: Any) -> str | None:
    want = (
        "3 integers (data, fsdp, tensor), each >= 1, at most one -1 (fills the rest), or auto "
        "(a mesh that fits the devices, chosen by tools.plan)"
    )
    if v == "auto" or (isinstance(v, tuple | list) and tuple(v) == ("auto",)):
        return None
    if not isinstance(v, tuple | list) or len(v) != 3 or not all(_is_int(x) for x in v):
        return want
    return None if all(x >= 1 or x == -1 for x in v) and list(v).count(-1) <= 1 else want


def _templates() -> tuple[str, ...]:
    from rcgrpo_jax.envs.synthetic import MAIN_TEMPLATES

    return tuple(MAIN_TEMPLATES)


def _perturbations() -> tuple[str, ...]:
    from rcgrpo_jax.data.perturb import PERTURBATIONS

    return PERTURBATIONS


def _remat() -> tuple[str, ...]:
    from rcgrpo_jax.models.config import REMAT_POLICIES

    return REMAT_POLICIES


def _sampler_weights() -> tuple[str, ...]:
    from rcgrpo_jax.models.config import SAMPLER_WEIGHTS

    return SAMPLER_WEIGHTS


def _families() -> tuple[str, ...]:
    from rcgrpo_jax.models.families import FAMILIES

    return tuple(FAMILIES)


def _lora_targets() -> tuple[str, ...]:
    from rcgrpo_jax.models.config import LORA_TARGETS

    return LORA_TARGETS


def _lora_inits() -> tuple[str, ...]:
    from rcgrpo_jax.models.config import LORA_INITS

    return LORA_INITS


def _attention() -> tuple[str, ...]:
    from rcgrpo_jax.models.config import ATTENTION_KINDS

    return ATTENTION_KINDS


def _arms() -> tuple[str, ...]:
    from rcgrpo_jax.rl.arms import ARM_SETS, ARMS

    return (*ARMS, *ARM_SETS)


def _objectives() -> tuple[str, ...]:
    from rcgrpo_jax.rl.losses import OBJECTIVES

    return tuple(OBJECTIVES)


def _estimators() -> tuple[str, ...]:
    from rcgrpo_jax.rl.advantages import ESTIMATORS

    return tuple(ESTIMATORS)


def _categories() -> tuple[str, ...]:
    # Both spellings are accepted downstream (envs.entries.normalize_category).
    short = tuple(c.removeprefix("multi_turn_") for c in BFCL_CATEGORIES)
    return BFCL_CATEGORIES + short


def _optim(prefix: str) -> dict[str, Rule]:
    return {
        f"{prefix}.lr": number(0.0, lo_open=True),
        f"{prefix}.warmup_steps": integer(0),
        f"{prefix}.total_steps": integer(0),
        f"{prefix}.weight_decay": number(0.0),
        f"{prefix}.b1": number(0.0, 1.0),
        f"{prefix}.b2": number(0.0, 1.0),
        f"{prefix}.eps": number(0.0, lo_open=True),
        f"{prefix}.clip_norm": number(0.0),  # 0 = no clipping
        f"{prefix}.grad_accum": integer(1),
        f"{prefix}.min_lr_ratio": number(0.0, 1.0),
    }


RULES: dict[str, Rule] = {
    "stage": choice(STAGES),
    "workdir": text,
    "seed": integer(0),
    "compile.cache": boolean,
    "arms": subset(_arms),
    "controls": subset(("shuffled", "lr0"), allow_empty=True),
    "compile.cache_dir": text,
    "mesh.shape": mesh_shape,
    "mesh.sampler_weights": lambda v: choice(_sampler_weights())(v),
    "model.hf_path": existing_path,
    "model.gather_head": boolean,
    "model.dtype": choice(DTYPES),
    "model.param_dtype": choice(DTYPES),
    "model.remat": lambda v: choice(_remat())(v),
    "model.scan_layers": boolean,
    "model.attention": lambda v: choice(_attention())(v),
    "model.chat_format": choice(CHAT_FORMATS),
    "model.lora.rank": integer(0),
    "model.lora.alpha": number(0.0, lo_open=True),
    "model.lora.targets": subset(_lora_targets),
    "model.lora.init": lambda v: choice(_lora_inits())(v),
    "model.arch.vocab_size": integer(1),
    "model.arch.hidden_size": integer(1),
    "model.arch.intermediate_size": integer(1),
    "model.arch.num_layers": integer(1),
    "model.arch.num_heads": integer(1),
    "model.arch.num_kv_heads": integer(1),
    "model.arch.head_dim": integer(2),
    "model.arch.rope_theta": number(0.0, lo_open=True),
    "model.arch.qkv_bias": boolean,
    "model.arch.tie_embeddings": boolean,
    "model.arch.max_position_embeddings": integer(1),
    "model.arch.family": lambda v: choice(_families())(v),
    "tokenizer_path": existing_path,
    "env.benchmark": text,  # a registered name: checked in _cross_checks
    "env.module": text,
    "env.bfcl.categories": subset(_categories),
    "env.max_steps_per_turn": integer(1),
    "env.call_timeout_s": number(0.0, lo_open=True),
    "env.synthetic.num_train": integer(1),
    "env.synthetic.num_test": integer(1),
    "env.synthetic.num_rl": integer(0),
    "env.synthetic.seed": integer(0),
    "env.synthetic.difficulty.turns": int_pair(1),
    "env.synthetic.difficulty.depth": integer(1),
    "env.synthetic.difficulty.distractors": integer(0),
    "env.synthetic.difficulty.followup": number(0.0, 1.0),
    "env.synthetic.difficulty.templates": subset(_templates),
    "env.synthetic.difficulty.name_roles": boolean,
    "eval.policy": choice(("model", "ground_truth", "empty")),
    "eval.split": choice(("test", "train", "all")),
    "eval.bfcl.categories": subset(_categories),
    "eval.max_entries": integer(0),
    "eval.max_new_tokens": integer(1),
    "eval.max_len": integer(2),
    "eval.temperature": number(0.0),
    "eval.samples": integer(0),
    "eval.sample_temperature": number(0.0, lo_open=True),
    "eval.batch_size": integer(0),
    "eval.reward_token": optional(choice((LOW, HIGH))),
    "rctp.low_per_high": number(),  # < 0 keeps every label-0 example
    "rctp.perturbations": subset(_perturbations, allow_empty=True),
    "rctp.perturbations_per_entry": integer(0),
    "rctp.rollouts_per_entry": integer(0),
    "rctp.rollout_batch": integer(1),
    "rctp.heldout_entries": integer(0),
    "rctp.max_tokens": integer(0),
    "rctp.min_per_label": integer(0),
    "rctp.eval_entries": integer(0),
    "rctp.train_steps": integer(0),
    "train.steps": integer(0),
    "train.warm_start_steps": integer(0),
    **{
        f"{section}.{key}": rule
        for section in ("train.warm_start_stop", "rctp.stop")  # stages/sft.StopRule's settings
        for key, rule in (
            ("level", number(0.0, 1.0)),
            ("every", integer(1)),
            ("entries", integer(1)),
            ("samples", integer(1)),
            ("split", choice(("train", "rl"))),
        )
    },  # fmt: skip
    "train.batch_size": integer(1),
    "train.seq_len": integer(2),
    "train.checkpoint_every": integer(1),
    "train.keep_checkpoints": integer(1),
    "train.peak_flops": number(0.0),
    **_optim("train.optim"),
    "rl.init_from": existing_path,
    "rl.steps": integer(0),
    "rl.num_prompts": integer(1),
    "rl.group_size": integer(1),
    "rl.p_high": number(0.0, 1.0),
    "rl.stratified": boolean,
    "rl.grpo_token": choice(("none", "high")),
    "rl.prompt_split": choice(("train", "rl")),
    "rl.max_new_tokens": integer(1),
    "rl.max_len": integer(2),
    "rl.temperature": number(0.0, lo_open=True),
    "rl.top_p": number(0.0, 1.0, lo_open=True),
    "rl.epochs": integer(1),
    "rl.minibatches": integer(1),
    "rl.objective": lambda v: choice(_objectives())(v),
    "rl.estimator": lambda v: None if v == "" else choice(_estimators())(v),  # "": objective's
    "rl.clip_low": number(0.0, 1.0),
    "rl.clip_high": number(0.0),
    "rl.gspo_clip_low": number(0.0, 1.0),
    "rl.gspo_clip_high": number(0.0),
    "rl.kl_beta": number(0.0),
    "rl.adv_eps": number(0.0),
    "rl.adv_std_ddof": integer(0, 1),  # 0 population std, 1 sample std
    "rl.shuffle_rewards": boolean,
    "rl.share_prompt": boolean,
    "rl.dynamic_sampling": boolean,
    "rl.dynamic_max_rounds": integer(1),
    "rl.max_rollouts": integer(0),
    "rl.max_rows": integer(0),
    "rl.eval_every": integer(0),
    "rl.eval_points": integer(0),
    "rl.checkpoint_every": integer(1),
    "rl.keep_checkpoints": integer(1),
    **_optim("rl.optim"),
    "logging.report_groups": integer(-1),  # -1 = every group
}


def _fail(key: str, value: Any, want: str) -> UserError:
    return UserError(f"config.{key}={value!r}: expected {want}")


def _environment_checks(c: ml_collections.ConfigDict) -> Iterable[UserError]:
    """env.module imports and env.benchmark names a registered environment."""
    from rcgrpo_jax import envs

    if c.env.module:
        try:
            importlib.import_module(c.env.module)
        except ModuleNotFoundError as e:
            yield _fail("env.module", c.env.module, f"an importable module ({e})")
            return
    if c.env.benchmark not in envs.names():
        yield _fail("env.benchmark", c.env.benchmark, f"one of {', '.join(envs.names())}")


def _stop_rule_checks(
    section: str, rule: ml_collections.ConfigDict, applies: Any, where: str, cap: int, cap_name: str
) -> Iterable[UserError]:
    """A stopping rule (`section`: level, every, ...; stages/sft.StopRule) set where it cannot
    act (`applies` false; `where` says where it can), or asked no sooner than its stage's `cap`
    of steps (`cap_name`, then what sets it)."""
    if rule.level > 0 and not applies:
        yield _fail(f"{section}.level", rule.level, where)
    elif rule.level > 0 and rule.every >= cap:
        yield _fail(
            f"{section}.every", rule.every,
            f"an integer < {cap_name}={cap} (the rule is asked every `every` steps before the "
            "cap, not at it)",
        )  # fmt: skip


def _cross_checks(c: ml_collections.ConfigDict) -> Iterable[UserError]:
    """What involves several keys; yields the problems in the order a user would fix them."""
    from rcgrpo_jax.models.families import qkv_bias_mismatch

    yield from _environment_checks(c)
    a = c.model.arch
    if not c.model.hf_path and a.num_heads % a.num_kv_heads:
        yield _fail(
            "model.arch.num_kv_heads", a.num_kv_heads,
            f"a divisor of model.arch.num_heads={a.num_heads}",
        )  # fmt: skip
    need = None if c.model.hf_path else qkv_bias_mismatch(a.family, a.qkv_bias)
    if need:  # HF export would refuse it, after training
        yield _fail("model.arch.qkv_bias", a.qkv_bias, f"{need}, as HF export requires")
    stop, rctp_stop = c.train.warm_start_stop, c.rctp.stop
    yield from _stop_rule_checks(
        "train.warm_start_stop", stop, c.stage == "all" and c.train.warm_start_steps,
        "0 unless stage all runs a warm start (train.warm_start_steps > 0, its cap)",
        c.train.warm_start_steps, "train.warm_start_steps",
    )  # fmt: skip
    yield from _stop_rule_checks(
        "rctp.stop", rctp_stop, c.stage == "all", "0 unless stage is all",
        c.rctp.train_steps or c.train.steps, "RCTP's steps",  # rctp.train_steps, else train.steps
    )  # fmt: skip
    if c.stage in RL_STAGES:
        if c.rl.group_size < 2:
            yield _fail("rl.group_size", c.rl.group_size, f"an integer >= 2 for stage {c.stage}")
        if c.rl.num_prompts % c.rl.minibatches:
            yield _fail(
                "rl.minibatches", c.rl.minibatches,
                f"a divisor of rl.num_prompts={c.rl.num_prompts} (whole groups per update)",
            )  # fmt: skip
        per_update = c.rl.num_prompts // c.rl.minibatches
        if c.rl.num_prompts % c.rl.minibatches == 0 and per_update % c.rl.optim.grad_accum:
            yield _fail(
                "rl.optim.grad_accum", c.rl.optim.grad_accum,
                f"a divisor of rl.num_prompts / rl.minibatches = {per_update} (whole groups "
                "per microbatch)",
            )  # fmt: skip
        if c.rl.max_new_tokens >= c.rl.max_len:
            yield _fail("rl.max_new_tokens", c.rl.max_new_tokens, f"< rl.max_len={c.rl.max_len}")
    if c.stage in ("sft", "rctp", "all") and c.train.batch_size % c.train.optim.grad_accum:
        yield _fail(
            "train.optim.grad_accum", c.train.optim.grad_accum,
            f"a divisor of train.batch_size={c.train.batch_size}",
        )  # fmt: skip
    if c.rctp.max_tokens and c.rctp.max_tokens > c.train.seq_len:
        yield _fail(
            "rctp.max_tokens", c.rctp.max_tokens,
            f"<= train.seq_len={c.train.seq_len} (examples are packed, never split)",
        )  # fmt: skip
    if c.eval.max_new_tokens >= c.eval.max_len:
        yield _fail(
            "eval.max_new_tokens", c.eval.max_new_tokens, f"< eval.max_len={c.eval.max_len}"
        )
    rl_split = c.env.benchmark == "synthetic" and c.env.synthetic.num_rl > 0
    for key, used, split in (
        ("rl.prompt_split", c.stage in ("grpo", "rcgrpo", "all"), c.rl.prompt_split),
        ("train.warm_start_stop.split", c.train.warm_start_stop.level > 0, stop.split),
        ("rctp.stop.split", rctp_stop.level > 0, rctp_stop.split),
    ):
        if used and split == "rl" and not rl_split:
            yield _fail(
                key, split,
                "'train' unless env.benchmark='synthetic' with env.synthetic.num_rl > 0 "
                "(only the synthetic environment has an rl split)",
            )  # fmt: skip
    if c.stage in RL_STAGES and 0 < c.rl.max_rollouts < c.rl.group_size:
        yield _fail(
            "rl.max_rollouts", c.rl.max_rollouts,
            f"0 (rl.steps x P x G) or >= rl.group_size={c.rl.group_size} (one group)",
        )  # fmt: skip
    per_iteration = c.rl.num_prompts * c.rl.group_size
    if c.stage == "all" and c.rl.max_rollouts > c.rl.steps * per_iteration:
        yield _fail(
            "rl.steps", c.rl.steps,
            f">= rl.max_rollouts / (P x G) = {-(-c.rl.max_rollouts // per_iteration)} for stage "
            "all: a plain arm must be able to spend the budget every arm is compared at",
        )  # fmt: skip
    if c.stage == "all":
        yield from _controls_check(c)
    if c.stage == "all" and c.rl.dynamic_sampling:
        yield _fail(
            "rl.dynamic_sampling", c.rl.dynamic_sampling,
            "False for stage all (each arm sets its own: name the _dynamic arms in config.arms)",
        )  # fmt: skip
    if c.stage == "all" and c.rl.init_from:
        yield _fail(
            "rl.init_from", c.rl.init_from,
            "'' for stage all (each RL arm starts from its own stage-1 export)",
        )  # fmt: skip


def _controls_check(c: ml_collections.ConfigDict) -> Iterable[UserError]:
    """Each control kind must control one of the chosen arms (else it would run nothing)."""
    from rcgrpo_jax.rl.arms import CONTROLS, chosen

    picked = set(chosen(tuple(c.arms)))
    for kind in c.controls:
        controlled = CONTROLS[kind][2]
        if not picked & set(controlled):
            yield _fail(
                "controls", tuple(c.controls),
                f"controls of chosen arms: {kind!r} controls {', '.join(controlled)}, and "
                f"config.arms chooses none of them",
            )  # fmt: skip


def flatten(c: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """Leaf keys as dotted paths ("rl.optim.lr") -> values."""
    out: dict[str, Any] = {}
    for k, v in c.items():
        key = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises UserError (one line) for the first bad key; returns None when the config is sound."""
    # a registered environment's own options: its factory checks them when the stage builds it
    own = (f"env.{c.env.benchmark}.", f"eval.{c.env.benchmark}.")
    for key, value in flatten(c).items():
        rule = RULES.get(key)
        if rule is None and key.startswith(own):
            continue
        if rule is None:
            raise UserError(f"config.{key} is not a known key (declare it in rcgrpo_jax/config.py)")
        want = rule(value)
        if want is not None:
            raise _fail(key, value, want)
    for problem in _cross_checks(c):
        raise problem
