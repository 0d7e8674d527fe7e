"""CIFAR-10 (the binary version or an image folder) and ImageNet-style folders, in their standard on-disk formats.

Neither ships in any package: `dataset.path` is required. Recipes built on them carry a `smoke` block
that runs on the embedded MNIST subset when the path is unset (ampzoo/config.apply_smoke).
"""
import os
from pathlib import Path

import mindspore.dataset as msds
import mindspore.dataset.transforms as T
import mindspore.dataset.vision as V
import numpy as np
from mindspore import dtype as mstype

from ampzoo.data.sampling import sampling, workers
from ampzoo.errors import ConfigError
from ampzoo.registry import DATASETS

CIFAR_RECORD = 1 + 32 * 32 * 3
CIFAR_FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
DECODED = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".ppm", ".pgm"}  # what MindSpore's decoder reads
UNDECODED = {".webp", ".gif", ".heic", ".heif", ".avif", ".jp2", ".ico"}  # images it cannot: refused up front
IMAGE_EXTENSIONS = DECODED | UNDECODED  # any case: IMG_0001.JPG


def _require_path(cfg, what: str) -> Path:
    if cfg.path is None:
        raise ConfigError(f"dataset {cfg.name} needs dataset.path ({what}); it is not embedded")
    return Path(cfg.path).expanduser()


def check_cifar_folder(path: Path, split: str) -> None:
    for name in CIFAR_FILES[split]:
        f = path / name
        if not f.is_file():
            hint = ""
            if (path / "cifar-10-batches-bin" / name).is_file():  # the archive's root given, not its folder
                hint = f": they are one folder down, give dataset.path={path / 'cifar-10-batches-bin'}"
            elif (path / "data_batch_1").is_file() or (path / "cifar-10-batches-py").is_dir():
                hint = ": these are CIFAR-10's python (pickle) files; get the binary version, cifar-10-binary.tar.gz"
            raise ConfigError(f"dataset.path={str(path)!r} has no {name}; CIFAR-10 needs the binary version "
                              f"(cifar-10-batches-bin: data_batch_1..5.bin, test_batch.bin){hint}")
        size = f.stat().st_size
        if size % CIFAR_RECORD or size < 10000 * CIFAR_RECORD:
            raise ConfigError(f"{f} is not a complete CIFAR-10 batch: {size} bytes, expected 10000 records of "
                              f"{CIFAR_RECORD} bytes ({10000 * CIFAR_RECORD}); truncated download?")
        labels = np.memmap(f, np.uint8, "r")[::CIFAR_RECORD]  # each record: a label byte, then 3,072 pixels
        if labels.max() > 9:
            raise ConfigError(f"{f} holds label {labels.max()} in record {int(labels.argmax())}; CIFAR-10 labels are "
                              f"0-9 (the binary version's first byte of each 3,073-byte record): not a CIFAR-10 batch?")


def _colour(cfg, ops: list) -> list:
    """The transforms after decoding, in the channels the network takes: the images as decoded (RGB), or
    grey with dataset.channels=1 (a 1-channel network, such as a shipped Fashion-MNIST weight)."""
    if cfg.channels == 1:
        return [V.ConvertColor(V.ConvertMode.COLOR_RGB2GRAY), *ops, _normalize(cfg), _channel_axis]
    return [*ops, _normalize(cfg), V.HWC2CHW()]


def _channel_axis(image):
    """A grey HxW image as the 1xHxW a network takes (HWC2CHW leaves a 2-D image as it is)."""
    return image[None]


def _finish(ds, cfg, split: str, ops):
    train = split == "train"
    ds = ds.map(operations=ops, input_columns="image", num_parallel_workers=workers(cfg))
    ds = ds.map(operations=T.TypeCast(mstype.int32), input_columns="label")
    batch_size = cfg.batch_size if train else cfg.eval_batch_size
    return ds.batch(batch_size, drop_remainder=train)


def _normalize(cfg):
    return V.Normalize(mean=[m * 255 for m in cfg.mean], std=[s * 255 for s in cfg.std])


