"""The huge-page malloc start-up setting: when it applies, and that a re-exec really sets it."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

from rcgrpo_jax import host_memory


def test_wanted_respects_opt_out_and_an_existing_setting():
    assert not host_memory.wanted({host_memory.OPT_OUT: "0"})
    assert not host_memory.wanted({"GLIBC_TUNABLES": f"glibc.malloc.check=0:{host_memory.TUNABLE}"})


def test_tunable_env_keeps_other_tunables():
    env = host_memory.tunable_env({"GLIBC_TUNABLES": "glibc.malloc.check=0", "X": "1"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.check=0:{host_memory.TUNABLE}"
    assert env["X"] == "1" and env[host_memory.OPT_OUT] == "0"
    assert host_memory.tunable_env({})["GLIBC_TUNABLES"] == host_memory.TUNABLE


def test_reexec_runs_the_program_again_with_the_tunable():
    """A child calls `reexec` and prints its environment: re-executed exactly once where the
    setting applies (Linux, glibc, THP available), untouched elsewhere."""
    code = (
        "import os, sys\n"
        "from rcgrpo_jax import host_memory\n"
        "print('start', flush=True)\n"
        "host_memory.reexec([sys.executable, '-c', sys.argv[1], sys.argv[1]])\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES', ''))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.OPT_OUT)}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", code, code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    applies = host_memory.wanted(env)
    assert out.count("start") == (2 if applies else 1)
    assert out[-2] == ("tunables " + (host_memory.TUNABLE if applies else ""))
