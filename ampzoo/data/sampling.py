"""How every dataset feeds training: the epoch order (EpochShuffle / EpochBatches, exact on resume and the same
in every process), worker counts, and the seeded flip-and-shift augmentation of image batches."""
import os
from typing import Callable, Optional

import mindspore.dataset as msds
import numpy as np


def workers(cfg) -> int:
    """The recipe's worker count, capped at this machine's cores (mindspore.dataset refuses more)."""
    return max(1, min(cfg.num_workers, os.cpu_count() or 1))


def epoch_order(n: int, seed: int, epoch: int, shard=None, skip: int = 0, shuffle: bool = True) -> np.ndarray:
    """The sample indices one process trains on in `epoch`: RandomState(seed + epoch).permutation of the n
    samples (n trimmed to a multiple of the shard count), every k-th of them for shard (k, id), less the first
    `skip` (already trained on: resume mid-epoch). The same in every process, so a resumed run sees exactly
    the order the uninterrupted run saw."""
    num_shards, shard_id = shard if shard else (1, 0)
    n -= n % num_shards
    order = np.random.RandomState(seed + epoch).permutation(n) if shuffle else np.arange(n)
    return order[shard_id::num_shards][skip:]


def epoch_length(n: int, shard=None, skip: int = 0) -> int:
    num_shards = shard[0] if shard else 1
    return n // num_shards - skip


class EpochShuffle(msds.Sampler):
    """Training order as a mindspore.dataset Sampler: `epoch_order`, one epoch after another."""

    def __init__(self, n, seed, start_epoch=0, shard=None, skip=0):
        self.n, self.seed, self.epoch, self.shard, self.skip = n, seed, start_epoch, shard, skip
        super().__init__()

    def __iter__(self):
        order = epoch_order(self.n, self.seed, self.epoch, self.shard, self.skip)
        self.epoch += 1
        return iter(order.tolist())

    def __len__(self):
        return epoch_length(self.n, self.shard, self.skip)


class EpochBatches:
    """Whole batches from arrays already in memory, in `epoch_order` (the same samples in the same batches as
    EpochShuffle plus batch), for `GeneratorDataset`: one Python call per batch instead of one per sample. A
    per-sample Python source holds the GIL once a sample while the train step waits for it (docs/benchmarks.md,
    "Data pipeline"). Test split: file order, last batch kept."""

    def __init__(self, arrays, batch_size: int, split: str, seed: int, start_epoch: int = 0, shard=None,
                 skip: int = 0, augment: Optional[Callable] = None):
        self.arrays, self.batch_size, self.train = arrays, batch_size, split == "train"
        self.seed, self.epoch, self.shard, self.skip = seed, start_epoch, shard, skip
        self.augment = augment if self.train else None

    def __iter__(self):
        order = epoch_order(len(self.arrays[0]), self.seed, self.epoch, self.shard, self.skip, shuffle=self.train)
        epoch, first = self.epoch, self.skip // self.batch_size
        self.epoch += self.train
        for b in range(len(self)):
            take = order[b * self.batch_size:(b + 1) * self.batch_size]
            batch = tuple(a[take] for a in self.arrays)
            if self.augment:  # seeded by (seed, epoch, batch): a resumed run draws what the uninterrupted one drew;
                # under msrun by the shard too, so the ranks' images do not all take the same flips and shifts
                key = (self.seed, epoch, first + b) + ((self.shard[1],) if self.shard else ())
                rng = np.random.default_rng(key)
                batch = (self.augment(batch[0], rng), *batch[1:])
            yield batch

    def __len__(self):
        samples = epoch_length(len(self.arrays[0]), self.shard, self.skip)
        return samples // self.batch_size if self.train else -(-samples // self.batch_size)


def flip_and_shift(images: np.ndarray, rng: np.random.Generator, hflip: bool, shift: int) -> np.ndarray:
    """A batch of NCHW images, each flipped left-right with probability 1/2 (hflip) and translated by up to
    `shift` pixels each way, the uncovered border filled with the batch's minimum (the background after
    normalisation): the random-crop-with-padding and flip of the CIFAR/Fashion-MNIST references, vectorised."""
    if hflip:
        flip = rng.random(len(images)) < 0.5
        images = np.where(flip[:, None, None, None], images[..., ::-1], images)
    if shift:
        h, w = images.shape[-2:]
        padded = np.pad(images, ((0, 0), (0, 0), (shift, shift), (shift, shift)), constant_values=images.min())
        windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))
        dy, dx = rng.integers(0, 2 * shift + 1, size=(2, len(images)))
        images = windows[np.arange(len(images)), :, dy, dx]
    return np.ascontiguousarray(images)


def sampling(n: int, split: str, shard, seed: int, start_epoch: int, skip: int = 0) -> dict:
    """Keyword arguments for a mindspore.dataset source: EpochShuffle for training, file order for test."""
    if split == "train":
        return {"sampler": EpochShuffle(n, seed, start_epoch, shard, skip)}
    num_shards, shard_id = shard if shard else (None, None)
    return {"shuffle": False, "num_shards": num_shards, "shard_id": shard_id}
