"""A run's report: one self-contained HTML page (`report.html`) that reads only files.

`build(run_dir)` writes `<run_dir>/report.html` from what a run left there: an RL stage's
workdir (`metrics.jsonl`, `summary.json`, `trajectories.jsonl`, `heldout.jsonl`,
`config.json`), stage `all`'s (its `summary.json`, `table.txt` and every stage's sub-directory)
or a `tools.seeds` study (`seeds.json`, `seeds.txt`). `refresh` is what a running stage calls:
it records the run's config beside the page (`config.json`), then rebuilds the page, and a
failure to build is a warning, never the end of a training run. The page: an overview (arms
table, targets, machine, wall and compile time per stage, the config as it differs from the
defaults), interactive curves (plotly.js, inlined), a rollout browser and a held-out browser;
docs/report.md describes it. This unit sits on the utilities floor: it imports no other part of
the package, so the caller hands in the config and its defaults as plain dicts.
"""

from rcgrpo_jax.report.build import build, changed, refresh
from rcgrpo_jax.report.read import read_run

__all__ = ["build", "changed", "read_run", "refresh"]
