"""The real BFCL path end to end on the CPU, at the 7B/8B configs' full lengths (issue 17).

Tiny random Qwen2- and LLaMA-architecture checkpoints are saved with the real tokenizers
(vocabulary 151,665 / 128,256, `../shared/tokenizers`; skipped without them), then run through
`python -m rcgrpo_jax.main --config=configs/qwen7b.py` (stage `all`: base, SFT, RCTP and the three
RL arms, one RL iteration each) and `--config=configs/llama8b.py` (stage `rcgrpo` from the random
checkpoint, then stage `eval` of its export, both on 2 CPU devices for its tensor-parallel mesh;
Qwen runs on one). A tiny random Qwen3 with the real Qwen3 tokenizer and its thinking template
(vocabulary 151,669) takes the LLaMA path's first half through `configs/qwen3_8b.py` (stage
`rcgrpo`, 2 devices, no held-out evaluation). The overrides (`SIZE_AND_STEPS`) change sizes, step
counts and entry counts only: every length (`rl.max_len`, `eval.max_len`, `train.seq_len`,
`rctp.max_tokens`) stays at the config's default, so the SFT rows and the fused RL step run at
16,384 tokens. Each run is a child process; its peak RSS (`os.wait4`) is printed and bounded.

Cost: the fused step's head over a 152k vocabulary at 2 x 16,384 positions dominates (~15-30 s a
step on 2 cores), so LLaMA takes the shorter path; Qwen through `all` is ~3 min (its two RC-GRPO
updates, the step's compile included, ~17 s of it), LLaMA ~1 min, Qwen3 ~50 s of CPU time.

The official checker `eval`s call strings: it is handed only stored stage-1 trajectories (ground
truth and its perturbations) and model trajectories without calls; model text with calls is
scored against our reward (equal to the checker by tests/test_bfcl_reward.py).

A random model's rollouts all fail, so no RL group would carry signal and no update would run:
the Qwen runs' environment is tests/forced_rewards.py's "bfcl" (`env.module`), whose reward is the
checker's verdict raised to 1 for a row conditioned on <|high_reward|>. Its RC-GRPO groups (one
high and one low row) are then mixed and update; GRPO's keep the checker's uniform verdict.
Stage 1's data is scored by the checker itself (not the environment), and the LLaMA runs use
the plain environment.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, mask_runs, shipped_config, xla_flags

from rcgrpo_jax.envs import bfcl, prompts
from rcgrpo_jax.envs.calls import extract_calls
from rcgrpo_jax.rl import arms as arm_table

CATEGORY = "multi_turn_base"
# Sizes, step counts and entry counts only; no length is overridden.
SIZE_AND_STEPS = (
    "--config.model.dtype=float32",  # bf16 compute is slower on this CPU
    f"--config.env.bfcl.categories=('{CATEGORY}',)",  # 180 training entries (of 720)
    f"--config.eval.bfcl.categories=('{CATEGORY}',)",
    "--config.eval.max_entries=1",
    "--config.rctp.eval_entries=1",
    "--config.train.steps=1",
    "--config.train.batch_size=1",
    "--config.rl.steps=1",
    "--config.rl.num_prompts=1",
    "--config.rl.group_size=2",
    "--config.rl.optim.grad_accum=1",  # must divide rl.num_prompts (whole groups)
    "--config.rl.max_new_tokens=16",
    "--config.eval.max_new_tokens=16",
    "--config.env.max_steps_per_turn=1",
    # The RL recipe's counts, back to one pass: a random policy's groups are all-fail, so with
    # dynamic sampling on every arm no fused step would run at 16k (the dynamic arm still runs
    # it); RCTP's 2 policy rollouts per entry would be 360 trajectories at 16k.
    "--config.arms=('paper','sft_grpo_dynamic')",
    "--config.rl.epochs=1",
    "--config.rctp.rollouts_per_entry=0",
)
LENGTH_KEYS = ("rl.max_len", "eval.max_len", "train.seq_len", "rctp.max_tokens")
FULL_LENGTH = 16384
PEAK_RSS_LIMIT = 12 * 2**30  # the runs must fit a 24 GB machine with room to spare
TIMEOUT_S = 900
ARMS = arm_table.chosen(("paper", "sft_grpo_dynamic"))
# the tokens each arm's rollouts carry (sorted, G = 2): none, both (stratified), or all high
ARM_TOKENS = {
    "sft_grpo": [-1, -1], "sft_rcgrpo": [0, 1], "rctp_rcgrpo": [0, 1], "rctp_grpo": [1, 1],
    "sft_grpo_dynamic": [-1, -1],
}  # fmt: skip
# The Qwen run's environment: its rewards give RC-GRPO's groups signal (module docstring).
FORCED_REWARDS = "--config.env.module=tests.forced_rewards"
# What each arm's one group of 2 makes under those rewards: RC-GRPO's (low, high) = (0, 1) is
# trained and updates; GRPO's share a token and a reward (all-fail without one, all-pass under
# the high one): trained without signal (the step is not called) or, dynamic, dropped.
ARM_OUTCOME = {
    "sft_grpo": "no signal", "sft_rcgrpo": "applied", "rctp_rcgrpo": "applied",
    "rctp_grpo": "no signal", "sft_grpo_dynamic": "dropped",
}  # fmt: skip
EOT = {"qwen": "<|im_end|>", "llama": "<|eot_id|>"}
# Embedding rows of the released checkpoints: Qwen2.5-7B pads its 151,665 tokens to 152,064 (the
# reward tokens take padded rows), LLaMA-3.1-8B has exactly its 128,256 (they grow the table).
VOCAB_ROWS = {"qwen2": 152064, "llama": 128256, "qwen3": 151936}
TOKENIZER_VOCAB = {"qwen2": 151665, "llama": 128256, "qwen3": 151669}
HEADER = {  # what precedes an assistant message
    "qwen": "<|im_start|>assistant\n",
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def make_checkpoint(kind: str, tokenizer_dir: Path, out: Path) -> None:
    """A random 2-layer, 32-wide model of the released architecture and embedding rows, saved
    with the real tokenizer (as a released checkpoint directory holds both)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB_ROWS[kind], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=False,
    )  # fmt: skip
    if kind == "qwen2":  # Qwen2.5-7B-Instruct: q/k/v biases, untied head
        cfg = Qwen2Config(rope_theta=1e6, bos_token_id=151643, eos_token_id=151645, **common)
    elif kind == "qwen3":  # Qwen3-8B: q/k RMSNorm, no biases, head_dim != hidden / heads
        cfg = Qwen3Config(
            rope_theta=1e6, bos_token_id=151643, eos_token_id=151645, head_dim=16, **common
        )
    else:  # Llama-3.1-8B-Instruct: llama3 rope scaling
        cfg = LlamaConfig(
            rope_theta=5e5, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            **common,
        )  # fmt: skip
    assert len(tok) == TOKENIZER_VOCAB[kind]
    model = AutoModelForCausalLM.from_config(cfg)
    if kind == "qwen3":
        lean_towards(model, {tok.convert_tokens_to_ids(t): p for t, p in THINKING.items()})
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


