"""The package stays ruff-clean, never calls eval/exec (model text must not reach them), its
`--help` texts print the usage lines as written, and its imports follow `rcgrpo_jax.layers`."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    out = subprocess.run(
        [ruff, "check", "rcgrpo_jax", "tests", "bench", "configs"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_eval_or_exec_in_package():
    pattern = re.compile(r"(^|[^_.a-zA-Z])(eval|exec)\(")
    hits = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in (REPO / "rcgrpo_jax").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


def test_no_backslash_line_joins():
    """A line ending in one backslash inside a docstring joins the next line onto it, so a
    tool's `--help` prints its usage as one line with a run of spaces; the shell continuation
    a usage line shows is written as two backslashes. (Code never needs the join either.)"""
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for root in ("rcgrpo_jax", "bench", "configs", "launch")
        for p in (REPO / root).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.endswith("\\") and not line.endswith("\\\\")
    ]
    assert not hits, hits


# ------------------------------------------------------------------ layers (rcgrpo_jax.layers)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    out = {}
    for p in sorted((REPO / "rcgrpo_jax").rglob("*.py")):
        parts = p.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _unit(module: str) -> str:
    """The top-level module or subpackage a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for each import of the package in `module`:
    `import` statements (module level = outside any function and outside `if TYPE_CHECKING:`)
    and string constants that name a module of the package (what `importlib` is handed)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "rcgrpo_jax":
                    found.append((nearest(a.name), node.lineno, top))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "rcgrpo_jax":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub if sub in modules else nearest(base), node.lineno, top))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "." in node.value and node.value in modules and node.value != module:
                found.append((node.value, node.lineno, False))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            top = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, top)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, top)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _import_graph() -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, at module level) over the whole package."""
    modules = _modules()
    return [
        (m, target, line, top)
        for m, path in modules.items()
        for target, line, top in _imports(m, path, modules)
    ]


LONG_MODULE = 500  # lines; a longer module says at its top why it stays one module
_REASON = re.compile(r"\b(long|one file|one module)\b[^.]*\bbecause\b", re.IGNORECASE | re.DOTALL)


def test_a_long_module_says_why_at_its_top():
    """Over `LONG_MODULE` lines, a module's docstring gives its reason ("... long because ...",
    "... stays one file ... because ...")."""
    missing = []
    for path in sorted((REPO / "rcgrpo_jax").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > LONG_MODULE:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not _REASON.search(doc):
                missing.append(f"{path.relative_to(REPO)} ({len(text.splitlines())} lines)")
    assert not missing, missing


def test_the_layers_table_names_every_unit_once():
    from rcgrpo_jax.layers import LAYERS

    listed = [u for floor in LAYERS for u in floor]
    units = {_unit(m) for m in _modules()} - {""}
    assert len(listed) == len(set(listed)), "a unit on two floors"
    assert set(listed) == units, (
        f"not in rcgrpo_jax.layers.LAYERS: {sorted(units - set(listed))}; "
        f"listed but absent: {sorted(set(listed) - units)}"
    )


def test_imports_go_only_downward():
    """Per `rcgrpo_jax.layers`: a module imports its own unit or a lower floor, never its own
    floor's other units nor a higher floor, function-local imports included."""
    from rcgrpo_jax.layers import LAYERS

    floor = {u: i for i, units in enumerate(LAYERS) for u in units}
    bad = []
    for src, dst, line, _ in _import_graph():
        a, b = _unit(src), _unit(dst)
        if a == b or b == "":
            continue
        if floor[b] >= floor[a]:
            way = "sideways" if floor[b] == floor[a] else "upward"
            bad.append(f"{src}:{line} imports {dst} ({way}: {a} -> {b})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_at_module_level():
    """Imports made when a module loads never come back to it (function-local and
    TYPE_CHECKING imports are not made then)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, top in _import_graph():
        if top and src != dst:
            graph.setdefault(src, set()).add(dst)
    cycles, done, path = [], set(), []

    def walk(m: str) -> None:
        if m in path:
            cycles.append(" -> ".join([*path[path.index(m) :], m]))
            return
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            walk(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        walk(m)
    assert not cycles, "\n".join(cycles)
