"""The `eval` stage: a policy on a split of the configured environment's tasks, scored by the
environment (BFCL v4 multi-turn: our BFCL checker).

Writes under `<workdir>/eval/<split>-<policy>/`:
- `entries.jsonl`: one line per entry (id, category, reward, state_ok, action_ok, error_type,
  error_turn, steps, decoded);
- `summary.json`: per-category and overall accuracy (%), error counts, wall time, the machine;
- `table.txt`: the one-screen table that is also printed.

The table's header is the environment's `title` and the error counts are of its
`error_types` (both optional: `envs.base.Environment`), then of any other error type the
records show, so that no failure goes uncounted.

Config keys read (declared in `rcgrpo_jax.config`): workdir, eval.policy ('model' |
'ground_truth' | 'empty'), eval.split ('test' | 'train' | 'all'), eval.max_entries (0 = all, else
first N per category), eval.reward_token (None, 0 or 1), eval.batch_size, eval.max_new_tokens,
eval.max_len and eval.temperature (model policy), env.benchmark with its options env.<benchmark>
under eval.<benchmark> (e.g. eval.bfcl.categories), env.max_steps_per_turn, env.call_timeout_s,
model.chat_format ('qwen' | 'llama' | 'python').
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

from rcgrpo_jax import machine
from rcgrpo_jax.envs import Episode, EpisodeSettings, policies
from rcgrpo_jax.envs.base import task_kind
from rcgrpo_jax.envs.reward import ERROR_TYPES, RewardResult
from rcgrpo_jax.envs.reward_tokens import NONE
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.stages import setup


class ModelPolicyUnavailable(UserError, NotImplementedError):
    """eval.policy='model' was asked for without a sampler plugged in."""


def _check_split(split: str) -> None:
    if split not in ("train", "test", "all"):
        raise UserError(f"eval.split={split!r}; expected 'train', 'test' or 'all'")


def select_entries(env: Any, split: str, max_entries: int) -> list[Any]:
    """`env`'s tasks of `split` ('train', 'test' or 'all' = both), at most `max_entries` per
    category (0 = all), grouped by category in `env.categories` order."""
    _check_split(split)
    tasks = [t for s in (("train", "test") if split == "all" else (split,)) for t in env.tasks(s)]
    out = []
    for category in env.categories:
        of_category = [t for t in tasks if t.category == category]
        out += of_category[:max_entries] if max_entries > 0 else of_category
    return out


def make_policy(
    name: str, generate_fn: policies.GenerateFn | None, tokenizer: Any, batch_size: int = 0
) -> policies.Policy:
    """The named policy; 'model' needs the sampler's `generate_fn` and the tokenizer."""
    if name in policies.REFERENCE_POLICIES:
        return policies.REFERENCE_POLICIES[name]
    if name != "model":
        raise UserError(
            f"unknown eval policy {name!r}; expected 'model', "
            f"{', '.join(map(repr, policies.REFERENCE_POLICIES))}"
        )
    if generate_fn is None or tokenizer is None:
        raise ModelPolicyUnavailable(
            "eval.policy='model' needs a sampler: call rcgrpo_jax.stages.eval.run(config, "
            "generate_fn=..., tokenizer=...) where generate_fn(prompts: list[list[int]]) -> "
            "list[list[int]] returns the new tokens of each prompt (e.g. sampling.generate(cfg, "
            "params, prompts, max_new_tokens, stop_token_ids=(end-of-turn id,)).tokens)."
        )
    return policies.model_policy(generate_fn, tokenizer, batch_size)


def entry_record(episode: Episode, result: RewardResult) -> dict[str, Any]:
    """The per-entry jsonl line."""
    return {
        "id": episode.entry.id,
        "category": episode.entry.category,
        "kind": task_kind(episode.entry),
        "reward": result.reward,
        "state_ok": result.state_ok,
        "action_ok": result.action_ok,
        "error_type": result.error_type,
        "error_turn": result.error_turn,
        "steps": sum(len(turn) for turn in episode.decoded),
        "decoded": episode.decoded,
    }


def error_columns(
    records: Sequence[dict[str, Any]], declared: Sequence[str] = ()
) -> tuple[str, ...]:
    """The error types to count: `declared` ones first, then any other the records show, in
    first-seen order."""
    seen = (r["error_type"] for r in records if r["error_type"])
    return tuple(dict.fromkeys([*declared, *seen]))


