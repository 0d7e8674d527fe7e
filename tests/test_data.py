"""MNIST readers: the embedded subset's split, and the idx reader on files written in the real format."""
import gzip
import struct

import numpy as np
import pytest
from omegaconf import OmegaConf

from ampzoo.compose import compose
from ampzoo.data import create_dataset
from ampzoo.data.mnist import load_embedded_mnist
from ampzoo.errors import ConfigError


def write_idx(folder, prefix, images, labels, image_magic=2051, gz=False):
    opener, suffix = (gzip.open, ".gz") if gz else (open, "")
    with opener(folder / f"{prefix}-images-idx3-ubyte{suffix}", "wb") as f:
        f.write(struct.pack(">IIII", image_magic, len(images), 28, 28) + images.astype(np.uint8).tobytes())
    with opener(folder / f"{prefix}-labels-idx1-ubyte{suffix}", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes())


@pytest.fixture(params=[False, True], ids=["plain", "gz"])
def idx_folder(tmp_path, request):
    rng = np.random.RandomState(0)
    for prefix, n in (("train", 96), ("t10k", 40)):
        write_idx(tmp_path, prefix, rng.randint(0, 256, (n, 28, 28)), np.arange(n) % 10, gz=request.param)
    return tmp_path


def dataset_cfg(**kw):
    cfg = compose(["recipe=lenet_o2"]).dataset
    return OmegaConf.merge(cfg, kw)


def test_embedded_split_is_real_balanced_disjoint_and_fixed():
    train_x, train_y = load_embedded_mnist("train", 0.2)
    test_x, test_y = load_embedded_mnist("test", 0.2)
    assert train_x.shape == (4000, 28, 28, 1) and test_x.shape == (1000, 28, 28, 1)
    assert np.bincount(test_y).tolist() == [100] * 10
    train_rows = {x.tobytes() for x in train_x}
    assert not any(x.tobytes() in train_rows for x in test_x)
    again_x, _ = load_embedded_mnist("test", 0.2)
    np.testing.assert_array_equal(again_x, test_x)
    assert 0.1 < (train_x > 0).mean() < 0.3, "real digits: mostly background, some ink"


def test_idx_reader_reads_the_standard_files(idx_folder):
    cfg = dataset_cfg(path=str(idx_folder), batch_size=32, eval_batch_size=16)
    train = create_dataset(cfg, "train")
    assert train.get_dataset_size() == 3  # 96 / 32, fixed batch shape
    images, labels = next(train.create_tuple_iterator())
    assert images.shape == (32, 1, 32, 32) and str(images.dtype) == "Float32" and str(labels.dtype) == "Int32"
    test = create_dataset(cfg, "test")
    got = np.concatenate([lab.asnumpy() for _, lab in test.create_tuple_iterator()])
    assert got.tolist() == (np.arange(40) % 10).tolist(), "test split in file order, all 40 images"


def test_gz_and_plain_files_give_the_same_pixels(tmp_path):
    rng = np.random.RandomState(1)
    images, labels = rng.randint(0, 256, (20, 28, 28)), rng.randint(0, 10, 20)
    for gz in (False, True):
        (tmp_path / str(gz)).mkdir()
        for prefix in ("train", "t10k"):
            write_idx(tmp_path / str(gz), prefix, images, labels, gz=gz)
    batches = [next(create_dataset(dataset_cfg(path=str(tmp_path / str(gz)), eval_batch_size=20), "test")
                    .create_tuple_iterator(output_numpy=True)) for gz in (False, True)]
    np.testing.assert_array_equal(batches[0][0], batches[1][0])
    assert batches[1][1].tolist() == labels.tolist()


def test_kaggle_file_names_are_read_too(tmp_path):
    """Kaggle's MNIST and Fashion-MNIST copies name the files train-images.idx3-ubyte (a dot before idx)."""
    rng = np.random.RandomState(2)
    images, labels = rng.randint(0, 256, (20, 28, 28)), rng.randint(0, 10, 20)
    for prefix in ("train", "t10k"):
        write_idx(tmp_path, prefix, images, labels)
        for kind in ("images-idx3", "labels-idx1"):
            dashed = tmp_path / f"{prefix}-{kind}-ubyte"
            dashed.rename(tmp_path / f"{prefix}-{kind.replace('-idx', '.idx')}-ubyte")
    batch = next(create_dataset(dataset_cfg(path=str(tmp_path), eval_batch_size=20), "test")
                 .create_tuple_iterator(output_numpy=True))
    assert batch[1].tolist() == labels.tolist()


def test_a_truncated_gz_file_is_one_line(tmp_path):
    write_idx(tmp_path, "train", np.zeros((8, 28, 28)), np.zeros(8), gz=True)
    data = (tmp_path / "train-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte.gz cannot be read as gzip"):
        create_dataset(dataset_cfg(path=str(tmp_path)), "train")


