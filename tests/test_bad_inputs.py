"""Bad input: one clear line naming the value and what is valid, exit code 2, nothing written."""
import pytest

from tests.conftest import run_cli
from ampzoo.engine.load import check_command_line

CASES = [
    (["recipe=lenet_o9"], "recipe=lenet_o9 not found; did you mean"),
    (["trainer.epochz=3"], "unknown key trainer.epochz; did you mean epochs?"),
    (["+trainer.foo=1"], "unknown key trainer.foo"),
    (["amp.level=O5"], "amp.level: Invalid value 'O5', expected one of [O0, O1, O2, O3]"),
    (["amp.dtype=float8"], "amp.dtype: Invalid value 'float8', expected one of [float16, bfloat16]"),
    (["amp.loss_scale.type=dyn"], "expected one of [none, fixed, dynamic]"),
    (["runtime.device=TPU"], "runtime.device: Invalid value 'TPU', expected one of [auto, CPU, GPU, Ascend]"),
    (["runtime.device=GPU"], "runtime.device=GPU is not available in this MindSpore build"),
    (["runtime.cpu_kernels=yes"], "runtime.cpu_kernels: Invalid value 'yes', expected one of [auto, on, off]"),
    (["amp.keep_fp32=[LayerNrom]"], "amp.keep_fp32: 'LayerNrom' is not a known Cell; did you mean LayerNorm"),
    (["amp.keep_fp32=[Conv2D]"], "'Conv2D' is a Primitive; MindSpore's precision lists take Cell classes, use Conv2d"),
    (["runtime.cpu_kernels=off", "runtime.cpu_compute=bf16"],  # an explicit setting never dropped silently
     "runtime.cpu_compute=bf16 asks the project's CPU kernels for bf16 products, but runtime.cpu_kernels=off runs "
     "MindSpore's kernels, which multiply fp16 in fp32; drop one of the two"),
    (["amp.keep_fp32=LayerNorm"],  # a list key given one value (issue 80, item 8)
     "amp.keep_fp32=LayerNorm is one value, and amp.keep_fp32 takes a list: amp.keep_fp32=[LayerNorm]"),
    (["amp.keep_fp32=LayerNorm,BatchNorm"],
     "amp.keep_fp32=LayerNorm,BatchNorm: a comma-separated value is a sweep (python train.py -m "
     "amp.keep_fp32=LayerNorm,BatchNorm) or, for a key that takes a list, a list in brackets: "
     "amp.keep_fp32=[LayerNorm,BatchNorm]"),
    (["recipe=resnet34_o2", "amp.keep_fp32=[CpuConv2d]"],  # copied from a CPU precision report
     "amp.keep_fp32: 'CpuConv2d' is the CPU build of Conv2d (cpu_kernels); name Conv2d, which matches it"),
    (["recipe=resnet34_o2", "amp.keep_fp32=[CpuBatchNorm2d]"],
     "amp.keep_fp32: 'CpuBatchNorm2d' is the CPU build of BatchNorm2d (cpu_kernels); name BatchNorm2d"),
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
    (["recipe=transformer_tiny_multi30k_o0", "dataset.path=/tmp", "smoke.trainer.epochs=2"],
     "smoke.trainer.epochs applies only to the smoke run (dataset.path unset); with dataset.path=/tmp set the key "
     "itself (trainer.epochs)"),  # not silently ignored
    (["runtime.distributed=true", "runtime.device_id=3"], "runtime.device_id=3 with runtime.distributed=true would "
                                                          "put every rank on device 3"),
    # numbers that cannot train: NaN passes every comparison with a bound, so each is checked for being finite
    (["optimizer.lr=nan"], "optimizer.lr=nan must be a finite number, positive"),
    (["optimizer.lr=inf"], "optimizer.lr=inf must be a finite number, positive"),
    (["schedule.min_lr=nan"], "schedule.min_lr=nan must be a finite number, at least 0"),
    (["amp.loss_scale.init_scale=inf"], "amp.loss_scale.init_scale=inf must be a finite number, positive"),
    (["trainer.label_smoothing=nan"], "trainer.label_smoothing=nan must be a finite number, from 0 to 1"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5]: each value must be from 0 to below 1"),
    (["optimizer.betas=[nan,0.98]"], "optimizer.betas=[nan, 0.98]: each value must be from 0 to below 1"),
    (["dataset.std=[0]"], "dataset.std=[0.0]: each value must be positive"),
    (["dataset.mean=[nan]"], "dataset.mean=[nan] is not a finite number"),
    (["recipe=transformer_base_o2", "model.params.dropout=nan"], "model.params.dropout=nan is not a finite number"),
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
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    nothing = run_cli("eval.py", "recipe=lenet_o2", f"checkpoint={empty}")
    assert nothing.returncode == 2 and nothing.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint='{empty}' is empty (0 bytes): a copy or a save that did not finish; take another "
        f"checkpoint of the run"), nothing.stderr


