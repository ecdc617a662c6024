"""Stages `grpo` and `rcgrpo`: rollouts → fused train steps → eval → checkpoints → HF export.

One RL iteration (`run`'s loop), six steps, each a function below:
1-3. `roll_out`: (1) draw P prompts from `rl.prompt_split` (seeded by iteration: resume needs
   no iterator state) and each rollout's reward token (`round_reward_tokens`: RC-GRPO
   r_j ~ P_sample(r), GRPO `rl.grpo_token`; those the previous iteration's fused step drew,
   else the same draw on the host); (2) run the P × G multi-turn rollouts (KV cache kept
   across turns), scored by the environment; (3) select the groups: with `rl.dynamic_sampling`
   drop those without signal (the estimator's rule: for the group-relative ones, rewards all
   equal) and draw more, at most `rl.dynamic_max_rounds` rounds (`fill_groups`).
4. `train_on`: the kept groups laid out as P (`train_batch`: any short of P masked out, so the
   step never recompiles for their number), then `rl.epochs` × `rl.minibatches` fused steps
   over whole groups, advantages (`rl.estimator`) and the loss `rl.objective` inside the step,
   each step also drawing the next iteration's reward tokens. A minibatch without signal
   (`has_signal`: no group carries any by the estimator's rule) is not stepped: the step would
   leave the state untouched (`train.state`). With `rl.shuffle_rewards` (the control) the
   rewards are permuted.
5. `evaluation_due` / `evaluate`: held-out success at the start (the record of iteration 0),
   at the budget points (`rl.eval_points`), every `rl.eval_every` iterations and at the end,
   always under one token (`evaluation_token`), greedy and, at the start and the end, the mean
   of `eval.samples` samples per entry.
6. `Records.iteration`: the iteration's metrics (`rl_report`; with the first update's
   rollout-trainer agreement), its rollouts.jsonl record, the run report's records of it
   (trajectories.jsonl: `logging.report_groups` of its groups with every row's conversation
   and advantage; heldout.jsonl: each evaluation's per-task outcomes) and a checkpoint every
   `rl.checkpoint_every`; at the end (`finish`) an HF export, the dynamics plot, summary.json
   and the end line.

Every generated trajectory counts against `rl.max_rollouts` (default: steps × P × G): the run
ends when the budget is spent (fewer than G trajectories left) or after `rl.steps` iterations,
whichever is first (the summary's `ended`; the end line says when rl.steps cut it short), so
arms with and without dynamic sampling are compared at equal cost. The count is logged per
iteration (`generated_rollouts`, and the running total `rollouts`) and kept in the
checkpoint's data state. With `rl.eval_points` N the run also evaluates each time the total
first reaches one of N evenly spaced points of the budget, recording which (`budget_point`);
summary.json keeps the curve (`rl.curve`) and its area.

Multi-process, every process runs this same loop (SPMD): the sampler and the train step are
programs over the global mesh; each process runs the environment of its own share of the rows
(`rl.rollout`); each process places its own shards of the (identical) host batch, so every row
is in the step exactly once; checkpoints are saved by all processes together; process 0 alone
writes metrics, rollouts.jsonl, trajectories.jsonl and heldout.jsonl (the conversations of the
rows other processes ran are gathered to it), the export, the plot and the summary.

A rollout row whose environment failed scores 0 and is counted (`env_errors` in the metrics, the
row's error in rollouts.jsonl, one `warning:` line per iteration). Resumed after a kill, the run
drops the log records past the restored iteration, so its logs equal an uninterrupted run's.

One module, long because the six steps share one `RunContext` and read best in the order they
run; what they record (metrics, logs, the run report's records) is built in `rl_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from rcgrpo_jax import distributed, report
from rcgrpo_jax.config import base_config
from rcgrpo_jax.envs import Environment
from rcgrpo_jax.envs.entries import Entry
from rcgrpo_jax.envs.reward_tokens import HIGH
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.models import ModelConfig, Params
from rcgrpo_jax.rl.advantages import TokenDraw, group_signal
from rcgrpo_jax.rl.curve import Curve, budget_points, reached
from rcgrpo_jax.rl.draws import prompts_for, reward_tokens_for, rollout_seed, shuffled, token_draw
from rcgrpo_jax.rl.dynamic import fill_groups, padded_batch
from rcgrpo_jax.rl.losses import Objective, objective_from_config
from rcgrpo_jax.rl.rollout import Rollouts, RolloutSettings, collect
from rcgrpo_jax.rl.train_step import NEXT_REWARD_TOKENS, make_rl_step, sequence_logprobs
from rcgrpo_jax.stages import rl_report, setup
from rcgrpo_jax.stages.rl_report import Generated, Heldout, Update
from rcgrpo_jax.train import plots
from rcgrpo_jax.train.metrics import JsonlLog, MetricsWriter, writing
from rcgrpo_jax.train.state import TrainState, batch_sharding

DYNAMICS_KEYS = ("reward_mean", "degenerate_frac", "entropy")


def _updates_per_iteration(rl: ml_collections.ConfigDict) -> int:
    return int(rl.epochs) * int(rl.minibatches)


def rollout_budget(rl: ml_collections.ConfigDict) -> int:
    """Trajectories the run may generate: `rl.max_rollouts`, or steps x P x G where it is 0."""
    return int(rl.max_rollouts) or int(rl.steps) * int(rl.num_prompts) * int(rl.group_size)


def plain_iterations(rl: ml_collections.ConfigDict) -> int:
    """Iterations a run of one round per iteration takes to spend its budget (at most rl.steps)."""
    return min(int(rl.steps), -(-rollout_budget(rl) // (int(rl.num_prompts) * int(rl.group_size))))


def _check(rl: ml_collections.ConfigDict, algo: str) -> None:
    if rl.num_prompts % rl.minibatches:
        raise UserError(
            f"rl.num_prompts={rl.num_prompts} is not divisible by rl.minibatches={rl.minibatches}"
        )
    if algo == "rcgrpo" and rl.stratified and rl.group_size < 2:
        raise UserError("rl.stratified needs rl.group_size >= 2")


def evaluation_token(algo: str, rl: ml_collections.ConfigDict) -> int | None:
    """The token an arm is evaluated under, at its start and at every later evaluation: the
    high token where its rollouts carry reward tokens (RC-GRPO; GRPO under `grpo_token`
    "high"), none otherwise."""
    return HIGH if algo == "rcgrpo" or rl.grpo_token == "high" else None


def _minibatches(batch: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    p = batch["rewards"].shape[0]
    size = p // n
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(n)]


def _ref_logprobs(cfg, params, batch, mesh) -> np.ndarray:
    p, g, t = batch["tokens"].shape
    flat = [_global(batch[k].reshape(p * g, t), mesh) for k in ("tokens", "positions", "segments")]
    out = sequence_logprobs(cfg, params, *flat)
    return distributed.host_array(out).astype(np.float32).reshape(p, g, t)


def _global(x: np.ndarray, mesh) -> jax.Array:
    """The host array (the same on every process) as a global array sharded like a train batch:
    each process places only its own shards. In a single process: what `shard_batch` makes."""
    return distributed.global_from_host(x, batch_sharding(mesh, x.shape))


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every iteration of a run reads: the model's config, tokenizer and mesh, the
    environment and its prompt pools, the rollout settings, the reward-token draw, the
    objective (whose estimator decides which groups carry signal), the fused step, the frozen
    KL reference (None without KL) and the trajectory budget with its
    evaluation points."""

    config: ml_collections.ConfigDict  # the run's whole config
    algo: str
    cfg: ModelConfig  # the policy model's
    tokenizer: Any
    mesh: jax.sharding.Mesh
    env: Environment
    train_pool: list[Entry]
    test_pool: list[Entry]
    settings: RolloutSettings
    reward_token_draw: TokenDraw
    objective: Objective
    step_fn: Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, Any]]]
    ref_params: Params | None
    budget: int
    points: tuple[int, ...]
    microbatches: int  # per update: train.optim's grad_accum

    @property
    def rl(self) -> ml_collections.ConfigDict:
        return self.config.rl

    @property
    def num_prompts(self) -> int:
        return int(self.rl.num_prompts)

    @property
    def group_size(self) -> int:
        return int(self.rl.group_size)

    @property
    def minibatches(self) -> int:
        return int(self.rl.minibatches)

    def spent(self, trajectories: int) -> bool:
        """Whether `trajectories` generated leave less than one group of the budget."""
        return self.budget - trajectories < self.group_size


