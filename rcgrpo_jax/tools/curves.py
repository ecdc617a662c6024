"""One figure of held-out success against trajectories generated, a panel per study.

    python -m rcgrpo_jax.tools.curves --study=one-turn=runs/seeds --study=multi-turn=runs/mt \\
        --out=docs/experiments/curves.png

Each study is a `tools.seeds` workdir (its `seeds.json`, whose `curves` are per arm the mean
and 95% interval at each budget point over its distinct runs); its panel is titled by the
name before "=".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

from rcgrpo_jax.errors import UserError


def read_panels(studies: list[str]) -> dict[str, dict]:
    """{title: curves} from "title=DIR" strings, each DIR holding a seeds.json with curves."""
    panels = {}
    for study in studies:
        title, sep, path = study.partition("=")
        if not sep or not title or not path:
            raise UserError(f"--study={study!r}: expected TITLE=DIR")
        record = Path(path) / "seeds.json"
        if not record.exists():
            raise UserError(f"--study={study!r}: {record} does not exist (run tools.seeds)")
        curves = json.loads(record.read_text()).get("curves") or {}
        if not any(curves.values()):
            raise UserError(f"--study={study!r}: {record} has no curve (no rl.eval_points)")
        panels[title] = curves
    return panels


def draw(panels: dict[str, dict], out_path: str | Path) -> Path:
    """`plots.plot_curves` with each control arm (`rl.arms.control_of`) drawn as its arm's."""
    from rcgrpo_jax.rl.arms import control_of
    from rcgrpo_jax.train import plots

    arms = {n for curves in panels.values() for n in curves}
    controls = {n: c[0] for n in arms if (c := control_of(n))}
    return plots.plot_curves(panels, out_path, controls=controls)


def main(argv: list[str]) -> int:
    del argv
    try:
        panels = read_panels(_STUDY.value)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = draw(panels, _OUT.value)
    print(f"wrote {out}")
    return 0


def _define_flags() -> None:
    global _STUDY, _OUT
    _STUDY = flags.DEFINE_multi_string("study", [], "TITLE=DIR of a tools.seeds workdir.")
    _OUT = flags.DEFINE_string("out", "curves.png", "Where the PNG goes.")


if __name__ == "__main__":
    _define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
