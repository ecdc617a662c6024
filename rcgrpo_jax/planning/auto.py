"""`mesh.shape=auto`: the first mesh, grad_accum and rl.max_rows under which every program of a
config fits the devices, found by planning them (`planner.plan`); `resolve_auto` is what a run
calls at start-up."""

from __future__ import annotations

import dataclasses
from typing import Any

from rcgrpo_jax.planning.chips import CHIPS, Chip, Topology, parse_topology
from rcgrpo_jax.planning.planner import plan
from rcgrpo_jax.planning.presets import model_config
from rcgrpo_jax.planning.programs import Shape, shape_from_config


def mesh_candidates(n: int, num_kv_heads: int) -> list[tuple[int, int, int]]:
    """(1, n / t, t) for t = 1, 2, 4, 8 dividing both n and the KV heads: FSDP first (the train
    state spread over every chip), then more tensor parallelism (the sampler's weights and
    KV heads split t ways)."""
    return [(1, n // t, t) for t in (1, 2, 4, 8) if n % t == 0 and num_kv_heads % t == 0]


def _grad_accums(prompts: int, start: int) -> list[int]:
    """start, 2 start, 4 start, ... while each divides the update's prompts (whole groups)."""
    out, ga = [], max(1, start)
    while ga <= prompts and prompts % ga == 0:
        out.append(ga)
        ga *= 2
    return out


def _row_chunks(rows: int, shards: int) -> list[int]:
    """rows, rows / 2, ... while a whole number of rows per data x fsdp shard (at least one)."""
    out = []
    while rows >= shards and rows % shards == 0:
        out.append(rows)
        if rows % 2:
            break
        rows //= 2
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    mesh: tuple[int, int, int]
    grad_accum: int
    max_rows: int  # rl.max_rows: 0 = every row at once
    rows: list[dict[str, Any]]  # the plan rows that fit
    tried: int  # configurations compiled

    def apply(self, config) -> None:
        """Sets the choice in the config."""
        config.mesh.shape = self.mesh
        config.rl.optim.grad_accum = self.grad_accum
        config.rl.max_rows = self.max_rows

    def line(self, where: str) -> str:
        gib = ", ".join(f"{r['program']} {r['total_gib']:.1f}" for r in self.rows)
        rows = f"rl.max_rows={self.max_rows}" if self.max_rows else "all rows at once"
        return (
            f"mesh.shape=auto on {where}: {'x'.join(map(str, self.mesh))}, "
            f"rl.optim.grad_accum={self.grad_accum}, {rows} (GiB per device: {gib} of "
            f"{self.rows[0]['hbm_gib']:.0f}; {self.tried} plans compiled)"
        )


def choose(config, topology: str | Topology, shape: Shape, plan_fn=None, **plan_kw) -> Choice:
    """The first (mesh, grad_accum, max_rows) under which every program fits: meshes in
    `mesh_candidates` order; per mesh, the config's grad_accum, then doubled (up to one group
    per microbatch), until the train step fits; then all sampler rows at once, then halved
    (down to one row per data x fsdp shard), until decode and prefill fit. `plan_fn` (default
    `plan`) is called as `plan(config, topology, shape, programs=..., **plan_kw)`."""
    from rcgrpo_jax.errors import UserError

    plan_fn = plan if plan_fn is None else plan_fn
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    cfg = model_config(config, int(plan_kw.get("extra_vocab", 0)), int(plan_kw.get("layers", 0)))
    tried = 0
    closest: dict[str, Any] | None = None  # the failing row nearest to fitting, for the error

    def note(row: dict[str, Any], mesh, ga: int) -> None:
        nonlocal closest
        if closest is None or row["hbm_frac"] < closest["hbm_frac"]:
            closest = dict(row, tried_mesh=mesh, tried_grad_accum=ga)

    for mesh in mesh_candidates(topo.chips, cfg.num_kv_heads):
        c = config.copy_and_resolve_references()
        c.mesh.shape = mesh
        train = None
        for ga in _grad_accums(shape.prompts, shape.grad_accum):
            tried += 1
            (row,) = plan_fn(c, topo, dataclasses.replace(shape, grad_accum=ga),
                             programs=("train",), **plan_kw)  # fmt: skip
            if row["fits"]:
                train = (ga, row)
                break
            note(row, mesh, ga)
        if train is None:
            continue
        all_rows = shape.prompts * shape.minibatches * shape.group
        for rows in _row_chunks(all_rows, mesh[0] * mesh[1]):
            tried += 1
            max_rows = 0 if rows == all_rows else rows
            chunked = dataclasses.replace(shape, grad_accum=train[0], max_rows=max_rows)
            sampler = plan_fn(c, topo, chunked, programs=("decode", "prefill"), **plan_kw)
            if all(r["fits"] for r in sampler):
                return Choice(mesh, train[0], max_rows, [train[1], *sampler], tried)
            for r in sampler:
                if not r["fits"]:
                    note(r, mesh, train[0])
    near = ""
    if closest is not None and "total_gib" in closest:
        near = (
            f"; closest: {closest['program']} {closest['total_gib']:.1f} GiB of "
            f"{closest['hbm_gib']:.0f} per device at mesh "
            f"{'x'.join(map(str, closest['tried_mesh']))}, grad_accum "
            f"{closest['tried_grad_accum']}"
        )
    raise UserError(
        f"mesh.shape=auto: no mesh of {topo.chips} {topo.chip.name} devices fits every program "
        f"(tried {tried} plans{near}); plan one by hand: python -m rcgrpo_jax.tools.plan"
    )


def device_topology(devices) -> Topology | None:
    """The devices as a planner topology: their chip's figures where the device kind names a
    known TPU or GPU, with the memory limit the runtime reports; None where none is reported
    (CPU)."""
    d = devices[0]
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return None
    kind = str(getattr(d, "device_kind", d.platform)).lower()
    known = next((c for k, c in CHIPS.items() if k in kind.replace(" lite", "e").replace(" ", "")),
                 None)  # fmt: skip
    backend = "gpu" if d.platform in ("gpu", "cuda", "rocm") else "tpu"
    chip = Chip(kind, int(limit), *(
        (known.peak_flops, known.hbm_bandwidth) if known else (1e15, 1e12)), 1, 4,
        backend=backend)  # fmt: skip
    return Topology(name=f"{len(devices)} x {kind}", chip=chip, chips=len(devices))


def resolve_auto(config) -> str:
    """Sets `mesh.shape=auto`'s choice in `config` (mesh, rl.optim.grad_accum, rl.max_rows)
    for the devices present, by planning on them (`choose`); returns the line that says it.
    The train step is planned with its head at every position (`Shape.loss_tokens` 0): an upper
    bound of what `model.gather_head` computes, whose loss positions a run does not know yet.
    Devices that report no memory limit (CPU) get FSDP over all of them, nothing else changed."""
    import jax

    devices = jax.devices()
    topo = device_topology(devices)
    if topo is None:
        config.mesh.shape = (1, len(devices), 1)
        return (
            f"mesh.shape=auto on {len(devices)} {devices[0].platform} devices (no memory limit "
            f"reported): 1x{len(devices)}x1"
        )
    choice = choose(config, topo, shape_from_config(config), devices=devices)
    choice.apply(config)
    return choice.line(topo.name)
