"""Builds the checkpoints bench/peers.py gives every system: a 1,024-token byte-level BPE with
Qwen2.5's chat template (TRL's copy, which TRL's tool-call parser recognises), and

  random/       the tiny Qwen2 of `workload.MODEL` as initialised (seed 0): single-turn;
  tool_caller/  the same model fine-tuned (torch, the assistant's tokens, 300 AdamW steps) on the
                multi-turn chats, so it calls `next_part()` twice and then answers.

Runs in the environment that has transformers, torch and trl (our test extras). Deterministic:
the same files for the same package versions; reused while `done.json` matches the recipe
(model, data, steps, `RECIPE`) and those versions.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import workload as w

SFT_STEPS, SFT_LR = 300, 3e-3
RECIPE = 2  # raise when the code below changes what it builds
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def sft_chats() -> list[list[dict]]:
    """Each prompt: call the tool twice, then a one-sentence answer."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": w.TOOL_NAME, "arguments": {}}}]}  # fmt: skip
    chats = []
    for topic, prompt in zip(w.TOPICS, w.PROMPTS, strict=True):
        chat = w.messages(prompt, multi_turn=True)
        for n in range(w.TURNS - 1):
            chat += [call, {"role": "tool", "content": w.tool_result(n)}]
        chat.append({"role": "assistant", "content": f"Here is a short note about {topic}."})
        chats.append(chat)
    return chats


def filler_words(n: int = 4000) -> list[str]:
    """Deterministic pseudo-words, so BPE has pairs enough to reach `workload.VOCAB` pieces."""
    import random

    rng, syllables = random.Random(0), [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(12))
            for _ in range(n // 12)]  # fmt: skip


def corpus() -> list[str]:
    """The tokenizer's training text, but the chat template's."""
    texts = [json.dumps(w.TOOL_DOC), w.TOOL_CALL_TEXT, w.SYSTEM, *w.PROMPTS]
    texts += [w.tool_result(n) for n in range(w.TURNS)] + ["Here is a short note about"] * 4
    return texts + filler_words()


def train_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [*corpus(), template]  # and the template's own text (its system and tool preambles)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=w.VOCAB, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(texts * 8, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[3:],
    )  # fmt: skip
    tok.chat_template = template
    return tok


def build(out: Path) -> Path:
    """Writes `out/random`, `out/tool_caller` (each a model + tokenizer directory)."""
    import torch
    import transformers
    from trl.chat_template_utils import qwen2_5_chat_template

    what = [RECIPE, w.MODEL, w.VOCAB, SFT_STEPS, SFT_LR, sft_chats(), corpus(), w.TOOL_DOC]
    recipe = {"recipe": hashlib.sha256(json.dumps(what).encode()).hexdigest(),
              "transformers": transformers.__version__, "torch": torch.__version__}  # fmt: skip
    done = out / "done.json"
    if done.exists() and json.loads(done.read_text()) == recipe:
        return out
    tok = train_tokenizer(qwen2_5_chat_template)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=len(tok), **w.MODEL, torch_dtype="float32")
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    for name in ("random", "tool_caller"):
        if name == "tool_caller":
            fine_tune(model, tok)
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
    done.write_text(json.dumps(recipe))
    return out


def fine_tune(model, tok) -> None:
    """AdamW on the assistant's tokens of `sft_chats()`, the learning rate falling linearly to 0
    (a sharp policy: at temperature 1 it still writes the calls as trained)."""
    import torch

    def render(chat: list[dict], **kwargs) -> list[int]:
        return tok.apply_chat_template(chat, tools=[w.TOOL_DOC], **kwargs)["input_ids"]

    rows, masks = [], []
    for chat in sft_chats():
        ids, mask = render(chat), []
        for i, message in enumerate(chat):  # the tokens each message adds; 1 on the assistant's
            end = len(render(chat[: i + 1])) if i + 1 < len(chat) else len(ids)
            mask += [message["role"] == "assistant"] * (end - len(mask))
        rows.append(ids)
        masks.append(mask)
    width = max(map(len, rows))
    pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
    input_ids, keep = torch.tensor(pad(rows, tok.pad_token_id)), torch.tensor(pad(masks, False))
    labels = input_ids.masked_fill(~keep, -100)
    attention = torch.tensor(pad([[1] * len(r) for r in rows], 0))
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / SFT_STEPS)
    model.train()
    for _ in range(SFT_STEPS):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    print(f"tool_caller: SFT loss {loss.item():.5f} after {SFT_STEPS} steps", file=sys.stderr)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
