"""A small SentencePiece tokenizer trained at start-up on the synthetic task corpus.

The tiny demo trains its model from scratch, so it needs no downloaded tokenizer: a BPE
SentencePiece model (default 1024 pieces: 256 byte-fallback pieces, the chat tokens, the rest
learned) is trained on rendered conversations of the given tasks and wrapped as a
transformers `PreTrainedTokenizerFast` with a compact chat template, so `prompts.render_*`,
`prompt_ids`, `end_of_turn_token` and `add_reward_tokens` work on it as on Qwen/LLaMA.

Exactness matters more than compression: the environment parses decoded model text, so
`decode(encode(text)) == text` for any text. SentencePiece runs with identity normalisation,
no dummy prefix and byte fallback, and the fast tokenizer has no normaliser or pre-tokenizer
(spaces live inside the pieces), so nothing is rewritten on the way in or out.

Role tokens, the end-of-turn token and the reward tokens are SentencePiece user-defined
symbols (single ids, never split or merged) and special tokens of the wrapper; so
`add_reward_tokens` adds nothing and `len(tokenizer)` is the model's vocabulary size.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rcgrpo_jax.envs import policies, prompts
from rcgrpo_jax.envs.entries import Entry
from rcgrpo_jax.envs.synthetic import SYLLABLES, act_without_looking, play

ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
END_OF_TURN = "<|end|>"  # one of `prompts._END_OF_TURN`
UNK, PAD = "<unk>", "<pad>"
SPECIAL_TOKENS = (*ROLE_TOKENS.values(), END_OF_TURN, *prompts.REWARD_TOKENS.values())
# The token roles of the transformers wrapper (eos: the end of a turn).
WRAPPER_ROLES = {"unk_token": UNK, "pad_token": PAD, "eos_token": END_OF_TURN}
# Frequent characters that SentencePiece would otherwise only reach through byte fallback, and
# the syllables of the synthetic tasks' names: one piece each, never merged with their
# neighbours, so a name tokenizes the same in every context (and held-out names like training
# ones).
EXTRA_SYMBOLS = ("\n", *SYLLABLES)

# <|role|>content<|end|> per message; tool names are not shown (one result per call, in order).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DEFAULT_VOCAB_SIZE = 1024
SUBDIR = "tokenizer"
_META = "rcgrpo_tiny_tokenizer.json"
_SP_MODEL = "tiny.model"


def corpus(tasks: Sequence[Entry], perturbed_every: int = 4) -> list[str]:
    """Training text: the ground-truth conversation of every task with alternating reward
    tokens, plus empty and act-without-looking conversations of every `perturbed_every`-th."""
    texts = []
    for i, task in enumerate(tasks):
        runs = [(policies.ground_truth, i % 2)]
        if perturbed_every and i % perturbed_every == 0:
            runs += [(policies.empty, 0), (act_without_looking, 0)]
        for policy, reward in runs:
            messages = play(task, policy, reward_token=reward).messages
            texts.append(render(messages))
    return texts


def render(messages: Iterable[prompts.Message]) -> str:
    """What `CHAT_TEMPLATE` renders, without a tokenizer (for the training corpus)."""
    return "".join(f"{ROLE_TOKENS[m['role']]}{m['content']}{END_OF_TURN}" for m in messages)


def train_sentencepiece(texts: Iterable[str], vocab_size: int) -> bytes:
    """A serialized BPE SentencePiece model; deterministic for the same texts.

    BPE rather than unigram: the corpus is templated, and BPE turns the repeated system
    prompt and call syntax into long pieces (~70 vs ~210 tokens for the system prompt)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # small corpora may support fewer pieces
        user_defined_symbols=[*SPECIAL_TOKENS, *EXTRA_SYMBOLS],
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_by_whitespace=False,  # templated phrases may become single pieces
        split_by_unicode_script=False,  # so may "cd(folder='"
        split_digits=True,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        character_coverage=1.0,
        max_sentence_length=1 << 16,
        max_sentencepiece_length=16,
        input_sentence_size=0,  # use every text: no sampling
        shuffle_input_sentence=False,
        num_threads=1,
        unk_id=0,
        pad_id=1,
        bos_id=-1,
        eos_id=-1,
        unk_piece=UNK,
        pad_piece=PAD,
        minloglevel=2,
    )
    return model.getvalue()


def _merges(vocab: dict[str, int], pieces: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges recovered from SentencePiece's piece order (a BPE model lists its pieces in
    the order they were merged): every split of a piece into two known pieces, ranked by
    the id of the merged piece, then of its parts."""
    merges = []
    for piece in pieces:
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((vocab[piece], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def from_sentencepiece(model_proto: bytes) -> Any:
    """The SentencePiece BPE model as a `PreTrainedTokenizerFast` (exact round trip)."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    # Spaces are stored as U+2581 in SentencePiece pieces; keep them as plain spaces here so
    # no normaliser is needed and U+2581 itself round-trips (through byte fallback).
    pieces = [sp.id_to_piece(i).replace("\u2581", " ") for i in range(sp.get_piece_size())]
    vocab = {p: i for i, p in enumerate(pieces)}
    symbols = {UNK, PAD, *SPECIAL_TOKENS, *EXTRA_SYMBOLS}
    mergeable = [p for i, p in enumerate(pieces) if p not in symbols and not sp.is_byte(i)]
    bpe = models.BPE(vocab, _merges(vocab, mergeable), unk_token=UNK, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (UNK, PAD, *SPECIAL_TOKENS)]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t in EXTRA_SYMBOLS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **WRAPPER_ROLES,
    )


def load(directory: str | os.PathLike) -> Any:
    """A tokenizer saved by `load_or_train`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def load_or_train(
    workdir: str | os.PathLike,
    tasks: Sequence[Entry],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Any:
    """The run's tokenizer from `workdir/tokenizer`, trained on the `corpus` of the synthetic
    `tasks` only if absent."""

    def texts() -> Iterator[str]:
        yield from corpus(tasks)

    return load_or_train_texts(workdir, texts(), vocab_size)


def load_or_train_texts(
    workdir: str | os.PathLike,
    texts: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    source: str = "",
) -> Any:
    """The run's tokenizer from `workdir/tokenizer`, trained on `texts` only if absent (they
    are not consumed otherwise: pass a generator to keep building them lazy).

    Written to a temporary folder and renamed, so an interrupted run leaves no half cache.
    A cached tokenizer of another requested vocab size, or trained for another `source` (the
    environment whose corpus it was trained on), is an error, not silently reused.
    """
    directory = Path(workdir) / SUBDIR
    meta_path = directory / _META
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["requested_vocab_size"] != vocab_size:
            raise ValueError(
                f"{directory} holds a tokenizer for vocab_size={meta['requested_vocab_size']}, "
                f"not {vocab_size}; use another workdir or delete it"
            )
        if source and meta.get("source", source) != source:
            raise ValueError(
                f"{directory} holds a tokenizer trained for {meta['source']!r}, not {source!r}; "
                "use another workdir or delete it"
            )
        return load(directory)
    proto = train_sentencepiece(texts, vocab_size)
    tokenizer = from_sentencepiece(proto)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=directory.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / _SP_MODEL).write_bytes(proto)
        meta = {"requested_vocab_size": vocab_size, "vocab_size": len(tokenizer)}
        if source:
            meta["source"] = source
        (tmp / _META).write_text(json.dumps(meta))
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load(directory)
