"""BFCL v4 multi-turn data and the committed train/test split."""

from __future__ import annotations

import json

from rcgrpo_jax.envs import bfcl
from rcgrpo_jax.envs.entries import docs_added, docs_at_start, hidden_functions
from rcgrpo_jax.envs.executor import public_methods
from rcgrpo_jax.envs.split import NUM_TEST_SCENARIOS, SEED, SPLIT_PATH, make_split


def test_entries_carry_everything():
    for category in bfcl.CATEGORIES:
        entries = bfcl.load_entries(category)
        assert len(entries) == 200
        assert [e.index for e in entries] == list(range(200))
        for e in entries:
            assert e.id == f"{category}_{e.index}" and e.category == category
            assert len(e.question) == len(e.ground_truth) == e.num_turns >= 1
            assert sum(len(t) for t in e.ground_truth) >= 2
            names = {d["name"] for d in e.function_docs}
            methods = {m for c in e.involved_classes for m in public_methods(c)}
            assert names <= methods  # every documented function is executable
            for turn, missed in e.missed_function.items():
                assert e.question[turn] == [] and set(missed) <= names
                assert set(missed) <= hidden_functions(e, turn - 1)
                assert not set(missed) & hidden_functions(e, turn)
                assert [d["name"] for d in docs_added(e, turn)] == sorted(
                    missed, key=[d["name"] for d in e.function_docs].index
                )
            shown = {d["name"] for d in docs_at_start(e)}
            assert shown == names - hidden_functions(e, 0)
    assert bfcl.load_entries("base")[0] is bfcl.load_entries("multi_turn_base")[0]
    assert sum(bool(e.missed_function) for e in bfcl.load_entries("miss_func")) == 200
    assert all(e.long_context for e in bfcl.load_entries("long_context"))


def test_split_file_is_the_generator_output():
    committed = json.loads(SPLIT_PATH.read_text())
    assert committed == make_split(SEED, NUM_TEST_SCENARIOS)
    assert committed["seed"] == SEED
    assert make_split(SEED + 1) != committed  # the seed matters


def test_split_by_scenario_is_disjoint_and_complete():
    test_ids, train_ids = set(), set()
    for category in bfcl.CATEGORIES:
        test = bfcl.split_entries("test", category)
        train = bfcl.split_entries("train", category)
        assert len(test) == NUM_TEST_SCENARIOS and len(train) == 200 - NUM_TEST_SCENARIOS
        test_ids |= {e.id for e in test}
        train_ids |= {e.id for e in train}
    assert len(test_ids) == 80 and len(train_ids) == 720
    all_ids = {e.id for e in bfcl.load_all()}
    assert test_ids | train_ids == all_ids and not test_ids & train_ids

    def scenarios(ids):
        return {int(i.rsplit("_", 1)[1]) for i in ids}

    # No test scenario appears in training in any category.
    assert not scenarios(test_ids) & scenarios(train_ids)
    assert len(scenarios(test_ids)) == NUM_TEST_SCENARIOS
