"""Synthetic file-system tasks and the tiny SentencePiece tokenizer (the CPU demo's env)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
from conftest import REPO, mask_runs

from rcgrpo_jax.envs import policies, prompts, synthetic, tiny_tokenizer
from rcgrpo_jax.envs.calls import extract_calls, parse_call
from rcgrpo_jax.envs.reward import RESPONSE_MISMATCH, STATE_MISMATCH

N = 40
VOCAB = 1024


@pytest.fixture(scope="module")
def tasks() -> dict[str, list]:
    return {split: synthetic.make_tasks(split, N, seed=0) for split in synthetic.SPLITS}


REFERENCES = {
    "ground_truth": policies.ground_truth,
    "empty": policies.empty,
    "act_without_looking": synthetic.act_without_looking,
}


def play_references(entries, reward_token=None) -> dict[str, dict[str, object]]:
    """{policy name: {task id: its finished episode}}: each task played once per reference."""
    return {
        name: {e.id: synthetic.play(e, policy, reward_token) for e in entries}
        for name, policy in REFERENCES.items()
    }


@pytest.fixture(scope="module")
def plays(tasks):
    """The module's train and test tasks, each played once under each reference policy."""
    return play_references(tasks["train"] + tasks["test"])


@pytest.fixture(scope="module")
def conversations(tasks) -> list[list[dict]]:
    """The first 20 tasks of each split under each reference policy, with the high reward
    token: what the tokenizer tests render."""
    entries = tasks["train"][:20] + tasks["test"][:20]
    played = play_references(entries, reward_token=1)
    return [played[name][e.id].messages for e in entries for name in REFERENCES]


@pytest.fixture(scope="module")
def tok(tasks, tmp_path_factory):
    return tiny_tokenizer.load_or_train(
        tmp_path_factory.mktemp("run"), tasks["train"], vocab_size=VOCAB
    )


def fingerprint(entries) -> str:
    data = [
        (e.id, e.question, e.initial_config, e.ground_truth, e.ground_truth_steps) for e in entries
    ]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def names_in(entry) -> set[str]:
    """Every name in a task: folders, files, contents, and names the ground truth creates."""
    found: set[str] = set()

    def walk(tree):
        for name, item in tree.items():
            found.add(name.split(".")[0])
            if item["type"] == "directory":
                walk(item["contents"])
            else:
                found.update(item["content"].split())

    walk(entry.initial_config["GorillaFileSystem"]["root"])
    for call in (c for turn in entry.ground_truth for c in turn):
        for value in parse_call(call).kwargs.values():
            found.update(re.findall(r"[a-z]{4}", str(value)))
    return found


# ---------------------------------------------------------------------------------------------
# Tasks


def test_tasks_are_deterministic_and_independent_of_n(tasks):
    again = synthetic.make_tasks("train", 5, seed=0)
    assert fingerprint(again) == fingerprint(tasks["train"][:5])
    assert fingerprint(synthetic.make_tasks("train", 5, seed=1)) != fingerprint(again)
    assert all(e.category == "synthetic" and e.index == i for i, e in enumerate(tasks["train"]))


def test_tasks_do_not_depend_on_hash_seed():
    code = (
        "from rcgrpo_jax.envs import synthetic; import test_synthetic as t; "
        "print(t.fingerprint(synthetic.make_tasks('test', 6, seed=3)))"
    )
    outs = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout.strip().splitlines()[-1])
    assert len(outs) == 1


def test_train_and_test_are_disjoint(tasks):
    assert not set(synthetic.NAMES["train"]) & set(synthetic.NAMES["test"])
    ids = {split: {e.id for e in tasks[split]} for split in tasks}
    assert len(ids["train"]) == len(ids["test"]) == N and not ids["train"] & ids["test"]
    for split, entries in tasks.items():
        for e in entries:
            names = names_in(e)
            assert len(names) >= 8
            assert {synthetic.name_split(n) for n in names} == {split}, e.id