# What the random Qwen3 samples besides uniformly drawn tokens: it closes a think block about
# every fourth token and ends its message about every twentieth, so that its messages hold
# `</think>` (which the template re-renders) and stop on their own or at the length cap.
THINKING = {"</think>": 0.25, "<|im_end|>": 0.05}


def lean_towards(model, probs: dict[int, float]) -> None:
    """Makes a random model sample token i with about probability probs[i] at every position,
    the rest of its draws nearly uniform: every embedding row gets a unit component along one
    direction, which then dominates each final hidden state (~ sqrt(hidden) along it after the
    final RMSNorm; the random weights add little), and the head maps that direction to the
    logit that gives token i its probability against the others' ~0 logits."""
    import math

    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] += 1.0
        head = model.get_output_embeddings().weight
        rest = (1.0 - sum(probs.values())) / (head.shape[0] - len(probs))
        scale = math.sqrt(head.shape[1])
        for i, p in probs.items():
            head[i] = 0.0
            head[i, 0] = math.log(p / rest) / scale


def run_main(args: list[str], log: Path, devices: int = 1) -> dict:
    """`python -m rcgrpo_jax.main ARGS` in a child with `devices` CPU devices; exit code, wall
    seconds, peak RSS of the child (bytes, from wait4) and its output."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(devices, fast=False)  # the full-length runs compile as a user's
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rcgrpo_jax.main", *args],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        timer = threading.Timer(TIMEOUT_S, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait
    text = log.read_text()
    return {
        "rc": proc.returncode,
        "seconds": time.perf_counter() - t0,
        "peak_rss": usage.ru_maxrss * 1024,  # Linux: KiB
        "output": text,
    }


def _check_run(r: dict, what: str) -> None:
    tail = "\n".join(r["output"].replace("\r", "\n").splitlines()[-25:])
    assert r["rc"] == 0, f"{what} exited {r['rc']}:\n{tail}"


@pytest.fixture(scope="module")
def qwen_model(tokenizer_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("e2e_qwen") / "model"
    make_checkpoint("qwen2", tokenizer_root / "qwen2.5", out)
    return out


@pytest.fixture(scope="module")
def qwen_run(qwen_model):
    root = qwen_model.parent
    work = root / "run"
    args = ["--config=configs/qwen7b.py", f"--config.model.hf_path={qwen_model}",
            f"--config.workdir={work}", *SIZE_AND_STEPS, FORCED_REWARDS]  # fmt: skip
    r = run_main(args, root / "main.log")  # one device: the FSDP axis has size 1
    _check_run(r, "qwen7b stage all")
    return {**r, "work": work, "model": qwen_model, "fmt": "qwen"}


@pytest.fixture(scope="module")
def llama_run(tokenizer_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_llama")
    make_checkpoint("llama", tokenizer_root / "llama3.1", root / "model")
    work = root / "run"
    common = ["--config=configs/llama8b.py", *SIZE_AND_STEPS]
    # two devices for the config's mesh (1, -1, 2): weights and heads split over the tensor axis
    rl = run_main(
        [*common, "--config.stage=rcgrpo", f"--config.model.hf_path={root / 'model'}",
         f"--config.workdir={work}"],
        root / "rcgrpo.log", devices=2,
    )  # fmt: skip
    _check_run(rl, "llama8b stage rcgrpo")
    ev = run_main(
        [*common, "--config.stage=eval", f"--config.model.hf_path={work / 'export'}",
         f"--config.workdir={root / 'eval'}", "--config.eval.reward_token=1"],
        root / "eval.log", devices=2,
    )  # fmt: skip
    _check_run(ev, "llama8b stage eval")
    return {
        "rl": rl, "eval": ev, "work": work, "eval_dir": root / "eval" / "eval" / "test-model",
        "model": root / "model", "fmt": "llama",
    }  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_run(tokenizer_root, tmp_path_factory):
    """Stage rcgrpo of configs/qwen3_8b.py from a random Qwen3 with the real Qwen3 tokenizer and
    its thinking template, on 2 devices for the config's mesh (1, -1, 2), forced rewards, no
    held-out evaluation (`rl.eval_every=0`: the LLaMA runs cover it; it would add a third of
    this run's time)."""
    root = tmp_path_factory.mktemp("e2e_qwen3")
    make_checkpoint("qwen3", tokenizer_root / "qwen3", root / "model")
    work = root / "run"
    r = run_main(
        ["--config=configs/qwen3_8b.py", *SIZE_AND_STEPS, "--config.stage=rcgrpo",
         "--config.rl.eval_every=0", f"--config.model.hf_path={root / 'model'}",
         f"--config.workdir={work}", FORCED_REWARDS],
        root / "rcgrpo.log", devices=2,
    )  # fmt: skip
    _check_run(r, "qwen3_8b stage rcgrpo")
    return {**r, "work": work, "model": root / "model", "fmt": "qwen"}


def _report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[e2e] {line}", flush=True)


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def test_configs_keep_full_lengths():
    """What the e2e runs rely on: the 7B/8B configs' lengths, none of them overridden."""
    for name in ("qwen7b", "llama8b", "qwen3_8b"):
        c = shipped_config(name)
        for key in LENGTH_KEYS:
            section, leaf = key.split(".")
            assert c[section][leaf] == FULL_LENGTH, (name, key)
    assert not any(k in arg for arg in SIZE_AND_STEPS for k in LENGTH_KEYS)


# ------------------------------------------------------------------------------ Qwen: stage all


def test_qwen7b_all_runs_at_full_length(qwen_run, capsys):
    _report(
        capsys,
        f"qwen7b stage all (tiny random Qwen2, real tokenizer, lengths {FULL_LENGTH}): "
        f"{qwen_run['seconds']:.0f} s, peak RSS {_gib(qwen_run['peak_rss'])}",
    )
    assert qwen_run["peak_rss"] < PEAK_RSS_LIMIT
    work = qwen_run["work"]
    summary = json.loads((work / "summary.json").read_text())
    assert set(summary["arms"]) == {"base", "sft", "rctp", *ARMS}
    assert summary["rl_budget"] == 2 and summary["rollouts_per_iteration"] == 2
    assert "Traceback" not in qwen_run["output"]
    for arm in ARMS:
        assert (work / arm / "export" / "config.json").is_file()


def _entries() -> dict[str, bfcl.Entry]:
    return {e.id: e for e in bfcl.load_entries(CATEGORY)}


def _records(stage_dir: Path) -> list[dict]:
    from rcgrpo_jax.data import store

    report = json.loads((stage_dir / "data_report.json").read_text())
    src = store.load_split(report["dataset_dir"], "train")
    return [src[i] for i in range(len(src))]


_counter = itertools.count()


def official_valid(entry: bfcl.Entry, decoded) -> bool:
    """bfcl-eval's own multi_turn_checker verdict (fresh instance-cache key per call)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    if len(decoded) != len(entry.ground_truth):
        return False  # eval_runner's force-terminated check
    name = f"rcgrpo_e2e_{next(_counter)}"
    out = multi_turn_checker.multi_turn_checker(
        copy.deepcopy(decoded), entry.ground_truth, entry.bfcl_dict(), entry.category, name
    )
    for key in [k for k in vars(multi_turn_utils) if k.startswith(name + "_")]:
        del vars(multi_turn_utils)[key]
    return bool(out["valid"])


def test_stage1_labels_are_the_checkers_verdicts(qwen_run):
    """Every stored SFT/RCTP trajectory's label is bfcl-eval's checker on its decoded calls."""
    entries = _entries()
    for stage in ("sft", "rctp"):
        recs = _records(qwen_run["work"] / stage)
        labels = [r["label"] for r in recs]
        assert set(labels) == ({1} if stage == "sft" else {0, 1})
        for rec in recs:
            meta = json.loads(rec["meta"])
            assert official_valid(entries[rec["entry_id"]], meta["decoded"]) == bool(rec["label"])
            assert meta["reward"] == float(rec["label"])


def test_stage1_masks_cover_assistant_tokens_only(qwen_run):
    """Loss mask = the assistant messages exactly: each masked run follows an assistant header
    and ends with the end-of-turn token, every assistant header starts one, and the masked
    text holds exactly the stored decoded calls."""
    from transformers import AutoTokenizer

    fmt = qwen_run["fmt"]
    for stage in ("sft", "rctp"):
        tok = AutoTokenizer.from_pretrained(str(qwen_run["work"] / stage / "export"))
        header = tok.encode(HEADER[fmt], add_special_tokens=False)
        eot = tok.convert_tokens_to_ids(EOT[fmt])
        recs = _records(qwen_run["work"] / stage)
        for rec in recs[:: max(1, len(recs) // 60)]:  # ~60 records of each stage
            ids, mask = np.asarray(rec["tokens"]), np.asarray(rec["loss_mask"])
            runs = mask_runs(mask)
            starts = [i for i in np.flatnonzero(ids == header[0]) if
                      ids[i : i + len(header)].tolist() == header]  # fmt: skip
            assert [s + len(header) for s in starts] == [a for a, _ in runs]
            assert all(ids[b - 1] == eot for _, b in runs)
            texts = [tok.decode(ids[a : b - 1].tolist()) for a, b in runs]
            steps = [c for c in (extract_calls(t, fmt) for t in texts) if c]
            decoded = json.loads(rec["meta"])["decoded"]
            assert steps == [step for turn in decoded for step in turn]


def test_reward_tokens_are_in_the_vocabulary(qwen_run):
    """RCTP records start their system prompt with their label's reward token (one token,
    unmasked, an embedding row of the exported model); SFT records hold none."""
    from transformers import AutoTokenizer

    work = qwen_run["work"]
    tok = AutoTokenizer.from_pretrained(str(work / "rctp" / "export"))
    ids = {r: tok.convert_tokens_to_ids(t) for r, t in prompts.REWARD_TOKENS.items()}
    assert json.loads((work / "rctp" / "data_report.json").read_text())["reward_tokens"] == {
        str(k): v for k, v in ids.items()
    }
    base_vocab = len(AutoTokenizer.from_pretrained(str(qwen_run["model"])))
    assert sorted(ids.values()) == [base_vocab, base_vocab + 1]  # after the real vocabulary
    for name, token in prompts.REWARD_TOKENS.items():
        assert tok.encode(token, add_special_tokens=False) == [ids[name]]
    for arm in ("rctp", *ARMS):
        vocab = json.loads((work / arm / "export" / "config.json").read_text())["vocab_size"]
        assert vocab == VOCAB_ROWS["qwen2"]  # the tokens took padded rows: no table growth
        added = json.loads((work / arm / "export" / "tokenizer.json").read_text())["added_tokens"]
        added = {t["content"]: t["id"] for t in added}
        assert {r: added[t] for r, t in prompts.REWARD_TOKENS.items()} == ids  # the same ids
    for rec in _records(work / "rctp"):
        tokens = list(rec["tokens"])
        assert rec["reward_token"] == ids[rec["label"]]
        at = tokens.index(rec["reward_token"])
        assert sum(t in ids.values() for t in tokens) == 1 and rec["loss_mask"][at] == 0
        assert tok.decode(tokens[:at]) == "<|im_start|>system\n"
    for rec in _records(work / "sft"):
        assert rec["reward_token"] == -1 and not set(ids.values()) & set(rec["tokens"])


def test_rl_arms_log_their_rollouts(qwen_run):
    """One iteration per arm: G=2 rollouts of one training prompt, conditioned on both reward
    tokens for RC-GRPO, on none for GRPO from SFT and on the high one from RCTP, scored (no
    environment failure), the metrics agreeing with the log. Each arm's group does what
    `ARM_OUTCOME` says: RC-GRPO's is mixed and its update applied; GRPO's is trained without
    signal, so no step runs, or, with dynamic sampling (a budget of 2 trajectories: no second
    round), dropped."""
    from rcgrpo_jax.envs.split import split_ids

    train = set(split_ids("train", CATEGORY))
    assert set(ARM_OUTCOME.values()) == {"applied", "no signal", "dropped"}
    for arm in ARMS:
        (row,) = [json.loads(x) for x in (qwen_run["work"] / arm / "rollouts.jsonl").open()]
        log = qwen_run["work"] / arm / "metrics.jsonl"
        start, metrics = [json.loads(x) for x in log.open()]
        assert start["step"] == 0 and "eval_success" in start  # the arm's start, evaluated
        assert row["iteration"] == 1 and set(row["entry_ids"]) <= train
        tokens = sorted(row["reward_token"][0])
        assert tokens == ARM_TOKENS[arm], arm
        rewards = np.asarray(row["rewards"])
        assert rewards.shape == (1, 2) and set(rewards.ravel()) <= {0.0, 1.0}
        assert row["env_errors"] == [[None, None]] and metrics["env_errors"] == 0
        assert metrics["reward_mean"] == pytest.approx(rewards.mean())
        assert metrics["sampled_tokens"] > 0 and metrics["generated_rollouts"] == 2
        outcome = ARM_OUTCOME[arm]
        signal = bool(rewards[0, 0] != rewards[0, 1])
        assert signal == (outcome == "applied"), (arm, rewards)
        assert row["trained"] == [outcome != "dropped"], arm
        assert metrics["applied_frac"] == float(signal), arm
        updated = metrics["loss"] is not None and np.isfinite(metrics["loss"])
        assert updated == signal, arm
        if signal:
            assert metrics["grad_norm"] > 0, arm


def _weights_off_the_vocabulary(export: Path) -> dict[str, np.ndarray]:
    """An export's weights but the vocabulary-sized ones (embedding, head: an RL stage may
    initialise the reward tokens' rows without any update), by name."""
    import jax

    from rcgrpo_jax import models

    cfg, params = models.load_hf(str(export))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in leaves
        if cfg.vocab_size not in np.shape(v)
    }


