"""The demo on multi-turn tasks: 2-3 user turns, each later turn acting on the file the turn
before it produced or found ("Also keep a copy of that file called 'x.md'", "How many words are
in that file?"), so the conversation's state matters and the sampler's cache carries it across
turns. Everything else is `configs/tiny.py` (same model, stage 1, arms and RL recipe).

    python -m rcgrpo_jax.main --config=configs/tiny_multiturn.py
"""

from rcgrpo_jax.config import sibling_config


def get_config():
    c = sibling_config(__file__, "tiny")
    d = c.env.synthetic.difficulty
    d.turns = (2, 3)
    d.followup = 1.0  # every later turn is a follow-up on the previous turn's file
    # The one-turn demo's kinds but clone_text (its word copy does not form in the tiny model:
    # `configs/tiny.py`), each followed by `count_in_file` or `copy_as` turns
    # (`synthetic.FOLLOWUP_TEMPLATES`); a task's kind is its turns' templates joined by ">".
    d.templates = ("count_top", "copy_top", "rename_top", "rename_by_ext")
    return c
