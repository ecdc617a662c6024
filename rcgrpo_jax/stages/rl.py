"""Stages `grpo` and `rcgrpo`: rollouts → fused train steps → eval → checkpoints → HF export.

One RL iteration, read top to bottom:
1. draw P prompts from `rl.prompt_split` (stage 1's training tasks, or the synthetic
   environment's third split; seeded by iteration: resume needs no iterator state);
2. take each rollout's reward token: r_j ~ P_sample(r) for RC-GRPO; GRPO: `rl.grpo_token`. The
   previous iteration's fused step drew them (the first iteration's, or after an iteration
   without an update: the same draw, jitted, on the host), keyed by seed and iteration alone;
3. run the P × G multi-turn rollouts (KV cache kept across turns), rewards from the environment;
   with `rl.dynamic_sampling`, drop the groups whose rewards are all equal and repeat 1-3 for
   the missing groups (seeded by iteration and round; their tokens drawn on the host), at most
   `rl.dynamic_max_rounds` rounds; the kept groups go into a batch of P groups, any short of P
   masked out (`group_mask`), so the step never recompiles for their number;
4. `rl.epochs` × `rl.minibatches` fused train steps over whole groups (advantages in the step),
   with the loss `rl.objective` names; each step also draws the next iteration's reward tokens.
   A minibatch whose groups are all degenerate has no signal: its step is not called (the
   step would leave params, Adam's moments and the schedule untouched: `train.state`);
   `applied_frac` logs how many of the planned updates were applied. With
   `rl.shuffle_rewards` (the control) the step's rewards are permuted across the batch;
5. log (with the first update's rollout-trainer agreement: |log p_train - log p_sampler| over
   generated tokens and max |ratio - 1|), evaluate at the start (the record of iteration 0)
   and every `rl.eval_every` iterations, always under one token (`evaluation_token`), greedy
   and, with `eval.samples` k, at the start and the end the mean of k samples per entry,
   checkpoint every `rl.checkpoint_every`; at the end export an HF directory and plot dynamics.

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
writes metrics, rollouts.jsonl, the export, the plot and the summary.

A rollout row whose environment failed scores 0 and is counted (`env_errors` in the metrics, the
row's error in rollouts.jsonl, one `warning:` line per iteration). Resumed after a kill, the run
drops the log records past the restored iteration, so its logs equal an uninterrupted run's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from rcgrpo_jax import distributed
from rcgrpo_jax.envs.reward_tokens import HIGH, LOW, NONE
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.rl.advantages import TokenDraw, degenerate_groups, draw_reward_tokens_jit
from rcgrpo_jax.rl.curve import Curve, budget_points, reached
from rcgrpo_jax.rl.dynamic import fill_groups, padded_batch
from rcgrpo_jax.rl.losses import summarize
from rcgrpo_jax.rl.rollout import Rollouts, RolloutSettings, collect, concat_groups
from rcgrpo_jax.rl.train_step import NEXT_TOKENS, make_rl_step, sequence_logprobs
from rcgrpo_jax.stages import setup
from rcgrpo_jax.stages.eval import measure_success
from rcgrpo_jax.train import plots
from rcgrpo_jax.train.metrics import JsonlLog, MetricsWriter, read_jsonl, writing
from rcgrpo_jax.train.state import batch_sharding

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


def token_draw(algo: str, rl: ml_collections.ConfigDict, seed: int) -> TokenDraw:
    """The run's reward-token assignment (GRPO: every row `rl.grpo_token`)."""
    fixed = (HIGH if rl.grpo_token == "high" else NONE) if algo == "grpo" else None
    return TokenDraw(
        seed=int(seed), num_groups=int(rl.num_prompts), group_size=int(rl.group_size),
        p_high=float(rl.p_high), stratified=bool(rl.stratified), fixed=fixed,
    )  # fmt: skip


def evaluation_token(algo: str, rl: ml_collections.ConfigDict) -> int | None:
    """The token an arm is evaluated under, at its start and at every later evaluation: the
    high token where its rollouts carry reward tokens (RC-GRPO; GRPO under `grpo_token`
    "high"), none otherwise."""
    return HIGH if algo == "rcgrpo" or rl.grpo_token == "high" else None


def reward_tokens_for(
    draw: TokenDraw, iteration: int, num: int | None = None, rnd: int = 0
) -> np.ndarray:
    """[num (default P), G] reward tokens of one iteration's round `rnd`, drawn on the host by
    the program the fused step runs for the next iteration's (the draw's values as inputs, as
    there: one program for every arm)."""
    return np.asarray(draw_reward_tokens_jit(draw.shape(), iteration, rnd, num, draw.inputs()))


