"""Conv+BN folding equals the unfolded network in eval mode; export writes a file MindSpore loads back."""
import json

import numpy as np
import pytest

import mindspore as ms
import mindspore.nn as nn

from ampzoo.models import create_model
from tests.conftest import run_cli
from ampzoo.engine.fuse import fuse_conv_bn


def with_trained_like_bn_stats(net, seed=0):
    rng = np.random.RandomState(seed)
    for _, c in net.cells_and_names():
        if isinstance(c, nn.BatchNorm2d):
            n = c.gamma.shape[0]
            c.moving_mean.set_data(ms.Tensor(rng.randn(n).astype(np.float32) * 0.1))
            c.moving_variance.set_data(ms.Tensor(rng.rand(n).astype(np.float32) + 0.5))
            c.gamma.set_data(ms.Tensor(rng.rand(n).astype(np.float32) + 0.5))
            c.beta.set_data(ms.Tensor(rng.randn(n).astype(np.float32) * 0.1))
    return net


@pytest.mark.parametrize("name,stem,pairs", [("resnet34", "imagenet", 36),
                                              pytest.param("resnet50", "cifar", 53, marks=pytest.mark.slow)])
def test_folded_network_matches_in_eval_mode(graph_mode, name, stem, pairs):
    net = with_trained_like_bn_stats(create_model(name, num_classes=10, stem=stem, width=8))
    net.set_train(False)
    x = ms.Tensor(np.random.RandomState(1).randn(2, 3, 32, 32).astype(np.float32))
    ref = net(x).asnumpy()
    net, info = fuse_conv_bn(net)
    assert info["fused_pairs"] == pairs and info["found_by"] == "rewrite"
    assert not any(isinstance(c, nn.BatchNorm2d) for _, c in net.cells_and_names())
    out = net(x).asnumpy()
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), (np.abs(out - ref).max(), np.abs(ref).max())


def test_eval_and_export_with_folding(tmp_path):
    run = tmp_path / "run"
    # ResNet-34's 36 conv-BN pairs at a sixteenth of the width: the folding is the point, not the FLOPs (eval.py
    # and export.py take the width from the run's config, beside the checkpoint)
    result = run_cli("train.py", "recipe=resnet34_o0", "smoke.trainer.max_steps=5", "+model.params.width=16",
                     "logger.progress_bar=false", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = json.loads((run / "metrics.json").read_text())["checkpoint"]
    plain = run_cli("eval.py", "recipe=resnet34_o0", f"checkpoint={ckpt}", f"output={tmp_path / 'a.json'}")
    fused = run_cli("eval.py", "recipe=resnet34_o0", f"checkpoint={ckpt}", "infer.fuse_conv_bn=true",
                    f"output={tmp_path / 'b.json'}")
    assert plain.returncode == 0 and fused.returncode == 0, fused.stderr[-2000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert b["fused_conv_bn_pairs"] == 36 and "36 pairs fused" in fused.stderr
    assert b["top1"] == pytest.approx(a["top1"], abs=2e-3) and b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    out = tmp_path / "model.mindir"
    exported = run_cli("export.py", "recipe=resnet34_o0", f"checkpoint={ckpt}", "infer.fuse_conv_bn=true",
                       f"output={out}")
    assert exported.returncode == 0, exported.stderr[-2000:]
    graph = nn.GraphCell(ms.load(str(out)))
    y = graph(ms.Tensor(np.zeros((1, 3, 32, 32), np.float32)))
    assert y.shape == (1, 10)


def test_the_export_format_follows_the_file_name(tmp_path):
    """output=x.onnx without infer.format wrote a MINDIR file named .onnx (exit 0): the suffix sets the format,
    and a format it contradicts is one line, exit 2, nothing written."""
    ckpt = tmp_path / "lenet.ckpt"
    ms.save_checkpoint(create_model("lenet5", num_classes=10), str(ckpt))
    onnx = tmp_path / "lenet.onnx"
    out = run_cli("export.py", "recipe=lenet_o2", f"checkpoint={ckpt}", f"output={onnx}")
    assert out.returncode == 0 and "(ONNX, inputs (1, 1, 32, 32))" in out.stdout, out.stderr[-2000:]
    assert onnx.read_bytes()[:1] == b"\x08" and b"MindSpore" in onnx.read_bytes()[:32]  # ONNX's ModelProto
    with pytest.raises(Exception):
        ms.load(str(onnx))  # not a MINDIR
    wrong = tmp_path / "lenet.mindir"
    out = run_cli("export.py", "recipe=lenet_o2", f"checkpoint={ckpt}", f"output={wrong}", "infer.format=ONNX")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"error: output={wrong}: its suffix says MINDIR, but infer.format=ONNX; drop infer.format (the suffix "
        f"decides) or name the file lenet.onnx"), out.stderr
    assert not wrong.exists()


def test_an_onnx_export_leaves_the_folder_and_the_file_as_any_new_file(tmp_path):
    """MindSpore's ONNX writer set the output folder to 0700 (a shared folder with a colleague's file in it) and
    the file to 0400; a second export replaced the first without a word (issue 80, item 3)."""
    import os
    import stat
    ckpt = tmp_path / "lenet.ckpt"
    ms.save_checkpoint(create_model("lenet5", num_classes=10), str(ckpt))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    (shared / "colleague.txt").write_text("theirs")
    onnx = shared / "lenet.onnx"
    for first in (True, False):
        out = run_cli("export.py", "recipe=lenet_o2", f"checkpoint={ckpt}", f"output={onnx}")
        assert out.returncode == 0, out.stderr[-2000:]
        assert ("note: replaced the lenet.onnx that was there" in out.stderr) is not first, out.stderr
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE(onnx.stat().st_mode) == 0o666 & ~mask
    assert sorted(p.name for p in shared.iterdir()) == ["colleague.txt", "lenet.onnx"], "nothing else left"


def test_an_export_with_overrides_names_its_own_file(tmp_path):
    """Without output=, an export at another batch (or any key that changes what is exported) replaced the plain
    one beside the checkpoint: it names its own file, as eval.py's results do; the format stays the suffix."""
    from export import output_path
    from ampzoo.engine.weights import checkpoint_config

    ckpt = tmp_path / "lenet.ckpt"
    ms.save_checkpoint(create_model("lenet5", num_classes=10), str(ckpt))
    for argv, name in [([], "lenet.ckpt.mindir"), (["infer.batch_size=8"], "lenet.ckpt.infer.batch_size-8.mindir"),
                       (["infer.format=ONNX", "runtime.seed=3"], "lenet.ckpt.onnx")]:
        argv = ["recipe=lenet_o2", f"checkpoint={ckpt}", *argv]
        assert output_path(checkpoint_config(argv)[0], argv) == tmp_path / name
