"""The package stays ruff-clean, never calls eval/exec (model text must not reach them), and its
`--help` texts print the usage lines as written."""

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


def test_no_backslash_line_joins():
    """A line ending in one backslash inside a docstring joins the next line onto it, so a
    tool's `--help` prints its usage as one line with a run of spaces; the shell continuation
    a usage line shows is written as two backslashes. (Code never needs the join either.)"""
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for root in ("rcgrpo_jax", "bench", "configs", "launch")
        for p in (REPO / root).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.endswith("\\") and not line.endswith("\\\\")
    ]
    assert not hits, hits
