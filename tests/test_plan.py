"""AOT planner on a tiny model (8 virtual devices from conftest) and the multi-host start-up rule.

The planner compiles, never runs: these tests check that it lowers the fused RC-GRPO step and the
sampler programs, that its memory figure moves the right way with batch and remat, and that the
analytic FLOPs and topology conventions are what the README documents.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import pytest
from conftest import REPO, shipped_config

from rcgrpo_jax import config_check, distributed, models, planning
from rcgrpo_jax.config import base_config
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.models import attention, flops
from rcgrpo_jax.planning import parse_topology, programs
from rcgrpo_jax.tools import plan as cli


def _tiny(remat: str = "none", mesh=(1, -1, 1)):
    c = base_config()
    c.model.dtype = "float32"
    c.model.remat = remat
    c.mesh.shape = mesh
    return c


def _train_row(config, shape):
    (row,) = planning.plan(config, "v5e-8", shape, programs=("train",), devices=jax.devices()[:8])
    return row


@pytest.fixture(scope="module")
def base_row():
    return _train_row(_tiny(), planning.Shape(prompts=1, group=8, seq=512))


def test_all_programs_compile_and_report(base_row, monkeypatch):
    """Also: the sampler programs hold every rollout row of an iteration (num_prompts x G, not
    one minibatch's P x G) and the cache the rollout allocates (T + one prefill chunk)."""
    states = []
    abstract_state = programs.abstract_rollout_state

    def spy(cfg, mesh, batch, capacity):
        states.append((batch, capacity))
        return abstract_state(cfg, mesh, batch, capacity)

    monkeypatch.setattr(programs, "abstract_rollout_state", spy)
    shape = planning.Shape(
        prompts=1, group=8, seq=64, prefill_chunk=32, decode_steps=4, minibatches=2
    )
    rows = planning.plan(
        _tiny(mesh=(1, 4, 2)), "v5e-8", shape, programs=("decode",), devices=jax.devices()[:8]
    )
    assert states == [(16, 96)]  # 2 minibatches x 1 prompt x 8; 64 + 32 slots
    assert (rows[0]["sampler_rows"], rows[0]["cache"], rows[0]["P"]) == (16, 96, 1)
    assert [r["program"] for r in rows] == ["decode"]
    for r in rows + [base_row]:
        assert r["temp_gib"] > 0 and r["argument_gib"] > 0
        assert r["fits"] and r["time_s"] > 0 and 0 < r["mfu"] <= 1
    assert rows[0]["mesh"] == "1x4x2" and base_row["mesh"] == "1x8x1"
    assert base_row["attention"] == base_row["attention_compiled"] == "flash"
    assert rows[0]["resident_gib"] > 0  # optimizer moments stay beside the sampler
    table = cli.format_table(rows + [base_row])
    assert table.count("\n") == 3 and "| train |" in table


def test_temp_memory_grows_with_batch(base_row):
    big = _train_row(_tiny(), planning.Shape(prompts=4, group=8, seq=512))
    assert big["temp_gib"] > 1.5 * base_row["temp_gib"]
    assert big["total_gib"] > base_row["total_gib"]


def test_full_remat_uses_less_temp_memory(base_row):
    full = _train_row(_tiny("full"), planning.Shape(prompts=1, group=8, seq=512))
    assert full["temp_gib"] < base_row["temp_gib"]
    assert full["model_tflop"] == pytest.approx(base_row["model_tflop"])
    assert full["hw_tflop"] > base_row["hw_tflop"]  # the recomputed forward


def test_flops_formula():
    cfg = planning.model_config(_tiny()).replace(attention="dense")
    shape = planning.Shape(prompts=2, group=4, seq=128)
    model, hw = planning.train_flops(cfg, shape)
    n = flops.matmul_params(cfg)
    tokens = 2 * 4 * 128
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 128 * tokens
    assert model == 6 * n * tokens + attn  # the full T x T, whatever the step skips
    blocks = attention.causal_blocks(128)
    assert blocks == 4 and hw == 6 * n * tokens + attn * 5 / 8  # (4 + 1) / (2 * 4) computed
    assert n < cfg.num_params() + cfg.hidden_size * cfg.vocab_size
    # flash at T = 2048: 4 blocks of 512, (4 + 1) / 8 of T x T, 3.5 passes (scores recomputed)
    shape = planning.Shape(prompts=2, group=4, seq=2048)
    model, hw = planning.train_flops(cfg.replace(attention="flash"), shape)
    tokens = 2 * 4 * 2048
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 2048 * tokens
    assert model == 6 * n * tokens + 3 * attn_fwd
    assert hw == pytest.approx(6 * n * tokens + 3.5 * attn_fwd * 5 / 8)
    # splash (separate dkv and dq backward kernels: 2 + 4 + 3 matmuls): 4.5 passes; 4 blocks
    _, hw = planning.train_flops(cfg, shape, "splash")
    assert hw == pytest.approx(6 * n * tokens + 4.5 * attn_fwd * 5 / 8)
    # remat dots: dense's attention einsums are saved, flash's forward (a loop) is rerun
    dots = cfg.replace(remat="dots")
    assert planning.train_flops(dots, shape)[1] == planning.train_flops(cfg, shape)[1]
    _, hw = planning.train_flops(dots.replace(attention="flash"), shape)
    assert hw == pytest.approx(6 * n * tokens + (3.5 + 1) * attn_fwd * 5 / 8)


def test_dots_remat_reruns_the_flash_forward():
    """What `remat_recompute` counts for flash under remat=dots: the grad's program holds the
    flash forward's two loops (query blocks, key blocks) once more than without remat, so
    the policy saved nothing of the forward and reruns it."""
    import jax.numpy as jnp

    from rcgrpo_jax import models

    def loops(remat):
        cfg = planning.model_config(_tiny()).replace(attention="flash", remat=remat, flash_block=64)

        def loss(p, tok):
            pos = jnp.broadcast_to(jnp.arange(tok.shape[1]), tok.shape)
            logp, _, valid = models.token_logprobs(cfg, p, tok, pos, jnp.ones_like(tok))
            return (logp * valid).sum()

        tok = jax.ShapeDtypeStruct((1, 128), jnp.int32)
        text = jax.jit(jax.grad(loss)).lower(models.param_shapes(cfg), tok).as_text()
        return text.count("stablehlo.while")

    assert loops("dots") == loops("none") + 2  # the layers are scanned: one body


def test_plans_what_the_config_runs():
    """T, P, G, grad_accum come from the config's RL update unless given; a TPU config's
    splash attention is compiled as flash, and the row says both."""
    c = base_config()
    c.rl.max_len, c.rl.num_prompts, c.rl.minibatches, c.rl.optim.grad_accum = 12288, 8, 2, 2
    shape = planning.shape_from_config(c)
    assert (shape.seq, shape.prompts, shape.group, shape.grad_accum) == (12288, 4, 8, 2)
    assert (shape.minibatches, shape.sampler_rows, shape.cache) == (2, 64, 12288 + 128)
    assert planning.shape_from_config(c, seq=4096, grad_accum=None).seq == 4096
    c.model.hf_path = "/nonexistent/Qwen2.5-7B-Instruct"
    cfg = planning.model_config(c)
    assert cfg.attention == "auto"
    kinds = planning.planned_attention
    assert kinds(cfg, 16384) == planning.PlannedAttention("splash", "flash", "flash")
    assert kinds(cfg, 1024, 1024).sampler == "dense"  # cached attention under auto, short cache
    assert kinds(_tiny_cfg(), 512).train == "flash"  # head_dim 16
    dense = kinds(cfg.replace(attention="dense"), 16384)
    assert (dense.train, dense.compiled, dense.sampler) == ("dense", "dense", "dense")


def _tiny_cfg():
    return planning.model_config(_tiny())


@pytest.mark.parametrize(
    "name,chips,hosts",
    [
        ("v5p-16", 8, 2),
        ("v6e-16", 16, 2),
        ("v5e-32", 32, 4),
        ("v5litepod-8", 8, 1),
        ("v4-8", 4, 1),
        ("v6e-8", 8, 1),
        ("h100-1", 1, 1),
        ("h100-16", 16, 2),
    ],
)
def test_topology_names(name, chips, hosts):
    t = parse_topology(name)
    assert (t.chips, t.hosts) == (chips, hosts)


@pytest.mark.parametrize("bad", ["v5p-1", "v7x-8", "v5p16", "tpu"])
def test_bad_topology(bad):
    with pytest.raises(ValueError):
        parse_topology(bad)


def test_mesh_shape_resolution():
    assert planning.resolve_mesh_shape((1, -1, 2), 16) == (1, 8, 2)
    with pytest.raises(ValueError):
        planning.resolve_mesh_shape((1, 3, -1), 16)
    with pytest.raises(ValueError):
        planning.resolve_mesh_shape((1, 4, 2), 16)


def test_paper_model_presets():
    c = base_config()
    c.model.hf_path = "/nonexistent/Qwen2.5-7B-Instruct"
    qwen = planning.model_config(c)
    assert 7.5e9 < qwen.num_params() < 7.7e9 and qwen.qkv_bias
    c.model.hf_path = "/nonexistent/Llama-3.1-8B-Instruct"
    llama = planning.model_config(c)
    assert 8.0e9 < llama.num_params() < 8.1e9 and llama.rope_scaling is not None


def test_qwen3_presets():
    """Qwen3's published sizes (total / non-embedding): 8B 8.19 / 6.95 B untied, 0.6B 0.60 /
    0.44 B tied, its head_dim 128 wider than hidden / heads; q/k norms, no q/k/v biases."""
    c = base_config()
    sizes = {"Qwen3-8B": (8.19e9, 6.95e9, False), "Qwen3-4B": (4.02e9, 3.63e9, True),
             "Qwen3-0.6B": (0.596e9, 0.440e9, True)}  # fmt: skip
    for name, (total, body, tied) in sizes.items():
        c.model.hf_path = f"/nonexistent/{name}"
        cfg = planning.model_config(c)
        embedding = cfg.vocab_size * cfg.hidden_size * (1 if tied else 2)
        assert cfg.num_params() == pytest.approx(total, rel=2e-3), name
        assert cfg.num_params() - embedding == pytest.approx(body, rel=2e-3), name
        assert (cfg.family, cfg.tie_embeddings, cfg.qkv_bias) == ("qwen3", tied, False)
        assert cfg.family_spec.qk_norm and (cfg.head_dim, cfg.num_kv_heads) == (128, 8)
    assert planning.model_config(c).num_heads * 128 == 2 * 1024  # 0.6B: 16 heads of 128


@pytest.mark.parametrize("name", ["qwen7b", "llama8b", "qwen3_8b"])
def test_shipped_configs_write_their_familys_chat_format(name):
    c = shipped_config(name)
    cfg = planning.model_config(c)  # the preset the checkpoint directory names
    assert c.model.chat_format == cfg.family_spec.chat_format


def test_a_bf16_sampler_is_planned_without_the_cpus_f32_weight_copies():
    """XLA:CPU has no bf16 dot: compiled as is, the bf16 decode program's temporaries hold f32
    copies of the weights (more than their f32 bytes); the planner takes the temporaries from
    the program's f32 compile instead, which holds no weight copy."""
    c = _tiny()
    c.model.dtype = "bfloat16"
    c.model.arch.update(hidden_size=256, intermediate_size=512, num_layers=4, vocab_size=2048)
    shape = planning.Shape(prompts=1, group=8, seq=64, prefill_chunk=32, decode_steps=4)
    (row,) = planning.plan(c, "v5e-8", shape, programs=("decode",), devices=jax.devices()[:8])
    cfg = planning.model_config(c)
    f32_weights = flops.matmul_params(cfg) * 4 / 2**30  # the mesh is (1, 8, 1): per device
    assert row["temp_estimated"] and row["temp_gib"] < f32_weights / 8
    mesh = models.make_mesh((1, 8, 1), jax.devices()[:8])
    params = programs.sampler_weights(cfg, mesh, _train_program(cfg, mesh, shape), "tensor")[1]
    raw = programs.compile_sampler(cfg, mesh, shape, "decode", params, 0)
    assert programs.memory(raw)["temp"] / 2**30 > f32_weights  # every layer's f32 copy


def _train_program(cfg, mesh, shape):
    from rcgrpo_jax.rl.losses import Objective

    return programs.train_setup(cfg, mesh, shape, Objective())


def _rows(train=2.0, decode=0.01, prefill=0.1, sampler_rows=32):
    r = lambda prog, t, bound: {"program": prog, "time_s": t, "bound": bound,
                                "sampler_rows": sampler_rows}  # fmt: skip
    return [r("train", train, "compute"), r("decode", decode, "memory"),
            r("prefill", prefill, "compute")]  # fmt: skip


def test_the_projected_iteration_counts_rounds_chunks_and_updates():
    shape = planning.Shape(prompts=8, group=8, seq=16384, prefill_chunk=128)
    work = cli.Workload(rows=64, rounds=10, prompt_tokens=4096, new_tokens=256, updates=2,
                            iterations=100)  # fmt: skip
    it = cli.iteration(_rows(), shape, work)
    # 64 rows in chunks of 32; 4096 / 128 = 32 prompt calls + 9 later rounds; 10 x 256 steps
    assert (it["row_chunks"], it["prefill_calls"], it["decode_tokens"]) == (2, 41, 2560)
    assert it["prefill_s"] == pytest.approx(2 * 41 * 0.1)
    assert it["decode_s"] == pytest.approx(2 * 2560 * 0.01)
    assert it["update_s"] == pytest.approx(4.0)
    assert it["iteration_s"] == pytest.approx(8.2 + 51.2 + 4.0)
    assert it["run_h"] == pytest.approx(63.4 * 100 / 3600)
    assert it["bound"].startswith("decode (memory-bound)")
    # the decode budget stops at T: a trajectory holds at most T - prompt sampled tokens
    long = cli.iteration(_rows(), dataclasses.replace(shape, seq=6144), work)
    assert long["decode_tokens"] == 6144 - 4096
    with pytest.raises(ValueError, match="prefill"):
        cli.iteration(_rows()[:2], shape, work)
    assert "RL iteration (projected): 63 s" in cli.format_iteration(it)


def test_assistant_steps_of_golden_trajectories():
    bfcl = types.SimpleNamespace(ground_truth=[["a()"], [], ["b()", "c()"]], ground_truth_steps=())
    assert cli.assistant_steps(bfcl) == 2 + 1 + 2  # a turn without calls: the reply only
    steps = types.SimpleNamespace(ground_truth=[["a()", "b()"]],
                                  ground_truth_steps=((("a()",), ("b()",)),))  # fmt: skip
    assert cli.assistant_steps(steps) == 3
    work = cli.workload_from_config(base_config(), prompt_tokens=512)
    c = base_config().rl
    assert (work.rows, work.new_tokens, work.iterations) == (
        c.num_prompts * c.group_size,
        c.max_new_tokens,
        c.steps,
    )
    assert work.rounds >= 2 and work.prompt_tokens == 512


def _fake_plan(fits):
    """A plan_fn whose rows fit where fits(mesh, grad_accum, max_rows, program) says."""
    calls = []

    def plan_fn(config, topo, shape, programs, **kw):
        mesh = tuple(config.mesh.shape)
        calls.append((mesh, shape.grad_accum, shape.max_rows, programs))
        ok = {p: fits(mesh, shape.grad_accum, shape.max_rows, p) for p in programs}
        # the larger the grad_accum and the tensor axis, the nearer a train step is to fitting
        near = 1.0 + 1.0 / shape.grad_accum - 0.01 * mesh[2]
        frac = {p: 0.5 if ok[p] else near for p in programs}
        return [{"program": p, "fits": ok[p], "total_gib": 16.0 * frac[p], "hbm_gib": 16.0,
                 "hbm_frac": frac[p]} for p in programs]  # fmt: skip

    return plan_fn, calls


def test_auto_mesh_takes_the_first_configuration_that_fits():
    c = _tiny()
    c.model.arch.update(num_heads=8, num_kv_heads=4, head_dim=8)
    shape = planning.Shape(prompts=8, group=8, grad_accum=2)
    assert planning.mesh_candidates(16, 4) == [(1, 16, 1), (1, 8, 2), (1, 4, 4)]
    assert planning.mesh_candidates(8, 8) == [(1, 8, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8)]

    # the train step fits from tensor 2 with grad_accum 4; the sampler with 16 rows at a time
    def fits(mesh, ga, max_rows, program):
        if program == "train":
            return mesh[2] >= 2 and ga >= 4
        return 0 < max_rows <= 16

    plan_fn, calls = _fake_plan(fits)
    choice = planning.choose(c, "v5e-16", shape, plan_fn=plan_fn)
    assert (choice.mesh, choice.grad_accum, choice.max_rows) == ((1, 8, 2), 4, 16)
    trains = [(m, ga) for m, ga, _, p in calls if p == ("train",)]
    assert trains == [((1, 16, 1), 2), ((1, 16, 1), 4), ((1, 16, 1), 8), ((1, 8, 2), 2),
                      ((1, 8, 2), 4)]  # fmt: skip
    assert [r for _, _, r, p in calls if p != ("train",)] == [0, 32, 16]
    assert choice.tried == len(calls)
    line = choice.line("v5e-16")
    assert "1x8x2" in line and "grad_accum=4" in line and "rl.max_rows=16" in line
    choice.apply(c)
    assert (tuple(c.mesh.shape), c.rl.optim.grad_accum, c.rl.max_rows) == ((1, 8, 2), 4, 16)

    plan_fn, _ = _fake_plan(lambda *a: False)
    with pytest.raises(UserError, match="no mesh of 16 v5e devices fits") as err:
        planning.choose(c, "v5e-16", shape, plan_fn=plan_fn)
    # what came nearest over every mesh tried: the last mesh's train step at the largest
    # grad_accum (one group per microbatch)
    assert "closest: train 17.4 GiB of 16 per device at mesh 1x4x4, grad_accum 8" in str(err.value)


def test_auto_mesh_on_devices_without_a_memory_limit():
    c = _tiny(mesh=("auto",))
    assert planning.is_auto(c.mesh.shape) and config_check.mesh_shape(("auto",)) is None
    line = planning.resolve_auto(c)
    assert tuple(c.mesh.shape) == (1, 8, 1) and "no memory limit" in line
    assert planning.device_topology(jax.devices()) is None


# ------------------------------------------------------------------ multi-host start-up rule


def _decide(env, tpu=False):
    return distributed.decide(env, tpu_device_present=lambda: tpu)


def test_single_cpu_process_is_a_no_op():
    assert not _decide({}).initialize
    assert not distributed.maybe_initialize({"RCGRPO_DISTRIBUTED": "0"})


def test_multi_host_signals():
    assert _decide({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}).initialize
    assert not _decide({"TPU_WORKER_HOSTNAMES": "10.0.0.2"}).initialize
    assert _decide({}, tpu=True).initialize
    assert not _decide({"TPU_SKIP_MDS_QUERY": "1"}, tpu=True).initialize
    assert _decide({"RCGRPO_DISTRIBUTED": "1"}).initialize
    assert not _decide({"RCGRPO_DISTRIBUTED": "0", "TPU_WORKER_HOSTNAMES": "a,b"}).initialize
    d = _decide(
        {
            "JAX_COORDINATOR_ADDRESS": "localhost:1234",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": "1",
        }
    )
    assert d.kwargs == {
        "coordinator_address": "localhost:1234",
        "num_processes": 2,
        "process_id": 1,
    }


def test_the_planner_runs_qwen3_8b_on_its_default_topology(tmp_path):
    """`python -m rcgrpo_jax.tools.plan --config=configs/qwen3_8b.py` with no --topology plans
    the default slice (v5p-16: re-executed on 8 virtual devices) from the Qwen3-8B preset,
    here at 1 layer and T = 1024, the train program only."""
    out = tmp_path / "plan.json"
    args = ["--config=configs/qwen3_8b.py", "--layers=1", "--seq=1024", "--programs=train",
            f"--json={out}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(cli._DEVICES_ENV, None)
    # one CPU device, as a user's shell has (not the suite's 8)
    xla = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(xla)
    p = subprocess.run([sys.executable, "-m", "rcgrpo_jax.tools.plan", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["topology"], row["mesh"], row["program"], row["fits"]) == (
        "v5p-16",
        "1x4x2",
        "train",
        True,
    )
    assert "model qwen3:1L/4096" in p.stdout


def test_the_planner_fits_qwen7b_on_v6e_16_at_reduced_depth_a_chunk_of_rows_at_a_time(tmp_path):
    """The CLI on the mission's config and slice (16 virtual devices, Qwen2.5-7B's widths, 2 of
    its 28 layers, T = 16384, P x G = 64) with rl.max_rows = 16: every program fits, the
    sampler's programs hold 16 rows (its KV cache is the output of decode: exactly 16 rows'
    worth), and the projected iteration runs 4 chunks of rows."""
    out = tmp_path / "plan.json"
    args = ["--config=configs/qwen7b.py", "--topology=v6e-16", "--layers=2",
            "--config.rl.max_rows=16", f"--json={out}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(cli._DEVICES_ENV, None)
    p = subprocess.run([sys.executable, "-m", "rcgrpo_jax.tools.plan", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    plan = json.loads(out.read_text())
    rows = {r["program"]: r for r in plan["rows"]}
    assert set(rows) == set(planning.PROGRAMS) and all(r["fits"] for r in rows.values())
    assert {r["T"] for r in rows.values()} == {16384} and rows["train"]["P"] * rows["train"][
        "G"
    ] == 64
    decode = rows["decode"]
    assert decode["sampler_rows"] == 16 == rows["prefill"]["sampler_rows"]
    kv_heads, head_dim = 4, 128  # Qwen2.5-7B
    cache = 16 * decode["cache"] * 2 * 2 * kv_heads * head_dim * 2 / 16 / 2**30  # bf16 K, V
    assert cache <= decode["output_gib"] < 1.05 * cache
    assert plan["iteration"]["row_chunks"] == 4
    assert "4 row chunk(s)" in p.stdout


def test_lora_is_planned_as_it_trains():
    """`model.lora.rank` > 0: the train state holds the adapters and reward-token rows with
    their AdamW moments (f32: 3 x 4 bytes each), the base (sharded as ever) is the step's
    frozen argument; train FLOPs are 4·N + 6·N_lora per token (no base weight gradient); the
    "tensor" sampler decodes merged weights (the base's FLOPs), "train" applies the adapters on
    the fly (2·N_lora more per token)."""
    c = _tiny()
    c.model.arch.update(hidden_size=128, intermediate_size=256, vocab_size=512)
    shape = planning.Shape(prompts=1, group=8, seq=64, prefill_chunk=32, decode_steps=4)
    full_cfg = planning.model_config(c)
    by_program = lambda progs: {r["program"]: r for r in planning.plan(
        c, "v5e-8", shape, programs=progs, devices=jax.devices()[:8])}  # fmt: skip
    full = by_program(("train",))
    c.model.lora.rank = 4
    cfg = planning.model_config(c)
    assert cfg.lora.rank == 4 and cfg.lora.token_ids == (510, 511)
    n, n_lora = flops.matmul_params(cfg), flops.lora_matmul_params(cfg)
    e, m, hd, kvd = 128, 256, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert n_lora == cfg.num_layers * 4 * (2 * (e + hd) + 2 * (e + kvd) + 3 * (e + m))
    rows = {}
    for layout, progs in (("tensor", ("train", "decode")), ("train", ("decode",))):
        c.mesh.sampler_weights = layout
        rows[layout] = by_program(progs)
    train = rows["tensor"]["train"]
    trainable = models.weights.num_lora_params(cfg)
    assert train["lora_rank"] == 4
    # f32 rows + 2 moments, A over fsdp with its base rows' input axis, B and token rows whole
    assert trainable * 12 / 8 < train["state_gib"] * 2**30 < trainable * 12
    assert train["frozen_gib"] * 2**30 == pytest.approx(full_cfg.num_params() * 4 / 8, rel=0.05)
    assert train["state_gib"] < full["train"]["state_gib"] / 4
    tokens = 8 * 64
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 64 * tokens
    assert train["model_tflop"] * 1e12 == pytest.approx((4 * n + 6 * n_lora) * tokens + attn)
    mesh = models.make_mesh((1, 8, 1), jax.devices()[:8])
    merged = planning.sampler_flops(full_cfg, mesh, shape, "decode")  # the base's own
    assert rows["tensor"]["decode"]["model_tflop"] * 1e12 == pytest.approx(merged)
    decode_lora = rows["train"]["decode"]["model_tflop"] * 1e12 - merged
    assert decode_lora == pytest.approx(2 * n_lora * 8)  # 8 rows, one token each


def test_the_head_is_planned_where_the_loss_reads():
    """`Shape.loss_tokens` (the CLI's default under `model.gather_head`: the projected sampled
    tokens): the train step gets a `loss_index` of that many positions per row, and with a wide
    vocabulary its temporaries fall well below the whole-row head's."""
    c = _tiny()
    c.model.arch.update(vocab_size=8192)
    shape = planning.Shape(prompts=1, group=8, seq=256)
    whole = _train_row(c, shape)
    gathered = _train_row(c, dataclasses.replace(shape, loss_tokens=40))
    assert (whole["loss_tokens"], gathered["loss_tokens"]) == (0, 40)
    mesh = models.make_mesh((1, 8, 1), jax.devices()[:8])
    batch = programs.abstract_rl_batch(mesh, dataclasses.replace(shape, loss_tokens=40), False)
    assert batch["loss_index"].shape == (1, 8, 64)  # length_bucket(40)
    assert gathered["temp_gib"] < 0.5 * whole["temp_gib"]


def test_a_plan_that_cannot_fit_is_one_line(monkeypatch, capsys):
    """`mesh.shape=auto` with no fitting mesh (or any bad input) ends the command with exit code
    2 and one line on stderr, not a traceback."""

    def no_mesh(argv):
        raise UserError("mesh.shape=auto: no mesh of 1 h100 devices fits every program")

    monkeypatch.setattr(cli, "_plan", no_mesh)
    assert cli.main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err == "error: mesh.shape=auto: no mesh of 1 h100 devices fits every program\n"
