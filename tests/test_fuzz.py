"""Fuzz: seeded, grammar-built hostile and malformed assistant texts through `Episode`.

Per chat format, `N_TEXTS` texts are generated from a small grammar: calls to public, hidden
(miss_func, before their reveal turn), private, dunder, builtin and foreign-class names; argument
values that are code-injection payloads (at every argument position: positional, keyword, inside
containers, as dict keys, as JSON names and keys), deep nesting, huge strings and numbers,
unicode (lone surrogates, RTL overrides, NUL, look-alikes), NaN/inf, unhashable set elements and
dict keys, duplicate keywords; then broken by mutations (cut, stray brackets and tags, prose).
Each text is one assistant step of an `Episode` (episodes are stepped until done, then scored).

Asserted, per format: nothing executed outside the simulators (no spy on os/subprocess/builtins/
private/foreign methods fired: test_bfcl_safety's and more; no marker file, no new file in the
cwd, no module imported, no simulator class or module changed), no exception escaped `step`
or `result`, and every step returned a well-formed `Step` (one tool message per call it
recorded, or the next turn's messages) and every reward is 0 or 1. A step that hangs is ended by
pytest-timeout. The counts are printed (tried / executed / raised / malformed).
"""

from __future__ import annotations

import builtins
import json
import os
import random
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
from test_bfcl_safety import spy_factory, spying

from rcgrpo_jax.envs import bfcl
from rcgrpo_jax.envs.base import Step
from rcgrpo_jax.envs.calls import CallError, extract_calls, parse_call
from rcgrpo_jax.envs.executor import (
    CLASS_FILE_PATH_MAPPING,
    ERROR_PREFIX,
    public_methods,
    simulator_class,
)

SEED = 18
N_TEXTS = 2000  # per chat format
ENTRY_ID = "multi_turn_miss_func_2"  # GorillaFileSystem + TicketAPI; cp, cat hidden until turn 4

PRIVATE = (
    "_load_scenario", "_navigate_to_directory", "_current_dir", "__init__", "__class__",
    "__dict__", "__reduce_ex__", "__getattribute__", "__setattr__", "__globals__", "__del__",
)  # fmt: skip
FOREIGN = ("post_tweet", "place_order", "send_message", "book_flight", "startEngine", "add")
BUILTIN = ("__import__", "exec", "eval", "open", "getattr", "globals", "breakpoint", "input")
ODD = ("ls.__globals__", "os.system", "ｌｓ", "", "1ls", "class", "None", "l s", "ls\u202e")
TEXT_BITS = (
    "é", "中文", "🙂", "\u202e", "\u0000", "\u200b", "a\u0301", "\\ud800", "\\x00", "'", '"',
    "\\", "\n", "]", ")", "}", "<tool_call>", "</tool_call>", "<|python_tag|>", "<|eot_id|>",
)  # fmt: skip


def payloads(marker: str) -> list[str]:
    """Python expressions that would leave a trace if anything ever evaluated them."""
    touch = f"__import__('os').system('touch {marker}')"
    return [
        touch,
        f"open('{marker}', 'w')",
        f"exec(\"open('{marker}', 'w')\")",
        f"(lambda: {touch})()",
        f"[{touch} for _ in [1]]",
        f"(x := {touch})",
        f"f'{{{touch}}}'",
        "().__class__.__bases__[0].__subclasses__()",
        "globals()['__builtins__']",
        "ls.__globals__['os'].system('true')",
        "breakpoint()",
        "input()",
        f"__builtins__.open('{marker}', 'w')",
        "some_variable",
        "1 + 1",
        "'x' * 10 ** 9",
    ]


