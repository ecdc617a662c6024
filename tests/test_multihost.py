"""Multi-host correctness on CPU: RC-GRPO on 2 processes × 4 devices equals 1 process × 8 devices.

Both runs go through the real command line (tests/multihost_worker.py: `rcgrpo_jax.main` with a
reward that varies, so updates are not no-ops). The 2-process run joins a localhost coordinator
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) and reduces over gloo. The mesh is
(data 2, fsdp 4): params are FSDP-sharded inside a process, the train batch is split over the two
processes (gradients all-reduced across them), the sampler's rows over all 8 devices. Checked:
losses, rewards and the final exported params are equal, and each process ran the environment of
exactly its own half of the rows; with full fine-tuning and under LoRA (`model.lora.rank` 4 on
every projection: the adapters train, the base is every program's frozen argument).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, xla_flags

from rcgrpo_jax.train.metrics import read_jsonl

P, G, STEPS, TEST_ENTRIES, SAMPLES = 4, 2, 2, 4, 2  # SAMPLES: eval.samples
ARCH = dict(
    vocab_size=1024, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, qkv_bias=True, tie_embeddings=True,
    max_position_embeddings=1024, family="qwen2", dtype="float32", param_dtype="float32",
)  # fmt: skip
OVERRIDES = {
    "stage": "rcgrpo",
    "mesh.shape": "(2,4,1)",
    "env.synthetic.num_train": 16,
    "env.synthetic.num_test": TEST_ENTRIES,
    "rl.steps": STEPS,
    "rl.num_prompts": P,
    "rl.group_size": G,
    "rl.minibatches": 2,
    "rl.dynamic_sampling": False,  # one round of P x G rows per iteration (the tiling below)
    "rl.max_rollouts": 0,
    "rl.kl_beta": 0.01,
    "rl.max_new_tokens": 8,
    "rl.eval_every": STEPS,
    "rl.eval_points": 0,
    "rl.checkpoint_every": 1,
    "eval.max_new_tokens": 8,
    "eval.max_entries": TEST_ENTRIES,
    "eval.samples": SAMPLES,
}
# Adam divides by sqrt(v) + eps: with the default eps=1e-8 an element whose gradient is at float32
# rounding level takes an O(lr) step whose sign rounding decides. eps=1e-4 (typical |g| here is
# ~2e-3) keeps the update Lipschitz in g, |Δupdate| <= lr·|Δg|/eps, so rounding differences stay
# at rounding level and the tolerances below can be tight.
OVERRIDES["rl.optim.eps"] = 1e-4
OVERRIDES["rl.optim.lr"] = 1e-3  # pinned: the tolerances below scale with it, not with the demo's
TIMEOUT_S = 600  # ~1.5 min alone on 2 idle cores; generous for a loaded CI machine
# The samples, rewards and token counts must be equal exactly. Floats may not be: gradients are
# all-reduced across the two processes by gloo and within one process by XLA's own collectives,
# and the FSDP-sharded matmuls reduce partial sums the same two ways, in different orders: float32
# rounding (relative ~1e-7 per sum) is all that may differ.
RTOL = 1e-5  # loss-side means over ~10^3 tokens
LOSS_ATOL = 1e-6  # the token-mean surrogate cancels to ~1e-8 (advantages sum to 0 per group)
PARAM_ATOL = 1e-7  # params ~0.05 (ulp ~4e-9) after STEPS * 2 updates of lr 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _make_init(root: Path) -> Path:
    """The runs' initial policy as an HF directory: the tiny tokenizer (trained on the runs'
    training tasks) and a random model, made with numpy (nothing compiled in this process)."""
    import jax
    from conftest import shipped_config

    from rcgrpo_jax import models
    from rcgrpo_jax.envs import tiny_tokenizer
    from rcgrpo_jax.stages.setup import task_entries

    config = shipped_config("tiny")
    config.env.synthetic.num_train = OVERRIDES["env.synthetic.num_train"]
    tasks = task_entries(config, "train")
    tokenizer = tiny_tokenizer.load_or_train(root, tasks, vocab_size=ARCH["vocab_size"])
    cfg = models.ModelConfig.from_dict(ARCH)
    rng = np.random.default_rng(0)

    def init(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(leaf.shape, np.float32)
        return rng.normal(0.0, 0.05, leaf.shape).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(init, models.param_shapes(cfg))
    models.save_hf(root / "init", cfg, params, tokenizer=tokenizer)
    return root / "init"


def _launch(workdir: Path, init: Path, process_id: int, nproc: int, port: int, lora_rank: int):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(8 // nproc)  # the same compile flags in every process
    env["RCGRPO_TEST_ENV_LOG"] = str(workdir / f"env.p{process_id}.jsonl")
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    if nproc > 1:
        env.update(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES=str(nproc),
            JAX_PROCESS_ID=str(process_id),
        )
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, "model.lora.rank": lora_rank}.items()]
    log = open(workdir.parent / f"{workdir.name}.p{process_id}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "multihost_worker.py"), "--config=configs/tiny.py",
         f"--config.workdir={workdir}", f"--config.rl.init_from={init}", *args],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, log


@pytest.fixture(scope="module", params=[0, 4], ids=["full", "lora"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    init = _make_init(root)
    single, multi = root / "single", root / "multi"
    single.mkdir()
    multi.mkdir()
    port = _free_port()
    procs = [
        ("single", *_launch(single, init, 0, 1, port, request.param)),
        ("multi p0", *_launch(multi, init, 0, 2, port, request.param)),
        ("multi p1", *_launch(multi, init, 1, 2, port, request.param)),
    ]
    deadline = time.monotonic() + TIMEOUT_S
    failed = []
    try:
        for name, proc, _ in procs:
            try:
                rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                rc = f"timeout after {TIMEOUT_S} s"
            if rc != 0:
                failed.append((name, rc))
    finally:
        for _, proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        tails = []
        for name, proc, log in procs:
            text = Path(log.name).read_text(errors="replace")
            lines = [x for x in text.splitlines() if not x.startswith(("I1", "W1", "[Gloo]"))]
            tails.append(f"===== {name} (rc {proc.returncode}):\n" + "\n".join(lines[-40:]))
        pytest.fail(f"runs failed: {failed}\n" + "\n".join(tails), pytrace=False)
    return single, multi


def test_losses_rewards_and_params_match(runs):
    import jax

    from rcgrpo_jax import models

    single, multi = runs
    ms, mm = read_jsonl(single / "metrics.jsonl"), read_jsonl(multi / "metrics.jsonl")
    # the start's evaluation (step 0), then the iterations; process 0 alone wrote it
    assert [m["step"] for m in mm] == list(range(0, STEPS + 1))
    for key in ("eval_success", "eval_sampled"):
        assert mm[0][key] == ms[0][key], key
    ms, mm = ms[1:], mm[1:]
    for a, b in zip(ms, mm, strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl", "clip_frac", "abs_adv_mean"):
            atol = LOSS_ATOL if key in ("loss", "kl") else 0.0
            np.testing.assert_allclose(b[key], a[key], rtol=RTOL, atol=atol, err_msg=key)
        for key in ("reward_mean", "reward_high", "reward_low", "degenerate_frac",
                    "sampled_tokens", "prefill_tokens", "truncated", "eval_success"):  # fmt: skip
            assert b.get(key) == a.get(key), key
    assert any(m["abs_adv_mean"] > 0 for m in ms)  # not all groups degenerate: real updates
    rs, rm = read_jsonl(single / "rollouts.jsonl"), read_jsonl(multi / "rollouts.jsonl")
    assert [r["env_process"] for r in rs] == [np.zeros((P, G), int).tolist()] * STEPS
    for a, b in zip(rs, rm, strict=True):
        assert {**a, "env_process": None} == {**b, "env_process": None}
    cfg_s, ps = models.load_hf(single / "export")
    cfg_m, pm = models.load_hf(multi / "export")
    assert cfg_s == cfg_m
    _, p0 = models.load_hf(single.parent / "init")
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                zip(jax.tree.leaves(ps), jax.tree.leaves(p0), strict=True))  # fmt: skip
    assert moved > 0  # the updates did something
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
               zip(jax.tree.leaves(ps), jax.tree.leaves(pm), strict=True))  # fmt: skip
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(ms, mm, strict=True))
    print(f"max |Δparam| {diff:.3g} (moved {moved:.3g}), max |Δloss| {loss_diff:.3g}")
    assert diff <= PARAM_ATOL


def test_each_process_ran_its_own_rows(runs):
    """Rows 0..P*G/2-1 of every rollout batch ran on process 0, the rest on process 1: the two
    processes' environment logs tile the single run's log, with nothing run twice."""
    single, multi = runs
    rollouts = read_jsonl(multi / "rollouts.jsonl")
    solo = read_jsonl(single / "env.p0.jsonl")
    logs = [read_jsonl(multi / f"env.p{q}.jsonl") for q in range(2)]
    # per collect(): the start's evaluation (greedy: TEST_ENTRIES rows; sampled: SAMPLES rows
    # per entry), the RL iterations (P*G rows each), then the final evaluation
    evaluation = [TEST_ENTRIES, TEST_ENTRIES * SAMPLES]
    sizes = [*evaluation, *[P * G] * STEPS, *evaluation]
    assert len(solo) == sum(sizes) and [len(x) for x in logs] == [sum(sizes) // 2] * 2
    start = 0
    for it, n in enumerate(sizes):
        rows = solo[start : start + n]
        parts = [logs[q][start // 2 : (start + n) // 2] for q in range(2)]
        # process q scored exactly rows q*n/2 .. (q+1)*n/2 - 1 of this batch, in order
        assert parts[0] == rows[: n // 2] and parts[1] == rows[n // 2 :]
        if 2 <= it < 2 + STEPS:  # an RL iteration's batch
            owner = np.asarray(rollouts[it - 2]["env_process"]).ravel()
            assert owner.tolist() == [0] * (n // 2) + [1] * (n // 2)
            rewards = np.asarray(rollouts[it - 2]["rewards"]).ravel()
            assert [x["reward"] for x in rows] == rewards.tolist()
        start += n
    assert json.loads((multi / "summary.json").read_text())["iterations"] == STEPS


# ------------------------------------------------------------------ the helpers, in one process


def test_split_rows_tile_the_rows():
    from rcgrpo_jax import distributed

    for n in range(12):
        for count in range(1, 5):
            shares = [distributed.split_rows(n, count, q) for q in range(count)]
            assert [r for share in shares for r in share] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert distributed.process_rows(5) == range(5) and distributed.row_owner(3) == [0, 0, 0]


def test_gloo_for_cpu_processes_only():
    from rcgrpo_jax.distributed import _cpu_collectives

    assert _cpu_collectives({"JAX_PLATFORMS": "cpu"})
    assert not _cpu_collectives({"JAX_PLATFORMS": "tpu,cpu"})
    assert not _cpu_collectives(
        {"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "mpi"}
    )
    assert _cpu_collectives({}, tpu_device_present=lambda: False)
    assert not _cpu_collectives({}, tpu_device_present=lambda: True)


def test_single_process_helpers_gather_nothing():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from rcgrpo_jax import distributed, models

    assert distributed.allgather_rows([[1, 2], [], [3]]) == [[[1, 2], [], [3]]]
    assert distributed.allgather_objects([{"a": (1,)}]) == [[{"a": (1,)}]]
    mesh = models.make_mesh((8, 1, 1))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    g = distributed.global_from_host(x, NamedSharding(mesh, PartitionSpec("data")))
    assert len(g.sharding.device_set) == 8
    out = distributed.host_tree({"x": g, "y": jnp.ones(2), "z": jax.numpy.int32(3)})
    np.testing.assert_array_equal(out["x"], x)
    assert isinstance(out["y"], np.ndarray) and int(out["z"]) == 3
    np.testing.assert_array_equal(distributed.host_array(g), x)
