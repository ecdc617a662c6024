"""RCTP / SFT trajectory datasets: labels are the rewards actually received (recomputed from the
stored records), the mix follows the settings, the loss mask covers assistant text only (with the
real Qwen2.5 tokenizer when present), and plain SFT holds label-1 examples without tokens."""

from __future__ import annotations

import json
import random
import re

import pytest

from rcgrpo_jax.data import perturb as P
from rcgrpo_jax.data import store
from rcgrpo_jax.data import trajectories as T
from rcgrpo_jax.envs import bfcl, prompts
from rcgrpo_jax.envs.calls import extract_calls
from rcgrpo_jax.envs.executor import public_methods
from rcgrpo_jax.envs.policies import ground_truth_text

ENTRIES = (
    bfcl.split_entries("train", "multi_turn_base")[:3]
    + bfcl.split_entries("train", "multi_turn_miss_func")[:1]
)
BY_ID = {e.id: e for e in ENTRIES}
SOURCES = {T.GROUND_TRUTH, T.ROLLOUT, *(T.PERTURB_PREFIX + k for k in P.PERTURBATIONS)}


class CharTokenizer:
    """The slice of the transformers tokenizer interface `envs.prompts` uses: one id per
    character, special tokens whole, a ChatML-like template. Shows the builder needs no more."""

    unk_token_id = 0

    def __init__(self) -> None:
        self.special = ["<|im_start|>", "<|im_end|>"]

    def __len__(self) -> int:
        return 0x110000 + len(self.special) + 1

    def _pattern(self) -> re.Pattern:
        return re.compile("(" + "|".join(re.escape(s) for s in self.special) + ")")

    def add_tokens(self, tokens, special_tokens=False) -> int:
        new = [t for t in tokens if t not in self.special]
        self.special += new
        return len(new)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.special.index(token) + 1 if token in self.special else self.unk_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for part in self._pattern().split(text):
            if part in self.special:
                ids.append(self.convert_tokens_to_ids(part))
            else:
                ids += [len(self.special) + 1 + ord(c) for c in part]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        n = len(self.special) + 1
        return "".join(self.special[i - 1] if i < n else chr(i - n) for i in ids)

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False
    ):
        out = ""
        for m in messages:
            content = m["content"]
            if m["role"] == "system" and tools:
                content += "\n# Tools\n" + json.dumps(tools)
            out += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def half_right(episodes):
    """Stand-in rollout policy: ground truth on even scenarios, no calls on odd ones."""
    return [
        ground_truth_text(e) if e.entry.index % 2 == 0 else prompts.NO_CALL_TEXT for e in episodes
    ]


def make_settings(**overrides) -> T.DataSettings:
    """Every perturbation, one rollout per entry, every label-0 example kept."""
    return T.DataSettings(**{"low_per_high": -1.0, "rollouts_per_entry": 1, **overrides})


def records(dataset_dir: str, split: str = "train") -> list[dict]:
    src = store.load_split(dataset_dir, split)
    return [src[i] for i in range(len(src))]


@pytest.fixture(scope="module")
def rctp_build(tmp_path_factory):
    tok = CharTokenizer()
    report = T.build_rctp_dataset(
        make_settings(), tok, ENTRIES, tmp_path_factory.mktemp("rctp"), policy=half_right
    )
    return tok, report, records(report["dataset_dir"])


def assistant_texts(tok, rec) -> list[str]:
    """Masked tokens, decoded and cut at each end-of-turn token: one text per assistant message."""
    masked = [t for t, m in zip(rec["tokens"], rec["loss_mask"], strict=True) if m]
    text = tok.decode(masked, skip_special_tokens=False)
    eot = prompts.end_of_turn_token(tok)
    assert text.endswith(eot)
    return text[: -len(eot)].split(eot)


def test_labels_are_recomputed_rewards(rctp_build):
    tok, report, recs = rctp_build
    assert {r["source"] for r in recs} == SOURCES
    for rec in recs:
        entry = BY_ID[rec["entry_id"]]
        assert T.recompute_reward(rec, entry).reward == rec["label"]
        # The stored tokens hold the same calls as the stored decoded trajectory.
        meta = json.loads(rec["meta"])
        steps = [extract_calls(t, "qwen") for t in assistant_texts(tok, rec)]
        assert [s for s in steps if s] == [step for turn in meta["decoded"] for step in turn]
    by_source = T.count_labels(recs)
    assert all(row[0] == 0 for s, row in by_source.items() if s == T.GROUND_TRUTH)
    # Labels come from the reward, not the source: some perturbations still score 1 ...
    assert sum(row[1] for s, row in by_source.items() if s.startswith(T.PERTURB_PREFIX)) > 0
    # ... and the stand-in rollout policy gets both labels.
    even = sum(e.index % 2 == 0 for e in ENTRIES)
    assert by_source[T.ROLLOUT] == {0: len(ENTRIES) - even, 1: even} and 0 < even < len(ENTRIES)