class Grammar:
    """Random hostile/malformed assistant texts, one chat format each."""

    def __init__(self, rng: random.Random, marker: str, public: tuple[str, ...]) -> None:
        self.rng = rng
        self.code = payloads(marker)
        self.names = (*public, *public, *PRIVATE, *FOREIGN, *BUILTIN, *ODD)

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def text(self, n: int) -> str:
        r = self.rng
        bits = [self.pick(TEXT_BITS) for _ in range(r.randrange(1, 6))]
        s = "".join(bits) + "".join(chr(r.randrange(32, 0x2FFF)) for _ in range(r.randrange(n)))
        if r.random() < 0.04:
            s += "x" * 200_000  # 200 kB
        return s

    def number(self) -> str:
        return self.pick(
            ["0", "-1", "3.5", "1e999", "-1e999", "1e-320", "2j", "9" * 4000, "9" * 5000, "1_0"]
        )

    # python-list format -------------------------------------------------------------------
    def py_value(self, depth: int = 0) -> str:
        r, k = self.rng, self.rng.random()
        if k < 0.2:
            return self.pick(self.code)
        if k < 0.35:
            return repr(self.text(20)).replace("\\\\ud800", "\\ud800")  # lone surrogate escape
        if k < 0.45:
            return self.number()
        if k < 0.5:
            return self.pick(["None", "True", "...", "b'\\x00'", "'a' 'b'"])
        if k < 0.55:
            d = self.pick([50, 150, 250, 1000])
            return "[" * d + "]" * d
        if depth > 2:
            return "1"
        items = [self.py_value(depth + 1) for _ in range(r.randrange(4))]
        shape = self.pick(["list", "tuple", "set", "dict", "bad_dict", "bad_set"])
        if shape == "list":
            return "[" + ", ".join(items) + "]"
        if shape == "tuple":
            return "(" + ", ".join(items) + ",)"
        if shape == "set":
            return "{" + ", ".join(items or ["1"]) + "}"
        if shape == "bad_set":  # list elements: unhashable
            return "{" + ", ".join(["[1]", *items, "[2]"]) + "}"
        if shape == "bad_dict":  # list, set or dict keys: unhashable
            keys = ["[1]", "{2}", "{}", "(1, [2])"]
        else:
            keys = [self.py_value(depth + 1) for _ in range(2)]
        return "{" + ", ".join(f"{self.pick(keys)}: {v}" for v in items or ["1"]) + "}"

    def py_call(self) -> str:
        r = self.rng
        args = [self.py_value() for _ in range(r.randrange(3))]
        kw = self.pick(["file_name", "folder", "dir_name", "content", "a", "class", "a"])
        args += [f"{kw}={self.py_value()}" for _ in range(r.randrange(3))]  # repeats: duplicates
        if r.random() < 0.1:
            args.append(self.pick(["*[1]", "**{'a': 1}", "*x", "**globals()"]))
        call = f"{self.pick(self.names)}({', '.join(args)})"
        if r.random() < 0.1:
            call = self.pick([f"{call}()", f"{call}[0]", f"{call}.x", f"ls({call})"])
        return call

    def python(self) -> str:
        calls = [self.py_call() for _ in range(self.rng.randrange(1, 4))]
        return self.mutate(self.pick(["[{}]", "{}", "```\n[{}]\n```", "Sure: [{}]"]).format(
            ", ".join(calls)
        ))  # fmt: skip

    # JSON formats --------------------------------------------------------------------------
    def json_value(self, depth: int = 0) -> str:
        r, k = self.rng, self.rng.random()
        if k < 0.2:
            return json.dumps(self.pick(self.code))
        if k < 0.35:
            return '"' + self.text(20).replace('"', "").replace("\\", "\\\\") + '"'
        if k < 0.45:
            return self.pick(["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000, "-0", "1.5"])
        if k < 0.5:
            return self.pick(["null", "true", '"\\ud800"', '"\\u0000"', "tru", "'single'"])
        if k < 0.55:
            d = self.pick([50, 500, 5000])
            return "[" * d + "]" * d
        if depth > 2:
            return "1"
        items = [self.json_value(depth + 1) for _ in range(r.randrange(4))]
        if r.random() < 0.5:
            return "[" + ", ".join(items) + "]"
        return "{" + ", ".join(f"{self.json_key()}: {v}" for v in items) + "}"

    def json_key(self) -> str:
        return json.dumps(
            self.pick(["file_name", "folder", "a", "a", "a b", "class", "", *self.code, "ｌｓ"])
        )

    def json_call(self, args_key: str) -> str:
        r = self.rng
        name = self.pick(
            [json.dumps(self.pick(self.names))] * 6 + ["3", "null", "[]", '{"x": 1}', "NaN"]
        )
        pairs = ", ".join(f"{self.json_key()}: {self.json_value()}" for _ in range(r.randrange(4)))
        args = self.pick(
            ["{" + pairs + "}"] * 6
            + ["[1]", '"not json"', json.dumps("{" + pairs + "}"), "7", "null", "{" + pairs]
        )
        key = self.pick([args_key] * 4 + ["arguments", "parameters", "args"])
        return "{" + f'"name": {name}, "{key}": {args}' + "}"

    def qwen(self) -> str:
        blocks = [self.json_call("arguments") for _ in range(self.rng.randrange(1, 4))]
        wrap = self.pick(["<tool_call>\n{}\n</tool_call>", "<tool_call>{}", "{}</tool_call>"] * 1
                         + ["<tool_call>\n{}\n</tool_call>"] * 3)  # fmt: skip
        return self.mutate("Let me see.\n" + "\n".join(wrap.format(b) for b in blocks))

    def llama(self) -> str:
        calls = [self.json_call("parameters") for _ in range(self.rng.randrange(1, 4))]
        body = self.pick(["; ", ", ", " "]).join(calls)
        return self.mutate(self.pick(["{}", "<|python_tag|>{}<|eom_id|>", "[{}]", "Calling {}"])
                           .format(body))  # fmt: skip

    def mutate(self, text: str) -> str:
        r, k = self.rng, self.rng.random()
        if k < 0.6 or not text:
            return text
        i = r.randrange(len(text))
        if k < 0.7:
            return text[:i]  # cut off mid-way
        if k < 0.8:
            return (
                text[:i] + self.pick(["]", ")", "}", "[", "(", "{", ",", '"', "'", ";"]) + text[i:]
            )
        if k < 0.9:
            return text[:i] + self.pick(self.code) + text[i:]
        return self.text(40)  # prose / garbage: no call


GENERATORS = {"python": Grammar.python, "qwen": Grammar.qwen, "llama": Grammar.llama}


REAL_IMPORT = builtins.__import__


@contextmanager
def more_spies():
    """test_bfcl_safety's spies, plus other ways out that a bug might reach. Its spy on
    `__import__` is narrowed to modules not loaded yet: the parser looks `unicodedata` up to
    normalise non-ASCII identifiers (`ｌｓ`), which runs nothing."""
    hits: list[str] = []
    spy = spy_factory(hits)
    with pytest.MonkeyPatch.context() as mp:
        for owner, attr in [(builtins, "exec"), (builtins, "eval"), (builtins, "input"),
                            (os, "execv"), (os, "fork"), (os, "kill")]:  # fmt: skip
            mp.setattr(owner, attr, spy(f"{getattr(owner, '__name__', owner)}.{attr}"))
        with spying() as safety_hits:
            import_spy = builtins.__import__

            def narrowed(name, *args, **kwargs):
                loaded = name in sys.modules and not (args[3:4] and args[3])  # level 0 only
                return (REAL_IMPORT if loaded else import_spy)(name, *args, **kwargs)

            builtins.__import__ = narrowed  # no MonkeyPatch here: it would import
            try:
                yield hits, safety_hits
            finally:
                builtins.__import__ = import_spy


def world_snapshot(cwd) -> tuple:
    """What a side effect outside the simulator instances would change."""
    classes = {c: {k: id(v) for k, v in vars(simulator_class(c)).items()}
               for c in CLASS_FILE_PATH_MAPPING if c in bfcl_classes()}  # fmt: skip
    modules = {
        m: {k: id(v) for k, v in vars(sys.modules[m]).items()}
        for m in {simulator_class(c).__module__ for c in classes}
    }
    return classes, modules, sorted(os.listdir(cwd)), set(sys.modules)


def bfcl_classes() -> tuple[str, ...]:
    return ("GorillaFileSystem", "TicketAPI", "TwitterAPI", "TradingBot", "MathAPI",
            "MessageAPI", "TravelAPI", "VehicleControlAPI")  # fmt: skip


def caught(fn):
    """(fn(), None), or (None, the exception it raised)."""
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - counted, reported below
        return None, e


def malformed(step: Step, episode: bfcl.Episode, turn: int, recorded: int) -> str | None:
    """What is wrong with `step`, the answer to a text given in `turn` when `recorded` steps of
    that turn were recorded: None if it is one tool message (string content) per call of the
    step it recorded, or the turn ended and it is the next turn's messages (none at the end)."""
    if not isinstance(step, Step) or step.done != episode.done:
        return f"not a Step of this episode: {step!r}"[:200]
    steps = episode.decoded[turn]
    if len(steps) == recorded + 1:  # the text had calls: executed, one result each
        if [m["role"] for m in step.messages] != ["tool"] * len(steps[-1]):
            return f"{len(steps[-1])} calls, messages {[m['role'] for m in step.messages]}"
        if not all(isinstance(m["content"], str) for m in step.messages):
            return "a tool message without string content"
        return None
    if len(steps) != recorded or episode.turn != turn + 1:
        return f"no call recorded, yet the turn went from {turn} to {episode.turn}"
    if episode.done:
        return None if step.messages == [] else "messages after the last turn"
    if step.messages != episode.messages[-len(step.messages) :] or not step.messages:
        return "the next turn's messages are not the episode's"
    return None


def fuzz(fmt: str, entry, texts: list[str], marker) -> tuple[Counter, list[str]]:
    counts, problems = Counter(tried=0, executed=0, raised=0, malformed=0), []
    episode = None
    for text in texts:
        if episode is None:
            episode = bfcl.Episode(entry, fmt, max_steps_per_turn=10**6)  # before the spies
        turn, recorded = episode.turn, len(episode.decoded[episode.turn])
        with more_spies() as (more, hits):
            step, error = caught(lambda: episode.step(text))  # noqa: B023
        counts["tried"] += 1
        results = [m["content"] for m in step.messages if m["role"] == "tool"] if step else []
        counts["tool_results"] += len(results)
        counts["errors"] += sum(r.startswith(ERROR_PREFIX) for r in results)
        if hits or more or marker.exists():
            counts["executed"] += 1
            problems.append(f"executed {hits + more}: {text[:200]!r}")
        if error is not None:
            counts["raised"] += 1
            problems.append(f"raised {type(error).__name__}: {error}: {text[:200]!r}")
        elif (wrong := malformed(step, episode, turn, recorded)) is not None:
            counts["malformed"] += 1
            problems.append(f"malformed step: {wrong}: {text[:200]!r}")
        if episode.done or error is not None:
            result, error = caught(episode.result)
            counts["episodes"] += 1
            if error is not None or result.reward not in (0.0, 1.0):
                counts["raised"] += 1
                problems.append(f"reward failed: {error!r}")
            episode = None
    return counts, problems


@pytest.mark.parametrize("fmt", ["python", "qwen", "llama"])
def test_fuzz_episode(fmt, tmp_path, monkeypatch, capsys):
    entry = next(e for e in bfcl.load_entries("miss_func") if e.id == ENTRY_ID)
    marker = tmp_path / "MARKER"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    public = tuple(n for c in entry.involved_classes for n in public_methods(c))
    grammar = Grammar(random.Random(f"{SEED}-{fmt}"), str(marker), public)
    texts = [GENERATORS[fmt](grammar) for _ in range(N_TEXTS)]
    assert len(set(texts)) > 0.9 * N_TEXTS
    # warm-up: the simulator modules, and what a benign episode imports lazily
    world_snapshot(cwd)
    fuzz(fmt, entry, ["[ls()]", "<tool_call>{}</tool_call>", "done"] * 8, marker)
    before = world_snapshot(cwd)
    counts, problems = fuzz(fmt, entry, texts, marker)
    after = world_snapshot(cwd)
    with capsys.disabled():
        print(
            f"\nfuzz {fmt}: tried {counts['tried']} / executed {counts['executed']} / raised "
            f"{counts['raised']} / malformed {counts['malformed']} ({counts['episodes']} "
            f"episodes, {counts['tool_results']} tool results of which {counts['errors']} errors)"
        )
    assert counts["tried"] == N_TEXTS and counts["episodes"] > 20
    assert (counts["executed"], counts["raised"], counts["malformed"]) == (0, 0, 0), problems[:5]
    assert not marker.exists()
    assert after[0] == before[0], "a simulator class changed"
    assert after[1] == before[1], "a simulator module changed"
    assert after[2] == before[2] == [], f"files appeared in the cwd: {after[2]}"
    assert after[3] == before[3], f"modules imported: {sorted(after[3] - before[3])}"


# The cases that raised out of Episode.step before issue 18 and their JSON counterparts: each is
# now one call whose execution is an error result naming the reason.
MALFORMED = [
    ("python", "[cat(file_name={[1]: 2})]", "dict keys must be hashable"),
    ("python", "[cat(file_name={[1], [2]})]", "set elements must be hashable"),
    ("python", "[cat(file_name={(1, [2]): 3})]", "dict keys must be hashable"),
    ("python", "[cat(file_name=1e999)]", "non-finite"),
    ("python", "[cat(file_name='\\ud800')]", "not valid unicode"),
    ("python", "[cat(file_name=...)]", "is not a value"),
    ("qwen", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', "must be a function name"),
    ("qwen", '<tool_call>{"name": "cat", "arguments": [1]}</tool_call>', "must be an object"),
    ("qwen", '<tool_call>{"name": "cat", "arguments": {"file_name": NaN}}</tool_call>', "non-fin"),
    ("qwen", '<tool_call>{"name": "cat", "arguments": "{nope"}</tool_call>', "not JSON"),
    ("llama", '{"name": "cat", "parameters": {"file_name": 1e999}}', "non-finite"),
    ("llama", '{"name": "cat", "parameters": {"a b": 1}}', "not an identifier"),
    ("llama", '{"name": "cat", "parameters": {"file_name": "\\ud800"}}', "not valid unicode"),
    ("llama", '{"name": ["cat"], "parameters": {}}', "must be a function name"),
]


@pytest.mark.parametrize("fmt,text,reason", MALFORMED)
def test_malformed_call_is_an_error_result(fmt, text, reason):
    (call,) = extract_calls(text, fmt)
    with pytest.raises(CallError, match=reason):
        parse_call(call)
    entry = next(e for e in bfcl.load_entries("miss_func") if e.id == ENTRY_ID)
    episode = bfcl.Episode(entry, fmt)
    (message,) = episode.step(text).messages
    assert message["role"] == "tool" and message["content"].startswith(ERROR_PREFIX)
    assert reason in message["content"]
    assert message["name"] in ("cat", "")
    assert episode.result().reward == 0.0
