"""ResNet-34 (CIFAR stem) gradients on two CIFAR-10 batches from the same weights: the zoo's O0 and O2 (fp32 or
bf16 products) against PyTorch's fp32 and bf16 autocast, all against PyTorch in float64 (gradients.txt).

    python grad_parity.py batches DATA              # torch venv: 2 x 128 test images (file order, no augmentation)
    python grad_parity.py torch init|ckpt           # torch venv: fp64, fp32, bf16 autocast; writes the weights too
    python grad_parity.py zoo LEVEL COMPUTE init|ckpt  # the zoo's venv, from the checkout: O0|O2  fp32|bf16
    python grad_parity.py --compare init|ckpt

init: torchvision's ResNet-34 with the zoo's CIFAR stem as bench.torch_cifar10 builds it, seed 1; ckpt: the shipped
weights/resnet34_cifar10_o2.ckpt (fp16 weights, as fp32). Each variant runs in its own process (oneDNN's ISA cap
is per process). BatchNorm in training mode, as in a step; the zoo's O2 loss is scaled by 65536 (its initial
dynamic scale) and the gradients unscaled in float64. The question: is the zoo's bf16 path as close to exact as
PyTorch's own bf16 autocast, at the card's weights and data?"""
import pickle
import sys
from pathlib import Path

import numpy as np

TMP = Path("/tmp/r34grad")
S = 65536.0
BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}


def our_name(torch_name: str, bn_layers: set) -> str:
    """torchvision's parameter name -> the zoo's (as tests/test_torchvision.py)."""
    name = torch_name.replace("downsample.", "down.")
    if name.startswith(("conv1.", "bn1.")):
        name = name.replace("conv1.", "stem.0.", 1).replace("bn1.", "stem.1.", 1)
    layer, _, leaf = name.rpartition(".")
    return f"{layer}.{BN[leaf] if layer in bn_layers else leaf}"


def batches(data: str) -> None:
    from PIL import Image

    from ampzoo.engine.load import load_config
    card = load_config(["recipe=resnet34_cifar10_o2", f"dataset.path={data}"])[0].dataset  # the card, not its smoke
    classes = sorted(p.name for p in (Path(data) / "test").iterdir())
    files = [(f, c) for c, name in enumerate(classes) for f in sorted((Path(data) / "test" / name).glob("*.jpg"))]
    pick = np.random.RandomState(1).permutation(len(files))[:256]
    x = np.stack([np.asarray(Image.open(files[i][0]).convert("RGB"), np.float32) / 255 for i in pick])
    x = ((x - list(card.mean)) / list(card.std)).transpose(0, 3, 1, 2).astype(np.float32)
    y = np.array([files[i][1] for i in pick], np.int32)
    TMP.mkdir(exist_ok=True)
    np.savez(TMP / "batches.npz", x=x, y=y)


def load_batches():
    """The two batches `batches` wrote: images (2, 128, 3, 32, 32) float32, labels (2, 128) int32."""
    data = np.load(TMP / "batches.npz")
    return data["x"].reshape(2, 128, 3, 32, 32), data["y"].reshape(2, 128)


