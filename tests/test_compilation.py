"""The persistent compilation cache (`rcgrpo_jax.compilation`): where it lives, that a second
compile of the same program is read from it, that it can be turned off, and one line for a
directory that cannot hold it; and the compile-time counts that stages and metrics report."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from rcgrpo_jax import compilation
from rcgrpo_jax.errors import UserError


@pytest.fixture
def restore_cache():
    """Puts the session's cache (conftest's) back after a test that moved it."""
    yield
    compilation.configure(True, os.environ["JAX_COMPILATION_CACHE_DIR"])


def test_default_dir_is_jax_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compilation.default_cache_dir() == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation.default_cache_dir() == tmp_path / "xdg" / "rcgrpo_jax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation.default_cache_dir() == tmp_path / "home" / ".cache" / "rcgrpo_jax" / "xla"


def test_a_second_compile_is_read_from_the_cache_and_off_means_off(tmp_path, restore_cache):
    f = lambda x: jnp.sin(x) * 3.0 + 1.0  # noqa: E731 (a fresh function object per jit)
    x = jnp.arange(7.0)
    assert compilation.configure(True, str(tmp_path / "xla")) == tmp_path / "xla"
    before = compilation.stats()
    jax.jit(lambda x: f(x)).lower(x).compile()
    first = compilation.stats() - before
    assert first.programs == 1 and first.cache_hits == 0 and first.seconds > 0
    assert any((tmp_path / "xla").iterdir())  # written, although it compiled in milliseconds
    jax.jit(lambda x: f(x)).lower(x).compile()  # a new jit: JAX's in-memory cache misses
    assert (compilation.stats() - before).cache_hits == 1
    assert compilation.configure(False) is None
    jax.jit(lambda x: f(x)).lower(x).compile()
    assert (compilation.stats() - before).cache_hits == 1  # off: compiled, not read


def test_a_directory_that_cannot_hold_the_cache_is_one_line(tmp_path, restore_cache):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="compile.cache_dir: cannot use .*compile.cache=False"):
        compilation.configure(True, str(blocker / "xla"))


def test_span_counts_what_its_stage_compiled():
    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    span = compilation.Span()
    jax.jit(lambda x: x * 5 - 2).lower(x).compile()
    got = span.summary()
    assert got["programs"] == 1 and got["compile_s"] > 0 and got["wall_s"] >= got["compile_s"]
    assert "compile" in span.describe() and "1 programs" in span.describe()


def test_the_random_init_is_one_program_per_model_and_mesh():
    """Every stage that starts from the random init calls `init_params`: the second call with the
    same config and mesh reuses the first one's program (no new trace, no cache read), and gives
    the same params; another mesh is another program."""
    from rcgrpo_jax import models

    cfg = models.ModelConfig(  # a shape no other test builds, so the count starts here
        vocab_size=72, hidden_size=24, intermediate_size=40, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=12,
    )  # fmt: skip
    key = jax.random.key(1)
    before = compilation.programs("jit(init)")  # JAX's own compile events, by function name
    a, b = models.init_params(cfg, key), models.init_params(cfg, key)
    assert compilation.programs("jit(init)") - before == 1
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), a, b)))
    models.init_params(cfg, key, models.make_mesh((1, 1, 1), jax.devices()[:1]))
    assert compilation.programs("jit(init)") - before == 2


def test_stages_whose_optimizers_differ_in_rates_share_the_state_init():
    """Stage 1 and RL build their optimizers from different rates and step counts; the fresh
    state's init program depends only on `OptimConfig.init_key()` (clipping on or off), so they
    share it, and the state it makes is the one the stage's own optimizer would make."""
    from rcgrpo_jax import models
    from rcgrpo_jax.train.optim import OptimConfig, make_optimizer
    from rcgrpo_jax.train.state import init_train_state

    cfg = models.ModelConfig(
        vocab_size=80, hidden_size=24, intermediate_size=40, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=12,
    )  # fmt: skip
    mesh = models.make_mesh((1, 1, 1), jax.devices()[:1])
    psh = models.param_shardings(cfg, mesh)
    params = jax.device_put(models.init_params(cfg, jax.random.key(0)), psh)
    configs = (OptimConfig(lr=1e-2, total_steps=1000), OptimConfig(lr=1e-3, total_steps=16))
    before = compilation.programs("jit(init)")
    for optim in configs:
        opt = make_optimizer(optim)
        key = optim.init_key()
        state = init_train_state(params, opt, 3, mesh=mesh, param_shardings=psh, key=key)
        want = opt.init(params)
        assert jax.tree.structure(state.opt_state) == jax.tree.structure(want)
        same = jax.tree.map(lambda x, y: bool((x == y).all()), state.opt_state, want)
        assert all(jax.tree.leaves(same))
    assert compilation.programs("jit(init)") - before == 1
    assert OptimConfig(clip_norm=0).init_key() != configs[0].init_key()
