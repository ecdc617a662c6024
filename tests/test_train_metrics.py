"""Metrics writer (jsonl + TensorBoard + progress bar), PNG plots, and the FLOP/MFU estimate."""

from __future__ import annotations

import json
import math

import pytest

from rcgrpo_jax import models
from rcgrpo_jax.models import flops
from rcgrpo_jax.train import metrics, plots


def test_writer_outputs_and_plot(tmp_path):
    runs = {}
    for arm, slope in [("rcgrpo", 0.1), ("grpo", 0.05)]:
        wd = tmp_path / arm
        with metrics.MetricsWriter(wd, total_steps=5, bar_keys=("loss",)) as w:
            for step in range(1, 6):
                rec = w.write(step, {"loss": 1.0 / step, "reward": slope * step, "nan": math.nan})
        assert rec["nan"] is None
        lines = (wd / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5]
        assert json.loads(lines[-1])["reward"] == pytest.approx(slope * 5)
        events = list((wd / "tb").glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0
        runs[arm] = wd / "metrics.jsonl"
    png = plots.plot_metrics(runs, ["reward", "loss", "absent"], tmp_path / "plots" / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_writer_disabled_on_other_processes(tmp_path):
    w = metrics.MetricsWriter(tmp_path / "p1", enabled=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "p1").exists()


def test_flops_and_mfu():
    cfg = models.ModelConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
    )
    # matmul weights: per layer q, o (16 x 4 heads x 4), k, v (16 x 2 x 4), gate, up, down
    # (16 x 32); then the LM head, tied or not. The embedding lookup (a gather), the norms'
    # scales and any bias are no matmul.
    n_matmul = 2 * (2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 32) + 16 * 100
    norms = (2 * 2 + 1) * 16
    assert n_matmul == cfg.num_params() - 100 * 16 - norms
    assert flops.flops_per_token(cfg, 8) == 6 * n_matmul + 12 * 2 * 4 * 4 * 8
    tied = cfg.replace(tie_embeddings=True)
    assert flops.flops_per_token(tied, 8) == 6 * n_matmul + 12 * 2 * 4 * 4 * 8
    assert flops.flops_per_token(cfg, 8, training=False) == 2 * n_matmul + 4 * 2 * 4 * 4 * 8
    assert metrics.mfu(1000.0, 1e6, 1e10) == pytest.approx(0.1)


def test_event_file_does_not_import_torch(tmp_path):
    """A stage's TensorBoard events leave torch unimported (tensorboardX's package would import
    it, ~2.5 s a process wherever torch is installed), the events are written, and torch still
    imports afterwards."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    code = "\n".join([
        "import sys", "from pathlib import Path", "from rcgrpo_jax.train.metrics import EventFile",
        f"events = EventFile(Path({str(tmp_path)!r}) / 'tb')",
        "events.scalars(1, {'loss': 0.5})", "events.close()",
        "assert 'torch' not in sys.modules, 'torch imported'", "import torch", "print('ok')",
    ])  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert any((tmp_path / "tb").glob("events*"))