def test_difficulty_knobs():
    easy = synthetic.make_tasks("train", 8, seed=5, turns=(1, 1), depth=1, distractors=0)
    hard = synthetic.make_tasks("train", 8, seed=5, turns=(3, 3), depth=3, distractors=3)
    assert {e.num_turns for e in easy} == {1} and {e.num_turns for e in hard} == {3}
    # depth 1: every folder sits at the top, so instructions name no nested path
    assert not any("/" in e.question[0][0]["content"] for e in easy)

    def folders(entry):
        (root,) = entry.initial_config["GorillaFileSystem"]["root"].values()
        stack, out = [root], []
        while stack:
            items = stack.pop()["contents"]
            out.append(items)
            stack += [v for v in items.values() if v["type"] == "directory"]
        return out[1:]  # below the root

    for entries, depth, files in ((easy, 1, 1), (hard, 3, 4)):
        for e in entries:
            below = folders(e)
            assert all(sum(v["type"] == "file" for v in f.values()) == files for f in below)
            assert 2 <= len(below) <= 2 * depth
    assert any(len(folders(e)) > 4 for e in hard)  # some reach below depth 2
    assert sum(len(c) for e in hard for c in e.ground_truth) > sum(
        len(c) for e in easy for c in e.ground_truth
    )
    only = synthetic.make_tasks("test", 4, seed=0, templates=("rename_by_ext",), followup=0.0)
    assert all(e.question[0][0]["content"].startswith(("Rename", "There")) for e in only)
    # a task's kind: its turns' templates in order (what evaluations report success by)
    assert {k for e in only for k in e.kind.split(">")} == {"rename_by_ext"}
    for e in hard:
        kinds = e.kind.split(">")
        assert len(kinds) == e.num_turns and kinds[0] in synthetic.MAIN_TEMPLATES
        assert set(kinds) <= {*synthetic.MAIN_TEMPLATES, *synthetic.FOLLOWUP_TEMPLATES}
    for bad in ({"turns": (0, 2)}, {"depth": 0}, {"templates": ("nope",)}):
        with pytest.raises(ValueError):
            synthetic.make_tasks("train", 1, **bad)
    with pytest.raises(ValueError):
        synthetic.make_tasks("valid", 1)


def check_reference_plays(entries, plays) -> None:
    """Per task, from one play under each reference policy: the ground truth succeeds, looking
    before it acts; no calls, or acting on the right names without the look-ups, fail. And
    acting needs what was observed: every argument was shown to the agent before (instruction,
    prompt or a tool result), and every task has an argument that only a tool result showed."""
    for entry in entries:
        truth = plays["ground_truth"][entry.id]
        assert truth.result().reward == 1.0, entry.id
        # golden trajectories look, then act: more than one assistant call step per turn 1
        assert len(truth.decoded[0]) == len(entry.ground_truth_steps[0]) >= 2
        assert plays["empty"][entry.id].result().reward == 0.0
        blind = plays["act_without_looking"][entry.id].result()
        assert blind.reward == 0.0 and blind.error_type in (RESPONSE_MISMATCH, STATE_MISMATCH)
        told, observed, needs_looking = "", "", 0
        for m in truth.messages:
            if m["role"] in ("system", "user"):
                told += m["content"]
            elif m["role"] == "tool":
                observed += m["content"]
            else:
                for call in extract_calls(m["content"], "python"):
                    for value in parse_call(call).kwargs.values():
                        assert value in told or value in observed, (entry.id, call)
                        needs_looking += value not in told
        assert needs_looking >= 1, entry.id
        # the first instruction never names the file acted on
        first = entry.ground_truth_steps[0][-1]
        targets = [parse_call(c).kwargs.get("source") for c in first]
        targets += [parse_call(c).kwargs.get("content") for c in first]
        assert not any(t and t in entry.question[0][0]["content"] for t in targets), entry.id


def test_reference_policies_and_what_acting_needs(tasks, plays):
    check_reference_plays(tasks["train"] + tasks["test"], plays)


