"""Config validation: every key has a rule, and bad values stop the CLI in seconds, in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, shipped_config

from rcgrpo_jax import config as config_lib
from rcgrpo_jax import config_check
from rcgrpo_jax.errors import UserError


def test_every_declared_key_has_a_rule_and_every_rule_a_key():
    keys = set(config_check.flatten(config_lib.base_config()))
    assert keys - set(config_check.RULES) == set()
    assert set(config_check.RULES) - keys == set()


@pytest.mark.parametrize(
    "name",
    ["tiny", "tiny_multiturn", "tiny_headroom", "tiny_pretrain", "qwen7b", "llama8b", "qwen3_8b"],
)
def test_shipped_configs_validate(name, tmp_path):
    c = shipped_config(name)
    if c.model.hf_path:  # the 7B/8B configs point at a checkpoint on the TPU VM
        c.model.hf_path = str(tmp_path)
    config_check.validate(c)


def test_sibling_config_is_its_parent_with_the_stated_changes(tmp_path):
    """A config built on another (`sibling_config(__file__, name)`) gets the config of the file
    beside it, whole, and only what the child sets differs; a name with no file is a one-line
    error naming the path."""
    (tmp_path / "parent.py").write_text(
        "from rcgrpo_jax.config import base_config\n\n\n"
        "def get_config():\n    c = base_config()\n    c.seed = 7\n    return c\n"
    )
    (tmp_path / "child.py").write_text(
        "from rcgrpo_jax.config import sibling_config\n\n\n"
        "def get_config():\n    c = sibling_config(__file__, 'parent')\n"
        "    c.rl.p_high = 0.25\n    return c\n"
    )
    parent = config_check.flatten(config_lib.config_from_file(tmp_path / "parent.py"))
    child = config_check.flatten(config_lib.config_from_file(tmp_path / "child.py"))
    assert parent["seed"] == 7 and child.keys() == parent.keys()
    assert {k for k, v in parent.items() if child[k] != v} == {"rl.p_high"}
    with pytest.raises(FileNotFoundError, match=r"config file '.*nope\.py' does not exist"):
        config_lib.sibling_config(str(tmp_path / "child.py"), "nope")


def test_cross_key_rules():
    c = shipped_config("tiny")
    c.rl.minibatches = 3
    with pytest.raises(UserError, match=r"config.rl.minibatches=3: expected a divisor of rl.num"):
        config_check.validate(c)
    c = shipped_config("tiny")
    c.stage = "sft"
    c.rl.group_size = 1  # only the RL stages need groups of 2
    config_check.validate(c)
    c.stage = "rcgrpo"
    with pytest.raises(UserError, match="rl.group_size=1: expected an integer >= 2"):
        config_check.validate(c)
    c = shipped_config("tiny")  # stage all, a warm start: the stopping rule applies
    c.train.warm_start_stop.level = 0.3
    config_check.validate(c)
    c.train.warm_start_stop.every = c.train.warm_start_steps  # never asked before the cap
    with pytest.raises(UserError, match=r"warm_start_stop.every=1000: expected an integer < "):
        config_check.validate(c)
    c.train.warm_start_stop.every = 50
    c.train.warm_start_stop.split = "rl"  # unseen names: the synthetic third split
    config_check.validate(c)
    c.env.synthetic.num_rl, c.rl.prompt_split = 0, "train"  # no rl split now
    with pytest.raises(UserError, match=r"warm_start_stop.split='rl': expected 'train' unless"):
        config_check.validate(c)
    c.train.warm_start_stop.split = "test"  # the held-out split is never measured
    with pytest.raises(UserError, match=r"warm_start_stop.split='test': expected one of"):
        config_check.validate(c)
    c.train.warm_start_stop.split = "train"
    c.stage = "sft"  # a stage without a warm start
    with pytest.raises(UserError, match=r"warm_start_stop.level=0.3: expected 0 unless stage all"):
        config_check.validate(c)
    c.stage, c.train.warm_start_steps = "all", 0  # nothing for it to stop
    with pytest.raises(UserError, match=r"warm_start_stop.level=0.3: expected 0 unless stage all"):
        config_check.validate(c)
    c = shipped_config("tiny")  # RCTP's rule (the tokens learnt): stage all, below RCTP's cap
    c.rctp.stop.level, c.rctp.stop.split = 0.2, "rl"
    config_check.validate(c)
    c.rctp.stop.every = c.rctp.train_steps
    with pytest.raises(UserError, match=r"rctp.stop.every=300: expected an integer < RCTP's st"):
        config_check.validate(c)
    c.rctp.stop.every, c.rctp.train_steps = 50, 0  # RCTP then takes train.steps (200)
    config_check.validate(c)
    c.train.steps = 50
    with pytest.raises(UserError, match=r"rctp.stop.every=50: expected an integer < RCTP's steps"):
        config_check.validate(c)
    c.train.steps, c.env.synthetic.num_rl, c.rl.prompt_split = 200, 0, "train"
    with pytest.raises(UserError, match=r"rctp.stop.split='rl': expected 'train' unless"):
        config_check.validate(c)
    c.rctp.stop.split, c.stage = "train", "rctp"  # stage rctp alone: the rule is stage all's
    with pytest.raises(UserError, match=r"rctp.stop.level=0.2: expected 0 unless stage is all"):
        config_check.validate(c)


@pytest.mark.parametrize("family,bias", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_family_qkv_bias_mismatch_is_caught_before_training(family, bias, tmp_path):
    """What HF export refuses (`families.qkv_bias_mismatch`), said at config check instead."""
    from rcgrpo_jax import models
    from rcgrpo_jax.models.hf_io import config_to_hf

    c = shipped_config("tiny")
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
    c = shipped_config("tiny")
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


def _parsed(override: str, workdir):
    """The config the CLI builds from `--config=configs/tiny.py --config.<override>` (absl's
    parser, as `main.parse_flags` runs it, on fresh flag values)."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["main", f"--config={REPO / 'configs' / 'tiny.py'}", f"--config.workdir={workdir}",
            f"--config.{override}"]  # fmt: skip
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


