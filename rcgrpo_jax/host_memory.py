"""glibc malloc settings for XLA:CPU's host buffers (Linux, glibc): a start-up setting.

XLA:CPU allocates an execution's temporaries afresh on every call (one ~470 MB block for
bench/suite.py's train step; many 16-64 MB blocks for the multi-turn RL update). Under glibc's
defaults each such block is a new mapping: a block above the mmap threshold (at most 32 MiB) is
`mmap`ed and `munmap`ed per call, and a worker thread's arena frees each extra 64 MiB heap as soon
as it empties. The kernel faults every one back in and zeroes it on the next call: 3.2M page
faults and a third of the multi-turn update's time in the kernel (docs/benchmarks.md, "Host
memory").

`TUNABLES` keeps those blocks in the process instead: one arena (`arena_max=1`, so no thread heap
is created and deleted), no direct `mmap` (`mmap_max=0`) and no trimming (`trim_threshold`
64 GiB), so a freed block is reused by the next call without a fault; `hugetlb=1` advises the heap
onto 2 MiB transparent huge pages (kernel THP mode "madvise"), which it is faulted into once.
The price: the process keeps its peak host memory until it exits, and malloc has one lock.

glibc reads tunables only when a process starts, so entry points (`rcgrpo_jax.main`, the
benchmarks) call `reexec` first: the process replaces itself, once, with the tunables added.
`RCGRPO_HOST_MALLOC=0` keeps a process as it was started. PyTorch's CPU tensors come from the same
malloc, so a benchmark that runs both in one process gives both the setting.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence

TUNABLES = ":".join(
    (
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.arena_max=1",
        "glibc.malloc.mmap_max=0",
        f"glibc.malloc.trim_threshold={64 << 30}",
    )
)
OPT_OUT = "RCGRPO_HOST_MALLOC"


def wanted(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Whether re-executing with the tunables would change anything here."""
    if environ.get(OPT_OUT, "1") == "0" or TUNABLES in environ.get("GLIBC_TUNABLES", ""):
        return False
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def tunable_env(environ: os._Environ | dict[str, str] = os.environ) -> dict[str, str]:
    """`environ` with the tunables put before any in GLIBC_TUNABLES: glibc takes the last value of
    a tunable named twice, so a user's own setting wins."""
    env = dict(environ)
    current = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{TUNABLES}:{current}" if current else TUNABLES
    env[OPT_OUT] = "0"  # the new process never re-executes again
    return env


def reexec(argv: Sequence[str]) -> None:
    """Replaces this process with `argv` run under the tunables, when `wanted`; else returns.

    Call before any work (the process starts over). `argv[0]` is the program to run, usually
    `sys.executable`.
    """
    if not wanted():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), tunable_env())
