"""Quiet output by default: our progress bars, one line per stage and the results, nothing else.

Orbax logs hundreds of INFO lines per checkpoint through absl, JAX reports its backend probing,
TFDS prints a banner and progress bars per dataset, transformers warns that PyTorch is absent
and matplotlib logs its font cache. `configure(verbose=False)` silences all of that below
ERROR; errors and tracebacks still print. `--verbosity=N` (absl's flag) on the command line
turns the libraries' logs back on at absl's level N.
"""

from __future__ import annotations

import logging
import os
import warnings

# Loggers of the libraries a run imports; python's logging is hierarchical, so a prefix is enough.
LIBRARY_LOGGERS = (
    "absl", "jax", "jaxlib", "orbax", "tensorflow_datasets", "tensorflow", "matplotlib",
    "transformers", "grain", "etils", "tensorstore", "PIL", "fsspec", "urllib3", "filelock",
)  # fmt: skip

_verbose = False


def verbose() -> bool:
    """Whether library output (logs, TFDS progress bars) is wanted."""
    return _verbose


def configure(verbose: bool) -> None:
    """Sets library log levels for this process; call before the libraries are imported."""
    global _verbose
    _verbose = verbose
    if verbose:
        return
    # Read by the libraries at import time.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TFDS_DISABLE_PROGRESS_BAR", "1")
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
