"""The PyTorch peer of the ResNet-34 CIFAR-10 card: the same network, data files, augmentation and schedule trained
with PyTorch, its test top-1 beside our runs' in docs/benchmarks.md. The parity reference of resnet34_cifar10_o0
(fp32) and, with --amp bf16, of _o2 (PyTorch's own mixed precision on a CPU: bf16 autocast).

    python -m bench.torch_cifar10 --data /data/cifar10 --out DIR [--epochs N] [--seed 1] [--threads N]
                                  [--amp fp32|bf16] [--resume auto|off] [--limit-steps K]
                                  [--limit-eval-batches K] [key=value ...]

PyTorch and torchvision are bench-only: a venv of their own with the zoo's runtime beside them
(bench/requirements-torch.txt says how), run from the checkout.

Everything is read from the card (conf/card/resnet34_cifar10.yaml through the recipe; a key=value overrides any
of it, --epochs is trainer.epochs, --seed runtime.seed):
- network: torchvision's resnet34 with the zoo's CIFAR stem (ampzoo/models/resnet.py, model.params.stem=cifar: a
  3x3/1 first convolution, no max-pool), initialised as ours (He normal fan-out convolutions, BatchNorm 1 and 0,
  model.params.zero_init_residual, the classifier He uniform a=sqrt(5) with a U(+-1/sqrt(512)) bias); PyTorch's
  own random numbers;
- data: train/<class>/ and test/<class>/ of --data (dataset.eval_split names another evaluated folder), classes
  sorted, decoded to RGB; pad 4 and a random 32x32 crop, then a horizontal flip; dataset.mean / std
  (ampzoo/data/images.py). Each epoch takes the zoo's order of the files (ampzoo.data.sampling.epoch_order with
  runtime.seed) in dataset.batch_size batches, the last partial batch dropped; the test split in file order,
  dataset.eval_batch_size at a time;
- optimization: SGD with optimizer.momentum (Nesterov per optimizer.nesterov) at the zoo's learning rate for every
  step (ampzoo.engine.optim: scaled_lr, lr_schedule: linear warm-up over schedule.warmup_epochs, then cosine to
  schedule.min_lr), optimizer.weight_decay on convolution and classifier weights only while
  optimizer.decay_norm_and_bias is false (ampzoo.engine.optim.param_groups), cross-entropy with
  trainer.label_smoothing, trainer.epochs;
- precision: fp32, or --amp bf16 (torch.autocast on the CPU, bfloat16).

Writes into --out, each epoch: a line of eval_history.jsonl (epoch; step, the updates so far; top1, top5 as
fractions and loss on the test split, as our runs' eval_history.jsonl; seconds, the epoch's training; eval_seconds;
time_s, the run's so far), last.pt (network, optimizer, position, random states) and progress.log lines;
config.json holds the run's settings and each session's PyTorch, CPU and threads. A stopped run
(Ctrl-C, SIGTERM) finishes its step, saves last.pt and exits 130 / 143; the same command continues where it stopped,
in the same order of images and random draws (--resume off refuses a folder that holds a run). --limit-steps and
--limit-eval-batches make a smoke run: at most K steps an epoch (the schedule stays the whole run's), K test
batches.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
import logging
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ampzoo import interrupt
from ampzoo.cli import pop_option
from ampzoo.data.sampling import epoch_order
from ampzoo.engine.optim import lr_schedule, scaled_lr
from ampzoo.errors import fail
from ampzoo.machine import machine
from ampzoo.runtime import cpu_info
from bench.common import bench_config

try:  # bench-only: not in the zoo's install (bench/requirements-torch.txt)
    import torch
    import torchvision
    from torch import nn
    from torchvision import datasets, transforms as T
except ImportError:
    fail("PyTorch is not installed: pip install torch torchvision (bench-only, not in the zoo's install)")

RECIPES = {"fp32": "resnet34_cifar10_o0", "bf16": "resnet34_cifar10_o2"}  # the zoo's row each peer stands beside
LOG_EVERY = 50  # steps between progress lines (an epoch of the card is 390)
CHECKPOINT = "last.pt"


def peer_network(num_classes: int, zero_init_residual: bool = False) -> nn.Module:
    """torchvision's ResNet-34 with the zoo's CIFAR stem. torchvision initialises as ampzoo/models/resnet.py does
    (He normal fan-out convolutions, BatchNorm weight 1 and bias 0, each block's last BatchNorm at 0 with
    zero_init_residual, the classifier nn.Linear's default: our HeUniform(sqrt(5)) and Uniform(1/sqrt(512)))."""
    net = torchvision.models.resnet34(num_classes=num_classes, zero_init_residual=zero_init_residual)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net


def options(argv) -> SimpleNamespace:
    """The command line: its options, and the rest as the card's overrides (key=value)."""
    opts = {}
    for name, default, convert in (("--data", None, Path), ("--out", None, Path), ("--epochs", None, int),
                                   ("--seed", None, int), ("--threads", len(os.sched_getaffinity(0)), int),
                                   ("--amp", "fp32", str), ("--resume", "auto", str), ("--limit-steps", 0, int),
                                   ("--limit-eval-batches", 0, int)):
        opts[name[2:].replace("-", "_")], argv = pop_option(argv, name, default, convert)
    opts = SimpleNamespace(**opts, overrides=argv)
    if opts.data is None or opts.out is None:
        fail("give --data DIR (train/<class>/ and test/<class>/ of CIFAR-10's images) and --out DIR (this run's "
             "folder): python -m bench.torch_cifar10 --data /data/cifar10 --out DIR")
    for value, valid, name in ((opts.amp, RECIPES, "--amp"), (opts.resume, ("auto", "off"), "--resume")):
        if value not in valid:
            fail(f"{name} {value} is not valid; valid: {', '.join(valid)}")
    for name in ("epochs", "threads", "limit_steps", "limit_eval_batches"):
        value = getattr(opts, name)
        if value is not None and value < (0 if name.startswith("limit") else 1):
            fail(f"--{name.replace('_', '-')} {value} is not valid: "
                 f"{'0 (no limit) or more' if name.startswith('limit') else 'at least 1'}")
    stray = [a for a in argv if "=" not in a]
    if stray:
        fail(f"{stray[0]!r} is not an option of bench.torch_cifar10 nor a key=value of the card; see --help")
    return opts


def card(opts):
    """The card as the zoo composes it (recipe, then --epochs, --seed, --data and the overrides)."""
    keys = [f"recipe={RECIPES[opts.amp]}", f"dataset.path={opts.data}"]
    keys += [f"trainer.epochs={opts.epochs}"] * (opts.epochs is not None)
    keys += [f"runtime.seed={opts.seed}"] * (opts.seed is not None)
    return bench_config([*keys, *opts.overrides], smoke=False)


def image_folders(data_cfg):
    """(train set, test set): torchvision's ImageFolder with the zoo's transforms (ampzoo/data/images.py: pad 4 and
    random crop, flip, then the mean and std). Its file order is MindSpore's ImageFolderDataset's (classes sorted,
    then files), so the zoo's epoch order picks the same images."""
    root = Path(data_cfg.path).expanduser()
    name = data_cfg.eval_split or "test"
    for split in ("train", name):
        if not (root / split).is_dir():
            fail(f"--data {root} has no {split}/ folder; the peer reads the image folder (train/<class>/*.jpg, "
                 f"{name}/<class>/*.jpg), not CIFAR-10's binary batches")
    norm = T.Normalize(list(data_cfg.mean), list(data_cfg.std))
    train = datasets.ImageFolder(str(root / "train"), T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = datasets.ImageFolder(str(root / name), T.Compose([T.ToTensor(), norm]))
    if test.classes != train.classes:  # each ImageFolder labels its own sub-folders: they must be the same
        fail(f"{root / name} has classes {test.classes}, {root / 'train'} has {train.classes}: they must be the same")
    return train, test


def run_settings(cfg, opts, train, test) -> dict:
    """What this run trains with, every value from the card: the same on every resume."""
    d, o, s = cfg.dataset, cfg.optimizer, cfg.schedule
    steps = len(train) // d.batch_size
    return {
        "peer_of": RECIPES[opts.amp], "card": "conf/card/resnet34_cifar10.yaml", "overrides": opts.overrides,
        "data_path": str(Path(d.path).expanduser().resolve()),  # may move between sessions; the rest may not
        "model": {"network": "torchvision resnet34, conv1 3x3/1 pad 1, no max-pool", "stem": cfg.model.params.stem,
                  "num_classes": cfg.model.num_classes,
                  "zero_init_residual": bool(cfg.model.params.get("zero_init_residual", False))},
        "data": {"train_images": len(train),
                 "test_images": len(test), "test_split": d.eval_split or "test", "classes": train.classes,
                 "mean": list(d.mean), "std": list(d.std),
                 "train_transform": "RandomCrop(32, padding=4, fill 0), RandomHorizontalFlip(0.5), ToTensor, Normalize",
                 "order": "ampzoo.data.sampling.epoch_order(train_images, seed, epoch), last partial batch dropped",
                 "batch_size": d.batch_size, "eval_batch_size": d.eval_batch_size},
        "optimizer": {"name": "SGD", "lr": scaled_lr(o, d.batch_size), "momentum": o.momentum,
                      "nesterov": bool(o.nesterov), "weight_decay": o.weight_decay,
                      "decay_norm_and_bias": bool(o.decay_norm_and_bias)},
        "schedule": {"name": str(s.name), "warmup_epochs": s.warmup_epochs, "warmup_steps": s.warmup_steps,
                     "min_lr": s.min_lr, "per": "step (ampzoo.engine.optim.lr_schedule)"},
        "label_smoothing": cfg.trainer.label_smoothing, "epochs": cfg.trainer.epochs, "steps_per_epoch": steps,
        "seed": cfg.runtime.seed, "amp": opts.amp, "limit_steps": opts.limit_steps,
    }


def sgd(net, settings) -> torch.optim.SGD:
    """The zoo's Momentum: weight decay on the weights alone unless decay_norm_and_bias. Here the 1-D parameters are
    BatchNorm's weight and bias and the classifier's bias, the ones ampzoo.engine.optim.NO_DECAY_MARKERS names."""
    o = settings["optimizer"]
    params = list(net.parameters())
    decay = [p for p in params if p.dim() > 1 or o["decay_norm_and_bias"]]
    rest = [p for p in params if not (p.dim() > 1 or o["decay_norm_and_bias"])]
    return torch.optim.SGD([{"params": decay, "weight_decay": o["weight_decay"]}, {"params": rest, "weight_decay": 0}],
                           lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"])


def progress_log(path: Path) -> logging.Logger:
    """progress.log (and the console), its lines as our runs' train.log writes them."""
    log = logging.getLogger("bench.torch_cifar10")
    log.setLevel(logging.INFO)
    log.propagate = False
    form = logging.Formatter("[%(asctime)s] %(message)s")
    for handler in (logging.FileHandler(path), logging.StreamHandler(sys.stdout)):
        handler.setFormatter(form)
        log.addHandler(handler)
    return log


def flat(settings: dict, prefix: str = "") -> dict:
    """{"schedule.updates": 7800, ...}: the settings by their dotted names."""
    out = {}
    for k, v in settings.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def start(out: Path, resume: str, settings: dict, net, opt) -> dict:
    """The run's position: a new one, or the one last.pt saved (network, optimizer and random states restored).
    eval_history.jsonl keeps the epochs the checkpoint has seen evaluated."""
    ckpt, history = out / CHECKPOINT, out / "eval_history.jsonl"
    pos = {"epoch": 0, "batch": 0, "step": 0, "epoch_s": 0.0, "epoch_loss": 0.0, "time_s": 0.0}
    if ckpt.is_file():
        if resume == "off":
            fail(f"{ckpt} holds a run: --resume auto continues it, or give another --out")
        state = torch.load(ckpt, weights_only=False)  # our own file: numpy's and Python's random states in it
        was, now = flat(state["settings"]), flat(settings)
        changed = [k for k in {**was, **now} if was.get(k) != now.get(k) and k != "data_path"]
        if changed:
            what = "; ".join(f"{k}: {was.get(k)} there, {now.get(k)} now" for k in changed)
            fail(f"{out} holds a run of other settings ({what}): give another --out, or the settings it was started "
                 f"with")
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        pos = state["position"]
    lines = history.read_text().splitlines() if history.is_file() else []
    kept = [ln for ln in lines if ln.strip() and json.loads(ln)["epoch"] <= pos["epoch"]]
    history.write_text("".join(ln + "\n" for ln in kept))  # a line written after the last save is evaluated again
    return pos


def save(out: Path, net, opt, pos: dict, settings: dict) -> None:
    """last.pt, replaced whole (a stop while writing leaves the previous one)."""
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "position": dict(pos), "settings": settings,
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / CHECKPOINT)


def write_config(out: Path, settings: dict, opts, pos: dict) -> None:
    """config.json: the run's settings, and each session's PyTorch, machine and threads."""
    path = out / "config.json"
    resumed = path.is_file() and (out / CHECKPOINT).is_file()
    sessions = json.loads(path.read_text())["sessions"] if resumed else []
    mach = machine()  # CPU model, family and vector ISA from /proc/cpuinfo, cores, memory, Python
    sessions.append({"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
                     "from": {k: pos[k] for k in ("epoch", "batch", "step")}, "threads": torch.get_num_threads(),
                     "num_workers": 0, "limit_eval_batches": opts.limit_eval_batches, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "cpu": mach["cpu"], "cpu_family": mach["family"],
                     "isa": mach["isa"], "cores": mach["cores"], "memory_gb": mach["memory_gb"],
                     "python": mach["python"]})
    path.write_text(json.dumps({"settings": settings, "sessions": sessions}, indent=2) + "\n")


def train_epoch(net, opt, loss_fn, train, lr, pos: dict, settings: dict, autocast, log) -> None:
    """The rest of epoch pos["epoch"], one step at a time; each step finishes before a stop signal is taken, with
    pos saying what has been trained."""
    batch, steps = settings["data"]["batch_size"], settings["steps_per_epoch"]
    last = min(steps, settings["limit_steps"] or steps)
    order = epoch_order(len(train), settings["seed"], pos["epoch"])[pos["batch"] * batch: last * batch]
    # num_workers=0: a batch of 128 32x32 JPEGs decodes and augments in ~30 ms against a step of seconds, so a
    # worker would only take a core from the step's threads; and the augmentation's draws then come from this
    # process's torch generator, which last.pt saves, so a resumed run draws what the uninterrupted one drew. The
    # loader's own generator keeps its per-iterator seed draw off that one.
    loader = torch.utils.data.DataLoader(train, batch_size=batch, sampler=order.tolist(), num_workers=0,
                                         drop_last=True, generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for x, y in loader:
        with interrupt.deferred():
            for group in opt.param_groups:
                group["lr"] = float(lr[pos["epoch"] * steps + pos["batch"]])
            with autocast():
                loss = loss_fn(net(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            now, value = time.perf_counter(), loss.item()
            pos["batch"] += 1
            pos["step"] += 1
            pos["epoch_loss"] += value
            pos["epoch_s"] += now - t0
            pos["time_s"] += now - t0
            t0 = now
        if pos["batch"] % LOG_EVERY == 0:
            log.info(f"epoch {pos['epoch'] + 1} step {pos['step']}: loss {value:.4f}, "
                     f"lr {opt.param_groups[0]['lr']:.5g}, {pos['epoch_s'] / pos['batch']:.2f} s a step so far")


def evaluate(net, test, loss_fn, eval_batch: int, limit: int, autocast) -> dict:
    """Top-1, top-5 (fractions) and the mean loss over the test split in file order (the first `limit` batches)."""
    loader = torch.utils.data.DataLoader(test, batch_size=eval_batch, shuffle=False, num_workers=0,
                                         generator=torch.Generator())  # its seed draw not from the augmentation's
    net.eval()
    n, top1, top5, loss = 0, 0, 0, 0.0
    with torch.no_grad(), autocast():
        for b, (x, y) in enumerate(loader):
            if limit and b == limit:
                break
            out = net(x).float()
            best = out.topk(min(5, out.shape[1]), 1).indices
            top1 += int((best[:, 0] == y).sum())
            top5 += int((best == y[:, None]).any(1).sum())
            loss += float(loss_fn(out, y)) * len(y)
            n += len(y)
    net.train()
    return {"top1": top1 / n, "top5": top5 / n, "loss": loss / n, "images": n}


def finish_epoch(out, net, opt, loss_fn, test, pos, settings, opts, autocast, log) -> None:
    """The epoch's evaluation, its eval_history.jsonl line, then last.pt at the next epoch's start."""
    epochs, trained = settings["epochs"], pos["batch"]
    log.info(f"epoch {pos['epoch'] + 1}/{epochs}: step {pos['step']}, loss {pos['epoch_loss'] / max(1, trained):.4f} "
             f"(mean), {trained} steps in {pos['epoch_s']:.1f} s, "
             f"{trained * settings['data']['batch_size'] / max(pos['epoch_s'], 1e-9):.0f} samples/s")
    t0 = time.perf_counter()
    result = evaluate(net, test, loss_fn, settings["data"]["eval_batch_size"], opts.limit_eval_batches, autocast)
    eval_s = time.perf_counter() - t0
    with interrupt.deferred():  # the line and the checkpoint together
        pos["time_s"] += eval_s
        record = {"epoch": pos["epoch"] + 1, "step": pos["step"], **result, "seconds": round(pos["epoch_s"], 1),
                  "eval_seconds": round(eval_s, 1), "time_s": round(pos["time_s"], 1)}
        with open(out / "eval_history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        pos.update(epoch=pos["epoch"] + 1, batch=0, epoch_s=0.0, epoch_loss=0.0)
        save(out, net, opt, pos, settings)
    log.info(f"eval epoch {record['epoch']} step {record['step']}: top1={result['top1']:.4f}, "
             f"top5={result['top5']:.4f}, loss={result['loss']:.4f} ({result['images']:,} images, {eval_s:.0f} s)")


def main(argv) -> None:
    opts = options(argv)
    torch.set_num_threads(opts.threads)
    cfg = card(opts)
    train, test = image_folders(cfg.dataset)
    settings = run_settings(cfg, opts, train, test)
    torch.manual_seed(settings["seed"])  # the initialisation and the augmentation's draws
    net = peer_network(settings["model"]["num_classes"], settings["model"]["zero_init_residual"])
    opt = sgd(net, settings)
    lr = lr_schedule(cfg.schedule, settings["optimizer"]["lr"], settings["steps_per_epoch"], settings["epochs"])
    settings["schedule"].update(updates=len(lr), lr_first=float(lr[0]), lr_max=float(lr.max()), lr_last=float(lr[-1]))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=settings["label_smoothing"])

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if opts.amp == "bf16" else nullcontext()

    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    pos = start(out, opts.resume, settings, net, opt)
    write_config(out, settings, opts, pos)
    log = progress_log(out / "progress.log")
    epochs, steps = settings["epochs"], settings["steps_per_epoch"]
    if pos["epoch"] < epochs:
        log.info(f"{'resume at' if pos['step'] else 'start:'} epoch {pos['epoch'] + 1}/{epochs}, step {pos['step']} "
                 f"(batch {pos['batch']} of {steps}): PyTorch {torch.__version__} peer of {settings['peer_of']} "
                 f"({opts.amp}), threads {torch.get_num_threads()}")
    if opts.amp == "bf16" and not {"avx512_bf16", "amx_bf16"} & set(cpu_info()[1]):
        log.info("note: this CPU has neither AVX512-BF16 nor AMX: bf16 autocast runs emulated, far slower than fp32")
    net.train()
    try:
        while pos["epoch"] < epochs:
            train_epoch(net, opt, loss_fn, train, lr, pos, settings, autocast, log)
            finish_epoch(out, net, opt, loss_fn, test, pos, settings, opts, autocast, log)
    except interrupt.Interrupted as stop:
        try:
            with interrupt.deferred():
                save(out, net, opt, pos, settings)
        except interrupt.Interrupted:  # a second signal while saving: the save finished first
            pass
        note = (f"{out / CHECKPOINT} holds epoch {pos['epoch'] + 1}, step {pos['step']} (batch {pos['batch']} of "
                f"{steps}); the same command continues there")
        log.info(f"interrupted by {stop.name}: {note}")
        raise interrupt.Interrupted(stop.signum, note) from None
    log.info(f"finished: {epochs} epochs, step {pos['step']}, {pos['time_s']:.0f} s; {out / 'eval_history.jsonl'}")


if __name__ == "__main__":
    run(main)
