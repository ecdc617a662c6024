"""Our executor for BFCL's multi-turn simulators: per-trajectory instances, name-based dispatch.

bfcl-eval's own executor `eval`s each call string with the instance name prefixed and caches
instances forever in module globals. Here a call string is parsed into literals
(`calls.parse_call`) and dispatched by name to a bound public method of one of the
trajectory's own instances; results are stringified exactly as bfcl-eval does, so the
checker in `reward.py` can compare them with the ground truth's.

Every simulator call runs under a wall-clock limit (`call_timeout_s`). In the main thread (where
rollouts run) a SIGALRM timer raises `CallTimeout` inside the call, which stops a pure-Python
loop or a sleep; elsewhere the call runs in a daemon thread that is abandoned when late (a thread
cannot be killed; it holds only that trajectory's instances). A C routine that holds the GIL
(e.g. a huge integer power, hence `_costly`) cannot be interrupted by either.
"""

from __future__ import annotations

import copy
import decimal
import functools
import importlib
import inspect
import json
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import mpmath
from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    STATELESS_CLASSES,
)

from rcgrpo_jax.envs.calls import Call, CallError, parse_call

ERROR_PREFIX = "Error during execution: "

# Inputs that make a simulator method run for minutes or exhaust memory (bfcl-eval would hang
# too). Such a call returns an error string instead of being dispatched.
MAX_INT_EXPONENT = 10_000
MAX_PRECISION = 1_000

CALL_TIMEOUT_S = 5.0  # default wall-clock limit of one simulator call (config env.call_timeout_s)

Instances = dict[str, Any]
MethodTable = dict[str, Callable[..., Any]]


@functools.cache
def simulator_class(class_name: str) -> type:
    """The bfcl-eval simulator class called `class_name` (e.g. "GorillaFileSystem")."""
    module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
    return getattr(module, class_name)


@functools.cache
def public_methods(class_name: str) -> tuple[str, ...]:
    """Method names bfcl-eval exposes for a class: bound methods not starting with '_'."""
    instance = simulator_class(class_name)()
    members = inspect.getmembers(instance, predicate=inspect.ismethod)
    return tuple(name for name, _ in members if not name.startswith("_"))


def load_instances(
    initial_config: Mapping[str, Any],
    involved_classes: Iterable[str],
    long_context: bool,
    copies: int = 1,
) -> list[Instances]:
    """`copies` fresh instance sets, each set up from `initial_config` as bfcl-eval does.

    In long-context mode some simulators put module-level objects into their state (TravelAPI's
    extension cards and bookings). Those sets are deep-copied together, so nothing is shared
    with the module (no leak between trajectories) while objects stay shared between the
    copies exactly as they are between the model's and the ground truth's instances inside
    bfcl-eval's checker. Otherwise all state comes from deep copies already.
    """
    sets = []
    for _ in range(copies):
        instances: Instances = {}
        for class_name in involved_classes:
            instance = simulator_class(class_name)()
            if class_name not in STATELESS_CLASSES:
                config = copy.deepcopy(initial_config.get(class_name, {}))
                instance._load_scenario(config, long_context=long_context)
            instances[class_name] = instance
        sets.append(instances)
    return copy.deepcopy(sets) if long_context else sets


def method_table(instances: Instances, hidden: Iterable[str] = ()) -> MethodTable:
    """Name -> bound method over the given instances, minus `hidden` names.

    Later classes win on a name clash, as in bfcl-eval (no clash exists in v4).
    """
    hidden = set(hidden)
    return {
        name: getattr(instance, name)
        for class_name, instance in instances.items()
        for name in public_methods(class_name)
        if name not in hidden
    }


