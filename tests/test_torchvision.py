"""Our ResNets are torchvision's: copy torchvision's weights into ours and compare (slow: full-width ResNets;
`make test-all`, or `pytest -m slow tests/test_torchvision.py`).

For each model, torchvision's `resnetNN()` (no weights downloaded: its own random initialisation) is copied
parameter by parameter into ours (BatchNorm running statistics included), then on the same random batch:
- eval mode: the logits, relative error (max |ours - theirs| / max |theirs|), which must be <= 1e-4;
- train mode, one SGD step (lr 0.1, momentum 0.9, weight decay 1e-4 on every parameter, as torch's SGD
  default): the loss, and the update of all weights together, relative error ||ours - theirs|| / ||theirs||
  (a per-tensor ratio is noise for BatchNorm betas, whose first update is a sum of gradients that nearly
  cancel), which must stay within twice the same error between torchvision's own fp32 and fp64 steps: the
  fp32 noise floor of this network at initialisation (deep ResNets without zero-init residuals amplify
  rounding). The BatchNorm running statistics (momentum 0.1 in torch's convention, 0.9 in MindSpore's) are
  compared too. PyTorch and torchvision are test-only peers, skipped when absent.
"""
from typing import Dict

import mindspore as ms
import mindspore.nn as nn
import numpy as np
import pytest

from ampzoo.models import create_model

pytest.importorskip("torch", reason="pip install torch==2.14.1 torchvision==0.29.1")
pytest.importorskip("torchvision", reason="pip install torch==2.14.1 torchvision==0.29.1")

BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}


def our_name(torch_name: str, bn_layers: set) -> str:
    """torchvision's parameter name -> ours (ampzoo/models/resnet.py)."""
    name = torch_name.replace("downsample.", "down.")
    if name.startswith(("conv1.", "bn1.")):
        name = name.replace("conv1.", "stem.0.", 1).replace("bn1.", "stem.1.", 1)
    layer, _, leaf = name.rpartition(".")
    if layer in bn_layers:
        leaf = BN[leaf]
    return f"{layer}.{leaf}"


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def check(name: str, batch: int, size: int) -> Dict:
    import torch
    import torchvision

    torch.manual_seed(0)
    theirs = getattr(torchvision.models, name)()
    ours = create_model(name, num_classes=1000)
    bn_layers = {n for n, m in theirs.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    bn_layers = {our_name(n + ".weight", set()).rpartition(".")[0] for n in bn_layers}
    state = {our_name(k, bn_layers): v.detach().numpy() for k, v in theirs.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    own = {p.name: p for p in ours.get_parameters()}
    assert set(state) == set(own), (sorted(set(state) ^ set(own)))[:6]
    for k, v in state.items():
        own[k].set_data(ms.Tensor(v.copy()))
    rng = np.random.RandomState(0)
    x = rng.randn(batch, 3, size, size).astype(np.float32)
    y = rng.randint(0, 1000, batch).astype(np.int64)

    theirs.eval()
    ours.set_train(False)
    with torch.no_grad():
        logits_t = theirs(torch.from_numpy(x)).numpy()
    logits_o = ours(ms.Tensor(x)).asnumpy()

    before = {k: v.copy() for k, v in state.items()}
    floor_model = getattr(torchvision.models, name)()
    floor_model.load_state_dict(theirs.state_dict())
    floor_model = floor_model.double().train()
    opt_64 = torch.optim.SGD(floor_model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    torch.nn.functional.cross_entropy(floor_model(torch.from_numpy(x).double()), torch.from_numpy(y)).backward()
    opt_64.step()
    after_64 = {our_name(k, bn_layers): v.detach().numpy() for k, v in floor_model.state_dict().items()
                if not k.endswith("num_batches_tracked")}
    theirs.train()
    ours.set_train(True)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_t = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(x)), torch.from_numpy(y))
    opt_t.zero_grad()
    loss_t.backward()
    opt_t.step()
    opt_o = nn.Momentum(ours.trainable_params(), learning_rate=0.1, momentum=0.9, weight_decay=1e-4)
    step = nn.TrainOneStepCell(nn.WithLossCell(ours, nn.CrossEntropyLoss()), opt_o)
    step.set_train(True)
    loss_o = float(step(ms.Tensor(x), ms.Tensor(y.astype(np.int32))).asnumpy())
    after = {our_name(k, bn_layers): v.detach().numpy() for k, v in theirs.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    weights = [k for k in after if "moving_" not in k]
    delta_o = np.concatenate([(own[k].asnumpy() - before[k]).ravel() for k in weights])
    delta_t = np.concatenate([(after[k] - before[k]).ravel() for k in weights])
    delta_64 = np.concatenate([(after_64[k] - before[k]).ravel() for k in weights])
    stats = [rel_err(own[k].asnumpy(), v) for k, v in after.items() if "moving_" in k]
    return {"model": name, "parameters": int(sum(p.size for p in ours.trainable_params())),
            "eval_logits_rel_err": rel_err(logits_o, logits_t), "train_loss": [loss_o, float(loss_t.detach())],
            "step_update_rel_err": float(np.linalg.norm(delta_o - delta_t) / np.linalg.norm(delta_t)),
            "torch_fp32_vs_fp64_update_rel_err": float(np.linalg.norm(delta_t - delta_64) / np.linalg.norm(delta_64)),
            "step_weights_max_abs_diff": float(np.abs(delta_o - delta_t).max()),
            "step_running_stats_max_rel_err": max(stats)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet50"])
def test_our_resnet_is_torchvisions(name):
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        r = check(name, batch=2, size=224)
    finally:
        ms.set_context(mode=mode)
    assert r["eval_logits_rel_err"] <= 1e-4, r
    assert abs(r["train_loss"][0] - r["train_loss"][1]) <= 1e-4 * abs(r["train_loss"][1]), r
    assert r["step_update_rel_err"] <= 2 * r["torch_fp32_vs_fp64_update_rel_err"], r
    assert r["step_running_stats_max_rel_err"] <= 1e-3, r