def test_counts_match_stored_records(rctp_build):
    _, report, recs = rctp_build
    assert report["splits"]["train"] == T.count_labels(recs)
    assert report["pool"]["train"] == report["splits"]["train"]  # low_per_high < 0 keeps all
    skipped = sum(report["skipped"]["train"].values())
    n_pert = len(ENTRIES) * len(P.PERTURBATIONS)
    assert len(recs) == len(ENTRIES) * 2 + n_pert - skipped
    table = T.format_counts(report["splits"]["train"])
    assert table.splitlines()[-1].split()[1:] == [
        str(sum(r[0] for r in report["splits"]["train"].values())),
        str(sum(r[1] for r in report["splits"]["train"].values())),
        str(len(recs)),
    ]


def test_reward_token_at_start_of_system_prompt(rctp_build):
    tok, report, recs = rctp_build
    ids = {r: tok.convert_tokens_to_ids(t) for r, t in prompts.REWARD_TOKENS.items()}
    assert report["reward_tokens"] == ids
    prefix = tok.encode("<|im_start|>system\n")
    for rec in recs:
        tokens = list(rec["tokens"])
        assert rec["reward_token"] == ids[rec["label"]]
        assert tokens[len(prefix)] == rec["reward_token"]
        assert tokens[: len(prefix)] == prefix
        assert sum(t in ids.values() for t in tokens) == 1
        assert rec["loss_mask"][len(prefix)] == 0


def test_mix_ratio_and_determinism():
    settings = make_settings(low_per_high=1.0, rollouts_per_entry=0)
    tok = CharTokenizer()
    splits, report = T.build_examples(settings, tok, ENTRIES)
    pool, kept = report["pool"]["train"], report["splits"]["train"]
    n_high = sum(r[1] for r in pool.values())
    n_low = sum(r[0] for r in kept.values())
    assert sum(r[1] for r in kept.values()) == n_high
    assert n_low == min(n_high, sum(r[0] for r in pool.values())) > 0
    again, _ = T.build_examples(settings, tok, ENTRIES)
    assert [(r["source"], r["tokens"]) for r in again["train"]] == [
        (r["source"], r["tokens"]) for r in splits["train"]
    ]
    held = make_settings(heldout_entries=1, rollouts_per_entry=0)
    parts, report = T.build_examples(held, tok, ENTRIES)
    assert {r["entry_id"] for r in parts["heldout"]}.isdisjoint(
        {r["entry_id"] for r in parts["train"]}
    )
    assert len({r["entry_id"] for r in parts["heldout"]}) == 1
    short = make_settings(max_tokens=1, rollouts_per_entry=0)
    with pytest.raises(ValueError, match="no training examples"):
        T.build_rctp_dataset(make_settings(max_tokens=1), tok, ENTRIES[:1], "/nonexistent")
    assert T.build_examples(short, tok, ENTRIES[:1])[1]["too_long"]["train"] > 0


def test_sft_mode_is_label_one_without_tokens(tmp_path):
    tok = CharTokenizer()
    report = T.build_rctp_dataset(
        make_settings(enabled=False), tok, ENTRIES, tmp_path, policy=half_right
    )
    recs = records(report["dataset_dir"])
    assert recs and all(r["label"] == 1 and r["reward_token"] == -1 for r in recs)
    assert report["reward_tokens"] == {} and len(tok.special) == 2  # no tokens added
    text = "".join(tok.decode(r["tokens"]) for r in recs)
    assert not any(t in text for t in prompts.REWARD_TOKENS.values())
    high = {s: row[1] for s, row in report["pool"]["train"].items() if row[1]}
    assert {s: row[1] for s, row in T.count_labels(recs).items()} == high


def test_rejects_test_split_entries():
    entries = bfcl.split_entries("test", "multi_turn_base")[:1]
    with pytest.raises(ValueError, match="not in the training split"):
        T.build_examples(T.DataSettings(), CharTokenizer(), entries)