def summarize(
    records: Sequence[dict[str, Any]], categories: Sequence[str], error_types: Sequence[str] = ()
) -> dict[str, Any]:
    """Per-category counts and accuracies (%); overall = mean over categories, as BFCL does.
    Errors are counted per `error_columns(records, error_types)`."""
    columns = error_columns(records, error_types)
    per_category: dict[str, dict[str, Any]] = {}
    for category in categories:
        rows = [r for r in records if r["category"] == category]
        n = len(rows)
        errors = collections.Counter(r["error_type"] for r in rows if r["error_type"])
        per_category[category] = {
            "n": n,
            "correct": sum(r["reward"] == 1.0 for r in rows),
            "accuracy": 100.0 * sum(r["reward"] for r in rows) / n if n else 0.0,
            "state_ok": 100.0 * sum(r["state_ok"] for r in rows) / n if n else 0.0,
            "action_ok": 100.0 * sum(r["action_ok"] for r in rows) / n if n else 0.0,
            "errors": {e: errors.get(e, 0) for e in columns},
        }
    scored = [c for c in categories if per_category[c]["n"]]
    overall = sum(per_category[c]["accuracy"] for c in scored) / len(scored) if scored else 0.0
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for r in records:
        kinds[r.get("kind") or r["category"]].append(r["reward"])
    return {
        "accuracy": {**{c: per_category[c]["accuracy"] for c in categories}, "overall": overall},
        "categories": per_category,
        # per task kind (`envs.base.task_kind`; BFCL: its category), n and accuracy (%)
        "kinds": {
            k: {"n": len(v), "accuracy": 100.0 * sum(v) / len(v)} for k, v in sorted(kinds.items())
        },
        "num_entries": len(records),
        "num_correct": sum(r["reward"] == 1.0 for r in records),
    }


# BFCL's error types are too long for a column; any other is named after its last ":".
SHORT_ERRORS = dict(
    zip(ERROR_TYPES, ("err:empty", "err:state", "err:resp", "err:force"), strict=True)
)


def format_table(summary: dict[str, Any], title: str) -> str:
    """One screen headed `title`: accuracy, R_state and R_action rates and error counts per
    category (the columns of the summary's error counts)."""
    rows = summary["categories"]
    columns = list(next(iter(rows.values()))["errors"]) if rows else []
    short = {e: SHORT_ERRORS.get(e, e.rsplit(":", 1)[-1]) for e in columns}
    width = {e: max(10, len(short[e])) for e in columns}
    head = (
        f"{title} | split={summary['split']} policy={summary['policy']} "
        f"format={summary['chat_format']} | {summary['num_entries']} entries | "
        f"{summary['wall_time_s']:.1f} s"
    )
    cols = f"{'category':<24}{'n':>5}{'acc%':>8}{'state%':>8}{'action%':>9} " + " ".join(
        f"{short[e]:>{width[e]}}" for e in columns
    )
    lines = [head, cols, "-" * len(cols)]
    for category, c in rows.items():
        lines.append(
            f"{category:<24}{c['n']:>5}{c['accuracy']:>8.2f}{c['state_ok']:>8.2f}"
            f"{c['action_ok']:>9.2f} " + " ".join(f"{c['errors'][e]:>{width[e]}}" for e in columns)
        )
    lines.append("-" * len(cols))
    lines.append(f"{'overall (mean of categories)':<29}{summary['accuracy']['overall']:>8.2f}")
    kinds = summary.get("kinds", {})
    if set(kinds) - set(rows):  # kinds finer than the categories: one line each
        w = max(24, *(len(k) + 1 for k in kinds))
        lines += [f"{'task kind':<{w}}{'n':>5}{'acc%':>8}"]
        lines += [f"{k:<{w}}{v['n']:>5}{v['accuracy']:>8.2f}" for k, v in kinds.items()]
    return "\n".join(lines)


def _model_rollouts(
    config: ml_collections.ConfigDict,
    env: Any,
    entries: Sequence[Any],
    model: tuple[Any, Any],
    tokenizer: Any,
    mesh: Any,
    reward_token: int | None,
    samples: int = 0,
) -> list[tuple[list[Any], Any]]:
    """`rl.rollout.Rollouts` of `env`'s `entries` conditioned on `reward_token` (None: no
    token), `eval.batch_size` (0 = all) at a time: one greedy rollout per entry (eval.temperature),
    or with `samples` k > 0, k per entry at `eval.sample_temperature`. Entries whose prompt
    alone does not fit `eval.max_len` are left out (said once). Returns (entries, their
    rollouts) per batch."""
    import numpy as np

    from rcgrpo_jax.rl.rollout import RolloutSettings, collect

    cfg, params = model
    settings = RolloutSettings(
        chat_format=config.model.chat_format,
        max_new_tokens=int(config.eval.max_new_tokens),
        max_len=int(config.eval.max_len),
        temperature=float(config.eval.sample_temperature if samples else config.eval.temperature),
        max_steps_per_turn=int(config.env.max_steps_per_turn),
        call_timeout_s=float(config.env.call_timeout_s),
        sampler_weights=str(config.mesh.sampler_weights),
    )
    entries = setup.fitting_entries(
        env, entries, tokenizer, settings.chat_format, settings.max_len,
        "evaluation entries for eval.max_len",
    )  # fmt: skip
    size = int(config.eval.batch_size) or len(entries)
    out = []
    for i in range(0, len(entries), size):
        chunk = entries[i : i + size]
        token = NONE if reward_token is None else int(reward_token)
        tokens = np.full((len(chunk), max(samples, 1)), token, np.int32)
        ro = collect(cfg, params, tokenizer, env, chunk, tokens, settings, seed=i, mesh=mesh)
        out.append((chunk, ro))
    return out


