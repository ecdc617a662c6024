"""BFCL v4 multi-turn entries read from the installed bfcl-eval package (data only, no imports
of its runners, which write folders and pull API clients)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

# bfcl_eval.constants.executable_backend_config.MULTI_TURN_FUNC_DOC_FILE_MAPPING (v4 classes).
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}


@dataclass(frozen=True, eq=False)
class Entry:
    """One multi-turn test case with its ground truth. Treat nested values as read-only.

    Compared and hashed by identity (entries are loaded once and shared)."""

    id: str
    category: str  # e.g. "multi_turn_base"
    index: int  # scenario index, shared across categories
    question: list[list[dict[str, str]]]  # per turn, the user messages ([] on miss_func turns)
    initial_config: dict[str, Any]
    involved_classes: tuple[str, ...]
    missed_function: dict[int, tuple[str, ...]]  # turn -> names hidden until that turn
    ground_truth: list[list[str]]  # per turn, BFCL call strings
    function_docs: tuple[dict[str, Any], ...]  # BFCL docs of all involved classes
    # Optional split of each turn's ground truth into assistant steps (synthetic tasks: look,
    # then act on what was seen). Empty: the whole turn is one step, as in BFCL.
    ground_truth_steps: tuple[tuple[tuple[str, ...], ...], ...] = ()
    # The environment's choice of system prompt: a few lines with one signature per function
    # (`prompts.system_message(compact=True)`, python call format) instead of BFCL's.
    compact_prompt: bool = False
    # What sort of task it is, for success per kind (`envs.base.task_kind`); "" = its category.
    # Synthetic tasks: their turns' templates joined by ">".
    kind: str = ""

    @property
    def long_context(self) -> bool:
        """bfcl-eval loads the simulators in long-context mode for this category."""
        return "long_context" in self.category

    @property
    def num_turns(self) -> int:
        return len(self.ground_truth)

    def bfcl_dict(self) -> dict[str, Any]:
        """The entry in bfcl-eval's own shape (what its `multi_turn_checker` takes)."""
        return {
            "id": self.id,
            "question": self.question,
            "initial_config": self.initial_config,
            "involved_classes": list(self.involved_classes),
            **(
                {"missed_function": {str(k): list(v) for k, v in self.missed_function.items()}}
                if self.missed_function
                else {}
            ),
        }


def truth_steps(entry: Entry, turn: int) -> tuple[tuple[str, ...], ...]:
    """The ground truth of `turn` as assistant steps (one step per BFCL turn with calls)."""
    if entry.ground_truth_steps:
        return entry.ground_truth_steps[turn]
    calls = tuple(entry.ground_truth[turn])
    return (calls,) if calls else ()


def hidden_functions(entry: Entry, turn: int) -> frozenset[str]:
    """Names not yet available at `turn` (miss_func reveals them at their turn)."""
    return frozenset(
        name for at, names in entry.missed_function.items() if at > turn for name in names
    )


def docs_at_start(entry: Entry) -> list[dict[str, Any]]:
    """Function docs shown in the first turn: all but the missed ones."""
    hidden = hidden_functions(entry, 0)
    return [d for d in entry.function_docs if d["name"] not in hidden]


def docs_added(entry: Entry, turn: int) -> list[dict[str, Any]]:
    """Function docs revealed at `turn` (empty outside miss_func's reveal turns)."""
    names = entry.missed_function.get(turn, ())
    return [d for d in entry.function_docs if d["name"] in names]


def _data_dir() -> Path:
    return Path(str(resources.files("bfcl_eval") / "data"))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    # The .json files are JSON Lines.
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache
def function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """bfcl-eval's function docs of a simulator class (e.g. "MathAPI")."""
    return tuple(_read_jsonl(_data_dir() / "multi_turn_func_doc" / FUNC_DOC_FILES[class_name]))


def normalize_category(category: str) -> str:
    """Accept "base" or "multi_turn_base"; return the full name."""
    full = category if category.startswith("multi_turn_") else f"multi_turn_{category}"
    if full not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
    return full


@functools.cache
def _load(category: str) -> tuple[Entry, ...]:
    questions = _read_jsonl(_data_dir() / f"BFCL_v4_{category}.json")
    answers = _read_jsonl(_data_dir() / "possible_answer" / f"BFCL_v4_{category}.json")
    entries = []
    for q, a in zip(questions, answers, strict=True):
        if q["id"] != a["id"]:
            raise ValueError(f"question/answer ids out of line: {q['id']} vs {a['id']}")
        classes = tuple(q["involved_classes"])
        entries.append(
            Entry(
                id=q["id"],
                category=category,
                index=int(q["id"].rsplit("_", 1)[1]),
                question=q["question"],
                initial_config=q.get("initial_config", {}),
                involved_classes=classes,
                missed_function={int(k): tuple(v) for k, v in q.get("missed_function", {}).items()},
                ground_truth=a["ground_truth"],
                function_docs=tuple(d for c in classes for d in function_docs(c)),
            )
        )
    return tuple(entries)


def load_entries(category: str) -> list[Entry]:
    """All entries of a category (200 each in v4), in file order, with ground truth."""
    return list(_load(normalize_category(category)))


def load_all(categories: tuple[str, ...] = CATEGORIES) -> list[Entry]:
    """Entries of several categories, concatenated."""
    return [e for c in categories for e in load_entries(c)]
