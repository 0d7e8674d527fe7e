"""Dataset registry: `create_dataset(cfg.dataset, "train")` returns a batched `mindspore.dataset` pipeline.

Each builder takes (dataset config, split, shard) and reads either the embedded data that ships in a
package (`path` unset) or the standard on-disk format at `path`.
"""
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np

DATASETS: Dict[str, Callable] = {}


def register_dataset(name: str):
    def wrap(fn: Callable) -> Callable:
        DATASETS[name] = fn
        return fn
    return wrap


def workers(cfg) -> int:
    """The recipe's worker count, capped at this machine's cores (mindspore.dataset refuses more)."""
    return max(1, min(cfg.num_workers, os.cpu_count() or 1))


class EpochShuffle:
    """Training order: epoch e is RandomState(seed + e).permutation, the same in every process, so a run
    resumed at epoch e sees exactly the data order the uninterrupted run saw. Sharded: every k-th index."""

    def __new__(cls, *args, **kwargs):  # a mindspore.dataset.Sampler, imported lazily
        import mindspore.dataset as msds

        class _EpochShuffle(msds.Sampler):
            def __init__(self, n, seed, start_epoch=0, shard=None, skip=0):
                self.num_shards, self.shard_id = shard if shard else (1, 0)
                self.n, self.seed, self.epoch = n - n % self.num_shards, seed, start_epoch
                self.skip = skip  # samples already trained on: a one-epoch dataset of the rest (resume mid-epoch)
                super().__init__()

            def __iter__(self):
                order = np.random.RandomState(self.seed + self.epoch).permutation(self.n)
                self.epoch += 1
                return iter(order[self.shard_id::self.num_shards][self.skip:].tolist())

            def __len__(self):
                return self.n // self.num_shards - self.skip
        return _EpochShuffle(*args, **kwargs)


class EpochBatches:
    """Whole batches from arrays already in memory, in EpochShuffle's order (the same samples in the same
    batches), for `GeneratorDataset`: one Python call per batch instead of one per sample. A per-sample Python
    source holds the GIL 32 times a batch while the train step waits; on 2 cores that cost LeNet 13%."""

    def __init__(self, arrays, batch_size: int, split: str, seed: int, start_epoch: int = 0, shard=None,
                 skip: int = 0):
        self.arrays, self.batch_size, self.train = arrays, batch_size, split == "train"
        self.num_shards, self.shard_id = shard if shard else (1, 0)
        n = len(arrays[0])
        self.n = n - n % self.num_shards
        self.seed, self.epoch, self.skip = seed, start_epoch, skip

    def __iter__(self):
        if self.train:
            order = np.random.RandomState(self.seed + self.epoch).permutation(self.n)
            self.epoch += 1
        else:
            order = np.arange(self.n)
        order = order[self.shard_id::self.num_shards][self.skip:]
        for b in range(len(self)):
            take = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield tuple(a[take] for a in self.arrays)

    def __len__(self):
        samples = self.n // self.num_shards - self.skip
        return samples // self.batch_size if self.train else -(-samples // self.batch_size)


def sampling(n: int, split: str, shard, seed: int, start_epoch: int, skip: int = 0) -> dict:
    """Keyword arguments for a mindspore.dataset source: EpochShuffle for training, file order for test."""
    if split == "train":
        return {"sampler": EpochShuffle(n, seed, start_epoch, shard, skip)}
    num_shards, shard_id = shard if shard else (None, None)
    return {"shuffle": False, "num_shards": num_shards, "shard_id": shard_id}


def create_dataset(cfg, split: str, shard: Optional[Tuple[int, int]] = None, start_epoch: int = 0, seed: int = 0,
                   skip_batches: int = 0):
    """split: "train" (shuffled per epoch, fixed batch shape) or "test"; shard: (num_shards, shard_id) or None;
    start_epoch: the training epoch the first pass is, and skip_batches the batches of it already done (resume)."""
    return DATASETS[cfg.name](cfg, split, shard, start_epoch, seed, skip_batches)


from data import images, mnist, translation  # noqa: E402,F401  (registers their datasets)
