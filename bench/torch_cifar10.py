"""The PyTorch peer of the ResNet-34 CIFAR-10 card (bench-only: PyTorch and torchvision are not in the zoo's
install): the same network, data files, augmentation and schedule, trained with PyTorch, its test top-1 per epoch
beside our runs' in docs/benchmarks.md. It is the parity reference of resnet34_cifar10_o0 / _o2.

    pip install torch torchvision   # CPU wheels, about 5.5 GB with their dependencies
    python -m bench.torch_cifar10 OUT_DIR dataset.path=/data/cifar10 [--precision bf16|fp32] [--threads N]

From the recipe (`recipe=resnet34_cifar10_o2`, any key of it can be given):
- network: torchvision's resnet34 with the CIFAR stem as the zoo builds it (a 3x3/1 first convolution, no
  max-pool), `model.num_classes` classes; PyTorch's own initialisation (Kaiming normal, as torchvision's);
- data: the same folders (`train/<class>/`, `test/<class>/`, torchvision's ImageFolder: classes sorted, as ours),
  pad 4 + random 32x32 crop and a horizontal flip, the recipe's mean and std; each epoch's order is the zoo's
  (ampzoo.data.sampling.epoch_order with runtime.seed), the last partial batch dropped, as ours;
- optimization: SGD momentum (Nesterov as the recipe says), the recipe's learning rate at its batch
  (ampzoo.engine.optim.scaled_lr) on the zoo's schedule for every step (ampzoo.engine.optim.lr_schedule: linear
  warm-up, then cosine), weight decay on weights only when optimizer.decay_norm_and_bias is false, label smoothing
  from trainer.label_smoothing;
- precision: bf16 autocast (PyTorch's mixed precision on a CPU, the default) or fp32.
Writes OUT_DIR/curve.json (test top-1 and loss after each epoch, train time) and OUT_DIR/last.pt after each epoch:
resumable (the same command continues at the next epoch). Speed is not what it is for: bench.speed compares
steps side by side.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import time
from pathlib import Path

from ampzoo.cli import pop_option
from ampzoo.data.sampling import epoch_order
from ampzoo.engine.optim import lr_schedule, scaled_lr
from ampzoo.errors import fail
from bench.common import bench_config


def peer_network(num_classes: int):
    """torchvision's ResNet-34 with the zoo's CIFAR stem (ampzoo/models/resnet.py, stem=cifar)."""
    import torch.nn as tnn
    from torchvision.models import resnet34
    net = resnet34(num_classes=num_classes)
    net.conv1 = tnn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    tnn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
    net.maxpool = tnn.Identity()
    return net


def loaders(cfg):
    """(train set, test loader): the recipe's folders and transforms."""
    import torch
    from torchvision import datasets, transforms as T
    root = Path(cfg.dataset.path).expanduser()
    norm = T.Normalize(list(cfg.dataset.mean), list(cfg.dataset.std))
    train = datasets.ImageFolder(str(root / "train"), T.Compose([T.RandomCrop(32, padding=4),
                                                                  T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = datasets.ImageFolder(str(root / (cfg.dataset.eval_split or "test")), T.Compose([T.ToTensor(), norm]))
    return train, torch.utils.data.DataLoader(test, batch_size=cfg.dataset.eval_batch_size, num_workers=2)


def optimizer(net, cfg, lr: float):
    import torch
    o = cfg.optimizer
    decay = [p for n, p in net.named_parameters() if p.dim() > 1 or o.decay_norm_and_bias]
    rest = [p for n, p in net.named_parameters() if not (p.dim() > 1 or o.decay_norm_and_bias)]
    return torch.optim.SGD([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0}],
                           lr=lr, momentum=o.momentum, nesterov=o.nesterov)


def evaluate(net, test, autocast) -> dict:
    import torch
    net.eval()
    right, loss, n = 0, 0.0, 0
    with torch.no_grad(), autocast():
        for x, y in test:
            out = net(x).float()
            loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
            right += int((out.argmax(1) == y).sum())
            n += len(y)
    net.train()
    return {"top1": round(100 * right / n, 2), "loss": round(loss / n, 4)}


def main(argv) -> dict:
    precision, argv = pop_option(argv, "--precision", "bf16", str)
    threads, argv = pop_option(argv, "--threads", 0, int)
    if not argv or "=" in argv[0]:
        fail("give the output folder first: python -m bench.torch_cifar10 OUT_DIR dataset.path=DIR")
    if precision not in ("bf16", "fp32"):
        fail(f"--precision {precision} is not valid; valid: bf16, fp32")
    out, argv = Path(argv[0]), argv[1:]
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed: pip install torch torchvision (bench-only, not in the zoo's install)")
    cfg = bench_config(["recipe=resnet34_cifar10_o2", *argv], smoke=False)
    if cfg.dataset.path is None:
        fail("give dataset.path=DIR: the CIFAR-10 folder (train/<class>/, test/<class>/)")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.runtime.seed)
    out.mkdir(parents=True, exist_ok=True)
    train, test = loaders(cfg)
    batch, steps = cfg.dataset.batch_size, len(train) // cfg.dataset.batch_size
    lr = lr_schedule(cfg.schedule, scaled_lr(cfg.optimizer, batch), steps, cfg.trainer.epochs)
    net, curve_file, ckpt = peer_network(cfg.model.num_classes), out / "curve.json", out / "last.pt"
    opt = optimizer(net, cfg, float(lr[0]))
    curve = json.loads(curve_file.read_text()) if curve_file.is_file() else {}
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.trainer.label_smoothing)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    for epoch in range(len(curve), cfg.trainer.epochs):
        order = epoch_order(len(train), cfg.runtime.seed, epoch)[: steps * batch].reshape(steps, batch)
        t0 = time.perf_counter()
        for i, idx in enumerate(order):
            x, y = zip(*(train[int(j)] for j in idx))
            for group in opt.param_groups:
                group["lr"] = float(lr[epoch * steps + i])
            with autocast():
                loss = loss_fn(net(torch.stack(x)).float(), torch.tensor(y))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        record = {"step": (epoch + 1) * steps, "train_s": round(time.perf_counter() - t0, 1), "last_loss":
                  round(float(loss), 4), **evaluate(net, test, autocast)}
        curve[str(epoch + 1)] = record
        torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, ckpt)
        curve_file.write_text(json.dumps({**curve}, indent=2))
        print(f"epoch {epoch + 1}: test top-1 {record['top1']:.2f}, loss {record['loss']:.4f} "
              f"({record['train_s']:.0f} s, {precision})", flush=True)
    return curve


if __name__ == "__main__":
    run(main)
