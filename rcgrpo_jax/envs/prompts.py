"""Prompts and chat rendering: system prompt with a reward-token slot, BFCL function docs as
JSON-schema tools, and token ids with an assistant-only loss mask from the model's own chat
template (transformers' `apply_chat_template`).

Conversations are lists of `{"role", "content"}` messages (system, user, assistant, tool);
assistant messages hold the raw model text. A conversation's tokens are its append-only
rendering (`render_segments`), the stream a sampler's KV cache holds: the first prompt, then per
assistant turn the model's text and what the template puts after it. Earlier turns are never
re-rendered, so a template that rewrites them (Qwen3's drops their `<think>` blocks) changes no
token the policy has seen; for Qwen2.5 and LLaMA-3.1 it is the template's rendering itself.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    OUTPUT_FORMAT_MAPPING,
    PROMPT_STYLE_TEMPLATES,
)

from rcgrpo_jax.envs.reward_tokens import REWARD_TOKENS

Message = dict[str, Any]

_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
# For formats whose chat template lists the tools itself (Qwen2.5, LLaMA-3.1).
SYSTEM_PROMPT_FC = f"{_STYLE['persona']} {_STYLE['task']}\n\n{_STYLE['multiturn_behavior']}"
# BFCL's default prompting system prompt (python call lists; docs listed in the prompt).
SYSTEM_PROMPT_PYTHON = (
    f"{_STYLE['persona']} {_STYLE['task']}\n\n"
    + _STYLE["tool_call_no_tag"].format(
        output_format=OUTPUT_FORMAT_MAPPING["python"], param_types=""
    )
    + f"\n\n{_STYLE['multiturn_behavior']}\n\n"
)
ADDED_FUNCTIONS_PROMPT = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
# Compact prompt (entries with `compact_prompt`): the tiny demo's tasks, not BFCL's.
COMPACT_SYSTEM_PROMPT = (
    "You control a file system. Functions:\n{functions}\n"
    "To act, reply only with calls like [f(a=1), g(b='x')]. When done, reply in words."
)
# What a policy says when it has no call to make: decodes to no calls in every format.
NO_CALL_TEXT = "I have completed the request."

# BFCL parameter types -> JSON schema types (BFCL's GORILLA_TO_OPENAPI, but "any" is untyped).
_JSON_TYPES = {
    "integer": "integer",
    "number": "number",
    "float": "number",
    "string": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "dict": "object",
    "object": "object",
    "byte": "integer",
    "short": "integer",
    "long": "integer",
    "double": "number",
    "char": "string",
}


# ---------------------------------------------------------------------------------------------
# Tool schemas


def json_schema(param: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of a BFCL parameter spec (types mapped, nested items/properties too)."""
    out = {k: v for k, v in param.items() if k not in ("type", "items", "properties")}
    bfcl_type = param.get("type")
    if bfcl_type is not None and bfcl_type != "any":
        out["type"] = _JSON_TYPES.get(bfcl_type, "string")
    if "items" in param:
        out["items"] = json_schema(param["items"])
    if "properties" in param:
        out["properties"] = {k: json_schema(v) for k, v in param["properties"].items()}
    return out


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style tool entry for `apply_chat_template(tools=...)` from a BFCL function doc."""
    parameters = json_schema(doc.get("parameters", {"type": "dict", "properties": {}}))
    parameters["type"] = "object"
    parameters.setdefault("properties", {})
    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc.get("description", ""),
            "parameters": parameters,
        },
    }


def function_listing(docs: Sequence[dict[str, Any]], chat_format: str) -> str:
    """Functions as text (python prompts and miss_func reveals): BFCL docs or tool schemas."""
    items = list(docs) if chat_format == "python" else [tool_schema(d) for d in docs]
    return json.dumps(items)


def template_tools(docs: Sequence[dict[str, Any]], chat_format: str) -> list[dict] | None:
    """`tools=` for the chat template; None for python prompts, which list docs themselves."""
    return None if chat_format == "python" else [tool_schema(d) for d in docs]


# ---------------------------------------------------------------------------------------------
# Messages


def with_reward_token(text: str, reward: int | None) -> str:
    """`text` with its leading reward token replaced by that of `reward` (None: removed)."""
    for token in REWARD_TOKENS.values():
        if text.startswith(token):
            text = text[len(token) :]
            break
    return text if reward is None else REWARD_TOKENS[int(reward)] + text


def set_reward_token(messages: Sequence[Message], reward: int | None) -> list[Message]:
    """Copy of a conversation whose system prompt carries the token of `reward`.

    The token sits at the start of the system message, so relabelling a finished
    trajectory (RCTP, RC-GRPO) changes only that token.
    """
    if not messages or messages[0]["role"] != "system":
        raise ValueError("conversation has no system message to carry the reward token")
    first = dict(messages[0], content=with_reward_token(messages[0]["content"], reward))
    return [first, *messages[1:]]


def compact_signature(doc: dict[str, Any]) -> str:
    """`name(a, b=default): description` for one BFCL-shaped doc (compact prompts)."""
    params = doc.get("parameters", {})
    required = set(params.get("required", []))
    args = [
        p if p in required else f"{p}={spec.get('default')!r}"
        for p, spec in params.get("properties", {}).items()
    ]
    return f"{doc['name']}({', '.join(args)}): {doc.get('description', '')}"


def system_message(
    chat_format: str,
    docs: Sequence[dict[str, Any]],
    reward: int | None = None,
    *,
    compact: bool = False,
) -> Message:
    """System prompt for a format, with the reward-token slot at its start.

    `compact`: a few lines with one signature per function instead of BFCL's ~4k-token
    prompt, for the synthetic tasks a tiny model trains on (python call format only).
    """
    if compact:
        if chat_format != "python":
            raise ValueError("compact prompts use the python call format")
        listing = "\n".join(compact_signature(d) for d in docs)
        body = COMPACT_SYSTEM_PROMPT.format(functions=listing)
    elif chat_format == "python":
        body = SYSTEM_PROMPT_PYTHON + _STYLE["available_tools"].format(
            format="json", functions=function_listing(docs, chat_format)
        )
    else:
        body = SYSTEM_PROMPT_FC
    return {"role": "system", "content": with_reward_token(body, reward)}


def added_functions_message(docs: Sequence[dict[str, Any]], chat_format: str) -> Message:
    """miss_func's reveal turn: the new functions, then BFCL's "updated some more" prompt.

    The functions go in the message (as in BFCL's prompting mode), not in `tools=`, so the
    rendered conversation only ever grows at its end (KV cache and one loss mask per run).
    """
    content = f"{function_listing(docs, chat_format)}\n{ADDED_FUNCTIONS_PROMPT}"
    return {"role": "user", "content": content}


def tool_message(name: str, result: str) -> Message:
    """One tool result, as bfcl-eval's OSS handlers add it (one message per call)."""
    return {"role": "tool", "name": name, "content": result}


# ---------------------------------------------------------------------------------------------
# Tokenizer side


def add_reward_tokens(tokenizer: Any) -> dict[int, int]:
    """Register the reward tokens as special tokens; returns reward -> token id.

    The model's embedding table must grow to `len(tokenizer)` afterwards.
    """
    tokenizer.add_tokens(list(REWARD_TOKENS.values()), special_tokens=True)
    return {r: tokenizer.convert_tokens_to_ids(t) for r, t in REWARD_TOKENS.items()}


def stop_ids(tokenizer: Any) -> list[int]:
    """The ids that end an assistant step: the chat format's end-of-turn token and EOS."""
    ids = {tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def end_of_turn_token(tokenizer: Any) -> str:
    """The token that closes an assistant message in this tokenizer's chat template."""
    for token in _END_OF_TURN:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != tokenizer.unk_token_id:
            return token
    raise ValueError("tokenizer has no known end-of-turn token")


def render_text(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The conversation as text, the chat template's own rendering of all of it (for Qwen3 not
    the token stream: see `render_segments`)."""
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# Stands in for an assistant message's content: its index between two NUL characters.
_MARK_PREFIX = "\x00RCGRPO-ASSISTANT-"
_MARK = _MARK_PREFIX + "{}\x00"


def render_segments(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
) -> list[tuple[str, bool]]:
    """The conversation's append-only rendering cut into (text, is_assistant) pieces.

    The rendering is the token stream a sampler builds turn by turn, never the template's
    rendering of the whole conversation (Qwen3's drops earlier turns' `<think>` blocks):
    the first prompt, then per assistant message the text the model emits after its
    generation prompt (through the end-of-turn token) and what the template puts after it
    (`_render_segments`). Memoised per tokenizer: the G rollouts of a prompt open with the same
    conversation and, from a peaked policy, mostly continue alike, and a template render costs
    more than the model's step on small models.
    """
    try:  # the template too: it can be replaced on the same tokenizer
        template = str(getattr(tokenizer, "chat_template", None))
        key = (template, json.dumps([messages, tools, add_generation_prompt]))
    except TypeError:  # not plain data: render every time
        return _render_segments(tokenizer, messages, tools, add_generation_prompt, memo=False)
    segments = _memoised(
        _SEGMENTS, tokenizer, key,
        lambda: tuple(_render_segments(tokenizer, messages, tools, add_generation_prompt)),
    )  # fmt: skip
    return list(segments)


def _render_segments(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    *,
    memo: bool = True,
) -> list[tuple[str, bool]]:
    """`render_segments` without its own memo (`memo`: the template renders still memoised).

    Every piece comes from the template rendering a prefix of the conversation in which the
    earlier assistant messages are markers, so how the template re-renders an earlier
    assistant message never reaches the stream:
    - before assistant message k: the prefix's rendering with the generation prompt, from the
      previous assistant message's end-of-turn token on (the first prompt: all of it);
    - message k itself: the template's rendering of it as the latest message, after that
      generation prompt, through its end-of-turn token (verbatim for Qwen2.5 and LLaMA-3.1;
      Qwen3 normalises the `</think>` separator and adds an empty think block to a message
      without one);
    - after the last assistant message: the rest of the whole conversation's rendering.
    """
    render = _Renderer(tokenizer, messages, tools, memo)
    eot = end_of_turn_token(tokenizer)
    segments: list[tuple[str, bool]] = []
    previous = None  # the assistant message the next piece follows
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(k, add_generation_prompt=True)
        segments.append((_after(prompt, previous, eot), False))
        segments.append((_latest_assistant(prompt, render(k, latest=message), eot), True))
        previous = k
    segments.append((_after(render(len(messages), add_generation_prompt), previous, eot), False))
    return [(text, is_assistant) for text, is_assistant in segments if text]


class _Renderer:
    """Template renders of a conversation's prefixes with their assistant messages as markers
    (`render(k, latest=m)`: messages[:k], then message m as itself), memoised per tokenizer:
    a conversation rendered again one turn longer repeats all but its last renders."""

    def __init__(
        self, tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None, memo: bool
    ) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.marked = [
            dict(m, content=_MARK.format(i)) if m["role"] == "assistant" else m
            for i, m in enumerate(messages)
        ]
        self.keys = None
        if memo:  # the key of a prefix: the template, the tools and each message, hashed
            template = str(getattr(tokenizer, "chat_template", None))
            self.keys = [template, json.dumps(tools), *(json.dumps(m) for m in self.marked)]

    def __call__(
        self, k: int, add_generation_prompt: bool = False, latest: Message | None = None
    ) -> str:
        messages = self.marked[:k] + ([] if latest is None else [latest])
        compute = lambda: render_text(self.tokenizer, messages, self.tools, add_generation_prompt)
        if self.keys is None:
            return compute()
        parts = [*self.keys[: k + 2], json.dumps(latest), str(add_generation_prompt)]
        key = hashlib.sha1("\x01".join(parts).encode()).digest()
        return _memoised(_RENDERS, self.tokenizer, key, compute)


def _after(text: str, previous: int | None, eot: str) -> str:
    """`text` after assistant message `previous`'s marker and end-of-turn token (all of it
    when there is none)."""
    if previous is None:
        return text
    _, marker, rest = text.partition(_MARK.format(previous))
    if not marker or _MARK_PREFIX in rest or not rest.startswith(eot):
        raise ValueError("chat template does not close an assistant message with " + repr(eot))
    return rest[len(eot) :]


def _latest_assistant(prompt: str, shown: str, eot: str) -> str:
    """What the template prints for an assistant message as the latest one (`shown`: the
    rendering that ends with it) after the generation prompt (`prompt`: the same rendering
    up to it), through its end-of-turn token."""
    end = shown.rfind(eot)
    if not shown.startswith(prompt) or end < len(prompt):
        raise ValueError(
            "chat template does not print the latest assistant message after its generation "
            "prompt, closed by " + repr(eot)
        )
    return shown[len(prompt) : end + len(eot)]


# Per-tokenizer LRU memos (`_memoised`): rendered conversations, template renders of their
# prefixes and encoded pieces.
_SEGMENTS: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
_RENDERS: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
_ENCODED: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
_MEMO_MAX = 1024  # entries per tokenizer and memo


def _memoised(store: weakref.WeakKeyDictionary, tokenizer: Any, key: Any, compute) -> Any:
    """compute() for `key`, kept in `tokenizer`'s LRU of `store` (keyed by vocabulary size
    too, so added tokens invalidate). The value must be immutable: it is shared."""
    cache = store.setdefault(tokenizer, OrderedDict())
    key = (len(tokenizer), key)
    value = cache.get(key)
    if value is None:
        value = cache[key] = compute()
        if len(cache) > _MEMO_MAX:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one rendered piece, memoised per tokenizer: a conversation is re-rendered
    at every step and all but its last pieces repeat."""
    ids = _memoised(
        _ENCODED, tokenizer, text,
        lambda: tuple(tokenizer.encode(text, add_special_tokens=False)),
    )  # fmt: skip
    return list(ids)


