"""Files shipped with the package: the tiny instruct base (none is committed yet)."""

from pathlib import Path

# Written by `python -m rcgrpo_jax.tools.pretrain_tiny`; its PROVENANCE.json says how.
TINY_INSTRUCT = Path(__file__).resolve().parent / "tiny_instruct"
PROVENANCE = "PROVENANCE.json"
