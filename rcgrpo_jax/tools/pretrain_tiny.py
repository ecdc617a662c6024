"""Builds a tiny instruct base, a pretrained start for the embedded demo (which does not use one:
it starts from a random init and a 1000-step warm start, `configs/tiny.py`).

    python -m rcgrpo_jax.tools.pretrain_tiny [--workdir=/tmp/pretrain_tiny] [--config.seed=N ...]

Why a base: every demo task needs a name copied from the context, and a model trained from
scratch learns that copy as a jump after a plateau whose length depends on the seed and on the
CPU's float rounding. The paper's arms start from a pretrained instruct model; a base made once
by this command and committed would let the demo's path skip the plateau. The demo's own warm
start crosses it within its 1000 steps on the seeds measured (docs/experiments/tiny_default.md).

What it does (deterministic for a given machine; its rounding decides when the copy forms):
1. trains the SentencePiece tokenizer on the pretraining corpus alone, so that every piece is
   one the model has seen: the demo's text is then spelled with known pieces (a piece the model
   never saw sits ~30 nats down, and fine-tuning on one wrecked the base's copying; measured,
   docs/experiments/tiny_default.md);
2. runs stage `sft` of `configs/tiny_pretrain.py` from the random init on the pretraining chores
   (`synthetic.PRETRAIN_TEMPLATES`), which never call the demo's functions (mv, cp, wc);
3. measures held-out success on the pretraining chores and on the demo family it is made for
   (`synthetic.BASE_DEMO_TEMPLATES`), and refuses to write a base that has not learned its
   chores (`--min_success`) or that already solves the demo (`--max_demo_success`);
4. writes the export (config, safetensors, tokenizer) to `--out` with `PROVENANCE.json`: the
   command, the measured numbers and every file's SHA-256, which `tests/test_tiny_base.py` checks.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from rcgrpo_jax import assets, config_check, logs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file of the base except the provenance record itself."""
    return {
        p.name: sha256(p)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != assets.PROVENANCE
    }


def demo_success(config, export: Path) -> float:
    """Held-out success of the export on the test tasks of `synthetic.BASE_DEMO_TEMPLATES`
    (what a demo from this base would call `base`)."""
    import ml_collections

    from rcgrpo_jax.envs import synthetic
    from rcgrpo_jax.stages import setup
    from rcgrpo_jax.stages.eval import measure_success

    demo = ml_collections.ConfigDict(config.to_dict())
    demo.env.synthetic.difficulty.templates = synthetic.BASE_DEMO_TEMPLATES
    demo.model.hf_path, demo.tokenizer_path = str(export), ""
    mesh = setup.mesh_from_config(demo)
    tokenizer = setup.tokenizer_from_config(demo)
    model = setup.model_from_config(demo, mesh)
    entries = setup.task_entries(demo, "test")[: int(demo.rctp.eval_entries) or None]
    return measure_success(demo, model, tokenizer, mesh, entries, None).rate


def main(argv: list[str]) -> int:
    del argv
    logs.configure(verbose=flags.FLAGS["verbosity"].present)
    from rcgrpo_jax.envs import tiny_tokenizer
    from rcgrpo_jax.errors import UserError
    from rcgrpo_jax.stages import setup, sft

    config = _CONFIG.value
    workdir, out = Path(_WORKDIR.value), Path(_OUT.value)
    t0 = time.time()
    try:
        config_check.validate(config)
        if config.stage != "sft" or config.model.hf_path:
            raise UserError("the pretraining config must be stage 'sft' from the random init")
        tasks = setup.task_entries(config, "train")
        vocab = int(config.model.arch.vocab_size)
        tokenizer = tiny_tokenizer.load_or_train(workdir, tasks, vocab_size=vocab)
        print(f"tokenizer: {len(tokenizer)} pieces, {workdir / tiny_tokenizer.SUBDIR}", flush=True)
        config.tokenizer_path = str(workdir / tiny_tokenizer.SUBDIR)
        config.workdir = str(workdir / "sft")
        summary = sft.run(config)
        export = Path(summary["export"])
        chores = float(summary["heldout_success"]["none"])
        on_demo = demo_success(config, export)
        print(f"base: {on_demo:.1%} held-out success on the demo's tasks", flush=True)
        if chores < _MIN.value or on_demo >= _MAX_DEMO.value:
            raise UserError(
                f"not written: chores {chores:.1%} (need >= {_MIN.value:.0%}), demo "
                f"{on_demo:.1%} (need < {_MAX_DEMO.value:.0%}); try another --config.seed or "
                f"more --config.train.steps"
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    record = {
        "command": "python -m rcgrpo_jax.tools.pretrain_tiny " + " ".join(sys.argv[1:]),
        "seed": int(config.seed),
        "steps": int(config.train.steps),
        "templates": list(config.env.synthetic.difficulty.templates),
        "num_train": int(config.env.synthetic.num_train),
        "heldout_success_chores": chores,
        "heldout_success_demo": on_demo,
        "final_loss": summary["final_loss"],
        "wall_s": round(time.time() - t0, 1),
        "files": file_hashes(out),
    }
    (out / assets.PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB)")
    return 0


def _define_flags() -> None:
    """Flags are defined only when run as a command (the module is also imported by tests)."""
    global _CONFIG, _WORKDIR, _OUT, _MIN, _MAX_DEMO
    _CONFIG = config_flags.DEFINE_config_file(
        "config", "configs/tiny_pretrain.py", "Pretraining config (stage sft)."
    )
    _WORKDIR = flags.DEFINE_string("workdir", "/tmp/pretrain_tiny", "Scratch directory.")
    _OUT = flags.DEFINE_string("out", str(assets.TINY_INSTRUCT), "Where the base is written.")
    _MIN = flags.DEFINE_float("min_success", 0.6, "Held-out success on the chores required.")
    _MAX_DEMO = flags.DEFINE_float("max_demo_success", 0.2, "Demo success to stay below.")


if __name__ == "__main__":
    _define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
