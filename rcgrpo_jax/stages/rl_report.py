"""What an RL run records: the held-out evaluation record (overall and per task kind), each
iteration's metrics and rollouts.jsonl record, its environment-failure warning, its end line,
and the statistics stage `all` and `tools.seeds` read back from metrics.jsonl (`run_stats`);
for the run report, each iteration's trajectories.jsonl lines (`trajectory_records`) and each
evaluation's heldout.jsonl line (`heldout_line`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rcgrpo_jax import distributed
from rcgrpo_jax.envs.base import task_kind
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.rl.advantages import degenerate_groups, group_signal
from rcgrpo_jax.rl.curve import Curve
from rcgrpo_jax.rl.losses import summarize
from rcgrpo_jax.rl.rollout import concat_groups
from rcgrpo_jax.stages.eval import measure_success
from rcgrpo_jax.train.metrics import JsonlLog, read_jsonl

if TYPE_CHECKING:
    from rcgrpo_jax.envs.entries import Entry
    from rcgrpo_jax.rl.dynamic import Filled
    from rcgrpo_jax.rl.losses import Objective
    from rcgrpo_jax.rl.rollout import Rollouts
    from rcgrpo_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Generated:
    """An iteration's rollouts, every round's groups in order: their entries, which groups
    the update trains on (`trained`, [groups] bool), how many trajectories they cost, each
    group's rollout round (`rounds`, [groups] int: 0 without dynamic sampling) and which
    groups dynamic sampling dropped for carrying no signal (`dropped`, [groups] bool)."""

    entries: list[Entry]
    rollouts: Rollouts
    trained: np.ndarray
    trajectories: int
    rounds: np.ndarray
    dropped: np.ndarray

    @classmethod
    def of(cls, filled: Filled, dynamic: bool, estimator: str) -> Generated:
        """The groups of `fill_groups`' rounds (each with its `entries` and `rollouts`), with
        `dynamic` sampling or not, under advantage estimator `estimator`."""
        rounds = filled.rounds
        rewards = np.concatenate([r.rewards for r in rounds])
        # the groups fill_groups dropped for want of signal (one it left for want of room has)
        no_signal = ~np.asarray(group_signal(estimator, rewards))
        return cls(
            entries=[e for r in rounds for e in r.entries],
            rollouts=concat_groups([r.rollouts for r in rounds]),
            trained=np.concatenate(filled.trained),
            trajectories=filled.generated,
            rounds=np.concatenate([np.full(len(r.entries), k) for k, r in enumerate(rounds)]),
            dropped=no_signal & dynamic,
        )


@dataclasses.dataclass(frozen=True)
class Update:
    """An iteration's update: the new state, each applied step's metrics, the update calls the
    batch planned (applied or not), the next iteration's reward tokens as the step drew them
    (None: no step ran), the seconds it took and each generated row's advantage as the update
    saw it ([groups, G]: 0 in a group not trained; `row_advantages`)."""

    state: TrainState
    step_metrics: list[dict[str, Any]]
    planned: int
    next_reward_tokens: np.ndarray | None
    seconds: float
    advantages: np.ndarray


KIND_KEYS = {"eval_success": "eval_by_kind/", "eval_sampled": "eval_sampled_by_kind/"}
# the reward tokens as trajectories.jsonl and heldout.jsonl name them
TOKEN_NAMES = {HIGH: "high", LOW: "low", NONE: "none"}


@dataclasses.dataclass(frozen=True)
class Heldout:
    """A held-out evaluation: its metrics record (`heldout`) and, per task, the greedy
    measurement's outcome (`eval.task_outcome`: the rollout behind `eval_success`)."""

    record: dict[str, float]
    tasks: tuple[dict[str, Any], ...]


