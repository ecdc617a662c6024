"""The page itself: the payload (`read.read_run`) and plotly.js, each gzipped and base64-encoded
into one HTML file with the page's own script and style (`assets/`), decompressed in the browser
by its `DecompressionStream`. Nothing is fetched: the file opens from disk, offline.

Compressed, plotly.js (4.8 MB as shipped in the `plotly` wheel) takes ~1.9 MB of the page and a
run's conversations shrink ~10x, so a 100-iteration 7B-shaped run stays a few MB
(docs/report.md has the figures and `bench/report_size.py` measures them).
"""

from __future__ import annotations

import base64
import datetime
import functools
import gzip
import json
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from rcgrpo_jax.report.read import changed, read_run

PAGE = "report.html"
# gzip level: 6 compresses a run's JSON within ~2% of 9 in a third of the time
LEVEL = 6


def _packed(data: bytes, level: int = LEVEL) -> str:
    """`data` gzipped and base64-encoded: text that can stand inside a <script> element (the
    base64 alphabet has no "<")."""
    return base64.b64encode(gzip.compress(data, compresslevel=level, mtime=0)).decode("ascii")


@functools.cache
def _plotly() -> str:
    """plotly.js as the `plotly` package ships it, packed once per process (level 9: it is
    packed once, and its bytes are most of a small run's page)."""
    from plotly.offline import get_plotlyjs

    return _packed(get_plotlyjs().encode(), 9)


def _asset(name: str) -> str:
    return (resources.files("rcgrpo_jax.report") / "assets" / name).read_text()


def html(payload: dict[str, Any]) -> str:
    """The page for `payload`: the template with the style, script, plotly.js and the data."""
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False, default=str).encode()
    return (
        _asset("page.html")
        .replace("/*STYLE*/", _asset("page.css"))
        .replace("/*SCRIPT*/", _asset("page.js"))
        .replace("PLOTLY_GZ", _plotly())
        .replace("DATA_GZ", _packed(data))
    )


def _finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as None (JSON has neither; metrics hold NaN where an
    iteration had no update)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


INTERN_CHARS = 256  # message texts at least this long are stored once, by reference


def _interned(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with each long message text that occurs more than once (a task's system
    prompt and tool schemas, repeated in every row of its group and every evaluation of it)
    kept once in `payload["strings"]`, the messages holding its index (`"c"`) instead of
    `"content"`; page.js puts the texts back. Gzip alone cannot: its window is 32 KB and a
    BFCL system prompt ~16 KB."""
    messages = [
        m for g in payload.get("groups", []) for row in g["rows"] for m in row.get("messages") or []
    ]
    for evals in payload.get("heldout", {}).values():
        messages += [m for e in evals for t in e["tasks"] for m in t.get("messages") or []]
    seen: dict[str, int] = {}
    for m in messages:
        text = m.get("content")
        if isinstance(text, str) and len(text) >= INTERN_CHARS:
            seen[text] = seen.get(text, 0) + 1
    strings = [text for text, n in seen.items() if n > 1]
    index = {text: i for i, text in enumerate(strings)}
    for m in messages:
        if (i := index.get(m.get("content"))) is not None:
            del m["content"]
            m["c"] = i
    return {**payload, "strings": strings}


def _write_atomic(path: Path, text: str) -> None:
    """The page as a whole or not at all: a browser reloading it mid-refresh sees the old page
    or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the page from other users
    os.replace(tmp, path)


def build(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the page of `run_dir` (default `<run_dir>/report.html`) and returns its path;
    ValueError where `run_dir` is not a run."""
    payload = _interned(_finite(read_run(run_dir)))
    payload["built"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    path = Path(out) if out is not None else Path(run_dir) / PAGE
    page = html(payload)
    _write_atomic(path, page)
    return path


def refresh(
    run_dir: str | Path,
    config: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Path | None:
    """What a stage calls at a checkpoint and at its end: records `config` (the run's, as a
    dict) with its `defaults` as `config.json`, then rebuilds the page. A failure is one
    warning line on stderr and None: the page must never end a training run."""
    run_dir = Path(run_dir)
    try:
        if config is not None:
            record = {"config": config, "defaults": defaults or {}}
            _write_atomic(run_dir / "config.json", json.dumps(record, indent=1, default=str))
        return build(run_dir)
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        print(
            f"warning: {run_dir / PAGE} not written: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return None


__all__ = ["build", "changed", "html", "refresh"]
