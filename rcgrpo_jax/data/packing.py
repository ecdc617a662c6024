"""Whole examples into fixed-length rows: first-fit packing, or one per row padded to a bucket.

The rows carry the batch layout the losses read (`train.losses`): tokens, loss_mask, segments
(1, 2, ... per example in a row, 0 = padding) and positions (restarting at 0 per segment).
Examples are never split or truncated. `loss_index` adds the positions the loss reads, so the
head runs only there (`models.token_logprobs(at=...)`; the RL rollout batch uses it too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rcgrpo_jax.shapes import length_bucket, piece_bucket


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket ≥ n. Longer than every bucket is an error: we never truncate silently
    (a cut trajectory would train on a conversation the environment never produced)."""
    for b in sorted(buckets):
        if n <= b:
            return int(b)
    raise ValueError(
        f"example of length {n} exceeds the largest bucket {max(buckets)}; "
        f"raise the bucket/row length or filter long examples upstream"
    )


class ExampleTooLongError(ValueError):
    """An example longer than the row it should be packed into (examples are never split)."""

    def __init__(self, index: int, length: int, row_len: int) -> None:
        super().__init__(
            f"example {index} has {length} tokens > row length {row_len}; examples are never split"
        )
        self.index, self.length, self.row_len = index, length, row_len