def heldout(config, cfg, tokenizer, mesh, entries, token, params, sampled: bool = True) -> Heldout:
    """The RL evaluation: greedy held-out success (`eval_success`) and, with
    `eval.samples` k and `sampled`, the mean success of k samples per entry (`eval_sampled`:
    k times the rollouts of the greedy figure, so only at the start and the end); each also
    per task kind (`eval_by_kind/<kind>`, `eval_sampled_by_kind/<kind>`), and with samples the
    fraction of entries solved by some samples but not all (`eval_sampled_sometimes`)."""
    model, k = (cfg, params), int(config.eval.samples)
    measured = {"eval_success": measure_success(config, model, tokenizer, mesh, entries, token)}
    if k and sampled:
        measured["eval_sampled"] = measure_success(
            config, model, tokenizer, mesh, entries, token, k
        )
    out: dict[str, float] = {}
    for key, m in measured.items():
        out[key] = m.rate
        out.update({f"{KIND_KEYS[key]}{kind}": v for kind, v in m.by_kind.items()})
    if "eval_sampled" in measured:  # held-out prompts a group could carry signal on
        out["eval_sampled_sometimes"] = measured["eval_sampled"].sometimes
    return Heldout(out, measured["eval_success"].tasks)


def by_kind(record: dict[str, Any], key: str = "eval_success") -> dict[str, float]:
    """The per-kind values of a record's `key` (`KIND_KEYS`)."""
    prefix = KIND_KEYS[key]
    return {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}


def run_stats(workdir: Path, budget: int) -> dict[str, Any]:
    """Over an RL run (its metrics.jsonl): mean degenerate-group fraction, entropy and reward,
    the fraction of updates applied, and held-out success at the start (the record of
    iteration 0) and at the end (the last evaluation); sampled success too where measured; the
    trajectories generated, and held-out success against them (`curve`, its normalised area
    `auc`) over the run's `budget`."""
    rows = read_jsonl(workdir / "metrics.jsonl")
    curve = Curve.from_records(rows, budget)
    evals = [r for r in rows if r.get("eval_success") is not None]
    first = lambda k: evals[0].get(k, float("nan")) if evals and evals[0]["step"] == 0 else None
    last = lambda k: evals[-1].get(k, float("nan")) if evals else float("nan")
    # a value is null (NaN) in an iteration without an update (dynamic sampling found no group)
    values = lambda k: [r[k] for r in rows if r.get(k) is not None]
    mean = lambda k: float(np.mean(values(k))) if values(k) else float("nan")
    out = {
        "start_success": first("eval_success"),
        "heldout_success": last("eval_success"),
        "degenerate_frac": mean("degenerate_frac"),
        "entropy": mean("entropy"),
        "reward_mean": mean("reward_mean"),
        "applied_frac": mean("applied_frac"),
        "all_pass_frac": mean("all_pass_frac"),
        "all_fail_frac": mean("all_fail_frac"),
        "generated_rollouts": int(sum(r.get("generated_rollouts") or 0 for r in rows)),
        "curve": curve.to_dict(),
        "auc": curve.area(),
    }
    if any("eval_sampled" in r for r in evals):
        out.update(sampled_start=first("eval_sampled"), sampled_success=last("eval_sampled"))
        out.update(
            sometimes_start=first("eval_sampled_sometimes"),
            sometimes_end=last("eval_sampled_sometimes"),
        )
    if evals:  # success per task kind at the start and the end
        out["kinds"] = {
            "start": by_kind(evals[0]) if evals[0]["step"] == 0 else {},
            "end": by_kind(evals[-1]),
        }
    return out


