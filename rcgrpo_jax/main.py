"""Command line: `python -m rcgrpo_jax.main --config=configs/tiny.py [--config.key=value ...]`.

The whole config is validated before any work (`config_check`); library logs stay silent unless
`--verbosity=N` is given (`logs`).
"""

from __future__ import annotations

import errno
import importlib
import re
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from rcgrpo_jax import config_check, logs
from rcgrpo_jax.config import STAGES
from rcgrpo_jax.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Experiment config file.")

# stage -> the module whose `run(config) -> dict` runs it
_STAGE_RUNNERS = {
    "eval": "rcgrpo_jax.stages.eval",
    "sft": "rcgrpo_jax.stages.sft",
    "rctp": "rcgrpo_jax.stages.sft",
    "grpo": "rcgrpo_jax.stages.rl",
    "rcgrpo": "rcgrpo_jax.stages.rl",
    "all": "rcgrpo_jax.stages.all",
}


def _runner(stage: str):
    if stage not in _STAGE_RUNNERS:
        raise UserError(f"config.stage={stage!r}; expected one of {', '.join(STAGES)}")
    return importlib.import_module(_STAGE_RUNNERS[stage]).run


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, but a bad config file or override is one line, not a traceback."""
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.get("stage")  # surfaces a config file that failed to load
        return rest
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:
        name = flags.FLAGS["config"].config_filename
        print(f"error: cannot load config file {name!r} ({type(e).__name__})", file=sys.stderr)
    except (KeyError, AttributeError) as e:
        msg = str(e.args[0] if e.args else e)
        key = re.match(r"\W*(\w+)", msg).group(1)
        bad = [a for a in argv if a.startswith("--config.") and f".{key}" in a.split("=")[0]]
        print(
            f"error: unknown config key {key!r} in {' '.join(bad) or 'overrides'}", file=sys.stderr
        )
    sys.exit(2)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logs.configure(verbose=flags.FLAGS["verbosity"].present)
    config = _CONFIG.value
    if not config.workdir:
        config.workdir = str(Path("runs") / Path(flags.FLAGS["config"].config_filename).stem)
    try:
        config_check.validate(config)
        if config.model.hf_path and not Path(config.model.hf_path).is_dir():
            raise UserError(f"config.model.hf_path={config.model.hf_path!r} is not a directory")
        run = _runner(config.stage)
        from rcgrpo_jax import compilation
        from rcgrpo_jax.distributed import is_main_process, maybe_initialize

        compilation.configure_from(config)

        maybe_initialize()  # multi-host TPU slices; a no-op for a single process
        from rcgrpo_jax import planning

        if planning.is_auto(config.mesh.shape):
            line = planning.resolve_auto(config)
            if is_main_process():
                print(line, flush=True)
        run(config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # e.g. `pip install -e .` alone: bfcl-eval goes in --no-deps
        if e.name and not e.name.startswith("rcgrpo_jax"):
            print(
                f"error: package {e.name!r} is missing: run `bash launch/install.sh`",
                file=sys.stderr,
            )
            return 2
        raise
    except OSError as e:  # a full disk wherever a stage writes: one line naming the path
        if e.errno != errno.ENOSPC:
            raise
        print(
            f"error: no space left on device writing {e.filename or config.workdir}",
            file=sys.stderr,
        )
        return 2
    except Exception as e:  # one clear line for checkpoint problems, tracebacks for bugs
        from rcgrpo_jax.models import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    from rcgrpo_jax import host_memory

    host_memory.reexec([sys.executable, "-m", "rcgrpo_jax.main", *sys.argv[1:]])
    app.run(main, flags_parser=parse_flags)
