"""Datasets: `create_dataset(cfg.dataset, "train")` returns a batched `mindspore.dataset` pipeline.

Each builder, registered with `@DATASETS.register(name, task=...)` (ampzoo/registry.py), takes (dataset config,
split, shard, ...) and reads either the embedded data that ships in a package (`path` unset) or the standard
on-disk format at `path`.
"""
from typing import Optional, Tuple

from ampzoo.data import images, mnist, translation  # noqa: F401  (the datasets register themselves)
from ampzoo.errors import ConfigError
from ampzoo.registry import DATASETS


def create_dataset(cfg, split: str, shard: Optional[Tuple[int, int]] = None, start_epoch: int = 0, seed: int = 0,
                   skip_batches: int = 0):
    """split: "train" (shuffled per epoch, fixed batch shape) or "test"; shard: (num_shards, shard_id) or None;
    start_epoch: the training epoch the first pass is, and skip_batches the batches of it already done (resume)."""
    return DATASETS.get(cfg.name, "dataset.name")(cfg, split, shard, start_epoch, seed, skip_batches)


def task(cfg) -> str:
    """What the recipe's data is for: "classification" or "translation" (how it is evaluated)."""
    return DATASETS.meta(cfg.dataset.name).get("task", "classification")



def channels(cfg) -> Optional[int]:
    """The channels of the images the data pipeline yields: dataset.channels when set, else the data's own
    (registered with the dataset: MNIST-style idx 1, CIFAR-10 and image folders 3); None for data that are not
    images. A network's first convolution must take this many."""
    own = DATASETS.meta(cfg.dataset.name).get("channels")
    return (cfg.dataset.channels or own) if own else None


def check_channels(cfg) -> None:
    """dataset.channels is one an image reader can give (0: the data's own, 1: grey, 3: RGB), and the
    normalisation has one value for all channels or one per channel; one line otherwise."""
    n, d = channels(cfg), cfg.dataset
    if n is None:
        return
    if d.channels not in (0, 1, 3):
        raise ConfigError(f"dataset.channels={d.channels}: the image readers give 1 (grey) or 3 (RGB) channels; "
                          f"set 0 (the data's own), 1 or 3")
    for key in ("mean", "std"):
        values = list(d[key] or [])
        if len(values) not in (0, 1, n):
            read = f"{n} channel{'s' if n > 1 else ''}" + (f" (dataset.channels={d.channels})" if d.channels else "")
            raise ConfigError(f"dataset.{key}={values} has {len(values)} values but the images are read with {read}; "
                              f"give dataset.mean and dataset.std one value each, or one per channel")