def test_top_file_templates_put_the_name_last_in_the_listing():
    """The fixed-offset templates (rename_top, copy_top, count_top) obey the same rules as the
    others, and the file acted on is the last item `ls` lists, so the call that copies it
    follows it at the same token distance in every task."""
    kw = dict(templates=("rename_top", "copy_top", "count_top"), turns=(1, 1))
    top = [e for s in ("train", "test") for e in synthetic.make_tasks(s, 6, seed=3, **kw)]
    plays = play_references(top)
    check_reference_plays(top, plays)
    for entry in top:
        messages = plays["ground_truth"][entry.id].messages
        listing = next(m["content"] for m in messages if m["role"] == "tool")
        act = [m["content"] for m in messages if m["role"] == "assistant"][1]
        (call,) = extract_calls(act, "python")
        target = next(iter(parse_call(call).kwargs.values()))  # source= / file_name=
        assert listing.endswith(f'"{target}"]}}'), (entry.id, listing, call)


# ---------------------------------------------------------------------------------------------


DEMO_TEMPLATES = ("count_top", "copy_top", "rename_top", "rename_by_ext", "clone_text")


def role_of(name: str) -> str | None:
    """The role whose names include `name` (None for a word that is no role's, e.g. "file")."""
    roles = [r for r in synthetic.ROLES if any(name in v for v in synthetic.ROLE_NAMES[r].values())]
    return roles[0] if roles else None


def test_name_roles_draw_each_role_from_its_own_syllables():
    """With `name_roles`, folders, files and new names come from disjoint syllables, each role
    split 1 in 5 like `NAMES`; the tasks still obey every rule, and a name the agent copies in
    the top-file templates is the only one of its role in view."""
    syllables = {
        r: {n[:2] for v in synthetic.ROLE_NAMES[r].values() for n in v}
        | {n[2:] for v in synthetic.ROLE_NAMES[r].values() for n in v}
        for r in synthetic.ROLES
    }
    assert all(len(s) == 10 for s in syllables.values())
    assert not set.intersection(*syllables.values())
    for r in synthetic.ROLES:
        names = synthetic.ROLE_NAMES[r]
        assert (len(names["train"]), len(names["test"])) == (20, 5)
        assert {synthetic.name_split(n) for n in synthetic.ROLE_NAMES[r]["test"]} == {"test"}
    kw = dict(templates=DEMO_TEMPLATES, turns=(1, 1), name_roles=True, depth=1, distractors=1)
    made = {s: synthetic.make_tasks(s, 20, seed=2, **kw) for s in synthetic.SPLITS}
    checked = 0
    plays = play_references([e for entries in made.values() for e in entries])
    check_reference_plays([e for entries in made.values() for e in entries], plays)
    for split, entries in made.items():
        for e in entries:
            (root,) = e.initial_config["GorillaFileSystem"]["root"].values()
            for name, item in root["contents"].items():
                want = "dir" if item["type"] == "directory" else "file"
                assert role_of(name.split(".")[0]) == want, (e.id, name)
            act = e.ground_truth[0][-1]
            for value in parse_call(act).kwargs.values():
                for name in re.findall(r"[a-z]{4}", value):  # names; contents are no role's
                    assert role_of(name) is None or synthetic.name_split(name) == split
            if act.startswith(("mv", "cp", "wc")) and "top" in e.question[0][0]["content"]:
                messages = plays["ground_truth"][e.id].messages
                seen = " ".join(str(m["content"]) for m in messages[:-3])  # before the act
                for value in parse_call(act).kwargs.values():
                    stem = value.split(".")[0]
                    if len(stem) == 4:
                        found = re.findall(r"[a-z]{4}", seen)
                        same_role = {n for n in found if role_of(n) == role_of(stem)}
                        assert same_role == {stem}, (e.id, act, same_role)
                        checked += 1
    assert checked >= 20
    with pytest.raises(ValueError, match="name_roles"):  # 5 held-out file names per role
        synthetic.make_tasks("test", 1, templates=DEMO_TEMPLATES, name_roles=True, depth=2)