def render_with_mask(
    tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its loss mask (1 on assistant tokens only).

    Each piece is tokenized on its own, so a conversation's ids start with the ids of its
    prompt at every assistant turn (`prompt_ids`), as they do when sampling.
    """
    ids: list[int] = []
    mask: list[int] = []
    for text, is_assistant in render_segments(tokenizer, messages, tools):
        piece = _encode(tokenizer, text)
        ids += piece
        mask += [int(is_assistant)] * len(piece)
    return ids, mask


def continuation_ids(
    tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None = None
) -> list[int]:
    """Tokens the template puts after the last assistant message (tool results, next user turn,
    generation prompt): the piece `prompt_ids` ends with there, rendered alone, so a sampled
    row's cache is extended by exactly what the stream holds and no earlier token changes."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    render = _Renderer(tokenizer, messages, tools, memo=False)
    text = render(len(messages), add_generation_prompt=True)
    return _encode(tokenizer, _after(text, last, end_of_turn_token(tokenizer)))


def prompt_ids(
    tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None = None
) -> list[int]:
    """Token ids to sample the next assistant message from (generation prompt included): the
    conversation's stream so far, what a rollout's cache holds at this turn."""
    segments = render_segments(tokenizer, messages, tools, add_generation_prompt=True)
    return [i for text, _ in segments for i in _encode(tokenizer, text)]
