"""Parsing model text into calls (BFCL python lists, Qwen2.5/LLaMA-3.1 JSON), running nothing."""

from __future__ import annotations

import pytest

from rcgrpo_jax.envs.calls import (
    Call,
    CallError,
    bind_positional,
    extract_calls,
    format_call,
    parse_call,
    render_calls,
)

CALLS = [
    Call("cd", (), {"folder": "document"}),
    Call("sort", ("final_report.pdf",), {}),
    Call("mean", (), {"numbers": [1, 2.5, -3]}),
    Call("post", (), {"tags": ["#a", "#b"], "meta": {"k": None, "ok": True}}),
    Call("fill", (), {"amount": -0.25, "text": 'it\'s "quoted"\nnewline'}),
    Call("ls", (), {}),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_format_parse_round_trip(call):
    assert parse_call(format_call(call)) == call


def test_parse_keeps_python_literal_types():
    call = parse_call("f(1, x=(1, 2), y={3}, z=-4.5e3, w=b'x', v=+2)")
    assert call == Call("f", (1,), {"x": (1, 2), "y": {3}, "z": -4500.0, "w": b"x", "v": 2})


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "os.system('true')",
        "ls(a=__import__('os').getpid())",
        "ls(a=(lambda: 1)())",
        "ls(a=f'{1+1}')",
        "ls(a=[i for i in range(3)])",
        "ls(a=1+1)",
        "ls(*[1])",
        "ls(**{'a': 1})",
        "ls(a=x)",
        "ls(a=-'x')",
        "ls(a=1, a=2)",
        "ls()()",
        "ls",
        "ls(",
        "[ls()]",
        "ls(); rm('x')",
        "ls(a={**{}})",
    ],
)
def test_parse_call_rejects_anything_but_literal_calls(text):
    with pytest.raises(CallError):
        parse_call(text)


def test_python_format_like_bfcl():
    text = "[cd(folder='document'), mkdir(dir_name='temp'), sort('a.txt')]"
    assert extract_calls(text, "python") == [
        "cd(folder='document')",
        "mkdir(dir_name='temp')",
        "sort('a.txt')",
    ]
    # bfcl-eval strips backticks/newlines and adds missing brackets.
    assert extract_calls("```\ncd(folder='x')\n```", "python") == ["cd(folder='x')"]
    assert extract_calls("cd(folder='x'), ls()", "python") == ["cd(folder='x')", "ls()"]
    # Prose is no call (the turn ends), as bfcl-eval's decoder raises on it.
    assert extract_calls("I have completed the request.", "python") == []
    assert extract_calls("[]", "python") == []
    assert extract_calls("Sure: [ls()]", "python") == []


def test_python_format_keeps_non_literal_calls_as_text_that_fails():
    out = extract_calls("[ls(a=__import__('os').getpid()), cd(folder='x')]", "python")
    assert out == ["ls(a=__import__('os').getpid())", "cd(folder='x')"]
    with pytest.raises(CallError):
        parse_call(out[0])


def test_qwen_format():
    text = (
        "Let me do that.\n<tool_call>\n"
        '{"name": "cd", "arguments": {"folder": "document"}}\n</tool_call>\n'
        "<tool_call>\n{bad json}\n</tool_call>\n"
        '<tool_call>{"name": "mean", "arguments": "{\\"numbers\\": [1, 2]}"}</tool_call>'
    )
    assert extract_calls(text, "qwen") == ["cd(folder='document')", "mean(numbers=[1, 2])"]
    assert extract_calls("No tools needed.", "qwen") == []
    # A malformed call is kept as its JSON, which parse_call rejects (an error tool message).
    for block in [
        '{"name": 3}',
        '{"name": "a.b", "arguments": {}}',
        '{"name": "f", "arguments": {"x": NaN}}',
    ]:
        (kept,) = extract_calls(f"<tool_call>{block}</tool_call>", "qwen")
        with pytest.raises(CallError):
            parse_call(kept)


def test_llama_format():
    one = '{"name": "cd", "parameters": {"folder": "document"}}'
    two = '{"name": "ls", "parameters": {}}'
    assert extract_calls(one, "llama") == ["cd(folder='document')"]
    assert extract_calls("<|python_tag|>" + one + "<|eom_id|>", "llama") == [
        "cd(folder='document')"
    ]
    assert extract_calls(f"{one}; {two}", "llama") == ["cd(folder='document')", "ls()"]
    assert extract_calls(f"[{one}, {two}]", "llama") == ["cd(folder='document')", "ls()"]
    assert extract_calls(f"Calling {one}", "llama") == []
    assert extract_calls("The file was moved.", "llama") == []
    assert extract_calls('{"answer": 1}', "llama") == []


def test_unknown_format():
    with pytest.raises(ValueError):
        extract_calls("[ls()]", "xml")


@pytest.mark.parametrize("fmt", ["python", "qwen", "llama"])
def test_render_then_extract(fmt):
    calls = [bind_positional(c, ("file_name",)) for c in CALLS]
    assert [parse_call(s) for s in extract_calls(render_calls(calls, fmt), fmt)] == calls


def test_bind_positional():
    assert bind_positional(Call("sort", ("a",), {}), ("file_name",)) == Call(
        "sort", (), {"file_name": "a"}
    )
    with pytest.raises(CallError):
        bind_positional(Call("f", (1, 2), {}), ("a",))
    with pytest.raises(CallError):
        bind_positional(Call("f", (1,), {"a": 2}), ("a",))
    with pytest.raises(CallError):
        render_calls([Call("sort", ("a",), {})], "qwen")
