"""Accelerator specs and slice names, for the planner's fit check and roofline projections.

Values are Google Cloud's published per-chip figures (checked 2026-11 on docs.cloud.google.com):
- v4:  https://cloud.google.com/tpu/docs/v4   275 TFLOP/s bf16, 32 GiB HBM2,  1200 GB/s
- v5e: https://cloud.google.com/tpu/docs/v5e  197 TFLOP/s bf16, 16 GB HBM2,    819 GB/s
- v5p: https://cloud.google.com/tpu/docs/v5p  459 TFLOP/s bf16, 95 GiB HBM2e, 2765 GB/s
- v6e: https://cloud.google.com/tpu/docs/v6e  918 TFLOP/s bf16, 32 GB HBM,    1638 GB/s
- h100: https://www.nvidia.com/en-us/data-center/h100/ (SXM) 989 TFLOP/s dense bf16, 80 GB HBM3,
  3.35 TB/s. The card reports 79.6 GiB; JAX takes 75% of it unless told otherwise: the planner
  counts 75 GiB, within what `XLA_PYTHON_CLIENT_MEM_FRACTION=0.95` (75.6 GiB) lets it take.
(v5p's page says 96 GiB is physical and 95 GiB is what JAX can allocate; we use the usable figure.
v5e's "16 GB" and v6e's "32 GB" are taken as GiB, which is how JAX reports them. Both pages
say 8 chips per host: v5e-8 and v6e-8 are one host, v5e-32 four; v4 and v5p hosts hold 4.)

Slice names: the number after the dash counts TensorCores for v4 and v5p (two per chip, driven as
one JAX device by megacore), and chips for v5e and v6e. So v5p-16 = 8 chips = 8 JAX devices,
v6e-16 = 16 devices, v5e-32 = 32 devices. `v5litepod-N` is accepted as v5e-N. GPUs count
cards: h100-1 is one H100, h100-8 one 8-GPU host.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int  # usable HBM per chip
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    cores_per_chip: int  # TensorCores per chip, as counted in the slice name
    chips_per_host: int  # chips per TPU VM worker (GPUs per host) in multi-host slices
    backend: str = "tpu"  # which attention kernels `model.attention=auto` picks there


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1200e9, 2, 4),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 1, 8),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, 2, 4),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1638e9, 1, 8),
    "h100": Chip("h100", 75 * GiB, 989e12, 3350e9, 1, 8, backend="gpu"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as given, e.g. "v5p-16"
    chip: Chip
    chips: int  # = JAX devices

    @property
    def hosts(self) -> int:
        return max(1, -(-self.chips // self.chip.chips_per_host))


def parse_topology(name: str) -> Topology:
    """ "v5p-16" -> 8 v5p chips; see the module docstring for the naming convention."""
    m = re.fullmatch(r"\s*([a-z0-9]+)-(\d+)\s*", name.lower())
    if not m:
        raise ValueError(f"topology {name!r}: expected <chip>-<count>, e.g. v5p-16 or v6e-16")
    kind = _ALIASES.get(m.group(1), m.group(1))
    if kind not in CHIPS:
        raise ValueError(f"topology {name!r}: unknown chip {kind!r}; known: {', '.join(CHIPS)}")
    chip, count = CHIPS[kind], int(m.group(2))
    if count < chip.cores_per_chip or count % chip.cores_per_chip:
        raise ValueError(
            f"topology {name!r}: {kind} slices count {chip.cores_per_chip} cores per chip"
        )
    return Topology(name=name, chip=chip, chips=count // chip.cores_per_chip)
