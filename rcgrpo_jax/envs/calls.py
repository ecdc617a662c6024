"""Safe parsing of model text into tool calls, and rendering calls back into model formats.

Nothing here executes code: text is read with `ast.parse` / `json` only, and argument values
must be plain literals (numbers, strings, booleans, None, lists, tuples, sets, dicts). A call
is then identified by its name alone; which callables a name may reach is decided by the
executor (`envs/executor.py`), never by the text.

Decoded calls are kept as BFCL-style strings (`name(a, k='v')`), the shape bfcl-eval's
`multi_turn_checker` takes; `parse_call` turns such a string back into a `Call`.

Nothing here raises on model text. A call that is recognisably meant (a python call in the list,
a JSON object with a "name") but malformed (a non-literal or unhashable argument, a non-finite
number, a lone surrogate, a name that is not a function name, arguments that are not an object)
is kept as text that `parse_call` rejects with the reason, so executing it gives an error tool
message, in the episode and in the reward alike. Text that is no call at all yields no calls.
"""

from __future__ import annotations

import ast
import cmath
import json
import keyword
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("python", "qwen", "llama")


class CallError(ValueError):
    """A call string that is not a plain `name(literal, key=literal)` call."""


@dataclass(frozen=True)
class Call:
    """One tool call: a bare function name with literal positional and keyword arguments."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Literals


def _constant(value: Any) -> Any:
    """A literal's leaf value, refused where a simulator could not take it (or a call string
    could not carry it): `...`, NaN/inf, strings that are not valid unicode."""
    if value is Ellipsis:
        raise CallError("`...` is not a value")
    if (isinstance(value, float) and not math.isfinite(value)) or (
        isinstance(value, complex) and not cmath.isfinite(value)
    ):
        raise CallError(f"non-finite number {value!r} is not allowed")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise CallError("string is not valid unicode (lone surrogate)") from None
    return value


def _hashable(build, items, what: str) -> Any:
    """`build(items)` for a set or dict, with unhashable elements/keys as a CallError."""
    try:
        return build(items)
    except TypeError as e:
        raise CallError(f"{what} must be hashable: {e}") from None


def _literal(node: ast.AST) -> Any:
    """Value of a literal expression node; raises CallError on anything that could run code."""
    if isinstance(node, ast.Constant):
        return _constant(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float, complex)):
            raise CallError("unary sign applied to a non-number")
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e) for e in node.elts)
    if isinstance(node, ast.Set):
        return _hashable(set, [_literal(e) for e in node.elts], "set elements")
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # `{**x}`
            raise CallError("dict unpacking is not a literal")
        pairs = [(_literal(k), _literal(v)) for k, v in zip(node.keys, node.values, strict=True)]
        return _hashable(dict, pairs, "dict keys")
    raise CallError(f"argument is not a literal: {type(node).__name__}")


def _parse(source: str) -> ast.expr:
    """`ast.parse` in eval mode, silent: model text must not print warnings (invalid escapes,
    `1ls`) on every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source, mode="eval").body


def _call_from_node(node: ast.AST) -> Call:
    """Call from an `ast.Call` node whose callee is a bare name and whose arguments are literals."""
    if not isinstance(node, ast.Call):
        raise CallError(f"not a function call: {type(node).__name__}")
    if not isinstance(node.func, ast.Name):
        raise CallError("callee must be a bare function name")
    args = []
    for arg in node.args:
        if isinstance(arg, ast.Starred):
            raise CallError("*args is not allowed")
        args.append(_literal(arg))
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise CallError("**kwargs is not allowed")
        if kw.arg in kwargs:
            raise CallError(f"keyword argument repeated: {kw.arg}")
        kwargs[kw.arg] = _literal(kw.value)
    return Call(node.func.id, tuple(args), kwargs)


def parse_call(text: str) -> Call:
    """Parse one call string such as `mv(source='a', destination='b')` (no code is run).

    A JSON tool-call object (what the JSON extractors keep of a malformed call) is refused with
    the reason it was refused for: JSON never runs.
    """
    text = text.strip()
    if text.startswith("{"):
        return _refuse_json_call(text)
    try:
        tree = _parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CallError(f"invalid call syntax: {e}") from None
    try:
        return _call_from_node(tree)
    except RecursionError:
        raise CallError("argument nested too deeply") from None


def format_call(call: Call) -> str:
    """BFCL-style call string; `parse_call(format_call(c)) == c` for every parsed call."""
    parts = [repr(a) for a in call.args] + [f"{k}={v!r}" for k, v in call.kwargs.items()]
    return f"{call.name}({','.join(parts)})"


_CALLEE = re.compile(r"\s*([^\W\d]\w*)\s*\(")


def call_name(text: str) -> str:
    """Function name of a decoded call string, even a malformed one ("" if it names none):
    the name its tool message carries."""
    try:
        return parse_call(text).name
    except CallError:
        pass
    if text.lstrip().startswith("{"):
        try:
            name = json.loads(text).get("name")
        except (ValueError, RecursionError, AttributeError):
            return ""
        return name if _is_name(name) else ""
    match = _CALLEE.match(text)
    return match.group(1) if match else ""


def bind_positional(call: Call, param_names: Sequence[str]) -> Call:
    """Same call with positional arguments named by the function's parameter order.

    JSON tool-call formats only carry named arguments; ground-truth calls such as
    `sort('final_report.pdf')` must be named before they can be shown in those formats.
    """
    if not call.args:
        return call
    if len(call.args) > len(param_names):
        raise CallError(f"{call.name}: too many positional arguments")
    named = dict(zip(param_names, call.args, strict=False))
    clash = set(named) & set(call.kwargs)
    if clash:
        raise CallError(f"{call.name}: argument given twice: {sorted(clash)}")
    return Call(call.name, (), {**named, **call.kwargs})