def iteration_record(update: Update, generated: Generated, total: int) -> dict[str, float]:
    """Per-iteration metrics: group statistics from every generated rollout (recomputable from
    rollouts.jsonl), loss-side values averaged over the iteration's applied updates (of the
    planned calls), except the rollout-trainer agreement (`logp_gap_*`, `ratio_dev_max`): the
    first update's, whose params are still the sampler's (a later update's gap is the policy's
    own change); the trajectories generated, the groups trained on and the running total."""
    step_metrics, planned = update.step_metrics, update.planned
    rollouts = generated.rollouts
    means = collections.defaultdict(lambda: float("nan"))  # no update: no loss-side values
    first = collections.defaultdict(lambda: float("nan"))
    if step_metrics:
        means.update(
            summarize({k: np.mean([float(m[k]) for m in step_metrics]) for k in step_metrics[0]})
        )
        first.update(summarize(step_metrics[0]))
    rewards, reward_token = rollouts.rewards, rollouts.reward_token
    with_token = lambda t: (
        float(rewards[reward_token == t].mean()) if (reward_token == t).any() else float("nan")
    )
    total_s = rollouts.stats["rollout_s"] + update.seconds
    return {
        "loss": means["loss"],
        "grad_norm": means["grad_norm"],
        "entropy": means["entropy"],
        "kl": means["kl"],
        "clip_frac": means["clip_frac"],
        "skipped": means["skipped"],
        # of the iteration's update calls, those applied (not skipped: no signal, non-finite)
        "applied_frac": sum(1.0 - float(m["update_skipped"]) for m in step_metrics)
        / max(planned, 1),
        "reward_mean": float(rewards.mean()),
        "reward_high": with_token(HIGH),
        "reward_low": with_token(LOW),
        "degenerate_frac": float(np.asarray(degenerate_groups(rewards)).mean()),
        # the prompt pool's pass rates: groups all solved / all failed (degenerate = their sum)
        "all_pass_frac": float((rewards == 1).all(1).mean()),
        "all_fail_frac": float((rewards == 0).all(1).mean()),
        "abs_adv_mean": means["abs_adv_mean"],
        "logp_gap_mean": first["logp_gap_mean"],
        "logp_gap_max": first["logp_gap_max"],
        "ratio_dev_max": first["ratio_dev_max"],
        "rollout_s": rollouts.stats["rollout_s"],
        "update_s": update.seconds,
        "sampled_tokens": rollouts.stats["sampled_tokens"],
        "prefill_tokens": rollouts.stats["prefill_tokens"],
        "tokens_per_s": rollouts.stats["trajectory_tokens"] / max(total_s, 1e-9),
        "truncated": rollouts.stats["truncated"],
        "env_errors": rollouts.stats["env_errors"],
        **({"lr": means["lr"]} if "lr" in means else {}),
        "generated_rollouts": float(generated.trajectories),
        "trained_groups": float(generated.trained.sum()),
        "rollouts": total,
    }


def rollout_log_record(iteration: int, generated: Generated) -> dict[str, Any]:
    """rollouts.jsonl's record of an iteration: per group its entry, reward tokens, rewards,
    the process that ran each row's environment, the rows' environment errors and whether the
    update trained on it."""
    rollouts = generated.rollouts
    p, g = rollouts.rewards.shape
    return {
        "iteration": iteration,
        "entry_ids": [e.id for e in generated.entries],
        "reward_token": rollouts.reward_token.tolist(),
        "rewards": rollouts.rewards.tolist(),
        "env_process": rollouts.env_process.tolist(),
        "env_errors": [rollouts.errors[i * g : (i + 1) * g] for i in range(p)],
        "trained": generated.trained.tolist(),
    }


