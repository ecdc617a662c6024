"""Trajectory/example storage: a TFDS dataset in ArrayRecord files, written and read without
TensorFlow.

What works without TF in tensorflow-datasets 4.9.10 (checked):
- A `tfds.core.GeneratorBasedBuilder` subclass with `file_format="array_record"`:
  `download_and_prepare()` encodes features with numpy and writes ArrayRecord shards plus
  `dataset_info.json`/`features.json`; `as_data_source()` / `tfds.builder_from_directory(...)
  .as_data_source()` read and decode them with numpy. That is what this module uses.
- Not `tfds.dataset_builders.store_as_tfds_dataset`: its ad-hoc builder checks
  `isinstance(x, tf.data.Dataset)`, which imports TensorFlow.
- A builder class defined inside a package makes TFDS look up a download-checksums file via the
  `importlib_resources` package (not installed); `url_infos = None` on the builder skips that.

Record fields: tokens int32[T], loss_mask uint8[T] (1 = assistant token to train on), label int32
(the 0/1 reward the trajectory received), reward_token int32 (id injected for RCTP, -1 if none),
source str (e.g. "ground_truth", "rollout", "perturb:wrong_arg"), entry_id str (BFCL id), meta str
(free JSON for anything else).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from rcgrpo_jax import logs

DATASET_NAME = "rcgrpo_trajectories"
DEFAULT_VERSION = "1.0.0"
FIELDS = ("tokens", "loss_mask", "label", "reward_token", "source", "entry_id", "meta")


def features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict(
        {
            "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.uint8),
            "label": np.int32,
            "reward_token": np.int32,
            "source": tfds.features.Text(),
            "entry_id": tfds.features.Text(),
            "meta": tfds.features.Text(),
        }
    )


def to_record(ex: Mapping[str, Any]) -> dict[str, Any]:
    """Validates one example and fills defaults (reward_token -1, meta "{}")."""
    tokens = np.asarray(ex["tokens"], np.int32)
    mask = np.asarray(ex["loss_mask"], np.uint8)
    if tokens.ndim != 1 or tokens.shape != mask.shape:
        raise ValueError(f"tokens {tokens.shape} and loss_mask {mask.shape} must be equal 1-D")
    if np.asarray(ex["label"]).item() not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {ex['label']!r}")
    label = int(np.asarray(ex["label"]).item())
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "label": label,
        "reward_token": int(ex.get("reward_token", -1)),
        "source": str(ex.get("source", "")),
        "entry_id": str(ex.get("entry_id", "")),
        "meta": str(ex.get("meta", "{}")),
    }


class RcgrpoTrajectories(tfds.core.GeneratorBasedBuilder):
    """Builder fed from Python iterables given at construction (no download step)."""

    VERSION = tfds.core.Version(DEFAULT_VERSION)
    # Nothing is downloaded. Without this, TFDS looks for a checksums file next to this module
    # through `importlib_resources` (a package this project does not depend on).
    url_infos = None

    def __init__(self, *, splits: Mapping[str, Iterable[Mapping[str, Any]]] | None = None, **kw):
        self._splits = dict(splits or {})
        super().__init__(**kw)

    def _info(self) -> tfds.core.DatasetInfo:
        # disable_shuffling: record i of a split is the i-th example given (reproducible layout).
        return tfds.core.DatasetInfo(builder=self, features=features(), disable_shuffling=True)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {name: self._generate_examples(exs) for name, exs in self._splits.items()}

    def _generate_examples(self, examples):
        for i, ex in enumerate(examples):
            yield i, to_record(ex)

    # TFDS prints a "Downloading and preparing" banner around every build; nothing is downloaded.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


def write_dataset(
    data_dir: str | Path,
    splits: Mapping[str, Iterable[Mapping[str, Any]]],
    *,
    overwrite: bool = False,
) -> Path:
    """Writes every split; returns the dataset directory (pass it to `load_split`)."""
    data_dir = Path(data_dir).absolute()
    out = data_dir / DATASET_NAME / DEFAULT_VERSION
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
        shutil.rmtree(out)
    builder = RcgrpoTrajectories(splits=splits, data_dir=str(data_dir), file_format="array_record")
    if not logs.verbose():
        tfds.disable_progress_bar()  # its per-split bars would interleave with the stage's own
    builder.download_and_prepare()
    return out


class ExampleSource:
    """Random-access view of one split (grain data source protocol: len + getitem), decoding
    Text features to str. Picklable, so grain worker processes can use it."""

    def __init__(self, dataset_dir: str | Path, split: str = "train") -> None:
        self.dataset_dir = str(dataset_dir)
        self.split = split
        self._src = tfds.builder_from_directory(self.dataset_dir).as_data_source(split=split)

    def __len__(self) -> int:
        return len(self._src)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r = dict(self._src[i])
        for k in ("source", "entry_id", "meta"):
            v = r[k]
            r[k] = v.decode() if isinstance(v, bytes) else str(v)
        r["label"] = int(r["label"])
        r["reward_token"] = int(r["reward_token"])
        return r

    def __repr__(self) -> str:
        return f"ExampleSource({self.dataset_dir!r}, {self.split!r}, n={len(self)})"

    def __getstate__(self):
        return {"dataset_dir": self.dataset_dir, "split": self.split}

    def __setstate__(self, d):
        self.__init__(d["dataset_dir"], d["split"])


def load_split(dataset_dir: str | Path, split: str = "train") -> ExampleSource:
    return ExampleSource(dataset_dir, split)


def split_names(dataset_dir: str | Path) -> list[str]:
    return sorted(tfds.builder_from_directory(str(dataset_dir)).info.splits.keys())
