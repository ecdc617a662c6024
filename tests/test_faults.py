"""Injected environment faults in a real RL iteration: the run goes on, the rows score 0.

One `rcgrpo` iteration (`stages.rl.run`, tiny random model, 8 prompts x 2 rollouts) over synthetic
file-system tasks whose simulator is `FaultyFS`, a GorillaFileSystem that misbehaves as its
scenario says. The policy's text is scripted (the tokenizer's `decode` returns `[ls()]`, so every
row calls the faulty method; `env.max_steps_per_turn = 1` ends each row after two steps).

A hanging or sleeping call ends on its own after `FAULT_BOUND_S` (or when the test releases it)
and then returns a normal result: if the call limit did not stop it, the outcome is that result,
not `CallTimeout`, and the test fails instead of hanging.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest
from conftest import shipped_config

from rcgrpo_jax.envs import executor, tiny_tokenizer
from rcgrpo_jax.stages import rl as loop
from rcgrpo_jax.stages import setup
from rcgrpo_jax.train.metrics import read_jsonl

GFS = executor.simulator_class("GorillaFileSystem")
TIMEOUT_S = 0.5
FAULT_BOUND_S = 30.0  # how long a hanging or sleeping call lasts if nothing stops it
RELEASE = threading.Event()  # set: hanging and sleeping calls (abandoned ones too) end now
FINISHED: list[str] = []  # the faults whose call ran to its end


class Unprintable:
    def __str__(self):
        raise RuntimeError("injected: result cannot be printed")


class Explosive:
    """A public attribute the reward's state check cannot compare."""

    def __eq__(self, other):
        raise RuntimeError("injected: state cannot be compared")

    __ne__ = __eq__
    __hash__ = object.__hash__


class FaultyFS(GFS):
    """GorillaFileSystem whose `ls` (or set-up, or state) fails as scenario["fault"] says."""

    def _load_scenario(self, scenario, long_context=False):
        scenario = dict(scenario)
        self._fault = scenario.pop("fault")
        if self._fault == "load":
            raise RuntimeError("injected: scenario does not load")
        super()._load_scenario(scenario, long_context=long_context)
        if self._fault == "reward":
            self.probe = Explosive()

    def ls(self, a: bool = False):
        fault = self._fault
        if fault == "raise":
            raise ValueError("injected simulator error")  # bfcl-eval: an error tool message
        if fault == "hang":
            end = time.monotonic() + FAULT_BOUND_S
            while not RELEASE.is_set() and time.monotonic() < end:
                pass
        if fault == "sleep":
            RELEASE.wait(FAULT_BOUND_S)
        FINISHED.append(fault)
        if fault == "unprintable":
            return Unprintable()
        if fault == "exit":
            sys.exit(3)
        return super().ls(a)


@pytest.fixture(autouse=True)
def release_abandoned_calls():
    """Calls abandoned past their limit end with the test that started them."""
    RELEASE.clear()
    FINISHED.clear()
    yield
    RELEASE.set()


# fault -> the error type its rows record (None: no row error)
FAULTS = {
    "none": None,
    "raise": None,
    "load": "RuntimeError",
    "hang": "CallTimeout",
    "sleep": "CallTimeout",
    "unprintable": "RuntimeError",
    "reward": "RuntimeError",
    "exit": "SystemExit",
}


def faulty_entries(tasks):
    """One task per fault, on FaultyFS instead of GorillaFileSystem."""
    return [
        dataclasses.replace(
            task,
            id=f"faulty_{fault}",
            involved_classes=("FaultyFS",),
            initial_config={
                "FaultyFS": {**task.initial_config["GorillaFileSystem"], "fault": fault}
            },
        )
        for task, fault in zip(tasks, FAULTS, strict=False)
    ]


