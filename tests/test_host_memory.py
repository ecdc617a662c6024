"""The malloc start-up setting: when it applies, that a re-exec really sets it, and that under it
a freed block is reused without the kernel faulting it in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from rcgrpo_jax import host_memory


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.OPT_OUT)}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_wanted_respects_opt_out_and_an_existing_setting():
    assert not host_memory.wanted({host_memory.OPT_OUT: "0"})
    assert not host_memory.wanted(
        {"GLIBC_TUNABLES": f"glibc.malloc.check=0:{host_memory.TUNABLES}"}
    )


def test_tunable_env_lets_the_users_own_tunables_win():
    env = host_memory.tunable_env({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=9", "X": "1"})
    assert env["GLIBC_TUNABLES"] == f"{host_memory.TUNABLES}:glibc.malloc.mmap_max=9"
    assert env["X"] == "1" and env[host_memory.OPT_OUT] == "0"
    assert host_memory.tunable_env({})["GLIBC_TUNABLES"] == host_memory.TUNABLES


def test_reexec_runs_the_program_again_with_the_tunables():
    """A child calls `reexec` and prints its environment: re-executed exactly once where the
    setting applies (Linux, glibc), untouched elsewhere."""
    code = (
        "import os, sys\n"
        "from rcgrpo_jax import host_memory\n"
        "print('start', flush=True)\n"
        "host_memory.reexec([sys.executable, '-c', sys.argv[1], sys.argv[1]])\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES', ''))\n"
    )
    env = _clean_env()
    out = subprocess.run(
        [sys.executable, "-c", code, code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    applies = host_memory.wanted(env)
    assert out.count("start") == (2 if applies else 1)
    assert out[-2] == ("tunables " + (host_memory.TUNABLES if applies else ""))


# A worker thread (its own arena under glibc's defaults) mallocs and fills two 40 MiB blocks, frees
# them, and does it again; prints the page faults the second round took. THP is off for the child
# (PR_SET_THP_DISABLE), so every fault is one 4 KiB page whatever the kernel's THP mode.
_REFAULT = """
import ctypes, resource, threading
libc = ctypes.CDLL("libc.so.6")
libc.prctl(41, 1, 0, 0, 0)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 40 << 20
def round_():
    blocks = [libc.malloc(size) for _ in range(2)]
    for p in blocks:
        ctypes.memset(p, 1, size)
    for p in blocks:
        libc.free(p)
def work(out):
    round_()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    round_()
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
out = []
t = threading.Thread(target=work, args=(out,))
t.start(); t.join()
print(out[0])
"""


@pytest.mark.skipif(not host_memory.wanted(_clean_env()), reason="needs Linux with glibc")
def test_under_the_tunables_a_freed_block_is_reused_without_faults():
    """The property the setting is for. Under glibc's defaults both blocks go back to the kernel
    (`munmap`) and all 20k pages fault in again; with `mmap_max=0` alone the second block's thread
    heap is still deleted (10k faults); under all of `TUNABLES` the second round reuses them."""

    def faults(env: dict[str, str]) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _REFAULT], env=env, capture_output=True, text=True, check=True
        )
        return int(run.stdout)

    default = faults(_clean_env())
    tuned = faults(host_memory.tunable_env(_clean_env()))
    assert default >= 2 * (40 << 20) // 4096, default
    assert tuned < 100, tuned