def test_idx_reader_rejects_a_bad_magic_number(idx_folder):
    write_idx(idx_folder, "train", np.zeros((8, 28, 28)), np.zeros(8), image_magic=1234)
    for gz in idx_folder.glob("*.gz"):
        gz.unlink()
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte is not an MNIST idx images file: magic number "
                                          "1234, expected 2051"):
        create_dataset(dataset_cfg(path=str(idx_folder)), "train")


def test_idx_reader_names_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"has no train-images-idx3-ubyte \(or train-images-idx3-ubyte.gz\)"):
        create_dataset(dataset_cfg(path=str(tmp_path)), "train")


def test_batch_larger_than_the_data_is_refused(idx_folder):
    with pytest.raises(ConfigError, match="dataset.batch_size=128 is larger than the 96 training images"):
        create_dataset(dataset_cfg(path=str(idx_folder), batch_size=128), "train")


def test_flip_and_shift_moves_pixels_without_inventing_them():
    from ampzoo.data.sampling import flip_and_shift
    images = np.arange(2 * 1 * 6 * 6, dtype=np.float32).reshape(2, 1, 6, 6)
    rng = np.random.default_rng(0)
    flipped = flip_and_shift(images, rng, hflip=True, shift=0)
    for got, orig in zip(flipped, images):
        assert np.array_equal(got, orig) or np.array_equal(got, orig[..., ::-1])
    shifted = flip_and_shift(images, np.random.default_rng(3), hflip=False, shift=2)
    assert shifted.shape == images.shape
    for got, orig in zip(shifted, images):  # some (dy, dx) in [-2, 2] maps the original onto the result
        padded = np.pad(orig, ((0, 0), (2, 2), (2, 2)), constant_values=images.min())
        assert any(np.array_equal(got, padded[:, dy:dy + 6, dx:dx + 6]) for dy in range(5) for dx in range(5))
    assert not np.array_equal(shifted, images)


def test_augmented_batches_are_the_same_after_a_mid_epoch_resume(idx_folder):
    cfg = dataset_cfg(path=str(idx_folder), batch_size=16, hflip=True, shift=2)
    whole = [x.asnumpy() for x, _ in create_dataset(cfg, "train", seed=5).create_tuple_iterator()]
    resumed = [x.asnumpy() for x, _ in create_dataset(cfg, "train", seed=5, skip_batches=4).create_tuple_iterator()]
    assert len(whole) == 6 and len(resumed) == 2
    np.testing.assert_array_equal(np.stack(resumed), np.stack(whole[4:]))
    plain = [x.asnumpy() for x, _ in create_dataset(dataset_cfg(path=str(idx_folder), batch_size=16), "train",
                                                    seed=5).create_tuple_iterator()]
    assert not np.array_equal(np.stack(plain), np.stack(whole)), "the training split is augmented"
    test = [x.asnumpy() for x, _ in create_dataset(cfg, "test").create_tuple_iterator()]
    plain_test = [x.asnumpy() for x, _ in create_dataset(dataset_cfg(path=str(idx_folder), batch_size=16),
                                                         "test").create_tuple_iterator()]
    np.testing.assert_array_equal(np.concatenate(test), np.concatenate(plain_test))


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    """Windows Notepad starts a UTF-8 file with a BOM; it is not a character of the first sentence."""
    from ampzoo.data.translation import _read_lines

    (tmp_path / "train.en").write_bytes("\ufeffTwo dogs play.\r\nA man runs.\r\n".encode("utf-8"))
    assert _read_lines(tmp_path / "train.en", "train_prefix") == ["Two dogs play.", "A man runs."]


def test_idx_files_a_folder_or_two_down_are_named(tmp_path):
    """torchvision keeps them in FashionMNIST/raw/: the error says which folder to give."""
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw, "train", np.zeros((4, 28, 28)), np.zeros(4))
    with pytest.raises(ConfigError,
                       match=f"has no train-images-idx3-ubyte .*: it is in {raw}, give dataset.path={raw}$"):
        create_dataset(dataset_cfg(path=str(tmp_path)), "train")


def test_a_missing_translation_split_names_the_files_that_are_there(tmp_path):
    """test.en where the recipe reads test_2016_flickr.en: the error lists the prefixes present and the key."""
    from ampzoo.data.translation import read_pairs

    for name in ("train.en", "train.de", "test.en", "test.de"):
        (tmp_path / name).write_text("one\n")
    cfg = OmegaConf.merge(compose(["recipe=transformer_tiny_multi30k_o0"]).dataset, {"path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"test_2016_flickr.en \(or .gz\) does not exist; .*the en files here are "
                                          r"test, train: set dataset.params.test_prefix to one of them$"):
        read_pairs(cfg, "test")
    assert read_pairs(OmegaConf.merge(cfg, {"params": {"test_prefix": "test"}}), "test") == [("one", "one")]
