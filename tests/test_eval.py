"""The eval stage: reference policies, outputs, and the model-policy plug."""

from __future__ import annotations

import json

import ml_collections
import pytest

from rcgrpo_jax import config as config_lib
from rcgrpo_jax import envs
from rcgrpo_jax.envs import bfcl, prompts
from rcgrpo_jax.envs.reward import EMPTY_TURN, ENV_ERROR, ERROR_TYPES
from rcgrpo_jax.errors import UserError
from rcgrpo_jax.stages import eval as eval_stage


def make_config(workdir, **eval_overrides) -> ml_collections.ConfigDict:
    """The base config evaluating the ground truth on BFCL's test split, with `eval.*`
    overrides (and `chat_format`, `categories` for model.chat_format, eval.bfcl.categories)."""
    c = config_lib.base_config()
    c.workdir = str(workdir)
    c.model.chat_format = eval_overrides.pop("chat_format", "qwen")
    c.eval.policy = "ground_truth"
    c.eval.bfcl.categories = eval_overrides.pop("categories", bfcl.CATEGORIES)
    c.eval.update(eval_overrides)
    return c


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ground_truth_policy_is_100_percent_on_all_800(tmp_path, capsys):
    """Every BFCL entry's ground truth, played through the environment and scored by our
    reward: each of the 800 succeeds on state and action alike."""
    from rcgrpo_jax import compilation

    before = compilation.stats()
    summary = eval_stage.run(make_config(tmp_path, split="all"))
    print(f"\nground-truth evaluation of 800 entries (qwen format): {summary['wall_time_s']:.2f} s")
    assert summary["num_entries"] == 800 and summary["num_correct"] == 800
    for category in bfcl.CATEGORIES:
        assert summary["categories"][category]["n"] == 200
        assert f"{summary['accuracy'][category]:.2f}" == "100.00"
    assert summary["accuracy"]["overall"] == 100.0
    # replaying the ground truth runs no model: not one program is compiled
    assert (compilation.stats() - before).programs == 0

    out = tmp_path / "eval" / "all-ground_truth"
    rows = read_jsonl(out / "entries.jsonl")
    assert len(rows) == 800 and {r["id"] for r in rows} == {e.id for e in bfcl.load_all()}
    assert all(r["reward"] == 1.0 and r["state_ok"] and r["action_ok"] for r in rows)
    assert all(r["error_type"] is None and r["error_turn"] is None for r in rows)
    assert {"id", "category", "reward", "state_ok", "action_ok", "error_type"} <= set(rows[0])
    saved = json.loads((out / "summary.json").read_text())
    assert saved["accuracy"] == summary["accuracy"]
    table = (out / "table.txt").read_text()
    assert table.strip() in capsys.readouterr().out
    assert len(table.splitlines()) <= 12 and max(map(len, table.splitlines())) <= 100


@pytest.mark.parametrize("fmt", ["python", "llama"])
def test_ground_truth_policy_in_other_formats(tmp_path, fmt):
    summary = eval_stage.run(make_config(tmp_path, chat_format=fmt))
    assert summary["num_entries"] == 80
    assert all(summary["accuracy"][c] == 100.0 for c in bfcl.CATEGORIES)


def test_empty_policy_scores_zero_with_empty_turn_errors(tmp_path):
    config = make_config(tmp_path, policy="empty", max_entries=3, categories=("base", "miss_func"))
    summary = eval_stage.run(config)
    assert summary["num_entries"] == 6 and summary["num_correct"] == 0
    assert set(summary["categories"]) == {"multi_turn_base", "multi_turn_miss_func"}
    rows = read_jsonl(tmp_path / "eval" / "test-empty" / "entries.jsonl")
    assert [r["error_type"] for r in rows] == [EMPTY_TURN] * 6
    assert all(r["steps"] == 0 and not r["action_ok"] for r in rows)
    for c in summary["categories"].values():  # BFCL's four, in its order, zeros included
        assert c["errors"] == dict.fromkeys(ERROR_TYPES, 0) | {EMPTY_TURN: 3}
    head, columns = (tmp_path / "eval" / "test-empty" / "table.txt").read_text().splitlines()[:2]
    assert head.startswith("BFCL v4 multi-turn | split=test policy=empty format=qwen | 6 entries")
    assert columns.split()[-4:] == ["err:empty", "err:state", "err:resp", "err:force"]


