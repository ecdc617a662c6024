"""`tools.compare_runs`: two runs agree when only timings and their workdir differ, and any
other change is named."""

import json
from pathlib import Path

from rcgrpo_jax.tools import compare_runs


def _run(root: Path, *, loss: float = 0.5, wall: float = 1.0, weights: bytes = b"w") -> Path:
    (root / "arm" / "export").mkdir(parents=True)
    (root / "arm" / "checkpoints").mkdir()
    (root / "arm" / "checkpoints" / "state").write_bytes(str(wall).encode())
    rows = [{"step": 1, "time": wall, "loss": loss, "rollout_s": wall, "tokens_per_s": 1 / wall}]
    (root / "arm" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"export": str(root / "arm" / "export"), "time": {"wall_s": wall}, "final": rows[0]}
    (root / "arm" / "summary.json").write_text(json.dumps(summary))
    (root / "arm" / "export" / "model.safetensors").write_bytes(weights)
    (root / "table.txt").write_text(f"arm: held-out 50.0%; {wall} s, compile {wall} s\n")
    return root


def test_timings_and_workdir_do_not_count(tmp_path):
    a = _run(tmp_path / "a", wall=1.0)
    b = _run(tmp_path / "runs" / "b", wall=7.5)
    assert compare_runs.differences(a, b) == []
    assert compare_runs.main([str(a), str(b)]) == 0
    # a run given a relative workdir names its paths relative to where it ran
    summary = b / "arm" / "summary.json"
    summary.write_text(summary.read_text().replace(str(tmp_path) + "/", ""))
    assert "runs/b/arm/export" in summary.read_text()
    assert compare_runs.differences(a, b) == []


def test_a_changed_result_or_file_is_named(tmp_path, capsys):
    a = _run(tmp_path / "a")
    assert compare_runs.differences(a, _run(tmp_path / "b", loss=0.25)) == [
        "differs: arm/metrics.jsonl",
        "differs: arm/summary.json",
    ]
    assert compare_runs.differences(a, _run(tmp_path / "c", weights=b"v")) == [
        "differs: arm/export/model.safetensors"
    ]
    d = _run(tmp_path / "d")
    (d / "arm" / "rollouts.jsonl").write_text("{}\n")
    assert compare_runs.differences(a, d) == [f"only in {d}: arm/rollouts.jsonl"]
    assert compare_runs.main([str(a), str(d)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "4 of 5 files the same"
    assert compare_runs.main([str(a), str(tmp_path / "missing")]) == 2
