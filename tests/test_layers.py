"""The package's layering, read from the code's own imports (module-level and function-local).

A library layer imports only layers below it: models ← sampling; models, envs ← data ← train ←
rl ← stages ← tools ← main. `config`, `errors`, `distributed`, `logs`, `host_memory`,
`compilation` and `machine` are usable from anywhere and import none of the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "rcgrpo_jax"
RANK = {
    "assets": 0, "models": 0, "sampling": 1, "envs": 1, "data": 2, "train": 3, "rl": 4,
    "stages": 5, "config_check": 5, "tools": 6, "main": 7,
}  # fmt: skip
ANYWHERE = {
    "config", "errors", "distributed", "logs", "host_memory", "compilation", "machine", "__init__",
}  # fmt: skip


def unit(module: str) -> str:
    """The layer of a dotted module inside the package ("rcgrpo_jax.rl.losses" -> "rl")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """Every rcgrpo_jax module `path` imports, wherever the import statement sits."""
    here = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rcgrpo_jax")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module == "rcgrpo_jax":  # from rcgrpo_jax import models, ...
                found |= {f"rcgrpo_jax.{a.name}" for a in node.names}
            elif module.startswith("rcgrpo_jax"):
                found.add(module)
    return found


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = unit(".".join(path.relative_to(REPO).with_suffix("").parts))
        for module in sorted(imports(path)):
            theirs = unit(module)
            if theirs == mine:
                continue
            if mine in ANYWHERE:
                ok = theirs in ANYWHERE
            else:
                ok = theirs in ANYWHERE or RANK[theirs] < RANK[mine]
            if not ok:
                out.append(f"{path.relative_to(REPO)} imports {module}")
    return out


def test_every_module_has_a_layer():
    units = {
        unit(".".join(p.relative_to(REPO).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")
    }
    assert units <= set(RANK) | ANYWHERE, sorted(units - set(RANK) - ANYWHERE)


def test_no_import_runs_upward():
    assert violations() == []


def test_the_walk_sees_function_local_and_relative_imports():
    """The checker itself: an upward import inside a function, or a relative one, is caught."""
    fake = PACKAGE / "models" / "_layer_probe.py"
    fake.write_text("def f():\n    from ..rl import losses\n    from rcgrpo_jax import stages\n")
    try:
        assert imports(fake) == {"rcgrpo_jax.rl", "rcgrpo_jax.stages"}
        assert {v.split()[-1] for v in violations() if "_layer_probe" in v} == {
            "rcgrpo_jax.rl", "rcgrpo_jax.stages",
        }  # fmt: skip
    finally:
        fake.unlink()