# Tokenizer


def test_tokenizer_round_trips_exactly(tok, conversations):
    for messages in conversations:
        text = prompts.render_text(tok, messages)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    odd = "  two  spaces\ttab\n\nnewlines é ü 😀 \u2581 <0x41> <|end ascii ~`^ {}[]"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd
    assert tok.unk_token_id not in tok.encode(odd, add_special_tokens=False)


def test_special_tokens_are_single_ids(tok):
    vocab = len(tok)
    assert vocab <= VOCAB
    ids = {t: tok.encode(t, add_special_tokens=False) for t in tiny_tokenizer.SPECIAL_TOKENS}
    assert all(len(v) == 1 and v[0] != tok.unk_token_id for v in ids.values())
    assert len({v[0] for v in ids.values()}) == len(ids)
    reward_ids = prompts.add_reward_tokens(tok)
    assert len(tok) == vocab  # already present: no new ids
    assert reward_ids == {r: ids[t][0] for r, t in prompts.REWARD_TOKENS.items()}
    assert prompts.end_of_turn_token(tok) == tiny_tokenizer.END_OF_TURN
    assert tok.eos_token_id == ids[tiny_tokenizer.END_OF_TURN][0]
    # a reward token in the middle of text is still one id
    text = f"ab{prompts.REWARD_TOKENS[0]}cd"
    assert reward_ids[0] in tok.encode(text, add_special_tokens=False)


def test_syllables_are_not_in_the_fixed_text(tasks, plays):
    """Name syllables occur only inside names: the prompt, docs and templates stay whole."""
    for split in ("train", "test"):
        for entry in tasks[split]:
            names = re.compile(r"\b(" + "|".join(sorted(names_in(entry))) + r")\b")
            for played in plays.values():
                text = tiny_tokenizer.render(played[entry.id].messages)
                fixed = names.sub("#", text)
                assert not [s for s in synthetic.SYLLABLES if s in fixed], entry.id


def test_names_are_syllable_ids_in_every_context(tok, conversations):
    """A name is the same two ids in an instruction, a tool result, a file's text or a call."""
    ids = {s: tok.encode(s, add_special_tokens=False) for s in synthetic.SYLLABLES}
    assert all(len(v) == 1 for v in ids.values()) and len({v[0] for v in ids.values()}) == len(ids)
    by_id = {v[0]: s for s, v in ids.items()}
    pattern = re.compile("|".join(synthetic.SYLLABLES))
    for messages in conversations:
        text = prompts.render_text(tok, messages)
        got = [by_id[i] for i in tok.encode(text, add_special_tokens=False) if i in by_id]
        assert got == pattern.findall(text)


def test_loss_mask_is_exactly_the_assistant_spans(tok, conversations):
    eot = tiny_tokenizer.END_OF_TURN
    for messages in conversations[::7]:
        ids, mask = prompts.render_with_mask(tok, messages)
        text = prompts.render_text(tok, messages)
        assert ids == tok.encode(text, add_special_tokens=False)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = mask_runs(mask)
        assert len(spans) == len(assistant)
        for i, (start, end) in zip(assistant, spans, strict=True):
            assert tok.decode(ids[start:end]) == messages[i]["content"] + eot
            prompt = prompts.prompt_ids(tok, messages[:i])
            assert ids[: len(prompt)] == prompt and len(prompt) == start
            assert tok.decode(prompt).endswith(tiny_tokenizer.ROLE_TOKENS["assistant"])
        low = prompts.set_reward_token(messages, 0)
        low_ids, low_mask = prompts.render_with_mask(tok, low)
        assert low_mask == mask and sum(a != b for a, b in zip(ids, low_ids, strict=True)) == 1


