"""`tools/pretrain_tiny` end to end at a few steps, and the task family it is designed for.

The tool writes a base (HF export + tokenizer) with a PROVENANCE.json recording every file's
SHA-256; a changed or truncated file must no longer match.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO

from rcgrpo_jax import assets, models
from rcgrpo_jax.envs import prompts, synthetic
from rcgrpo_jax.tools import pretrain_tiny


def test_pretrain_tool_writes_a_loadable_base_with_its_hashes(tmp_path):
    out = tmp_path / "base"
    args = [
        f"--workdir={tmp_path / 'work'}", f"--out={out}", "--min_success=0",
        "--max_demo_success=1.01", "--config.train.steps=3", "--config.env.synthetic.num_train=24",
        "--config.env.synthetic.num_test=2", "--config.rctp.eval_entries=2",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.tools.pretrain_tiny", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / assets.PROVENANCE).read_text())
    assert record["files"] == pretrain_tiny.file_hashes(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= record["files"].keys()
    assert record["steps"] == 3 and record["templates"] == list(synthetic.PRETRAIN_TEMPLATES)
    assert record["command"].startswith("python -m rcgrpo_jax.tools.pretrain_tiny")
    cfg, params = models.load_hf(out)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    for token in prompts.REWARD_TOKENS.values():  # single ids: RCTP adds nothing
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    ids = tokenizer.encode("[ls()]", add_special_tokens=False)
    logits = np.asarray(models.forward(cfg, params, np.asarray([ids])))
    assert logits.shape == (1, len(ids), cfg.vocab_size) and np.isfinite(logits).all()
    with open(out / "model.safetensors", "r+b") as f:  # one flipped byte: the hashes disagree
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert record["files"] != pretrain_tiny.file_hashes(out)


def _acts(templates) -> set[tuple[str, str]]:
    """(function, what its folder argument is) of every call: a listed folder by its position
    in the top's `ls`, another name ("other"), or none ("-")."""
    out = set()
    for task in synthetic.make_tasks("train", 20, turns=(1, 1), templates=templates):
        listed = list(task.initial_config["GorillaFileSystem"]["root"].values())[0]["contents"]
        folders = [n for n, item in listed.items() if item["type"] == "directory"]
        for call in (c for turn in task.ground_truth for c in turn):
            fn = call.split("(")[0]
            arg = next((a for a in ("destination='", "folder='") if a in call), None)
            dest = call.split(arg)[1].split("'")[0] if arg else None
            kind = "-" if dest is None else "other"
            out.add((fn, f"folder {folders.index(dest)}" if dest in folders else kind))
    return out


def test_the_demo_family_combines_what_pretraining_teaches_separately():
    """A base starts that family low: no act of it (function and destination) is a chore's,
    though every function and every destination kind it needs is."""
    demo = _acts(synthetic.BASE_DEMO_TEMPLATES) - {("ls", "-")}
    pre = _acts(synthetic.PRETRAIN_TEMPLATES)
    assert demo and not demo & pre
    assert {fn for fn, _ in demo} <= {fn for fn, _ in pre}
    assert {d for _, d in demo} <= {d for _, d in pre}