def test_unknown_perturbation_kind_is_rejected():
    with pytest.raises(ValueError, match=r"unknown perturbations \['bogus'\]"):
        T.DataSettings(perturbations=("wrong_arg", "bogus"))


def test_perturbations_change_the_plan():
    entry = ENTRIES[0]
    truth = P.ground_truth_plan(entry, "qwen")
    offered = {n for c in entry.involved_classes for n in public_methods(c)}
    for kind in P.PERTURBATIONS:
        p = P.perturb(entry, truth, kind, random.Random(kind))
        assert p is not None and p.kind == kind
        assert P.plan_key(p.plan) != P.plan_key(truth)
        changed = [t for t in range(len(truth)) if P.plan_key(p.plan)[t] != P.plan_key(truth)[t]]
        assert changed[0] == p.turn
        if kind == "premature_stop":
            assert all(not calls for calls in p.plan[p.turn + 1 :])
        else:
            assert changed == [p.turn]
        if kind == "foreign_call":
            assert {c.name for step in p.plan[p.turn] for c in step} - offered
    single = next(e for e in bfcl.split_entries("train", "multi_turn_base") if e.id.endswith("_4"))
    assert all(len(calls) <= 1 for calls in single.ground_truth)
    plan = P.ground_truth_plan(single, "qwen")
    assert P.perturb(single, plan, "wrong_order", random.Random()) is None
    with pytest.raises(ValueError, match="unknown perturbation"):
        P.perturb(single, plan, "bogus", random.Random())


def test_scripted_policy_plays_several_steps_per_turn():
    """Plans may split a turn into assistant steps (synthetic look-then-act tasks)."""
    entry = ENTRIES[0]
    truth = P.ground_truth_plan(entry, "qwen")
    t = next(t for t, turn in enumerate(truth) if len(turn[0]) >= 2)
    (calls,) = truth[t]
    split = tuple(((calls[0],), calls[1:]) if u == t else turn for u, turn in enumerate(truth))
    episode = bfcl.Episode(entry, "qwen")
    bfcl.run_episodes([episode], P.ScriptedPolicy({episode: split}))
    assert [len(steps) for steps in episode.decoded] == [len(turn) for turn in split]
    assert episode.result().reward == 1.0
    stop = P.perturb(entry, split, "premature_stop", random.Random(3))
    assert all(len(step) > 0 for turn in stop.plan for step in turn)


# ---------------------------------------------------------------------------------------------
# Real tokenizer


@pytest.fixture(scope="module")
def qwen(tokenizer_root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_root / "qwen2.5"))


def test_loss_mask_is_assistant_text_with_qwen(qwen, tmp_path):
    settings = make_settings(perturbations=("wrong_arg", "missing_step"), rollouts_per_entry=0)
    report = T.build_rctp_dataset(settings, qwen, ENTRIES[:1], tmp_path)
    recs = records(report["dataset_dir"])
    assert {r["label"] for r in recs} == {0, 1}
    ids = {r: qwen.convert_tokens_to_ids(t) for r, t in prompts.REWARD_TOKENS.items()}
    assert report["reward_tokens"] == ids and len(qwen) > max(ids.values())
    # The conversations themselves, played again (the builder is deterministic).
    played, _ = T.collect_trajectories(ENTRIES[:1], settings)
    by_source = {t.source: t for t in played}
    prefix = qwen.encode("<|im_start|>system\n", add_special_tokens=False)
    for rec in recs:
        episode = by_source[rec["source"]].episode
        assert episode.decoded == json.loads(rec["meta"])["decoded"]
        assistant = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        tokens = list(rec["tokens"])
        assert tokens[: len(prefix)] == prefix and tokens[len(prefix)] == ids[rec["label"]]
        assert rec["loss_mask"][len(prefix)] == 0
        assert sum(t in ids.values() for t in tokens) == 1
        assert assistant_texts(qwen, rec) == assistant
        # One masked run per assistant message (its text plus <|im_end|>); headers unmasked.
        runs = list(re.finditer("1+", "".join(map(str, rec["loss_mask"]))))
        assert len(runs) == len(assistant)
        for run in runs:
            assert qwen.decode(tokens[run.start() - 3 : run.start()]) == "<|im_start|>assistant\n"
            assert qwen.decode(tokens[run.end() - 1 : run.end()]) == "<|im_end|>"
