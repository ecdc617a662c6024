"""Large host buffers on transparent huge pages (Linux, glibc): a start-up setting.

XLA:CPU allocates an execution's temporaries afresh on every call (one ~470 MB block for
bench/suite.py's train step), and glibc serves every block above 32 MB with a new `mmap` that the
kernel then faults in 4 KiB at a time: 127k page faults and 0.40 s of kernel time per step there.
glibc's `glibc.malloc.hugetlb=1` tunable makes malloc advise such mappings onto 2 MiB transparent
huge pages (kernel THP mode "madvise", the usual default): ~700 faults and 0.09 s per step in the
same measurement. PyTorch's CPU tensors come from the same malloc, so a benchmark that runs both
in one process gives both the setting.

glibc reads tunables only when a process starts, so entry points (`rcgrpo_jax.main`, the
benchmarks) call `reexec` first: the process replaces itself, once, with the tunable added.
`RCGRPO_HUGEPAGES=0` keeps a process as it was started.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "RCGRPO_HUGEPAGES"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "" where there is none."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def wanted(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Whether re-executing with the tunable would change anything here."""
    if environ.get(OPT_OUT, "1") == "0" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return False
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    return _thp_mode() in ("always", "madvise")


def tunable_env(environ: os._Environ | dict[str, str] = os.environ) -> dict[str, str]:
    """`environ` with the tunable appended to GLIBC_TUNABLES (colon-separated, kept as given)."""
    env = dict(environ)
    current = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    env[OPT_OUT] = "0"  # the new process never re-executes again
    return env


def reexec(argv: Sequence[str]) -> None:
    """Replaces this process with `argv` run under the tunable, when `wanted`; else returns.

    Call before any work (the process starts over). `argv[0]` is the program to run, usually
    `sys.executable`.
    """
    if not wanted():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), tunable_env())