@dataclasses.dataclass(frozen=True)
class _Round:
    """One rollout round: its entries and their rollouts (`rewards` for `fill_groups`)."""

    entries: list[Entry]
    rollouts: Rollouts

    @property
    def rewards(self) -> np.ndarray:
        return self.rollouts.rewards


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A held-out measurement due after an iteration: the budget point it stands for (-1: a
    periodic one only, `rl.eval_every`) and whether its sampled half runs too (the end)."""

    budget_point: int
    sampled: bool


def _prepare(config: ml_collections.ConfigDict, algo: str) -> tuple[RunContext, setup.Training]:
    """The run's fixed parts and its training set-up (a restored or fresh state)."""
    rl = config.rl
    initial = setup.with_reward_tokens(setup.start(config, rl.init_from))
    env = setup.environment(config)
    train_pool = setup.fitting_entries(
        env, setup.task_entries(config, rl.prompt_split), initial.tokenizer,
        config.model.chat_format, int(rl.max_len),
        f"{rl.prompt_split}-split entries for rl.max_len",
    )  # fmt: skip
    test_pool = setup.task_entries(config, "test")
    if config.eval.max_entries:
        test_pool = test_pool[: int(config.eval.max_entries)]
    # the schedule's default length: a plain run's updates
    updates = plain_iterations(rl) * _updates_per_iteration(rl)
    training = setup.training(config, rl, initial, updates)
    objective = objective_from_config(rl)
    reward_token_draw = token_draw(algo, rl, config.seed)
    step_fn = make_rl_step(
        training.cfg, objective, training.optimizer, reward_token_draw=reward_token_draw,
        mesh=initial.mesh, shardings=training.shardings, grad_accum=training.optim.grad_accum,
        schedule=training.schedule, key=training.optim, frozen=training.frozen,
    )  # fmt: skip
    settings = setup.rl_rollout_settings(config)
    # the KL term's reference, the starting model: under LoRA that is the frozen base itself
    reference = initial.params if training.frozen is None else training.frozen
    budget = rollout_budget(rl)
    ctx = RunContext(
        config=config, algo=algo, cfg=training.cfg, tokenizer=initial.tokenizer, mesh=initial.mesh,
        env=env, train_pool=train_pool, test_pool=test_pool, settings=settings,
        reward_token_draw=reward_token_draw, objective=objective, step_fn=step_fn,
        ref_params=reference if objective.kl_beta > 0 else None, budget=budget,
        points=budget_points(budget, int(rl.eval_points)) if rl.eval_points else (),
        microbatches=training.optim.grad_accum,
    )  # fmt: skip
    return ctx, training