def pack_examples(
    examples: Sequence[Mapping[str, Any]],
    row_len: int,
    *,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """First-fit packing of whole examples into rows of `row_len` tokens.

    examples: dicts with `tokens` and `loss_mask` (1-D, same length). Returns numpy
    tokens/loss_mask/segments/positions [R, row_len] plus `example_row`/`example_segment` [N]
    telling where each input went. Examples are never split; one longer than `row_len` raises
    `ExampleTooLongError`.
    Deterministic: the same input order gives the same rows.
    """
    lengths = [len(e["tokens"]) for e in examples]
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ExampleTooLongError(i, n, row_len)
        if n == 0:
            raise ValueError(f"example {i} is empty")
    free: list[int] = []  # remaining room per row
    rows: list[list[int]] = []
    for i, n in enumerate(lengths):
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    out = {
        "tokens": np.full((len(rows), row_len), pad_id, np.int32),
        "loss_mask": np.zeros((len(rows), row_len), np.int32),
        "segments": np.zeros((len(rows), row_len), np.int32),
        "positions": np.zeros((len(rows), row_len), np.int32),
    }
    ex_row = np.zeros(len(examples), np.int32)
    ex_seg = np.zeros(len(examples), np.int32)
    for r, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(members, start=1):
            n = lengths[i]
            out["tokens"][r, at : at + n] = np.asarray(examples[i]["tokens"])
            out["loss_mask"][r, at : at + n] = np.asarray(examples[i]["loss_mask"])
            out["segments"][r, at : at + n] = seg
            out["positions"][r, at : at + n] = np.arange(n)
            ex_row[i], ex_seg[i] = r, seg
            at += n
    out["example_row"], out["example_segment"] = ex_row, ex_seg
    return out


def pad_examples(
    examples: Sequence[Mapping[str, Any]], buckets: Sequence[int], *, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """One example per row, right-padded to the bucket of the longest (bucketing, no packing)."""
    length = bucket_length(max(len(e["tokens"]) for e in examples), buckets)
    out = {
        k: np.full((len(examples), length), pad_id if k == "tokens" else 0, np.int32)
        for k in ("tokens", "loss_mask", "segments", "positions")
    }
    for r, e in enumerate(examples):
        n = len(e["tokens"])
        out["tokens"][r, :n] = np.asarray(e["tokens"])
        out["loss_mask"][r, :n] = np.asarray(e["loss_mask"])
        out["segments"][r, :n] = 1
        out["positions"][r, :n] = np.arange(n)
    return out


def loss_index(loss_mask: np.ndarray) -> np.ndarray:
    """[..., K] int32: per row, the positions t >= 1 with loss_mask[..., t] > 0 in ascending
    order, then 0s. K is the `length_bucket` of the largest per-row count (at most T), one K for
    the whole array, so a loader or an RL iteration builds one program, and a run few.

    Padding points at position 0, which nothing predicts: the losses drop it (their mask is 0
    there) whatever loss_mask, old or reference log-probs hold at 0."""
    mask = np.asarray(loss_mask) > 0
    mask[..., :1] = False
    t = mask.shape[-1]
    k = min(length_bucket(max(int(mask.sum(-1).max(initial=0)), 1)), t)
    order = np.argsort(~mask, axis=-1, kind="stable")[..., :k]  # loss positions first, in order
    return np.where(np.take_along_axis(mask, order, -1), order, 0).astype(np.int32)


# The batch keys of `shared_prompts`: prompt rows [P, K, ...] and the rest of each row [P, G, ...]
SHARED_PROMPT_KEYS = (
    "prompt_tokens", "prompt_length", "prompt_of",
    "rest_tokens", "rest_positions", "rest_segments", "rest_start",
)  # fmt: skip


def shared_prompts(
    tokens: np.ndarray, segments: np.ndarray, loss_mask: np.ndarray
) -> dict[str, np.ndarray]:
    """Groups of right-padded rows [P, G, T] (segments 1 real, 0 padding) as the prompts they
    share and the rest of each row, for a loss that runs each prompt once
    (`models.shared_prefix_logprobs`). A row's prompt is its tokens before the one that precedes
    its first loss token (that token's hidden state predicts the first loss token, so it opens
    the rest); the rows of a group whose prompts are equal token for token share one. Returns:

    - prompt_tokens [P, K, Tp], prompt_length [P, K]: each group's distinct prompts, K the most
      any group has (GRPO 1; RC-GRPO 2: its reward token is part of the prompt), rows past a
      group's own count empty (length 0);
    - prompt_of [P, G]: which of its group's prompts a row continues;
    - rest_tokens, rest_positions, rest_segments [P, G, Ts]: the rest of each row, positions
      counting on from its prompt's length;
    - rest_start [P, G]: where the rest starts in the row (its prompt's length).

    Tp is the `piece_bucket` of the longest prompt, Ts that of the longest rest less its last
    token, plus that token (at most T): the model runs the stack over Ts - 1 positions, since a
    row's last token is a target only (so 64 sampled tokens after the prompt's last cost 64
    positions, not a bucket of 65). A row with no loss token keeps an empty rest (nothing of it
    is ever read) and continues its group's first prompt."""
    tokens = np.asarray(tokens)
    p, g, t = tokens.shape
    length = (np.asarray(segments) > 0).sum(-1)
    mask = np.asarray(loss_mask) > 0
    mask[..., :1] = False  # as `loss_index`: nothing predicts the first token
    has_loss = mask.any(-1)
    # the rest opens one token before the first loss token; a row without one has no rest
    start = np.where(has_loss, np.maximum(np.argmax(mask, -1) - 1, 0), length)
    prompts = [[] for _ in range(p)]  # per group: its distinct prompts, in order of first use
    prompt_of = np.zeros((p, g), np.int32)
    for i in range(p):
        for j in range(g):
            if not has_loss[i, j]:
                continue
            prompt = tokens[i, j, : start[i, j]].tobytes()
            if prompt not in prompts[i]:
                prompts[i].append(prompt)
            prompt_of[i, j] = prompts[i].index(prompt)
    k = max(1, *(len(x) for x in prompts))
    rest = np.where(has_loss, length - start, 0)
    bucket = lambda n: min(piece_bucket(max(1, n)), t)  # never longer than the rows themselves
    tp = bucket(int(start[has_loss].max(initial=0)))
    ts = min(bucket(int(rest.max(initial=0)) - 1) + 1, t)
    out = {
        "prompt_tokens": np.zeros((p, k, tp), np.int32),
        "prompt_length": np.zeros((p, k), np.int32),
        "prompt_of": prompt_of,
        "rest_tokens": np.zeros((p, g, ts), np.int32),
        "rest_positions": np.zeros((p, g, ts), np.int32),
        "rest_segments": np.zeros((p, g, ts), np.int32),
        "rest_start": np.where(has_loss, start, 0).astype(np.int32),
    }
    for i in range(p):
        for kk, prompt in enumerate(prompts[i]):
            ids = np.frombuffer(prompt, tokens.dtype)
            out["prompt_tokens"][i, kk, : len(ids)] = ids
            out["prompt_length"][i, kk] = len(ids)
        for j in range(g):
            n, s = int(rest[i, j]), int(start[i, j])
            out["rest_tokens"][i, j, :n] = tokens[i, j, s : s + n]
            out["rest_positions"][i, j, :n] = np.arange(s, s + n)
            out["rest_segments"][i, j, :n] = 1
    return out
