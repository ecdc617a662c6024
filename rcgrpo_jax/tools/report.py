"""Rebuilds a run's report page from the files the run wrote.

    python -m rcgrpo_jax.tools.report RUN_DIR [--out=PATH]

RUN_DIR is an RL stage's workdir, stage `all`'s or a `tools.seeds` study's; the page goes to
`RUN_DIR/report.html` (or `--out`). Prints its path, size and the seconds the build took; exits
2 where RUN_DIR is not a run.
"""

from __future__ import annotations

import argparse
import sys
import time

from rcgrpo_jax import report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rcgrpo_jax.tools.report")
    parser.add_argument("run_dir", help="an RL stage's, stage all's or a tools.seeds workdir")
    parser.add_argument("--out", default=None, help="where the page goes (RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        page = report.build(args.run_dir, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = page.stat().st_size / 1e6
    print(f"wrote {page} ({size:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
