"""Chat rendering with the real Qwen2.5 / LLaMA-3.1 tokenizers, the loss mask, tool schemas."""

from __future__ import annotations

import json

import pytest
from conftest import mask_runs

from rcgrpo_jax.envs import bfcl, prompts
from rcgrpo_jax.envs.calls import extract_calls

JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean"}


def entry_by_id(entry_id):
    return next(e for e in bfcl.load_entries(entry_id.rsplit("_", 1)[0]) if e.id == entry_id)


@pytest.fixture(scope="module")
def tokenizers(tokenizer_root):
    from transformers import AutoTokenizer

    out = {}
    for name in ("qwen2.5", "llama3.1"):
        tok = AutoTokenizer.from_pretrained(str(tokenizer_root / name))
        prompts.add_reward_tokens(tok)
        out[name] = tok
    return out


def played(entry_id: str, fmt: str, reward: int | None = 1) -> bfcl.Episode:
    episode = bfcl.Episode(entry_by_id(entry_id), fmt, reward_token=reward)
    bfcl.run_episodes([episode], bfcl.ground_truth)
    return episode


def test_tool_schemas_are_json_schema():
    def check(schema):
        if "type" in schema:
            assert schema["type"] in JSON_TYPES
        for sub in schema.get("properties", {}).values():
            check(sub)
        if "items" in schema:
            check(schema["items"])

    docs = {d["name"]: d for e in bfcl.load_all() for d in e.function_docs}
    assert len(docs) > 100
    for doc in docs.values():
        tool = prompts.tool_schema(doc)
        params = tool["function"]["parameters"]
        assert tool["type"] == "function" and tool["function"]["name"] == doc["name"]
        assert params["type"] == "object"
        assert params.get("required", []) == doc["parameters"].get("required", [])
        assert set(params["properties"]) == set(doc["parameters"]["properties"])
        check(params)
    # BFCL-only types are mapped.
    convert = prompts.json_schema
    assert convert({"type": "float", "description": "x"}) == {"type": "number", "description": "x"}
    assert convert({"type": "tuple", "items": {"type": "dict"}}) == {
        "type": "array",
        "items": {"type": "object"},
    }
    assert convert({"type": "any", "description": "y"}) == {"description": "y"}
    assert convert({"type": "dict", "properties": {"a": {"type": "integer"}}})["type"] == "object"


CASES = [
    ("qwen2.5", "qwen", "multi_turn_miss_func_0", "<|im_end|>"),
    ("qwen2.5", "python", "multi_turn_base_1", "<|im_end|>"),
    ("llama3.1", "llama", "multi_turn_miss_param_2", "<|eot_id|>"),
]


@pytest.mark.parametrize(("tok_name", "fmt", "entry_id", "eot"), CASES)
def test_loss_mask_lines_up_with_assistant_spans(tokenizers, tok_name, fmt, entry_id, eot):
    tok = tokenizers[tok_name]
    episode = played(entry_id, fmt)
    messages, tools = episode.messages, episode.tools
    ids, mask = prompts.render_with_mask(tok, messages, tools)
    assert len(ids) == len(mask)
    text = prompts.render_text(tok, messages, tools)
    assert tok.decode(ids) == text  # nothing lost or added
    assert ids == tok.encode(text, add_special_tokens=False)  # same as one-piece tokenization

    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = mask_runs(mask)
    assert len(spans) == len(assistant) >= 4
    eot_id = tok.convert_tokens_to_ids(eot)
    for i, (start, end) in zip(assistant, spans, strict=True):
        content = messages[i]["content"]
        assert tok.decode(ids[start:end]) == content.strip() + eot
        assert ids[end - 1] == eot_id
        # The prompt the sampler sees before this message is exactly what precedes the span.
        prompt = prompts.prompt_ids(tok, messages[:i], tools)
        assert ids[: len(prompt)] == prompt and len(prompt) == start
        assert extract_calls(tok.decode(ids[start : end - 1]), fmt) == extract_calls(content, fmt)
    assert sum(mask) == sum(end - start for start, end in spans)
    # User and system text are never trained on.
    unmasked = tok.decode([t for t, k in zip(ids, mask, strict=True) if not k])
    for m in messages:
        if m["role"] in ("user", "system"):
            assert m["content"].strip() in unmasked


