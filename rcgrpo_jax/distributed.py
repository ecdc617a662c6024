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

Call it first thing in `main`, before anything that lists devices or compiles.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Callable, Mapping

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
    jax.distributed.initialize(**d.kwargs)
    logging.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True
