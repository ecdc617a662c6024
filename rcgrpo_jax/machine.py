"""The machine a run's figures came from, recorded next to them.

The same seed gives different figures under a different vector ISA (XLA picks other kernels),
another core count (the threads split reductions differently) or other `XLA_FLAGS`, so a
summary without these cannot be compared with another one: `describe()` is written into every
stage's `summary.json`, and `one_line()` ends the experiment's table.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# Vector extensions that decide which dot kernels XLA:CPU and PyTorch use.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under `taskset`): XLA:CPU sizes
    its thread pool by them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu(cpuinfo: str | None = None) -> dict[str, Any]:
    """{name, family, model, isa} from `/proc/cpuinfo` (or the text given). Family and model
    matter: "AMD EPYC" names both Zen 4 (AVX-512 on 256-bit units) and full-width parts, ~2x
    apart in f32 peak. Elsewhere than Linux: the platform's processor name, family/model None."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    info: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    number = lambda key: int(info[key]) if info.get(key, "").isdigit() else None
    return {
        "name": info.get("model name") or platform.processor() or platform.machine(),
        "family": number("cpu family"),
        "model": number("model"),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def describe() -> dict[str, Any]:
    """The CPU, the cores this process may use, `XLA_FLAGS`, jax/jaxlib versions and the
    devices the run used."""
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "cpu": cpu(),
        "cores": usable_cores(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
    }


def cpu_line(c: dict[str, Any]) -> str:
    """'AMD EPYC (family 25 model 17; avx2 avx512f)'."""
    isa = " ".join(c.get("isa") or ()) or "no avx2"
    return f"{c.get('name')} (family {c.get('family')} model {c.get('model')}; {isa})"


def one_line(m: dict[str, Any] | None) -> str:
    """A `describe()` record as one line; None (a summary written before it was recorded):
    'not recorded'."""
    if not m:
        return "not recorded"
    devices = ""
    if m.get("platform") != "cpu":
        devices = f"{m.get('devices')} × {m.get('device_kind')}, host "
    elif m.get("devices", 1) > 1:
        devices = f"{m.get('devices')} host devices, "
    flags = f"XLA_FLAGS={m['xla_flags']}" if m.get("xla_flags") else "XLA_FLAGS unset"
    procs = f", {m['processes']} processes" if m.get("processes", 1) > 1 else ""
    return (
        f"{devices}{cpu_line(m.get('cpu') or {})}, {m.get('cores')} cores{procs}, {flags}, "
        f"jax {m.get('jax')}"
    )