@dataclasses.dataclass(frozen=True)
class Success:
    """Held-out success: over every rollout (`rate`), per task kind (`by_kind`,
    `envs.base.task_kind`: where a change came from), and the fraction of entries solved by
    some of their rollouts but not all (`sometimes`: with several samples per entry, the
    prompts on which a group can carry signal; 0 with one rollout per entry)."""

    rate: float
    by_kind: dict[str, float]
    sometimes: float = 0.0
    # per entry measured, in order: its first rollout (`task_outcome`; the only one without
    # samples), what the run report shows of each held-out task
    tasks: tuple[dict[str, Any], ...] = ()


def task_outcome(entry: Any, result: RewardResult, messages: list[dict[str, str]]) -> dict:
    """One held-out task's record in the RL stage's heldout.jsonl: its id, category and kind,
    whether the rollout solved it (reward 1), its error type and its conversation."""
    return {
        "task_id": entry.id,
        "category": entry.category,
        "kind": task_kind(entry),
        "success": bool(result.reward == 1.0),
        "error_type": result.error_type,
        "messages": messages,
    }


def measure_success(
    config: ml_collections.ConfigDict,
    model: tuple[Any, Any],
    tokenizer: Any,
    mesh: Any,
    entries,
    reward_token,
    samples: int = 0,
) -> Success:
    """Held-out success of the model (eval.* sampling settings), conditioned on `reward_token`
    (None: no token), overall and per task kind — for periodic RL evaluation and the RCTP
    controllability report. With `samples` k > 0: the mean success of k rollouts per entry at
    `eval.sample_temperature` (sees a policy's change before its greedy choice flips). A
    measurement this process has already made (the same parameters, tokenizer, entries and
    settings) is not run again: its first value is returned, also where an environment's
    wall-clock limit (`env.call_timeout_s`) could have scored a repeat differently."""
    key = _measurement_key(config, model, tokenizer, mesh, entries, reward_token, samples)
    if key is not None and key in _MEASURED:
        return _MEASURED[key]
    env = setup.environment(config)
    per_kind: dict[str, list[float]] = collections.defaultdict(list)
    per_entry: list[float] = []
    tasks: list[dict[str, Any]] = []
    for chunk, ro in _model_rollouts(
        config, env, entries, model, tokenizer, mesh, reward_token, samples
    ):  # every rollout's reward, whichever process ran it
        k = ro.rewards.shape[1]
        first = ro.conversations(range(0, len(chunk) * k, k))  # each entry's first rollout
        for i, (entry, row) in enumerate(zip(chunk, ro.rewards, strict=True)):
            per_kind[task_kind(entry)] += [float(x) for x in row]
            per_entry.append(float(row.mean()))
            tasks.append(task_outcome(entry, ro.results[i][0], first[i * k]))
    rewards = [x for xs in per_kind.values() for x in xs]
    out = Success(
        rate=sum(rewards) / max(len(rewards), 1),
        by_kind={k: sum(v) / len(v) for k, v in sorted(per_kind.items())},
        sometimes=sum(0 < x < 1 for x in per_entry) / max(len(per_entry), 1),
        tasks=tuple(tasks),
    )
    if key is not None:
        _MEASURED[key] = out
    return out


# Successes measured in this process, by `_measurement_key`. Stage `all` evaluates each
# stage-1 policy at its end, and again as the start of every RL arm (and control) that begins
# from it, under the same token: those repeats are answered from here, not measured again.
_MEASURED: dict[str, Success] = {}
# Parameters above this size are not hashed: an evaluation of such a model is a small part
# of its run, and reading them all to the host is not.
_MEMO_MAX_BYTES = 1 << 28


