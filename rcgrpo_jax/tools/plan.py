"""AOT planner: will a config fit a TPU slice (or GPUs), and how fast could its steps run?

    python -m rcgrpo_jax.tools.plan --config=configs/qwen7b.py --topology=v5p-16 \\
        [--prompts=8 --group=8 --seq=16384 --grad_accum=4] [--config.mesh.shape=(1,4,2)] \\
        [--config.model.remat=full] [--json=plan.json]

It plans what the config runs: P, G, T and grad_accum default to the config's RL update
(`rl.num_prompts` / `rl.minibatches`, `rl.group_size`, `rl.max_len`, `rl.optim.grad_accum`; the
flags override them), the prefill chunk to the sampler's `Buckets.chunk_max`, and the attention
kernels to what `model.attention` picks on the chip, a TPU or a GPU (`models.attention.resolve`,
for the train step and for the sampler's cached attention). Under `model.lora.rank` > 0 the
state trains the adapters and the base is the step's frozen argument. Splash (a Pallas TPU
kernel) and cuDNN's attention do not compile for the CPU, so such a config's train step is
compiled with `flash` in its place: the same O(T * block) memory (blockwise scores, output +
log-sum-exp kept for the backward pass); the output says so. Its FLOPs are counted for the
kernel planned.

For a topology of N chips the planner runs on N virtual CPU devices (it re-executes itself with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`), builds the config's (data, fsdp, tensor)
mesh and lowers + compiles, with abstract inputs only (ShapeDtypeStructs carrying NamedShardings;
nothing is allocated):

- train:   the fused RC-GRPO step (`rl.train_step.make_rl_step`) on a [P, G, T] rollout batch
           of whole rows, its head at the sampled positions only under `model.gather_head`
           (the projected workload's decode tokens, `--loss_tokens` to set them);
- decode:  the sampler's decode program (`sampling.core.decode`) over the rollout rows held at
           once (every row of an iteration, num_prompts·G = P·minibatches·G, or `rl.max_rows` of
           them; `sampling.batch_capacity`) at the cache length the rollout allocates
           (`sampling.cache_capacity(T)`);
- prefill: the sampler's prefill program for one chunk (`--prefill_chunk`) into that cache.

Per program it reports XLA's per-device memory (arguments, outputs, temporaries, peak), whether
that fits the chip's HBM, analytic FLOPs (`cost_analysis` counts a scanned layer body once, so it
is not used) and a roofline projection of the step time and MFU. Caveats, also printed:
memory comes from the XLA *CPU* compiler's buffer assignment, which fuses and schedules
differently from the TPU compiler (usually more conservatively); collectives over ICI are not
modelled in the time projection.
"""

# The planning itself is the `rcgrpo_jax.planning` package, which `mesh.shape=auto` also runs at
# a run's start-up; this module is its command line and report (the table, the assumptions
# under it, the projected RL iteration). The docstring above is the command's --help.

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rcgrpo_jax.planning import (
    PROGRAMS,
    Assumptions,
    Shape,
    choose,
    is_auto,
    parse_topology,
    plan,
    shape_from_config,
)

