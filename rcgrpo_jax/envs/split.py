"""The fixed train/test split of BFCL v4 multi-turn, by scenario index.

The four categories derive from the same 200 scenarios (`multi_turn_<cat>_N` from
`multi_turn_base_N`), so the test set is a set of scenario indices taken in every category:
20 scenarios x 4 categories = 80 test entries (accuracy steps of 1.25%), 720 train entries,
and no test scenario appears in training in any category.

The split is committed as data (`bfcl_split.json`); regenerate or check it with
`python -m rcgrpo_jax.envs.split [--write]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from pathlib import Path
from typing import Any

from rcgrpo_jax.envs.entries import CATEGORIES, Entry, load_entries, normalize_category

SPLIT_PATH = Path(__file__).with_name("bfcl_split.json")
SEED = 20260323
NUM_SCENARIOS = 200
NUM_TEST_SCENARIOS = 20
SPLITS = ("train", "test")


def make_split(seed: int = SEED, num_test: int = NUM_TEST_SCENARIOS) -> dict[str, Any]:
    """The split as committed: test scenario indices drawn uniformly without replacement."""
    test = sorted(random.Random(seed).sample(range(NUM_SCENARIOS), num_test))
    train = sorted(set(range(NUM_SCENARIOS)) - set(test))
    return {
        "seed": seed,
        "method": f"random.Random({seed}).sample(range({NUM_SCENARIOS}), {num_test}); "
        "a scenario index N selects multi_turn_<category>_N in all four categories",
        "categories": list(CATEGORIES),
        "test_scenarios": test,
        "train_scenarios": train,
        "test": {c: [f"{c}_{i}" for i in test] for c in CATEGORIES},
        "train": {c: [f"{c}_{i}" for i in train] for c in CATEGORIES},
    }


@functools.cache
def load_split() -> dict[str, Any]:
    """The committed split."""
    with open(SPLIT_PATH, encoding="utf-8") as f:
        return json.load(f)


def split_ids(split: str, category: str) -> list[str]:
    """Entry ids of `split` ("train" or "test") in one category."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return list(load_split()[split][normalize_category(category)])


def split_entries(split: str, category: str) -> list[Entry]:
    """Entries of `split` in one category, in file order."""
    wanted = set(split_ids(split, category))
    return [e for e in load_entries(category) if e.id in wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite bfcl_split.json")
    args = parser.parse_args()
    split = make_split()
    if args.write:
        SPLIT_PATH.write_text(json.dumps(split, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {SPLIT_PATH}")
        return
    same = json.loads(SPLIT_PATH.read_text(encoding="utf-8")) == split
    print(f"{SPLIT_PATH} {'matches' if same else 'DIFFERS from'} make_split(seed={SEED})")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
