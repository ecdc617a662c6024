"""The command line: config loading, overrides and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, shipped_config

from rcgrpo_jax import config as config_lib
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.stages import setup


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--config=configs/tiny.py", "--config.trian.lr=1e-6"],
            "error: unknown config key 'trian' in --config.trian.lr=1e-6",
        ),
        (
            ["--config=configs/tiny.py", "--config.model.archx=1"],
            "error: unknown config key 'archx' in --config.model.archx=1",
        ),
        (["--config=configs/tiny.py", "--config.seed=abc"], "error: flag --config.seed=abc"),
        (["--config=configs/missing.py"], "error: cannot load config file 'configs/missing.py'"),
        (
            ["--config=configs/tiny.py", "--config.model.hf_path=/nonexistent/ckpt"],
            "error: config.model.hf_path='/nonexistent/ckpt': expected an existing path",
        ),
        (["--config=configs/tiny.py", "--config.stage=nope"], "error: config.stage='nope'"),
        (
            ["--config=configs/tiny.py", "--config.stage=sft", "--config.model.lora.rank=4"],
            "error: model.lora.rank > 0 adapts a trained model (model.hf_path, rl.init_from)",
        ),
    ],
)
def test_bad_input_is_one_line(args, expected):
    out = run_main(*args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["tiny", "qwen7b", "llama8b"])
def test_configs_load_and_declare_known_stage(name):
    c = shipped_config(name)
    assert c.stage in config_lib.STAGES
    assert c.model.chat_format in ("qwen", "llama", "python")


def test_mesh_from_config_fills_and_rejects():
    c = config_lib.base_config()
    c.mesh.shape = (2, -1, 1)
    assert dict(setup.mesh_from_config(c).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    c.mesh.shape = (3, -1, 1)
    with pytest.raises(UserError, match="does not divide 8 devices"):
        setup.mesh_from_config(c)
    c.mesh.shape = (2, 2, 1)
    with pytest.raises(UserError, match="uses 4 of 8 devices"):
        setup.mesh_from_config(c)


def test_random_model_from_config_is_sharded():
    c = config_lib.base_config()
    c.mesh.shape = (1, 2, 4)
    mesh = setup.mesh_from_config(c)
    cfg, params = setup.model_from_config(c, mesh)
    assert cfg.vocab_size == c.model.arch.vocab_size and cfg.dtype == "bfloat16"
    wq = params["layers"]["attn"]["wq"]
    assert wq.shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    assert tuple(wq.sharding.spec) == (None, "fsdp", "tensor", None)
    c.model.arch.num_heads = 3
    with pytest.raises(UserError, match="not a multiple of num_kv_heads"):
        setup.model_from_config(c)
