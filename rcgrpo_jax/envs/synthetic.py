"""Procedurally generated multi-turn file-system tasks: BFCL's machinery at toy scale.

BFCL's own prompts are ~4.5k tokens of tool docs, far too long for a model trained from
scratch on two CPU cores. These tasks run on the same `GorillaFileSystem` simulator and come
back as ordinary `Entry` objects (category "synthetic"), so `Episode`, the executor,
`trajectory_reward` (R_state x R_action) and the reference policies apply unchanged; only the
system prompt is compact (`Entry.compact_prompt`) and the docs list a handful of
functions in one line each.

Every task is partially observable: the instruction names a pattern, keyword or extension,
never the file the agent must act on, so the agent has to look (`find`, `ls`, `cat`) and
then act on what it saw. The ground truth is kept as assistant steps (look, then act;
`Entry.ground_truth_steps`) so golden trajectories show the observation before the action.
The checker's response check also requires the look-ups: their results must appear among
the agent's results.

Train and test tasks are disjoint by RNG stream and by every name: root, folders, files,
keywords and contents come from disjoint sets of two-syllable names (`NAMES`); with
`Difficulty.name_roles`, the content words (`ROLE_WORDS`) are shared by both splits. Generation is
deterministic given the arguments, and each task is kept only if the ground truth scores 1.0
and the empty policy 0.0 through `Episode`.

With `rl_split=True` there is a third split, "rl" (`RL_SPLIT`), so RL can train on tasks whose
names the stage-1 policy never saw and that are still disjoint from the held-out ones: a second
1-in-5 class of names (`NAMES3`, `ROLE_NAMES3`) is taken out of "train" and given to "rl".
"test" keeps its names and RNG stream, so the held-out tasks are the same either way; without
`rl_split` there are only "train" and "test".

One module, long because it is a catalogue: the task templates (main, follow-up and the tiny
base's pretraining chores) share the name-taking and file-system helpers above them, and a
template reads best next to its siblings.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rcgrpo_jax.envs import policies, prompts
from rcgrpo_jax.envs.calls import Call, format_call, parse_call, render_calls
from rcgrpo_jax.envs.entries import Entry, truth_steps
from rcgrpo_jax.envs.episode import Episode
from rcgrpo_jax.envs.executor import ERROR_PREFIX, execute, load_instances, method_table

CATEGORY = "synthetic"
CLASSES = ("GorillaFileSystem",)
SPLITS = ("train", "test")
CHAT_FORMAT = "python"
EXTENSIONS = ("txt", "md", "csv", "log")

# Names are two consonant-vowel syllables ("kamo"). Train and test use disjoint sets of names
# over the same syllables, so held-out names are split like training names (unseen whole words
# would fall apart into bytes and never be copied). The tiny tokenizer keeps every syllable as
# one piece, wherever it occurs, so a name is the same two tokens in an instruction, a tool
# result, a file's text or a call, and copying it is copying two ids. Only syllables that occur
# nowhere in the fixed text (prompt, docs, templates) are used, so that text is not cut up
# (`test_syllables_are_not_in_the_fixed_text`).
SYLLABLES = tuple(
    "ba bi bu da du fa fe fu ga ge go gu ka ko ku lu mi mu ni nu po ra ru tu va vi vo vu za ze "
    "zi zo zu".split()
)


RL_SPLIT = "rl"
SPLITS3 = (*SPLITS, RL_SPLIT)  # the splits with `rl_split=True`
# Name classes: (i + 3j) % 5 of the syllable indices. Class 0 is held out ("test") always;
# class 1 is "rl" with `rl_split=True`, else "train".
_SPLIT_CLASS = {0: "test", 1: RL_SPLIT}


def name_split(name: str, rl_split: bool = False) -> str:
    """Which split a two-syllable name belongs to (about 1 in 5 is held out; with `rl_split`,
    about another 1 in 5 is "rl" and the rest "train")."""
    i, j = SYLLABLES.index(name[:2]), SYLLABLES.index(name[2:])
    split = _SPLIT_CLASS.get((i + 3 * j) % 5, "train")
    return "train" if split == RL_SPLIT and not rl_split else split


def _split_names(names: Sequence[str], rl_split: bool) -> dict[str, tuple[str, ...]]:
    """`names` by split, in their order."""
    splits = SPLITS3 if rl_split else SPLITS
    return {s: tuple(n for n in names if name_split(n, rl_split) == s) for s in splits}


_ALL_NAMES = tuple(a + b for a in SYLLABLES for b in SYLLABLES)
NAMES = _split_names(_ALL_NAMES, rl_split=False)
NAMES3 = _split_names(_ALL_NAMES, rl_split=True)  # "train", "test" (== NAMES["test"]), "rl"

# With `Difficulty.name_roles`, folders, files and the new names a user asks for come from
# disjoint syllable sets (each role's first and second syllables five of their own). Then every
# name a task needs is the only one of its role in view, and the agent can find it by what it
# is, not by where it sits: a copy a tiny model learns steadily from its first steps, where a
# copy by position forms after a plateau whose length rides on the seed and the rounding
# (docs/experiments/tiny_default.md). Each role keeps the 1-in-5 held-out split of `NAMES`.
# With `rl_split` (`ROLE_NAMES3`), each role's 25 names split 15 train, 5 test, 5 rl.
ROLES = ("dir", "file", "new")
_ROLE_ALL = {
    role: tuple(
        a + b for a in SYLLABLES[10 * r : 10 * r + 5] for b in SYLLABLES[10 * r + 5 : 10 * r + 10]
    )
    for r, role in enumerate(ROLES)
}
ROLE_NAMES = {role: _split_names(names, rl_split=False) for role, names in _ROLE_ALL.items()}
ROLE_NAMES3 = {role: _split_names(names, rl_split=True) for role, names in _ROLE_ALL.items()}
ROLE_WORDS = tuple(a + b for a in SYLLABLES[30:] for b in SYLLABLES[30:])  # file contents


def _doc(name: str, description: str, required: Sequence[str] = (), **optional: Any) -> dict:
    """A BFCL-shaped function doc with a one-line description (string parameters)."""
    props = {p: {"type": "string", "description": ""} for p in required}
    props |= {p: {"type": "string", "description": "", "default": d} for p, d in optional.items()}
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "dict", "properties": props, "required": list(required)},
    }


# The functions the tasks use, with short descriptions: the compact prompt lists these only.
FUNCTION_DOCS: tuple[dict[str, Any], ...] = (
    _doc("ls", "list the current folder"),
    _doc("cd", "enter one subfolder; '..' up, '/' top", ["folder"]),
    _doc("find", "paths below here whose name contains name", ["name"]),
    _doc("cat", "show a file here", ["file_name"]),
    _doc("mkdir", "make a folder here", ["dir_name"]),
    _doc("mv", "move into a folder, or rename", ["source", "destination"]),
    _doc("cp", "copy into a folder, or to a new name", ["source", "destination"]),
    _doc("rm", "delete a file here", ["file_name"]),
    _doc("touch", "make an empty file here", ["file_name"]),
    _doc("echo", "write content to a file here", ["content", "file_name"]),
    _doc("wc", "count l(ines) or w(ords) of a file", ["file_name"], mode="l"),
)

Path = tuple[str, ...]  # folder names below the root


@dataclass(frozen=True)
class Difficulty:
    """Knobs for calibration (held-out success of the SFT'd tiny model).

    turns: (min, max) user turns; depth: folder levels below the root (>= 1);
    distractors: extra files per folder besides one (more to read, more to confuse);
    followup: chance that a later turn refers to the previous turn's file;
    templates: which main task kinds may occur (see `MAIN_TEMPLATES`);
    name_roles: folders, files and new names from disjoint syllables (`ROLE_NAMES`).
    """

    turns: tuple[int, int] = (1, 3)
    depth: int = 2
    distractors: int = 1
    followup: float = 0.6
    templates: tuple[str, ...] = ("copy_found", "move_by_content", "rename_by_ext", "clone_text")
    name_roles: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            raise ValueError(f"turns must satisfy 1 <= min <= max, got {self.turns}")
        if self.depth < 1 or self.distractors < 0 or not 0 <= self.followup <= 1:
            raise ValueError(f"invalid difficulty {self}")
        unknown = set(self.templates) - set(MAIN_TEMPLATES)
        if unknown or not self.templates:
            raise ValueError(f"unknown templates {sorted(unknown)}; have {sorted(MAIN_TEMPLATES)}")


# ---------------------------------------------------------------------------------------------
# Initial state


def _call(function: str, /, **kwargs: Any) -> str:
    return format_call(Call(function, (), kwargs))


def _content(rng: random.Random, words: Sequence[str]) -> str:
    return " ".join(rng.choices(words, k=rng.randint(2, 4)))


Take = Callable[..., str]  # take(role) -> a fresh name for "dir", "file" or "new" (`ROLES`)


def _taker(
    rng: random.Random, split: str, size: int, roles: bool, rl_split: bool = False
) -> tuple[Take, Sequence[str]]:
    """A task's supply of fresh names, and the words file contents are made of."""
    names, role_names = (NAMES3, ROLE_NAMES3) if rl_split else (NAMES, ROLE_NAMES)
    if not roles:
        if size > len(names[split]):
            raise ValueError(
                f"a {split} task needs {size} names, more than the {len(names[split])} of its "
                "split; lower env.synthetic.difficulty.depth, .distractors or .turns"
            )
        pool = rng.sample(names[split], size)
        return lambda role="new": pool.pop(), pool
    pools = {r: rng.sample(role_names[r][split], len(role_names[r][split])) for r in ROLES}

    def take(role: str = "new") -> str:
        if not pools[role]:
            n = len(role_names[role][split])
            raise ValueError(
                f"name_roles: a {split} task needs more than the {n} {role} names of its role; "
                "lower env.synthetic.difficulty.depth or .distractors"
            )
        return pools[role].pop()

    return take, ROLE_WORDS


def _folder(rng, take: Take, words, level: int, diff: Difficulty) -> dict[str, Any]:
    """Contents of one folder: 1 + distractors files, maybe a subfolder below `diff.depth`."""
    contents: dict[str, Any] = {}
    for _ in range(1 + diff.distractors):
        name = f"{take('file')}.{rng.choice(EXTENSIONS)}"
        contents[name] = {"type": "file", "content": _content(rng, words)}
    if level < diff.depth and (level == 1 or rng.random() < 0.5):
        contents[take("dir")] = {
            "type": "directory",
            "contents": _folder(rng, take, words, level + 1, diff),
        }
    return contents


def initial_config(
    rng: random.Random, take: Take, words: Sequence[str], diff: Difficulty
) -> dict[str, Any]:
    """GorillaFileSystem `initial_config`: two top folders (trees to `diff.depth`), a root file."""
    top: dict[str, Any] = {}
    for _ in range(2):
        top[take("dir")] = {"type": "directory", "contents": _folder(rng, take, words, 1, diff)}
    top[f"{take('file')}.{rng.choice(EXTENSIONS)}"] = {
        "type": "file",
        "content": _content(rng, words),
    }
    return {"GorillaFileSystem": {"root": {take("dir"): {"type": "directory", "contents": top}}}}


# ---------------------------------------------------------------------------------------------
# Reading the live simulator (the generator acts on it as the ground truth will)


def _is_dir(item: Any) -> bool:
    return hasattr(item, "contents")


def _node(fs: Any, path: Path) -> Any:
    node = fs.root
    for name in path:
        node = node.contents[name]
    return node


def _cwd(fs: Any) -> Path:
    names, node = [], fs._current_dir
    while node.parent is not None:
        names.append(node.name)
        node = node.parent
    return tuple(reversed(names))


def _folders(fs: Any, path: Path = ()) -> list[Path]:
    """Every folder below the root (not the root itself), depth first."""
    out = []
    for name, item in _node(fs, path).contents.items():
        if _is_dir(item):
            out.append((*path, name))
            out.extend(_folders(fs, (*path, name)))
    return out


def _files(fs: Any, path: Path) -> list[str]:
    return [n for n, item in _node(fs, path).contents.items() if not _is_dir(item)]


def _all_names(fs: Any, path: Path = ()) -> list[str]:
    out = []
    for name, item in _node(fs, path).contents.items():
        out.append(name)
        if _is_dir(item):
            out.extend(_all_names(fs, (*path, name)))
    return out


def _nav(cwd: Path, target: Path) -> list[str]:
    """cd calls from `cwd` to `target`: down if below, else via the top ('/')."""
    if target[: len(cwd)] == cwd:
        return [_call("cd", folder=f) for f in target[len(cwd) :]]
    return [_call("cd", folder="/")] + [_call("cd", folder=f) for f in target]


def _ext(name: str) -> str:
    return name.rsplit(".", 1)[-1]


# ---------------------------------------------------------------------------------------------
# Turn templates: each reads the live state and returns (instruction, steps) or None


@dataclass
class _Ctx:
    rng: random.Random
    take: Take
    fs: Any
    focus: tuple[Path, str] | None = None  # the file the last turn was about
    last: str = ""  # the last turn's template


Turn = tuple[str, list[list[str]]]


def _where(path: Path) -> str:
    return "/".join(path)


def copy_found(ctx: _Ctx) -> Turn | None:
    """Find a file by part of its name anywhere; copy it into a new folder beside it."""
    names = _all_names(ctx.fs)
    cands = [
        (path, f)
        for path in _folders(ctx.fs)
        for f in _files(ctx.fs, path)
        if sum(f.split(".")[0] in n for n in names) == 1
    ]
    if not cands:
        return None
    path, target = ctx.rng.choice(cands)
    stem, new = target.split(".")[0], ctx.take()
    text = ctx.rng.choice(
        (
            f"Somewhere in my files is a file with '{stem}' in its name. "
            f"Copy it into a new folder '{new}' in the same place.",
            f"Find the file whose name contains '{stem}' and put a copy of it "
            f"in a new folder '{new}' next to it.",
        )
    )
    look = ([_call("cd", folder="/")] if _cwd(ctx.fs) else []) + [_call("find", name=stem)]
    act = [_call("cd", folder=f) for f in path] + [
        _call("mkdir", dir_name=new),
        _call("cp", source=target, destination=new),
    ]
    ctx.focus = (path, target)
    return text, [look, act]


def move_by_content(ctx: _Ctx) -> Turn | None:
    """Read the files of a named folder; move the one mentioning a keyword into a new folder."""
    cands = []
    for path in _folders(ctx.fs):
        files = _files(ctx.fs, path)
        if len(files) < 2:
            continue
        contents = {f: _node(ctx.fs, path).contents[f].content for f in files}
        for f in files:
            for word in set(contents[f].split()):
                if sum(word in c for c in contents.values()) == 1:
                    cands.append((path, files, f, word))
    if not cands:
        return None
    path, files, target, word = ctx.rng.choice(sorted(cands))
    new = ctx.take()
    where = _where(path)
    text = ctx.rng.choice(
        (
            f"One file in {where} mentions '{word}'. Move it into a new folder '{new}' there.",
            f"In {where}, put the file that talks about '{word}' into a new folder '{new}'.",
        )
    )
    look = _nav(_cwd(ctx.fs), path) + [_call("ls")]
    read = [_call("cat", file_name=f) for f in files]
    act = [_call("mkdir", dir_name=new), _call("mv", source=target, destination=new)]
    ctx.focus = ((*path, new), target)
    return text, [look, read, act]


def _unique_ext_files(ctx: _Ctx) -> list[tuple[Path, str]]:
    out = []
    for path in _folders(ctx.fs):
        files = _files(ctx.fs, path)
        exts = [_ext(f) for f in files]
        out += [(path, f) for f in files if exts.count(_ext(f)) == 1]
    return out


def rename_by_ext(ctx: _Ctx) -> Turn | None:
    """Rename the only file of an extension in a named folder (its name must be looked up)."""
    cands = _unique_ext_files(ctx)
    if not cands:
        return None
    path, target = ctx.rng.choice(cands)
    ext = _ext(target)
    new = f"{ctx.take()}.{ext}"
    text = ctx.rng.choice(
        (
            f"Rename the .{ext} file in {_where(path)} to '{new}'.",
            f"There is one .{ext} file in {_where(path)}. Call it '{new}' instead.",
        )
    )
    look = _nav(_cwd(ctx.fs), path) + [_call("ls")]
    act = [_call("mv", source=target, destination=new)]
    ctx.focus = (path, new)
    return text, [look, act]


def clone_text(ctx: _Ctx) -> Turn | None:
    """Write the text of the only file of an extension into a new file (read, then write)."""
    cands = _unique_ext_files(ctx)
    if not cands:
        return None
    path, source = ctx.rng.choice(cands)
    new = f"{ctx.take()}.txt"
    content = _node(ctx.fs, path).contents[source].content
    where, ext = _where(path), _ext(source)
    text = ctx.rng.choice(
        (
            f"In {where}, make a file '{new}' with the same text as the .{ext} file.",
            f"Copy the words of the .{ext} file in {where} into a new file '{new}'.",
        )
    )
    look = _nav(_cwd(ctx.fs), path) + [_call("ls")]
    read = [_call("cat", file_name=source)]
    act = [_call("touch", file_name=new), _call("echo", content=content, file_name=new)]
    ctx.focus = (path, new)
    return text, [look, read, act]


def delete_original(ctx: _Ctx) -> Turn | None:
    """After `copy_found`: remove the original (the agent must remember which it was)."""
    if ctx.last != "copy_found" or ctx.focus is None:
        return None
    path, name = ctx.focus
    ctx.focus = None
    text = ctx.rng.choice(("Now delete the original file.", "Remove the original one now."))
    return text, [_nav(_cwd(ctx.fs), path) + [_call("rm", file_name=name)]]


def count_in_file(ctx: _Ctx) -> Turn | None:
    """Count words or lines of the file the last turn was about."""
    if ctx.focus is None:
        return None
    path, name = ctx.focus
    unit, mode = ctx.rng.choice((("words", "w"), ("lines", "l")))
    text = f"How many {unit} are in that file?"
    return text, [_nav(_cwd(ctx.fs), path) + [_call("wc", file_name=name, mode=mode)]]


def copy_as(ctx: _Ctx) -> Turn | None:
    """Copy the file the last turn was about to a new name in its folder."""
    if ctx.focus is None:
        return None
    path, name = ctx.focus
    new = f"{ctx.take()}.{_ext(name)}"
    text = f"Also keep a copy of that file called '{new}' in the same folder."
    return text, [_nav(_cwd(ctx.fs), path) + [_call("cp", source=name, destination=new)]]


def _look_top(ctx: _Ctx) -> list[str]:
    """`ls` at the top (going there first if elsewhere)."""
    return ([_call("cd", folder="/")] if _cwd(ctx.fs) else []) + [_call("ls")]


def _top_file(ctx: _Ctx) -> tuple[Path, list[str], str] | None:
    """The top folder's only file and the look-up that lists it last (a fixed copy distance).

    `ls` at the top lists the folders first and the file last, so the file's name is always
    followed by the same tokens (its extension, the list's end, end-of-message, the assistant
    header, the call's opening): the tiny model can learn to copy it at a fixed offset."""
    files = _files(ctx.fs, ())
    if len(files) != 1 or list(_node(ctx.fs, ()).contents)[-1] != files[0]:
        return None
    return (), _look_top(ctx), files[0]


def _top_folders(ctx: _Ctx) -> list[str]:
    """The top folder's subfolders, in `ls` order."""
    return [n for n, item in _node(ctx.fs, ()).contents.items() if _is_dir(item)]


def _top_to_new_name(ctx: _Ctx, function: str, texts: tuple[str, str]) -> Turn | None:
    """`function(source=<top file>, destination=<new name>)`; `texts` take the new name."""
    found = _top_file(ctx)
    if found is None:
        return None
    path, look, target = found
    new = f"{ctx.take()}.{_ext(target)}"
    text = ctx.rng.choice(tuple(t.format(new=new) for t in texts))
    ctx.focus = (path, new if function == "mv" else target)
    return text, [look, [_call(function, source=target, destination=new)]]


def rename_top(ctx: _Ctx) -> Turn | None:
    """Rename the file at the top (listed last by `ls`) to a new name given at the end."""
    texts = ("Rename the file at the top to '{new}'.", "Give the top file the new name '{new}'.")
    return _top_to_new_name(ctx, "mv", texts)


def copy_top(ctx: _Ctx) -> Turn | None:
    """Copy the file at the top (listed last by `ls`) to a new name given at the end."""
    texts = ("Copy the file at the top to '{new}'.", "Make a copy of the top file named '{new}'.")
    return _top_to_new_name(ctx, "cp", texts)


# The user's two phrasings of moving (mv) or copying (cp) the top file into a listed folder.
_INTO_FOLDER_TEXTS = {
    "cp": (
        "Copy the top file into the {nth} folder.",
        "Put a copy of the top file in the {nth} folder.",
    ),
    "mv": (
        "Move the top file into the {nth} folder.",
        "Put the file at the top in the {nth} folder.",
    ),
}
_ORDINALS = ("first", "second")


def _top_into_folder(ctx: _Ctx, function: str, index: int) -> Turn | None:
    """`function(source=<top file>, destination=<the top's index-th folder>)` after one `ls`:
    both names at fixed distances in its output."""
    found, folders = _top_file(ctx), _top_folders(ctx)
    if found is None or len(folders) <= index:
        return None
    _, look, target = found
    ctx.focus = ((folders[index],), target)
    act = [_call(function, source=target, destination=folders[index])]
    texts = tuple(t.format(nth=_ORDINALS[index]) for t in _INTO_FOLDER_TEXTS[function])
    return ctx.rng.choice(texts), [look, act]


# Top file into a listed folder: template -> (function, folder index). `stash_top` is a
# pretraining chore (below): mv into the first folder, never the demo's second one.
_INTO_FOLDER: dict[str, tuple[str, int]] = {
    "copy_into_first": ("cp", 0),
    "copy_into_second": ("cp", 1),
    "move_into_second": ("mv", 1),
    "stash_top": ("mv", 0),
}


def _into_folder(name: str) -> Callable[[_Ctx], Turn | None]:
    """The `_INTO_FOLDER` template `name`."""
    function, index = _INTO_FOLDER[name]
    return lambda ctx: _top_into_folder(ctx, function, index)


def count_top(ctx: _Ctx) -> Turn | None:
    """Count the words or lines of the file at the top (listed last by `ls`)."""
    found = _top_file(ctx)
    if found is None:
        return None
    path, look, target = found
    unit, mode = ctx.rng.choice((("words", "w"), ("lines", "l")))
    text = f"How many {unit} are in the file at the top?"
    ctx.focus = (path, target)
    return text, [look, [_call("wc", file_name=target, mode=mode)]]


# The tiny instruct base's pretraining tasks (`tools/pretrain_tiny`): everyday file-system
# chores that teach the pieces the demo's tasks (`copy_into_first`, `copy_into_second`,
# `move_into_second`) are made of: listing the top folder, copying its last entry and naming its
# first or second folder, the mv/cp call syntax, the words of the demo's instructions. They never
# make the demo's combinations (cp into a listed folder, mv into the second one), so the base
# starts the demo low and stage 1 has only to combine what it knows.


def _top_one(ctx: _Ctx, function: str, texts: tuple[str, str]) -> Turn | None:
    """`function(file_name=<top file>)` after listing the top folder."""
    found = _top_file(ctx)
    if found is None:
        return None
    _, look, target = found
    ctx.focus = None
    return ctx.rng.choice(texts), [look, [_call(function, file_name=target)]]


def delete_top(ctx: _Ctx) -> Turn | None:
    """Delete the file at the top (listed last by `ls`)."""
    return _top_one(ctx, "rm", ("Delete the file at the top.", "Remove the top file."))


def show_top(ctx: _Ctx) -> Turn | None:
    """Show the file at the top (listed last by `ls`)."""
    return _top_one(ctx, "cat", ("Show me the file at the top.", "What does the top file say?"))


def backup_top(ctx: _Ctx) -> Turn | None:
    """Copy the top file into a new folder the user names."""
    found = _top_file(ctx)
    if found is None:
        return None
    _, look, target = found
    new = ctx.take()
    texts = (
        f"Copy the top file into a new folder '{new}'.",
        f"Back up the file at the top in a new folder called '{new}'.",
    )
    act = [_call("mkdir", dir_name=new), _call("cp", source=target, destination=new)]
    ctx.focus = ((new,), target)
    return ctx.rng.choice(texts), [look, act]


def folder_in_second(ctx: _Ctx) -> Turn | None:
    """Make a new folder, named by the user, inside the top's second folder."""
    folders = _top_folders(ctx)
    if len(folders) < 2:
        return None
    new = ctx.take()
    texts = (
        f"Make a new folder '{new}' inside the second folder at the top.",
        f"In the second top folder, add a folder called '{new}'.",
    )
    ctx.focus = None
    act = [_call("cd", folder=folders[1]), _call("mkdir", dir_name=new)]
    return ctx.rng.choice(texts), [_look_top(ctx), act]


def touch_top(ctx: _Ctx) -> Turn | None:
    """Make an empty file, named by the user, at the top."""
    new = f"{ctx.take()}.{ctx.rng.choice(EXTENSIONS)}"
    texts = (f"Make an empty file '{new}' at the top.", f"At the top, create a file '{new}'.")
    ctx.focus = ((), new)
    return ctx.rng.choice(texts), [_look_top(ctx), [_call("touch", file_name=new)]]


# The task family the chores are designed for, on which `tools/pretrain_tiny` measures a base;
# not the default demo's (`configs/tiny.py`; docs/experiments/tiny_default.md, "A shipped base
# instead of a from-scratch model").
BASE_DEMO_TEMPLATES = ("copy_into_first", "copy_into_second", "move_into_second")
PRETRAIN_TEMPLATES = (
    "delete_top", "show_top", "stash_top", "backup_top", "folder_in_second", "touch_top",
)  # fmt: skip

MAIN_TEMPLATES: dict[str, Callable[[_Ctx], Turn | None]] = {
    "copy_found": copy_found,
    "move_by_content": move_by_content,
    "rename_by_ext": rename_by_ext,
    "clone_text": clone_text,
    "rename_top": rename_top,
    "copy_top": copy_top,
    "count_top": count_top,
    "copy_into_first": _into_folder("copy_into_first"),
    "copy_into_second": _into_folder("copy_into_second"),
    "move_into_second": _into_folder("move_into_second"),
    "delete_top": delete_top,
    "show_top": show_top,
    "stash_top": _into_folder("stash_top"),
    "backup_top": backup_top,
    "folder_in_second": folder_in_second,
    "touch_top": touch_top,
}
FOLLOWUP_TEMPLATES: dict[str, Callable[[_Ctx], Turn | None]] = {
    "delete_original": delete_original,
    "count_in_file": count_in_file,
    "copy_as": copy_as,
}


# ---------------------------------------------------------------------------------------------
# Tasks


def _run(ctx: _Ctx, steps: list[list[str]]) -> bool:
    """Apply the calls to the live simulator; False if any of them fails."""
    table = method_table({"GorillaFileSystem": ctx.fs})
    results = [execute(c, table) for step in steps for c in step]
    return not any(r.startswith(ERROR_PREFIX) or '"error"' in r for r in results)


def _next_turn(ctx: _Ctx, kinds: Sequence[str]) -> tuple[str, Turn] | None:
    order = list(kinds)
    ctx.rng.shuffle(order)
    for kind in order:
        template = MAIN_TEMPLATES.get(kind) or FOLLOWUP_TEMPLATES[kind]
        turn = template(ctx)
        if turn is not None:
            return kind, turn
    return None


def generate(
    rng: random.Random, split: str, diff: Difficulty, *, rl_split: bool = False
) -> tuple[dict, list[Turn], str] | None:
    """One task's initial config, turns and kind (its turns' templates joined by ">") from
    `rng`, or None if a template had no target. `rl_split`: names of the three-way split
    (`NAMES3`)."""
    # Enough names for every folder (up to 2 * depth), its files and subfolder, the root,
    # its file and the names the turns create; contents reuse names not taken yet.
    size = 2 * diff.depth * (diff.distractors + 2) + 8 + 2 * diff.turns[1]
    take, words = _taker(rng, split, size, diff.name_roles, rl_split)
    config = initial_config(rng, take, words, diff)
    (instances,) = load_instances(config, CLASSES, long_context=False)
    ctx = _Ctx(rng, take, instances["GorillaFileSystem"])
    turns: list[Turn] = []
    kinds: list[str] = []
    for t in range(rng.randint(*diff.turns)):
        use_followup = t > 0 and rng.random() < diff.followup
        picked = _next_turn(ctx, list(FOLLOWUP_TEMPLATES)) if use_followup else None
        picked = picked or _next_turn(ctx, diff.templates)
        if picked is None or not _run(ctx, picked[1][1]):
            return None
        ctx.last = picked[0]
        turns.append(picked[1])
        kinds.append(picked[0])
    return config, turns, ">".join(kinds)


def to_entry(
    task_id: str, index: int, config: dict, turns: Sequence[Turn], kind: str = ""
) -> Entry:
    """An `Entry` like BFCL's, with the ground truth also kept as steps."""
    return Entry(
        id=task_id,
        category=CATEGORY,
        index=index,
        question=[[{"role": "user", "content": text}] for text, _ in turns],
        initial_config=config,
        involved_classes=CLASSES,
        missed_function={},
        ground_truth=[[c for step in steps for c in step] for _, steps in turns],
        function_docs=FUNCTION_DOCS,
        ground_truth_steps=tuple(tuple(tuple(s) for s in steps) for _, steps in turns),
        compact_prompt=True,
        kind=kind,
    )


def play(entry: Entry, policy: policies.Policy, reward_token: int | None = None) -> Episode:
    """A finished episode of `entry` under `policy` (python call format)."""
    episode = Episode(entry, CHAT_FORMAT, reward_token=reward_token)
    policies.run_episodes([episode], policy)
    return episode


def act_without_looking(episodes: Sequence[Episode]) -> list[str]:
    """Reference policy that skips the look-ups: the last ground-truth step of each turn
    (right names included) on its first step. Fails every task, as a guesser would."""
    out = []
    for e in episodes:
        steps = truth_steps(e.entry, e.turn)
        if e.steps_in_turn > 0 or not steps:
            out.append(prompts.NO_CALL_TEXT)
        else:
            out.append(render_calls([parse_call(c) for c in steps[-1]], CHAT_FORMAT))
    return out


def verified(entry: Entry) -> bool:
    """The ground truth scores 1.0 and the empty policy 0.0 through `Episode`."""
    truth = play(entry, policies.ground_truth).result().reward
    return truth == 1.0 and play(entry, policies.empty).result().reward == 0.0


def make_tasks(
    split: str,
    n: int,
    seed: int = 0,
    *,
    rl_split: bool = False,
    max_tries: int = 50,
    **difficulty: Any,
) -> list[Entry]:
    """`n` verified tasks of `split` ("train" or "test"; "rl" with `rl_split`), deterministic
    given the arguments.

    `rl_split`: the three-way split of names (`NAMES3`): "train" then draws only from names of
    neither "test" nor "rl"; "test" tasks are the same as without it.
    `difficulty`: fields of `Difficulty` (turns, depth, distractors, followup, templates).
    Task i draws from its own RNG stream (split, seed, i, try), so a task does not depend on
    `n` and the splits never share a stream.
    """
    splits = SPLITS3 if rl_split else SPLITS
    if split == RL_SPLIT and not rl_split:
        raise ValueError(f"split {split!r} needs rl_split=True (env.synthetic.num_rl > 0)")
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {splits}")
    diff = Difficulty(**difficulty)
    tasks = []
    for i in range(n):
        for attempt in range(max_tries):
            rng = random.Random(f"{split}/{seed}/{i}/{attempt}")
            made = generate(rng, split, diff, rl_split=rl_split)
            if made is None:
                continue
            entry = to_entry(f"{CATEGORY}_{split}_{seed}_{i}", i, *made)
            if verified(entry):
                tasks.append(entry)
                break
        else:
            raise RuntimeError(f"no valid task {split}/{seed}/{i} in {max_tries} tries: {diff}")
    return tasks
