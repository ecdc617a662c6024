"""Whether two run directories hold the same results: every file one run wrote, compared with
the other's, where values that depend on the clock or the machine's load are left out.

    python -m rcgrpo_jax.tools.compare_runs RUN_A RUN_B

Compared byte for byte: exported weights, tokenizers, every file but those below. Stored datasets
(ArrayRecord): example by example, decoded (a record's bytes order its features by chance). JSON
and JSON lines (metrics, rollouts, summaries): equal after dropping the keys that measure time or
speed (`VOLATILE`, at any depth). Text: equal after dropping the figures of timing phrases. In
every string the run's own directory (absolute, or as the run named it) reads as `<run>`, so
two workdirs compare. Not compared: checkpoints (their bytes carry save metadata; the export is
the same weights), TensorBoard event files, PNG plots (timestamps) and the report page
(`report.html`: built from the files compared, with its build time). Prints one line per
differing file and exits 1 if any differs or either run has a file the other lacks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

# keys whose values measure time, speed or what the compilation cache held
VOLATILE = re.compile(
    r"(^time$|_s$|_per_s$|^mfu|^wall|^compile|^programs$|^cache_hits$|^machine$|^step_time)"
)
SKIPPED_DIRS = ("checkpoints", "tb")
SKIPPED_SUFFIXES = (".png", ".html")  # plots, and the report page built from the other files
# a stage's end line and the table's timing columns: "; 103.0 s, compile 31.0 s (...)"
_TIMING = re.compile(r"\d+(\.\d+)?\s*s\b|compile [^;)]*|\(\d+ programs[^)]*\)|\d+(\.\d+)? ?it/s")


def _strip(value: Any, root: Path) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v, root) for k, v in value.items() if not VOLATILE.search(str(k))}
    if isinstance(value, list):
        return [_strip(v, root) for v in value]
    if isinstance(value, str):
        value = value.replace(str(root), "<run>")
        # the same directory as the run named it (a relative workdir: runs/tiny/sft/export)
        value = re.sub(rf"[^\s'\"]*\b{re.escape(root.name)}(?=/)", "<run>", value)
        return _TIMING.sub("<t>", value)
    return value


def _files(root: Path) -> set[str]:
    out = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_dir() or any(part in SKIPPED_DIRS for part in rel.parts):
            continue
        if path.suffix in SKIPPED_SUFFIXES:
            continue
        out.add(str(rel))
    return out


def _examples(path: Path) -> list[dict[str, Any]]:
    """The decoded examples of the dataset split an ArrayRecord shard belongs to."""
    from rcgrpo_jax.data.store import load_split

    split = path.name.split(".array_record")[0].rsplit("-", 1)[-1]
    source = load_split(path.parent, split)
    plain = lambda v: v.tolist() if hasattr(v, "tolist") else v
    return [{k: plain(v) for k, v in source[i].items()} for i in range(len(source))]


def _content(path: Path, root: Path) -> Any:
    """What of a file is compared: parsed and stripped JSON (lines), decoded examples,
    timing-free text, or bytes."""
    if path.suffix == ".json":
        return _strip(json.loads(path.read_text()), root)
    if path.suffix == ".jsonl":
        return [_strip(json.loads(line), root) for line in path.read_text().splitlines() if line]
    if ".array_record" in path.name:
        return _examples(path)
    if path.suffix == ".txt":
        return _strip(path.read_text(), root)
    return path.read_bytes()


def compare(a: Path, b: Path) -> tuple[list[str], int]:
    """One line per file of `a` or `b` whose results differ, or that one run lacks; and how
    many files the two runs hold together."""
    fa, fb = _files(a), _files(b)
    out = [f"only in {a}: {f}" for f in sorted(fa - fb)]
    out += [f"only in {b}: {f}" for f in sorted(fb - fa)]
    out += [f"differs: {f}" for f in sorted(fa & fb) if _content(a / f, a) != _content(b / f, b)]
    return out, len(fa | fb)


def differences(a: Path, b: Path) -> list[str]:
    """`compare`'s lines alone."""
    return compare(a, b)[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rcgrpo_jax.tools.compare_runs RUN_A RUN_B", file=sys.stderr)
        return 2
    a, b = (Path(x) for x in argv)
    for path in (a, b):
        if not path.is_dir():
            print(f"error: {path} is not a directory", file=sys.stderr)
            return 2
    found, n = compare(a, b)
    for line in found:
        print(line)
    print(f"{n - len(found)} of {n} files the same" + ("" if found else ": the runs agree"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