def round_reward_tokens(
    ctx: RunContext, iteration: int, rnd: int, num: int, from_step: np.ndarray | None
) -> np.ndarray:
    """The reward tokens of `num` groups of round `rnd` of `iteration`: for the first round of
    P groups those the previous iteration's step drew (`from_step`) where one ran, else the
    same draw on the host (`reward_tokens_for`)."""
    if from_step is not None and rnd == 0 and num == ctx.num_prompts:
        return from_step
    return reward_tokens_for(ctx.reward_token_draw, iteration, num, rnd)


def roll_out(
    ctx: RunContext, params: Params, iteration: int, budget_left: int, from_step: np.ndarray | None
) -> Generated:
    """Steps 1-3 of an iteration: rounds of P x G rollouts (one round, or with
    `rl.dynamic_sampling` more until P groups carry signal) within `budget_left` trajectories.

    If the rounds stop short of P informative groups (the budget, or `rl.dynamic_max_rounds`),
    the update takes the k it has (cut to a multiple of minibatches x microbatches, laid out as
    P groups with the rest masked: one step shape): they were paid for from the budget, and
    skipping would starve exactly the runs that need the signal most. No informative group: no
    update."""
    rl, seed = ctx.rl, int(ctx.config.seed)
    drawn: set[str] = set()  # entries already in this iteration: later rounds draw others

    def draw(rnd: int, num: int) -> _Round:
        entries = prompts_for(ctx.train_pool, num, seed, iteration, rnd, frozenset(drawn))
        drawn.update(e.id for e in entries)
        rollouts = collect(
            ctx.cfg, params, ctx.tokenizer, ctx.env, entries,
            round_reward_tokens(ctx, iteration, rnd, num, from_step), ctx.settings,
            seed=rollout_seed(seed, iteration, rnd), mesh=ctx.mesh,
        )  # fmt: skip
        return _Round(entries, rollouts)

    dynamic, estimator = bool(rl.dynamic_sampling), ctx.objective.advantage_estimator
    filled = fill_groups(
        draw, ctx.num_prompts, ctx.group_size, budget=budget_left,
        dynamic=dynamic, estimator=estimator, max_rounds=int(rl.dynamic_max_rounds),
        multiple_of=ctx.minibatches * ctx.microbatches,
    )  # fmt: skip
    return Generated.of(filled, dynamic, estimator)


