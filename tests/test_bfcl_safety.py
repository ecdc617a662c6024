"""Hostile model output executes nothing: no process, no file, no private method, no foreign class.

Every hostile text goes through the environment in each chat format and through the executor
directly, with spies on os/subprocess/builtins, on the simulators' private methods and on
methods of classes the entry does not involve; the test then checks that no spy fired, that
no marker file appeared, and that the simulators' state is unchanged.
"""

from __future__ import annotations

import builtins
import copy
import os
import subprocess
from contextlib import contextmanager

import pytest

from rcgrpo_jax.envs import bfcl
from rcgrpo_jax.envs.executor import (
    ERROR_PREFIX,
    execute,
    load_instances,
    method_table,
    public_state,
    simulator_class,
)

FOREIGN = {"TwitterAPI": "post_tweet", "TradingBot": "place_order"}


def file_system_entry() -> bfcl.Entry:
    """A base entry with the file system and without the classes in FOREIGN."""
    return next(
        e
        for e in bfcl.load_entries("base")
        if "GorillaFileSystem" in e.involved_classes and not set(FOREIGN) & set(e.involved_classes)
    )


def hostile_calls(marker: str) -> list[str]:
    touch = f"__import__('os').system('touch {marker}')"
    return [
        touch,
        f"ls(a={touch})",
        f"ls(a=(lambda: {touch})())",
        f"ls(a=f'{{{touch}}}')",
        f"ls(a=[{touch} for _ in range(1)])",
        f"ls(a=open('{marker}', 'w'))",
        f"cd(folder=__builtins__.open('{marker}', 'w'))",
        "ls.__globals__['os'].system('true')",
        "ls.__self__._load_scenario({})",
        "_load_scenario({'root': {}})",
        "_load_directory({})",
        "__init__()",
        "__class__()",
        "getattr(ls, '__globals__')",
        "globals()",
        "breakpoint()",
        "post_tweet(content='not my class')",
        "place_order(order_type='Buy', symbol='AAPL', price=1.0, amount=1)",
        "mkdir(dir_name='a')(); rm(file_name='x')",
        "mkdir(dir_name='x' + __import__('os').getcwd())",
        "mkdir(**{'dir_name': 'x'})",
        "mkdir(*['x'])",
        "rm(file_name=some_variable)",
        "mkdir(dir_name='x'.join(['a', 'b']))",
    ]


def model_texts(fmt: str, marker: str) -> list[str]:
    """Hostile assistant outputs in one chat format."""
    if fmt == "python":
        return [t for c in hostile_calls(marker) for t in (f"[{c}]", c)]
    key = "arguments" if fmt == "qwen" else "parameters"
    payloads = [
        f'{{"name": "_load_scenario", "{key}": {{"scenario": {{}}}}}}',
        f'{{"name": "__import__", "{key}": {{"name": "os"}}}}',
        f'{{"name": "system", "{key}": {{"command": "touch {marker}"}}}}',
        f'{{"name": "ls", "{key}": {{"a=__import__(\'os\').system(\'touch {marker}\'),b": 1}}}}',
        f'{{"name": "ls.__globals__", "{key}": {{}}}}',
        f'{{"name": "post_tweet", "{key}": {{"content": "x"}}}}',
        f'{{"name": "__class__", "{key}": {{}}}}',
    ]
    if fmt == "qwen":
        return [f"<tool_call>\n{p}\n</tool_call>" for p in payloads]
    return payloads + ["<|python_tag|>" + p for p in payloads]


def spy_factory(hits: list[str]):
    """spy(name) -> a stand-in that records `name` in `hits` and fails the call."""

    def spy(name):
        def record(*args, **kwargs):
            hits.append(name)
            raise AssertionError(f"{name} was called")

        return record

    return spy


