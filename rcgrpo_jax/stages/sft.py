"""Stages `sft` and `rctp`: build the stage-1 dataset, fine-tune on assistant tokens, export.

`rctp`: mixed-quality trajectories (ground truth, executed perturbations, policy rollouts), each
labelled by the reward it actually received and prefixed by that label's reward token.
`sft`: the same pipeline on label-1 trajectories only, with no token — the baseline.
On an environment with only the protocol (no `golden_trajectories`) the trajectories are its
demonstrations, if it has them, and the starting policy's own rollouts (`rl.rollout.collect`,
`rctp.rollouts_per_entry` per task, for SFT too: its successes are rejection-sampled data).
At the end the policy is exported as an HF directory (tokenizer and reward tokens included) and,
for RCTP, its controllability is measured: held-out success under each reward token.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_collections

from rcgrpo_jax import distributed
from rcgrpo_jax.data import store
from rcgrpo_jax.data.loader import train_loader
from rcgrpo_jax.data.packing import ExampleTooLongError
from rcgrpo_jax.data.trajectories import (
    ROLLOUT,
    DataSettings,
    RecordedEpisode,
    Sources,
    TooFewExamples,
    Trajectory,
    build_rctp_dataset,
    protocol_sources,
)
from rcgrpo_jax.envs.prompts import stop_ids
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.models.flops import flops_per_token
from rcgrpo_jax.stages import setup
from rcgrpo_jax.stages.eval import Success, measure_success
from rcgrpo_jax.train.loop import train_loop
from rcgrpo_jax.train.losses import make_sft_loss
from rcgrpo_jax.train.metrics import JsonlLog, MetricsWriter
from rcgrpo_jax.train.state import make_train_step


def _sampler_seed(config: ml_collections.ConfigDict, call: int) -> int:
    """The seed of stage 1's `call`-th sampling call of the starting policy (one stream each)."""
    return int(config.seed) * 7919 + call


def rollout_policy(config, model, tokenizer, mesh):
    """The initial policy, sampled at temperature `rl.temperature`: the source of RCTP's own
    low-quality trajectories (labelled by the reward they get, like every other source)."""
    import itertools

    from rcgrpo_jax import models, sampling
    from rcgrpo_jax.envs import bfcl

    cfg, params = model
    layout = str(config.mesh.sampler_weights)
    params = models.sampler_params(cfg, params, layout)
    cfg = models.sampler_config(cfg, layout)
    stops, calls = stop_ids(tokenizer), itertools.count()

    def generate(batch: list[list[int]]) -> list[list[int]]:
        out = sampling.generate(
            cfg, params, batch, int(config.rl.max_new_tokens),
            temperature=float(config.rl.temperature), stop_token_ids=stops,
            seed=_sampler_seed(config, next(calls)), mesh=mesh,
        )  # fmt: skip
        return out.tokens

    return bfcl.model_policy(generate, tokenizer, int(config.rctp.rollout_batch))