def update_rewards(ctx: RunContext, generated: Generated, iteration: int) -> np.ndarray:
    """The rewards the update's advantages come from, [groups, G] for every generated group:
    the rollouts' own, or shuffled for the control (`rl.shuffle_rewards`)."""
    rewards = generated.rollouts.rewards
    return shuffled(rewards, ctx.config.seed, iteration) if ctx.rl.shuffle_rewards else rewards


def train_batch(
    ctx: RunContext, generated: Generated, rewards: np.ndarray
) -> dict[str, np.ndarray]:
    """The update's host batch: the trained groups laid out as P (the rest masked out,
    `group_mask`), with `rewards` (`update_rewards`), and the frozen reference's log-probs
    where the objective has a KL term."""
    layout = generated.rollouts.batch(bool(ctx.config.model.gather_head), bool(ctx.rl.share_prompt))
    batch = {**layout, "rewards": rewards}
    batch = padded_batch(
        batch, generated.trained, ctx.num_prompts, ctx.minibatches, ctx.microbatches
    )
    if ctx.ref_params is not None:
        batch["ref_logprobs"] = _ref_logprobs(ctx.cfg.base(), ctx.ref_params, batch, ctx.mesh)
    return batch


def has_signal(minibatch: dict[str, np.ndarray], estimator: str = "grpo") -> bool:
    """Whether an update's minibatch holds a group that carries signal: one of its valid groups
    (`group_mask`) does by advantage estimator `estimator`'s rule (grpo's: its rewards differ).
    Without one the fused step computes the update and leaves the state untouched
    (`train.state`), so the loop does not call it."""
    valid = np.asarray(minibatch["group_mask"]) > 0
    return bool(np.asarray(group_signal(estimator, minibatch["rewards"]))[valid].any())


def train_on(ctx: RunContext, state: TrainState, generated: Generated, iteration: int) -> Update:
    """Step 4 of an iteration: `rl.epochs` x `rl.minibatches` fused steps over the trained
    groups (advantages computed inside the step), skipping a minibatch without signal; each step
    also draws the next iteration's reward tokens (every step of an iteration the same ones)."""
    t0 = time.perf_counter()
    step_metrics: list[dict[str, Any]] = []
    planned, next_reward_tokens = 0, None
    rewards = update_rewards(ctx, generated, iteration)
    if generated.trained.any():
        batch = train_batch(ctx, generated, rewards)
        for _ in range(int(ctx.rl.epochs)):
            for minibatch in _minibatches(batch, ctx.minibatches):
                planned += 1
                if not has_signal(minibatch, ctx.objective.advantage_estimator):
                    continue
                minibatch["iteration"] = np.int32(iteration)  # keys the next tokens' draw
                inputs = {k: _global(v, ctx.mesh) for k, v in minibatch.items()}
                state, metrics = ctx.step_fn(state, inputs)
                metrics = distributed.host_tree(metrics)
                next_reward_tokens = metrics.pop(NEXT_REWARD_TOKENS)
                step_metrics.append(metrics)
    seconds = time.perf_counter() - t0
    advantages = rl_report.row_advantages(ctx.objective, rewards, generated.trained)
    return Update(state, step_metrics, planned, next_reward_tokens, seconds, advantages)