def test_conversations_fit_the_token_budget(tok, tasks, plays):
    lengths = {
        split: sorted(
            len(prompts.render_with_mask(tok, plays["ground_truth"][e.id].messages)[0])
            for e in tasks[split]
        )
        for split in tasks
    }
    for split, lens in lengths.items():
        print(split, "tokens: min", lens[0], "median", statistics.median(lens), "max", lens[-1])
        assert 100 <= statistics.median(lens) <= 400
        assert lens[-1] <= 700
    # held-out names are split like training names: no blow-up on the test split
    assert statistics.median(lengths["test"]) <= 1.3 * statistics.median(lengths["train"])


def test_tokenizer_saved_with_a_qwen2_export_loads_as_saved(tok, conversations, tmp_path):
    """A stage's export holds the tokenizer beside a qwen2 config.json; AutoTokenizer alone
    would rebuild it as Qwen2Tokenizer (another pre-tokenizer), so RL arms read other ids."""
    import ml_collections

    from rcgrpo_jax.stages import setup

    tok.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    c = ml_collections.ConfigDict(
        {"tokenizer_path": "", "model": {"hf_path": ""}, "env": {"benchmark": "synthetic"}}
    )
    loaded = setup.tokenizer_from_config(c, str(tmp_path))
    text = prompts.render_text(tok, conversations[0])
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )


def test_tokenizer_is_cached_and_deterministic(tok, tasks, conversations, tmp_path):
    first = tiny_tokenizer.load_or_train(tmp_path, tasks["train"], vocab_size=VOCAB)
    saved = (tmp_path / tiny_tokenizer.SUBDIR / "tokenizer.json").read_bytes()
    again = tiny_tokenizer.load_or_train(tmp_path, [], vocab_size=VOCAB)  # no tasks: must load
    text = prompts.render_text(first, conversations[0])
    assert again.encode(text) == first.encode(text) == tok.encode(text)  # same as the fixture's
    assert again.get_vocab() == tok.get_vocab()
    assert (tmp_path / tiny_tokenizer.SUBDIR / "tokenizer.json").read_bytes() == saved
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_tokenizer.load_or_train(tmp_path, [], vocab_size=VOCAB * 2)


def test_cached_tokenizer_of_another_environment_is_refused(tasks, tmp_path):
    texts = lambda: tiny_tokenizer.corpus(tasks["train"])
    first = tiny_tokenizer.load_or_train_texts(tmp_path, texts(), VOCAB, source="synthetic")
    again = tiny_tokenizer.load_or_train_texts(tmp_path, iter(()), VOCAB, source="synthetic")
    assert again.get_vocab() == first.get_vocab()
    with pytest.raises(ValueError, match="trained for 'synthetic', not 'calculator'"):
        tiny_tokenizer.load_or_train_texts(tmp_path, iter(()), VOCAB, source="calculator")


# ---------------------------------------------------------------------------------------------
# The "rl" split (rl_split / env.synthetic.num_rl)


def test_rl_split_names_are_disjoint_and_cover_all_names():
    """With `rl_split`, a second 1-in-5 class of names moves from "train" to "rl"; "test" keeps
    its names (in order), and without it nothing changes."""
    three = {s: set(v) for s, v in synthetic.NAMES3.items()}
    assert set(three) == {"train", "test", "rl"} == set(synthetic.SPLITS3)
    assert not three["train"] & three["test"] and not three["train"] & three["rl"]
    assert not three["test"] & three["rl"]
    every = {a + b for a in synthetic.SYLLABLES for b in synthetic.SYLLABLES}
    assert set.union(*three.values()) == every == set().union(*map(set, synthetic.NAMES.values()))
    assert synthetic.NAMES3["test"] == synthetic.NAMES["test"]
    assert three["train"] | three["rl"] == set(synthetic.NAMES["train"])
    for split, names in synthetic.NAMES3.items():
        assert {synthetic.name_split(n, rl_split=True) for n in names} == {split}
    assert {synthetic.name_split(n) for n in synthetic.NAMES3["rl"]} == {"train"}
    for r in synthetic.ROLES:
        roles3, roles = synthetic.ROLE_NAMES3[r], synthetic.ROLE_NAMES[r]
        assert {s: len(v) for s, v in roles3.items()} == {"train": 15, "test": 5, "rl": 5}
        assert roles3["test"] == roles["test"]
        assert set(roles3["train"]) | set(roles3["rl"]) == set(roles["train"])
        assert not set(roles3["train"]) & set(roles3["rl"])