def _idx(folder, n=96, magic=2051, label=None):
    """The four idx files in their real format; `label`: every example labelled so (default 0-9 in turn)."""
    import struct

    import numpy as np
    for prefix, count in (("train", n), ("t10k", 16)):
        with open(folder / f"{prefix}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", magic, count, 28, 28) + bytes(count * 784))
        labels = np.arange(count) % 10 if label is None else np.full(count, label)
        with open(folder / f"{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 2049, count) + labels.astype(np.uint8).tobytes())


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
    result = run_cli("train.py", f"recipe={recipe}", f"dataset.path={data}", *extra,
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# Every reader, class by class: an empty, truncated, mislabelled or wrong-kind file is one ConfigError naming it
# (train.py turns that into the one `error:` line and exit 2, as test_bad_data_files shows), before any step.
def _text(src: bytes, tgt: bytes):
    def make(folder):
        (folder / "train.en").write_bytes(src)
        (folder / "train.de").write_bytes(tgt)
    return make


def _cifar_label(folder):
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (folder / name).write_bytes((bytes([12]) + bytes(3072)) * 10000)


READER_CASES = [
    ("lenet_o0", lambda d: (_idx(d), (d / "train-images-idx3-ubyte").write_bytes(b"")), [],
     "train-images-idx3-ubyte is empty (0 bytes)"),
    ("lenet_o0", lambda d: _idx(d, n=0), [], "train-images-idx3-ubyte holds no images"),
    ("lenet_o0", lambda d: _idx(d, label=12), [],
     "train-labels-idx1-ubyte holds label 12 (at example 0); an MNIST-style data set's labels are 0-9"),
    ("lenet_o0", lambda d: (d / "mnist.zip").write_bytes(b"PK"), ["dataset.path={data}/mnist.zip"],
     "mnist.zip' is a file; give the folder that holds the mnist files"),
    ("transformer_base_o2", _text(b"", b""), [], "train.en and .de hold no sentence pair (empty files)"),
    ("transformer_base_o2", _text(b"\n\n", b"\n\n"), [], "hold no sentence pair (2 lines, every pair with an empty"),
    ("transformer_base_o2", _text(b"ok\n\xff\xfe bad\n", b"gut\nschlecht\n"), [],
     "train.en is not UTF-8 text (line 2: invalid start byte)"),
    ("transformer_base_o2", lambda d: (_text(b"a b\n", b"c d\n")(d), (d / "m.model").write_bytes(b"garbage")),
     ["+dataset.params.spm_model={data}/m.model"], "m.model is not a sentencepiece model"),
    ("transformer_base_o2", lambda d: (_text(b"a b\n", b"c d\n")(d), (d / "m.model").mkdir()),
     ["+dataset.params.spm_model={data}/m.model"], "m.model' is a directory; give a sentencepiece .model file"),
    ("resnet34_cifar10_o2", _cifar_label, [], "data_batch_1.bin holds label 12 in record 0; CIFAR-10 labels are 0-9"),
    ("transformer_tiny_multi30k_o0",
     _text(b"a small dog runs\na cat sleeps\n", b"ein kleiner hund rennt\neine katze\n"),
     [], "the 2 training pairs fill no whole batch: the fullest length bucket (14 tokens) has 2 pairs, and a batch "
         "of it holds 292 (dataset.max_tokens=4096); lower dataset.max_tokens, or give more training pairs"),
]


@pytest.mark.parametrize("recipe,make,extra,message", READER_CASES, ids=[c[3][:40] for c in READER_CASES])
def test_every_reader_names_a_bad_file(tmp_path, recipe, make, extra, message):
    from ampzoo.data import create_dataset
    from ampzoo.engine.load import load_config
    from ampzoo.errors import ConfigError

    data = tmp_path / "data"
    data.mkdir()
    make(data)
    overrides = [e.format(data=data) for e in extra]
    path = [] if any(e.startswith("dataset.path=") for e in overrides) else [f"dataset.path={data}"]
    with pytest.raises(ConfigError) as error:
        cfg, _ = load_config([f"recipe={recipe}", *path, *overrides])
        next(create_dataset(cfg.dataset, "train").create_tuple_iterator())
    assert message in str(error.value)


def test_a_run_directory_that_cannot_be_read_is_one_line(tmp_path):
    from ampzoo.engine.rundir import load_run_config
    from ampzoo.errors import ConfigError

    with pytest.raises(ConfigError, match="has no config.yaml: not a train.py run directory"):
        load_run_config(tmp_path)
    for text, reason in (("", "it holds no settings"), ("model: [unclosed", "while parsing"), ("- a list\n", "")):
        (tmp_path / "config.yaml").write_text(text)
        with pytest.raises(ConfigError, match="config.yaml cannot be read as the run's config") as error:
            load_run_config(tmp_path)
        assert reason in str(error.value)


PIPELINE_ERROR = """Exception thrown from dataset pipeline. Refer to 'Dataset Pipeline Error Message'.

------------------------------------------------------------------
- Dataset Pipeline Error Message:
------------------------------------------------------------------
[ERROR] Invalid image, /data/imagenet/train/n01/10.JPEG decode failed, the image is broken or permission denied.
"""  # MindSpore 2.10's own message for a broken JPEG in an ImageFolder (the whole of its first lines)


def test_a_file_the_pipeline_cannot_read_is_one_line_at_any_step(tmp_path):
    import types

    from ampzoo.engine.process.failures import step_error
    run = types.SimpleNamespace(timer=types.SimpleNamespace(steps=[120]), run_dir=tmp_path, device="CPU", is_main=True,
                                cfg=types.SimpleNamespace(recipe_name="resnet34_o2"))
    line = step_error(run, RuntimeError(PIPELINE_ERROR), ran_before=True)
    assert line.startswith("the data pipeline failed at step 120: Invalid image, /data/imagenet/train/n01/10.JPEG "
                           "decode failed")
    assert f"continue with: python train.py recipe=resnet34_o2 hydra.run.dir={tmp_path} resume=auto" in line
    with pytest.raises(RuntimeError, match="a bug"):  # anything else after the first step is not bad input
        step_error(run, RuntimeError("a bug"), ran_before=True)


@pytest.mark.parametrize("command", ["eval.py", "export.py", "-m bench.verify", "-m bench.ship", "-m bench.multi30k",
                                     "-m amp.report", "-m amp.audit", "-m amp.search"])
def test_every_command_answers_help_with_its_usage(command):
    """-h/--help prints the command's usage and exits 0 instead of being taken for a bad argument."""
    result = run_cli(command, "--help")
    name = command.split()[-1].removesuffix(".py").rsplit(".", 1)[-1]  # eval, export, verify, ship, ..., search
    assert result.returncode == 0 and "error" not in result.stderr.lower(), result.stderr[-500:]
    assert "python" in result.stdout and name in result.stdout, result.stdout[:300]