def prompts_for(
    pool: list[Any],
    num: int,
    seed: int,
    iteration: int,
    rnd: int = 0,
    drawn: frozenset = frozenset(),
) -> list[Any]:
    """`num` training entries of one iteration's round `rnd`, without replacement within the
    iteration: a later round draws from the entries not `drawn` before (all, if too few)."""
    rng = np.random.default_rng([seed, iteration] if rnd == 0 else [seed, iteration, rnd])
    fresh = [e for e in pool if e.id not in drawn]
    pool = fresh if len(fresh) >= num else pool
    return [pool[i] for i in rng.choice(len(pool), size=num, replace=len(pool) < num)]


def rollout_seed(seed: int, iteration: int, rnd: int = 0) -> int:
    """The sampler's seed for one iteration's round `rnd`."""
    if rnd == 0:
        return seed * 1_000_003 + iteration
    return int(np.random.SeedSequence([seed, iteration, rnd]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class _Drawn:
    """One rollout round: its entries and their rollouts (`rewards` for `fill_groups`)."""

    entries: list[Any]
    rollouts: Rollouts

    @property
    def rewards(self) -> np.ndarray:
        return self.rollouts.rewards


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


def shuffled(rewards: np.ndarray, seed: int, iteration: int) -> np.ndarray:
    """`rewards` [n, G] permuted across all n x G rollouts (`rl.shuffle_rewards`, the control):
    the batch's reward distribution kept, its link to the trajectories broken."""
    rng = np.random.default_rng([seed, iteration, 0x5EED])
    return rng.permutation(rewards.reshape(-1)).reshape(rewards.shape)


KIND_KEYS = {"eval_success": "eval_by_kind/", "eval_sampled": "eval_sampled_by_kind/"}


def heldout(
    config, cfg, tokenizer, mesh, entries, token, params, sampled: bool = True
) -> dict[str, float]:
    """The RL evaluation record: greedy held-out success (`eval_success`) and, with
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
    return out


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


def run(config: ml_collections.ConfigDict, name: str = "") -> dict[str, Any]:
    """Runs the stage; its end line starts with `name` (default: the stage's)."""
    algo = config.stage
    if algo not in ("grpo", "rcgrpo"):
        raise UserError(f"stages.rl runs stages grpo/rcgrpo, not {algo!r}")
    rl = config.rl
    _check(rl, algo)
    s = setup.with_reward_tokens(setup.start(config, rl.init_from))
    workdir, mesh, tokenizer = s.workdir, s.mesh, s.tokenizer
    env = setup.environment(config)
    train_pool = setup.fitting_entries(
        env, setup.task_entries(config, rl.prompt_split), tokenizer, config.model.chat_format,
        int(rl.max_len), f"{rl.prompt_split}-split entries for rl.max_len",
    )  # fmt: skip
    test_pool = setup.task_entries(config, "test")
    if config.eval.max_entries:
        test_pool = test_pool[: int(config.eval.max_entries)]

    iterations = plain_iterations(rl)  # the schedule's default length: a plain run's updates
    t = setup.training(config, rl, s, iterations * _updates_per_iteration(rl))
    cfg, optim_cfg, ckpt, state = t.cfg, t.optim, t.checkpointer, t.state
    objective = setup.objective_from_config(rl)
    tokens_draw = token_draw(algo, rl, config.seed)
    step_fn = make_rl_step(
        cfg, objective, t.optimizer, tokens=tokens_draw, mesh=mesh, shardings=t.shardings,
        grad_accum=optim_cfg.grad_accum, schedule=t.schedule, key=optim_cfg,
    )  # fmt: skip
    settings = RolloutSettings(
        chat_format=config.model.chat_format, max_new_tokens=int(rl.max_new_tokens),
        max_len=int(rl.max_len), temperature=float(rl.temperature), top_p=float(rl.top_p),
        max_steps_per_turn=int(config.env.max_steps_per_turn),
        call_timeout_s=float(config.env.call_timeout_s), max_rows=int(rl.max_rows),
        sampler_weights=str(config.mesh.sampler_weights),
    )  # fmt: skip
    ref_params = s.params if objective.kl_beta > 0 else None
    del s  # the state owns the policy from here on
    p_, g_ = int(rl.num_prompts), int(rl.group_size)
    gather_head = bool(config.model.gather_head)
    mbs, ga = int(rl.minibatches), optim_cfg.grad_accum  # an update's minibatches x microbatches
    budget = rollout_budget(rl)
    start = int(t.data_state.get("iteration", 0))
    # a checkpoint without the count: made when every iteration generated P x G
    generated = int(t.data_state.get("generated_rollouts", start * p_ * g_))

    # held-out success at N evenly spaced trajectory counts (the cost curve, `rl.curve`)
    points = budget_points(budget, int(rl.eval_points)) if rl.eval_points else ()
    evaluating = bool(rl.eval_every or points)
    eval_token = evaluation_token(algo, rl)
    main = distributed.is_main_process()
    with contextlib.ExitStack() as stack:
        stack.callback(ckpt.close)  # last out: waits for the final save
        writer = stack.enter_context(
            MetricsWriter(
                workdir,
                total_steps=iterations,  # at one round each (a dynamic arm may end sooner)
                initial_step=start,
                desc=algo,
                bar_keys=("reward_mean", "degenerate_frac", "eval_success"),
            )
        )
        rollout_log = JsonlLog(workdir / "rollouts.jsonl", "iteration", start) if main else None
        if rollout_log is not None:
            stack.callback(rollout_log.close)
        history = list(writer.previous)
        done = start
        tokens = reward_tokens_for(tokens_draw, start)  # later iterations': from the step
        evaluate = functools.partial(heldout, config, cfg, tokenizer, mesh, test_pool, eval_token)
        # the start, under the same token as every later evaluation (once: a run killed before
        # its first checkpoint resumes at 0 with this record kept)
        # process 0 alone holds the records: every process must take the same path into the
        # evaluation's collectives, so they go by its answer
        (started,), *_ = distributed.allgather_objects([any(r["step"] == 0 for r in history)])
        if start == 0 and evaluating and not started:
            record = {**evaluate(state.params), "rollouts": 0, "budget_point": 0}
            history.append(writer.write(0, record))
        for it in range(start, int(rl.steps)):
            if budget - generated < g_:
                break
            drawn: set[str] = set()

            def draw(rnd: int, n: int, it=it, drawn=drawn, params=state.params, first=tokens):
                entries = prompts_for(train_pool, n, config.seed, it, rnd, frozenset(drawn))
                drawn.update(e.id for e in entries)
                rt = first if rnd == 0 and n == p_ else reward_tokens_for(tokens_draw, it, n, rnd)
                ro = collect(
                    cfg, params, tokenizer, env, entries, rt, settings,
                    seed=rollout_seed(config.seed, it, rnd), mesh=mesh,
                )  # fmt: skip
                return _Drawn(entries, ro)

            # Cap hit with fewer than P informative groups: the update takes the k it has (cut
            # to a multiple of minibatches x microbatches, laid out as P groups with the rest
            # masked: one step shape): they were paid for from the budget, and skipping would
            # starve exactly the runs that need the signal most. No informative group: no update.
            filled = fill_groups(
                draw, p_, g_, budget=budget - generated, dynamic=bool(rl.dynamic_sampling),
                max_rounds=int(rl.dynamic_max_rounds),
                multiple_of=mbs * ga,
            )  # fmt: skip
            before, generated = generated, generated + filled.generated
            ro = concat_groups([d.rollouts for d in filled.rounds])
            entries = [e for d in filled.rounds for e in d.entries]
            trained = np.concatenate(filled.trained)
            t0 = time.perf_counter()
            step_metrics: list[dict[str, Any]] = []
            planned = 0  # update calls the iteration's batch makes (skipped or not)
            tokens = None
            if trained.any():
                batch = ro.batch(gather_head)
                if rl.shuffle_rewards:
                    batch["rewards"] = shuffled(batch["rewards"], config.seed, it)
                batch = padded_batch(batch, trained, p_, mbs, ga)
                if ref_params is not None:
                    batch["ref_logprobs"] = _ref_logprobs(cfg, ref_params, batch, mesh)
                for _ in range(int(rl.epochs)):
                    for mb in _minibatches(batch, mbs):
                        planned += 1
                        if not has_signal(mb):  # the step would compute it and not apply it
                            continue
                        mb["iteration"] = np.int32(it)  # the step draws iteration it + 1's tokens
                        state, m = step_fn(state, {k: _global(v, mesh) for k, v in mb.items()})
                        m = distributed.host_tree(m)
                        tokens = m.pop(NEXT_TOKENS)  # keyed by iteration: all updates' agree
                        step_metrics.append(m)
            update_s = time.perf_counter() - t0
            if tokens is None:  # no update: the same draw on the host
                tokens = reward_tokens_for(tokens_draw, it + 1)
            record = _iteration_record(step_metrics, planned, ro, update_s)
            record.update(
                generated_rollouts=float(filled.generated), trained_groups=float(trained.sum()),
                rollouts=generated,
            )  # fmt: skip
            if rollout_log is not None:
                p, g = ro.rewards.shape
                rollout_log.append({
                    "iteration": it + 1, "entry_ids": [e.id for e in entries],
                    "reward_token": ro.reward_token.tolist(), "rewards": ro.rewards.tolist(),
                    "env_process": ro.env_process.tolist(),
                    "env_errors": [ro.errors[i * g : (i + 1) * g] for i in range(p)],
                    "trained": trained.tolist(),
                })  # fmt: skip
                _warn_env_errors(it + 1, ro.errors)
            spent = budget - generated < g_  # within one round of the budget
            last = spent or it + 1 == int(rl.steps)
            periodic = bool(rl.eval_every) and (it + 1) % int(rl.eval_every) == 0
            new_point = reached(points, generated) > reached(points, before)
            if periodic or new_point or (last and evaluating):
                record.update(evaluate(state.params, sampled=last))
                # the budget point this measurement stands for; -1: none (periodic only)
                record["budget_point"] = (
                    len(points) if spent and points
                    else reached(points, generated) if new_point else -1
                )  # fmt: skip
            history.append(writer.write(it + 1, record))
            done = it + 1
            ckpt.save(done, state, {"iteration": done, "generated_rollouts": generated})
        ckpt.save(done, state, {"iteration": done, "generated_rollouts": generated}, force=True)

    ended = "budget" if budget - generated < g_ else "steps"  # rl.steps capped the run
    curve = Curve.from_records(history, budget)
    summary = {
        "stage": algo,
        "iterations": done,
        "generated_rollouts": generated,
        "budget": budget,
        "ended": ended,
        "curve": curve.to_dict(),
        "auc": curve.area(),
        "export": str(t.export_dir),
        "final": history[-1] if history else {},
    }
    if main:
        with writing(workdir / "dynamics.png"):
            plots.plot_metrics(
                {algo: workdir / "metrics.jsonl"}, DYNAMICS_KEYS, workdir / "dynamics.png"
            )
    line = ""  # process 0 alone prints (and has the metrics file)
    if main:
        stats = run_stats(workdir, budget)
        begin = stats["start_success"]
        line = (
            f"{name or algo}: held-out success "
            + ("" if begin is None else f"{begin:.1%} -> ")
            + f"{stats['heldout_success']:.1%}, degenerate groups {stats['degenerate_frac']:.1%}"
            + f", updates applied {stats['applied_frac']:.0%}, {generated} trajectories"
            + ("" if ended == "budget" else f" (stopped by rl.steps={rl.steps} short of {budget})")
        )
    setup.finish(t, state.params, summary, line)
    return summary


def _warn_env_errors(iteration: int, errors: list[str | None]) -> None:
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


def has_signal(batch: dict[str, np.ndarray]) -> bool:
    """Whether an update's batch holds a group that carries signal: one of its valid groups
    (`group_mask`) has rewards that differ. Without one the fused step computes the update and
    leaves the state untouched (`train.state`), so the loop does not call it."""
    valid = np.asarray(batch["group_mask"]) > 0
    return bool((~np.asarray(degenerate_groups(batch["rewards"]))[valid]).any())


def _iteration_record(
    step_metrics: list[dict], planned: int, ro, update_s: float
) -> dict[str, float]:
    """Per-iteration metrics: group statistics from every generated rollout (recomputable from
    rollouts.jsonl), loss-side values averaged over the iteration's applied updates (of
    `planned` calls), except the rollout-trainer agreement (`logp_gap_*`, `ratio_dev_max`): the
    first update's, whose params are still the sampler's (a later update's gap is the policy's
    own change)."""
    means = collections.defaultdict(lambda: float("nan"))  # no update: no loss-side values
    first = collections.defaultdict(lambda: float("nan"))
    if step_metrics:
        means.update(
            summarize({k: np.mean([float(m[k]) for m in step_metrics]) for k in step_metrics[0]})
        )
        first.update(summarize(step_metrics[0]))
    rewards, rt = ro.rewards, ro.reward_token
    with_token = lambda t: float(rewards[rt == t].mean()) if (rt == t).any() else float("nan")
    total_s = ro.stats["rollout_s"] + update_s
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
        "rollout_s": ro.stats["rollout_s"],
        "update_s": update_s,
        "sampled_tokens": ro.stats["sampled_tokens"],
        "prefill_tokens": ro.stats["prefill_tokens"],
        "tokens_per_s": ro.stats["trajectory_tokens"] / max(total_s, 1e-9),
        "truncated": ro.stats["truncated"],
        "env_errors": ro.stats["env_errors"],
        **({"lr": means["lr"]} if "lr" in means else {}),
    }
