"""Datasets: `create_dataset(cfg.dataset, "train")` returns a batched `mindspore.dataset` pipeline.

Each builder, registered with `@DATASETS.register(name, task=...)` (zoo/registry.py), takes (dataset config,
split, shard, ...) and reads either the embedded data that ships in a package (`path` unset) or the standard
on-disk format at `path`.
"""
from typing import Optional, Tuple

from data import images, mnist, translation  # noqa: F401  (the datasets register themselves)
from zoo.registry import DATASETS


def create_dataset(cfg, split: str, shard: Optional[Tuple[int, int]] = None, start_epoch: int = 0, seed: int = 0,
                   skip_batches: int = 0):
    """split: "train" (shuffled per epoch, fixed batch shape) or "test"; shard: (num_shards, shard_id) or None;
    start_epoch: the training epoch the first pass is, and skip_batches the batches of it already done (resume)."""
    return DATASETS.get(cfg.name, "dataset.name")(cfg, split, shard, start_epoch, seed, skip_batches)


def task(cfg) -> str:
    """What the recipe's data is for: "classification" or "translation" (how it is evaluated)."""
    return DATASETS.meta(cfg.dataset.name).get("task", "classification")

