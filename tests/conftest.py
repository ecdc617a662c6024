"""Shared test set-up: 8 virtual CPU devices, tiny random HF models, real tokenizers if present."""

from __future__ import annotations

import os

# Compile time, not run time, dominates the suite's tiny programs: XLA's backend at -O0 compiles
# them ~2x faster. The unit tests and the short CLI runs use it (every process of a comparison
# compiles with the same flags); the full-length runs (tests/test_bfcl_e2e.py) and CI's fresh-venv
# job compile as a user's run does. RCGRPO_TEST_COMPILE=default runs everything at the default.
XLA_FAST = (
    ""
    if os.environ.get("RCGRPO_TEST_COMPILE") == "default"
    else "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)


def xla_flags(devices: int, fast: bool = True) -> str:
    """XLA_FLAGS for a test process with `devices` CPU devices, and the suite's compile flags
    unless `fast` is False (a user's compile)."""
    return f"--xla_force_host_platform_device_count={devices} {XLA_FAST if fast else ''}".strip()


# Must happen before JAX is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole test session, its child processes included
# (`python -m rcgrpo_jax.main` reads it as its default): every test that compiles a program
# another test compiled reads it from there. Empty at the start of a session, so a run measures
# what a clean clone costs; set JAX_COMPILATION_CACHE_DIR to keep one between sessions.
_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import tempfile

    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="rcgrpo-tests-xla-"
    )
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# bfcl-eval writes result/score folders into site-packages on import unless this is set.
os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(os.environ.get("TMPDIR", "/tmp"), "bfcl"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY_VOCAB = 128


def shipped_config(name: str):
    """`configs/<name>.py`'s `get_config()`, as `--config=configs/<name>.py` builds it."""
    from rcgrpo_jax.config import config_from_file

    return config_from_file(REPO / "configs" / f"{name}.py")


def tiny_model_config(**overrides):
    """The 2-layer, 32-wide decoder the unit tests train and sample (fields overridable)."""
    from rcgrpo_jax import models

    shape = dict(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    return models.ModelConfig(**{**shape, **overrides})


def mask_runs(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of ones in a 0/1 mask (assistant spans of a loss mask)."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def tokenizers_dir() -> Path | None:
    """Real tokenizer fixtures: $RCGRPO_TOKENIZERS, else ../shared/tokenizers next to the repo."""
    env = os.environ.get("RCGRPO_TOKENIZERS")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "tokenizers"]:
        if cand.is_dir():
            return cand
    return None


def on_ci() -> bool:
    """CI=true (or 1), as CI services set it: a missing fixture there is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


@pytest.fixture(scope="session")
def tokenizer_root() -> Path:
    """The real tokenizers' folder. A developer without them skips the tests that need them; CI
    fails those tests instead, so that a run that tested less does not pass as a full one."""
    root = tokenizers_dir()
    if root is None:
        where = f"set RCGRPO_TOKENIZERS or provide {REPO.parent / 'shared' / 'tokenizers'}"
        if on_ci():
            pytest.fail(f"CI=true: real tokenizers not found ({where})", pytrace=False)
        pytest.skip(f"real tokenizers not found ({where})")
    return root


# What each family's tiny test checkpoint sets beyond the shared shape (`make_hf_model`); a
# family without an entry gets its transformers config class's defaults. LLaMA: llama3 rope
# scaling with an original context shorter than the test sequences, so the scaling matters.
# Qwen3: head_dim 16 != hidden / heads (8), as its real checkpoints have (128 != 1024 / 16),
# and weights drawn wider than the 0.02 default, so that greedy generation from the tied model
# does not repeat one token (its head is its embedding).
HF_TEST_CONFIGS = {
    "qwen2": {"rope_theta": 1e6},
    "llama": {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen3": {"rope_theta": 1e6, "head_dim": 16, "initializer_range": 0.1},
}


def hf_model_names() -> list[str]:
    """The `hf_models` names: every family of `models.families`, untied and "<family>_tied"."""
    from rcgrpo_jax.models.families import FAMILIES

    return [n for f in FAMILIES for n in (f, f"{f}_tied")]


def make_hf_model(kind: str, path: Path, *, tied: bool = False, layers: int = 2, seed: int = 0):
    """A tiny random transformers model of family `kind` (a `model_type` of
    `models.families`; GQA 8 heads / 2 KV heads, `HF_TEST_CONFIGS` on top) saved with
    save_pretrained; returns the torch model. Biases and norm scales (q/k norms included) are
    perturbed away from their zero/one init so that mapping errors show in the logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    hf_cfg = AutoConfig.for_model(kind, **common, **HF_TEST_CONFIGS.get(kind, {}))
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{name: (torch_model, dir)} for `hf_model_names()` (e.g. "qwen2", "qwen2_tied"); built
    once."""
    out = {}
    for name in hf_model_names():
        d = tmp_path_factory.mktemp(name)
        out[name] = (make_hf_model(name.removesuffix("_tied"), d, tied=name.endswith("_tied")), d)
    return out


def pytest_sessionfinish(session, exitstatus):
    """Removes the session's own compilation cache (not one the caller named)."""
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