def is_cifar_folder(path: Path) -> bool:
    """CIFAR-10 as an image folder (train/<class>/*.jpg and test/<class>/*.jpg), not the binary batches."""
    return (path / "train").is_dir() and not (path / "data_batch_1.bin").is_file()


@DATASETS.register("cifar10", task="classification", classes=10, channels=3, reads_folders=True)
def cifar10(cfg, split: str, shard=None, start_epoch: int = 0, seed: int = 0,
            skip_batches: int = 0):
    """The binary version (data_batch_1..5.bin, test_batch.bin) or an image folder (train/<class>/,
    test/<class>/: dataset.eval_split names the evaluated folder). Both give airplane..truck labels 0-9: the
    folder's class names sorted are CIFAR-10's own order."""
    path = _require_path(cfg, "the cifar-10-batches-bin folder, or a folder with train/<class>/ and test/<class>/")
    ops = [V.RandomCrop(32, padding=4), V.RandomHorizontalFlip()] if split == "train" else []
    if is_cifar_folder(path):
        ds = _image_folder(cfg, path, split, "test", shard, seed, start_epoch, skip_batches)
        return _finish(ds, cfg, split, _colour(cfg, ops))
    check_cifar_folder(path, split)
    n = msds.Cifar10Dataset(str(path), usage=split).get_dataset_size()
    ds = msds.Cifar10Dataset(str(path), usage=split, **sampling(n, split, shard, seed, start_epoch,
                                                                 skip_batches * cfg.batch_size))
    return _finish(ds, cfg, split, _colour(cfg, ops))


# what ImageFolderDataset reads (it matches suffixes exactly): images only, so a .DS_Store or notes.txt that a
# copy brought along is passed over, as torchvision's ImageFolder does, instead of failing to decode mid-epoch
READ_EXTENSIONS = sorted({v for e in DECODED for v in (e, e.upper(), "." + e[1:].capitalize())})


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def image_classes(folder: Path) -> list:
    """The sub-folders of `folder` that hold images, sorted."""
    return sorted(d.name for d in folder.iterdir()
                  if d.is_dir() and any(map(is_image, d.iterdir()))) if folder.is_dir() else []


def check_decodable(folder: Path) -> None:
    """Images MindSpore's decoder cannot read (a phone's .heic, a web page's .webp) are one line before training,
    not a "broken image" at whatever step the sampler first reaches one."""
    unread = sorted(Path(f.path) for d in os.scandir(folder) if d.is_dir() for f in os.scandir(d)
                    if os.path.splitext(f.name)[1].lower() in UNDECODED)  # os.scandir: ImageNet's 1.28M in seconds
    if unread:
        kinds = sorted({f.suffix.lower() for f in unread})
        more = f" and {len(unread) - 1:,} more {'/'.join(kinds)} image(s) in {folder}" if len(unread) > 1 else ""
        raise ConfigError(f"{unread[0]}{more} cannot be read: MindSpore's image decoder reads "
                          f"{', '.join(sorted(DECODED))}; convert them (for example mogrify -format png "
                          f"*/*{kinds[0]} in {folder}) or move them out")


ENDS = {".jpg": (b"\xff\xd9", "JPEG's end-of-image marker"), ".jpeg": (b"\xff\xd9", "JPEG's end-of-image marker"),
        ".png": (b"IEND", "PNG's IEND chunk")}


def check_complete(folder: Path) -> None:
    """Every JPEG and PNG of `folder`'s class folders ends as its format does (JPEG's end-of-image marker, PNG's
    IEND chunk, in the file's last KiB): a truncated copy is one line naming the file before training, not a
    pipeline error at the first evaluation, after an epoch of training. Reads the last KiB of each file (the
    evaluation split's: ImageNet's 50,000 in seconds; the training split's broken files are named when the
    sampler reaches one)."""
    for entry in (f for d in os.scandir(folder) if d.is_dir() for f in os.scandir(d)):
        end, what = ENDS.get(os.path.splitext(entry.name)[1].lower(), (None, ""))
        if end is None:
            continue
        with open(entry.path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 1024))
            if end not in f.read():
                raise ConfigError(f"{entry.path} is truncated (it lacks {what} at its end): copy it again, or move "
                                  f"it out of {folder}")