@contextmanager
def spying():
    """Spies on everything hostile text might reach; yields the list of hits. Install it only
    around model-driven work: building simulators legitimately uses private methods."""
    hits: list[str] = []
    spy = spy_factory(hits)
    targets = [
        (os, "system"),
        (os, "popen"),
        (os, "remove"),
        (os, "unlink"),
        (subprocess, "Popen"),
        (subprocess, "run"),
        (builtins, "open"),
        (builtins, "breakpoint"),
    ]
    gfs = simulator_class("GorillaFileSystem")
    targets += [(gfs, "_load_scenario"), (gfs, "_load_directory")]
    targets += [(simulator_class(c), m) for c, m in FOREIGN.items()]
    targets += [(builtins, "__import__")]  # last in, first out: pytest itself imports
    with pytest.MonkeyPatch.context() as mp:
        for owner, attr in targets:
            mp.setattr(owner, attr, spy(f"{getattr(owner, '__name__', owner)}.{attr}"))
        yield hits


def snapshot(instances):
    fs = instances["GorillaFileSystem"]
    return copy.deepcopy(({c: public_state(i) for c, i in instances.items()}, fs._current_dir.name))


@pytest.mark.parametrize("fmt", ["python", "qwen", "llama"])
def test_hostile_text_through_the_environment(fmt, tmp_path):
    marker = tmp_path / "MARKER"
    texts = model_texts(fmt, str(marker))
    episodes = [bfcl.Episode(file_system_entry(), fmt) for _ in texts]  # loaded before the spies
    before = [snapshot(e._instances) for e in episodes]
    results = []
    with spying() as hits:
        for episode, text in zip(episodes, texts, strict=True):
            step = episode.step(text)  # never raises
            results += [m["content"] for m in step.messages if m["role"] == "tool"]
    assert hits == [] and not marker.exists()
    assert results and all(r.startswith(ERROR_PREFIX) for r in results), results
    assert [snapshot(e._instances) for e in episodes] == before


def test_hostile_calls_through_the_executor(tmp_path):
    marker = tmp_path / "MARKER"
    entry = file_system_entry()
    (instances,) = load_instances(entry.initial_config, entry.involved_classes, False)
    before = snapshot(instances)
    table = method_table(instances)
    assert not {"post_tweet", "place_order"} & set(table)
    assert all(not name.startswith("_") for name in table)
    with spying() as hits:
        results = [execute(call, table) for call in hostile_calls(str(marker))]
    assert hits == [] and not marker.exists()
    assert all(r.startswith(ERROR_PREFIX) for r in results), results
    assert snapshot(instances) == before


def test_simulator_errors_become_results_like_bfcl():
    """Bad arguments and simulator exceptions come back as bfcl-eval's error strings."""
    entry = file_system_entry()
    (instances,) = load_instances(entry.initial_config, entry.involved_classes, False)
    table = method_table(instances)
    assert execute("cd()", table) == (
        f"{ERROR_PREFIX}GorillaFileSystem.cd() missing 1 required positional argument: 'folder'"
    )
    assert execute("cd(nope=1)", table).startswith(
        f"{ERROR_PREFIX}GorillaFileSystem.cd() got an unexpected keyword argument 'nope'"
    )
    assert execute("frobnicate()", table) == f"{ERROR_PREFIX}name 'frobnicate' is not defined"
    assert execute("not a call", table).startswith(ERROR_PREFIX)


def test_runaway_arguments_are_refused():
    (instances,) = load_instances({}, ("MathAPI",), False)
    table = method_table(instances)
    assert execute("power(base=9, exponent=10**9)", table).startswith(ERROR_PREFIX)
    assert execute("power(base=9, exponent=1000000000)", table).startswith(ERROR_PREFIX)
    assert execute("power(9, 1000000000)", table).startswith(ERROR_PREFIX)
    assert execute("power(base=2, exponent=10)", table) == '{"result": 1024}'
    assert execute("logarithm(value=8, base=2, precision=10**7)", table).startswith(ERROR_PREFIX)
    assert execute("logarithm(8, 2, 10000000)", table).startswith(ERROR_PREFIX)
    assert execute("square_root(number=2, precision=10000000)", table).startswith(ERROR_PREFIX)
    assert execute("square_root(number=4, precision=5)", table) == "{'result': Decimal('2')}"