def test_error_types_not_declared_are_counted_after_the_declared_ones():
    def record(category: str, error_type: str | None) -> dict:
        reward = 0.0 if error_type else 1.0
        return {"category": category, "reward": reward, "state_ok": False, "action_ok": False,
                "error_type": error_type}  # fmt: skip

    records = [record("a", "tool:timeout"), record("b", ENV_ERROR), record("a", None),
               record("b", "tool:timeout"), record("a", EMPTY_TURN)]  # fmt: skip
    summary = eval_stage.summarize(records, ["a", "b"], ERROR_TYPES)
    assert list(summary["categories"]["a"]["errors"]) == [*ERROR_TYPES, "tool:timeout", ENV_ERROR]
    assert summary["categories"]["a"]["errors"]["tool:timeout"] == 1
    assert summary["categories"]["b"]["errors"] == dict.fromkeys(ERROR_TYPES, 0) | {
        "tool:timeout": 1, ENV_ERROR: 1,
    }  # fmt: skip
    undeclared = eval_stage.summarize(records, ["a", "b"])["categories"]["a"]["errors"]
    assert list(undeclared.items()) == [("tool:timeout", 1), (ENV_ERROR, 0), (EMPTY_TURN, 1)]
    summary.update(split="test", policy="empty", chat_format="python", wall_time_s=1.0)
    head, columns, *_ = eval_stage.format_table(summary, "my tools").splitlines()
    assert head.startswith("my tools | split=test policy=empty format=python | 5 entries")
    assert columns.split()[-6:] == [
        "err:empty", "err:state", "err:resp", "err:force", "timeout", "env_error",
    ]  # fmt: skip


def test_config_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="generate_fn"):  # the re-prompting plug needs both
        eval_stage.make_policy("model", None, None)
    with pytest.raises(UserError, match="policy"):
        eval_stage.run(make_config(tmp_path, policy="oracle"))
    with pytest.raises(UserError, match="split"):
        eval_stage.run(make_config(tmp_path, split="dev"))
    with pytest.raises(UserError, match="categories"):
        eval_stage.run(make_config(tmp_path, categories=("multi_turn_web",)))