# ---------------------------------------------------------------------------------------------
# Model text -> call strings


def _is_name(text: Any) -> bool:
    """A string usable as a function or keyword-argument name in a call string."""
    return isinstance(text, str) and text.isidentifier() and not keyword.iskeyword(text)


def _json_value(value: Any) -> Any:
    """A decoded JSON value with its leaves checked like python literals (NaN/inf, surrogates)."""
    if isinstance(value, dict):
        return {_constant(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return _constant(value)


def _call_from_json(obj: Any, args_key: str) -> Call | None:
    """Call from a `{"name": ..., args_key: {...}}` object; None if `obj` is no call at all (not
    an object with a "name"); CallError if it is a malformed one."""
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    name = obj["name"]
    if not _is_name(name):
        shown = repr(name[:40]) if isinstance(name, str) else type(name).__name__
        raise CallError(f"tool call name must be a function name, got {shown}")
    args = _json_args(obj, args_key)
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            raise CallError(f"{name}: arguments are a string that is not JSON") from None
    if not isinstance(args, dict):
        raise CallError(f"{name}: arguments must be an object, got {type(args).__name__}")
    bad = next((k for k in args if not _is_name(k)), None)
    if bad is not None:
        raise CallError(f"{name}: argument name {bad[:40]!r} is not an identifier")
    try:
        return Call(name, (), _json_value(args))
    except RecursionError:
        raise CallError(f"{name}: argument nested too deeply") from None


def _json_args(obj: dict, args_key: str) -> Any:
    """The arguments of a JSON call: under `args_key`, else under the other format's key."""
    other = "parameters" if args_key == "arguments" else "arguments"
    return obj.get(args_key, obj.get(other, {}))


def _refuse_json_call(text: str) -> Call:
    """CallError for a kept malformed JSON call, with the reason it was refused for."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise CallError("invalid JSON tool call") from None
    _call_from_json(obj, "arguments")  # raises the reason
    raise CallError("a JSON tool call is not a call string")


def _json_call_text(obj: Any, args_key: str) -> str | None:
    """Decoded call string of a JSON object: the BFCL call; for a malformed call, its name and
    arguments as JSON (which `parse_call` refuses with the same reason); None if `obj` is no
    call."""
    try:
        call = _call_from_json(obj, args_key)
    except CallError:
        kept = {"name": obj["name"], "arguments": _json_args(obj, args_key)}
        try:
            return json.dumps(kept, ensure_ascii=True)
        except (ValueError, RecursionError):  # nested past what json can write back
            name = obj["name"] if _is_name(obj["name"]) else None
            return json.dumps({"name": name, "arguments": "<nested too deeply>"})
    return None if call is None else format_call(call)


def _python_calls(text: str) -> list[str]:
    """BFCL's prompting format `[f(a=1), g(b='x')]`, normalised as bfcl-eval does."""
    body = text.strip("`\n ")
    if not body.startswith("["):
        body = "[" + body
    if not body.endswith("]"):
        body = body + "]"
    try:
        tree = _parse(body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    elements = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    out = []
    for node in elements:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            return []  # prose or nested structure: not a call list
        try:
            out.append(format_call(_call_from_node(node)))
        except (CallError, RecursionError):
            # Keep the text: executing it yields an error result, as it would in BFCL.
            out.append(ast.get_source_segment(body, node) or node.func.id + "(?)")
    return out


_QWEN_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _qwen_calls(text: str) -> list[str]:
    """Qwen2.5 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    Blocks that are not JSON, or JSON without a "name", are skipped, as bfcl-eval's Qwen handler
    does; a malformed call is kept (an error result when executed).
    """
    out = []
    for block in _QWEN_BLOCK.findall(text):
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            continue
        call_text = _json_call_text(obj, "arguments")
        if call_text is not None:
            out.append(call_text)
    return out


def _llama_calls(text: str) -> list[str]:
    """LLaMA-3.1 `{"name": ..., "parameters": {...}}` objects (optionally after `<|python_tag|>`,
    separated by `;` or `,`, or wrapped in a list). Anything else in the text means no calls."""
    body = text.replace("<|python_tag|>", "").strip()
    for stop in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(stop).strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] in ";,"):
            pos += 1
        if pos == len(body):
            return out
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return []
        call_text = _json_call_text(obj, "parameters")
        if call_text is None:
            return []
        out.append(call_text)


_EXTRACTORS = {"python": _python_calls, "qwen": _qwen_calls, "llama": _llama_calls}


def extract_calls(text: str, fmt: str) -> list[str]:
    """Decoded call strings in `text` (model output in format `fmt`); [] means "no call".

    Like bfcl-eval's decoders, text that is not a call list yields no calls, which ends the turn.
    """
    if fmt not in _EXTRACTORS:
        raise ValueError(f"unknown call format {fmt!r}; expected one of {FORMATS}")
    return _EXTRACTORS[fmt](text)


# ---------------------------------------------------------------------------------------------
# Calls -> model text (reference policies, SFT targets)


def render_calls(calls: Sequence[Call], fmt: str) -> str:
    """Assistant text that `extract_calls(text, fmt)` decodes back into `calls`.

    JSON formats need named arguments: pass calls through `bind_positional` first.
    """
    if fmt == "python":
        return "[" + ", ".join(format_call(c) for c in calls) + "]"
    if any(c.args for c in calls):
        raise CallError("JSON call formats need named arguments (use bind_positional)")
    if fmt == "qwen":
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.kwargs}) + "\n</tool_call>"
            for c in calls
        )
    if fmt == "llama":
        return "; ".join(json.dumps({"name": c.name, "parameters": c.kwargs}) for c in calls)
    raise ValueError(f"unknown call format {fmt!r}; expected one of {FORMATS}")
