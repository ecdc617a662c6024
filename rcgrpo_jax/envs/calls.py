"""Safe parsing of model text into tool calls, and rendering calls back into model formats.

Nothing here executes code: text is read with `ast.parse` / `json` only, and argument values
must be plain literals (numbers, strings, booleans, None, lists, tuples, sets, dicts). A call
is then identified by its name alone; which callables a name may reach is decided by the
executor (`envs/executor.py`), never by the text.

Decoded calls are kept as BFCL-style strings (`name(a, k='v')`), the shape bfcl-eval's
`multi_turn_checker` takes; `parse_call` turns such a string back into a `Call`.
"""

from __future__ import annotations

import ast
import json
import re
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


def _literal(node: ast.AST) -> Any:
    """Value of a literal expression node; raises CallError on anything that could run code."""
    if isinstance(node, ast.Constant):
        return node.value
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
        return {_literal(e) for e in node.elts}
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # `{**x}`
            raise CallError("dict unpacking is not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    raise CallError(f"argument is not a literal: {type(node).__name__}")


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
    """Parse one call string such as `mv(source='a', destination='b')` (no code is run)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CallError(f"invalid call syntax: {e}") from None
    try:
        return _call_from_node(tree.body)
    except RecursionError:
        raise CallError("argument nested too deeply") from None


def format_call(call: Call) -> str:
    """BFCL-style call string; `parse_call(format_call(c)) == c` for finite values."""
    parts = [repr(a) for a in call.args] + [f"{k}={v!r}" for k, v in call.kwargs.items()]
    return f"{call.name}({','.join(parts)})"


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


def _reject_non_finite(token: str) -> float:
    raise ValueError(f"non-finite number {token} is not allowed")


def _json_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_non_finite)


def _call_from_json(obj: Any, args_key: str) -> Call | None:
    """Call from a `{"name": ..., args_key: {...}}` object, or None if it has another shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = _json_loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or not obj["name"].isidentifier():
        return None
    return Call(obj["name"], (), dict(args))


def _python_calls(text: str) -> list[str]:
    """BFCL's prompting format `[f(a=1), g(b='x')]`, normalised as bfcl-eval does."""
    body = text.strip("`\n ")
    if not body.startswith("["):
        body = "[" + body
    if not body.endswith("]"):
        body = body + "]"
    try:
        tree = ast.parse(body, mode="eval").body
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

    Blocks that are not such JSON are skipped, as bfcl-eval's Qwen handler does.
    """
    out = []
    for block in _QWEN_BLOCK.findall(text):
        try:
            call = _call_from_json(_json_loads(block), "arguments")
        except (ValueError, RecursionError):
            continue
        if call is not None:
            out.append(format_call(call))
    return out


def _llama_calls(text: str) -> list[str]:
    """LLaMA-3.1 `{"name": ..., "parameters": {...}}` objects (optionally after `<|python_tag|>`,
    separated by `;` or `,`, or wrapped in a list). Anything else in the text means no calls."""
    body = text.replace("<|python_tag|>", "").strip()
    for stop in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(stop).strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    decoder = json.JSONDecoder(parse_constant=_reject_non_finite)
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
        call = _call_from_json(obj, "parameters")
        if call is None:
            return []
        out.append(format_call(call))


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