def _measurement_key(config, model, tokenizer, mesh, entries, reward_token, samples) -> str | None:
    """A digest of everything `measure_success`'s value depends on: the parameters' bytes, the
    model config, mesh, tokenizer (`setup.tokenizer_fingerprint`), the entries and the
    evaluation, environment and sampler settings. None (measure every time) in a
    multi-process run (every process must take the same path into the rollouts' collectives),
    or when the parameters are larger than `_MEMO_MAX_BYTES`."""
    import hashlib

    import jax
    import numpy as np

    from rcgrpo_jax.envs.prompts import stop_ids

    if jax.process_count() > 1:
        return None
    cfg, params = model
    leaves = jax.tree_util.tree_leaves(params)
    if sum(x.nbytes for x in leaves) > _MEMO_MAX_BYTES:
        return None
    digest = hashlib.sha256()
    for x in leaves:  # the layout too: with mesh.sampler_weights='train' the dots follow it
        digest.update(str(getattr(x, "sharding", None)).encode())
    for x in jax.device_get(leaves):
        x = np.ascontiguousarray(x)
        digest.update(f"{x.dtype}{x.shape}".encode())
        digest.update(x.tobytes())
    settings = {
        "cfg": repr(cfg), "mesh": repr(getattr(mesh, "shape", None)),
        "eval": config.eval.to_dict(), "env": config.env.to_dict(), "seed": config.seed,
        "chat_format": config.model.chat_format, "weights": config.mesh.sampler_weights,
        "tokenizer": (setup.tokenizer_fingerprint(tokenizer), len(tokenizer)),
        "template": str(getattr(tokenizer, "chat_template", None)), "stops": stop_ids(tokenizer),
        "entries": [repr(e) for e in entries], "token": reward_token, "samples": samples,
    }  # fmt: skip
    digest.update(json.dumps(settings, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


def run(
    config: ml_collections.ConfigDict,
    generate_fn: policies.GenerateFn | None = None,
    tokenizer: Any = None,
    model: tuple[Any, Any] | None = None,
    mesh: Any = None,
) -> dict:
    """Evaluate `config.eval.policy` on `config.eval.split`; write outputs; return the summary.

    policy='model' uses `model` = (cfg, params) — loaded from the config when not given — and
    the rollout sampler; `generate_fn` instead plugs any token-level sampler (re-prompting).
    """
    policy_name = config.eval.policy
    split = config.eval.split
    env = setup.environment(config, "eval")
    entries = select_entries(env, split, int(config.eval.max_entries))
    categories = list(env.categories)
    chat_format = config.model.chat_format
    use_rollouts = policy_name == "model" and generate_fn is None
    if use_rollouts:
        mesh = mesh if mesh is not None else setup.mesh_from_config(config)
        model = model if model is not None else setup.model_from_config(config, mesh)
        tokenizer = tokenizer if tokenizer is not None else setup.tokenizer_from_config(config)
    else:
        policy = make_policy(policy_name, generate_fn, tokenizer, int(config.eval.batch_size))

    start = time.perf_counter()
    if use_rollouts:
        from rcgrpo_jax import distributed

        records = []
        rollouts = _model_rollouts(
            config, env, entries, model, tokenizer, mesh, config.eval.reward_token
        )
        for _, ro in rollouts:
            mine = [
                entry_record(e, res[0])
                for e, res in zip(ro.episodes, ro.results, strict=True)
                if e is not None
            ]  # this process's entries; gathered so that process 0 writes them all
            records += [r for part in distributed.allgather_objects(mine) for r in part]
    else:
        settings = EpisodeSettings(
            chat_format,
            max_steps_per_turn=int(config.env.max_steps_per_turn),
            call_timeout_s=float(config.env.call_timeout_s),
        )
        token = config.eval.reward_token
        episodes = [env.episode(entry, settings, reward_token=token) for entry in entries]
        policies.run_episodes(episodes, policy)
        records = [entry_record(e, e.result()) for e in episodes]
    summary = {
        "split": split,
        "policy": policy_name,
        "chat_format": chat_format,
        **summarize(records, categories, tuple(getattr(env, "error_types", ()))),
        "wall_time_s": time.perf_counter() - start,
        "machine": machine.describe(),
    }

    out_dir = Path(config.workdir) / "eval" / f"{split}-{policy_name}"
    import jax

    if jax.process_index() != 0:  # process 0 writes
        return {**summary, "output_dir": str(out_dir)}
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "entries.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    table = format_table(summary, getattr(env, "title", str(config.env.benchmark)))
    (out_dir / "table.txt").write_text(table + "\n", encoding="utf-8")
    print(table)
    summary["output_dir"] = str(out_dir)
    return summary
