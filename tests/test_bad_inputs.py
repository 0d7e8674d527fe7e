"""Bad input: one clear line naming the value and what is valid, exit code 2, nothing written."""
import pytest

from tests.conftest import run_cli
from engine.load import check_command_line

CASES = [
    (["recipe=lenet_o9"], "recipe=lenet_o9 not found; did you mean"),
    (["trainer.epochz=3"], "unknown key trainer.epochz; did you mean epochs?"),
    (["+trainer.foo=1"], "unknown key trainer.foo"),
    (["amp.level=O5"], "amp.level: Invalid value 'O5', expected one of [O0, O1, O2, O3]"),
    (["amp.dtype=float8"], "amp.dtype: Invalid value 'float8', expected one of [float16, bfloat16]"),
    (["amp.loss_scale.type=dyn"], "expected one of [none, fixed, dynamic]"),
    (["runtime.device=TPU"], "runtime.device: Invalid value 'TPU', expected one of [auto, CPU, GPU, Ascend]"),
    (["runtime.device=GPU"], "runtime.device=GPU is not available in this MindSpore build"),
    (["amp.keep_fp32=[LayerNrom]"], "amp.keep_fp32: 'LayerNrom' is not a known Cell; did you mean LayerNorm"),
    (["amp.keep_fp32=[Conv2D]"], "'Conv2D' is a Primitive; MindSpore's precision lists take Cell classes, use Conv2d"),
    (["amp.force_fp16=[Softmx]"], "amp.force_fp16: 'Softmx' is not a known Cell; did you mean Softmax"),
    (["amp.keep_fp32=[Dense]", "amp.force_fp16=[Dense]"], "Dense is in both amp.keep_fp32 and amp.force_fp16"),
    (["amp.dtype=bfloat16"], "amp.dtype=bfloat16 is not supported on CPU"),
    (["dataset.path=/no/such/mnist"], "dataset.path='/no/such/mnist' does not exist"),
    (["recipe=lenet_fashion_o2", "dataset.path=/usr/share/datasets/fashion-mnist-gone"],
     "install Debian's package (apt-get install dataset-fashion-mnist)"),
    (["dataset.batch_size=0"], "dataset.batch_size=0 must be at least 1"),
    (["dataset.batch_size=abc"], "dataset.batch_size: Value 'abc' of type 'str' could not be converted to Integer"),
    (["model.name=lenet4"], "model.name='lenet4' is not a registered model; did you mean lenet5"),
    (["+model.params.width=3"], "model.params.width is not an argument of model 'lenet5'"),
    (["amp.loss_scale.scale=-1"], "amp.loss_scale.scale=-1.0 must be positive"),
    (["-m", "recipe=lenet_o0,lenet_o9"], "recipe=lenet_o9 not found"),
    (["hydra.run.dir=/etc/hostname"], "hydra.run.dir=/etc/hostname is a file; give a directory"),
    # common slips: what was meant, not Hydra's grammar
    (["lenet_o2"], "'lenet_o2' is not a key=value override; did you mean recipe=lenet_o2?"),
    (["epochs=1"], "unknown key epochs; did you mean trainer.epochs?"),
    (["resume=true"], "resume=true: resume takes auto (the newest checkpoint of hydra.run.dir) or the path of a "
                      ".ckpt file"),
    (["dataset.path=~/no-such-mnist"], "/no-such-mnist' does not exist"),  # ~ expanded, not a grammar error
    (["recipe=lenet_o2", "[--diff", "O1", "O3]"], "'[--diff' looks like a usage line pasted with its brackets"),
    (["trainer.sink_size=100"], "trainer.sink_size=100: MindSpore counts each sink as an epoch"),
    (["runtime.distributed=true", "runtime.device_id=3"], "runtime.device_id=3 with runtime.distributed=true would "
                                                          "put every rank on device 3"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_command_line(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert message in err, err


def test_cli_exit_code_and_nothing_written(tmp_path):
    """The real command, from another directory: exit 2, one line on stderr, no run directory."""
    from tests.conftest import ROOT
    result = run_cli(str(ROOT / "train.py"), "amp.level=O5", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: amp.level: Invalid value 'O5', expected one of [O0, O1, O2, O3]"]
    assert not any(tmp_path.iterdir())


def test_eval_bad_checkpoints(tmp_path):
    missing = run_cli("eval.py", "recipe=lenet_o2", f"checkpoint={tmp_path}/none.ckpt")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00not a checkpoint" * 64)
    corrupt = run_cli("eval.py", "recipe=lenet_o2", f"checkpoint={junk}")
    assert corrupt.returncode == 2
    folder = run_cli("eval.py", "recipe=lenet_o2", f"checkpoint={tmp_path}")
    assert folder.returncode == 2 and f"checkpoint='{tmp_path}' is a directory; give a .ckpt file" in folder.stderr
    assert "is not a readable MindSpore checkpoint" in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


def _idx(folder, n=96, magic=2051):
    import struct

    import numpy as np
    for prefix, count in (("train", n), ("t10k", 16)):
        with open(folder / f"{prefix}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", magic, count, 28, 28) + bytes(count * 784))
        with open(folder / f"{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 2049, count) + (np.arange(count) % 10).astype(np.uint8).tobytes())


def _empty_image_folder(folder):
    (folder / "train" / "n01").mkdir(parents=True)
    (folder / "val" / "n01").mkdir(parents=True)


def _cifar_truncated(folder):
    (folder / "test_batch.bin").write_bytes(bytes(3073 * 100))


def _misaligned_text(folder):
    (folder / "train.en").write_text("one\ntwo\nthree\n")
    (folder / "train.de").write_text("eins\nzwei\n")


DATA_CASES = [
    ("lenet_o0", lambda d: _idx(d, magic=1234), [],
     "-images-idx3-ubyte is not an MNIST idx images file: magic number 1234, expected 2051"),
    ("lenet_o0", lambda d: _idx(d, n=96), ["dataset.batch_size=128"],
     "dataset.batch_size=128 is larger than the 96 training images of this shard; use at most 96"),
    ("resnet34_cifar10_o2", _cifar_truncated, [], "test_batch.bin is not a complete CIFAR-10 batch"),
    ("resnet34_o2", _empty_image_folder, [], "has no images in class sub-folders"),
    ("transformer_base_o2", _misaligned_text, [], "train.en has 3 lines but .de has 2; parallel files must align"),
]


@pytest.mark.parametrize("recipe,make,extra,message", DATA_CASES, ids=[c[3][:40] for c in DATA_CASES])
def test_bad_data_files(tmp_path, recipe, make, extra, message):
    data = tmp_path / "data"
    data.mkdir()
    make(data)
    result = run_cli("train.py", f"recipe={recipe}", f"dataset.path={data}", *extra, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
