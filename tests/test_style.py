"""The package stays ruff-clean and never calls eval/exec (model text must not reach them)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from conftest import REPO


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    out = subprocess.run(
        [ruff, "check", "rcgrpo_jax", "tests", "bench", "configs"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_eval_or_exec_in_package():
    pattern = re.compile(r"(^|[^_.a-zA-Z])(eval|exec)\(")
    hits = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in (REPO / "rcgrpo_jax").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