def result_text(result: Any) -> str:
    """Stringify a method's return value exactly as bfcl-eval's executor does."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:  # noqa: BLE001 - bfcl-eval falls back on any failure
            return str(result)
    return str(result)


def _arg(call: Call, index: int, name: str) -> Any:
    """Argument `name` of a call, given by keyword or at position `index`."""
    if name in call.kwargs:
        return call.kwargs[name]
    return call.args[index] if index < len(call.args) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _costly(call: Call) -> str | None:
    """Why a call would run away (huge integer power, huge precision), else None."""
    if call.name == "power":
        base, exponent = _arg(call, 0, "base"), _arg(call, 1, "exponent")
        if _is_int(base) and _is_int(exponent) and abs(base) > 1 and exponent > MAX_INT_EXPONENT:
            return f"integer exponent larger than {MAX_INT_EXPONENT} is not supported"
    position = {"logarithm": 2, "square_root": 1}.get(call.name)
    if position is not None:
        precision = _arg(call, position, "precision")
        if isinstance(precision, (int, float)) and precision > MAX_PRECISION:
            return f"precision larger than {MAX_PRECISION} is not supported"
    return None


class CallTimeout(BaseException):
    """A simulator call ran past its time limit. A BaseException, so that it unwinds through
    the simulator's own `except Exception` handlers; the instances it ran on may be half
    updated, so the trajectory must end (see `rl.rollout`)."""


def _alarm_call(fn: Callable[[], Any], limit_s: float) -> Any:
    """fn() in the main thread, interrupted by SIGALRM after `limit_s` (an outer timer is
    restored afterwards, delayed by at most the call)."""

    def on_alarm(signum, frame):
        raise CallTimeout(f"simulator call took longer than {limit_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, limit_s)
    start = time.monotonic()
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _thread_call(fn: Callable[[], Any], limit_s: float) -> Any:
    """fn() in a daemon thread; CallTimeout if it has not finished after `limit_s` (it then
    runs on, abandoned, and does not keep the process from exiting)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, name="simulator-call", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise CallTimeout(f"simulator call took longer than {limit_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_with_limit(fn: Callable[[], Any], limit_s: float | None) -> Any:
    """fn() bounded by `limit_s` seconds of wall time (None or <= 0: unbounded)."""
    if not limit_s or limit_s <= 0:
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _alarm_call(fn, limit_s)
    return _thread_call(fn, limit_s)


def execute(call_text: str, table: MethodTable, timeout_s: float | None = None) -> str:
    """Run one decoded call string against `table`; any failure becomes an error string,
    except a call past `timeout_s`, which raises CallTimeout.

    Only names in `table` can be reached and only with literal arguments; nothing in
    `call_text` is ever compiled or run. Decimal/mpmath precision set by a method is
    confined to the call.
    """
    try:
        call = parse_call(call_text)
    except CallError as e:
        return ERROR_PREFIX + str(e)
    method = table.get(call.name)
    if method is None:
        return f"{ERROR_PREFIX}name '{call.name}' is not defined"
    too_costly = _costly(call)
    if too_costly:
        return ERROR_PREFIX + too_costly
    dps = mpmath.mp.dps
    try:
        with decimal.localcontext():
            result = call_with_limit(lambda: method(*call.args, **call.kwargs), timeout_s)
    except Exception as e:  # noqa: BLE001 - simulator errors become the tool result
        return ERROR_PREFIX + str(e)
    finally:
        mpmath.mp.dps = dps
    return result_text(result)


def execute_all(
    call_texts: Iterable[str], table: MethodTable, timeout_s: float | None = None
) -> list[str]:
    """Results of several decoded calls, in order."""
    return [execute(text, table, timeout_s) for text in call_texts]


def public_state(instance: Any) -> dict[str, Any]:
    """Public attributes of a simulator: what bfcl-eval's state check compares."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def state_differences(model: Instances, truth: Instances) -> dict[str, dict[str, Any]]:
    """Per class, the public attributes of `truth` whose value differs in `model`.

    Mirrors bfcl-eval's `_compare_instances`: attributes are taken from the ground truth
    instance and compared with `!=`.
    """
    missing = object()
    out: dict[str, dict[str, Any]] = {}
    for class_name, truth_instance in truth.items():
        model_instance = model[class_name]
        diffs = {
            attr: {"model": getattr(model_instance, attr, missing), "ground_truth": value}
            for attr, value in public_state(truth_instance).items()
            if getattr(model_instance, attr, missing) != value
        }
        if diffs:
            out[class_name] = diffs
    return out


def parameter_names(involved_classes: Iterable[str], function: str) -> tuple[str, ...]:
    """Parameter names of `function` (a public method of one of the classes), in order."""
    for class_name in involved_classes:
        if function in public_methods(class_name):
            method = getattr(simulator_class(class_name), function)
            return tuple(p for p in inspect.signature(method).parameters if p != "self")
    raise KeyError(f"{function} is not a method of {list(involved_classes)}")