@pytest.fixture(scope="module")
def rl_env():
    from rcgrpo_jax.envs.builtin import SyntheticEnvironment

    return SyntheticEnvironment(num_train=8, num_test=8, seed=0, num_rl=8)


def test_rl_split_tasks_use_only_their_own_names(rl_env, tasks):
    made = {s: rl_env.tasks(s) for s in synthetic.SPLITS3}
    assert [e.id for e in made["rl"]] == [f"synthetic_rl_0_{i}" for i in range(8)]
    for split, entries in made.items():
        for e in entries:
            names = names_in(e)
            assert len(names) >= 8
            assert {synthetic.name_split(n, rl_split=True) for n in names} == {split}, e.id
    entries = [e for split in synthetic.SPLITS3 for e in made[split]]
    check_reference_plays(entries, play_references(entries))
    # The held-out tasks are today's; train tasks are new (they lose the rl names).
    assert fingerprint(made["test"]) == fingerprint(tasks["test"][:8])
    assert fingerprint(made["train"]) != fingerprint(tasks["train"][:8])


def test_rl_split_with_name_roles():
    kw = dict(templates=DEMO_TEMPLATES, turns=(1, 1), name_roles=True, depth=1, distractors=1)
    made = {s: synthetic.make_tasks(s, 6, seed=2, rl_split=True, **kw) for s in synthetic.SPLITS3}
    for split, entries in made.items():
        for e in entries:
            role_names = {n for n in names_in(e) if role_of(n) is not None}  # not contents
            assert role_names and {synthetic.name_split(n, True) for n in role_names} == {split}
    plain = synthetic.make_tasks("test", 6, seed=2, **kw)
    assert fingerprint(made["test"]) == fingerprint(plain)
    with pytest.raises(ValueError, match="name_roles: a rl task"):  # 5 rl file names per role
        synthetic.make_tasks("rl", 1, rl_split=True, templates=DEMO_TEMPLATES, name_roles=True)


def test_without_num_rl_the_splits_are_unchanged(tasks):
    from rcgrpo_jax.envs.builtin import SyntheticEnvironment

    env = SyntheticEnvironment(num_train=5, num_test=5, seed=0)
    assert fingerprint(env.tasks("train")) == fingerprint(tasks["train"][:5])
    assert fingerprint(env.tasks("test")) == fingerprint(tasks["test"][:5])
    with pytest.raises(ValueError, match="env.synthetic.num_rl"):
        env.tasks("rl")
    with pytest.raises(ValueError, match="rl_split"):
        synthetic.make_tasks("rl", 1)
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("valid")
    with pytest.raises(ValueError, match="num_rl"):
        SyntheticEnvironment(num_rl=-1)


def test_multiturn_task_set_acts_on_what_the_earlier_turn_touched():
    """configs/tiny_multiturn.py's tasks: 2-3 turns, every later turn a follow-up whose call
    names the file the previous turn's calls produced or found."""
    from conftest import shipped_config

    from rcgrpo_jax.envs.calls import parse_call

    d = shipped_config("tiny_multiturn").env.synthetic.difficulty
    tasks = synthetic.make_tasks("test", 24, seed=3, **d.to_dict())
    assert {e.num_turns for e in tasks} == {2, 3}
    for e in tasks:
        kinds = e.kind.split(">")
        assert kinds[0] in d.templates and set(kinds[1:]) <= set(synthetic.FOLLOWUP_TEMPLATES)
        for t in range(1, e.num_turns):
            call = parse_call(e.ground_truth[t][-1])
            file = call.kwargs.get("source", call.kwargs.get("file_name"))
            assert file and file in " ".join(e.ground_truth[t - 1]), (e.kind, e.ground_truth)