def test_model_policy_plug_with_a_fake_sampler(tmp_path, tokenizer_root):
    """A generate_fn that answers with the ground truth's tokens scores 100%: the prompts it
    receives, the decoding and the stop-token handling are those of a real model run."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_root / "qwen2.5"))
    eot = prompts.end_of_turn_token(tok)
    config = make_config(tmp_path, policy="model", max_entries=2, batch_size=3)
    entries = eval_stage.select_entries(envs.get("bfcl")(), "test", 2)
    mirror = [bfcl.Episode(e, "qwen") for e in entries]  # replays the same trajectories
    pending: list[bfcl.Episode] = []  # the current round's episodes not yet answered

    def generate_fn(batch: list[list[int]]) -> list[list[int]]:
        assert 0 < len(batch) <= 3 and all(isinstance(i, int) for p in batch for i in p)
        if not pending:
            pending.extend(e for e in mirror if not e.done)
        group = [pending.pop(0) for _ in batch]
        out = []
        for episode, prompt in zip(group, batch, strict=True):
            assert prompt == prompts.prompt_ids(tok, episode.messages, episode.tools)
            text = bfcl.ground_truth([episode])[0]
            episode.step(text)
            out.append(tok.encode(text + eot + "trailing junk", add_special_tokens=False))
        return out

    summary = eval_stage.run(config, generate_fn=generate_fn, tokenizer=tok)
    assert summary["num_entries"] == 8 and summary["accuracy"]["overall"] == 100.0
    assert all(e.done for e in mirror)


def test_synthetic_benchmark_evaluates_its_own_tasks(tmp_path):
    """`--config.stage=eval` on a synthetic config scores the synthetic held-out tasks (the
    demo's), not BFCL's."""
    config = make_config(tmp_path, max_entries=6, chat_format="python")
    config.env.benchmark = "synthetic"
    config.env.synthetic = {
        "num_train": 4,
        "num_test": 8,
        "seed": 0,
        "difficulty": {"turns": (1, 1)},
    }
    summary = eval_stage.run(config)
    assert summary["num_entries"] == 6 and summary["accuracy"]["overall"] == 100.0
    assert set(summary["categories"]) == {"synthetic"}
    rows = read_jsonl(tmp_path / "eval" / "test-ground_truth" / "entries.jsonl")
    assert [r["id"] for r in rows] == [f"synthetic_test_0_{i}" for i in range(6)]
    config.eval.policy, config.eval.split = "empty", "all"
    assert eval_stage.run(config)["num_entries"] == 6  # the first 6 of train + test
    config.eval.split = "valid"
    with pytest.raises(UserError, match="eval.split"):
        eval_stage.run(config)


def test_a_repeated_measurement_is_not_run_again(tmp_path, monkeypatch):
    """`measure_success` keeps what it measured: the same parameters, tokenizer, entries and
    settings give the kept value without a rollout; a changed weight, token, sample count,
    entry, setting or chat template measures again; a multi-process run and parameters above
    the memo's size always do."""
    import types

    import numpy as np

    runs = []

    def rollouts(config, env, entries, model, tokenizer, mesh, token, samples=0):
        runs.append((token, samples))
        per_entry = np.array([1.0, 0.0, 0.5])[: len(entries), None]
        rewards = np.repeat(per_entry, max(samples, 1), axis=1)
        # each row's verdict and (empty) conversation, which the per-task records read
        results = [[types.SimpleNamespace(reward=x, error_type=None) for x in r] for r in rewards]
        conversations = lambda rows: {r: [] for r in rows}
        ro = types.SimpleNamespace(rewards=rewards, results=results, conversations=conversations)
        return [(entries, ro)]

    monkeypatch.setattr(eval_stage, "_model_rollouts", rollouts)
    monkeypatch.setattr(eval_stage.setup, "environment", lambda config: None)
    monkeypatch.setattr(eval_stage, "_MEASURED", {})

    class Tokenizer:
        chat_template, eos_token_id, unk_token_id = "{{ x }}", 1, None

        def get_vocab(self):
            return {"a": 0, "<|im_end|>": 1}

        def convert_tokens_to_ids(self, token):
            return self.get_vocab().get(token)

        def __len__(self):
            return 2

    tok = Tokenizer()
    entries = [types.SimpleNamespace(id=f"e{i}", category="c", kind="aba"[i]) for i in range(3)]
    config = make_config(tmp_path)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}

    def rate(params=params, token=1, samples=0, entries=entries, config=config):
        return eval_stage.measure_success(
            config, ("cfg", params), tok, None, entries, token, samples
        ).rate

    assert rate() == rate() == 0.5 and len(runs) == 1
    # per task kind (the kept measurement holds both): kind a = entries 0 and 2, kind b = 1
    got = eval_stage.measure_success(config, ("cfg", params), tok, None, entries, 1)
    assert got.by_kind == {"a": 0.75, "b": 0.0} and len(runs) == 1
    changed = {"w": params["w"].copy()}
    changed["w"][1, 2] = np.nextafter(changed["w"][1, 2], np.float32(9))
    other = make_config(tmp_path, max_new_tokens=7)
    for kwargs in (
        {"params": changed}, {"token": None}, {"samples": 4}, {"entries": entries[:2]},
        {"config": other},
    ):  # fmt: skip
        before = len(runs)
        rate(**kwargs)
        rate(**kwargs)
        assert len(runs) == before + 1, kwargs
    before = len(runs)
    tok.chat_template = "{{ y }}"  # replaced on the same object
    rate()
    assert len(runs) == before + 1
    monkeypatch.setattr("jax.process_count", lambda: 2)
    rate()
    assert len(runs) == before + 2  # multi-process: every process measures
    monkeypatch.setattr("jax.process_count", lambda: 1)
    monkeypatch.setattr(eval_stage, "_MEMO_MAX_BYTES", 8)
    rate()
    assert len(runs) == before + 3  # too large to hash


def test_success_per_task_kind_in_the_summary_and_table():
    """Kinds finer than the categories get n and accuracy each and a line of the table; a
    record without a kind counts under its category."""
    ok = {"state_ok": True, "action_ok": True, "error_type": None}
    rec = lambda kind, reward: {"category": "synthetic", "kind": kind, "reward": reward, **ok}
    records = [rec("copy_top", 1.0), rec("copy_top", 0.0), rec("rename_top>copy_as", 1.0),
               rec("", 0.0)]  # fmt: skip
    summary = eval_stage.summarize(records, ["synthetic"])
    assert summary["kinds"] == {
        "copy_top": {"n": 2, "accuracy": 50.0},
        "rename_top>copy_as": {"n": 1, "accuracy": 100.0},
        "synthetic": {"n": 1, "accuracy": 0.0},
    }
    summary.update(split="test", policy="model", chat_format="python", wall_time_s=1.0)
    lines = eval_stage.format_table(summary, "t").splitlines()
    assert lines[-4].split() == ["task", "kind", "n", "acc%"]
    assert lines[-3].split() == ["copy_top", "2", "50.00"]
