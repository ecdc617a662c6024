"""`python tests/kill_points.py ARGS` runs `python -m rcgrpo_jax.main ARGS` and can SIGKILL itself
at a chosen point of the run, chosen by what the run did, not by the clock.

It counts three kinds of event, by wrapping the package's functions (nothing in the package
changes):
- `update <iteration>`: an RL update step was dispatched (`make_rl_step`'s step; its state is in
  memory only, the computation maybe still running);
- `saved <step>`: a checkpoint save started and its files are on disk (the save waited for);
- `sampled_eval <k>`: a held-out measurement of k samples per entry begins (`measure_success`
  with samples k > 0: an evaluation's sampled half, after its greedy half).

RCGRPO_KILL_AT="<event>:<n>": at the n-th event of that kind this process makes, it kills itself
with SIGKILL (no clean-up, no flush: what a power cut leaves). RCGRPO_EVENTS=<file>: each event
is appended to it as one line, "<event> <detail>", as it happens. Neither set: a plain run.
"""

from __future__ import annotations

import collections
import inspect
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

KILL_AT = "RCGRPO_KILL_AT"
EVENTS = "RCGRPO_EVENTS"


class Events:
    """Counts events, logs them to RCGRPO_EVENTS, and kills the process at RCGRPO_KILL_AT."""

    def __init__(self) -> None:
        kind, _, n = os.environ.get(KILL_AT, "").partition(":")
        self.kill_kind, self.kill_n = kind, int(n or 0)
        path = os.environ.get(EVENTS)
        self.log = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives as long as the process
        self.counts: collections.Counter[str] = collections.Counter()

    def kills_at_next(self, kind: str) -> bool:
        return kind == self.kill_kind and self.counts[kind] + 1 == self.kill_n

    def __call__(self, kind: str, detail: Any) -> None:
        self.counts[kind] += 1
        if self.log is not None:
            self.log.write(f"{kind} {detail}\n")
            self.log.flush()
        if kind == self.kill_kind and self.counts[kind] == self.kill_n:
            os.kill(os.getpid(), signal.SIGKILL)


class _CountedStep:
    """An RL step whose every call is an `update` event (after the call: dispatched)."""

    def __init__(self, step: Callable, events: Events) -> None:
        self._step, self._events = step, events

    def __call__(self, state, batch):
        out = self._step(state, batch)
        self._events("update", int(batch["iteration"]) + 1)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def install(events: Events) -> None:
    """Wraps the step factory, the held-out measurement and the checkpoint save, wherever the
    package's modules bound them."""
    from rcgrpo_jax.rl import train_step
    from rcgrpo_jax.stages import eval as eval_stage
    from rcgrpo_jax.train.checkpoint import Checkpointer

    make_rl_step, measure_success, save = (
        train_step.make_rl_step, eval_stage.measure_success, Checkpointer.save,
    )  # fmt: skip
    samples_of = inspect.signature(measure_success)

    def counted_make_rl_step(*args, **kwargs):
        return _CountedStep(make_rl_step(*args, **kwargs), events)

    def counted_measure_success(*args, **kwargs):
        samples = samples_of.bind(*args, **kwargs).arguments.get("samples", 0)
        if samples:
            events("sampled_eval", samples)
        return measure_success(*args, **kwargs)

    def counted_save(self, step, *args, **kwargs):
        started = save(self, step, *args, **kwargs)
        if started:
            if events.kills_at_next("saved"):
                self.wait()  # the checkpoint is on disk when the process dies
            events("saved", int(step))
        return started

    Checkpointer.save = counted_save
    import rcgrpo_jax.main  # noqa: F401 - the command line, and the stages it runs
    import rcgrpo_jax.stages.all  # noqa: F401
    import rcgrpo_jax.stages.rl  # noqa: F401

    wrapped = {id(make_rl_step): counted_make_rl_step, id(measure_success): counted_measure_success}
    for module in [m for name, m in sys.modules.items() if name.startswith("rcgrpo_jax")]:
        for name, value in list(vars(module).items()):
            if id(value) in wrapped:
                setattr(module, name, wrapped[id(value)])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's package
    install(Events())
    from absl import app

    from rcgrpo_jax import main as cli

    sys.argv = ["rcgrpo_jax.main", *sys.argv[1:]]
    app.run(cli.main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    main()