def evaluation_due(ctx: RunContext, iteration: int, before: int, total: int) -> Evaluation | None:
    """Step 5: the held-out measurement due after `iteration` (counted from 1), whose rollouts
    took the trajectories generated from `before` to `total`, or None. Due at each budget point
    first reached (a spent budget stands for the last), every `rl.eval_every` iterations and at
    the run's end; its sampled half at the end only."""
    rl, points = ctx.rl, ctx.points
    spent = ctx.spent(total)
    last = spent or iteration == int(rl.steps)
    periodic = bool(rl.eval_every) and iteration % int(rl.eval_every) == 0
    new_point = reached(points, total) > reached(points, before)
    if not (periodic or new_point or (last and (rl.eval_every or points))):
        return None
    if spent and points:
        point = len(points)
    else:
        point = reached(points, total) if new_point else -1
    return Evaluation(budget_point=point, sampled=last)


def evaluate(ctx: RunContext, params: Params, sampled: bool = True) -> Heldout:
    """Held-out success of `params` under the arm's evaluation token (`heldout`)."""
    return rl_report.heldout(
        ctx.config, ctx.cfg, ctx.tokenizer, ctx.mesh, ctx.test_pool,
        evaluation_token(ctx.algo, ctx.rl), params, sampled=sampled,
    )  # fmt: skip


class Records:
    """Step 6, and what `run` reads back: the metrics writer (process 0 alone writes), the
    rollouts log, the run report's logs (`rl_report.ReportLogs`), the checkpointer and the
    records of the run so far (`history`: those a resumed run kept, then each new one)."""

    def __init__(
        self, stack: contextlib.ExitStack, ctx: RunContext, training: setup.Training, first: int
    ) -> None:
        self.ctx = ctx
        self.checkpointer = training.checkpointer
        stack.callback(self.checkpointer.close)  # last out: waits for the final save
        self.writer = stack.enter_context(
            MetricsWriter(
                training.workdir,
                # at one round each (a dynamic arm may end sooner)
                total_steps=plain_iterations(ctx.rl),
                initial_step=first,
                desc=ctx.algo,
                bar_keys=("reward_mean", "degenerate_frac", "eval_success"),
            )
        )
        self.rollouts: JsonlLog | None = None
        if distributed.is_main_process():
            self.rollouts = JsonlLog(training.workdir / "rollouts.jsonl", "iteration", first)
            stack.callback(self.rollouts.close)
        self.history = list(self.writer.previous)
        self.report = rl_report.ReportLogs(
            stack, training.workdir, first, self._start_recorded(),
            evaluation_token(ctx.algo, ctx.rl), int(ctx.config.logging.report_groups),
        )  # fmt: skip

    def _start_recorded(self) -> bool:
        return any(r["step"] == 0 for r in self.history)

    def started(self) -> bool:
        """Whether the start's evaluation is recorded. Process 0 alone holds the records: every
        process must take the same path into the evaluation's collectives, so all go by its
        answer."""
        (started,), *_ = distributed.allgather_objects([self._start_recorded()])
        return bool(started)

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.history.append(self.writer.write(step, record))

    def iteration(
        self, done: int, record: dict[str, Any], generated: Generated, update: Update,
        state: TrainState, total: int,
    ) -> None:  # fmt: skip
        """Iteration `done`'s rollouts, its groups kept for the run report and its metrics, and
        its checkpoint where one is due."""
        self.report.iteration(done, generated, update)  # on every process: a collective
        if self.rollouts is not None:
            self.rollouts.append(rl_report.rollout_log_record(done, generated))
            rl_report.warn_env_errors(done, generated.rollouts.errors)
        self.write(done, record)
        self.save(done, state, total)

    def save(self, done: int, state: TrainState, total: int, force: bool = False) -> None:
        """A checkpoint after iteration `done` (every `rl.checkpoint_every`; `force`: now)."""
        data = {"iteration": done, "generated_rollouts": total}
        if self.checkpointer.save(done, state, data, force=force):
            refresh_report(self.ctx.config)  # a running job's page follows its checkpoints