def row_advantages(objective: Objective, rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """[groups, G]: each row's advantage as the update computes it, by the objective's
    estimator from `rewards` (those the step sees: permuted for the shuffled-reward control),
    for the `trained` groups ([groups] bool); 0 in the others, which no update sees."""
    out = np.zeros(rewards.shape, np.float32)
    if trained.any():
        out[trained] = np.asarray(objective.advantages(rewards[trained]))
    return out


def _flag(x: Any) -> bool | None:
    return None if x is None else bool(x)


def trajectory_records(
    iteration: int, generated: Generated, update: Update, keep: int
) -> list[dict[str, Any]]:
    """trajectories.jsonl's lines of iteration `iteration`, one per group kept for the run
    report: the first `keep` groups in generation order (-1: all; `logging.report_groups`),
    each with its entry, round, whether the update trained on it or dynamic sampling dropped
    it, and per row its reward token, reward, verdicts, environment error, advantage
    (`Update.advantages`), truncation and conversation. Multi-process a collective (the
    conversations are gathered from the processes that ran them): every process calls it."""
    ro = generated.rollouts
    n, g = ro.rewards.shape
    groups = range(n if keep < 0 else min(keep, n))
    talks = ro.conversations([i * g + j for i in groups for j in range(g)])
    lines = []
    for i in groups:
        entry, rows = generated.entries[i], []
        for j, result in enumerate(ro.results[i]):
            r = i * g + j
            rows.append({
                "reward_token": TOKEN_NAMES[int(ro.reward_token[i, j])],
                "reward": float(ro.rewards[i, j]),
                "state_ok": _flag(result.state_ok),
                "action_ok": _flag(result.action_ok),
                "error_type": result.error_type,
                "env_error": ro.errors[r],
                "advantage": float(update.advantages[i, j]),
                "truncated": bool(ro.truncated[r]),
                "messages": talks[r],
            })  # fmt: skip
        lines.append({
            "iteration": iteration, "round": int(generated.rounds[i]), "group": i,
            "groups_in_iteration": n, "task_id": entry.id, "category": entry.category,
            "kind": task_kind(entry), "trained": bool(generated.trained[i]),
            "dropped": bool(generated.dropped[i]), "rows": rows,
        })  # fmt: skip
    return lines


def heldout_line(
    iteration: int, trajectories: int, token: int | None, measured: Heldout
) -> dict[str, Any]:
    """heldout.jsonl's line of the evaluation after iteration `iteration` (0: the start), at
    `trajectories` generated, under `token` (None: none): its success as logged
    (`eval_success`) and each task's greedy outcome."""
    return {
        "iteration": iteration,
        "trajectories": trajectories,
        "token": TOKEN_NAMES[NONE if token is None else int(token)],
        "success": measured.record["eval_success"],
        "tasks": list(measured.tasks),
    }


class ReportLogs:
    """The run report's logs of an RL run in `workdir` (process 0 alone opens and writes
    them): trajectories.jsonl, the first `keep` groups of each iteration (-1: all;
    `trajectory_records`), and heldout.jsonl, a line per evaluation under the arm's `token`
    (`heldout_line`). Resumed at iteration `first`, each keeps the lines of the iterations the
    checkpoint holds, and the start's line (iteration 0) only where its metrics record is kept
    (`started`): a run killed between the two measures the start again."""

    def __init__(
        self, stack: contextlib.ExitStack, workdir: Path, first: int, started: bool,
        token: int | None, keep: int,
    ) -> None:  # fmt: skip
        self.token, self.keep = token, keep
        self.trajectories: JsonlLog | None = None
        self.evaluations: JsonlLog | None = None
        if distributed.is_main_process():
            log = lambda name, through: stack.enter_context(
                contextlib.closing(JsonlLog(workdir / name, "iteration", through))
            )
            self.trajectories = log("trajectories.jsonl", first)
            self.trajectories.previous = []  # not read back: only the report reads the file
            self.evaluations = log("heldout.jsonl", first if started else -1)

    def evaluation(self, done: int, total: int, measured: Heldout) -> None:
        """The held-out evaluation after iteration `done` (0: the start), at `total`
        trajectories generated."""
        if self.evaluations is not None:
            self.evaluations.append(heldout_line(done, total, self.token, measured))

    def iteration(self, done: int, generated: Generated, update: Update) -> None:
        """Iteration `done`'s groups kept for the report. Multi-process a collective (the
        conversations are gathered): every process calls it."""
        lines = trajectory_records(done, generated, update, self.keep)
        if self.trajectories is not None:
            for line in lines:
                self.trajectories.append(line)


def warn_env_errors(iteration: int, errors: list[str | None]) -> None:
    """One stderr line for an iteration in which some rollout rows' environment failed."""
    kinds = collections.Counter(e.split(":")[0] for e in errors if e is not None)
    if kinds:
        what = ", ".join(f"{k} x{n}" for k, n in kinds.most_common())
        print(
            f"warning: iteration {iteration}: {sum(kinds.values())} of {len(errors)} rollouts "
            f"failed in the environment ({what}), scored 0; see rollouts.jsonl",
            file=sys.stderr,
            flush=True,
        )


def end_line(
    name: str, stats: dict[str, Any], generated: int, ended: str, steps: int, budget: int
) -> str:
    """The stage's one end line: held-out success start -> end, degenerate groups, updates
    applied and trajectories generated (and whether rl.steps cut the budget short)."""
    begin = stats["start_success"]
    return (
        f"{name}: held-out success "
        + ("" if begin is None else f"{begin:.1%} -> ")
        + f"{stats['heldout_success']:.1%}, degenerate groups {stats['degenerate_frac']:.1%}"
        + f", updates applied {stats['applied_frac']:.0%}, {generated} trajectories"
        + ("" if ended == "budget" else f" (stopped by rl.steps={steps} short of {budget})")
    )
