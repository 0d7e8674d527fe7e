"""runtime.profile=true: the Profiler's op times, attributed to the precision each Cell runs in."""
import json

import pytest

from ampzoo.amp.profile import cell_path


@pytest.mark.parametrize("scope, path", [
    ("Default/network-NetWithLoss/net-CastOutput/cell-LeNet5/conv1-Conv2d/Conv2D-op3", "conv1"),
    ("Gradients/Default/network-NetWithLoss/net-CastOutput/cell-LeNet5/conv1-Conv2d/Grad_Conv2D/Cast-op0", "conv1"),
    ("Default/network-NetWithLoss/net-CastOutput/cell-ResNet/layer1-SequentialCell/0-BasicBlock/bn1-CastOutput/"
     "cell-BatchNorm2d/BatchNorm-op1", "layer1.0.bn1"),
    ("Default/network-NetWithLoss/net-LeNet5/fc1-Dense/MatMul-op2", "fc1"),
    ("Default/network-NetWithLoss/net-CastOutput/Cast-op9", ""),
    ("Default/optimizer-Momentum/ApplyMomentum-op7", None),
    # a top-level Cell's own ops (the Transformer's tied output projection) belong to it, forward and backward
    ("Default/network-NetWithLoss/net-CastOutput/cell-Transformer/MatMul-op0", ""),
    ("Gradients/Default/network-NetWithLoss/net-Transformer/Grad_MatMul/MatMul-op45", ""),
    ("Default/network-NetWithLoss/loss_fn-FlatCrossEntropy/ce-CrossEntropyLoss/Log-op1", None),
])
def test_ops_are_attributed_to_their_cell(scope, path):
    assert cell_path(scope) == path


def test_root_ops_count_for_the_model_and_unscoped_ops_apart():
    from ampzoo.amp.profile import UNSCOPED, summarise
    rows = [("Default/network-NetWithLoss/net-CastOutput/cell-Transformer/MatMul-op0", "MatMul", 6.0),
            ("Default/network-NetWithLoss/net-CastOutput/cell-Transformer/encoder-CellList/0-EncoderLayer/"
             "norm-CastOutput/cell-LayerNorm/LayerNorm-op1", "LayerNorm", 1.0),
            ("Expand/_SumExt/ReduceSum-op0", "ReduceSum", 2.0),
            ("Default/optimizer-Adam/Adam-op3", "Adam", 1.0)]
    dtypes = {"(root)": "float16", "encoder.0.norm": "float32"}
    share = summarise(rows, dtypes, steps=1)["share"]
    assert share == {"float16 Cells": 0.6, UNSCOPED: 0.2, "float32 Cells": 0.1,
                     "outside the network (loss, optimizer, loss scaling)": 0.1}


def test_profile_writes_the_precision_time_shares(tmp_path, graph_mode):
    from train import train
    from ampzoo.engine.load import load_config
    cast = {}
    for recipe, low in [("lenet_o0", False), ("lenet_o2", True)]:
        cfg, _ = load_config([f"recipe={recipe}", "trainer.epochs=1", "trainer.max_steps=12", "runtime.profile=true",
                       "logger.progress_bar=false"])
        (tmp_path / recipe).mkdir()
        train(cfg, tmp_path / recipe)
        summary = json.loads((tmp_path / recipe / "profile.json").read_text())
        assert summary["steps"] == 5
        assert sum(summary["share"].values()) == pytest.approx(1.0)
        assert ("float16 Cells" in summary["share"]) == low
        conv = [r for r in summary["slowest"] if r["cell"] in ("conv1", "conv2") and r["op"] != "Cast"]
        assert conv and all(r["group"] == ("float16 Cells" if low else "float32 Cells") for r in conv)
        report = (tmp_path / recipe / "profile.md").read_text()
        assert "| ops | share of op time |" in report
        assert f"Cast ops in the step's graph: {summary['cast_ops']}" in report
        cast[recipe] = summary["cast_ops"]
    # counted, not timed (a time share moves with the machine's load)
    assert cast["lenet_o2"] > cast["lenet_o0"], f"O2 casts at Cell edges; O0 next to nothing: {cast}"
