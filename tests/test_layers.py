"""The layering check itself (tests/test_style.py, against `rcgrpo_jax.layers`) on a probe
module: an upward import inside a function, or a relative one, is found and is upward.

The probe sits in a package of the same name under tmp_path, never in the source tree, which
other tests read (and ruff checks) while this one runs.
"""

from __future__ import annotations

from test_style import _imports, _modules, _unit

from rcgrpo_jax.layers import LAYERS

PROBE = "rcgrpo_jax.models._layer_probe"


def test_the_walk_sees_function_local_and_relative_imports(tmp_path):
    probe = tmp_path / "rcgrpo_jax" / "models" / "_layer_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..rl import losses\n    from rcgrpo_jax import stages\n")
    found = _imports(PROBE, probe, {**_modules(), PROBE: probe})
    # (module, at module level): both imports are seen, neither is made when the module loads
    assert {(m, top) for m, _, top in found} == {
        ("rcgrpo_jax.rl.losses", False), ("rcgrpo_jax.stages", False),
    }  # fmt: skip
    floor = {u: i for i, units in enumerate(LAYERS) for u in units}
    assert {_unit(m) for m, _, _ in found} == {"rl", "stages"}
    assert all(floor[_unit(m)] > floor["models"] for m, _, _ in found)  # both upward