@pytest.mark.parametrize("override,key", BAD, ids=[k for _, k in BAD])
def test_bad_value_is_one_line_naming_the_key(override, key, tmp_path):
    with pytest.raises(UserError) as e:
        config_check.validate(_parsed(override, tmp_path / "run"))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"config.{key}=") and "expected" in line


# A child process's `sitecustomize`: when the program calls sys.exit (absl's app.run does), it
# writes whether a JAX backend was started (before JAX's own exit handler clears them).
_BACKEND_PROBE = """
import os, sys

_exit = sys.exit

def _exit_reporting(*args):
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = bridge is not None and bridge.backends_are_initialized()
    with open(os.environ["RCGRPO_BACKEND_PROBE"], "w") as f:
        f.write("started" if started else "none")
    _exit(*args)

sys.exit = _exit_reporting
"""


@pytest.mark.parametrize("override,key", [BAD[0], BAD[3]], ids=[BAD[0][1], BAD[3][1]])
def test_bad_value_exits_2_in_one_line_before_any_work(override, key, tmp_path):
    """Through the CLI: exit code 2, the one line on stderr, nothing written, and no JAX
    backend started (validation runs before any device work; the in-process test above checks
    every rule's line)."""
    workdir = tmp_path / "run"
    (tmp_path / "sitecustomize.py").write_text(_BACKEND_PROBE)
    probe = tmp_path / "backend"
    env = dict(
        os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", RCGRPO_BACKEND_PROBE=str(probe)
    )
    out = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.main", "--config=configs/tiny.py",
         f"--config.workdir={workdir}", f"--config.{override}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: config.{key}="), out.stderr
    assert "expected" in lines[0]
    assert not workdir.exists()  # nothing written, no stage started
    assert out.stdout == ""
    assert probe.read_text() == "none"  # no backend: no device was touched, nothing compiled