@pytest.mark.parametrize(("tok_name", "fmt"), [("qwen2.5", "qwen"), ("llama3.1", "llama")])
def test_reward_token_is_one_unmasked_token_in_the_system_prompt(tokenizers, tok_name, fmt):
    tok = tokenizers[tok_name]
    token_ids = {r: tok.convert_tokens_to_ids(t) for r, t in prompts.REWARD_TOKENS.items()}
    assert token_ids[0] != token_ids[1] and all(i >= 128000 for i in token_ids.values())
    episode = played("multi_turn_base_7", fmt, reward=1)
    high_ids, high_mask = prompts.render_with_mask(tok, episode.messages, episode.tools)
    low = prompts.set_reward_token(episode.messages, 0)
    low_ids, low_mask = prompts.render_with_mask(tok, low, episode.tools)
    assert high_ids.count(token_ids[1]) == 1 and token_ids[0] not in high_ids
    assert len(high_ids) == len(low_ids) and high_mask == low_mask
    diff = [i for i, (a, b) in enumerate(zip(high_ids, low_ids, strict=True)) if a != b]
    assert len(diff) == 1 and low_ids[diff[0]] == token_ids[0] and high_mask[diff[0]] == 0
    assert diff[0] < mask_runs(high_mask)[0][0]  # before the first assistant token
    none = prompts.set_reward_token(episode.messages, None)
    assert len(prompts.render_with_mask(tok, none, episode.tools)[0]) == len(high_ids) - 1


def test_tools_reach_the_template(tokenizers):
    episode = bfcl.Episode(entry_by_id("multi_turn_base_0"), "qwen")
    text = prompts.render_text(tokenizers["qwen2.5"], episode.messages, episode.tools)
    listed = [
        json.loads(line) for line in text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    ]
    assert listed == episode.tools
    llama = prompts.render_text(tokenizers["llama3.1"], episode.messages, episode.tools)
    assert '"name": "mkdir"' in llama and "Environment: ipython" in llama
    python = bfcl.Episode(entry_by_id("multi_turn_base_0"), "python")
    assert python.tools is None
    assert '"name": "mkdir"' in python.messages[0]["content"]
    assert "[func_name1(params_name1=params_value1" in python.messages[0]["content"]


def test_prompt_lengths_are_shared_by_equal_tokenizers(tokenizer_root):
    """A later stage loads the same tokenizer again (from an export): its first-prompt lengths
    come from the memo, not from rendering again; the reward tokens added to a tokenizer give
    it lengths of its own (the token is then one id, not pieces)."""
    from transformers import AutoTokenizer

    from rcgrpo_jax import envs
    from rcgrpo_jax.stages import setup

    env = envs.get("bfcl")()
    entry = bfcl.split_entries("test", "multi_turn_base")[0]
    first = AutoTokenizer.from_pretrained(str(tokenizer_root / "qwen2.5"))
    n = setup.prompt_length(env, first, entry, "qwen")
    again = AutoTokenizer.from_pretrained(str(tokenizer_root / "qwen2.5"))
    before = len(setup._PROMPT_LENGTHS)
    assert setup.prompt_length(env, again, entry, "qwen") == n
    assert len(setup._PROMPT_LENGTHS) == before  # a hit: nothing rendered
    prompts.add_reward_tokens(again)
    shorter = setup.prompt_length(env, again, entry, "qwen")
    assert len(setup._PROMPT_LENGTHS) == before + 1 and shorter < n
    assert setup.prompt_length(env, first, entry, "qwen") == n  # the plain one keeps its own


def test_memoised_rendering_equals_a_fresh_one(tokenizers):
    """`render_segments` keeps what it rendered (the G rollouts of a prompt repeat it): every
    prefix of a played conversation renders as the template does, a returned list can be
    changed without changing the next one, and a replaced template is rendered anew."""
    tok = tokenizers["qwen2.5"]
    episode = played("multi_turn_base_1", "qwen")
    messages, tools = episode.messages, episode.tools
    for end in range(1, len(messages) + 1):
        for gen in (False, True):
            fresh = prompts._render_segments(tok, messages[:end], tools, gen, memo=False)
            first = prompts.render_segments(tok, messages[:end], tools, gen)
            first.append(("changed", False))
            assert prompts.render_segments(tok, messages[:end], tools, gen) == fresh
    template, before = tok.chat_template, prompts.render_segments(tok, messages, tools)
    try:
        tok.chat_template = template.replace("<|im_start|>", "<|im_start|> ")
        changed = prompts.render_segments(tok, messages, tools)
        fresh = prompts._render_segments(tok, messages, tools, False, memo=False)
        assert changed == fresh != before
    finally:
        tok.chat_template = template


# --------------------------------------------------------------------------- Qwen3 (thinking)


