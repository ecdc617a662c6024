"""XLA compilation: the persistent cache every run shares, and how long compiling took.

A run compiles the same programs as the run before it (the same model, shapes and settings), so
JAX's persistent compilation cache is on by default: a second run, another workdir, a resumed
run or a test reuses each program from disk instead of compiling it again. Where it lives:
`compile.cache_dir`, else `$JAX_COMPILATION_CACHE_DIR`, else `$XDG_CACHE_HOME/rcgrpo_jax/xla`
(`~/.cache/rcgrpo_jax/xla`). The cache key covers the program, the backend, the device count and
the XLA flags, so a changed compile (`XLA_FLAGS=--xla_cpu_max_isa=AVX2`) never reads another's.

`stats()` counts, from JAX's monitoring events, the seconds spent making programs (tracing,
lowering, and the backend compile or its cache read) and how many programs were compiled or read
from the cache; the metrics writer logs the seconds since its previous record as `compile_s`,
and each stage's end line says what it spent.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from pathlib import Path

# JAX's monitoring events of making one program (dispatch.py / compiler.py).
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"  # includes a persistent-cache read
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Stats:
    """Cumulative since the process started: seconds making programs, backend programs made
    (compiled or read from the persistent cache) and of those the cache reads."""

    seconds: float = 0.0
    programs: int = 0
    cache_hits: int = 0

    def __sub__(self, other: Stats) -> Stats:
        return Stats(
            self.seconds - other.seconds,
            self.programs - other.programs,
            self.cache_hits - other.cache_hits,
        )

    def describe(self) -> str:
        """'compile 12.3 s (5 programs, 2 from cache)'."""
        cached = f", {self.cache_hits} from cache" if self.cache_hits else ""
        return f"compile {self.seconds:.1f} s ({self.programs} programs{cached})"


_lock = threading.Lock()
_totals = {"seconds": 0.0, "programs": 0, "cache_hits": 0}
_by_name: collections.Counter[str] = collections.Counter()
_listening = False


def _on_duration(event: str, duration: float, fun_name: str = "", **_: object) -> None:
    if event in (_TRACE, _LOWER, _BACKEND):
        with _lock:
            _totals["seconds"] += duration
            if event == _BACKEND:
                _totals["programs"] += 1
                _by_name[fun_name] += 1


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _totals["cache_hits"] += 1


def track() -> None:
    """Starts counting (idempotent); `stats()` calls it, so the first call starts the count."""
    global _listening
    if _listening:
        return
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)
    _listening = True


def stats() -> Stats:
    track()
    with _lock:
        return Stats(**_totals)


def programs(name: str) -> int:
    """Backend programs made so far for jitted functions named `name` (e.g. "jit(step_fn)")."""
    track()
    with _lock:
        return _by_name[name]


def default_cache_dir() -> Path:
    """$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/rcgrpo_jax/xla (~/.cache/...)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rcgrpo_jax" / "xla"


def configure(enabled: bool = True, cache_dir: str = "") -> Path | None:
    """Turns the persistent cache on in `cache_dir` (default `default_cache_dir()`) for every
    program, however fast it compiled (CPU programs compile in well under JAX's default 1 s
    threshold), or off. Returns the directory in use (None: off). Takes effect from the next
    compile on, also in a process that has compiled before."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    track()
    compilation_cache.reset_cache()  # the next compile reads the settings below afresh
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        from rcgrpo_jax.errors import UserError

        raise UserError(
            f"compile.cache_dir: cannot use {path} for the compilation cache ({e}); set "
            "compile.cache_dir to a writable directory, or compile.cache=False"
        ) from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def configure_from(config) -> Path | None:
    """`configure` with the config's `compile.cache` / `compile.cache_dir`."""
    return configure(bool(config.compile.cache), str(config.compile.cache_dir))


class Span:
    """Wall time and compile time since it was made: what one stage spent."""

    def __init__(self) -> None:
        import time

        self._clock = time.perf_counter
        self._t0 = self._clock()
        self._stats0 = stats()

    def summary(self) -> dict[str, float | int]:
        """{wall_s, compile_s, programs, cache_hits} since the span began (summary.json)."""
        spent = stats() - self._stats0
        return {
            "wall_s": round(self._clock() - self._t0, 2),
            "compile_s": round(spent.seconds, 2),
            "programs": spent.programs,
            "cache_hits": spent.cache_hits,
        }

    def describe(self, summary: dict[str, float | int] | None = None) -> str:
        """'81.0 s, compile 5.2 s (4 programs)': of `summary` (one `summary()`, so that the line
        and summary.json show the same numbers), else of now."""
        s = summary or self.summary()
        spent = Stats(float(s["compile_s"]), int(s["programs"]), int(s["cache_hits"]))
        return f"{float(s['wall_s']):.1f} s, {spent.describe()}"
