"""What the page shows, read from a run's files into one JSON-able payload.

Three kinds of directory (`kind_of`): an RL stage's workdir ("arm": its `metrics.jsonl`), stage
`all`'s ("all": sub-directories that are RL arms, or its `summary.json` with `arms`) and a
`tools.seeds` study ("study": `seeds.json`). Files a run has not written yet (a stage still
running, a run older than `trajectories.jsonl`) are left out, and the page says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# stage `all`'s sub-directories that are not RL arms (their summaries give times and rows)
STAGE1 = ("base", "warm_start", "sft", "rctp")


def _json(path: Path) -> Any:
    """A JSON file's value, or None where the file is absent."""
    return json.loads(path.read_text()) if path.exists() else None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records (none where absent); a half-written last line (a run
    appending while the page is built) is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def is_arm(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() and (path / "rollouts.jsonl").exists()


def kind_of(run_dir: Path) -> str | None:
    """ "arm", "all", "study", or None where `run_dir` holds none of them."""
    if (run_dir / "seeds.json").exists():
        return "study"
    if is_arm(run_dir):
        return "arm"
    summary = _json(run_dir / "summary.json") or {}
    if "arms" in summary or any(is_arm(p) for p in run_dir.iterdir() if p.is_dir()):
        return "all"
    return None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {"a.b.c": leaf}."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


def changed(config: dict[str, Any], defaults: dict[str, Any]) -> list[list[Any]]:
    """The keys whose value differs from the defaults, [[dotted key, value, default], ...]
    (a key the defaults lack: default None), sorted by key; tuples and lists compare alike."""
    plain = lambda v: json.loads(json.dumps(v, default=str))
    mine, base = plain(_flat(config)), plain(_flat(defaults))
    return [[k, mine[k], base.get(k)] for k in sorted(mine) if mine[k] != base.get(k)]


def _config(run_dir: Path) -> list[list[Any]] | None:
    """The run's config as it differs from the defaults (`config.json`; None without it)."""
    record = _json(run_dir / "config.json")
    return None if record is None else changed(record["config"], record["defaults"])


def _time(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    t = (summary or {}).get("time")
    return None if not t else {k: t.get(k) for k in ("wall_s", "compile_s", "programs")}


def _evals(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in metrics if r.get("eval_success") is not None]


def arm_row(name: str, metrics: list[dict[str, Any]], summary: dict[str, Any] | None) -> dict:
    """An arm's overview row from its metrics (a running arm's so far): held-out success at
    the start (the record of iteration 0) and at the last evaluation, iterations, trajectories
    generated; area under the curve and how it ended once its summary exists."""
    evals = _evals(metrics)
    start = evals[0]["eval_success"] if evals and evals[0].get("step") == 0 else None
    end = evals[-1]["eval_success"] if evals else None
    return {
        "name": name,
        "start": start,
        "end": end,
        "change": None if start is None or end is None else end - start,
        "auc": (summary or {}).get("auc"),
        "iterations": max((int(r.get("step", 0)) for r in metrics), default=0),
        "trajectories": int(sum(r.get("generated_rollouts") or 0 for r in metrics)),
        "ended": (summary or {}).get("ended", "running" if summary is None else None),
    }


def _arm(run_dir: Path, name: str, groups_out: list, heldout_out: dict) -> dict[str, Any]:
    """One RL arm: its metrics, overview row and time; its kept groups (each tagged with the
    arm) appended to `groups_out`, its held-out evaluations put in `heldout_out`."""
    metrics = _jsonl(run_dir / "metrics.jsonl")
    summary = _json(run_dir / "summary.json")
    groups = _jsonl(run_dir / "trajectories.jsonl")
    groups_out.extend({"arm": name, **g} for g in groups)
    if evals := _jsonl(run_dir / "heldout.jsonl"):
        # the page compares the start with the end: the evaluations between are left out
        evals.sort(key=lambda e: e["iteration"])
        heldout_out[name] = [evals[0], evals[-1]] if len(evals) > 1 else evals
    return {
        "metrics": metrics,
        "row": arm_row(name, metrics, summary),
        "time": _time(summary),
        "machine": (summary or {}).get("machine"),
        "has_trajectories": (run_dir / "trajectories.jsonl").exists(),
    }


def _read_arms(dirs: dict[str, Path]) -> dict[str, Any]:
    """The RL arms {name: workdir}: their records, kept groups and held-out evaluations."""
    groups: list[dict[str, Any]] = []
    heldout: dict[str, Any] = {}
    arms = {name: _arm(path, name, groups, heldout) for name, path in dirs.items()}
    return {"arms": arms, "groups": groups, "heldout": heldout}


def _read_all(run_dir: Path) -> dict[str, Any]:
    """Stage `all`: its RL arms (the summary's, then any still running), stage 1's rows and
    times, the targets, the table and the machine (those of a finished run only)."""
    summary = _json(run_dir / "summary.json") or {}
    subdirs = sorted(p.name for p in run_dir.iterdir() if p.is_dir())
    names = [n for n in (summary.get("arms") or {}) if n not in STAGE1 and is_arm(run_dir / n)]
    names += [n for n in subdirs if n not in names and is_arm(run_dir / n)]  # still running
    out = _read_arms({n: run_dir / n for n in names})
    times = {n: _time(_json(run_dir / n / "summary.json")) for n in STAGE1 if n in subdirs}
    out["stage_times"] = {n: t for n, t in times.items() if t}
    out["stage_rows"] = {n: r for n, r in (summary.get("arms") or {}).items() if n in STAGE1}
    out["summary_rows"] = {n: r for n, r in (summary.get("arms") or {}).items() if n not in STAGE1}
    out["targets"] = summary.get("targets")
    out["table"] = (run_dir / "table.txt").read_text() if (run_dir / "table.txt").exists() else None
    out["machine"] = summary.get("machine")
    out["wall_s"] = summary.get("wall_s")
    return out


def _read_study(run_dir: Path) -> dict[str, Any]:
    """A `tools.seeds` study: per arm its intervals, the paired differences, the curves' bands
    and each run with a link to its own page where it has one beside the study."""
    record = _json(run_dir / "seeds.json")
    runs = []
    for label, s in (record.get("runs") or {}).items():
        page = run_dir / label / "report.html"
        runs.append(
            {
                "label": label,
                "href": f"{label}/report.html" if page.exists() else None,
                "wall_s": s.get("wall_s"),
                "machine": s.get("machine"),
            }
        )
    table = run_dir / "seeds.txt"
    return {
        "study_arms": record.get("arms") or {},
        "paired": {**(record.get("paired") or {}), **(record.get("paired_cost") or {})},
        "bands": record.get("curves") or {},
        "runs": runs,
        "dropped": record.get("dropped") or [],
        "table": table.read_text() if table.exists() else None,
    }


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """The page's payload for `run_dir` (ValueError where it is none of the three kinds)."""
    run_dir = Path(run_dir)
    kind = kind_of(run_dir) if run_dir.is_dir() else None
    if kind is None:
        raise ValueError(
            f"{run_dir}: not a run directory (no metrics.jsonl + rollouts.jsonl, no stage `all` "
            "summary or RL arm sub-directory, no seeds.json)"
        )
    if kind == "study":
        body = _read_study(run_dir)
    elif kind == "arm":
        body = _read_arms({run_dir.name: run_dir})
        body["machine"] = body["arms"][run_dir.name]["machine"]
    else:
        body = _read_all(run_dir)
    return {"kind": kind, "title": str(run_dir.resolve()), "config": _config(run_dir), **body}