@pytest.fixture(scope="module")
def qwen3(tokenizer_root):
    """The real Qwen3 tokenizer (thinking-only template: its generation prompt opens
    `<think>\\n`, and it drops the reasoning of assistant messages before the last user turn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_root / "qwen3"))
    prompts.add_reward_tokens(tok)
    return tok


def thinking_reply(episode: bfcl.Episode, n: int) -> str:
    """The ground truth's next message after a reasoning of its own (what Qwen3 emits after
    its generation prompt `<think>\\n`)."""
    reasoning = f"Step {n}: what does turn {episode.turn} need?"
    return f"{reasoning}\n</think>\n\n{bfcl.ground_truth([episode])[0]}"


def test_qwen3_rollout_stream_is_the_training_sequence(qwen3):
    """A multi-turn BFCL episode rolled out as `rl.rollout` does (first prompt, sampled tokens,
    `_advance`'s continuation after each) with Qwen3 messages that think before their calls:
    at every turn a fresh `prompt_ids` of the conversation is the stream so far (what the
    policy conditioned on), each continuation is exactly the template's text for the new
    messages, and `render_with_mask` (stage 1) gives the same tokens, masked on the sampled
    ones only. Every turn's reasoning stays in the stream, although the template's rendering
    of the whole conversation drops those before the last user turn."""
    from rcgrpo_jax.rl import rollout

    tok = qwen3
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    settings = rollout.RolloutSettings(chat_format="qwen", max_len=1 << 20)
    episode = bfcl.Episode(entry_by_id("multi_turn_base_1"), "qwen", reward_token=1)
    stream = prompts.prompt_ids(tok, episode.messages, episode.tools)
    sampled = [False] * len(stream)
    assert tok.decode(stream).endswith("<|im_start|>assistant\n<think>\n")
    reasonings = []
    while True:
        assert prompts.prompt_ids(tok, episode.messages, episode.tools) == stream
        reply = thinking_reply(episode, len(reasonings) + 1)
        reasonings.append(reply.split("\n</think>")[0])
        new = tok.encode(reply, add_special_tokens=False) + [eot]  # stopped at <|im_end|>
        stream, sampled = stream + new, sampled + [True] * len(new)
        before = len(episode.messages)
        report = rollout._advance(episode, tok, new, True, len(stream), eot, settings)
        if report.outcome == rollout.Outcome.DONE:
            break
        assert report.outcome == rollout.Outcome.APPEND
        added = episode.messages[before + 1 :]  # tool results, or the next user turn
        shown = "".join(
            "\n<|im_start|>user\n" + m["content"] + "<|im_end|>"
            if m["role"] == "user"
            else ("\n<|im_start|>user" if i == 0 else "") + "\n<tool_response>\n"
            + m["content"] + "\n</tool_response>" + ("<|im_end|>" if i == len(added) - 1 else "")
            for i, m in enumerate(added)
        )  # fmt: skip
        assert tok.decode(report.append) == shown + "\n<|im_start|>assistant\n<think>\n"
        stream, sampled = stream + report.append, sampled + [False] * len(report.append)
    assert episode.result().reward == 1.0  # the calls after each reasoning were executed
    assert len(reasonings) == 8 and len(episode.decoded) == 4

    ids, mask = prompts.render_with_mask(tok, episode.messages, episode.tools)
    closing = tok.encode("\n", add_special_tokens=False)  # after the last <|im_end|>
    assert ids == stream + closing
    assert mask == [int(s) for s in sampled] + [0] * len(closing)
    text = tok.decode(stream)
    assert all(r in text for r in reasonings)
    whole = prompts.render_text(tok, episode.messages, episode.tools)  # the template's own
    last_query = max(i for i, m in enumerate(episode.messages) if m["role"] == "user")
    after = sum(m["role"] == "assistant" for m in episode.messages[last_query:])
    assert [r in whole for r in reasonings] == [False] * (8 - after) + [True] * after


def test_qwen3_golden_trajectory_masks_what_the_model_emits(qwen3):
    """Stage 1's render of a golden BFCL trajectory (calls without reasoning) under Qwen3: each
    masked run starts right after the generation prompt `<|im_start|>assistant\\n<think>\\n`
    (where the sampler starts, `prompt_ids` of the conversation up to it) and is what the
    template shows for that message when it is the latest, an empty reasoning then the calls:
    `\\n</think>\\n\\n` + text + `<|im_end|>`; nothing else is masked, the reward token is one
    unmasked token in the system prompt."""
    tok = qwen3
    episode = played("multi_turn_miss_func_0", "qwen")
    messages, tools = episode.messages, episode.tools
    ids, mask = prompts.render_with_mask(tok, messages, tools)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    runs = mask_runs(mask)
    assert len(runs) == len(assistant) >= 4 and len(ids) == len(mask)
    for i, (start, end) in zip(assistant, runs, strict=True):
        prompt = prompts.prompt_ids(tok, messages[:i], tools)
        assert ids[: len(prompt)] == prompt and len(prompt) == start
        assert tok.decode(ids[:start]).endswith("<|im_start|>assistant\n<think>\n")
        content = messages[i]["content"]
        assert tok.decode(ids[start:end]) == "\n</think>\n\n" + content + "<|im_end|>"
        assert extract_calls(tok.decode(ids[start:end]), "qwen") == extract_calls(content, "qwen")
    unmasked = tok.decode([t for t, k in zip(ids, mask, strict=True) if not k])
    later = tok.decode([t for t, k in zip(ids, mask, strict=True) if not k][runs[0][0] :])
    assert "</think>" not in later and "<tool_call>" not in later  # calls are masked, all
    for m in messages:
        if m["role"] in ("user", "system", "tool"):
            assert m["content"].strip() in unmasked
    high = tok.convert_tokens_to_ids(prompts.REWARD_TOKENS[1])
    assert ids.count(high) == 1 and mask[ids.index(high)] == 0 and ids.index(high) < runs[0][0]