def test_an_applied_update_changes_the_weights(qwen_run):
    """An arm whose update was applied exports weights other than its start's (the stage-1
    export it began from), every one of them moved; an arm without one exports its start's
    weights bit for bit."""
    work = qwen_run["work"]
    for arm in ARMS:
        start = _weights_off_the_vocabulary(work / arm_table.find(arm).init / "export")
        end = _weights_off_the_vocabulary(work / arm / "export")
        assert start.keys() == end.keys() and start
        same = {k for k in start if np.array_equal(start[k], end[k])}
        if ARM_OUTCOME[arm] == "applied":
            assert not same, (arm, sorted(same))
        else:
            assert same == start.keys(), (arm, sorted(start.keys() - same))


@pytest.mark.parametrize("which", ["qwen", "llama", "qwen3"])
def test_exports_load_in_transformers(which, request):
    """The final RL export loads in transformers and gives our logits, reward token included."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo_jax import models

    run = request.getfixturevalue(f"{which}_run")
    export = run["work"] / ("rctp_rcgrpo" if which == "qwen" else "") / "export"
    architecture = {"qwen": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[which] + "ForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = tok.encode(prompts.REWARD_TOKENS[1] + " list the files", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(prompts.REWARD_TOKENS[1])
    model = AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    cfg, params = models.load_hf(str(export), dtype=jnp.float32)
    ours = np.asarray(models.forward(cfg, params, jnp.asarray([ids], jnp.int32)))
    assert ref.shape == ours.shape == (1, len(ids), cfg.vocab_size)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------- LLaMA: stage rcgrpo, then eval


def test_llama8b_rcgrpo_runs_at_full_length(llama_run, capsys):
    rl, ev = llama_run["rl"], llama_run["eval"]
    _report(
        capsys,
        f"llama8b stage rcgrpo (tiny random LLaMA, real tokenizer, rl.max_len {FULL_LENGTH}): "
        f"{rl['seconds']:.0f} s, peak RSS {_gib(rl['peak_rss'])}; its export through stage eval: "
        f"{ev['seconds']:.0f} s, peak RSS {_gib(ev['peak_rss'])}",
    )
    assert max(rl["peak_rss"], ev["peak_rss"]) < PEAK_RSS_LIMIT
    (row,) = [json.loads(x) for x in (llama_run["work"] / "rollouts.jsonl").open()]
    assert sorted(row["reward_token"][0]) == [0, 1] and row["env_errors"] == [[None, None]]
    start, metrics = [json.loads(x) for x in (llama_run["work"] / "metrics.jsonl").open()]
    assert start["step"] == 0 and "eval_success" in start  # the arm's start, evaluated
    assert metrics["eval_success"] is not None and metrics["sampled_tokens"] > 0
    # the reward tokens grew the embedding table past LLaMA's 128,256 rows (to a multiple of 128)
    from transformers import AutoTokenizer

    export = llama_run["work"] / "export"
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = {t: tok.convert_tokens_to_ids(t) for t in prompts.REWARD_TOKENS.values()}
    assert sorted(ids.values()) == [TOKENIZER_VOCAB["llama"], TOKENIZER_VOCAB["llama"] + 1]
    assert all(tok.encode(t, add_special_tokens=False) == [i] for t, i in ids.items())
    assert json.loads((export / "config.json").read_text())["vocab_size"] == 128384


def test_llama8b_eval_rewards_are_the_checkers(llama_run):
    """The model's held-out trajectory is scored as BFCL scores it: bfcl-eval's checker where
    the model made no call (nothing of its text reaches `eval`), else our equal reward."""
    entries = _entries()
    recs = [json.loads(x) for x in (llama_run["eval_dir"] / "entries.jsonl").open()]
    assert len(recs) == 1
    for rec in recs:
        entry = entries[rec["id"]]
        ours = bfcl.trajectory_reward(entry, rec["decoded"])
        assert (rec["reward"], rec["error_type"]) == (ours.reward, ours.error_type)
        if not any(call for turn in rec["decoded"] for step in turn for call in step):
            assert official_valid(entry, rec["decoded"]) == (rec["reward"] == 1.0)


# ---------------------------------------------------------------- Qwen3: stage rcgrpo, thinking


def test_qwen3_rcgrpo_runs_at_full_length(qwen3_run, capsys):
    """One RC-GRPO iteration of a random Qwen3 under the real thinking template at rl.max_len
    16,384: a mixed group (low, high) is rolled out over several turns, each row's cache
    extended by `continuation_ids` after messages that close think blocks (`THINKING`; no row
    fails in its environment, where a template re-render of such a message would), and the
    update is applied on the trajectories as sampled: the trainer's log-probs of every sampled
    token equal the sampler's (`logp_gap_max`), so the sequence trained on is, token for token,
    the one the policy conditioned on."""
    _report(
        capsys,
        f"qwen3_8b stage rcgrpo (tiny random Qwen3, real tokenizer and thinking template, "
        f"rl.max_len {FULL_LENGTH}): {qwen3_run['seconds']:.0f} s, "
        f"peak RSS {_gib(qwen3_run['peak_rss'])}",
    )
    assert qwen3_run["peak_rss"] < PEAK_RSS_LIMIT
    work = qwen3_run["work"]
    (row,) = [json.loads(x) for x in (work / "rollouts.jsonl").open()]
    assert sorted(row["reward_token"][0]) == [0, 1] and row["env_errors"] == [[None, None]]
    rewards = dict(zip(row["reward_token"][0], row["rewards"][0], strict=True))
    assert rewards == {0: 0.0, 1: 1.0} and row["trained"] == [True]  # forced: signal
    (metrics,) = [json.loads(x) for x in (work / "metrics.jsonl").open()]
    assert metrics["step"] == 1 and metrics["applied_frac"] == 1.0 and np.isfinite(metrics["loss"])
    assert metrics["grad_norm"] > 0 and metrics["sampled_tokens"] > 0
    assert metrics["logp_gap_max"] < 1e-4, metrics["logp_gap_max"]
    start_weights = _weights_off_the_vocabulary(qwen3_run["model"])
    end_weights = _weights_off_the_vocabulary(work / "export")
    assert start_weights.keys() == end_weights.keys() and any("q_norm" in k for k in start_weights)
    assert not [k for k in start_weights if np.array_equal(start_weights[k], end_weights[k])]
    from transformers import AutoTokenizer

    export = AutoTokenizer.from_pretrained(str(work / "export"))
    original = AutoTokenizer.from_pretrained(str(qwen3_run["model"]))
    assert export.chat_template == original.chat_template  # the thinking template travels
    # more prefilled than the two rows' prompts (they differ by their reward token): rows went
    # on after their first message, their caches extended by what the template puts after it
    (entry_id,) = row["entry_ids"]
    episode = bfcl.Episode(_entries()[entry_id], "qwen", reward_token=1)
    prompt = prompts.prompt_ids(export, episode.messages, episode.tools)
    assert export.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    assert metrics["prefill_tokens"] > 2 * len(prompt), (metrics["prefill_tokens"], len(prompt))
    assert json.loads((work / "export" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]


# ------------------------------------------------------------------- lengths the configs reject


def test_prompts_longer_than_max_len_are_left_out_once(qwen_model, capsys):
    """A prompt that leaves no room within eval.max_len / rl.max_len is dropped before any
    rollout (said once on stderr), and the rest run instead of the rollout raising."""
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from rcgrpo_jax import config as config_lib
    from rcgrpo_jax import envs, models
    from rcgrpo_jax.errors import UserError
    from rcgrpo_jax.stages import setup
    from rcgrpo_jax.stages.eval import measure_success

    tok = AutoTokenizer.from_pretrained(str(qwen_model))
    entries = bfcl.split_entries("test", CATEGORY)[:3]
    env = envs.get("bfcl")()
    lengths = [setup.prompt_length(env, tok, e, "qwen") for e in entries]
    max_len = min(lengths) + setup.PROMPT_HEADROOM
    kept = [e for e, n in zip(entries, lengths, strict=True) if n == min(lengths)]
    assert 0 < len(kept) < len(entries)
    what = "evaluation entries for eval.max_len"
    for _ in range(2):
        assert setup.fitting_entries(env, entries, tok, "qwen", max_len, what) == kept
    err = capsys.readouterr().err
    note = f"note: {len(entries) - len(kept)} of {len(entries)} {what}={max_len} left out"
    assert err.count(note) == 1, err
    with pytest.raises(UserError, match="every prompt is longer"):
        setup.fitting_entries(env, entries, tok, "qwen", min(lengths), what)

    c = config_lib.base_config()
    c.eval.max_len, c.eval.max_new_tokens, c.env.max_steps_per_turn = max_len, 1, 1
    model = models.load_hf(str(qwen_model), dtype=jnp.float32)
    assert measure_success(c, model, tok, None, entries, None).rate == 0.0  # ran the one that fits


def test_too_long_stage1_example_is_a_one_line_error(qwen_run, tmp_path):
    """Stage-1 data with trajectories longer than train.seq_len (rctp.max_tokens unset) stops
    with one line naming both keys, not a traceback from the packer."""
    work = tmp_path / "sft"
    work.mkdir()
    shutil.copy(qwen_run["work"] / "sft" / "data_report.json", work)  # reuses the stored data
    r = run_main(
        ["--config=configs/qwen7b.py", "--config.stage=sft",
         f"--config.model.hf_path={qwen_run['model']}", f"--config.workdir={work}",
         *SIZE_AND_STEPS, "--config.train.seq_len=4096", "--config.rctp.max_tokens=0"],
        tmp_path / "sft.log",
    )  # fmt: skip
    lines = [ln for ln in r["output"].splitlines() if ln.strip()]
    assert r["rc"] == 2, r["output"][-2000:]
    assert lines[-1].startswith("error: a stage-1 example has "), lines[-3:]
    assert "train.seq_len=4096" in lines[-1] and "rctp.max_tokens (now 0 = no limit)" in lines[-1]
    assert "Traceback" not in r["output"]