def run(config: ml_collections.ConfigDict, name: str = "") -> dict[str, Any]:
    """Runs the stage; its end line starts with `name` (default: the stage's)."""
    algo = config.stage
    if algo not in ("grpo", "rcgrpo"):
        raise UserError(f"stages.rl runs stages grpo/rcgrpo, not {algo!r}")
    rl = config.rl
    _check(rl, algo)
    ctx, training = _prepare(config, algo)
    state = training.state
    first = int(training.data_state.get("iteration", 0))  # a resumed run's next iteration
    # The trajectories generated so far, which the budget counts (a checkpoint without the
    # count was made when every iteration generated P x G).
    per_round = ctx.num_prompts * ctx.group_size
    total = int(training.data_state.get("generated_rollouts", first * per_round))
    with contextlib.ExitStack() as stack:
        records = Records(stack, ctx, training, first)
        done = first
        # the start, under the same token as every later evaluation (once: a run killed before
        # its first checkpoint resumes at 0 with this record kept)
        if first == 0 and (rl.eval_every or ctx.points) and not records.started():
            measured = evaluate(ctx, training.policy(state))
            records.report.evaluation(0, 0, measured)
            records.write(0, {**measured.record, "rollouts": 0, "budget_point": 0})
        next_reward_tokens = None  # drawn by the last step; None: drawn on the host
        for iteration in range(first, int(rl.steps)):
            if ctx.spent(total):
                break
            generated = roll_out(
                ctx, training.policy(state), iteration, ctx.budget - total, next_reward_tokens
            )
            update = train_on(ctx, state, generated, iteration)
            state, next_reward_tokens = update.state, update.next_reward_tokens
            before, total = total, total + generated.trajectories
            done = iteration + 1
            record = rl_report.iteration_record(update, generated, total)
            due = evaluation_due(ctx, done, before, total)
            if due is not None:
                measured = evaluate(ctx, training.policy(state), sampled=due.sampled)
                records.report.evaluation(done, total, measured)
                record.update(measured.record)
                record["budget_point"] = due.budget_point
            records.iteration(done, record, generated, update, state, total)
        records.save(done, state, total, force=True)
    return finish(ctx, training, state, records.history, done, total, name or algo)


def finish(
    ctx: RunContext, training: setup.Training, state: TrainState, history: list[dict[str, Any]],
    done: int, total: int, name: str,
) -> dict[str, Any]:  # fmt: skip
    """The run's end: summary.json (with the curve over the budget), the HF export, the dynamics
    plot and the end line starting with `name`; returns the summary."""
    ended = "budget" if ctx.spent(total) else "steps"  # rl.steps capped the run
    curve = Curve.from_records(history, ctx.budget)
    summary = {
        "stage": ctx.algo,
        "iterations": done,
        "generated_rollouts": total,
        "budget": ctx.budget,
        "ended": ended,
        "curve": curve.to_dict(),
        "auc": curve.area(),
        "export": str(training.export_dir),
        "final": history[-1] if history else {},
    }
    line = ""  # process 0 alone writes the plot and prints (and has the metrics file)
    if distributed.is_main_process():
        workdir = training.workdir
        with writing(workdir / "dynamics.png"):
            plots.plot_metrics(
                {ctx.algo: workdir / "metrics.jsonl"}, DYNAMICS_KEYS, workdir / "dynamics.png"
            )
        stats = rl_report.run_stats(workdir, ctx.budget)
        line = rl_report.end_line(name, stats, total, ended, int(ctx.rl.steps), ctx.budget)
    setup.finish(training, training.policy(state), summary, line)
    refresh_report(ctx.config)
    return summary


def refresh_report(config: ml_collections.ConfigDict) -> None:
    """The run report (`report.html` in the workdir, with `config.json` beside it), rebuilt
    from the run's files; process 0 alone writes it, and a failure is a warning only."""
    if distributed.is_main_process():
        report.refresh(config.workdir, config.to_dict(), base_config().to_dict())