def folder_classes(path) -> list:
    """The class names of an image-folder data set: its train/ sub-folders that hold images, sorted. Their order
    gives the labels of both splits (torchvision's ImageFolder order), so val/ lines up with train/ even when it
    lacks a class."""
    return image_classes(Path(path).expanduser() / "train")


def _image_folder(cfg, root: Path, split: str, eval_default: str, shard=None, seed: int = 0,
                  start_epoch: int = 0, skip_batches: int = 0):
    """root/train/<class>/ or root/<eval split>/<class>/ (dataset.eval_split, else eval_default) as a decoded
    ImageFolderDataset, checked first: the folder exists, holds images in class folders MindSpore can decode,
    and names no class that train/ lacks (the labels are train/'s class names, sorted)."""
    name = "train" if split == "train" else (cfg.eval_split or eval_default)
    folder = root / name
    if not folder.is_dir():
        found = sorted(d.name + "/" for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
        key = "" if split == "train" else f" (dataset.eval_split={name})"
        raise ConfigError(f"dataset.path={str(root)!r} has no {name}/ folder{key}; "
                          + (f"it has {', '.join(found)}" if found else
                             "it is not a folder" if not root.is_dir() else "it has no sub-folders")
                          + f"; expected train/ and {'val/' if eval_default == 'val' else 'test/'} with one "
                            "sub-folder of images per class")
    if not any(map(is_image, folder.glob("*/*"))):
        flat = sum(1 for f in folder.iterdir() if is_image(f))
        raise ConfigError(f"{folder} has no images in class sub-folders (looked for "
                          f"{', '.join(sorted(DECODED))}, in any case)" + (
                              f"; it holds {flat:,} images directly: sort them into one sub-folder per class "
                              f"(ImageNet's val/ ships flat: its devkit's labels say each image's class)"
                              if flat else ""))
    check_decodable(folder)
    if split != "train":
        check_complete(folder)
    classes = folder_classes(root)
    extra = sorted(set(image_classes(folder)) - set(classes))
    if extra:
        raise ConfigError(f"{folder} has class folder(s) that {root / 'train'} does not: {', '.join(extra[:5])}"
                          f"{' ...' if len(extra) > 5 else ''}; {name}/ must use train/'s class names, or its "
                          f"labels would not line up with what the network learned")
    index = {c: i for i, c in enumerate(classes)}
    n = msds.ImageFolderDataset(str(folder), class_indexing=index, extensions=READ_EXTENSIONS).get_dataset_size()
    return msds.ImageFolderDataset(str(folder), decode=True, class_indexing=index, extensions=READ_EXTENSIONS,
                                   **sampling(n, split, shard, seed, start_epoch, skip_batches * cfg.batch_size))


@DATASETS.register("imagenet", task="classification", classes_on_disk=folder_classes, channels=3)
def imagenet(cfg, split: str, shard=None, start_epoch: int = 0, seed: int = 0,
            skip_batches: int = 0):
    """path/train/<class>/*.JPEG and path/val/<class>/*.JPEG (the torchvision ImageFolder layout; another
    evaluated folder: dataset.eval_split)."""
    root = _require_path(cfg, "a folder with train/ and val/, one sub-folder of images per class")
    ds = _image_folder(cfg, root, split, "val", shard, seed, start_epoch, skip_batches)
    size = cfg.image_size
    if split == "train":
        ops = [V.RandomResizedCrop(size, scale=(0.08, 1.0)), V.RandomHorizontalFlip()]
    else:
        ops = [V.Resize(int(round(size * 256 / 224))), V.CenterCrop(size)]
    return _finish(ds, cfg, split, _colour(cfg, ops))