def policy_rollouts(config: ml_collections.ConfigDict, s: setup.Start) -> Sources:
    """The starting policy's own trajectories on an environment with only the protocol:
    `rctp.rollouts_per_entry` per task, sampled without a reward token under RL's rollout
    settings (`rl.temperature`, `rl.max_new_tokens`, `rl.max_len`), `rctp.rollout_batch` rows
    per `rl.rollout.collect` call; each labelled by its reward. Rows whose environment failed
    are left out (counted in the report's `skipped` as `rollout:env_error`). Multi-process:
    every process gets every row's conversation (`RecordedEpisode`)."""
    import numpy as np

    from rcgrpo_jax import distributed
    from rcgrpo_jax.envs.reward_tokens import NONE
    from rcgrpo_jax.rl.rollout import collect

    env, k = setup.environment(config), int(config.rctp.rollouts_per_entry)
    settings = setup.rl_rollout_settings(config)
    per_call = max(1, int(config.rctp.rollout_batch) // k)

    def rollouts(tasks: Sequence[Any]) -> tuple[list[Trajectory], Counter]:
        tasks = setup.fitting_entries(
            env, tasks, s.tokenizer, settings.chat_format, settings.max_len,
            "stage-1 rollout tasks for rl.max_len",
        )  # fmt: skip
        out, skipped = [], Counter()
        for n, lo in enumerate(range(0, len(tasks), per_call)):
            chunk = tasks[lo : lo + per_call]
            tokens = np.full((len(chunk), k), NONE, np.int32)
            ro = collect(
                s.cfg, s.params, s.tokenizer, env, chunk, tokens, settings,
                seed=_sampler_seed(config, n), mesh=s.mesh,
            )  # fmt: skip
            mine = [
                (r, e.messages, e.tools, e.decoded)
                for r, e in enumerate(ro.episodes)
                if e is not None
            ]  # this process's rows; every process needs them all
            rows = {x[0]: x[1:] for part in distributed.allgather_objects(mine) for x in part}
            results = [x for group in ro.results for x in group]
            for r, (result, error) in enumerate(zip(results, ro.errors, strict=True)):
                if error is not None:
                    skipped[f"{ROLLOUT}:env_error"] += 1
                    continue
                episode = RecordedEpisode(chunk[r // k], *rows[r])
                out.append(Trajectory(ROLLOUT, episode, result))
        return out, skipped

    return rollouts


def data_settings(config: ml_collections.ConfigDict, rctp: bool) -> DataSettings:
    """The stage-1 builder's settings: `rctp.*` (RCTP's mix; plain SFT when not `rctp`)."""
    r = config.rctp
    return DataSettings(
        enabled=rctp, low_per_high=float(r.low_per_high), perturbations=tuple(r.perturbations),
        perturbations_per_entry=int(r.perturbations_per_entry),
        rollouts_per_entry=int(r.rollouts_per_entry), rollout_batch=int(r.rollout_batch),
        heldout_entries=int(r.heldout_entries), max_tokens=int(r.max_tokens),
        seed=int(config.seed), chat_format=config.model.chat_format,
        max_steps_per_turn=int(config.env.max_steps_per_turn),
        call_timeout_s=float(config.env.call_timeout_s),
        min_per_label=int(config.rctp.min_per_label),
    )  # fmt: skip


def dataset(
    config, tokenizer, workdir: Path, rctp: bool, policy=None, sources: Sources | None = None
) -> tuple[str, dict]:
    """The stage-1 dataset: built once per workdir, reused on resume (same seed, same data).
    `sources`: an environment with only the protocol (`protocol_sources`); else the built-ins'
    ground truth, perturbations and `policy`'s rollouts."""
    out = workdir / "data"
    report_path = workdir / "data_report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        if rctp:
            from rcgrpo_jax.envs import prompts

            prompts.add_reward_tokens(tokenizer)
        return report["dataset_dir"], report
    entries = setup.task_entries(config, "train")
    settings = data_settings(config, rctp)
    try:
        report = build_rctp_dataset(
            settings, tokenizer, entries, out, policy=policy, overwrite=True, sources=sources
        )
    except TooFewExamples as e:  # of a label (rctp.min_per_label), or none at all
        raise UserError(f"{config.stage}: {e}") from None
    report_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report["dataset_dir"], report


def too_long_message(config: ml_collections.ConfigDict, length: int, workdir: Path) -> str:
    """The one-line error for a stored stage-1 example longer than a packed row."""
    seq_len, max_tokens = int(config.train.seq_len), int(config.rctp.max_tokens)
    now = "0 = no limit" if max_tokens <= 0 else str(max_tokens)
    return (
        f"a stage-1 example has {length} tokens > train.seq_len={seq_len} (examples are packed, "
        f"never split): raise train.seq_len, or set rctp.max_tokens (now {now}) <= {seq_len} "
        f"to drop longer trajectories (the data is built once per workdir: remove "
        f"{workdir / 'data_report.json'} to rebuild it)"
    )


@dataclass(frozen=True)
class StopRule:
    """Stop training at the first check whose measured quantity reaches `level`: every `every`
    steps, `samples` sampled rollouts on each of the first `entries` tasks of `split` ("train" or
    "rl", never the held-out split). `quantity`: "success" (their mean success; the warm start's
    `train.warm_start_stop`) or "token_gap" (mean success under <|high_reward|> minus under
    <|low_reward|>: RCTP's `rctp.stop`, the tokens learnt)."""

    level: float
    every: int
    entries: int
    samples: int
    split: str = "train"
    quantity: str = "success"

    @property
    def level_pct(self) -> str:
        return f"{100 * self.level:g}%"

    @property
    def key(self) -> str:
        """The check record's field the level applies to: "success" or "gap"."""
        return "success" if self.quantity == "success" else "gap"

    @property
    def measured(self) -> str:
        """What the rule measures, in words: "training success", "rl-split success" or, for the
        token gap, "rl-split success high - low"."""
        where = "training" if self.split == "train" else f"{self.split}-split"
        return f"{where} success" + ("" if self.quantity == "success" else " high - low")

    @property
    def until_note(self) -> str:
        """The stage's start line's clause: ", or until rl-split success 30%"."""
        return f", or until {self.measured} {self.level_pct}"

    @classmethod
    def from_config(
        cls, c: ml_collections.ConfigDict, quantity: str = "success"
    ) -> StopRule | None:
        """The rule `c` (`train.warm_start_stop`, `rctp.stop`) sets for `quantity`; None where
        its level is 0 (off)."""
        if float(c.level) <= 0:
            return None
        return cls(
            float(c.level), int(c.every), int(c.entries), int(c.samples), str(c.split), quantity
        )


def stop_report(rule: StopRule, checks: list[dict[str, Any]], step: int) -> tuple[dict, str]:
    """The summary's `stop` record (the rule, its checks, whether the last one reached the
    level) and the end line's note, for a stage that ended at `step`."""
    reached = bool(checks) and bool(checks[-1]["reached"])
    if reached:
        note = f" (stopped at step {step}: {rule.measured} {checks[-1][rule.key]:.1%}"
        note += f" >= {rule.level_pct})"
    elif checks:
        last = checks[-1]
        note = f" (ran to its cap, step {step}: {rule.measured} {last[rule.key]:.1%} at"
        note += f" step {last['step']} < {rule.level_pct})"
    else:
        note = f" (ran to its cap, step {step}: never checked)"
    return {**vars(rule), "checks": checks, "reached": reached}, note


def check_fields(rule: StopRule, measure: Callable[[Any], Success]) -> dict[str, float]:
    """One check's fields, from `measure(reward_token)` (a sampled measurement of the current
    policy): success and the share of tasks solved sometimes or, for the token gap, the success
    under each token, their difference and the share solved sometimes under the high one."""
    if rule.quantity == "success":
        m = measure(None)
        return {"success": m.rate, "sometimes": m.sometimes}
    high, low = measure(HIGH), measure(LOW)
    return {
        "gap": high.rate - low.rate, "high": high.rate, "low": low.rate,
        "sometimes": high.sometimes,
    }  # fmt: skip


def _stop_checks(
    rule: StopRule | None,
    measure: Callable[[Any], dict[str, float]],
    path: Path,
    resumed_at: int,
) -> tuple[Callable[[int, Any], bool] | None, list[dict[str, Any]], JsonlLog | None]:
    """`train_loop`'s `until` for `rule` (None without one), the list of its checks, and the
    log process 0 appends each check to (`path`; the others measure too, and write nothing).
    At every `rule.every`-th step (not step 0) `until` measures the state (`measure(state)`:
    the fields `check_fields` gives), records {step, fields..., reached, time_s}, and says
    whether `rule.key` reached the level. A stage resumed at `resumed_at` keeps the checks made
    before it; the one at that step is made again, by the resumed loop."""
    if rule is None:
        return None, [], None
    log = JsonlLog(path, "step", resumed_at - 1) if distributed.is_main_process() else None
    checks = list(log.previous) if log is not None else []

    def until(step: int, state: Any) -> bool:
        if step == 0 or step % rule.every:
            return False
        t0 = time.perf_counter()
        fields = measure(state)
        row = {
            "step": step, **fields, "reached": fields[rule.key] >= rule.level,
            "time_s": round(time.perf_counter() - t0, 3),
        }  # fmt: skip
        checks.append(row)
        if log is not None:
            log.append(row)
        return row["reached"]

    return until, checks, log


def run(
    config: ml_collections.ConfigDict, name: str = "", stop: StopRule | None = None
) -> dict[str, Any]:
    """Runs the stage; its end line starts with `name` (default: the stage's). With `stop`,
    training ends at the first check that reaches its level, `train.steps` being the cap."""
    stage = config.stage
    if stage not in ("sft", "rctp"):
        raise UserError(f"stages.sft runs stages sft/rctp, not {stage!r}")
    setup.require_stage1_sources(config, demonstrations=False)
    rctp = stage == "rctp"
    s = setup.start(config)
    workdir = s.workdir
    policy = sources = None
    rollouts = int(config.rctp.rollouts_per_entry) > 0
    if not setup.golden_trajectories(config):
        env = setup.environment(config)
        settings = data_settings(config, rctp)
        sources = protocol_sources(env, settings, policy_rollouts(config, s) if rollouts else None)
    elif rctp and rollouts:
        policy = rollout_policy(config, (s.cfg, s.params), s.tokenizer, s.mesh)
    dataset_dir, report = dataset(config, s.tokenizer, workdir, rctp, policy, sources)
    if rctp:
        s = setup.with_reward_tokens(s)
    elif len(s.tokenizer) > s.cfg.vocab_size:
        raise UserError(f"tokenizer has {len(s.tokenizer)} tokens > model vocab {s.cfg.vocab_size}")

    train = config.train
    source = store.load_split(dataset_dir, "train")
    try:
        loader = train_loader(
            source, batch_size=int(train.batch_size) // jax.process_count(),
            row_len=int(train.seq_len), seed=int(config.seed),
            shard_index=jax.process_index(), shard_count=jax.process_count(),
            gather_head=bool(config.model.gather_head),
        )  # fmt: skip
    except ExampleTooLongError as e:
        raise UserError(too_long_message(config, e.length, workdir)) from None
    tasks = setup.task_entries(config, stop.split)[: stop.entries] if stop else []
    if stop and len(tasks) < stop.entries:
        raise UserError(
            f"config.{'rctp.stop' if rctp else 'train.warm_start_stop'}.entries={stop.entries}: "
            f"the environment has {len(tasks)} {stop.split}-split tasks to measure the rule on"
        )
    data_iter = iter(loader)
    t = setup.training(config, train, s, int(train.steps), data_iter)
    cfg = t.cfg

    def check(state: Any) -> dict[str, float]:  # the rule's measurement of this state
        model = (cfg, t.policy(state))
        return check_fields(
            stop,
            lambda token: measure_success(
                config, model, t.tokenizer, t.mesh, tasks, token, stop.samples
            ),
        )

    until, checks, stop_log = _stop_checks(
        stop, check, workdir / "stop_checks.jsonl", int(t.state.step)
    )
    step_fn = make_train_step(
        make_sft_loss(cfg), t.optimizer, mesh=t.mesh, shardings=t.shardings,
        grad_accum=t.optim.grad_accum, schedule=t.schedule, key=("sft", cfg, t.optim),
        frozen=t.frozen,
    )  # fmt: skip
    with MetricsWriter(
        workdir,
        total_steps=int(train.steps),
        initial_step=int(t.state.step),
        desc=stage,
        bar_keys=("loss", "grad_norm", "tokens_per_s"),
    ) as writer:
        state, history = train_loop(
            step_fn, t.state, data_iter, int(train.steps), checkpointer=t.checkpointer,
            writer=writer, flops_per_token=flops_per_token(cfg, int(train.seq_len)),
            peak_flops=float(train.peak_flops) or None, until=until,
        )  # fmt: skip
    t.checkpointer.close()
    if stop_log is not None:
        stop_log.close()

    summary: dict[str, Any] = {
        "stage": stage, "steps": int(state.step), "export": str(t.export_dir),
        "init_from": str(config.model.hf_path),  # "" = the random init
        "data": report["splits"], "final_loss": history[-1]["loss"] if history else None,
        "skipped_updates": int(state.skipped),
    }  # fmt: skip
    stopped = ""
    if stop is not None:
        summary["stop"], stopped = stop_report(stop, checks, int(state.step))
    line = f"{name or stage}: {int(state.step)} steps"
    n_eval = int(config.rctp.eval_entries)
    if n_eval:
        heldout = setup.task_entries(config, "test")[:n_eval]
        model = (cfg, t.policy(state))
        tokens = {"high": HIGH, "low": LOW} if rctp else {"none": None}
        measured = {
            name: measure_success(config, model, t.tokenizer, t.mesh, heldout, tok)
            for name, tok in tokens.items()
        }
        summary["heldout_success"] = {name: m.rate for name, m in measured.items()}
        summary["heldout_by_kind"] = {name: m.by_kind for name, m in measured.items()}
        rates = summary["heldout_success"]
        got = (
            ", ".join(f"{k} {v:.1%}" for k, v in rates.items()) if rctp else f"{rates['none']:.1%}"
        )
        line = f"{name or stage}: held-out success {got} on {len(heldout)} entries"
    line += stopped
    setup.finish(t, t.policy(state), summary, line)
    return summary