def tiny_config(workdir):
    c = shipped_config("tiny")
    c.stage = "rcgrpo"
    c.workdir = str(workdir)
    c.env.synthetic.num_train = 40
    c.env.max_steps_per_turn = 1
    c.env.call_timeout_s = TIMEOUT_S
    c.model.arch.num_layers = 1
    c.rl.steps = 1
    c.rl.num_prompts = len(FAULTS)
    c.rl.group_size = 2
    c.rl.dynamic_sampling = False  # one round of P x G rollouts: each fault exactly once
    c.rl.max_new_tokens = 8
    c.rl.eval_every = c.rl.eval_points = 0
    c.rl.checkpoint_every = 1
    return c


def test_faults_in_an_rl_iteration(tmp_path, monkeypatch, capfd):
    config = tiny_config(tmp_path / "run")
    tasks = setup.task_entries(config, "train")
    tokenizer = tiny_tokenizer.load_or_train(tmp_path / "tok", tasks, vocab_size=1024)
    tokenizer.decode = lambda ids, **kw: "[ls()]"  # the scripted policy text
    entries = faulty_entries(tasks)
    real_class = executor.simulator_class
    monkeypatch.setattr(
        executor, "simulator_class", lambda n: FaultyFS if n == "FaultyFS" else real_class(n)
    )
    monkeypatch.setattr(setup, "tokenizer_from_config", lambda *a, **k: tokenizer)
    monkeypatch.setattr(setup, "task_entries", lambda c, split: entries)

    summary = loop.run(config)

    root = tmp_path / "run"
    assert (root / "summary.json").exists() and (root / "export" / "config.json").exists()
    (metrics,) = read_jsonl(root / "metrics.jsonl")
    (rollouts,) = read_jsonl(root / "rollouts.jsonl")
    expected = sum(2 for kind in FAULTS.values() if kind)
    assert metrics["env_errors"] == expected and summary["final"]["env_errors"] == expected
    for entry_id, errors, rewards in zip(
        rollouts["entry_ids"], rollouts["env_errors"], rollouts["rewards"], strict=True
    ):
        kind = FAULTS[entry_id.removeprefix("faulty_")]
        for error, reward in zip(errors, rewards, strict=True):
            if kind is None:
                assert error is None, (entry_id, error)
            else:
                assert error.startswith(f"{kind}: "), (entry_id, error)
                assert reward == 0.0
            if kind == "CallTimeout":  # cut at the configured limit, not at the fault's end
                assert error == f"CallTimeout: simulator call took longer than {TIMEOUT_S:g} s"
    assert "hang" not in FINISHED and "sleep" not in FINISHED, FINISHED
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "failed in the environment" in line]
    assert len(said) == 1 and f"{expected} of 16 rollouts" in said[0], said


@pytest.mark.parametrize(
    "fault,outcome,thread",
    [("raise", "error result", False), ("hang", "CallTimeout", False),
     ("hang", "CallTimeout", True), ("sleep", "CallTimeout", False),
     ("sleep", "CallTimeout", True),
     ("unprintable", "RuntimeError", False), ("exit", "SystemExit", False),
     ("none", "result", False), ("none", "result", True)],
)  # fmt: skip
def test_executor_under_each_fault(fault, outcome, thread, monkeypatch):
    """Main thread: SIGALRM stops the call; another thread: the call is abandoned, still
    running when the caller gets `CallTimeout` (it ends when the test releases it)."""
    real_class = executor.simulator_class
    monkeypatch.setattr(
        executor, "simulator_class", lambda n: FaultyFS if n == "FaultyFS" else real_class(n)
    )
    config = {"FaultyFS": {"root": {"r": {"type": "directory", "contents": {}}}, "fault": fault}}
    (instances,) = executor.load_instances(config, ("FaultyFS",), False)
    table = executor.method_table(instances)
    out: dict = {}

    def call():
        try:
            got = executor.execute("ls()", table, TIMEOUT_S)
            out["kind"] = "error result" if got.startswith(executor.ERROR_PREFIX) else "result"
        except BaseException as e:  # noqa: BLE001
            out["kind"] = type(e).__name__

    if thread:
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
    else:
        call()
    assert out["kind"] == outcome
    if outcome == "CallTimeout":  # returned before the call itself ended
        assert fault not in FINISHED
    elif outcome == "result":
        assert FINISHED == [fault]
