"""Multi-process start-up: `jax.distributed.initialize()` when, and only when, a run spans hosts.

On a multi-host TPU slice every worker runs the same command; each process must join the
distributed runtime before JAX touches a device, so that `jax.devices()` lists the whole slice.
On a laptop, CI or a single CPU process nothing must happen (initialising would try to reach a
coordinator or the GCE metadata server). `maybe_initialize()` decides from the environment:

- `RCGRPO_DISTRIBUTED=0` / `=1`: force off / on (the launch scripts set 1);
- `JAX_COORDINATOR_ADDRESS` (with `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`): explicit cluster, e.g.
  several local CPU processes;
- `TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES` listing more than one host (GKE TPU pods);
- a TPU device node (`/dev/accel*` or `/dev/vfio/*`) on a Cloud TPU VM: JAX reads the slice's
  workers from the metadata server (on a single-host VM it initialises one process — harmless).

Call it first thing in `main`, before anything that lists devices or compiles. Several CPU
processes (tests, a laptop) reduce across processes through gloo, which is switched on here.

The helpers below are what multi-process stages use, and are no-ops (no collective, no copy) in a
single process: every process runs the same program (SPMD), so host-side control must be
identical everywhere; each process executes the environment for its own contiguous share of the
rows (`process_rows`) and exchanges per-row host results with `allgather_rows`/
`allgather_objects`; `host_array`/`host_tree` read global arrays that are not fully addressable.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclasses.dataclass(frozen=True)
class Decision:
    initialize: bool
    reason: str
    kwargs: dict = dataclasses.field(default_factory=dict)  # for jax.distributed.initialize


def _hosts(env: Mapping[str, str]) -> int:
    names = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    return len([h for h in names.split(",") if h.strip()])


def _tpu_device_present() -> bool:
    return any(glob.glob(p) for p in _TPU_DEVICE_GLOBS)


def decide(
    env: Mapping[str, str] | None = None,
    tpu_device_present: Callable[[], bool] = _tpu_device_present,
) -> Decision:
    """Pure decision (no JAX import): whether and how to call `jax.distributed.initialize`."""
    env = os.environ if env is None else env
    forced = env.get("RCGRPO_DISTRIBUTED", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return Decision(False, "RCGRPO_DISTRIBUTED=0")
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs: dict = {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"]}
        if env.get("JAX_NUM_PROCESSES"):
            kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
        if env.get("JAX_PROCESS_ID"):
            kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
        return Decision(True, "JAX_COORDINATOR_ADDRESS is set", kwargs)
    if _hosts(env) > 1:
        return Decision(True, f"{_hosts(env)} TPU worker hosts in the environment")
    if forced in ("1", "true", "yes", "on"):
        return Decision(True, "RCGRPO_DISTRIBUTED=1")
    if env.get("TPU_SKIP_MDS_QUERY") is None and tpu_device_present():
        return Decision(True, "TPU device found (slice workers come from the metadata server)")
    return Decision(False, "single process")


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
    """Joins the multi-host runtime if the environment says this is one; True if it did.

    Idempotent: a second call (or one after someone else initialised) does nothing.
    """
    d = decide(env)
    if not d.initialize:
        return False
    import jax

    if jax.distributed.is_initialized():
        return False
    logging.info("jax.distributed.initialize(%s): %s", d.kwargs or "", d.reason)
    if _cpu_collectives(env if env is not None else os.environ):
        # without it, XLA:CPU computations that span processes fail ("no CPU collectives")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**d.kwargs)
    logging.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def _cpu_collectives(
    env: Mapping[str, str], tpu_device_present: Callable[[], bool] = _tpu_device_present
) -> bool:
    """Whether the run computes on CPU devices (JAX_PLATFORMS names cpu first, or is unset on a
    machine without a TPU) and the user chose no implementation
    (JAX_CPU_COLLECTIVES_IMPLEMENTATION)."""
    if env.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        return False
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    return not tpu_device_present()


# ------------------------------------------------------------------ SPMD helpers (any process count


def process_count() -> int:
    import jax

    return jax.process_count()


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main_process() -> bool:
    """Process 0: the one that writes logs, summaries, plots and exports."""
    return process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process got here (nothing in a single process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def split_rows(n: int, count: int, index: int) -> range:
    """The contiguous share of rows 0..n-1 that process `index` of `count` owns: shares differ
    by at most one row, earlier processes take the larger ones, and they tile 0..n-1."""
    base, extra = divmod(int(n), int(count))
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def process_rows(n: int) -> range:
    """This process's share of n rows (all of them in a single process)."""
    return split_rows(n, process_count(), process_index())


def row_owner(n: int) -> list[int]:
    """For each of n rows, the process that owns it (`process_rows`)."""
    out = [0] * n
    for q in range(process_count()):
        for r in split_rows(n, process_count(), q):
            out[r] = q
    return out


def _bucket(n: int) -> int:
    return max(8, 1 << max(0, int(n) - 1).bit_length())  # few distinct all-gather programs


def _allgather(x: Any):
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def allgather_rows(local: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Every process's list of int rows (ragged), indexed by process: `out[q]` is what process q
    passed. Collective: every process must call it, in the same order."""
    if process_count() == 1:
        return [[[int(t) for t in row] for row in local]]
    import numpy as np

    lens = [len(row) for row in local]
    sizes = _allgather(np.asarray([len(local), sum(lens)], np.int32))  # [processes, 2]
    lens_pad = np.zeros(_bucket(sizes[:, 0].max()), np.int32)
    lens_pad[: len(lens)] = lens
    flat = np.zeros(_bucket(sizes[:, 1].max()), np.int32)
    flat[: sum(lens)] = [int(t) for row in local for t in row]
    all_lens, all_flat = _allgather(lens_pad), _allgather(flat)
    out = []
    for q, (count, _) in enumerate(sizes):
        ends = np.cumsum(all_lens[q, :count])
        out.append(
            [
                all_flat[q, e - n : e].tolist()
                for n, e in zip(all_lens[q, :count], ends, strict=True)
            ]
        )
    return out


def allgather_objects(local: Sequence[Any]) -> list[list[Any]]:
    """`allgather_rows` for JSON-serialisable objects: `out[q]` is process q's list."""
    if process_count() == 1:
        return [list(local)]
    rows = [list(json.dumps(x).encode()) for x in local]
    return [[json.loads(bytes(r).decode()) for r in rows_q] for rows_q in allgather_rows(rows)]


def host_array(x: Any):
    """A numpy copy of `x`; a global array that this process does not hold entirely (sharded
    over several processes) is gathered first — a collective then, called by every process."""
    import jax
    import numpy as np

    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def host_tree(tree: Any) -> Any:
    """`host_array` on every leaf, with one collective for all the leaves that need one."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(tree)
    spread = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)
    ]
    here = [i for i in range(len(leaves)) if i not in spread]
    out: list[Any] = [None] * len(leaves)
    for i, x in zip(here, jax.device_get([leaves[i] for i in here]), strict=True):
        out[i] = np.asarray(x)
    if spread:
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather([leaves[i] for i in spread], tiled=True)
        for i, x in zip(spread, got, strict=True):
            out[i] = np.asarray(x)
    return jax.tree.unflatten(treedef, out)


def global_from_host(x: Any, sharding: Any):
    """A global array with `sharding` from a host array that every process holds in full (the
    same values everywhere): each process places only its own shards, nothing is duplicated."""
    import jax
    import numpy as np

    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
