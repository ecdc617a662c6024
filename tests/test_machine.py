"""The machine record that sits next to a run's figures: what it reads, how it prints, and that
the experiment's table and the seed report name a stage or run that came from elsewhere."""

from __future__ import annotations

import os

import pytest

from rcgrpo_jax import machine
from rcgrpo_jax.stages import all as experiment
from rcgrpo_jax.tools import seed_stats, seeds

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16
processor\t: 1
model name\t: second core, not read
"""


def test_cpu_reads_family_model_and_the_isa_that_picks_kernels():
    assert machine.cpu(ZEN4) == {
        "name": "AMD EPYC",
        "family": 25,
        "model": 17,
        "isa": ["avx2", "avx512f", "avx512_bf16"],
    }
    assert (
        machine.cpu_line(machine.cpu(ZEN4))
        == "AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)"
    )
    bare = machine.cpu("")  # no /proc/cpuinfo (macOS): a name from the platform, no numbers
    assert bare["name"] and bare["family"] is None and bare["isa"] == []


def test_describe_records_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    m = machine.describe()
    assert m["xla_flags"] == "--xla_cpu_max_isa=AVX2"
    assert m["platform"] == "cpu" and m["devices"] >= 1 and m["jax"]
    assert m["cores"] == machine.usable_cores()
    line = machine.one_line(m)
    assert f"{m['cores']} cores" in line and "XLA_FLAGS=--xla_cpu_max_isa=AVX2" in line
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to narrow the affinity")
    allowed = os.sched_getaffinity(0)
    try:  # as under `taskset -c N`: the count is the affinity's, not the machine's
        os.sched_setaffinity(0, {min(allowed)})
        assert machine.describe()["cores"] == 1
    finally:
        os.sched_setaffinity(0, allowed)


def _record(cores: int, flags: str = "") -> dict:
    return {
        "cpu": machine.cpu(ZEN4), "cores": cores, "xla_flags": flags, "jax": "0.0",
        "platform": "cpu", "device_kind": "cpu", "devices": 1, "processes": 1,
    }  # fmt: skip


def test_the_table_names_stages_from_another_machine():
    here, one_core = _record(2), _record(1)
    same = experiment.format_machines(here, {"base": here, "sft": here})
    assert same == f"figures from: {machine.one_line(here)}"
    assert "2 cores, XLA_FLAGS unset" in same
    mixed = experiment.format_machines(here, {"base": here, "sft": one_core, "rctp": None})
    assert mixed == (
        f"figures from: {machine.one_line(here)}; sft: {machine.one_line(one_core)}; "
        "rctp: not recorded"
    )


def test_the_seed_report_says_which_runs_came_from_which_machine():
    arms = {"base": {"heldout_success": 0.1}, "sft": {"heldout_success": 0.5}}
    runs = {
        "seed_0": {"arms": arms, "targets": {}, "machine": _record(2)},
        "seed_1": {"arms": {**arms, "base": {"heldout_success": 0.2}}, "targets": {},
                   "machine": _record(2)},
        "seed_0@avx2": {"arms": {**arms, "sft": {"heldout_success": 0.6}}, "targets": {},
                        "machine": _record(2, "--xla_cpu_max_isa=AVX2")},
    }  # fmt: skip
    report = seeds.format_report(runs, seed_stats.aggregate(runs)).splitlines()
    assert f"machine: {machine.one_line(_record(2))} (seed_0, seed_1)" in report
    avx2 = machine.one_line(_record(2, "--xla_cpu_max_isa=AVX2"))
    assert f"machine: {avx2} (seed_0@avx2)" in report
    one = {"seed_0": runs["seed_0"]}
    assert (
        f"machine: {machine.one_line(_record(2))}"
        in seeds.format_report(one, seed_stats.aggregate(one)).splitlines()
    )
