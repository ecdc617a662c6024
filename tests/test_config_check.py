"""Config validation: every key has a rule, and bad values stop the CLI in seconds, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO

from rcgrpo_jax import config as config_lib
from rcgrpo_jax import config_check
from rcgrpo_jax.errors import UserError


def _load(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_every_declared_key_has_a_rule_and_every_rule_a_key():
    keys = set(config_check.flatten(config_lib.base_config()))
    assert keys - set(config_check.RULES) == set()
    assert set(config_check.RULES) - keys == set()


@pytest.mark.parametrize("name", ["tiny", "tiny_pretrain", "qwen7b", "llama8b"])
def test_shipped_configs_validate(name, tmp_path):
    c = _load(name)
    if c.model.hf_path:  # the 7B/8B configs point at a checkpoint on the TPU VM
        c.model.hf_path = str(tmp_path)
    config_check.validate(c)


def test_cross_key_rules():
    c = _load("tiny")
    c.rl.minibatches = 3
    with pytest.raises(UserError, match=r"config.rl.minibatches=3: expected a divisor of rl.num"):
        config_check.validate(c)
    c = _load("tiny")
    c.stage = "sft"
    c.rl.group_size = 1  # only the RL stages need groups of 2
    config_check.validate(c)
    c.stage = "rcgrpo"
    with pytest.raises(UserError, match="rl.group_size=1: expected an integer >= 2"):
        config_check.validate(c)
    c = _load("tiny")
    c.rl.objective, c.rl.aggregation = "dapo", "sequence"
    with pytest.raises(UserError, match="rl.aggregation='sequence': expected 'token' with rl.obj"):
        config_check.validate(c)


@pytest.mark.parametrize("family,bias", [("llama", True), ("qwen2", False)])
def test_family_qkv_bias_mismatch_is_caught_before_training(family, bias, tmp_path):
    """What HF export refuses (`families.qkv_bias_mismatch`), said at config check instead."""
    from rcgrpo_jax import models
    from rcgrpo_jax.models.hf_io import config_to_hf

    c = _load("tiny")
    c.model.arch.family, c.model.arch.qkv_bias = family, bias
    with pytest.raises(UserError) as e:
        config_check.validate(c)
    need = f"expected {not bias} for a {family} model"
    assert str(e.value).startswith(f"config.model.arch.qkv_bias={bias}: {need}")
    cfg = models.ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=8, qkv_bias=bias, family=family,
    )  # fmt: skip
    with pytest.raises(models.CheckpointError, match=need):
        config_to_hf(cfg, "float32")
    c.model.arch.qkv_bias = not bias
    config_check.validate(c)
    c.model.arch.qkv_bias = bias
    c.model.hf_path = str(tmp_path)  # the checkpoint's config.json decides: arch is unused
    config_check.validate(c)


def test_objective_names_the_valid_ones():
    c = _load("tiny")
    c.rl.objective = "ppo"
    with pytest.raises(UserError) as e:
        config_check.validate(c)
    assert str(e.value) == ("config.rl.objective='ppo': expected one of grpo, dr_grpo, dapo, gspo")


# (override, key named in the one-line error)
BAD = [
    ("train.steps=-5", "train.steps"),
    ("rl.p_high=1.5", "rl.p_high"),
    ("env.benchmark=bfcl", None),  # placeholder: replaced below by the categories case
    ("rl.group_size=1", "rl.group_size"),
    ("rl.minibatches=3", "rl.minibatches"),
    ("model.chat_format=chatml", "model.chat_format"),
    ("model.remat=sometimes", "model.remat"),
    ("model.attention=magic", "model.attention"),
    ("eval.split=dev", "eval.split"),
    ("rl.temperature=0", "rl.temperature"),
    ("mesh.shape=(0,1,1)", "mesh.shape"),
    ("train.optim.lr=-0.001", "train.optim.lr"),
    ("rctp.perturbations=('typo',)", "rctp.perturbations"),
    ("env.synthetic.difficulty.templates=('nope',)", "env.synthetic.difficulty.templates"),
    ("tokenizer_path=/nonexistent/tok", "tokenizer_path"),
    ("eval.reward_token=2", "eval.reward_token"),
    ("rctp.max_tokens=4096", "rctp.max_tokens"),
    ("model.arch.num_kv_heads=3", "model.arch.num_kv_heads"),
    ("model.arch.qkv_bias=False", "model.arch.qkv_bias"),
    ("env.call_timeout_s=-1.0", "env.call_timeout_s"),
    ("rl.optim.grad_accum=3", "rl.optim.grad_accum"),
    ("train.optim.grad_accum=3", "train.optim.grad_accum"),
    ("rl.objective=ppo", "rl.objective"),
]
BAD[2] = ("env.bfcl.categories=('multi_turn_nope',)", "env.bfcl.categories")


@pytest.mark.parametrize("override,key", BAD, ids=[k for _, k in BAD])
def test_bad_value_exits_2_in_one_line_before_any_work(override, key, tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.main", "--config=configs/tiny.py",
         f"--config.workdir={workdir}", f"--config.{override}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: config.{key}="), out.stderr
    assert "expected" in lines[0]
    assert not workdir.exists()  # nothing written, no stage started
    assert out.stdout == ""
    assert time.monotonic() - start < 60  # JAX is never imported; ~2 s on 2 cores