def torch_grads(tag: str) -> None:
    import torch

    from bench.torch_cifar10 import peer_network
    torch.manual_seed(1)
    net = peer_network(10)
    bn_layers = {our_name(n + ".weight", set()).rpartition(".")[0] for n, m in net.named_modules()
                 if isinstance(m, torch.nn.BatchNorm2d)}
    if tag == "ckpt":
        import mindspore as ms
        shipped = ms.load_checkpoint("weights/resnet34_cifar10_o2.ckpt")
        ours = {k: v.asnumpy().astype(np.float32) for k, v in shipped.items()}
        net.load_state_dict({k: torch.from_numpy(ours[our_name(k, bn_layers)]) for k in net.state_dict()
                             if not k.endswith("num_batches_tracked")}, strict=False)
    state = {our_name(k, bn_layers): v.detach().numpy() for k, v in net.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    np.savez(TMP / f"weights_{tag}.npz", **state)
    xs, ys = load_batches()
    ys = ys.astype(np.int64)
    torch.set_num_threads(2)
    for variant in ("fp64", "fp32", "bf16"):
        model = peer_network(10)
        model.load_state_dict(net.state_dict())
        model = model.double() if variant == "fp64" else model
        model.train()
        out = []
        for x, y in zip(xs, ys):
            model.zero_grad()
            x = torch.from_numpy(x).double() if variant == "fp64" else torch.from_numpy(x)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16"):
                loss = torch.nn.functional.cross_entropy(model(x), torch.from_numpy(y))
            loss.backward()
            out.append((float(loss.detach()), {our_name(k, bn_layers): p.grad.double().numpy()
                                      for k, p in model.named_parameters()}))
        with open(TMP / f"torch_{variant}_{tag}.pkl", "wb") as f:
            pickle.dump(out, f)


def zoo_grads(level: str, compute: str, tag: str) -> None:
    import mindspore as ms
    from omegaconf import OmegaConf

    from ampzoo.amp.policy import apply_policy
    from ampzoo.engine.load import load_config
    from ampzoo.engine.metrics import NetWithLoss, create_loss
    from ampzoo.engine.network import build_model, set_cpu_compute
    from ampzoo.runtime import set_context

    cfg, _ = load_config(["recipe=resnet34_cifar10_o2", f"runtime.cpu_compute={compute}"])
    set_context(cfg.runtime)
    set_cpu_compute(compute, training=True)
    net = build_model(cfg)
    weights = np.load(TMP / f"weights_{tag}.npz")
    own = {p.name: p for p in net.get_parameters()}
    assert set(weights.files) == set(own), sorted(set(weights.files) ^ set(own))[:6]
    for k in weights.files:
        own[k].set_data(ms.Tensor(weights[k].astype(np.float32)))
    net, _ = apply_policy(net, OmegaConf.merge(cfg.amp, {"level": level}))
    net.set_train(True)
    loss_net = NetWithLoss(net, create_loss(cfg.trainer))
    params = ms.ParameterTuple(net.trainable_params())
    scale = S if level != "O0" else 1.0

    class Scaled(ms.nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = loss_net

        def construct(self, x, y):
            return self.net(x, y) * scale

    class Step(ms.nn.Cell):  # one forward and its backward, compiled as a train step is
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.grad = ms.value_and_grad(Scaled(), None, params)

        def construct(self, x, y):
            return self.grad(x, y)

    grad = Step()
    out = []
    for x, y in zip(*load_batches()):
        loss, grads = grad(ms.Tensor(x), ms.Tensor(y))
        out.append((float(loss.asnumpy()) / scale,
                    {p.name: g.asnumpy().astype(np.float64) / scale for p, g in zip(params, grads)}))
    with open(TMP / f"zoo_{level}_{compute}_{tag}.pkl", "wb") as f:
        pickle.dump(out, f)


def compare(tag: str) -> None:
    ref = pickle.load(open(TMP / f"torch_fp64_{tag}.pkl", "rb"))
    names = ["torch_fp32", "torch_bf16", "zoo_O0_fp32", "zoo_O2_fp32", "zoo_O2_bf16"]
    print(f"# {tag}: each against PyTorch fp64 on the same weights and batches (||g - g64|| / ||g64||, all "
          "parameters together; median over tensors; the three tensors furthest off)")
    for name in names:
        path = TMP / f"{name}_{tag}.pkl"
        if not path.is_file():
            continue
        res = pickle.load(open(path, "rb"))
        for i, ((la, ga), (lb, gb)) in enumerate(zip(res, ref)):
            errs = sorted(((np.linalg.norm(ga[k] - gb[k]) / max(np.linalg.norm(gb[k]), 1e-30), k) for k in gb),
                          reverse=True)
            total = (np.sqrt(sum(np.sum((ga[k] - gb[k]) ** 2) for k in gb))
                     / np.sqrt(sum(np.sum(gb[k] ** 2) for k in gb)))
            print(f"{name:12s} batch {i}: loss {la:.6f} (fp64 {lb:.6f}); total {total:.2e}; median "
                  f"{np.median([e for e, _ in errs]):.2e}; top: "
                  + ", ".join(f"{k} {e:.2e}" for e, k in errs[:3]))


if __name__ == "__main__":
    sys.path.insert(0, ".")  # run from the checkout's root: the zoo's packages and bench/
    what = sys.argv[1]
    if what == "batches":
        batches(sys.argv[2])
    elif what == "torch":
        torch_grads(sys.argv[2])
    elif what == "zoo":
        zoo_grads(*sys.argv[2:5])
    else:
        compare(sys.argv[2])