# --------------------------------------------------------------------------- an RL iteration


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one RL iteration does, as `iteration` counts it (`workload_from_config`)."""

    rows: int  # trajectories rolled out: rl.num_prompts x G
    rounds: int  # prefill + decode rounds per trajectory: its assistant steps
    prompt_tokens: int  # the first prefill of each trajectory
    new_tokens: int  # decode steps per round: rl.max_new_tokens (a round ends with its last row)
    updates: int  # fused train steps: rl.epochs x rl.minibatches
    iterations: int  # rl.steps

    def decode_tokens(self, seq: int) -> int:
        """Tokens a trajectory samples (the loss's positions): every round's full budget, at
        most what T leaves after the prompt."""
        prompt = min(self.prompt_tokens, seq - 1)
        return min(self.rounds * self.new_tokens, seq - prompt)


def assistant_steps(entry) -> int:
    """Assistant steps of an entry's golden trajectory: per turn, one per ground-truth step
    (BFCL: a turn's calls in one step; none for a turn without calls) and the closing reply."""
    if entry.ground_truth_steps:
        return sum(len(steps) + 1 for steps in entry.ground_truth_steps)
    return sum((1 if calls else 0) + 1 for calls in entry.ground_truth)


def workload_from_config(config, prompt_tokens: int = 4096, quantile: float = 0.9) -> Workload:
    """The config's RL iteration over its own training tasks: rounds = the `quantile` of the
    golden trajectories' assistant steps (rows of a chunk advance together, so a chunk takes
    about as many rounds as its longest rows); BFCL prompts are 3-5k tokens."""
    import numpy as np

    from rcgrpo_jax.stages import setup

    rl = config.rl
    entries = setup.task_entries(config, rl.prompt_split)
    steps = [assistant_steps(e) for e in entries]
    return Workload(
        rows=int(rl.num_prompts) * int(rl.group_size),
        rounds=int(np.ceil(np.quantile(steps, quantile))),
        prompt_tokens=int(prompt_tokens),
        new_tokens=int(rl.max_new_tokens),
        updates=int(rl.epochs) * max(1, int(rl.minibatches)),
        iterations=int(rl.steps),
    )


def iteration(rows: Sequence[dict[str, Any]], shape: Shape, work: Workload) -> dict[str, Any]:
    """Projected seconds of one RL iteration from the rows' step times: the rollout, in
    chunks of `sampler_rows` rows run one after another, each prefilling its prompts in
    `prefill_chunk`-token calls plus one call per later round (tool results and the next user
    message), and decoding `rounds x new_tokens` token steps (at most T - prompt); then
    `updates` train steps. Upper-bound-ish: every round decodes its full token budget."""
    by = {r["program"]: r for r in rows}
    missing = sorted(set(PROGRAMS) - set(by))
    if missing:
        raise ValueError(f"an iteration needs the {', '.join(missing)} program(s) planned too")
    chunk = min(shape.prefill_chunk, shape.seq)
    prompt = min(work.prompt_tokens, shape.seq - 1)
    decode_tokens = work.decode_tokens(shape.seq)
    prefill_calls = -(-prompt // chunk) + work.rounds - 1
    chunks = -(-work.rows // by["decode"]["sampler_rows"])
    parts = {
        "prefill": chunks * prefill_calls * by["prefill"]["time_s"],
        "decode": chunks * decode_tokens * by["decode"]["time_s"],
        "update": work.updates * by["train"]["time_s"],
    }
    total = sum(parts.values())
    top = max(parts, key=parts.get)
    program = "train" if top == "update" else top
    return {
        **{f"{k}_s": v for k, v in parts.items()},
        "iteration_s": total,
        "run_h": total * work.iterations / 3600,
        "iterations": work.iterations,
        "row_chunks": chunks,
        "rounds": work.rounds,
        "decode_tokens": decode_tokens,
        "prefill_calls": prefill_calls,
        "bound": f"{top} ({by[program]['bound']}-bound), {parts[top] / total:.0%} of it",
    }


def format_iteration(it: dict[str, Any]) -> str:
    """One line: the projected RL iteration and what bounds it."""
    return (
        f"RL iteration (projected): {it['iteration_s']:.0f} s = prefill {it['prefill_s']:.0f} + "
        f"decode {it['decode_s']:.0f} + update {it['update_s']:.0f} "
        f"({it['row_chunks']} row chunk(s) x {it['rounds']} rounds, {it['decode_tokens']} decode "
        f"steps); bound by {it['bound']}; {it['iterations']} iterations ~ {it['run_h']:.1f} h"
    )


COLUMNS = (
    ("topology", "{}"),
    ("mesh", "{}"),
    ("remat", "{}"),
    ("attention", "{}"),
    ("T", "{}"),
    ("grad_accum", "{}"),
    ("program", "{}"),
    ("argument_gib", "{:.2f}"),
    ("output_gib", "{:.2f}"),
    ("temp_gib", "{:.2f}"),
    ("resident_gib", "{:.2f}"),
    ("total_gib", "{:.2f}"),
    ("hbm_gib", "{:.0f}"),
    ("fits", "{}"),
    ("model_tflop", "{:.1f}"),
    ("hw_tflop", "{:.1f}"),
    ("time_s", "{:.3g}"),
    ("bound", "{}"),
    ("mfu", "{:.0%}"),
    ("compile_s", "{:.0f}"),
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table (pastes into the README as is)."""
    head = "| " + " | ".join(k.removesuffix("_gib") + (" GiB" if k.endswith("_gib") else "")
                             for k, _ in COLUMNS) + " |"  # fmt: skip
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format("yes" if r[k] is True else "NO" if r[k] is False else r[k])
                 for k, fmt in COLUMNS]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(rows: Sequence[dict[str, Any]], assume: Assumptions) -> str:
    """The assumptions behind the numbers, printed under the table."""
    if not rows:
        return ""
    r = rows[0]
    return "\n".join(
        [
            f"model {r['model']} ({r['params_b']:.2f}B params), {r['topology']} = {r['chips']} "
            f"{r['chip']} chips on {r['hosts']} hosts; batch P={r['P']} x G={r['G']} x "
            f"T={r['T']}, grad_accum={r['grad_accum']}"
            + (
                f", the head at {r['loss_tokens']} loss positions per row"
                if r.get("loss_tokens")
                else ", the head at every position"
            )
            + f"; train state {r['state_gib']:.2f} GiB/chip"
            + (
                f" (LoRA rank {r['lora_rank']}: adapters, token rows and their AdamW state; the "
                f"frozen base {r['frozen_gib']:.2f} GiB/chip more)"
                if r.get("lora_rank")
                else ""
            ),
            f"attention: {r['attention']}"
            + (
                f", compiled here as {r['attention_compiled']} (splash and cuDNN's kernels do not "
                "compile for the CPU; same O(T x block) memory)"
                if r["attention_compiled"] != r["attention"]
                else ""
            )
            + f"; the sampler's prefill/decode attend with {r['sampler_attention']} over "
            f"{r['sampler_rows']} rows x {r['cache']} cache slots",
            "memory: per device, from XLA:CPU buffer assignment (peak = args + outputs - donated "
            "+ temp); rollout programs add 'resident' = the training state that stays on device"
            + (
                "; their temp is that of the same program compiled in f32 (XLA:CPU has no bf16 "
                "dot and would count f32 copies of the bf16 weights, which a TPU does not make)"
                if any(r.get("temp_estimated") for r in rows)
                else ""
            ),
            f"fits: total <= {assume.headroom:.0%} of HBM. time: max(hw FLOPs / (chips x peak x "
            f"{assume.efficiency:.0%}), HBM bytes / bandwidth); ICI collectives not modelled",
            "train FLOPs: 6*N*tokens + 12*L*H*D*T*tokens (+ remat recompute in hw; under LoRA "
            "4*N + 6*N_lora for the weights: no base weight gradient); decode: per token step of "
            "the rows held at once; prefill: one chunk of those rows",
        ]
    )


# --------------------------------------------------------------------------- CLI

_DEVICES_ENV = "RCGRPO_PLAN_DEVICES"
DEFAULT_TOPOLOGY = "v5p-16"  # --topology's default


def _topology_from_argv(argv: Sequence[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--topology="):
            return a.split("=", 1)[1]
        if a == "--topology" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def ensure_virtual_devices(argv: Sequence[str]) -> None:
    """Re-executes this module with N virtual CPU devices unless it already has them (XLA reads
    the flag once, when the backend starts, so it must be in the environment beforehand)."""
    name = _topology_from_argv(argv) or DEFAULT_TOPOLOGY
    try:
        n = parse_topology(name).chips
    except ValueError:
        return  # absl reports it
    if os.environ.get(_DEVICES_ENV) == str(n):
        return
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_DEVICES_ENV: str(n)})
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.execve(sys.executable, [sys.executable, "-m", "rcgrpo_jax.tools.plan", *argv[1:]], env)


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", "configs/qwen7b.py", "Experiment config.")
    flags.DEFINE_string(
        "topology",
        DEFAULT_TOPOLOGY,
        "TPU slice, e.g. v5p-16 (cores), v6e-16 (chips); h100-1 (GPUs).",
    )
    flags.DEFINE_integer(
        "prompts", None, "P: prompts per train step (default: rl.num_prompts / rl.minibatches)."
    )
    flags.DEFINE_integer(
        "minibatches", None, "Train steps per rollout batch: sampler rows = P x this x G."
    )
    flags.DEFINE_integer("group", None, "G: rollouts per prompt (default: rl.group_size).")
    flags.DEFINE_integer("seq", None, "T: tokens per trajectory (rl.max_len).")
    flags.DEFINE_integer("grad_accum", None, "Train-step microbatches (rl.optim.grad_accum).")
    flags.DEFINE_integer("prefill_chunk", None, "Prefill chunk length (Buckets.chunk_max).")
    flags.DEFINE_list("programs", ["train", "decode", "prefill"], f"Subset of {PROGRAMS}.")
    flags.DEFINE_float("efficiency", 0.6, "Assumed fraction of peak FLOP/s reached.")
    flags.DEFINE_float("kl_beta", None, "KL weight, >0 adds ref_logprobs (rl.kl_beta).")
    flags.DEFINE_integer("extra_vocab", 0, "Rows added to the vocabulary (reward tokens).")
    flags.DEFINE_integer("layers", 0, "Cut the model to this many layers (0 = all).")
    flags.DEFINE_integer("prompt_tokens", 4096, "Prompt tokens per trajectory (projection).")
    flags.DEFINE_integer(
        "loss_tokens", None, "Loss positions per row, where the head runs (0: every position; "
        "default under model.gather_head: the tokens a trajectory samples, as projected)."
    )  # fmt: skip
    flags.DEFINE_string("json", "", "Also write the rows as JSON to this file.")
    return config


def main(argv: Sequence[str]) -> int:
    from rcgrpo_jax.errors import UserError

    try:
        return _plan(argv)
    except UserError as e:  # e.g. mesh.shape=auto finds no mesh: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


def _plan(argv: Sequence[str]) -> int:
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    shape = shape_from_config(
        config,
        prompts=f.prompts,
        minibatches=f.minibatches,
        group=f.group,
        seq=f.seq,
        grad_accum=f.grad_accum,
        prefill_chunk=f.prefill_chunk,
    )
    work = workload_from_config(config, f.prompt_tokens)
    if f.loss_tokens is not None:
        shape = dataclasses.replace(shape, loss_tokens=f.loss_tokens)
    elif config.model.gather_head:  # the head runs where the loss reads: the sampled tokens
        shape = dataclasses.replace(shape, loss_tokens=work.decode_tokens(shape.seq))
    assume = Assumptions(efficiency=f.efficiency)
    kw = dict(assume=assume, kl_beta=f.kl_beta, extra_vocab=f.extra_vocab, layers=f.layers)
    out: dict[str, Any] = {}
    if is_auto(config.mesh.shape):  # as a run's start-up chooses: the head at every position
        shape = dataclasses.replace(shape, loss_tokens=0)
        choice = choose(config, f.topology, shape, **kw)
        print(choice.line(f.topology))
        rows = choice.rows
        shape = dataclasses.replace(shape, grad_accum=choice.grad_accum, max_rows=choice.max_rows)
        out["choice"] = {k: getattr(choice, k) for k in ("mesh", "grad_accum", "max_rows", "tried")}
    else:
        rows = plan(config, f.topology, shape, programs=f.programs, **kw)
    print(format_table(rows))
    print(describe(rows, assume))
    out["rows"] = rows
    if set(PROGRAMS) <= {r["program"] for r in rows}:
        out["iteration"] = iteration(rows, shape, work)
        print(format_iteration(out["iteration"]))
    if f.json:
        Path(f.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    ensure_virtual_devices(sys.argv)
    from absl import app

    _CONFIG = _define_flags()
    app.run(main)
